"""Held-out evaluation, for RL and SFT alike: greedy pass@1, sampled pass@k, completion
length, per-verifier rewards.

    metrics = evaluate(sampler, params, batches, scorer, correct_label="gsm8k", pass_k=8,
                       temperature=1.0, step=step)

A sample is *correct* when the raw score of the deciding verifier (`eval.correct_reward`,
default the first reward term) is above 0.5 (`is_correct`; the built-in answer checkers
return 1 or 0). pass@k is the fraction of prompts with at least one correct sample among
k drawn at `eval.temperature` (with n = k samples the unbiased estimator of Chen et al.
2021 reduces to exactly this).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm import sampling

EVAL_KEY_OFFSET = 1 << 30  # eval draws use a key stream disjoint from training's
CORRECT_ABOVE = 0.5


def is_correct(scores) -> np.ndarray:
    """The one definition of a correct answer: the deciding verifier's raw score > 0.5."""
    return np.asarray(scores, np.float64) > CORRECT_ABOVE


def fixed_batches(data_iter, num_prompts: int) -> list:
    """The first ceil(num_prompts / batch) batches of an (unshuffled) iterator, kept.

    With several processes each holds its share of every batch: the count is global."""
    batches, seen = [], 0
    for batch in data_iter:
        batches.append(batch)
        seen += len(batch.examples) * jax.process_count()
        if seen >= num_prompts:
            break
    if not batches:
        raise ValueError("eval: the evaluation split yielded no prompts")
    return batches


def held_out_batches(config, tokenizer, batch_size: int) -> list:
    """The fixed evaluation batches of a run config: the first `eval.num_prompts` prompts
    of `eval.split` (or the JSONL file `eval.path`), unshuffled, one epoch, built like the
    training prompts (`data`), this process's share of each batch."""
    import ml_collections

    from jaxrl_llm import data

    eval_data = ml_collections.ConfigDict(config.data.to_dict())
    eval_data.split, eval_data.shuffle, eval_data.num_epochs = config.eval.split, False, 1
    eval_data.path = config.eval.path or config.data.path
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
    it = data.make_iterator(eval_data, tokenizer, batch_size, **hosts)
    return fixed_batches(it, config.eval.num_prompts)


def _scores(details, label: str) -> np.ndarray:
    return np.asarray(details.per_verifier[label], np.float64)


def _score(sampler, params, batch, scorer, spec, step):
    """Samples `spec` for one batch -> (ScoreDetails, lengths, finish)."""
    out = sampler.sample(params, batch.prompt_ids, batch.prompt_mask, spec, step)
    texts, lengths, finish = scorer.decode(out)
    examples = [ex for ex in batch.examples for _ in range(spec.num_generations)]
    _, details = scorer.pool.score(scorer.specs, texts, examples, num_tokens=lengths.tolist())
    return details, lengths, finish


def specs(spec, pass_k: int, temperature: float):
    """(greedy, sampled) rollout specs of an evaluation: one greedy sample per prompt, and
    pass_k samples at `temperature` (None when pass_k == 1)."""
    greedy = spec.replace(num_generations=1, temperature=0.0)
    sampled = spec.replace(num_generations=pass_k, temperature=temperature)
    return greedy, sampled if pass_k > 1 else None


def evaluate(
    sampler,
    params,
    batches,
    scorer,
    *,
    correct_label: str,
    pass_k: int,
    temperature: float,
    step: int = 0,
) -> dict[str, float]:
    """Metrics `eval/*` over the fixed evaluation batches.

    sampler: a `sampling.Sampler`; scorer: a `scoring.Scorer` (its spec gives the budget
    and stop ids; greedy and sampled draws replace G and the temperature)."""
    greedy, sampled = specs(scorer.spec, pass_k, temperature)
    correct1, correct_k, lengths, truncated, per_label = [], [], [], [], {}
    for i, batch in enumerate(batches):
        details, n, finish = _score(sampler, params, batch, scorer, greedy, step=i)
        correct1.append(is_correct(_scores(details, correct_label)))
        lengths.append(n)
        truncated.append(finish == sampling.FINISH_LENGTH)
        for label in details.per_verifier:
            per_label.setdefault(label, []).append(_scores(details, label))
        if pass_k > 1:
            key = EVAL_KEY_OFFSET + step * len(batches) + i
            details, _, _ = _score(sampler, params, batch, scorer, sampled, step=key)
            hit = is_correct(_scores(details, correct_label))
            correct_k.append(hit.reshape(-1, pass_k).any(axis=1))
    metrics = {
        "eval/pass@1": float(np.concatenate(correct1).mean()),
        "eval/length_mean": float(np.concatenate(lengths).mean()),
        "eval/truncated_frac": float(np.concatenate(truncated).mean()),
        "eval/num_prompts": float(sum(len(c) for c in correct1)),
    }
    if correct_k:
        metrics[f"eval/pass@{pass_k}"] = float(np.concatenate(correct_k).mean())
    for label, values in per_label.items():
        metrics[f"eval/reward/{label}"] = float(np.concatenate(values).mean())
    return metrics

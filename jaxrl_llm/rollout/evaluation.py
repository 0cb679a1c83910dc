"""Held-out evaluation, for RL and SFT alike, and for every player: one loop (`run`) of
greedy pass@1, sampled pass@k and per-row means over the held-out batches, around a
`play(batch, spec, key) -> (scores, per-row values)` of the player's own: the sampler and the
verifiers here (`evaluate`), whole trajectories (`EnvRollout.evaluate`), agent episodes
(`AgentRollout.evaluate`).

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


def specs(spec, pass_k: int, temperature: float):
    """(greedy, sampled) rollout specs of an evaluation: one greedy sample per prompt, and
    pass_k samples at `temperature` (None when pass_k == 1)."""
    greedy = spec.replace(num_generations=1, temperature=0.0)
    sampled = spec.replace(num_generations=pass_k, temperature=temperature)
    return greedy, sampled if pass_k > 1 else None


def run(play, batches, spec, *, pass_k: int, temperature: float, step: int) -> dict[str, float]:
    """`eval/*` over the held-out batches. play(batch, spec, key) -> (scores, values): a
    score per drawn row (a prompt's rows in a run), what decides correctness
    (`is_correct`), and {name: a value per row}. Batch i is drawn greedily (key i): its
    rows give `eval/pass@1` and each `eval/<name>` (the mean over every batch's rows);
    then, with pass_k > 1, pass_k rows per prompt at `temperature` (key EVAL_KEY_OFFSET +
    step * len(batches) + i) give `eval/pass@k`: prompts with a correct row among k."""
    greedy, sampled = specs(spec, pass_k, temperature)
    correct1, correct_k, values = [], [], {}
    for i, batch in enumerate(batches):
        scores, rows = play(batch, greedy, i)
        correct1.append(is_correct(scores))
        for name, v in rows.items():
            values.setdefault(name, []).append(np.asarray(v, np.float64))
        if sampled is not None:
            scores, _ = play(batch, sampled, EVAL_KEY_OFFSET + step * len(batches) + i)
            correct_k.append(is_correct(scores).reshape(-1, pass_k).any(axis=1))
    correct1 = np.concatenate(correct1)
    out = {"eval/pass@1": float(correct1.mean()), "eval/num_prompts": float(len(correct1))}
    if correct_k:
        out[f"eval/pass@{pass_k}"] = float(np.concatenate(correct_k).mean())
    return out | {f"eval/{name}": float(np.concatenate(v).mean()) for name, v in values.items()}


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
    """`eval/*` of single-turn samples (`run`): pass@1, pass@k, `length_mean`,
    `truncated_frac` and each verifier's mean (`reward/<label>`).

    sampler: a `sampling.Sampler`; scorer: a `scoring.Scorer` (its spec gives the budget
    and stop ids; greedy and sampled draws replace G and the temperature)."""

    def play(batch, spec, key):
        out = sampler.sample(params, batch.prompt_ids, batch.prompt_mask, spec, key)
        texts, lengths, finish = scorer.decode(out)
        examples = [ex for ex in batch.examples for _ in range(spec.num_generations)]
        _, details = scorer.pool.score(scorer.specs, texts, examples, num_tokens=lengths.tolist())
        rows = {"length_mean": lengths, "truncated_frac": finish == sampling.FINISH_LENGTH}
        rows |= {f"reward/{k}": v for k, v in details.per_verifier.items()}
        return details.per_verifier[correct_label], rows

    return run(play, batches, scorer.spec, pass_k=pass_k, temperature=temperature, step=step)

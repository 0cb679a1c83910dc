"""Held-out evaluation of a policy (SFT): greedy pass@1, sampled pass@k, completion lengths.

    eval_set = sft_eval.load_eval_set(data_config, tokenizer, split="test", num_examples=200)
    with verifiers.VerifierPool(workers=1) as pool:
        metrics = sft_eval.evaluate(cfg, params, tokenizer, eval_set, pool, rewards="gsm8k",
                                      max_new_tokens=8, num_samples=8, temperature=1.0)
    metrics["eval/pass@1"], metrics["eval/pass@8"], metrics["eval/completion_len"]

A completion counts as correct when its reward (sum of the weighted verifier scores) is at
least `threshold` (default 1.0: a fully correct answer). pass@k is the unbiased-at-n=k
estimate: the share of prompts with at least one correct completion among their k samples.
Prompts go through the same `data` pipeline (template, tokenizer, BOS) as training, so the
model is evaluated on exactly the prompt format it is trained and rewarded on.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl_llm import data, sampling, sft_data


@dataclasses.dataclass
class EvalSet:
    """Fixed held-out prompts: the first rows of a split, in source order."""

    prompt_ids: list[list[int]]  # [n] token ids (BOS and template included), unpadded
    prompts: list[str]  # [n] prompt texts
    examples: list[dict]  # [n] dataset rows, for the verifiers


def load_eval_set(data_config, tokenizer, split: str, num_examples: int) -> EvalSet:
    """The first `num_examples` rows of `split` (all rows when fewer), unshuffled."""
    cfg = data.default_config()
    cfg.update(data_config)
    cfg.split, cfg.shuffle, cfg.num_epochs = split, False, 1
    n = min(num_examples, len(data.make_source(cfg)))
    batch = next(data.make_iterator(cfg, tokenizer, batch_size=n))
    return EvalSet(sft_data.unpadded(batch), batch.prompts, batch.examples)


def decode_completions(tokenizer, out: sampling.SampleOutput) -> tuple[list[str], np.ndarray]:
    """Sampler output -> ([N] texts without special tokens, [N] lengths in tokens)."""
    tokens, lengths = jax.device_get((out.tokens, out.lengths))
    texts = [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
        for row, n in zip(tokens, lengths, strict=True)
    ]
    return texts, np.asarray(lengths)


def _rollouts(cfg, params, tokenizer, eval_set, pool, rewards, settings: dict):
    """Generates and scores in chunks of `batch_size` prompts -> (rewards [n, k], lengths
    [n, k], truncated [n, k], texts [n * k])."""
    batch_size, k = settings.pop("batch_size"), settings["num_samples"]
    all_rewards, all_lengths, all_truncated, all_texts = [], [], [], []
    for start in range(0, len(eval_set.prompt_ids), batch_size):
        prompts = eval_set.prompt_ids[start : start + batch_size]
        examples = eval_set.examples[start : start + batch_size]
        out = sampling.generate(cfg, params, prompts, **settings)
        texts, lengths = decode_completions(tokenizer, out)
        scores, _ = pool.score(rewards, texts, [e for e in examples for _ in range(k)])
        all_rewards.append(scores.reshape(-1, k))
        all_lengths.append(lengths.reshape(-1, k))
        truncated = np.asarray(jax.device_get(out.finish)) == sampling.FINISH_LENGTH
        all_truncated.append(truncated.reshape(-1, k))
        all_texts += texts
    cat = np.concatenate
    return cat(all_rewards), cat(all_lengths), cat(all_truncated), all_texts


def evaluate(
    cfg,
    params,
    tokenizer,
    eval_set: EvalSet,
    pool,
    rewards,
    *,
    max_new_tokens: int,
    num_samples: int = 0,
    temperature: float = 1.0,
    threshold: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    step: int = 0,
    mesh=None,
) -> dict:
    """Greedy and (when num_samples > 0) sampled evaluation; returns flat `eval/` metrics.

    pool: a `verifiers.VerifierPool`; rewards: reward terms as `verifiers.parse_specs`
    reads them (e.g. "gsm8k"). The sampler stops at the tokenizer's EOS.
    """
    common = dict(
        max_new_tokens=max_new_tokens,
        stop_ids=(tokenizer.eos_token_id,),
        pad_id=data.pad_id(tokenizer),
        mesh=mesh,
        batch_size=batch_size,
    )
    greedy, lengths, truncated, texts = _rollouts(
        cfg, params, tokenizer, eval_set, pool, rewards,
        dict(common, num_samples=1, temperature=0.0, seed=seed, step=step),
    )  # fmt: skip
    metrics = {
        "eval/pass@1": float(np.mean(greedy[:, 0] >= threshold)),
        "eval/completion_len": float(np.mean(lengths)),
        "eval/truncated": float(np.mean(truncated)),
        "eval/num_examples": len(eval_set.prompt_ids),
    }
    if num_samples > 0:
        sampled, lengths, _, _ = _rollouts(
            cfg, params, tokenizer, eval_set, pool, rewards,
            dict(common, num_samples=num_samples, temperature=temperature, seed=seed, step=step),
        )  # fmt: skip
        metrics[f"eval/pass@{num_samples}"] = float(np.mean(np.any(sampled >= threshold, 1)))
        metrics["eval/sample_acc"] = float(np.mean(sampled >= threshold))
        metrics["eval/sample_completion_len"] = float(np.mean(lengths))
    metrics["eval/example"] = f"{eval_set.prompts[0]!r} -> {texts[0]!r}"
    return metrics

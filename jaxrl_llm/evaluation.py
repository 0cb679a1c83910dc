"""Held-out evaluation: greedy pass@1, sampled pass@k, completion length, per-verifier rewards.

A sample is *correct* when the raw score of the deciding verifier (`eval.correct_reward`,
default the first reward term) is above 0.5 — the built-in answer checkers return 1 or 0.
pass@k is the fraction of prompts with at least one correct sample among k drawn at
`eval.temperature` (with n = k samples the unbiased estimator of Chen et al. 2021 reduces
to exactly this).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl_llm import rollout

EVAL_KEY_OFFSET = 1 << 30  # eval draws use a key stream disjoint from training's


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


def _scores(details, label: str) -> np.ndarray:
    return np.asarray(details.per_verifier[label], np.float64)


def evaluate(
    model_cfg,
    params,
    batches,
    pool,
    specs,
    tokenizer,
    settings,
    *,
    correct_label,
    pass_k: int,
    temperature: float,
    mesh=None,
    step: int = 0,
) -> dict[str, float]:
    """Metrics `eval/*` over the fixed evaluation batches."""
    greedy = dataclasses.replace(settings, num_generations=1, temperature=0.0)
    sampled = dataclasses.replace(settings, num_generations=pass_k, temperature=temperature)
    correct1, correct_k, lengths, per_label = [], [], [], {}
    for i, batch in enumerate(batches):
        out = rollout.generate(model_cfg, params, batch, greedy, step=i, mesh=mesh)
        texts, n, _ = rollout.decode(tokenizer, out, mesh)
        _, details = pool.score(specs, texts, batch.examples, num_tokens=n.tolist())
        correct1.append(_scores(details, correct_label) > 0.5)
        lengths.append(n)
        for label in details.per_verifier:
            per_label.setdefault(label, []).append(_scores(details, label))
        if pass_k > 1:
            out = rollout.generate(
                model_cfg,
                params,
                batch,
                sampled,
                mesh=mesh,
                step=EVAL_KEY_OFFSET + step * len(batches) + i,
            )
            texts, n, _ = rollout.decode(tokenizer, out, mesh)
            examples = [ex for ex in batch.examples for _ in range(pass_k)]
            _, details = pool.score(specs, texts, examples, num_tokens=n.tolist())
            hit = _scores(details, correct_label) > 0.5
            correct_k.append(hit.reshape(-1, pass_k).any(axis=1))
    metrics = {
        "eval/pass@1": float(np.concatenate(correct1).mean()),
        "eval/length_mean": float(np.concatenate(lengths).mean()),
        "eval/num_prompts": float(sum(len(c) for c in correct1)),
    }
    if correct_k:
        metrics[f"eval/pass@{pass_k}"] = float(np.concatenate(correct_k).mean())
    for label, values in per_label.items():
        metrics[f"eval/reward/{label}"] = float(np.concatenate(values).mean())
    return metrics

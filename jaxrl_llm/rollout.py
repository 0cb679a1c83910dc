"""One training step's rollouts: sample on device, decode and score on the host.

    prompts (host) -> sampling.generate (device, async) -> [reference log-probs dispatched
    by the caller] -> completion ids to host -> text -> verifier pool -> rewards

The only device->host transfer is the completion ids (with their lengths); the rewards go
back to the device in the caller. DAPO's dynamic sampling lives here: groups whose G
rewards are all equal carry no gradient, so they are dropped and more prompts are sampled,
for at most `algo.max_resample_rounds` extra rounds.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import parallel, sampling
from jaxrl_llm.verifiers.fmt import overlong_penalty


@dataclasses.dataclass
class Rollouts:
    """A step's rollouts, N = B * G rows, prompt-major."""

    out: sampling.SampleOutput  # device arrays
    rewards: np.ndarray  # [N] float32 (summed, weighted, with the overlong penalty)
    metrics: dict  # reward/<label>, verifier/*, rollout/* (host floats)
    completions: list[str]
    prompts: list[str]
    examples: list[dict]
    lengths: np.ndarray  # [N]
    prompt_lengths: np.ndarray  # [N] real (unpadded) prompt tokens
    sample_s: float = 0.0
    score_s: float = 0.0
    aux: object = None  # what `on_sampled` returned (e.g. reference log-probs in flight)


@dataclasses.dataclass
class RolloutSettings:
    max_new_tokens: int
    num_generations: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    seed: int
    overlong_buffer: int = 0  # L_c in tokens; 0 = no overlong penalty
    bucket_steps: int = 2  # prompt-length buckets per doubling (`sampling.bucket_length`)
    cache_segments: int = sampling.CACHE_SEGMENTS  # decode loops over a growing KV cache


def generate(model_cfg, params, batch, s: RolloutSettings, step: int, mesh=None, **overrides):
    """Samples G completions for each prompt of a data batch (prompt ids left-padded)."""
    prompts = [
        row[mask].tolist() for row, mask in zip(batch.prompt_ids, batch.prompt_mask, strict=True)
    ]
    kw = (
        dict(
            max_new_tokens=s.max_new_tokens,
            num_samples=s.num_generations,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            stop_ids=s.stop_ids,
            pad_id=s.pad_id,
            seed=s.seed,
            bucket_steps=s.bucket_steps,
            cache_segments=s.cache_segments,
            mesh=mesh,
            step=step,
        )
        | overrides
    )
    return sampling.generate(model_cfg, params, prompts, **kw)


def decode(tokenizer, out: sampling.SampleOutput, mesh=None):
    """This process's completion ids -> (texts, lengths, finish); the one device->host
    transfer of a step."""
    tokens, lengths, finish = parallel.local_rows((out.tokens, out.lengths, out.finish), mesh)
    texts = tokenizer.batch_decode(
        [row[:n] for row, n in zip(tokens, lengths, strict=True)], skip_special_tokens=True
    )
    return texts, np.asarray(lengths), np.asarray(finish)


def score(pool, specs, out, tokenizer, batch, s: RolloutSettings, mesh=None):
    """Decodes and scores this process's rows of one SampleOutput -> Rollouts."""
    G = s.num_generations
    texts, lengths, finish = decode(tokenizer, out, mesh)
    examples = [ex for ex in batch.examples for _ in range(G)]
    rewards, details = pool.score(specs, texts, examples, num_tokens=lengths.tolist())
    metrics = details.metrics()
    if s.overlong_buffer:
        penalty = np.array(
            [overlong_penalty(int(n), s.max_new_tokens, s.overlong_buffer) for n in lengths]
        )
        rewards = rewards + penalty
        metrics["reward/overlong"] = float(penalty.mean())
    metrics |= {
        "rollout/length_mean": float(lengths.mean()),
        "rollout/length_max": float(lengths.max()),
        "rollout/truncated_frac": float(np.mean(finish == sampling.FINISH_LENGTH)),
    }
    return Rollouts(
        out=out,
        rewards=rewards.astype(np.float32),
        metrics=metrics,
        completions=texts,
        prompts=[p for p in batch.prompts for _ in range(G)],
        examples=examples,
        lengths=lengths,
        prompt_lengths=np.repeat(np.asarray(batch.prompt_mask).sum(axis=1), G),
    )


def degenerate(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[N] -> [B] bool: the group's G rewards are all equal (no learning signal)."""
    groups = rewards.reshape(-1, group_size)
    return np.all(groups == groups[:, :1], axis=1)


def collect(
    model_cfg,
    params,
    data_iter,
    pool,
    specs,
    tokenizer,
    s: RolloutSettings,
    step: int,
    mesh=None,
    dynamic_rounds: int | None = None,
    on_sampled=None,
) -> Rollouts:
    """Samples and scores one step's batch.

    on_sampled(out): called as soon as the sampler is dispatched, before the host blocks
    on the completion ids, so device work it dispatches (reference log-probs) overlaps
    the scoring; its result is `Rollouts.aux`. With `dynamic_rounds` (DAPO dynamic
    sampling), keeps only groups with mixed rewards, sampling up to that many extra
    batches to fill the batch; if still short, the batch is completed with dropped
    groups (their advantage is 0, so they add nothing but keep shapes static). The
    final batch is only known after scoring then, so `on_sampled` runs on it last.
    """
    t0 = time.perf_counter()
    batch = next(data_iter)
    out = generate(model_cfg, params, batch, s, step * (1 + (dynamic_rounds or 0)), mesh)
    aux = on_sampled(out) if on_sampled is not None and dynamic_rounds is None else None
    jax.block_until_ready(out.tokens)
    sample_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ro = score(pool, specs, out, tokenizer, batch, s, mesh)
    score_s = time.perf_counter() - t0
    if dynamic_rounds is not None:
        ro, rounds, sample_extra, score_extra = _fill_dynamic(
            ro, model_cfg, params, data_iter, pool, specs, tokenizer, s, step, mesh, dynamic_rounds
        )
        ro.metrics["rollout/dynamic_rounds"] = float(rounds)
        sample_s, score_s = sample_s + sample_extra, score_s + score_extra
        if on_sampled is not None:
            aux = on_sampled(ro.out)
    ro.sample_s, ro.score_s, ro.aux = sample_s, score_s, aux
    return ro


def _fill_dynamic(
    ro, model_cfg, params, data_iter, pool, specs, tokenizer, s, step, mesh, max_rounds
):
    G = s.num_generations
    B = len(ro.rewards) // G
    parts, sample_s, score_s, rounds = [ro], 0.0, 0.0, 0
    kept = int((~degenerate(ro.rewards, G)).sum())
    # Every process samples in every round (the sampler is collective): continue while
    # any process is short of mixed-reward groups.
    while parallel.host_max(int(kept < B)) and rounds < max_rounds:
        rounds += 1
        t0 = time.perf_counter()
        batch = next(data_iter)
        out = generate(model_cfg, params, batch, s, step * (1 + max_rounds) + rounds, mesh)
        jax.block_until_ready(out.tokens)
        sample_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        parts.append(score(pool, specs, out, tokenizer, batch, s, mesh))
        score_s += time.perf_counter() - t0
        kept += int((~degenerate(parts[-1].rewards, G)).sum())
    if rounds == 0:
        ro.metrics["rollout/degenerate_frac"] = 1.0 - kept / B
        return ro, 0, 0.0, 0.0
    merged = _merge(parts, G, B, mesh)
    merged.metrics["rollout/degenerate_frac"] = 1.0 - min(kept, B) / B
    return merged, rounds, sample_s, score_s


@jax.jit
def _select_rows(outs: list[sampling.SampleOutput], index: jax.Array) -> sampling.SampleOutput:
    """Concatenates SampleOutputs (left-padding shorter prompt buckets, padding masked)
    and keeps the rows in `index`; jitted, so no constant is transferred implicitly."""
    P = max(o.prompt_tokens.shape[1] for o in outs)

    def widen(x):
        return jnp.pad(x, ((0, 0), (P - x.shape[1], 0)))  # 0 / False: masked padding

    outs = [
        o.replace(prompt_tokens=widen(o.prompt_tokens), prompt_mask=widen(o.prompt_mask))
        for o in outs
    ]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs)[index], *outs)


def _global_rows(rows: np.ndarray, parts: list[Rollouts], mesh) -> np.ndarray:
    """This process's selected rows (indices into its parts, concatenated) -> indices into
    the concatenation of the global outputs, gathered from every process in order."""
    if mesh is None or jax.process_count() == 1:
        return rows
    from jax.experimental import multihost_utils

    n_local, n_global = len(parts[0].rewards), parts[0].out.tokens.shape[0]
    table = np.asarray(multihost_utils.process_allgather(rows))  # [processes, selected]
    part, i = np.divmod(table, n_local)
    offset = np.arange(table.shape[0])[:, None] * n_local
    return (part * n_global + offset + i).reshape(-1)


def _merge(parts: list[Rollouts], G: int, B: int, mesh=None) -> Rollouts:
    """The first B mixed-reward groups over all parts, then dropped groups if needed."""
    rewards = np.concatenate([p.rewards for p in parts])
    mixed = ~degenerate(rewards, G)
    groups = np.concatenate([np.nonzero(mixed)[0], np.nonzero(~mixed)[0]])[:B]
    rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
    index = jax.device_put(
        _global_rows(rows, parts, mesh),
        parts[0].out.tokens.sharding if mesh is None else NamedSharding(mesh, PartitionSpec()),
    )
    out = _select_rows([p.out for p in parts], index)
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    flat = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
    metrics = {
        k: float(np.mean([p.metrics[k] for p in parts if k in p.metrics])) for k in parts[0].metrics
    }
    return Rollouts(
        out=out,
        rewards=rewards[rows],
        metrics=metrics,
        completions=pick(flat("completions")),
        prompts=pick(flat("prompts")),
        examples=pick(flat("examples")),
        lengths=np.concatenate([p.lengths for p in parts])[rows],
        prompt_lengths=np.concatenate([p.prompt_lengths for p in parts])[rows],
    )

"""Sampling from token-id lists, outside a trainer: `generate` and the prompt padding it
(and the gateway's static path, `serve`) uses.

    ids, mask = pad_prompts([[5, 7, 9], [11]], pad_id=0)      # left-padded to a bucket
    out = generate(cfg, params, prompts, max_new_tokens=64, num_samples=8)
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.sampler import CACHE_SEGMENTS, Sampler, bucket_length
from jaxrl_llm.sampling.spec import RolloutSpec


@functools.lru_cache(maxsize=32)
def _shared_sampler(cfg, mesh, pad_id, bucket_steps, cache_segments) -> Sampler:
    """One `Sampler` per setting for `generate`, so its programs compile once. The seed is
    not a setting: `generate` passes it per call, and the sampler holds no random state."""
    return Sampler(
        cfg, mesh, pad_id=pad_id, bucket_steps=bucket_steps, cache_segments=cache_segments
    )


def pad_prompts(
    prompts,
    pad_id: int,
    batch_multiple: int = 1,
    vocab_size: int | None = None,
    bucket: int | None = None,
    bucket_steps: int = 2,
):
    """Left-pads token-id lists to their bucket -> (ids [B', P], mask [B', P]) on the host.

    B' rounds B up to a multiple of `batch_multiple` with fully padded dummy rows; P is
    `bucket_length(longest, bucket_steps)`, or `bucket`.
    """
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    lengths = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids")
        if vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(f"prompts[{i}]: token id outside [0, {vocab_size})")
        lengths.append(arr.size)
    P = bucket or bucket_length(max(lengths), bucket_steps)
    B = -(-len(prompts) // batch_multiple) * batch_multiple
    ids = np.full((B, P), pad_id, np.int32)
    mask = np.zeros((B, P), bool)
    for i, p in enumerate(prompts):
        ids[i, P - lengths[i] :] = p
        mask[i, P - lengths[i] :] = True
    return ids, mask


def generate(
    cfg,
    params,
    prompts,
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids=(),
    seed: int = 0,
    mesh=None,
    *,
    step: int | None = None,
    pad_id: int = 0,
    bucket_steps: int = 2,
    cache_segments: int = CACHE_SEGMENTS,
) -> SampleOutput:
    """Samples `num_samples` (G) completions per prompt: `Sampler.sample` over token-id
    lists. See `decode.SampleOutput` for the result.

    prompts: list of token-id lists. temperature 0 = greedy. The random key is
    fold_in(key(seed), step), step 0 when not given: the same call draws the same tokens
    whatever came before it (pass successive steps for fresh samples). One sampler serves
    every call with the same model config, mesh, pad_id, bucket_steps and cache_segments,
    whatever the seed and step: a new seed compiles nothing. With several
    JAX processes, each passes its own share of the prompts (the same count on every
    process) and gets the global output; `parallel.local_rows` fetches its own rows.
    """
    spec = RolloutSpec(
        num_generations=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=tuple(stop_ids),
    )
    sampler = _shared_sampler(cfg, mesh, int(pad_id), bucket_steps, cache_segments)
    multi = sampler.multi_process()
    ids, mask = pad_prompts(
        prompts,
        sampler.pad_id,
        1 if multi else mesh_lib.batch_size_multiple(mesh),
        cfg.vocab_size,
        bucket_steps=bucket_steps,
    )
    out = sampler.sample(params, ids, mask, spec, step, seed=int(seed))
    n = len(prompts) * spec.num_generations
    if not multi and out.tokens.shape[0] != n:  # dummy rows that made B divide the mesh
        out = jax.tree.map(lambda x: x[:n], out)
    return out

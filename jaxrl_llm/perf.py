"""Throughput accounting: model FLOPs and a matmul peak measured on the device in use.

MFU everywhere in jaxrl_llm = model FLOPs / seconds / `matmul_peak()`, where model FLOPs
count the matmuls of the parameters (2 per parameter per token forward, 6 forward +
backward) and the peak is measured in the same process, so the ratio says how close a
step is to what this device's matmul unit can do, not to a datasheet number.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=4)
def matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Measured dense matmul FLOP/s of the default device at this dtype."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.dtype(dtype))
    f = jax.jit(lambda a, b: (a @ b) @ b)  # two matmuls per call amortise dispatch
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * 2 * n**3 / float(np.median(times))


def matmul_params(model_cfg) -> int:
    """Parameters that take part in matmuls (all but the embedding lookup)."""
    return model_cfg.num_params(include_embeddings=False)


def step_flops(
    model_cfg,
    *,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    prompts: int,
    reference: bool,
    update_passes: int,
    old_logp_pass: bool,
) -> dict[str, float]:
    """Model FLOPs of one RL step, by phase.

    sample: prefill of each prompt once + `new_tokens` decode steps over every row;
    reference: a forward over prompt + completion; update: forward + backward per pass
    (+ one forward when old-policy log-probs are recomputed).
    """
    per_token = 2 * matmul_params(model_cfg)
    seq = prompt_len + new_tokens
    return {
        "sample": per_token * (prompts * prompt_len + rows * new_tokens),
        "reference": per_token * rows * seq if reference else 0.0,
        "update": per_token * rows * seq * (3 * update_passes + int(old_logp_pass)),
    }

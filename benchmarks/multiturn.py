"""Multi-turn rollout throughput: appending each observation to the KV cache
(`Sampler.append`, what `envs.play` does) vs re-prefilling the whole conversation every
turn (what a loop over `generate` calls does), same weights, same turns.

    python benchmarks/multiturn.py                     # ~25M Qwen3-like, CPU
    python benchmarks/multiturn.py --preset=0.5b --dtype=bfloat16     # GPU

Every row samples `--turns` turns of exactly `--turn_tokens` tokens (temperature 1, no
stop id) after a `--prompt`-token prompt; an observation of `--obs` tokens follows each
turn but the last. Both paths fetch each turn's tokens to the host, as a turn loop must.
Sampled tokens/s = batch * turns * turn_tokens / seconds, after a warm-up run of each
path (compiles excluded; both compile one program per turn shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, device_name, preset_config, table  # noqa: E402

from jaxrl_llm import models, sampling  # noqa: E402


def appended(sampler, params, prompts, obs, spec, turns: int, turn_tokens: int):
    """start, then per turn: decode, fetch, append the observation."""
    ids, mask = sampling.pad_prompts(prompts, 0)
    state = sampler.start(params, ids, mask, spec, step=0)
    for t in range(turns):
        state = sampler.decode(params, state, turn_tokens)
        np.asarray(sampler.result(state).tokens)  # the turn loop reads each turn
        if t < turns - 1:
            state = sampler.append(params, state, obs, np.ones(obs.shape, bool))
    return block(sampler.result(state).tokens)


def reprefilled(sampler, params, prompts, obs, spec, turns: int, turn_tokens: int):
    """Per turn: prefill the whole conversation so far, sample a turn, fetch it."""
    conversation = [list(p) for p in prompts]
    for t in range(turns):
        ids, mask = sampling.pad_prompts(conversation, 0)
        out = sampler.sample(params, ids, mask, spec, step=t)
        tokens = np.asarray(out.tokens)
        for i, row in enumerate(conversation):
            row.extend(tokens[i, :turn_tokens].tolist())
            if t < turns - 1:
                row.extend(obs[i].tolist())
    return tokens


def timed(fn, *args):
    fn(*args)  # compiles
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="25m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn_tokens", type=int, default=32)
    p.add_argument("--obs", type=int, default=16)
    a = p.parse_args()
    cfg = preset_config(a.preset)
    params = models.init_params(cfg, seed=0, dtype=a.dtype)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (a.batch, a.prompt)).tolist()
    obs = rng.integers(1, cfg.vocab_size, (a.batch, a.obs)).astype(np.int32)
    args = (params, prompts, obs)
    turn = (a.turns, a.turn_tokens)
    spec_append = sampling.RolloutSpec(1, a.turns * (a.turn_tokens + a.obs), 1.0)
    spec_turn = sampling.RolloutSpec(1, a.turn_tokens, 1.0)
    s_append = timed(appended, sampling.Sampler(cfg, cache_segments=1), *args, spec_append, *turn)
    s_prefill = timed(reprefilled, sampling.Sampler(cfg, cache_segments=1), *args, spec_turn, *turn)
    sampled = a.batch * a.turns * a.turn_tokens
    print(
        f"{device_name()}, {a.preset} {a.dtype}, batch {a.batch}, prompt {a.prompt}, "
        f"{a.turns} turns x {a.turn_tokens} tokens, observations of {a.obs}"
    )
    rows = [
        {
            "path": "append (KV cache kept)",
            "seconds": f"{s_append:.2f}",
            "sampled tokens/s": f"{sampled / s_append:,.0f}",
        },
        {
            "path": "re-prefill every turn",
            "seconds": f"{s_prefill:.2f}",
            "sampled tokens/s": f"{sampled / s_prefill:,.0f}",
        },
    ]
    print(table(rows, ["path", "seconds", "sampled tokens/s"]))
    print(f"speed-up: {s_prefill / s_append:.2f}x")


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "default")
    main()

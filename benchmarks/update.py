"""Update-step throughput and MFU, and the memory that chunked log-probs save.

    python benchmarks/update.py                                  # ~100M, CPU, 8 x 512 tokens
    python benchmarks/update.py --seqs=64 --micro-batches=8      # the full 64 x 512 batch
    python benchmarks/update.py --memory-only                    # 150k-vocab memory table
    python benchmarks/update.py --group=8 --prompt-len=384 --completion-len=128  # shared prompt

One measured step = the reference model's forward (`make_logprob_fn`, GRPO's beta > 0)
plus the jitted GRPO update (forward + backward + AdamW) on N sequences of
--prompt-len + --completion-len tokens, the state threaded from call to call as in
training. tokens/s counts every token of every sequence (prompt and completion).
--group=G: every G sequences share their prompt (a GRPO group of the rollout spec), which
the reference and the update then read once (`make_update_fn`, `make_logprob_fn`); compare
with --group=1 on the same batch shape: distinct prompts, each read by its own row
(`share_prompts=False`; GRPO's groups are then min(8, --seqs) rows).

Model FLOPs (no remat recompute, full S x S attention as computed):
  forward F = N * L * (2 * S * P_layer + 4 * S^2 * n_heads * head_dim) + N * T * 2 * D * V
  step = 3 F (update forward + backward) + F (reference forward);
MFU = step FLOPs / seconds / a measured float32 matmul peak of this machine.

Memory: XLA's compiled `memory_analysis().temp_size_in_bytes` of the update program
(the scratch it allocates beyond arguments and outputs) at a 151,936-token vocabulary,
with log-probs chunked over 128 positions vs one chunk of the whole completion (which
holds the [N, T, V] logits). Compiled only, not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    block,
    device_name,
    measure_matmul_peak,
    peak_memory,
    preset_config,
    table,
    uptime,
)

from jaxrl_llm import models, rl, sampling  # noqa: E402
from jaxrl_llm.parallel import allocator  # noqa: E402
from jaxrl_llm.rl import update as U  # noqa: E402
from jaxrl_llm.trainer import perf


def random_batch(
    cfg, n: int, prompt_len: int, completion_len: int, group: int, generations: int
) -> U.RolloutBatch:
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (n // group, prompt_len), dtype=np.int32)
    return jax.device_put(
        U.RolloutBatch(
            prompt_tokens=np.repeat(prompts, group, axis=0),
            prompt_mask=np.ones((n, prompt_len), bool),
            tokens=rng.integers(0, cfg.vocab_size, (n, completion_len), dtype=np.int32),
            mask=np.ones((n, completion_len), bool),
            loss_mask=np.ones((n, completion_len), bool),
            behaviour_logprobs=np.full((n, completion_len), -np.log(cfg.vocab_size), np.float32),
            rewards=rng.integers(0, 2, n).astype(np.float32),
            policy_version=np.zeros(n, np.int32),
            num_generations=generations,
        )
    )


def setup(cfg, args, chunk_size: int):
    """(update fn, reference fn, state, reference params, batch) for GRPO (beta > 0)."""
    G = args.group if args.group > 1 else min(8, args.seqs)
    spec = sampling.RolloutSpec(G, args.completion_len)
    opt = U.make_optimizer(learning_rate=1e-6)
    params = models.init_params(cfg, seed=0, dtype=args.dtype)
    ref_params = jax.tree.map(jnp.copy, params)
    share = args.group > 1
    update = U.make_update_fn(
        cfg,
        rl.preset("grpo"),
        opt,
        spec,
        share_prompts=share,
        micro_batches=args.micro_batches,
        chunk_size=chunk_size,
    )
    ref_spec = spec if share else spec.replace(num_generations=1)
    ref_fn = U.make_logprob_fn(
        cfg, ref_spec, chunk_size=chunk_size, micro_batches=args.micro_batches
    )
    batch = random_batch(cfg, args.seqs, args.prompt_len, args.completion_len, args.group, G)
    return update, ref_fn, U.init_train_state(params, opt), ref_params, batch


def bench_step(cfg, args) -> dict:
    update, ref_fn, state, ref_params, batch = setup(cfg, args, args.chunk_size)

    def step(state):
        ref = ref_fn(ref_params, batch)
        state, metrics = update(state, batch.replace(ref_logprobs=ref))
        block(metrics)
        return state

    t0 = time.perf_counter()
    state = step(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state = step(state)
        times.append(time.perf_counter() - t0)
    return {"first": first, "seconds": float(np.median(times))}


def temp_bytes(cfg, args, chunk_size: int) -> int:
    update, _, state, _, batch = setup(cfg, args, chunk_size)
    ref = jnp.zeros(batch.tokens.shape, jnp.float32)
    compiled = update.lower(state, batch.replace(ref_logprobs=ref)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def logprob_temp_bytes(n: int, t: int, d: int, v: int, chunk_size: int) -> int:
    """Temp bytes of value-and-grad of the log-prob + entropy loss alone (no model)."""

    def loss(h, w, y):
        logp, ent = rl.token_logprobs(h, w, y, chunk_size=chunk_size)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    shapes = (((n, t, d), jnp.float32), ((d, v), jnp.float32), ((n, t), jnp.int32))
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def memory_rows(args) -> list[dict]:
    cfg = dataclasses.replace(preset_config(args.preset), vocab_size=151936)
    n, t = args.seqs // args.micro_batches, args.completion_len
    rows = []
    for label, chunk in (("chunked (128)", 128), ("one chunk = [n, T, V]", t)):
        lp = logprob_temp_bytes(n, t, cfg.hidden_size, cfg.vocab_size, chunk)
        rows.append(
            {
                "logprobs": label,
                "rows / micro-batch": n,
                "[n, chunk, V] f32 GiB": f"{n * chunk * cfg.vocab_size * 4 / 2**30:.2f}",
                "update temp GiB": f"{temp_bytes(cfg, args, chunk) / 2**30:.2f}",
                "logprob loss temp GiB": f"{lp / 2**30:.2f}",
            }
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=448)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--group", type=int, default=1, help="sequences per shared prompt")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    print(f"device: {device_name()}; {uptime()}")
    if not args.memory_only:
        cfg = preset_config(args.preset)
        r = bench_step(cfg, args)
        # Best of several: other jobs on shared cores only ever make the peak look lower.
        peak = max(measure_matmul_peak(args.dtype) for _ in range(3))
        tokens = args.seqs * (args.prompt_len + args.completion_len)
        # Full S x S attention, as the update computes it (not the causal half).
        P, T = args.prompt_len, args.completion_len
        flops = 4 * args.seqs * perf.forward_flops(cfg, P + T, P + T, T)
        if args.group > 1:  # each prompt once, then the completions after it
            prompts = args.seqs // args.group * perf.forward_flops(cfg, P, P, 0)
            flops = 4 * (prompts + args.seqs * perf.forward_flops(cfg, T - 1, P + T - 1, T))
        row = {
            "preset": f"{args.preset} ({models.count_params(models.init_params(cfg)) / 1e6:.0f}M)",
            "batch": f"{args.seqs} x {args.prompt_len}+{args.completion_len}",
            "group": args.group,
            "micro": args.micro_batches,
            "compile+1st s": f"{r['first']:.1f}",
            "step s": f"{r['seconds']:.1f}",
            "tokens/s": f"{tokens / r['seconds']:.0f}",
            "TFLOP/step": f"{flops / 1e12:.2f}",
            "GFLOP/s": f"{flops / r['seconds'] / 1e9:.1f}",
            "peak GFLOP/s": f"{peak / 1e9:.1f}",
            "MFU": f"{flops / r['seconds'] / peak:.1%}",
            "memory": peak_memory(),
        }
        print(table([row], list(row)))
    if not args.skip_memory:
        rows = memory_rows(args)
        print(table(rows, list(rows[0])))
    print(f"after: {uptime()}")


if __name__ == "__main__":
    allocator.reexec_with_tcmalloc()  # as the trainer's command line does
    main()

"""MoE forward and update tokens/s: the dropless grouped experts (`ragged_dot`, and the
blocked batched matmuls meant for CPU) against the same model computed densely (every
expert on every token, `model.moe_impl='dense'`).

    python benchmarks/moe.py                       # 16 experts, k = 2, CPU
    python benchmarks/moe.py --experts=64 --k=4 --repeats=5

The grouped path (`models.moe.grouped_experts`) sorts the N*k (token, expert) pairs by
expert and runs one `jax.lax.ragged_dot` per projection, so each token does k experts'
work (but XLA:CPU lowers `ragged_dot` densely over all groups); `blocked` pads each
expert's rows to blocks of 128 and runs one batched matmul over the blocks; the dense path
does E experts' work and weights E - k of them by zero. All compute the same logits
(tests/test_moe.py). Forward: `models.forward` of [rows, length] tokens.
Update: value and gradient of the mean teacher-forced log-prob (`rl.batch.
sequence_logprobs`) w.r.t. every parameter, what the GRPO update's backward costs. The paths
run interleaved (ragged, blocked, dense, ragged, ...) in one process; medians of --repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, device_name, table, uptime  # noqa: E402

from jaxrl_llm import models  # noqa: E402
from jaxrl_llm.rl.batch import sequence_logprobs  # noqa: E402


def model_config(args, impl: str) -> models.ModelConfig:
    return models.ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=2,
        head_dim=args.hidden // 8,
        qk_norm=True,
        num_experts=args.experts,
        num_experts_per_tok=args.k,
        moe_intermediate_size=args.expert_width,
        norm_topk_prob=True,
        moe_impl=impl,
    )


def programs(cfg, rows: int, length: int):
    """(jitted forward, jitted update) over fixed random tokens."""
    ids = jax.random.randint(jax.random.key(1), (rows, length), 0, cfg.vocab_size)
    mask = jnp.ones((rows, length), bool)
    half = length // 2

    def forward(params):
        return models.forward(cfg, params, ids, mask)

    def loss(params):
        logp, _ = sequence_logprobs(
            cfg, params, ids[:, :half], mask[:, :half], ids[:, half:], mask[:, half:]
        )
        return -jnp.mean(logp)

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    impls = ("ragged", "blocked", "dense")
    cfgs = {i: model_config(args, i) for i in impls}
    params = models.init_params(cfgs["ragged"], seed=0)
    progs = {i: programs(cfgs[i], args.rows, args.length) for i in impls}
    for i in impls:  # compile and warm up
        block(progs[i][0](params)), block(progs[i][1](params))
    times = {(i, kind): [] for i in impls for kind in ("forward", "update")}
    for _ in range(args.repeats):
        for i in impls:
            for kind, fn in zip(("forward", "update"), progs[i], strict=True):
                t0 = time.perf_counter()
                block(fn(params))
                times[(i, kind)].append(time.perf_counter() - t0)
    tokens = args.rows * args.length
    rows = []
    for kind in ("forward", "update"):
        med = {i: float(np.median(times[(i, kind)])) for i in impls}
        for i in impls:
            t = times[(i, kind)]
            rows.append(
                {
                    "pass": kind,
                    "experts": i,
                    "median s": f"{med[i]:.3f}",
                    "spread s": f"{min(t):.3f}-{max(t):.3f}",
                    "tokens/s": f"{tokens / med[i]:.0f}",
                    "dense / this": f"{med['dense'] / med[i]:.2f}x",
                }
            )
    cfg = cfgs["ragged"]
    print(f"device: {device_name()}; {uptime()}")
    print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} "
        f"experts of width {cfg.moe_intermediate_size}, k={cfg.num_experts_per_tok}; "
        f"{cfg.num_params() / 1e6:.1f}M params, {cfg.active_params() / 1e6:.1f}M active; "
        f"batch {args.rows} x {args.length} tokens"
    )
    print(table(rows, ["pass", "experts", "median s", "spread s", "tokens/s", "dense / this"]))


if __name__ == "__main__":
    main()

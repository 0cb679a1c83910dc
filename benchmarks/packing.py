"""Packed against padded rows: the GRPO update and the reference forward, side by side.

    python benchmarks/packing.py                        # 25M model, CPU, 16 rows x 448 tokens
    python benchmarks/packing.py --repeats=7 --full=false   # the long-tailed batch only

A long-tailed batch: prompts of 16-64 tokens, completions whose lengths follow a
geometric law capped at --completion-len, a few rows at the cap, scaled so that about
--padding of the [N, P + T] positions are padding. The same jitted programs run it with
`packing='off'` (every row padded to P + T) and `packing='on'` (each micro-batch's rows
first-fit into ceil(0.625 n) sequences of width P + T, `rl.packing`), interleaved
(off, on, off, on, ...) so that a loaded machine slows both alike. A second, full batch
(no padding: the rows cannot be packed, the packed program runs its padded branch)
gives the cost of planning when packing does not apply. Prints the median seconds and
the ratio per program; loss and gradient norm of the two updates agree.
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
from common import block, bool_flag, device_name, preset_config, table, uptime  # noqa: E402

from jaxrl_llm import models, rl, sampling  # noqa: E402
from jaxrl_llm.rl import packing  # noqa: E402
from jaxrl_llm.rl import update as U  # noqa: E402
from jaxrl_llm.rl.prefix import split_rows  # noqa: E402


def long_tailed_batch(cfg, n, prompt_len, completion_len, padding, full=False, seed=0):
    """A RolloutBatch with about `padding` of its positions padding (0 when full)."""
    rng = np.random.default_rng(seed)
    width = prompt_len + completion_len
    plen = rng.integers(prompt_len // 4, prompt_len + 1, n)
    want = (1 - padding) * n * width - plen.sum()  # completion tokens to spread
    clen = np.minimum(rng.geometric(1.0 / max(want / n, 1.0), n), completion_len)
    clen[rng.choice(n, max(1, n // 8), replace=False)] = completion_len  # the long tail
    clen = np.maximum(np.minimum(np.round(clen * want / clen.sum()), completion_len), 1)
    if full:
        plen[:], clen[:] = prompt_len, completion_len
    prompt_mask = np.arange(prompt_len)[None] >= (prompt_len - plen)[:, None]
    mask = np.arange(completion_len)[None] < clen[:, None]
    vocab = cfg.vocab_size
    return jax.device_put(
        U.RolloutBatch(
            prompt_tokens=np.where(
                prompt_mask, rng.integers(1, vocab, prompt_mask.shape), 0
            ).astype(np.int32),
            prompt_mask=prompt_mask,
            tokens=np.where(mask, rng.integers(1, vocab, mask.shape), 0).astype(np.int32),
            mask=mask,
            loss_mask=mask,
            behaviour_logprobs=np.where(mask, -np.log(vocab), 0.0).astype(np.float32),
            rewards=rng.integers(0, 2, n).astype(np.float32),
            policy_version=np.zeros(n, np.int32),
            num_generations=2,
        )
    )


def programs(cfg, args, mode):
    """(update, reference fn) with packing `mode`."""
    spec = sampling.RolloutSpec(2, args.completion_len)
    opt = U.make_optimizer(learning_rate=1e-6)
    update = U.make_update_fn(
        cfg,
        rl.preset("grpo"),
        opt,
        spec,
        micro_batches=args.micro_batches,
        chunk_size=args.chunk_size,
        share_prompts=False,
        packing=mode,
    )
    ref = U.make_logprob_fn(
        cfg,
        spec.replace(num_generations=1),
        chunk_size=args.chunk_size,
        micro_batches=args.micro_batches,
        packing=mode,
    )
    return update, ref


def packed_micro_batches(batch, micro_batches) -> list[bool]:
    """Whether each micro-batch's rows first-fit into its packed sequences (else the
    packed program runs its padded branch for it)."""
    n = batch.mask.shape[0] // micro_batches
    seqs = packing.packed_seqs(n, packing.DEFAULT_CAPACITY)
    return [
        bool(packing.plan_packing(pm, m, seqs).fits)
        for pm, m in zip(
            *(split_rows(x, micro_batches) for x in (batch.prompt_mask, batch.mask)),
            strict=True,
        )
    ]


def padding_fraction(batch) -> float:
    """The fraction of the [N, P + T] positions that are padding."""
    return 1 - float(np.mean(np.concatenate([batch.prompt_mask, batch.mask], 1)))


def measure(cfg, args, batch, label, params=None) -> list[dict]:
    """Rows of median seconds per update and per reference forward, padded and packed,
    timed in interleaved pairs (the first round, which compiles, is dropped). `args` needs
    completion_len, micro_batches, chunk_size and repeats; `params` defaults to a random
    float32 model of `cfg`."""
    if params is None:
        params = models.init_params(cfg, seed=0)
    opt = U.make_optimizer(learning_rate=1e-6)
    runs = {mode: programs(cfg, args, mode) for mode in ("off", "on")}
    states = {mode: U.init_train_state(jax.tree.map(jnp.copy, params), opt) for mode in runs}
    times = {(mode, what): [] for mode in runs for what in ("update", "reference")}
    losses = {}
    for i in range(args.repeats + 1):  # the first round compiles
        for mode, (update, ref_fn) in runs.items():
            t0 = time.perf_counter()
            ref = block(ref_fn(params, batch))
            t1 = time.perf_counter()
            states[mode], metrics = update(states[mode], batch.replace(ref_logprobs=ref))
            block(metrics)
            t2 = time.perf_counter()
            if i:
                times[mode, "reference"].append(t1 - t0)
                times[mode, "update"].append(t2 - t1)
            losses[mode] = (float(metrics["loss/total"]), float(metrics["optim/grad_norm"]))
    rows = []
    for what in ("update", "reference"):
        off, on = (np.array(times[m, what]) for m in ("off", "on"))
        rows.append(
            {
                "batch": label,
                "program": what,
                "padded s (median)": f"{np.median(off):.3f} [{off.min():.3f}-{off.max():.3f}]",
                "packed s (median)": f"{np.median(on):.3f} [{on.min():.3f}-{on.max():.3f}]",
                "speed-up (median of pairs)": f"{np.median(off / on):.2f}x",
            }
        )
    rows[0]["loss padded / packed"] = f"{losses['off'][0]:.5g} / {losses['on'][0]:.5g}"
    print(f"{label}: loss / grad norm padded {losses['off']}, packed {losses['on']}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="25m")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--padding", type=float, default=0.5)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--full", type=bool_flag, default=True, help="also the full batch")
    args = p.parse_args()
    cfg = preset_config(args.preset)
    batch = long_tailed_batch(cfg, args.seqs, args.prompt_len, args.completion_len, args.padding)
    n = args.seqs // args.micro_batches
    pad = padding_fraction(batch)
    fits = packed_micro_batches(batch, args.micro_batches)
    print(
        f"{device_name()}; {args.preset}, {args.seqs} rows x {args.prompt_len} + "
        f"{args.completion_len}, {args.micro_batches} micro-batches of {n} rows -> "
        f"{packing.packed_seqs(n, packing.DEFAULT_CAPACITY)} packed; padding {pad:.2f}; "
        f"micro-batches packed: {fits}"
    )
    rows = measure(cfg, args, batch, f"long-tailed ({pad:.0%} padding)")
    if args.full:
        full = long_tailed_batch(cfg, args.seqs, args.prompt_len, args.completion_len, 0, True)
        rows += measure(cfg, args, full, "full (0% padding, not packed)")
    print(table(rows, list(rows[0])))
    print(uptime())


if __name__ == "__main__":
    main()

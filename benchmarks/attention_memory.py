"""Compiled memory of the GRPO update against the sequence length, per attention path.

    python benchmarks/attention_memory.py                         # 1k 4k 16k 32k, xla + blockwise
    python benchmarks/attention_memory.py --lengths=1024,4096 --paths=blockwise
    python benchmarks/attention_memory.py --model=qwen3-1.7b --prompt=1024 --lengths=16384
    python benchmarks/attention_memory.py --chip=v5e --lengths=4096,16384 --paths=blockwise,pallas

Compiles (never runs) the trainer's update program (`rl.make_update_fn`) for Qwen2.5-0.5B
(or --model) shapes in bfloat16 with remat full, GRPO beta = 0.04, one row of 256 prompt + T
completion tokens per micro-batch (two rows, two micro-batches), from abstract arrays
(`lora_memory.abstract_state`): nothing is allocated, so lengths far beyond this
machine's memory compile. Prints XLA's `memory_analysis()` temporaries and peak
(arguments + outputs not donated + temporaries) for each path and length, and the growth
of each path's temporaries from one length to the next. A length of 32k counts the prompt
in: T = 32768 - 256.

--chip=v5e (v6e, v5p; libtpu, the test extra) compiles the same program with XLA:TPU for
one chip of that kind (docs/tpu.md) instead of XLA:CPU for this machine's CPU, so the two
compilers' figures for one program can be set side by side; `pallas` (the splash
kernel) is a path there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from jaxrl_llm.tpu import chips

# Before jax starts: --chip compiles for a TPU chip libtpu describes from this CPU process.
chips.set_platforms(os.environ, compile_only=any(a.startswith("--chip") for a in sys.argv))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, table  # noqa: E402
from lora_memory import QWEN2P5_0P5B, abstract_batch, abstract_state  # noqa: E402

from jaxrl_llm import models, rl, sampling  # noqa: E402
from jaxrl_llm.rl import update as U  # noqa: E402
from jaxrl_llm.tpu.report import peak_bytes  # noqa: E402

GiB = 2**30
PROMPT = 256
# Qwen3-1.7B as it is (configs/math_grpo_qwen3_1p7b_16k_tpu.py).
QWEN3_1P7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    qk_norm=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=40960,
)
MODELS = {
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", QWEN2P5_0P5B),
    "qwen3-1.7b": ("Qwen3ForCausalLM", QWEN3_1P7B),
}


def compiled_memory(cfg, new: int, prompt: int = PROMPT, device=None) -> tuple[int, int]:
    """(temporaries, peak) in bytes of the update over two rows of prompt + new tokens,
    compiled for `device` (default this process's first device)."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    opt = U.make_optimizer(learning_rate=1e-6)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=new)
    update = U.make_update_fn(cfg, rl.preset("grpo", beta=0.04), opt, spec, micro_batches=2)
    state = abstract_state(cfg, opt, jnp.dtype(jnp.bfloat16), sharding)
    batch = abstract_batch(2, prompt, new, 2, sharding)
    mem = update.lower(state, batch).compile().memory_analysis()
    return mem.temp_size_in_bytes, peak_bytes(mem)


def tpu_chip(kind: str):
    """One chip of `kind` described by libtpu, to compile for (nothing runs)."""
    shape = "1x1x1" if kind == "v5p" else "1x1"
    return chips.topology_devices(chips.parse_topology(f"{kind}:{shape}"))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768", help="T, comma-separated")
    ap.add_argument("--paths", default="xla,blockwise")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block")
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row")
    ap.add_argument("--chip", default=None, help="v5e, v6e or v5p: XLA:TPU for one chip")
    args = ap.parse_args()
    device = tpu_chip(args.chip) if args.chip else None
    where = f"XLA:TPU, one {args.chip} chip" if args.chip else f"XLA:CPU, {device_name()}"
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = args.paths.split(",")
    print(
        f"{where}; {args.model} shapes, bfloat16, remat full; GRPO update, "
        f"one row of {args.prompt} + T tokens per micro-batch; compiled, not run; "
        f"block {args.block}",
        flush=True,
    )
    rows = []
    for t in lengths:
        new = t - args.prompt if t >= 32768 else t
        row = {"T": t, "tokens/row": args.prompt + new}
        for path in paths:
            arch, shapes = MODELS[args.model]
            cfg = models.ModelConfig(
                arch, remat="full", attention=path, attention_block=args.block, **shapes
            )
            start = time.perf_counter()
            try:
                temp, peak = compiled_memory(cfg, new, args.prompt, device)
            except jax.errors.JaxRuntimeError as err:  # XLA:TPU: more than the chip's HBM
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                need = re.search(r"temporaries \(([\d.]+)G\)", str(err))
                row[f"{path} GiB"] = float(need.group(1)) if need else float("nan")  # GiB
                row[f"{path} peak"] = "does not fit"
                print(f"  T={t} {path}: does not fit the chip: {str(err).splitlines()[0]}")
                continue
            row[f"{path} GiB"], row[f"{path} peak"] = temp / GiB, f"{peak / GiB:.2f}"
            print(
                f"  T={t} {path}: {temp / GiB:.2f} GiB temporaries, {peak / GiB:.2f} GiB peak "
                f"({time.perf_counter() - start:.0f} s to compile)",
                flush=True,
            )
        rows.append(row)
    for prev, row in zip(rows, rows[1:], strict=False):
        for path in paths:
            row[f"{path} growth"] = f"{row[f'{path} GiB'] / prev[f'{path} GiB']:.2f}x"
    for row in rows:
        for path in paths:
            row[f"{path} GiB"] = f"{row[f'{path} GiB']:.2f}"
    cols = ["T", "tokens/row"] + [f"{p} {c}" for p in paths for c in ("GiB", "growth", "peak")]
    print(table(rows, cols))


if __name__ == "__main__":
    main()

"""Compiled memory of the GRPO update against the sequence length, per attention path.

    python benchmarks/attention_memory.py                         # 1k 4k 16k 32k, xla + blockwise
    python benchmarks/attention_memory.py --lengths=1024,4096 --paths=blockwise

Compiles (never runs) the trainer's update program (`rl.make_update_fn`) for Qwen2.5-0.5B
shapes in bfloat16 with remat full, GRPO beta = 0.04, one row of 256 prompt + T
completion tokens per micro-batch (two rows, two micro-batches), from abstract arrays
(`lora_memory.abstract_state`): nothing is allocated, so lengths far beyond this
machine's memory compile. Prints XLA's `memory_analysis()` temporaries for each path and
length, and the growth of each path's temporaries from one length to the next. A length
of 32k counts the prompt in: T = 32768 - 256.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, table  # noqa: E402
from lora_memory import QWEN2P5_0P5B, abstract_batch, abstract_state  # noqa: E402

from jaxrl_llm import models, rl, sampling  # noqa: E402
from jaxrl_llm.rl import update as U  # noqa: E402

GiB = 2**30
PROMPT = 256


def compiled_temporaries(cfg, new: int) -> int:
    """Temporaries (bytes) of the compiled update over two rows of PROMPT + new tokens."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    opt = U.make_optimizer(learning_rate=1e-6)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=new)
    update = U.make_update_fn(cfg, rl.preset("grpo", beta=0.04), opt, spec, micro_batches=2)
    state = abstract_state(cfg, opt, jnp.dtype(jnp.bfloat16), sharding)
    batch = abstract_batch(2, PROMPT, new, 2, sharding)
    return update.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768", help="T, comma-separated")
    ap.add_argument("--paths", default="xla,blockwise")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = args.paths.split(",")
    print(
        f"device {device_name()}; Qwen2.5-0.5B shapes, bfloat16, remat full; GRPO update, "
        f"one row of {PROMPT} + T tokens per micro-batch; compiled, not run; "
        f"block {args.block}",
        flush=True,
    )
    rows = []
    for t in lengths:
        new = t - PROMPT if t >= 32768 else t
        row = {"T": t, "tokens/row": PROMPT + new}
        for path in paths:
            cfg = models.ModelConfig(
                "Qwen2ForCausalLM", remat="full", attention=path, attention_block=args.block,
                **QWEN2P5_0P5B,
            )  # fmt: skip
            start = time.perf_counter()
            row[f"{path} GiB"] = compiled_temporaries(cfg, new) / GiB
            print(f"  T={t} {path}: {row[f'{path} GiB']:.2f} GiB temporaries "
                  f"({time.perf_counter() - start:.0f} s to compile)", flush=True)  # fmt: skip
        rows.append(row)
    for prev, row in zip(rows, rows[1:], strict=False):
        for path in paths:
            row[f"{path} growth"] = f"{row[f'{path} GiB'] / prev[f'{path} GiB']:.2f}x"
    for row in rows:
        for path in paths:
            row[f"{path} GiB"] = f"{row[f'{path} GiB']:.2f}"
    cols = ["T", "tokens/row"] + [f"{p} {c}" for p in paths for c in ("GiB", "growth")]
    print(table(rows, cols))


if __name__ == "__main__":
    main()

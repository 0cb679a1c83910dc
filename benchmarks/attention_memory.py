"""Compiled memory of the GRPO update against the sequence length, per attention path.

    python benchmarks/attention_memory.py                         # 1k 4k 16k 32k, xla + blockwise
    python benchmarks/attention_memory.py --lengths=1024,4096 --paths=blockwise
    python benchmarks/attention_memory.py --model=qwen3-1.7b --prompt=1024 --lengths=16384

Compiles (never runs) the trainer's update program (`rl.make_update_fn`) for Qwen2.5-0.5B
(or --model) shapes in bfloat16 with remat full, GRPO beta = 0.04, one row of 256 prompt + T
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


def compiled_temporaries(cfg, new: int, prompt: int = PROMPT) -> int:
    """Temporaries (bytes) of the compiled update over two rows of prompt + new tokens."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    opt = U.make_optimizer(learning_rate=1e-6)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=new)
    update = U.make_update_fn(cfg, rl.preset("grpo", beta=0.04), opt, spec, micro_batches=2)
    state = abstract_state(cfg, opt, jnp.dtype(jnp.bfloat16), sharding)
    batch = abstract_batch(2, prompt, new, 2, sharding)
    return update.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768", help="T, comma-separated")
    ap.add_argument("--paths", default="xla,blockwise")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block")
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = args.paths.split(",")
    print(
        f"device {device_name()}; {args.model} shapes, bfloat16, remat full; GRPO update, "
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
            row[f"{path} GiB"] = compiled_temporaries(cfg, new, args.prompt) / GiB
            print(
                f"  T={t} {path}: {row[f'{path} GiB']:.2f} GiB temporaries "
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
    cols = ["T", "tokens/row"] + [f"{p} {c}" for p in paths for c in ("GiB", "growth")]
    print(table(rows, cols))


if __name__ == "__main__":
    main()

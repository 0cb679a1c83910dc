"""Rollout throughput: jaxrl_llm's sampler vs HF transformers `generate`, same weights.

    python benchmarks/sampler.py                       # ~25M Qwen3-like, CPU, batch 1/16/128
    python benchmarks/sampler.py --preset=0.5b --dtype=bfloat16 --batches=1,64,256   # GPU

Both sample at temperature 1 with no stop token, so every row generates exactly
--new tokens; new tokens/s = batch * new / seconds. HF runs with its KV cache on. Compile
time of the jitted sampler is reported separately (it is paid once per prompt bucket and
batch). Decode memory traffic per step = weights + the KV cache read; its bandwidth is
reported as a fraction of a measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, bool_flag, device_name, peak_memory, preset_config, table  # noqa: E402

from jaxrl_llm import models, sampling  # noqa: E402
from jaxrl_llm.parallel import allocator, xla_flags  # noqa: E402


def copy_bandwidth(nbytes: int = 1 << 28) -> float:
    """Measured bytes/s of a device-to-device copy (read + write counted)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    block(f(x))
    t0 = time.perf_counter()
    for _ in range(5):
        block(f(x))
    return 2 * nbytes * 5 / (time.perf_counter() - t0)


def bench_ours(cfg, params, prompts, new, repeats, cache_segments):
    kw = dict(max_new_tokens=new, temperature=1.0, seed=0, cache_segments=cache_segments)
    t0 = time.perf_counter()
    block(sampling.generate(cfg, params, prompts, step=0, **kw).tokens)
    first = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        out = block(sampling.generate(cfg, params, prompts, step=r + 1, **kw).tokens)
        times.append(time.perf_counter() - t0)
    assert out.shape == (len(prompts), new)
    return first, float(np.median(times))


def bench_hf(model, prompts, new, repeats):
    import torch

    ids = torch.tensor(np.asarray(prompts))
    model.generation_config.eos_token_id = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        times.append(time.perf_counter() - t0)
    assert out.shape[1] == ids.shape[1] + new
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="25m", choices=["25m", "100m", "0.5b"])
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--scan-layers",
        type=bool_flag,
        default=False,
        help="model.scan_layers (false: unrolled layers, one cache array per layer)",
    )
    ap.add_argument(
        "--cache-segments",
        type=int,
        default=sampling.CACHE_SEGMENTS,
        help="decode loops over a growing KV cache (rollout.cache_segments)",
    )
    args = ap.parse_args()

    cfg = dataclasses.replace(preset_config(args.preset), scan_layers=args.scan_layers)
    print(
        f"device {device_name()}; {args.preset} ({cfg.num_params() / 1e6:.1f}M params); "
        f"prompt {args.prompt}, {args.new} new tokens; {args.dtype}; "
        f"scan_layers {args.scan_layers}; cache segments {args.cache_segments}"
    )
    params = models.init_params(cfg, seed=0, dtype=args.dtype)
    hf = None
    if not args.no_torch:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        with tempfile.TemporaryDirectory() as d:  # the same weights in both
            models.save_hf(cfg, params, d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=getattr(torch, args.dtype)
            ).eval()
    bandwidth = copy_bandwidth()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * params["embed"].itemsize
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = np.random.RandomState(batch).randint(0, cfg.vocab_size, (batch, args.prompt))
        first, t = bench_ours(
            cfg, params, prompts.tolist(), args.new, args.repeats, args.cache_segments
        )
        # Mean bytes a decode step reads: all weights + the average filled KV cache.
        step_bytes = weight_bytes + batch * kv_per_token * (args.prompt + args.new / 2)
        row = {
            "batch": batch,
            "ours tok/s": f"{batch * args.new / t:,.0f}",
            "ours s": f"{t:.2f}",
            "compile s": f"{max(first - t, 0):.1f}",
            "decode BW": f"{step_bytes * args.new / t / bandwidth:.0%}",
        }
        if hf is not None:
            t_hf = bench_hf(hf, prompts, args.new, args.repeats)
            row |= {
                "HF tok/s": f"{batch * args.new / t_hf:,.0f}",
                "HF s": f"{t_hf:.2f}",
                "speedup": f"{t_hf / t:.1f}x",
            }
        rows.append(row)
        print(table(rows[-1:], list(row)), flush=True)
    cols = [
        "batch",
        "ours tok/s",
        "HF tok/s",
        "speedup",
        "ours s",
        "HF s",
        "compile s",
        "decode BW",
    ]
    print(table(rows, [c for c in cols if c in rows[0]]))
    print(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (decode BW is a fraction of it); "
        f"memory: {peak_memory()}"
    )


if __name__ == "__main__":
    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()  # as the trainer's command line does
    main()

"""LoRA rollouts: the sampler on merged weights (W + (alpha/r) A B once per call) against
unmerged adapters (x W + (x A) B at every token), same adapters, same draws.

    python benchmarks/lora_sampler.py              # ~25M Qwen3-like, CPU, batch 1/16/128

"merged" is the merge (timed on its own) plus a sampler run on the plain model;
"unmerged" is the sampler run on the adapted model. Both generate --new tokens per row
(no stop token). The trainer's `model.lora.sampler="auto"` follows this table
(`models.lora.sampler_mode`; docs/lora.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, bool_flag, device_name, preset_config, table, uptime  # noqa: E402

from jaxrl_llm import models, sampling  # noqa: E402
from jaxrl_llm.models import lora  # noqa: E402
from jaxrl_llm.parallel import allocator, xla_flags  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call s, median of `repeats` further calls s); fn(r) gets the call index."""
    t0 = time.perf_counter()
    block(fn(0))
    first = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        block(fn(r + 1))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="25m", choices=["25m", "100m", "0.5b"])
    ap.add_argument("--batches", default="1,4,16,128")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--scan-layers", type=bool_flag, default=False)
    args = ap.parse_args()

    base_cfg = dataclasses.replace(preset_config(args.preset), scan_layers=args.scan_layers)
    cfg = base_cfg.replace(lora=models.LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    print(
        f"device {device_name()}; {args.preset} ({base_cfg.num_params() / 1e6:.1f}M params), "
        f"LoRA rank {args.rank} on all projections; prompt {args.prompt}, {args.new} new "
        f"tokens; {args.dtype}; scan_layers {args.scan_layers}; {uptime()}"
    )
    base = models.init_params(base_cfg, seed=0, dtype=args.dtype)
    adapters = lora.init_adapters(cfg, seed=1, dtype=args.dtype)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B != 0: a trained adapter
    params = lora.combine(base, adapters)
    merge = lora.make_merge_fn(cfg)
    _, merge_s = timed(lambda r: merge(params), args.repeats)
    merged = merge(params)
    kw = dict(max_new_tokens=args.new, temperature=1.0, seed=0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = np.random.RandomState(batch).randint(0, base_cfg.vocab_size, (batch, args.prompt))
        prompts = prompts.tolist()

        def run(model_cfg, p, prompts=prompts):
            return lambda r: sampling.generate(model_cfg, p, prompts, step=r, **kw).tokens

        _, unmerged_s = timed(run(cfg, params), args.repeats)
        _, plain_s = timed(run(base_cfg, merged), args.repeats)
        row = {
            "batch": batch,
            "unmerged s": f"{unmerged_s:.2f}",
            "merge s": f"{merge_s:.3f}",
            "merged sampler s": f"{plain_s:.2f}",
            "merged total s": f"{merge_s + plain_s:.2f}",
            "unmerged / merged": f"{unmerged_s / (merge_s + plain_s):.2f}",
        }
        rows.append(row)
        print(table(rows[-1:], list(row)), flush=True)
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()
    main()

"""The paged engine streaming across training steps (`PagedSampler.stream`, what
rollout.mode=overlap / split run) against one `sample` call per step, and the static
sampler, on a long-tailed length mix; side by side in one process, runs interleaved.

    python benchmarks/engine_stream.py               # CPU: ~25M Qwen3-like, 4 steps
    python benchmarks/engine_stream.py --preset 100m --rows 512 --slots 128 --new 512 \\
        --page-size 64 --chunk-steps 16               # GPU / TPU (same script)

Each of --steps steps samples --rows completions (G = --generations) whose lengths are
forced as in benchmarks/engine.py: log-normal, median --new / 10, clipped to [1, --new],
given to the engine as per-row budgets (the static sampler runs each step with
max_new_tokens = its longest row, what it spends when its rows stop there).

- static: one static batch per step.
- paged per step: `sample` per step; each step's tail (its few long rows) decodes with
  the other slots empty.
- paged stream: one session; step s + 1's rows are queued while step s decodes (at most
  two steps in the engine: max_staleness 1, the parameters unchanged), so they take the
  slots step s's short rows leave.

All three get the same KV memory: --slots rows of bucket + --new tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, device_name, preset_config, table, uptime  # noqa: E402
from engine import lengths_mix, prompts  # noqa: E402

from jaxrl_llm import models, sampling  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="25m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64, help="completions per step (B * G)")
    ap.add_argument("--slots", type=int, default=16, help="engine slots = static batch rows")
    ap.add_argument("--generations", type=int, default=4, help="G")
    ap.add_argument("--new", type=int, default=96, help="max_new_tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    cfg = preset_config(args.preset)
    params = models.init_params(cfg, seed=0)
    G, N, K, slots = args.generations, args.rows, args.steps, args.slots
    batches = [prompts(N // G, cfg.vocab_size, 1 + s) for s in range(K)]
    bucket = max(sampling.bucket_length(int(m.sum(1).max())) for _, m in batches)
    mixes = [lengths_mix(N, args.new, 100 + s) for s in range(K)]
    spec = sampling.RolloutSpec(num_generations=G, max_new_tokens=args.new, temperature=1.0)
    kv_tokens = slots * (bucket + args.new)
    pages = 1 + kv_tokens // args.page_size
    useful = int(sum(m.sum() for m in mixes))
    print(
        f"{device_name()}; {uptime()}; {args.preset}, {K} steps of {N} rows (G={G}), "
        f"max_new_tokens {args.new}; lengths median {int(np.median(np.concatenate(mixes)))}"
        f", max {max(m.max() for m in mixes)}; KV {kv_tokens} tokens ({pages} pages of "
        f"{args.page_size}), {slots} slots"
    )

    engine = sampling.PagedSampler(
        cfg,
        slots=slots,
        pages=pages,
        page_size=args.page_size,
        chunk_steps=args.chunk_steps,
        prefill_chunk=args.prefill_chunk,
    )
    static = sampling.Sampler(cfg)
    per = slots // G  # prompts per static batch

    def run_static():
        for s, (ids, mask) in enumerate(batches):
            for b in range(0, N // G, per):
                longest = int(mixes[s][b * G : (b + per) * G].max())
                out = static.sample(
                    params,
                    ids[b : b + per],
                    mask[b : b + per],
                    spec.replace(max_new_tokens=longest),
                    step=s,
                )
                block(out.tokens)

    def run_per_step():
        for s, (ids, mask) in enumerate(batches):
            out = engine.sample(params, ids, mask, spec, step=s, budgets=mixes[s])
            block(out.tokens)
            assert (np.asarray(out.lengths) == mixes[s]).all()

    def run_stream():
        session = engine.stream(params, 0, spec, width=bucket, rows=N)
        queued, finished = 0, 0
        while finished < K:
            while queued < K and queued <= finished + 1:  # at most two steps in the engine
                ids, mask = engine.bucketed(*batches[queued])
                session.submit(queued, ids, mask, mixes[queued], key_base=queued * N)
                queued += 1
            for s in session.run_chunk():
                out, _ = session.output(s)
                assert (np.asarray(out.lengths) == mixes[s]).all()
                finished += 1
        run_stream.stats = session.stats

    runs = {"static": run_static, "paged per step": run_per_step, "paged stream": run_stream}
    for fn in runs.values():  # compile
        fn()
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rows = [
        dict(
            engine=name,
            **{
                "median s": f"{statistics.median(t):.2f}",
                "spread s": f"{min(t):.2f}-{max(t):.2f}",
                "useful tok/s": f"{useful / statistics.median(t):.0f}",
            },
        )
        for name, t in times.items()
    ]
    print(table(rows, ["engine", "median s", "spread s", "useful tok/s"]))
    for name in ("static", "paged per step"):
        ratios = [a / b for a, b in zip(times[name], times["paged stream"], strict=True)]
        pairs = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"paged stream / {name} useful tokens/s: median {statistics.median(ratios):.2f}x "
            f"(pairs: {pairs})"
        )
    print(f"paged per step (last step): {engine.stats}; stream: {run_stream.stats}")


if __name__ == "__main__":
    main()

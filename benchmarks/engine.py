"""The paged engine (`sampling.PagedSampler`) against the static sampler on a long-tailed
length mix, side by side in one process (runs interleaved: static, paged, static, ...).

    python benchmarks/engine.py                       # CPU: ~25M Qwen3-like, 128 rows
    python benchmarks/engine.py --model-path smollm2-135m-instruct   # the real SmolLM2
    python benchmarks/engine.py --preset 100m --rows 512 --batch 128 --new 512 \\
        --scales 1,2,4,8 --page-size 64 --chunk-steps 8,32    # GPU / TPU (same script)

(`engine_natural.py`: a real model's own lengths, every row in one static call.)

Lengths. A random model never stops where we want, so each row's completion length is
forced: drawn log-normal (median --new / 10, sigma 1, clipped to [1, --new]), so the
longest row is ~10x the median. The paged engine is given them as per-row budgets
(`budgets=`). The static sampler has no per-row budget, but its cost does not depend on
which rows stopped: its decode loop runs every row of the batch until the last one stops,
so each static batch is sampled with max_new_tokens = the longest length in it, which is
exactly what it spends when its rows stop at those lengths. Useful tokens are the forced
lengths' sum, the same for both. Each run is timed in wall-clock seconds and in the
process's CPU seconds (all its threads): on a machine shared with other jobs the CPU time
is the steadier measure of the work done.

Same KV memory: the static sampler runs the rows in batches of --batch (B * G rows), its
cache batch * (bucket + max_new_tokens) tokens; the engine gets a pool of the same number
of tokens and streams all --rows through it, with --slots decode slots (each listed count
runs as its own engine; default --batch). The static sampler cannot run more rows at once
in that memory, since each row reserves bucket + max_new_tokens; the engine's rows hold
only the pages they fill (a prompt's once for its G rows), so more of them fit the pool
at once, and a pool that runs short preempts its youngest rows (counted in the stats).

Attention paths (--attention): "pages" (each layer reads its pages in place, the
default) and "gather" (every layer's pages gathered into a dense block first, the
reference path); each listed one runs as its own engine in the same interleaved rounds.
Decode-step cost (--step-rows): one full decode step of that many rows at a few cached
lengths, static (`models.decode_step` over a KV cache) against paged (`forward_paged` of
one token per row over its pages, each path), interleaved, CPU seconds per step.

KV budget: at that fixed pool (the static cache for --new), the engine runs the same
mix scaled to max_new_tokens = --new x each of --scales (median and longest scale too);
the static sampler fits --new only (its cache grows with max_new_tokens). A scale
"fits" when every row completes; preempted rows (recomputed) are counted.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import block, device_name, preset_config, table, uptime  # noqa: E402

from jaxrl_llm import models, sampling  # noqa: E402
from jaxrl_llm.sampling import paged_programs as paged_lib  # noqa: E402


def lengths_mix(rows: int, new: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(new / 10 * rng.lognormal(0.0, 1.0, rows)), 1, new).astype(int)


def prompts(n: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    lists = [rng.integers(1, vocab, rng.integers(8, 25)).tolist() for _ in range(n)]
    return sampling.pad_prompts(lists, 0)


def step_costs(cfg, params, rows: int, cached: list[int], page_size: int, impls, repeats: int):
    """CPU seconds of one decode step of `rows` rows after `cached` tokens: static (the
    KV cache of cached + page_size slots) and paged per impl (a table of each row's own
    pages), medians of interleaved repeats -> list of table rows."""
    # Arguments, not closed over: a closed-over array would be a constant of the program.
    layers = None if cfg.scan_layers else models.layer_params(params)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def static_step(params, layers, cache):
        tokens = jnp.ones((rows,), jnp.int32)
        logits, cache = models.decode_step(cfg, params, tokens, cache, layers)
        return logits, cache

    @functools.partial(jax.jit, static_argnames=("impl",), donate_argnums=(2,))
    def paged_step(params, layers, pages, table, length, impl):
        tokens, start = jnp.ones((rows,), jnp.int32), jnp.zeros_like(length)
        hidden, pages, _, _ = paged_lib.forward_paged(
            cfg,
            params,
            pages,
            tokens[:, None],
            jnp.ones((rows, 1), bool),
            table,
            start,
            length,
            layers,
            impl,
        )
        return models.project(cfg, params, hidden[:, 0]), pages

    out = []
    for n in cached:
        M = -(-(n + 1) // page_size)
        cache = models.init_cache(cfg, rows, M * page_size)
        cache = cache.replace(
            valid=cache.valid.at[:, :n].set(True),
            index=jnp.int32(n),
            pos=jnp.full((rows,), n, jnp.int32),
        )
        ptable = jnp.arange(1, 1 + rows * M, dtype=jnp.int32).reshape(rows, M)
        length = jnp.full((rows,), n, jnp.int32)
        state = {"static": cache}  # each path its own pool (donated)
        state |= {i: paged_lib.init_pages(cfg, 1 + rows * M, page_size) for i in impls}

        def one(name, state=state, ptable=ptable, length=length):
            if name == "static":
                logits, state[name] = static_step(params, layers, state[name])
            else:
                logits, state[name] = paged_step(params, layers, state[name], ptable, length, name)
            return block(logits)

        cpu = {name: [] for name in state}
        for name in state:  # compile
            one(name)
        for _ in range(repeats):
            for name in state:
                c0 = time.process_time()
                one(name)
                cpu[name].append(time.process_time() - c0)
        base = statistics.median(cpu["static"])
        row = {"rows": rows, "cached": n, "static ms": f"{1e3 * base:.1f}"}
        for i in impls:
            ratios = [p / s for p, s in zip(cpu[i], cpu["static"], strict=True)]
            row[f"{i} ms"] = f"{1e3 * statistics.median(cpu[i]):.1f}"
            row[f"{i} / static"] = (
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(row, flush=True)
        out.append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="25m")
    ap.add_argument(
        "--model-path",
        default="",
        help="a model.path instead of --preset "
        "(e.g. smollm2-135m-instruct; random prompts from its vocabulary)",
    )
    ap.add_argument("--rows", type=int, default=128, help="completions in all (B * G)")
    ap.add_argument("--batch", type=int, default=32, help="static batch rows (cache = pool)")
    ap.add_argument("--generations", type=int, default=4, help="G")
    ap.add_argument("--new", type=int, default=128, help="max_new_tokens")
    ap.add_argument("--scales", default="1,2,4,8", help="max_new_tokens multiples (budget)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-steps", default="4,16", help="engines compared (the first: budget)")
    ap.add_argument(
        "--slots", default="", help="engine slots compared, e.g. 32,128 (default: --batch)"
    )
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--attention", default="pages", help="the engine's attention paths compared (pages, gather)"
    )
    ap.add_argument(
        "--step-rows",
        type=int,
        default=0,
        help="also time one decode step of this many rows (0: not)",
    )
    ap.add_argument("--step-cached", default="48,128", help="cached tokens of --step-rows")
    args = ap.parse_args(argv)

    if args.model_path:
        from jaxrl_llm.models import builtin

        path = builtin.resolve(args.model_path)
        cfg, params = builtin.load_model(path, None, "float32", scan_layers=False)
        args.preset = args.model_path
    else:
        cfg = preset_config(args.preset)
        params = models.init_params(cfg, seed=0)
    G, N, batch = args.generations, args.rows, args.batch
    ids, mask = prompts(N // G, cfg.vocab_size, 1)
    bucket = sampling.bucket_length(int(mask.sum(1).max()))
    lengths = lengths_mix(N, args.new, 2)
    spec = sampling.RolloutSpec(num_generations=G, max_new_tokens=args.new, temperature=1.0)
    static = sampling.Sampler(cfg)
    kv_tokens = batch * (bucket + args.new)
    pages = 1 + kv_tokens // args.page_size
    print(
        f"{device_name()}; {uptime()}; {args.preset}, {N} rows (G={G}), prompt bucket "
        f"{bucket}, max_new_tokens {args.new}; lengths median {int(np.median(lengths))}, "
        f"mean {lengths.mean():.1f}, max {lengths.max()}; KV {kv_tokens} tokens "
        f"({pages} pages of {args.page_size})"
    )

    chunks = [int(x) for x in args.chunk_steps.split(",")]
    impls = args.attention.split(",")
    if args.step_rows:
        rows = step_costs(
            cfg,
            params,
            args.step_rows,
            [int(x) for x in args.step_cached.split(",")],
            args.page_size,
            impls,
            max(3, args.repeats),
        )
        print(table(rows, list(rows[0])))

    slot_counts = [int(x) for x in args.slots.split(",")] if args.slots else [batch]

    def engine(chunk=chunks[0], impl=impls[0], slots=slot_counts[0]):
        return sampling.PagedSampler(
            cfg,
            slots=slots,
            pages=pages,
            page_size=args.page_size,
            chunk_steps=chunk,
            prefill_chunk=args.prefill_chunk,
            attention=impl,
        )

    engines = {
        f"paged ({i}), chunk {c}, {n} slots": engine(c, i, n)
        for i in impls
        for c in chunks
        for n in slot_counts
    }
    per = batch // G  # prompts per static batch

    def run_static():
        for b in range(0, N // G, per):
            longest = int(lengths[b * G : (b + per) * G].max())
            out = static.sample(
                params,
                ids[b : b + per],
                mask[b : b + per],
                spec.replace(max_new_tokens=longest),
                step=b,
            )
            block(out.tokens)

    def run_paged(eng, mix=lengths, s=spec):
        out = eng.sample(params, ids, mask, s, budgets=mix)
        block(out.tokens)
        assert (np.asarray(out.lengths) == mix).all()

    useful = int(lengths.sum())
    runs = {"static": run_static}
    runs |= {name: (lambda e=e: run_paged(e)) for name, e in engines.items()}
    for fn in runs.values():  # compile
        fn()
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    rows = [
        dict(
            engine=name,
            **{
                "median s": f"{statistics.median(t):.2f}",
                "spread s": f"{min(t):.2f}-{max(t):.2f}",
                "useful tok/s": f"{useful / statistics.median(t):.0f}",
                "median CPU s": f"{statistics.median(cpu[name]):.2f}",
                "useful tok/CPU s": f"{useful / statistics.median(cpu[name]):.0f}",
            },
        )
        for name, t in times.items()
    ]
    print(
        table(
            rows,
            ["engine", "median s", "spread s", "useful tok/s", "median CPU s", "useful tok/CPU s"],
        )
    )
    for name, eng in engines.items():
        for what, t in (("wall", times), ("CPU", cpu)):
            ratios = [s / p for s, p in zip(t["static"], t[name], strict=True)]
            pairs = ", ".join(f"{r:.2f}" for r in ratios)
            print(
                f"{name} / static useful tokens per {what} second: median "
                f"{statistics.median(ratios):.2f}x (pairs: {pairs})"
            )
        print(f"{name}: {eng.stats}; programs compiled: {sum(eng.traces.values())}")

    rows = []
    for scale in (int(x) for x in args.scales.split(",") if x):
        new = args.new * scale
        mix = lengths_mix(N, new, 2)
        eng = engine()
        s = spec.replace(max_new_tokens=new)
        static_fits = batch * (bucket + new) <= kv_tokens
        try:
            run_paged(eng, mix, s)  # compile
            t0 = time.perf_counter()
            run_paged(eng, mix, s)
            took, fits = time.perf_counter() - t0, "yes"
        except (ValueError, RuntimeError) as e:
            took, fits = float("nan"), f"no ({e})"
        rows.append(
            dict(
                max_new_tokens=new,
                median=int(np.median(mix)),
                longest=int(mix.max()),
                static=("fits" if static_fits else f"needs {batch * (bucket + new)} tokens"),
                paged=fits,
                preempted=eng.stats.get("preempted", ""),
                **{
                    "peak pages": eng.stats.get("peak_pages", ""),
                    "useful tok/s": f"{mix.sum() / took:.0f}",
                },
            )
        )
        print(f"max_new_tokens {new}: {rows[-1]}", flush=True)
    if not rows:
        return
    print(f"KV budget {kv_tokens} tokens, {slot_counts[0]} slots:")
    print(
        table(
            rows,
            [
                "max_new_tokens",
                "median",
                "longest",
                "static",
                "paged",
                "preempted",
                "peak pages",
                "useful tok/s",
            ],
        )
    )


if __name__ == "__main__":
    main()

"""The paged engine against the static sampler on a real model's own completion lengths,
every row in memory at once, as the trainer's sync step samples them (interleaved runs:
static, paged, static, ...).

    python benchmarks/engine_natural.py                  # SmolLM2-135M-Instruct, CPU
    python benchmarks/engine_natural.py --pieces         # + where each engine's time goes

`engine.py` forces each row's length and gives the static sampler a quarter of the rows at
a time; here the model decides. 16 chat prompts (half asking for just a number, half for
a step-by-step explanation, through the model's chat template) x G rows, temperature 1,
`max_new_tokens` 192, a row ending at the end-of-turn token. The static sampler gets all
B * G rows in one call (`rollout.engine=static`); the engine the trainer's defaults
(`rollout.engine=paged`: a slot per row, a pool of the static cache's tokens,
`chunk_steps` 16, `prefill_chunk` 64). Each round draws with its own step (the same for
both), so the rounds see different samples; useful tokens are the rows' lengths (the
end-of-turn token included, no padding), counted per run. Greedy (temperature 0) tokens
of the two are compared once.

--pieces: one more run of each with every device program timed on its own (blocking
after each, so the sum is a little above an unprofiled run): the engine's prefill
programs, its decode chunks by rows (live rows padded to `row_bucket`) and the host time
between them; the static sampler's one program. And one decode step of B * G rows,
static against paged, at a few cached lengths (`engine.step_costs`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import block, device_name, table, uptime  # noqa: E402
from engine import step_costs  # noqa: E402

from jaxrl_llm import sampling  # noqa: E402
from jaxrl_llm.config.derived import stop_ids  # noqa: E402
from jaxrl_llm.data.prompts import PromptBuilder  # noqa: E402
from jaxrl_llm.models import builtin  # noqa: E402

SHORT = [
    f"What is {a} + {b}? Answer with just the number."
    for a, b in [(17, 25), (38, 46), (59, 12), (73, 88), (24, 69), (91, 35), (46, 57), (62, 19)]
]
LONG = [
    "Explain step by step how to compute 23 * 17.",
    "Explain step by step why the sky is blue.",
    "Explain step by step how to make a cup of tea.",
    "Explain step by step how a bicycle stays upright.",
    "Explain step by step how to sort a list of numbers.",
    "Explain step by step why ice floats on water.",
    "Explain step by step how to find the area of a circle.",
    "Explain step by step how plants make food from sunlight.",
]


def lengths_line(lengths: np.ndarray, cap: int) -> str:
    return (
        f"min {lengths.min()}, median {int(np.median(lengths))}, max {lengths.max()}, "
        f"{100 * (lengths >= cap).mean():.0f}% at the cap"
    )


class Timed:
    """A jitted program wrapped to block on its result and record seconds by a key
    (`key(args, kwargs)`), with the host time between programs."""

    def __init__(self, fn, key, log):
        self.fn, self.key, self.log = fn, key, log

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = block(self.fn(*args, **kwargs))
        self.log[self.key(args, kwargs)].append(time.perf_counter() - t0)
        return out


def pieces(static, eng, params, ids, mask, spec, step) -> list[dict]:
    """One run of each engine with its device programs timed -> table rows."""
    log = collections.defaultdict(list)
    decode, prefill = eng.decode, eng.prefill
    eng.decode = Timed(decode, lambda a, k: f"paged decode chunk, {a[2].tokens.shape[0]} rows", log)
    eng.prefill = Timed(prefill, lambda a, k: f"paged prefill, {a[4].shape} tokens", log)
    try:
        t0 = time.perf_counter()
        eng.sample(params, ids, mask, spec, step=step)
        paged_total = time.perf_counter() - t0
    finally:
        eng.decode, eng.prefill = decode, prefill
    t0 = time.perf_counter()
    block(static.sample(params, ids, mask, spec, step=step).tokens)
    static_total = time.perf_counter() - t0
    rows = [
        {"piece": k, "calls": len(v), "s": f"{sum(v):.2f}", "s per call": f"{np.mean(v):.3f}"}
        for k, v in sorted(log.items())
    ]
    device = sum(sum(v) for v in log.values())
    rows.append({"piece": "paged host (between programs)", "s": f"{paged_total - device:.2f}"})
    rows.append({"piece": "paged total", "s": f"{paged_total:.2f}"})
    rows.append({"piece": "static (one program)", "calls": 1, "s": f"{static_total:.2f}"})
    print(f"paged stats: {eng.stats}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="smollm2-135m-instruct")
    ap.add_argument("--generations", type=int, default=4, help="G")
    ap.add_argument("--new", type=int, default=192, help="max_new_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after a compiling one")
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pieces", action="store_true", help="also time each engine's pieces")
    ap.add_argument("--step-cached", default="64,192", help="cached tokens of the step costs")
    args = ap.parse_args(argv)

    path = builtin.resolve(args.model_path)
    cfg, params = builtin.load_model(path, None, "float32", scan_layers=False)
    tokenizer = builtin.load_tokenizer(path)
    build = PromptBuilder(tokenizer, "{question}", chat_template="always", max_len=128)
    ids, mask = sampling.pad_prompts([build({"question": q})[1] for q in SHORT + LONG], 0)
    G, T = args.generations, args.new
    N = ids.shape[0] * G
    spec = sampling.RolloutSpec(
        num_generations=G,
        max_new_tokens=T,
        temperature=1.0,
        stop_ids=stop_ids(tokenizer, ("<eos>",)),
    )
    static = sampling.Sampler(cfg)
    eng = sampling.PagedSampler(
        cfg,
        page_size=args.page_size,
        chunk_steps=args.chunk_steps,
        prefill_chunk=args.prefill_chunk,
    )
    bucket = static.bucketed(ids, mask)[0].shape[1]
    print(
        f"{device_name()}; {uptime()}; {args.model_path}, {ids.shape[0]} prompts x G={G} = "
        f"{N} rows, prompt bucket {bucket}, max_new_tokens {T}, temperature 1, stop "
        f"{spec.stop_ids}; KV {N * (bucket + T)} tokens for both; engine chunk_steps "
        f"{args.chunk_steps}, prefill_chunk {args.prefill_chunk}, page_size {args.page_size}",
        flush=True,
    )

    def run(name, step, s=spec):
        sampler = static if name == "static" else eng
        out = sampler.sample(params, ids, mask, s, step=step)
        return np.asarray(block(out).tokens), np.asarray(out.lengths)

    t0 = time.perf_counter()
    for name in ("static", "paged"):  # compile
        run(name, 0)
        print(f"compiled {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    times = {"static": [], "paged": []}
    useful = {"static": [], "paged": []}
    lengths = {"static": [], "paged": []}
    for r in range(args.repeats):
        for name in times:
            t0 = time.perf_counter()
            _, n = run(name, 1 + r)
            times[name].append(time.perf_counter() - t0)
            useful[name].append(int(n.sum()))
            lengths[name].append(n)
            print(
                f"round {r} {name}: {times[name][-1]:.2f} s, {n.sum()} tokens "
                f"({useful[name][-1] / times[name][-1]:.0f}/s); lengths {lengths_line(n, T)}",
                flush=True,
            )
    rate = {k: [u / t for u, t in zip(useful[k], times[k], strict=True)] for k in times}
    rows = [
        {
            "engine": k,
            "s": f"{statistics.median(times[k]):.2f} ({min(times[k]):.2f}-{max(times[k]):.2f})",
            "useful tokens/s": f"{statistics.median(rate[k]):.0f} "
            f"({min(rate[k]):.0f}-{max(rate[k]):.0f})",
            "lengths": lengths_line(np.concatenate(lengths[k]), T),
        }
        for k in times
    ]
    print(table(rows, ["engine", "s", "useful tokens/s", "lengths"]))
    ratios = [p / s for p, s in zip(rate["paged"], rate["static"], strict=True)]
    print(
        f"paged / static useful tokens/s per round: median {statistics.median(ratios):.2f}x "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); paged stats: {eng.stats}"
    )

    greedy = spec.replace(temperature=0.0)
    (a, la), (b, lb) = run("static", 0, greedy), run("paged", 0, greedy)
    same = [bool((a[i] == b[i]).all()) and la[i] == lb[i] for i in range(N)]
    print(
        f"greedy: {sum(same)} / {N} rows with equal tokens and lengths; lengths "
        f"{lengths_line(la, T)}",
        flush=True,
    )

    if args.pieces:
        print(
            table(
                pieces(static, eng, params, ids, mask, spec, 1),
                ["piece", "calls", "s", "s per call"],
            )
        )
        rows = step_costs(
            cfg,
            params,
            N,
            [int(x) for x in args.step_cached.split(",")],
            args.page_size,
            ["pages"],
            3,
        )
        print(table(rows, list(rows[0])))
    print(uptime())


if __name__ == "__main__":
    main()

"""Multi-turn rollouts with a slow environment: the static turn loop (`envs.play`) against
the paged engine (`envs.play` on either), side by side in one process, runs interleaved.

    python benchmarks/engine_multiturn.py                  # CPU: ~25M Qwen3-like, 64 rows
    python benchmarks/engine_multiturn.py --model-path smollm2-135m-instruct  # the real SmolLM2
    python benchmarks/engine_multiturn.py --preset 100m --rows 512 --batch 64 \\
        --turn-tokens 256 --page-size 64 --chunk-steps 16 --workers 128   # GPU / TPU

The environment (`tests/envs_for_tests.py:Sleepy`) sleeps --delay seconds per step (0.2:
a tool call, a sandboxed test run) and ends a trajectory after --turns actions, with
observations of a few characters between turns. Turn lengths are long-tailed: the random
model (vocabulary: the arithmetic tokenizer's 33 tokens) ends a turn when it draws one of
--stop-ids ids, which it does every ~20-40 tokens, so most turns are short and a few run
to --turn-tokens. With --model-path (a real instruct model such as SmolLM2-135M-Instruct)
the prompts and observations are rendered with its chat template, and a turn ends where
the model ends its message (its end-of-turn token), so the lengths are the model's own.

Static: the turn loop plays --batch rows at a time (B prompts x G), each turn decoding
until its slowest row is done, then stepping every environment while the batch waits; the
--rows trajectories are played batch after batch. Engine: --slots slots (default --batch;
each listed count runs as its own engine)
over a page pool of the static cache's tokens (batch * (prompt bucket +
max_total_tokens)), all --rows trajectories submitted at once: a row whose turn ends
leaves its slot to a waiting row and its environment steps in a thread while the others
decode. More slots than static rows fit the same pool because a row holds only the pages
it fills; when the pool runs short, rows are evicted and recomputed (counted in stats).
Both step the same environment pool (--workers processes, in --lanes lanes that step at
once). Trajectories/s = --rows / wall
seconds, after --warmup rounds of each (the engine's programs compile for the row counts
and page-table widths its schedule meets; a round that still compiles says so in its
line).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import device_name, preset_config, table, uptime  # noqa: E402

from jaxrl_llm import assets, envs, models, sampling  # noqa: E402
from jaxrl_llm.models import builtin  # noqa: E402

SLEEPY = os.path.join(os.path.dirname(HERE), "tests", "envs_for_tests.py") + ":Sleepy"
TOKENIZER = os.path.join(os.path.dirname(assets.__file__), "arithmetic_tokenizer")


def examples(rows: int, turns: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    ops = "+-*"
    return [
        {"question": f"{rng.integers(1, 99)}{ops[i % 3]}{rng.integers(1, 99)}=", "turns": turns}
        for i in range(rows)
    ]


def run(player, engine, params, pool, rows, per_call, G, spec, settings, renderer, tok, step):
    """One round: the G trajectories of every example of `rows`, `per_call` examples per
    `player` call -> (seconds, sampled tokens, model turns)."""
    t0 = time.perf_counter()
    sampled = turns = 0
    for at in range(0, len(rows), per_call):
        trajs, observations = pool.reset(rows[at : at + per_call])
        ids, mask = sampling.pad_prompts([renderer.prompt(o) for o in observations], 0)
        trajs, _ = envs.replicate(trajs, observations, G)
        out, record = player(
            engine, params, ids, mask, spec, settings, pool, trajs, renderer, tok, step=step
        )
        sampled += int(np.asarray(out.loss_mask).sum())
        turns += int(record.model_turns.sum())
    return time.perf_counter() - t0, sampled, turns


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="25m")
    ap.add_argument(
        "--model-path",
        default="",
        help="a model.path instead of --preset (e.g. smollm2-135m-instruct: its tokenizer, "
        "chat template and end-of-turn token)",
    )
    ap.add_argument("--rows", type=int, default=64, help="trajectories in all (B * G)")
    ap.add_argument("--batch", type=int, default=16, help="static batch rows (cache = pool)")
    ap.add_argument("--slots", default="", help="engine slots compared (default: --batch)")
    ap.add_argument(
        "--unrolled", action="store_true", help="scan_layers=False (the CPU configs' choice)"
    )
    ap.add_argument("--generations", type=int, default=4, help="G")
    ap.add_argument("--turns", type=int, default=3, help="actions per trajectory")
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--stop-ids", default="20", help="ids that end a turn")
    ap.add_argument("--delay", type=float, default=0.2, help="seconds per environment step")
    ap.add_argument("--workers", type=int, default=32, help="environment worker processes")
    ap.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="EnvPool lanes: steps that run at once (the workers split among them)",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="rounds not timed (they compile the shapes the schedule meets)",
    )
    args = ap.parse_args(argv)

    if args.model_path:
        path = builtin.resolve(args.model_path)
        cfg, params = builtin.load_model(path, None, "float32", scan_layers=not args.unrolled)
        tok = builtin.load_tokenizer(path)
        stops = (int(tok.eos_token_id),)
        obs_tokens = 32  # an observation inside the chat template's turn markers
    else:
        tok = builtin.load_tokenizer(TOKENIZER)
        cfg = dataclasses.replace(
            preset_config(args.preset), vocab_size=len(tok), scan_layers=not args.unrolled
        )
        params = models.init_params(cfg, seed=0)
        stops = tuple(int(s) for s in args.stop_ids.split(","))
        obs_tokens = 16
    G = args.generations
    renderer = envs.Renderer(tok, use_chat=bool(args.model_path))
    rows = examples(args.rows // G, args.turns, seed=0)
    total = args.turns * args.turn_tokens + (args.turns - 1) * obs_tokens
    settings = envs.TurnSettings(
        max_turns=args.turns, turn_tokens=args.turn_tokens, max_total_tokens=total, stop_ids=stops
    )
    spec = sampling.RolloutSpec(G, args.turn_tokens, temperature=1.0, stop_ids=stops)
    static = sampling.Sampler(cfg, cache_segments=1)
    bucket = sampling.bucket_length(max(len(renderer.prompt(r["question"])) for r in rows))
    pages = 1 + -(-args.batch * (bucket + total) // args.page_size)
    slot_counts = [int(x) for x in args.slots.split(",")] if args.slots else [args.batch]
    engines = {
        f"paged, {n} slots": sampling.PagedSampler(
            cfg,
            slots=n,
            pages=pages,
            page_size=args.page_size,
            chunk_steps=args.chunk_steps,
            prefill_chunk=args.prefill_chunk,
        )
        for n in slot_counts
    }
    players = {"static": (envs.play, static, args.batch // G)}
    players |= {name: (envs.play, e, len(rows)) for name, e in engines.items()}
    results = {name: [] for name in players}
    print(
        f"# {device_name()}; {args.model_path or args.preset}; {args.rows} trajectories of "
        f"{args.turns} turns (<= "
        f"{args.turn_tokens} tokens), env step {args.delay} s, {args.batch} static rows, "
        f"engine slots {slot_counts}, pool {pages} pages x {args.page_size}"
    )
    with envs.EnvPool(
        SLEEPY, {"delay_s": args.delay}, workers=args.workers, lanes=args.lanes
    ) as pool:
        for r in range(args.warmup + args.repeats):
            for name, (player, engine, per_call) in players.items():
                got = run(
                    player,
                    engine,
                    params,
                    pool,
                    rows,
                    per_call,
                    G,
                    spec,
                    settings,
                    renderer,
                    tok,
                    step=r,
                )
                if r >= args.warmup:
                    results[name].append(got)
                print(
                    f"round {r} {name}: {got[0]:.2f} s, {got[2]} turns, {got[1]} tokens, "
                    f"{sum(engine.traces.values())} programs traced so far",
                    flush=True,
                )
    for name, e in engines.items():
        print(f"# {name}, its last run: {e.stats}; {uptime()}")
    table_rows = []
    for name, runs in results.items():
        seconds = [s for s, _, _ in runs]
        rates = [args.rows / s for s in seconds]
        table_rows.append(
            {
                "engine": name,
                "median s": f"{statistics.median(seconds):.2f}",
                "spread s": f"{min(seconds):.2f}-{max(seconds):.2f}",
                "trajectories/s": f"{statistics.median(rates):.2f}",
                "turn tokens (median)": (
                    f"{statistics.median(t / max(n, 1) for _, t, n in runs):.1f}"
                ),
            }
        )
    print(
        table(
            table_rows, ["engine", "median s", "spread s", "trajectories/s", "turn tokens (median)"]
        )
    )
    for name in engines:
        ratios = [
            s / p for (s, _, _), (p, _, _) in zip(results["static"], results[name], strict=True)
        ]
        print(
            f"{name} / static trajectories/s per round: "
            f"{', '.join(f'{x:.2f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.2f}x)"
        )


if __name__ == "__main__":
    main()

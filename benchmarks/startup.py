"""Start-up of `python -m jaxrl_llm.train`: cold (empty compilation cache) and warm (a rerun).

    python benchmarks/startup.py                               # the quickstart, CPU
    python benchmarks/startup.py --config=../shared/anchors/jaxrl_w1_config.py \
        --auto=optim.micro_batches --steps=11                  # W1, with later steps timed

Each repeat runs the trainer twice as a user would, each time in a fresh process and a
fresh workdir: cold, with a new empty `train.compilation_cache_dir`, then warm, with the
cache the cold run filled. Reported per run, from the trainer's own metrics.jsonl (its
records are timestamped as they appear) and its output lines:

- start-up: launch -> the first step begins (imports, model, programs compiled before the
  first step, and an evaluation at step 0 when the config schedules one);
- first step: its `perf/step_s`; start-up + first step is the time to the first update;
  with --steps >= 2 also the time to the second (the reference of a fresh run is built
  once the first step is done: its update does not read it);
- compile: the start-up compilation's wall time (its summary line), or XLA compile time
  inside the first step (`perf/compile_s`) for a trainer that compiles there;
- per program: the trainer's "compiling NAME (DETAIL)... S s" lines (warm: "loading
  NAME (DETAIL)... S s (stored executable)");
- with --steps > 2: the median `perf/step_s` of steps 2.. (later steps) and the peak RSS of
  the trainer process (getrusage of the finished child).

`--separately` measures instead each program of the first step (and evaluation's) on its
own: lowered and compiled one after another in a fresh process with no cache (seconds to
trace, lower and compile each), the cost the side-by-side start-up spreads over the cores.

Medians and spreads over the runs are printed at the end. `--warm-runs=N` reruns N times
per cold run. `--src=DIR` runs the trainer from another checkout (PYTHONPATH);
`--src=A,B` runs several, alternating run by run (each with its own cache), and reports
each apart; so does `--xla-flags=F` given more than once (each the whole XLA_FLAGS of one
variant, crossed with the checkouts); `--no-cache` for a trainer without the cache key;
`--auto=KEY,...` leaves those keys to the trainer's start-up defaults even where the
config sets them; any other `--config.*` argument is passed on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import config_wrapper, device_name, table, uptime  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(
    r"(?:compiling|loading) (.+?)\.\.\. ([0-9.]+) s( \((?:compilation cache|stored"
    r" executable)\))?"
)
READY = re.compile(r"programs ready in ([0-9.]+) s")

AUTO = """    for key in {keys!r}:
        section, name = key.split(".")
        c[section][name] = None
"""


def _watch(path: str, records: list, stop: threading.Event) -> None:
    """Appends (seconds since the epoch when seen, record) for each new metrics line."""
    pos, buf = 0, b""
    while True:
        done = stop.is_set()
        if os.path.exists(path) and os.path.getsize(path) > pos:
            now = time.time()
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    records.append((now, json.loads(line)))
        if done:
            return
        time.sleep(0.01)


def run_once(args, src, config, cache, workdir, extra, xla_flags=None) -> dict:
    """One trainer process, from the checkout `src` with `config` (+ the `--config.*`
    arguments `extra`), the compilation cache `cache` (None: no cache key) and XLA_FLAGS
    `xla_flags` (None: this process's own) -> its start-up figures."""
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_llm.train",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.train.num_steps={args.steps}",
        *extra,
    ]
    if cache is not None:
        cmd.append(f"--config.train.compilation_cache_dir={cache}")
    env = dict(os.environ, PYTHONPATH=src, TOKENIZERS_PARALLELISM="false")
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    records, stop = [], threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(os.path.join(workdir, "metrics.jsonl"), records, stop)
    )
    watcher.start()
    log = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")
    with open(log, "w") as out:
        launch = time.time()
        # `python -m` puts the working directory first on sys.path: run in --src's checkout.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=src)
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak memory
    stop.set()
    watcher.join()
    with open(log, encoding="utf-8", errors="replace") as f:
        text = f.read().replace("\r", "\n")
    if status:
        sys.exit(f"trainer failed (status {status}):\n{text[-4000:]}")
    steps = [(seen, r) for seen, r in records if "perf/step_s" in r]
    seen, first = steps[0]
    programs, hits = {}, 0
    for m in LINE.finditer(text):
        programs[m.group(1)] = float(m.group(2))
        hits += bool(m.group(3))
    ready = READY.search(text)
    out = {
        "start-up s": seen - launch - first["perf/step_s"],
        "first step s": first["perf/step_s"],
        "to first update s": seen - launch,
        "compile s": float(ready.group(1)) if ready else first.get("perf/compile_s", 0.0),
        "cache hits": hits,
        "programs": programs,
    }
    if len(steps) > 1:  # what a program built after the first step costs the second
        out["to second update s"] = steps[1][0] - launch
    later = [r["perf/step_s"] for _, r in steps[1:]]
    if later:
        out["later steps s"] = float(np.median(later))
        out["peak RSS GiB"] = usage.ru_maxrss / 2**20
    return out


def programs_child(argv: list[str]) -> None:
    """In the child process: the run's programs compiled one by one, a line each, with the
    XLA flags the trainer's command line sets."""
    from absl import flags
    from ml_collections import config_flags

    from jaxrl_llm.parallel import xla_flags

    xla_flags.set_cpu_defaults()
    from jaxrl_llm import train
    from jaxrl_llm.startup import compilation, precompile

    config_flags.DEFINE_config_file("config", None, "run config", lock_config=False)
    flags.FLAGS([sys.argv[0], *argv])
    config = flags.FLAGS.config
    config.train.compilation_cache_dir = ""
    compilation.use_cache("")
    with tempfile.TemporaryDirectory() as workdir:
        run = train.Run.build(config, workdir)
        print(run.tuning_line, flush=True)
        run.compile_log.listen(lambda line: print(line, flush=True))
        precompile.precompile_step(run, side_by_side=False)
        run.close()


def separately(args, src: str, config: str, extra: list[str]) -> None:
    """--separately: per program, median [min, max] seconds over the repeats."""
    cmd = [sys.executable, os.path.abspath(__file__), "--programs-child", f"--config={config}"]
    env = dict(os.environ, PYTHONPATH=src, TOKENIZERS_PARALLELISM="false")
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        out = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, check=True)
        print(out.stdout.strip(), flush=True)
        for m in LINE.finditer(out.stdout):
            seconds.setdefault(m.group(1), []).append(float(m.group(2)))
    rows = [{"program": k, "trace + lower + compile s": _spread(v)} for k, v in seconds.items()]
    print(f"\n{uptime()}")
    print(table(rows, list(rows[0])))


def main() -> None:
    if sys.argv[1:2] == ["--programs-child"]:
        return programs_child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.py"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="steps per run (> 2: later steps timed)")
    p.add_argument("--src", default=ROOT, help="the checkout(s) whose trainer runs, a,b,...")
    p.add_argument("--warm-runs", type=int, default=1, help="warm reruns per cold run")
    p.add_argument("--no-cache", action="store_true", help="a trainer without the cache key")
    p.add_argument("--auto", default="", help="config keys left to the start-up defaults")
    p.add_argument("--separately", action="store_true", help="each program compiled alone")
    p.add_argument("--xla-flags", action="append", help="XLA_FLAGS of one variant (repeatable)")
    args, extra = p.parse_known_args()
    if bad := [a for a in extra if not a.startswith("--config.")]:
        p.error(f"unknown arguments {bad}")
    print(f"device: {device_name()}; {uptime()}", flush=True)
    checkouts = [os.path.abspath(s) for s in args.src.split(",") if s]
    flag_sets = args.xla_flags or [None]
    # A variant = a checkout and an XLA_FLAGS (None: this process's own).
    variants = [(src, f) for src in checkouts for f in flag_sets]
    short = [os.path.basename(s) or s for s in checkouts]
    short = short if len(set(short)) == len(short) else checkouts
    names = [
        " ".join(
            x
            for x in (
                short[checkouts.index(src)] if len(checkouts) > 1 else "",
                f"[{f}]" if len(flag_sets) > 1 else "",
            )
            if x
        )
        for src, f in variants
    ]
    where = ", ".join(checkouts)
    print(f"trainer from {where}; config {args.config} {' '.join(extra)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        config = os.path.abspath(args.config)
        if args.auto:
            config = os.path.join(tmp, "config.py")
            keys = tuple(k for k in args.auto.split(",") if k)
            with open(config, "w") as f:
                f.write(config_wrapper(os.path.abspath(args.config), AUTO.format(keys=keys)))
        if args.separately:
            return separately(args, checkouts[0], config, extra)
        # Several variants alternate run by run: the machine's drift reaches them alike.
        order = [("cold", 0)] + [("warm", w) for w in range(args.warm_runs)]
        for i in range(args.repeats):
            for kind, w in order:
                for s, (src, flags) in enumerate(variants):
                    cache = None if args.no_cache else os.path.join(tmp, f"xla{i}_{s}")
                    workdir = os.path.join(tmp, f"{kind}{i}_{w}_{s}")
                    r = run_once(args, src, config, cache, workdir, extra, flags)
                    programs = ", ".join(f"{k} {v:.1f}" for k, v in r.pop("programs").items())
                    label = f"{kind} {i + 1}"
                    label += f".{w + 1}" if kind == "warm" and args.warm_runs > 1 else ""
                    label += f" {names[s]}" if len(variants) > 1 else ""
                    rows.append({"run": label} | {k: _fmt(v) for k, v in r.items()})
                    rows[-1]["programs (s)"] = programs
                    print(table(rows[-1:], list(rows[-1])), flush=True)
    print(f"\n{uptime()}")
    print(table(rows, list(rows[0])))
    print("\nmedian [min, max] over runs:")
    for kind in ("cold", "warm"):
        for name in names if len(variants) > 1 else [""]:
            mine = [r for r in rows if r["run"].startswith(kind) and r["run"].endswith(name)]
            if not mine:  # --warm-runs=0
                continue
            keys = [k for k in mine[0] if k not in ("run", "programs (s)", "cache hits")]
            summary = "; ".join(f"{k} {_spread([float(r[k]) for r in mine])}" for k in keys)
            print(f"{kind} {name}".strip() + f": {summary}")


def _fmt(v):
    return f"{v:.2f}" if isinstance(v, float) else v


def _spread(values) -> str:
    return f"{np.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


if __name__ == "__main__":
    main()

"""The quickstart in split mode, once with its rollout mesh in the trainer's process and
once through two rollout worker processes (`rollout.workers=2`, each its own JAX world),
per engine: the curves, the staleness and the samples side by side.

    python benchmarks/workers_curve.py                 # 300 steps, static then paged
    python benchmarks/workers_curve.py --steps=100 --eval_every=25 --engines=paged

One process (--devices fake CPU devices, default 4): split mode, the last half of them
the rollout mesh. Through workers: a trainer process of the other half (every device
trains, `mesh.rollout_devices=0`) and two worker processes (`python -m
jaxrl_llm.workers.serve`, the same config, `--worker_devices` fake devices each, the
rollout mesh's shape), started on this machine with a fresh token and stopped after the
run. Both runs use the same seed and record every row of every step (samples.jsonl), so
the table says whether the rollouts, the eval pass@1 at each eval step (greedy), the
rewards and each step's staleness are the same. A step's staleness (the update's version
minus the version that sampled its batch) is decided by which side gets there first, so
with `--max_staleness` > 0 two runs can differ where the timing does; at 0 the schedule
is fixed. The one-process split run's trainer is a process of more devices than the
worker run's, and XLA:CPU may round its update differently (docs/workers.md);
`--reference=sync --max_staleness=0` (static) compares instead with a synchronous run in
a process of the trainer's devices alone: the same schedule in the same trainer world;
`--reference=overlap` (paged, whose stream draws other keys than its per-step sample)
with the paged stream on that process's training mesh, a bound of 1.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, uptime  # noqa: E402

from jaxrl_llm.trainer.metrics import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_for(devices: int, token: str) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=ROOT,
        TOKENIZERS_PARALLELISM="false",
        JAX_PLATFORMS="cpu",
        JAXRL_WORKER_TOKEN=token,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )


def start_workers(args, engine: str, token: str) -> list:
    """Two worker processes -> [(process, address)], once each listens."""
    cmd = [sys.executable, "-m", "jaxrl_llm.workers.serve", f"--config={args.config}"]
    cmd += ["--port=0", f"--config.rollout.engine={engine}"]
    procs = [
        subprocess.Popen(
            cmd,
            env=env_for(args.worker_devices, token),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(args.workers)
    ]
    started = []
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("worker listening on "):
            for q in procs:
                q.kill()
            raise RuntimeError(f"a worker did not start: {line!r}")
        started.append((p, line.split()[-1]))
    return started


def train(args, engine: str, workdir: str, token: str, addresses: list[str]) -> float:
    """One run -> its wall seconds (start-up and compiles included)."""
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={args.config}"]
    cmd += [
        f"--workdir={workdir}",
        f"--config.train.num_steps={args.steps}",
        f"--config.eval.every={args.eval_every}",
        "--config.train.log_every=1",
        "--config.train.print_samples_every=1",
        "--config.train.num_printed_samples=100000",  # every row of every step
        "--config.checkpoint.every=0",
        "--config.rollout.mode=split",
        f"--config.rollout.max_staleness={args.max_staleness}",
        f"--config.rollout.engine={engine}",
    ]
    if addresses:
        devices = args.devices - args.worker_devices
        cmd += [
            "--config.mesh.rollout_devices=0",
            f"--config.rollout.workers={len(addresses)}",
            f"--config.rollout.worker_addresses={','.join(addresses)}",
        ]
    elif args.reference in ("sync", "overlap"):  # the trainer's world alone
        devices = args.devices - args.worker_devices
        cmd += [f"--config.rollout.mode={args.reference}"]
    else:
        devices = args.devices
        cmd += [f"--config.mesh.rollout_devices={args.worker_devices}"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env_for(devices, token), cwd=ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall


def summary(workdir: str) -> dict:
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    steps = [r for r in records if "reward/mean" in r]
    return dict(
        eval={r["step"]: r["eval/pass@1"] for r in records if "eval/pass@1" in r},
        reward=np.array([r["reward/mean"] for r in steps]),
        staleness=np.array([r.get("rollout/staleness_max", 0.0) for r in steps]),
        samples=[
            (r["step"], r["prompt"], r["completion"], r["reward"])
            for r in read_metrics(os.path.join(workdir, "samples.jsonl"))
        ],
    )


def compare(engine: str, local: dict, remote: dict) -> list[dict]:
    """The rows of one engine's table: each eval step, then the run's totals."""
    rows = [
        {
            "engine": engine,
            "": f"eval/pass@1 step {s}",
            "one process": f"{p:.3f}",
            "2 workers": f"{remote['eval'].get(s, float('nan')):.3f}",
        }
        for s, p in sorted(local["eval"].items())
    ]
    q = max(1, len(local["reward"]) // 4)
    for name, f in [
        (f"reward/mean, first {q} steps", lambda r: r["reward"][:q].mean()),
        (f"reward/mean, last {q} steps", lambda r: r["reward"][-q:].mean()),
        (
            "staleness max (mean)",
            lambda r: f"{r['staleness'].max():.0f} ({r['staleness'].mean():.2f})",
        ),
        ("rows in samples.jsonl", lambda r: len(r["samples"])),
        ("wall s", lambda r: r["wall"]),
    ]:
        a, b = f(local), f(remote)
        fmt = (lambda x: f"{x:.3f}") if isinstance(a, float) else str
        rows.append({"engine": engine, "": name, "one process": fmt(a), "2 workers": fmt(b)})
    same_rows = sum(x == y for x, y in zip(local["samples"], remote["samples"], strict=False))
    first = next(
        (x[0] for x, y in zip(local["samples"], remote["samples"], strict=False) if x != y), None
    )
    same_staleness = int((local["staleness"] == remote["staleness"]).sum())
    n = len(local["staleness"])
    rows.append(
        {
            "engine": engine,
            "": "rows equal (first step that differs)",
            "2 workers": f"{same_rows}/{len(local['samples'])} ({first or '-'})",
        }
    )
    rows.append(
        {
            "engine": engine,
            "": "steps with the same staleness",
            "2 workers": f"{same_staleness}/{n}",
        }
    )
    rows.append(
        {
            "engine": engine,
            "": "reward/mean max |diff| over steps",
            "2 workers": f"{np.abs(local['reward'] - remote['reward']).max():.4f}",
        }
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.py")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--engines", default="static,paged")
    p.add_argument("--devices", type=int, default=4, help="one process's fake CPU devices")
    p.add_argument("--worker_devices", type=int, default=2, help="each worker's (= rollout mesh)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--reference",
        choices=["split", "sync", "overlap"],
        default="split",
        help="the one-process run: split (its rollout mesh beside the training mesh), or in "
        "a process of the trainer's devices only: sync (static, with --max_staleness=0) or "
        "overlap (paged: its stream on the training mesh, a bound of 1)",
    )
    p.add_argument("--keep", default="", help="a folder to keep the workdirs in")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep or tmp
        for engine in args.engines.split(","):
            token = secrets.token_hex(16)
            runs = {}
            local_dir = os.path.join(base, f"{engine}_local")
            wall = train(args, engine, local_dir, token, [])
            runs["local"] = summary(local_dir) | {"wall": wall}
            started = start_workers(args, engine, token)
            try:
                remote_dir = os.path.join(base, f"{engine}_workers")
                wall = train(args, engine, remote_dir, token, [a for _, a in started])
            finally:
                for proc, _ in started:
                    proc.kill()
                    proc.wait()
            runs["remote"] = summary(remote_dir) | {"wall": wall}
            rows += compare(engine, runs["local"], runs["remote"])
            print(table(rows, ["engine", "", "one process", "2 workers"]), flush=True)
    print(
        f"{args.steps} steps, eval every {args.eval_every}, max_staleness "
        f"{args.max_staleness}, one process: {args.reference}"
    )
    print(table(rows, ["engine", "", "one process", "2 workers"]))
    print(uptime())


if __name__ == "__main__":
    main()

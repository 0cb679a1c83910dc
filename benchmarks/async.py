"""Step time of rollout.mode=sync, overlap and split, with a verifier that costs the host
a set time per batch.

    python benchmarks/async.py                                  # the quickstart, 0.5 s
    python benchmarks/async.py --config=../shared/anchors/jaxrl_w1_config.py --steps=8

On CPU the runs see --devices fake devices (split: one rollout device, the rest train).
Each repeat runs the trainer once per mode, alternating, in fresh processes and workdirs
(the compilation cache shared, so later runs load their programs). The scoring cost is a
reward term of weight 0 that sleeps, spread over the verifier workers so that one batch
costs --verifier-s of wall time on the host. Reported per mode, from each run's
metrics.jsonl over steps 2.. (the first step compiles or loads programs): the median step
time, and what the host waited for: the sampler (`perf/sample_s`, the rollout's tokens
not yet there when scoring starts; in split mode the thread's sampling time) and the
update (`perf/update_s`); in split mode also how long the learner waited for the rollout
thread and the thread for parameters within the staleness bound.

In sync mode a step is sample + score + update one after the other; in overlap mode the
next rollout samples while the host scores, so a step approaches max(device time, host
time). On CPU the devices and the host share the same cores, so the gain there is bounded
by how idle the cores are while the verifiers sleep; a GPU or TPU keeps both busy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import config_wrapper, device_name, table, uptime  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLOW = '''import time


def slow(completion, example, seconds=0.0):
    """Weight 0 in the reward: only its host time counts."""
    time.sleep(seconds)
    return 0.0
'''

SETUP = """    import os
    rows = c.rollout.batch_size * c.rollout.num_generations
    workers = c.train.verifier_workers or os.cpu_count() or 1
    c.rewards = dict(c.rewards)
    c.rewards["slow"] = {{"name": {slow!r}, "weight": 0.0,
                         "options": {{"seconds": {seconds!r} * workers / rows}}}}
    c.train.log_every = 1
    c.eval.every = 0
    c.train.print_samples_every = 0
"""


def run_once(args, config: str, mode: str, workdir: str, cache: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_llm.train",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.train.num_steps={args.steps}",
        f"--config.rollout.mode={mode}",
        f"--config.train.compilation_cache_dir={cache}",
    ]
    if mode == "split":
        cmd += [
            "--config.mesh.rollout_devices=1",
            f"--config.rollout.max_staleness={args.max_staleness}",
        ]
    env = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    if args.devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"trainer failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "perf/step_s" in r][1:]
    keys = (
        "perf/step_s",
        "perf/sample_s",
        "perf/score_s",
        "perf/update_s",
        "perf/learner_wait_s",
        "perf/rollout_wait_s",
        "rollout/staleness_mean",
    )
    return {k: float(np.median([r.get(k, 0.0) for r in steps])) for k in keys}


def _spread(values) -> str:
    return f"{np.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.py"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--verifier-s", type=float, default=0.5, help="host seconds per batch")
    p.add_argument("--modes", default="sync,overlap,split")
    p.add_argument("--max-staleness", type=int, default=1, help="split mode's bound")
    p.add_argument("--devices", type=int, default=2, help="fake CPU devices (0: as is)")
    args = p.parse_args()
    print(f"device: {device_name()}; {uptime()}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    with tempfile.TemporaryDirectory(prefix="async_") as tmp:
        slow = os.path.join(tmp, "slow_reward.py")
        with open(slow, "w") as f:
            f.write(SLOW)
        config = os.path.join(tmp, "config.py")
        with open(config, "w") as f:
            body = SETUP.format(slow=f"{slow}:slow", seconds=args.verifier_s)
            f.write(config_wrapper(os.path.abspath(args.config), body))
        cache = os.path.join(tmp, "xla")
        for i in range(args.repeats):
            for mode in results:
                r = run_once(args, config, mode, os.path.join(tmp, f"{mode}{i}"), cache)
                print(
                    f"{mode} #{i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True
                )
                results[mode].append(r)
    rows = [
        {"mode": mode, **{k: _spread([r[k] for r in rs]) for k in rs[0]}}
        for mode, rs in results.items()
    ]
    print(
        f"\nconfig {args.config}, verifier {args.verifier_s} s per batch, steps 2..{args.steps}"
        f" medians [min, max] over {args.repeats} runs; {uptime()}"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

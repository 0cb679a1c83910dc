"""Metrics out of the trainer: JSON lines, TensorBoard, W&B, a plot (the console: console.py).

    writer = MetricWriter(workdir, config=config.to_dict(), resume_step=ckpt.latest_step())
    writer.write(step, {"reward/mean": 0.5, "perf/step_s": 1.2})
    writer.write_samples(step, [{"prompt": p, "completion": c, "reward": r}])
    writer.close()

    python -m jaxrl_llm.trainer.metrics plot --metrics=DIR/metrics.jsonl --out=curve.png

Files, all under the workdir and written by process 0 only:
  metrics.jsonl   one JSON object per `write`: {"step": 10, "reward/mean": 0.5, ...}
  samples.jsonl   one object per sample: {"step": 10, "prompt": ..., "completion": ...}
  tensorboard/    event files (needs the `tensorboard` package; no TensorFlow)

NaN and +-inf are written as JSON `null` (strict JSON has no NaN; jq, pandas and
JavaScript read null), with the key kept so that a diverging metric stays visible;
`read_metrics` turns them back into float('nan'). TensorBoard and W&B get the raw value.

Resume: `resume_step=k` (the step of the restored checkpoint) drops every record with
step > k from both files, because the resumed run does those steps again; TensorBoard is
told to hide its events after k the same way. `resume_step=None` means a new run (no
checkpoint): the files start empty and TensorBoard hides the older events. The W&B run
id is kept in `wandb_run_id` so that a resumed run appends to the same W&B run.

TensorBoard files are written with the `tensorboard` package's own TF-free event writer.
(tensorboardX would do too, but it imports torch when torch is installed: seconds of
start-up and a second framework in the trainer process.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.errors import UserError, cli_main

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class MetricWriter:
    """Writes scalars and sample completions from process 0; a no-op on the others."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "jaxrl_llm",
        run_name: str | None = None,
        resume_step: int | None = None,
    ):
        self.workdir = os.fspath(workdir)
        self.active = jax.process_index() == 0
        self._tb = self._wandb = None
        self._files: dict[str, Any] = {}
        if not self.active:
            return
        os.makedirs(self.workdir, exist_ok=True)
        for name in (METRICS_FILE, SAMPLES_FILE):
            path = os.path.join(self.workdir, name)
            _drop_after(path, -1 if resume_step is None else resume_step)
            self._files[name] = open(path, "a", encoding="utf-8")
        if tensorboard:
            self._tb = _open_tensorboard(self.workdir, resume_step, config)
        if wandb:
            self._wandb = _open_wandb(self.workdir, config, wandb_project, run_name, resume_step)

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """One record of scalars (python, numpy or jax; fetched from device in one go)."""
        if not self.active:
            return
        if "step" in values:
            raise ValueError("metric key 'step' is reserved for the step itself")
        # One device_get for all (a dict would come back key-sorted: keep the caller's order).
        fetched = jax.device_get(list(values.values()))
        values = {k: _scalar(k, v) for k, v in zip(values, fetched, strict=True)}
        step = int(step)
        self._append(METRICS_FILE, [{"step": step, **values}])
        numbers = {k: v for k, v in values.items() if not isinstance(v, str)}
        if self._tb is not None:
            from tensorboard.plugins.scalar.summary_v2 import scalar_pb

            for key, value in numbers.items():
                self._tb_add(scalar_pb(key, float(value)), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def write_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Sample completions (prompt, completion, reward, anything JSON-able)."""
        if not self.active or not samples:
            return
        step = int(step)
        rows = [
            {"step": step, **dict(zip(s, jax.device_get(list(s.values())), strict=True))}
            for s in samples
        ]
        self._append(SAMPLES_FILE, rows)
        if self._tb is not None:
            from tensorboard.plugins.text.summary_v2 import text_pb

            self._tb_add(text_pb("samples", _markdown_table(rows)), step)
            self._tb.flush()
        if self._wandb is not None:
            columns = sorted({k for r in rows for k in r if k != "step"})
            data = [[_jsonable(r.get(c)) for c in columns] for r in rows]
            table = sys.modules["wandb"].Table(columns=columns, data=data)
            self._wandb.log({"samples": table}, step=step)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _append(self, name: str, records: Iterable[dict]) -> None:
        f = self._files[name]
        for r in records:
            f.write(json.dumps(_jsonable(r), allow_nan=False, ensure_ascii=False) + "\n")
        f.flush()  # a killed run loses nothing it reported

    def _tb_add(self, summary, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))


def _scalar(key: str, v) -> float | int | bool | str:
    if isinstance(v, str | bool | int | float):
        return v
    a = np.asarray(v)
    if a.size == 1 and jnp.issubdtype(a.dtype, jnp.floating):  # bfloat16 included
        x = a.reshape(())[()]
        # Shortest repr of the value's own precision: float32 0.1 is written 0.1.
        return float(str(x)) if a.dtype.itemsize < 8 else float(x)
    if a.size == 1 and (jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool):
        return a.item()
    raise ValueError(f"metric {key!r}: expected a number, got {a.dtype} of shape {a.shape}")


def _jsonable(x):
    """NaN/inf -> None; numpy -> python; containers recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray | np.generic):
        return _jsonable(x.tolist())
    return x


def _drop_after(path: str, step: int) -> None:
    """Rewrites `path` without the records whose step is > `step` and without broken lines.

    A complete last record that lost only its newline (killed between the two) is kept
    and given its newline; appending the next record to it would break both.
    """
    if not os.path.exists(path):
        return
    kept, changed = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                keep = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False  # the half-written last line of a killed run
            if keep and not line.endswith("\n"):
                line, changed = line + "\n", changed + 1
            kept += [line] if keep else []
            changed += not keep
    if changed:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        logging.info("%s: kept %d records up to step %d (resumed run)", path, len(kept), step)


def _open_tensorboard(workdir: str, resume_step: int | None, config):
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        logging.warning(
            "TensorBoard logging is on but the `tensorboard` package is not installed "
            "(pip install tensorboard); writing %s only",
            METRICS_FILE,
        )
        return None
    tb = EventFileWriter(os.path.join(workdir, TENSORBOARD_DIR), flush_secs=10)
    # A session START hides the events at steps >= its step that earlier files hold (the
    # first START of a directory counts as the initial one, so every session writes one).
    first = 0 if resume_step is None else resume_step + 1
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    tb.add_event(event_pb2.Event(wall_time=time.time(), step=first, session_log=start))
    if config is not None:
        text = "```\n" + json.dumps(_jsonable(dict(config)), indent=2, default=str) + "\n```"
        tb.add_event(
            event_pb2.Event(wall_time=time.time(), step=first, summary=text_pb("config", text))
        )
    return tb


def _open_wandb(workdir: str, config, project: str, run_name: str | None, resume_step):
    try:
        import wandb
    except ImportError:
        logging.warning(
            "W&B logging is on but the `wandb` package is not installed "
            "(pip install 'jaxrl_llm[wandb]'); writing %s and TensorBoard only",
            METRICS_FILE,
        )
        return None
    id_path = os.path.join(workdir, WANDB_ID_FILE)
    if resume_step is not None and os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id)
    # W&B ignores steps at or below the last one it has, so re-done steps keep the values
    # of the first attempt there (metrics.jsonl has the re-done ones).
    return wandb.init(
        project=project,
        name=run_name,
        config=dict(config) if config is not None else None,
        id=run_id,
        resume="allow",
        dir=workdir,
    )


def _markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    columns = [c for c in ("prompt", "completion", "reward") if any(c in r for r in rows)]
    columns += sorted({k for r in rows for k in r} - {"step", *columns})

    def cell(x) -> str:
        text = x if isinstance(x, str) else json.dumps(_jsonable(x))
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ reading
def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl (or samples.jsonl), with null read back as NaN.

    A broken last line (a run killed mid-write, or still writing) is skipped.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {line[:80]!r}") from None
        records.append({k: math.nan if v is None else v for k, v in record.items()})
    return records


# -------------------------------------------------------------------------- progress bar
# ------------------------------------------------------------------------------- plotting
def plot_metrics(
    metrics_jsonl: str | os.PathLike,
    out_png: str | os.PathLike,
    keys: Sequence[str] = ("reward/mean", "eval/pass@1"),
    title: str | None = None,
) -> list[str]:
    """Plots `keys` against step into one PNG; returns the keys that had data."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "matplotlib", "not installed (plotting needs it)", 'pip install -e ".[plot]"'
        ) from None
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl)
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        if points:
            series[key] = points
    if not series:
        present = sorted({k for r in records for k in r} - {"step"})
        raise ValueError(f"{metrics_jsonl}: none of {list(keys)} found; keys: {present}")
    for key in keys:
        if key not in series:
            logging.warning("%s: no values for %r", metrics_jsonl, key)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, points in series.items():
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o" if len(points) <= 30 else None, ms=3, label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return list(series)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrl_llm.trainer.metrics")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="plot metrics.jsonl keys against step into a PNG")
    plot.add_argument("--metrics", required=True, help="path to a run's metrics.jsonl")
    plot.add_argument("--out", required=True, help="output PNG")
    plot.add_argument("--keys", default="reward/mean,eval/pass@1", help="comma-separated keys")
    plot.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    keys = [k for k in args.keys.split(",") if k]
    plotted = plot_metrics(args.metrics, args.out, keys=keys, title=args.title)
    print(f"wrote {args.out} ({', '.join(plotted)})")


if __name__ == "__main__":
    cli_main(main)

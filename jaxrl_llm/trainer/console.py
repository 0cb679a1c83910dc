"""What a run prints on the console (stderr, process 0 only): progress with a time
estimate, one line per evaluation, and a closing summary.

    progress = Progress(num_steps, initial_step=start)
    progress.update(step, reward=0.5, step_s=0.12)      # bar on a tty, a line in a log file
    progress.write(eval_line(50, ev))   # "[eval step 50] pass@1 0.49 pass@8 0.64 (256 prompts)"
    for line in summary(...): progress.write(line)

The time left is the median time of the recent steps times the steps still to go. The
first steps a process runs are left out: they include compiling, which later steps do
not pay, so an estimate from the average since the start runs hours long at step 1 of a
two-minute run. On a terminal the bar redraws in place; in a log file (stderr not a tty)
a plain line is printed every `every_s` seconds and at the last step instead.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import jax
import numpy as np

SKIPPED_STEPS = 2  # a process's first steps: compiles, programs loaded from the cache
RECENT_STEPS = 20  # the window of the median step time


def _clock(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Training progress (process 0 only): a tqdm bar on a terminal, plain lines in a log
    file, each with the latest values and the time left (module doc)."""

    def __init__(
        self,
        total_steps: int,
        initial_step: int = 0,
        desc: str = "train",
        every_s: float = 30.0,
        interactive: bool | None = None,
    ):
        self.total, self.desc, self.every_s = total_steps, desc, every_s
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.disabled = jax.process_index() != 0
        self._times: list[float] = []
        self._seen = 0  # steps this process has run (the first SKIPPED_STEPS excluded)
        self._printed_at = time.monotonic()
        self._step = initial_step
        self._bar = None
        self._lock = threading.Lock()
        if self.interactive and not self.disabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                desc=desc,
                dynamic_ncols=True,
                mininterval=0.1,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    def left_s(self) -> float | None:
        """Seconds to the last step from the median recent step time (None: too early)."""
        if not self._times:
            return None
        return statistics.median(self._times[-RECENT_STEPS:]) * (self.total - self._step)

    def update(self, step: int, step_s: float | None = None, **values) -> None:
        """Moves to `step` (steps done) and shows `values` (e.g. reward=0.5); step_s, the
        step's wall time, feeds the estimate."""
        self._step = int(step)
        self._seen += 1
        if step_s is not None and self._seen > SKIPPED_STEPS:
            self._times.append(float(step_s))
        shown = {
            k: f"{float(v):.4g}" if isinstance(v, float | np.floating) else v
            for k, v in values.items()
        }
        if step_s is not None:
            shown["step_s"] = f"{float(step_s):.4g}"
        left = self.left_s()
        if self._bar is not None:
            shown["left"] = "~" + _clock(left) if left is not None else "estimating"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(self._step - self._bar.n)
            return
        now = time.monotonic()
        if now - self._printed_at >= self.every_s or self._step == self.total:
            self._printed_at = now
            parts = [f"{self.desc} step {self._step}/{self.total}"]
            parts += [f"{k} {v}" for k, v in shown.items()]
            if left is not None and self._step < self.total:
                parts.append(f"~{_clock(left)} left")
            self.write(" | ".join(parts))

    def write(self, text: str) -> None:
        """Prints a line (above the bar on a terminal) on process 0."""
        if self.disabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            with self._lock:  # compile lines come from build threads: one write a line
                sys.stderr.write(text + "\n")
                sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def eval_line(step: int, ev: dict) -> str:
    """One evaluation's headline: "[eval step 50] pass@1 0.49 pass@8 0.64 (256 prompts)"."""
    passes = sorted((int(k.split("@")[1]), v) for k, v in ev.items() if k.startswith("eval/pass@"))
    parts = [f"pass@{k} {v:.2f}" for k, v in passes]
    for key, label in (("eval/reward_mean", "reward"), ("eval/turns_mean", "turns")):
        if key in ev:
            parts.append(f"{label} {ev[key]:.2f}")
    count = f" ({int(ev['eval/num_prompts'])} prompts)" if "eval/num_prompts" in ev else ""
    return f"[eval step {step}] {' '.join(parts)}{count}"


def summary(records: list[dict], steps: int, wall_s: float, workdir: str) -> list[str]:
    """The closing lines: steps, the final and best evaluation (by pass@1), wall time,
    the workdir and the commands that plot and export it. records: metrics.jsonl's."""
    lines = [f"done: {steps} steps in {_clock(wall_s)}; workdir {workdir}"]
    evals = [r for r in records if isinstance(r.get("eval/pass@1"), float | int)]
    if evals:
        final, best = evals[-1], max(evals, key=lambda r: r["eval/pass@1"])
        lines.append(
            f"eval/pass@1: final {final['eval/pass@1']:.2f} (step {final['step']}), "
            f"best {best['eval/pass@1']:.2f} (step {best['step']})"
        )
    lines.append(
        f"plot:   python -m jaxrl_llm.trainer.metrics plot "
        f"--metrics={workdir}/metrics.jsonl --out=curve.png"
    )
    lines.append(f"export: python -m jaxrl_llm.export --workdir={workdir} --out=HF_DIR")
    return lines

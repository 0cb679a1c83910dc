"""The training loop around `Run`: the workdir's lock, the resume check, checkpoints,
metrics, samples, evaluation and the progress bar.

    metrics = train(config, workdir)   # runs, or resumes from the workdir's checkpoint

`python -m jaxrl_llm.train` is this function behind the command line (`train.py`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import parallel, rl
from jaxrl_llm.errors import UserError
from jaxrl_llm.rollout import scoring
from jaxrl_llm.startup import compilation
from jaxrl_llm.startup.precompile import precompile_step
from jaxrl_llm.trainer import checkpoint, console
from jaxrl_llm.trainer import metrics as metrics_lib
from jaxrl_llm.trainer import workdir as workdir_lib
from jaxrl_llm.trainer.run import Run


class NonFiniteError(FloatingPointError):
    """The loss or a gradient became NaN/inf; the message names the step."""


def _config_record(prepared: config_lib.Prepared) -> dict:
    """The config as the workdir keeps it (`config.json` and its history): the model and
    tokenizer resolved to absolute directories, which export and evaluation read later."""
    record = prepared.config.to_dict()
    paths = (prepared.model_path, prepared.tokenizer_path)
    record["model"]["path"], record["model"]["tokenizer"] = map(os.path.abspath, paths)
    return record


def _check_resume(workdir: str, record: dict, allow: bool) -> None:
    """Lists how the config differs from the run's saved one; refuses changes of what the
    run means unless allowed. Process 0 decides (it writes the workdir), every host stops."""
    refused = None
    if jax.process_index() == 0:
        try:
            for line in workdir_lib.check_resume(workdir, record, allow=allow):
                print(f"config changed since the last start: {line}", file=sys.stderr)
        except UserError as err:
            refused = err
    if parallel.host_max(int(refused is not None)):
        raise refused or UserError(
            workdir, "process 0 refused to resume with this config", "see its log"
        )


def _write_run_files(run: Run, record: dict) -> None:
    if jax.process_index() != 0:
        return
    workdir_lib.save_config(run.workdir, record)
    with open(os.path.join(run.workdir, "hf_config.json"), "w", encoding="utf-8") as f:
        json.dump(run.model_cfg.to_hf_dict(), f, indent=2, sort_keys=True)


def _samples(s: scoring.Scored, count: int) -> list[dict]:
    n = min(count, len(s.completions))
    samples = [
        {"prompt": s.prompts[i], "completion": s.completions[i], "reward": float(s.rewards[i])}
        for i in range(n)
    ]
    for i, sample in enumerate(samples if s.turns is not None else ()):
        sample["turns"] = s.turns[i]  # multi-turn: the trajectory, turn by turn
    return samples


def _check_finite(step: int, metrics: dict, skip: bool) -> None:
    """step: the step's number as metrics.jsonl records it (the first step is 1)."""
    bad = [
        k for k in ("loss/total", "optim/grad_norm") if k in metrics and not np.isfinite(metrics[k])
    ]
    if metrics.get("optim/nonfinite", 0.0) > 0 or bad:
        if skip:
            logging.warning("step %d: non-finite loss or gradient, update skipped", step)
            return
        raise NonFiniteError(
            f"step {step}: non-finite loss or gradient ({', '.join(bad) or 'optim/nonfinite'})"
            "; set train.skip_nonfinite=True to skip such updates"
        )


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) training; returns the last logged metrics. One trainer at a time
    per workdir: process 0 holds its lock (`workdir.lock`) until this returns."""
    held = workdir_lib.lock(workdir) if jax.process_index() == 0 else None
    try:
        finished = _finished(config, workdir)
        return finished if finished is not None else _train(config, workdir)
    finally:
        if held is not None:
            held.release()


def _finished(config: ml_collections.ConfigDict, workdir: str) -> dict | None:
    """A run whose checkpoint is at train.num_steps already: says so (before anything is
    loaded or compiled) and returns its last metrics record; None otherwise."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return None
    latest = checkpoint.Checkpointer(directory, read_only=True).latest_step()
    if latest is None or latest < config.train.num_steps:
        return None
    if jax.process_index() == 0:
        print(
            f"already finished at step {latest}: {os.path.abspath(workdir)} (to start "
            "fresh, pass another --workdir or delete this one; to go on, raise "
            "--config.train.num_steps)",
            file=sys.stderr,
            flush=True,
        )
    path = os.path.join(workdir, "metrics.jsonl")
    records = metrics_lib.read_metrics(path) if os.path.exists(path) else []
    return {k: v for k, v in records[-1].items() if k != "step"} if records else {}


def _train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    started = time.monotonic()
    prepared = config_lib.prepare(config)  # checked once, speed settings picked once
    c, tuning_line = prepared.config, prepared.tuning_line  # config.json records these
    compilation.use_cache(c.train.compilation_cache_dir)
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=c.checkpoint.keep,
        save_interval_steps=c.checkpoint.every or c.train.num_steps,
        async_save=c.checkpoint.async_save,
    )
    latest = ckpt.latest_step()
    record = _config_record(prepared)
    if latest is not None:  # before the model is loaded: a refused resume costs nothing
        _check_resume(workdir, record, c.train.allow_config_change)
    if tuning_line and jax.process_index() == 0:
        print(tuning_line, file=sys.stderr, flush=True)
    run = Run(prepared, workdir)
    start = 0
    if latest is not None:  # LoRA: the checkpoint holds the adapters, the base is reloaded
        saved = rl.checkpointed(run.state)
        restored, extra = ckpt.restore(latest, target=_abstract(saved))
        # Restored arrays may view host memory: `owned` lets the first update donate them.
        run.state = rl.owned(restored).replace(frozen=run.state.frozen)
        run.sampling.data.restore(extra["data"])
        start = int(extra["step"])
        print(f"resumed from {ckpt.directory} at step {start}", file=sys.stderr, flush=True)
    _write_run_files(run, record)
    writer = metrics_lib.MetricWriter(
        workdir,
        c.to_dict(),
        tensorboard=c.logging.tensorboard,
        wandb=c.logging.wandb,
        wandb_project=c.logging.wandb_project,
        run_name=c.logging.run_name or None,
        resume_step=start,
    )
    progress = console.Progress(c.train.num_steps, initial_step=start)
    stop = checkpoint.install_sigterm_handler()  # SIGTERM, and a first Ctrl-C
    aborted = False
    try:
        last = _steps(run, ckpt, writer, progress, stop, start)
        if not stop.requested:
            _summarize(progress, workdir, c.train.num_steps, time.monotonic() - started)
        return last
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving, even mid-save
        aborted = True
        raise
    finally:
        run.compile_log.close()
        if not aborted:  # orbax's save threads are abandoned (errors.cli_main exits hard)
            ckpt.wait()
            ckpt.close()
        progress.close()
        writer.close()
        run.close()
        stop.restore()


def _steps(run: Run, ckpt, writer, progress, stop, start: int) -> dict:
    """Steps `start`.. to train.num_steps, each followed by its scheduled checkpoint; a
    SIGTERM or first Ctrl-C (`stop`) saves the step just done and ends the loop. Returns
    the last logged metrics."""
    c, last = run.config, {}
    run.compile_log.listen(progress.write, announce=progress.write)
    evaluate_first = bool(c.eval.every and c.eval.at_start and start == 0)
    if run.env_rollout is None:  # multi-turn prompts come from resets: compiled at use
        # The first step starts while the later programs still compile.
        precompile_step(run, background=True, evaluate_first=evaluate_first, step=start)
    if evaluate_first:  # the initial policy's point
        writer.write(0, last := run.evaluate(0))
        progress.write(console.eval_line(0, last))
    for step in range(start, c.train.num_steps):
        last, position = _one_step(run, step, writer, progress, last)
        run.compile_log.start_deferred()  # programs the first step did not need
        done = step + 1
        extra = {"step": done, "data": position}
        if stop.stop_at(done):
            ckpt.save(done, rl.checkpointed(run.state), extra, force=True)
            # Announced once final (orbax renamed its temp directory): a second Ctrl-C
            # before that aborts here, and the previous checkpoint stays the resume point.
            ckpt.wait()
            progress.write(f"{stop.reason}: saved step {done} in {ckpt.directory}, exiting")
            break
        ckpt.save(done, rl.checkpointed(run.state), extra, force=done == c.train.num_steps)
    return last


def _one_step(run: Run, step: int, writer, progress, last: dict):
    """Step, then what the config schedules after it: log, samples, eval, progress.
    -> (the last logged metrics, the data position after the step)."""
    c, compiled_before = run.config, run.compile_log.seconds
    result = run.step(step)
    host = result.host
    if result.warning:
        progress.write(result.warning)
    done = step + 1
    if done % c.train.log_every == 0 or done == c.train.num_steps:
        dev = {k: float(v) for k, v in jax.device_get(result.device).items()}
        _check_finite(done, dev, c.train.skip_nonfinite)
        last = host | dev | {"perf/compile_s": run.compile_log.seconds - compiled_before}
        writer.write(done, last)
    if c.train.print_samples_every and done % c.train.print_samples_every == 0:
        samples = _samples(result.scored, c.train.num_printed_samples)
        if samples:  # the console shows the first; samples.jsonl keeps them all
            s = samples[0]
            progress.write(
                f"[step {done}] reward {s['reward']:+.2f} | {s['prompt']!r} -> {s['completion']!r}"
            )
        writer.write_samples(done, samples)
    if c.eval.every and (done % c.eval.every == 0 or done == c.train.num_steps):
        ev = run.evaluate(done)
        writer.write(done, ev)
        progress.write(console.eval_line(done, ev))
        last = last | ev
    progress.update(done, reward=host["reward/mean"], step_s=host["perf/step_s"])
    return last, result.data_position


def _summarize(progress, workdir: str, steps: int, wall_s: float) -> None:
    """The closing summary, from the run's metrics.jsonl (process 0 writes it)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if jax.process_index() != 0 or not os.path.exists(path):
        return
    records = metrics_lib.read_metrics(path)
    for line in console.summary(records, steps, wall_s, os.path.abspath(workdir)):
        progress.write(line)


def _abstract(state):
    """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )

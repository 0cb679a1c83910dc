"""The RL trainer: GRPO / DAPO / PPO / ... on a device mesh, from an ml_collections config.

    python -m jaxrl_llm.train --config=configs/quickstart.py --workdir=/tmp/quickstart \
        [--config.algo.beta=0.0 --config.rollout.num_generations=16 ...]

Rerunning the same command resumes from the workdir's latest checkpoint. `train(config,
workdir)` is the same run in-process. The run itself, its step and its three jitted
programs are `run.Run` (also importable as `train.Run`); this module adds what lasts
across steps: the workdir lock, validation, the resume check, checkpoints, metrics, the
progress bar and the command line.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the command line re-runs itself under tcmalloc (where it is
    # installed) before it imports anything heavy: the imports below would be paid twice.
    from jaxrl_llm.parallel import allocator, xla_flags

    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()

import json
import logging
import os

import jax
import ml_collections
import numpy as np
from absl import logging as absl_logging

from jaxrl_llm import compilation, parallel, rl, run_config
from jaxrl_llm.run import Run, tuned


class NonFiniteError(FloatingPointError):
    """The loss or a gradient became NaN/inf; the message names the step."""


def _config_record(config) -> dict:
    """The config as the workdir keeps it (`config.json` and its history): the model and
    tokenizer resolved to absolute directories, which export and evaluation read later."""
    record = config.to_dict()
    path = run_config.resolve_model_path(config.model.path)
    tokenizer = run_config.resolve_model_path(
        config.model.tokenizer or path, "model.tokenizer", need_config=False
    )
    record["model"]["path"], record["model"]["tokenizer"] = map(os.path.abspath, (path, tokenizer))
    return record


def _check_resume(workdir: str, record: dict, allow: bool) -> None:
    """Lists how the config differs from the run's saved one; refuses changes of what the
    run means unless allowed. Process 0 decides (it writes the workdir), every host stops."""
    from jaxrl_llm import workdir as workdir_lib
    from jaxrl_llm.errors import UserError

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
    from jaxrl_llm import workdir as workdir_lib

    if jax.process_index() != 0:
        return
    workdir_lib.save_config(run.workdir, record)
    with open(os.path.join(run.workdir, "hf_config.json"), "w", encoding="utf-8") as f:
        json.dump(run.model_cfg.to_hf_dict(), f, indent=2, sort_keys=True)


def _samples(run: Run) -> list[dict]:
    s = run.last_scored
    n = min(run.config.train.num_printed_samples, len(s.completions))
    samples = [
        {"prompt": s.prompts[i], "completion": s.completions[i], "reward": float(s.rewards[i])}
        for i in range(n)
    ]
    for i, sample in enumerate(samples if s.turns is not None else ()):
        sample["turns"] = s.turns[i]  # multi-turn: the trajectory, turn by turn
    return samples


def _check_finite(step: int, metrics: dict, skip: bool) -> None:
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
    from jaxrl_llm import workdir as workdir_lib

    held = workdir_lib.lock(workdir) if jax.process_index() == 0 else None
    try:
        return _train(config, workdir)
    finally:
        if held is not None:
            held.release()


def _train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    from jaxrl_llm import checkpoint, metrics

    run_config.validate(config, process_count=jax.process_count())
    c, tuning_line = tuned(config)  # what config.json records, and a resume compares
    compilation.use_cache(c.train.compilation_cache_dir)
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=c.checkpoint.keep,
        save_interval_steps=c.checkpoint.every or c.train.num_steps,
        async_save=c.checkpoint.async_save,
    )
    latest = ckpt.latest_step()
    record = _config_record(c)
    if latest is not None:  # before the model is loaded: a refused resume costs nothing
        _check_resume(workdir, record, c.train.allow_config_change)
    if tuning_line and jax.process_index() == 0:
        print(tuning_line, file=sys.stderr, flush=True)
    run = Run(c, workdir)
    start = 0
    if latest is not None:  # LoRA: the checkpoint holds the adapters, the base is reloaded
        saved = rl.checkpointed(run.state)
        restored, extra = ckpt.restore(latest, target=_abstract(saved))
        run.state = restored.replace(frozen=run.state.frozen)
        run.data_iter.restore(extra["data"])
        start = int(extra["step"])
        print(f"resumed from {ckpt.directory} at step {start}", file=sys.stderr, flush=True)
    _write_run_files(run, record)
    writer = metrics.MetricWriter(
        workdir, c.to_dict(), tensorboard=c.logging.tensorboard, wandb=c.logging.wandb,
        wandb_project=c.logging.wandb_project, run_name=c.logging.run_name or None,
        resume_step=start,
    )  # fmt: skip
    progress = metrics.Progress(c.train.num_steps, initial_step=start)
    stop = checkpoint.install_sigterm_handler()  # SIGTERM, and a first Ctrl-C
    aborted = False
    try:
        return _steps(run, ckpt, writer, progress, stop, start)
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
    run.compile_log.listen(progress.write)
    evaluate_first = bool(c.eval.every and c.eval.at_start and start == 0)
    if run.env_rollout is None:  # multi-turn prompts come from resets: compiled at use
        # The first step starts while the later programs still compile.
        compilation.precompile_step(run, background=True, evaluate_first=evaluate_first, step=start)
    if evaluate_first:  # the initial policy's point
        writer.write(0, last := run.evaluate(0))
    for step in range(start, c.train.num_steps):
        last = _one_step(run, step, writer, progress, last)
        done = step + 1
        extra = {"step": done, "data": run.data_state()}
        if stop.stop_at(done):
            ckpt.save(done, rl.checkpointed(run.state), extra, force=True)
            progress.write(f"{stop.reason}: saved step {done} in {ckpt.directory}, exiting")
            break
        ckpt.save(done, rl.checkpointed(run.state), extra, force=done == c.train.num_steps)
    return last


def _one_step(run: Run, step: int, writer, progress, last: dict) -> dict:
    """Step, then what the config schedules after it: log, samples, eval, progress."""
    c, compiled_before = run.config, run.compile_log.seconds
    host = run.step(step)
    if run.warning:
        progress.write(run.warning)
    done = step + 1
    if done % c.train.log_every == 0 or done == c.train.num_steps:
        dev = {k: float(v) for k, v in jax.device_get(run.last_update_metrics).items()}
        _check_finite(step, dev, c.train.skip_nonfinite)
        last = host | dev | {"perf/compile_s": run.compile_log.seconds - compiled_before}
        writer.write(done, last)
    if c.train.print_samples_every and done % c.train.print_samples_every == 0:
        samples = _samples(run)
        for s in samples:
            progress.write(
                f"[step {done}] reward {s['reward']:+.2f} | {s['prompt']!r} -> {s['completion']!r}"
            )
        writer.write_samples(done, samples)
    if c.eval.every and (done % c.eval.every == 0 or done == c.train.num_steps):
        ev = run.evaluate(done)
        writer.write(done, ev)
        last = last | ev
    progress.update(done, reward=host["reward/mean"], step_s=host["perf/step_s"])
    return last


def _abstract(state):
    """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def main(argv):
    del argv
    from absl import flags

    from jaxrl_llm.parallel import allocator, distributed

    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    distributed.initialize()
    if jax.default_backend() == "cpu" and jax.process_index() == 0:
        if note := allocator.hint():
            print(note, file=sys.stderr, flush=True)
    train(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    from jaxrl_llm.errors import config_command

    config_command(
        main, "configs/<experiment>.py", "run directory (checkpoints, metrics); reruns resume"
    )

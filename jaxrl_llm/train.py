"""The RL trainer: GRPO / DAPO / PPO / ... on a device mesh, from an ml_collections config.

    python -m jaxrl_llm.train --config=configs/quickstart.py --workdir=/tmp/quickstart \
        [--config.algo.beta=0.0 --config.rollout.num_generations=16 ...]

Rerunning the same command resumes from the workdir's latest checkpoint. One step:

    sample (jitted, policy params in place) -> dispatch reference log-probs (no wait)
    -> completion ids to host -> text -> verifier pool (overlaps the reference forward)
    -> rewards to device -> jitted update (advantages, loss, optax; state donated)

`jax.transfer_guard("disallow")` holds around the step body: the only transfers are the
explicit ones (completion ids out, rewards in, metrics at log steps).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import logging as absl_logging

from jaxrl_llm import data, evaluation, parallel, perf, rollout, run_config, verifiers
from jaxrl_llm.models import builtin
from jaxrl_llm.rl import critic as critic_lib
from jaxrl_llm.rl import update as U


class NonFiniteError(FloatingPointError):
    """The loss or a gradient became NaN/inf; the message names the step."""


def _stop_ids(tokenizer, stop_tokens) -> tuple[int, ...]:
    ids = []
    for tok in stop_tokens:
        if tok == "<eos>":
            if tokenizer.eos_token_id is None:
                raise run_config.ConfigError("rollout.stop_tokens: the tokenizer has no EOS")
            ids.append(tokenizer.eos_token_id)
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == tokenizer.unk_token_id:
            raise run_config.ConfigError(f"rollout.stop_tokens: {tok!r} is not a single token")
        ids.append(int(tid))
    return tuple(dict.fromkeys(ids))


def _optimizer(c, learning_rate: float):
    """AdamW from the optim.* keys; the schedule counts trainer steps (update calls)."""
    o = c.optim
    return U.make_optimizer(
        learning_rate=learning_rate,
        warmup_steps=o.warmup_steps,
        total_steps=c.train.num_steps,
        schedule=o.schedule,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
        end_lr_ratio=o.end_lr_ratio,
    )


class Run:
    """Everything a training run holds: built from the config, then stepped by `train`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        run_config.validate(config, process_count=jax.process_count())
        self.config, self.workdir = config, workdir
        self.algo = run_config.algo_config(config)
        c = config
        # --------------------------------------------------------------------- Mesh
        self.mesh = parallel.make_mesh(dict(c.mesh))
        # ------------------------------------------------------------ Model & tokenizer
        self.model_path = run_config.resolve_model_path(c.model.path)
        self.model_cfg, params = builtin.load_model(
            self.model_path,
            self.mesh,
            c.model.dtype,
            remat=c.model.remat,
            scan_layers=bool(c.model.scan_layers),
        )
        self.tokenizer_path = run_config.resolve_model_path(
            c.model.tokenizer or self.model_path, "model.tokenizer", need_config=False
        )
        self.tokenizer = builtin.load_tokenizer(self.tokenizer_path)
        self.ref_params = None
        if self.algo.needs_ref:
            ref_path = run_config.resolve_model_path(
                c.model.ref_path or self.model_path, "model.ref_path"
            )
            _, self.ref_params = builtin.load_model(ref_path, self.mesh, c.model.dtype)
        pad = data.prompts.pad_id(self.tokenizer)
        self.settings = rollout.RolloutSettings(
            max_new_tokens=c.rollout.max_new_tokens,
            num_generations=c.rollout.num_generations,
            temperature=c.rollout.temperature,
            top_k=c.rollout.top_k,
            top_p=c.rollout.top_p,
            stop_ids=_stop_ids(self.tokenizer, c.rollout.stop_tokens),
            bucket_steps=c.rollout.bucket_steps,
            cache_segments=c.rollout.cache_segments,
            pad_id=pad,
            seed=c.train.seed,
            overlong_buffer=(
                max(1, round(self.algo.overlong_buffer_frac * c.rollout.max_new_tokens))
                if self.algo.overlong_penalty
                else 0
            ),
        )
        # -------------------------------------------------------------------- Input
        B = c.rollout.batch_size
        hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
        self.data_iter = data.make_iterator(c.data, self.tokenizer, B, **hosts)
        self.eval_batches = []
        if c.eval.every > 0:
            eval_data = ml_collections.ConfigDict(c.data.to_dict())
            eval_data.split, eval_data.shuffle, eval_data.num_epochs = c.eval.split, False, 1
            eval_data.path = c.eval.path or c.data.path
            self.eval_batches = evaluation.fixed_batches(
                data.make_iterator(eval_data, self.tokenizer, B, **hosts), c.eval.num_prompts
            )
        self.specs = verifiers.parse_specs(c.rewards)
        self.correct_label = c.eval.correct_reward or self.specs[0].label
        self.pool = verifiers.VerifierPool(
            c.train.verifier_workers or None, timeout_s=c.train.verifier_timeout_s
        )
        # ------------------------------------------------------ Model & optimizer state
        o = c.optim
        opt = _optimizer(c, o.learning_rate)
        critic_params = critic_opt = None
        if self.algo.uses_critic:
            critic_params = critic_lib.init_critic(self.model_cfg, params, seed=c.train.seed)
            critic_opt = _optimizer(c, o.critic_learning_rate)
        self.state = U.init_train_state(
            params, opt, critic_params=critic_params, critic_optimizer=critic_opt
        )
        # ------------------------------------------------------------- Update step
        temp = c.rollout.temperature
        self.update = U.make_update_fn(
            self.model_cfg,
            self.algo,
            opt,
            micro_batches=o.micro_batches,
            mini_batches=o.mini_batches,
            temperature=temp,
            chunk_size=c.train.logprob_chunk,
            critic_optimizer=critic_opt,
            skip_nonfinite=c.train.skip_nonfinite,
            group=c.rollout.num_generations,  # a group's samples share their prompt
        )
        self.ref_fn = (
            U.make_logprob_fn(
                self.model_cfg,
                temperature=temp,
                chunk_size=c.train.logprob_chunk,
                micro_batches=o.micro_batches * o.mini_batches,  # the update's row slices
                group=c.rollout.num_generations,  # a group's samples share their prompt
            )
            if self.algo.needs_ref
            else None
        )
        self.peak = perf.matmul_peak(c.model.dtype)

    def reference(self, out):
        """Dispatches the reference forward (async); None when beta = 0."""
        if self.ref_fn is None:
            return None
        return self.ref_fn(
            self.ref_params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask
        )

    def step(self, step: int) -> dict:
        """One RL step; returns host metrics of the rollout and the timings (device
        metrics stay on device in `self.last_update_metrics` until a log step)."""
        c, t_start = self.config, time.perf_counter()
        guard = (
            jax.transfer_guard("disallow") if c.train.transfer_guard else contextlib.nullcontext()
        )
        with guard:
            ro = rollout.collect(
                self.model_cfg,
                self.state.params,
                self.data_iter,
                self.pool,
                self.specs,
                self.tokenizer,
                self.settings,
                step,
                self.mesh,
                dynamic_rounds=(
                    self.algo.max_resample_rounds if self.algo.dynamic_sampling else None
                ),
                on_sampled=self.reference,
            )
            t0 = time.perf_counter()
            ref = jax.block_until_ready(ro.aux)
            ref_s = time.perf_counter() - t0
            rewards = parallel.shard_local_batch(ro.rewards, self.mesh)  # [N], global
            batch = U.batch_from_rollout(ro.out, rewards, ref_logprobs=ref)
            t0 = time.perf_counter()
            self.state, self.last_update_metrics = self.update(self.state, batch)
            jax.block_until_ready(self.state)
            update_s = time.perf_counter() - t0
        self.last_rollouts = ro
        step_s = time.perf_counter() - t_start
        host = self._perf(ro, step_s, ref_s, update_s) | ro.metrics
        host |= {"reward/mean": float(ro.rewards.mean()), "reward/std": float(ro.rewards.std())}
        return parallel.host_mean(host)  # each process saw only its own rows

    def _perf(self, ro, step_s, ref_s, update_s) -> dict:
        rows, P = ro.out.tokens.shape[0], ro.out.prompt_tokens.shape[1]
        T = ro.out.tokens.shape[1]
        flops = perf.step_flops(
            self.model_cfg,
            rows=rows,
            prompts=rows // self.settings.num_generations,
            prompt_len=float(ro.prompt_lengths.mean()),
            new_tokens=float(ro.lengths.mean()),
            reference=self.ref_fn is not None,
            update_forwards=self.update.forward_passes,
            update_shared_forwards=self.update.shared_prompt_passes,
            reference_shares_prompts=self.settings.num_generations > 1,
        )
        return {
            "perf/step_s": step_s,
            "perf/sample_s": ro.sample_s,
            "perf/reference_s": ref_s,
            "perf/score_s": ro.score_s,
            "perf/update_s": update_s,
            "perf/rollout_tokens_per_s": float(ro.lengths.sum()) / max(ro.sample_s, 1e-9),
            "perf/update_tokens_per_s": rows * (P + T) / max(update_s, 1e-9),
            "perf/mfu": sum(flops.values()) / step_s / self.peak,
        }


def _compile_seconds():
    """A list that accumulates XLA compile durations (jax.monitoring events)."""
    durations = []

    def listener(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            durations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return durations


def _write_run_files(run: Run) -> None:
    if jax.process_index() != 0:
        return
    os.makedirs(run.workdir, exist_ok=True)
    cfg = run.config.to_dict()
    # Absolute paths: export and evaluation read them from any directory later.
    cfg["model"]["path"] = os.path.abspath(run.model_path)
    cfg["model"]["tokenizer"] = os.path.abspath(run.tokenizer_path)
    with open(os.path.join(run.workdir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, default=str)
    with open(os.path.join(run.workdir, "hf_config.json"), "w", encoding="utf-8") as f:
        json.dump(run.model_cfg.to_hf_dict(), f, indent=2, sort_keys=True)


def _print_samples(run: Run, step: int, n: int, write) -> None:
    ro = run.last_rollouts
    for i in range(min(n, len(ro.completions))):
        write(
            f"[step {step}] reward {ro.rewards[i]:+.2f} | {ro.prompts[i]!r} -> "
            f"{ro.completions[i]!r}"
        )


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
    """Runs (or resumes) training; returns the last logged metrics."""
    from jaxrl_llm import checkpoint, metrics

    compile_s = _compile_seconds()
    run = Run(config, workdir)
    c = config
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=c.checkpoint.keep,
        save_interval_steps=c.checkpoint.every or c.train.num_steps,
        async_save=c.checkpoint.async_save,
    )
    start = 0
    if (latest := ckpt.latest_step()) is not None:
        run.state, extra = ckpt.restore(latest, target=_abstract(run.state))
        run.data_iter.restore(extra["data"])
        start = int(extra["step"])
        print(f"resumed from {ckpt.directory} at step {start}", file=sys.stderr, flush=True)
    _write_run_files(run)
    writer = metrics.MetricWriter(
        workdir,
        c.to_dict(),
        tensorboard=c.logging.tensorboard,
        wandb=c.logging.wandb,
        wandb_project=c.logging.wandb_project,
        run_name=c.logging.run_name or None,
        resume_step=start,
    )
    progress = metrics.Progress(c.train.num_steps, initial_step=start)
    stop = checkpoint.install_sigterm_handler()
    last = {}
    try:
        for step in range(start, c.train.num_steps):
            n_compiles = len(compile_s)
            host = run.step(step)
            done = step + 1
            if done % c.train.log_every == 0 or done == c.train.num_steps:
                dev = {k: float(v) for k, v in jax.device_get(run.last_update_metrics).items()}
                _check_finite(step, dev, c.train.skip_nonfinite)
                last = host | dev | {"perf/compile_s": float(sum(compile_s[n_compiles:]))}
                writer.write(done, last)
            if c.train.print_samples_every and done % c.train.print_samples_every == 0:
                _print_samples(run, done, c.train.num_printed_samples, progress.write)
                writer.write_samples(done, _sample_records(run))
            if c.eval.every and (done % c.eval.every == 0 or done == c.train.num_steps):
                ev = evaluation.evaluate(
                    run.model_cfg,
                    run.state.params,
                    run.eval_batches,
                    run.pool,
                    run.specs,
                    run.tokenizer,
                    run.settings,
                    correct_label=run.correct_label,
                    pass_k=c.eval.pass_k,
                    temperature=c.eval.temperature,
                    mesh=run.mesh,
                    step=done,
                )
                ev = parallel.host_mean(ev)
                writer.write(done, ev)
                last |= ev
            progress.update(done, reward=host["reward/mean"], step_s=host["perf/step_s"])
            extra = {"step": done, "data": run.data_iter.state()}
            if stop.stop_at(done):
                ckpt.save(done, run.state, extra, force=True)
                logging.warning("SIGTERM: saved step %d in %s, exiting", done, ckpt.directory)
                break
            ckpt.save(done, run.state, extra, force=done == c.train.num_steps)
    finally:
        ckpt.wait()
        ckpt.close()
        progress.close()
        writer.close()
        run.pool.close()
        stop.restore()
    return last


def _sample_records(run: Run) -> list[dict]:
    ro = run.last_rollouts
    n = run.config.train.num_printed_samples
    return [
        {"prompt": ro.prompts[i], "completion": ro.completions[i], "reward": float(ro.rewards[i])}
        for i in range(min(n, len(ro.completions)))
    ]


def _abstract(state):
    """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def initialize_distributed() -> None:
    """`jax.distributed.initialize()` when the launch environment asks for it.

    JAXRL_DISTRIBUTED=1 (set by launch/*.sh): JAX detects the cluster itself on TPU VM
    pods, GKE TPU slices and SLURM. JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES /
    JAXRL_PROCESS_ID give it explicitly (e.g. several processes on one machine). CPU
    collectives go through gloo (needed for multi-process CPU runs; other backends
    ignore it).
    """
    if os.environ.get("JAXRL_DISTRIBUTED") != "1":
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = {}
    if "JAXRL_COORDINATOR" in os.environ:
        explicit = dict(
            coordinator_address=os.environ["JAXRL_COORDINATOR"],
            num_processes=int(os.environ["JAXRL_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXRL_PROCESS_ID"]),
        )
    jax.distributed.initialize(**explicit)


def main(argv):
    del argv
    from absl import flags

    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    initialize_distributed()
    if jax.default_backend() == "cpu" and jax.process_index() == 0:
        from jaxrl_llm import allocator

        if note := allocator.hint():
            print(note, file=sys.stderr, flush=True)
    train(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    from jaxrl_llm import allocator

    allocator.reexec_with_tcmalloc()
    config_flags.DEFINE_config_file("config", None, "configs/<experiment>.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics); reruns resume")
    flags.mark_flags_as_required(["config", "workdir"])
    try:
        app.run(main)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if flags.FLAGS.is_parsed():
            raise  # a failure of the run itself, not of the command line
        # ml_collections reports an unknown --config key as an exception while absl parses
        # the flags: turn it into the one line it means.
        text = str(err).replace("\\n", " ").replace("\\", "").replace("'", "")
        message = " ".join(text.split())
        sys.exit(f"error: bad --config override: {message}")

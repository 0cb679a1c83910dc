"""`Run`: everything a training run holds, built from the config, and its step.

    run = Run(config, workdir)          # models, sampler, scorer, data, jitted programs
    metrics = run.step(step)            # sample -> reference -> score -> update
    metrics = run.evaluate(step)        # held-out pass@k

`train.py` drives it: checkpoints, resume, logging and the command line. One step, three
jitted programs and the host in between:

    out = sampler.sample(params, prompts, spec, step)   # jitted: prefill + decode, dispatched
    ref = ref_logprobs(ref_params, out)                  # jitted, dispatched, no wait
    scored = scorer(out, batch)                          # host: ids -> text -> verifiers,
                                                         # overlapping the reference forward
    state, metrics = update(state, RolloutBatch.from_sample(out, rewards, ref))  # jitted

`jax.transfer_guard("disallow")` holds around the step body: the only transfers are the
explicit ones (completion ids out, rewards in, metrics at log steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import jax
import ml_collections

from jaxrl_llm import (
    compilation,
    config_checks,
    data,
    evaluation,
    executables,
    models,
    parallel,
    perf,
    rl,
    rollout,
    run_config,
    sampling,
    tuning,
    verifiers,
)
from jaxrl_llm.modes import RolloutModes, staleness
from jaxrl_llm.parallel import xla_flags

# Config keys that no compiled program reads: they schedule, log, checkpoint or place host
# work. A rerun that changes only these (a resume to more steps, another checkpoint
# interval) loads the stored programs of the run before; every other key is part of their
# key, whether or not a program depends on it.
HOST_ONLY_KEYS = frozenset(
    {
        "checkpoint",  # the whole section
        "logging",  # the whole section
        "eval.every",
        "eval.at_start",
        "train.log_every",
        "train.print_samples_every",
        "train.num_printed_samples",
        "train.verifier_workers",
        "train.verifier_timeout_s",
        "train.verifier_memory_mb",
        "train.max_verifier_error_rate",
        "train.max_failed_steps",
        "train.allow_config_change",
        "train.compilation_cache_dir",
    }
)


class Run(RolloutModes):
    """Everything a training run holds: built from the config, then stepped by `train`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        run_config.validate(config, process_count=jax.process_count())
        # Speed settings the config leaves unset (None) are picked here (`tuning`).
        self.config, self.tuning_line = tuned(config)
        self.workdir = workdir
        self.algo = run_config.algo_config(self.config)
        # One mesh, or (rollout.mode='split') a training mesh and a rollout mesh.
        train_devices, rollout_devices = run_config.split_devices(self.config, jax.devices())
        self.mesh = parallel.make_mesh(run_config.mesh_axes(config.mesh), train_devices)
        self.rollout_mesh = self.mesh
        if rollout_devices:
            axes = run_config.mesh_axes(config.mesh.rollout)
            self.rollout_mesh = parallel.make_mesh(axes, rollout_devices)
        self.compile_log = compilation.CompileLog()  # says what compiles, while it listens
        params = self._load_models()
        self._build_rollout()
        self._build_input()
        self._build_programs(params)
        self._ahead = None  # overlap: the next step's rollout, in flight
        self.rollout_thread = None  # split: started by the first step
        # A CPU reaches its matmul peak at 1024^3, an eighth of the default's start-up cost.
        size = 1024 if jax.default_backend() == "cpu" else 2048
        dtype = self.config.model.dtype
        if self.cache_dir:  # kept there: reruns read it
            self.peak = perf.kept_matmul_peak(dtype, size, self.cache_dir)
        else:
            self.peak = perf.matmul_peak(dtype, size)

    # ----------------------------------------------------------------- Model & tokenizer
    def _load_models(self):
        """Tokenizer, the data rows checked up front (before any weight is read), policy
        (-> its params) and, with beta > 0, the reference params."""
        c = self.config
        self.model_path = run_config.resolve_model_path(c.model.path)
        self.tokenizer_path = run_config.resolve_model_path(
            c.model.tokenizer or self.model_path, "model.tokenizer", need_config=False
        )
        self.tokenizer = models.builtin.load_tokenizer(self.tokenizer_path)
        rows = data.check_rows(c.data, self.tokenizer)
        if rows.bad and jax.process_index() == 0:
            print(rows.summary(), file=sys.stderr, flush=True)
        runtime = dict(remat=c.model.remat, scan_layers=c.model.scan_layers)
        self.model_cfg, params = models.builtin.load_model(
            self.model_path, self.mesh, c.model.dtype, **runtime
        )
        config_checks.check_context(c, self.model_cfg)
        # LoRA: the policy is the base model + adapters; the base (and the reference, with
        # the adapters off) is `base_cfg` over the same arrays.
        self.base_cfg = self.model_cfg
        if (lora_cfg := run_config.lora_config(c)) is not None:
            self.model_cfg = self.model_cfg.replace(lora=lora_cfg)
        self.ref_params, self.ref_is_initial = None, False
        if self.algo.needs_ref and lora_cfg is not None and not c.model.ref_path:
            self.ref_params = params  # the frozen base itself: no second load, no copy
            self.ref_is_initial = True  # with the adapters' B = 0, the initial policy
        elif self.algo.needs_ref:
            ref_path = run_config.resolve_model_path(
                c.model.ref_path or self.model_path, "model.ref_path"
            )
            _, self.ref_params = models.builtin.load_model(ref_path, self.mesh, c.model.dtype)
            self.ref_is_initial = ref_path == self.model_path
        return params

    # ------------------------------------------------------------------------- Rollout
    def _build_rollout(self) -> None:
        """The rollout spec, the sampler and the host-side scorer (verifier pool)."""
        c = self.config
        self.spec = run_config.rollout_spec(c, self.tokenizer)
        pad = data.prompts.pad_id(self.tokenizer)
        self.merge = None  # LoRA, merged sampling: base + adapters -> plain weights
        sampler_cfg = self.model_cfg
        if self.model_cfg.lora is not None:
            mode = models.lora.sampler_mode(c.model.lora.sampler, self.model_cfg, self._rows())
            if mode == "merged":
                self.merge = models.lora.make_merge_fn(self.model_cfg, self.mesh)
                sampler_cfg = self.base_cfg
        self.sampler = sampling.Sampler(
            sampler_cfg, self.rollout_mesh, seed=c.train.seed, pad_id=pad,
            bucket_steps=c.rollout.bucket_steps, cache_segments=c.rollout.cache_segments,
        )  # fmt: skip
        self.pool = verifiers.VerifierPool(
            c.train.verifier_workers or None, timeout_s=c.train.verifier_timeout_s,
            memory_mb=c.train.verifier_memory_mb,
        )  # fmt: skip
        self.budget = verifiers.ErrorBudget(
            c.train.max_verifier_error_rate, c.train.max_failed_steps
        )
        self.warning = None  # the last step's verifier warning, for the progress output
        self.scorer = rollout.Scorer(
            self.tokenizer, self.pool, verifiers.parse_specs(c.rewards) if c.rewards else [],
            self.spec,
            overlong_buffer=self._overlong_buffer(), mesh=self.mesh,
        )  # fmt: skip
        self.correct_label = c.eval.correct_reward or next((s.label for s in self.scorer.specs), "")
        if self.scorer.specs:
            self.pool.prepare(self.scorer.specs)  # the workers load while the programs build
        self.env_rollout = None
        if c.env.name:  # multi-turn: the environments give the reward
            from jaxrl_llm.envs.runner import EnvRollout

            self.env_rollout = EnvRollout(c, self.tokenizer, self.sampler, self.spec, self.mesh)

    # --------------------------------------------------------------------------- Input
    def _build_input(self) -> None:
        """This process's training prompts and the fixed held-out batches."""
        c, B = self.config, self.config.rollout.batch_size
        hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
        self.data_iter = data.make_iterator(c.data, self.tokenizer, B, **hosts)
        self.eval_batches = []
        if c.eval.every > 0:
            self.eval_batches = evaluation.held_out_batches(c, self.tokenizer, B)

    # ---------------------------------------------- State, update and reference programs
    def _build_programs(self, params) -> None:
        c, o = self.config, self.config.optim
        opt = rl.optimizer_from_config(o, c.train.num_steps)
        critic_params = critic_opt = None
        if self.algo.uses_critic:
            critic_params = rl.init_critic(self.model_cfg, params, seed=c.train.seed)
            critic_opt = rl.optimizer_from_config(o, c.train.num_steps, o.critic_learning_rate)
        frozen = None
        if self.model_cfg.lora is not None:  # only the adapters train
            frozen = params
            params = models.lora.init_adapters(
                self.model_cfg, c.train.seed, self.mesh, c.model.dtype
            )
        self.state = rl.init_train_state(
            params, opt, critic_params=critic_params, critic_optimizer=critic_opt, frozen=frozen
        )
        self.update = rl.make_update_fn(
            self.model_cfg, self.algo, opt, self.spec, micro_batches=o.micro_batches,
            mini_batches=o.mini_batches, chunk_size=c.train.logprob_chunk,
            critic_optimizer=critic_opt, skip_nonfinite=c.train.skip_nonfinite,
            seed=c.train.seed, reference_is_initial=self.ref_is_initial,
        )  # fmt: skip
        self.updated = False  # whether this Run has applied an update (`reads_reference`)
        # Opens the reference's build when its log-probs are first needed (`precompile_step`).
        self.reference_gate = compilation.Gate()
        self.ref_logprobs = None
        if self.algo.needs_ref:  # the update's row slices bound its memory the same way
            self.ref_logprobs = rl.make_logprob_fn(
                self.base_cfg, self.spec, chunk_size=c.train.logprob_chunk,
                micro_batches=o.micro_batches * o.mini_batches, mesh=self.mesh,
            )  # fmt: skip

    @property
    def cache_dir(self) -> str | None:
        """`train.compilation_cache_dir` as an absolute path; None when it is off."""
        cache = self.config.train.compilation_cache_dir
        return os.path.abspath(os.path.expanduser(cache)) if cache else None

    def executable_store(self) -> executables.Store | None:
        """Where start-up keeps and finds the step's compiled programs (`executables`,
        under the compilation cache), keyed by what this run was built from; None without
        a cache, with several processes, or with a rollout mesh of its own."""
        c = self.config
        if not self.cache_dir or jax.process_count() > 1:
            return None
        if self.rollout_mesh is not self.mesh or self.mesh.size != jax.device_count():
            return None
        built = (self.model_cfg, self.base_cfg, self.spec, self.algo, self.sampler.pad_id)
        context = store_context(c) + "\n".join(map(repr, built))
        return executables.Store(os.path.join(self.cache_dir, "executables"), context)

    def _rows(self) -> int:
        """Rollout rows per step (all hosts)."""
        return self.config.rollout.batch_size * self.config.rollout.num_generations

    def _policy_params(self):
        """What the sampler reads: the policy's params; with LoRA base + adapters, merged
        into a transient weight set (one merge per call) or left unmerged (`self.merge`
        is None; the sampler's model then applies them)."""
        params = self.state.policy_params()
        return params if self.merge is None else self.merge(params)

    def _overlong_buffer(self) -> int:
        """DAPO's L_c in tokens (0: no overlong penalty)."""
        if not self.algo.overlong_penalty:
            return 0
        return max(1, round(self.algo.overlong_buffer_frac * self.spec.max_new_tokens))

    # ---------------------------------------------------------------------- the step
    def step(self, step: int) -> dict:
        """One RL step -> this step's host metrics (the update's device metrics stay on
        device in `last_update_metrics` until a log step)."""
        if self.rollout_mesh is not self.mesh:
            return self._split_step(step)
        clock, dynamic = perf.PhaseClock(), self.algo.dynamic_sampling
        with self._transfer_guard():
            if self.env_rollout is not None:  # multi-turn: the turn loop, then the reference
                batch, version = next(self.data_iter), step
                out, scored = self.play(batch, step, clock)
                ref = self.reference(out, step)
            else:
                batch, out, version = self._rollout(step)  # device arrays, dispatched
                ref = None if dynamic else self.reference(out, step)  # dispatched, no wait
                self._sample_ahead(step)  # overlap: step + 1's rollout, by these parameters
                scored = self.score(out, batch, clock)  # host, overlapping the device work
            if dynamic:  # DAPO: degenerate groups replaced, then the reference
                out, scored = self.refill(out, scored, step, clock)
                ref = self.reference(out, step)
            clock.wait("reference", ref)
            self._check_verifiers(scored, step)
            rewards = parallel.shard_local_batch(scored.rewards, self.mesh)  # [N], global
            batch = rl.RolloutBatch.from_sample(out, rewards, ref)
            with self.compile_log.program("update", _bucket(out)):
                self.state, self.last_update_metrics = self.update(self.state, batch)
            self.updated = True
            clock.wait("update", self.state)
        self.reference_gate.open()  # the next step's reference may build now
        self.last_scored, self.last_prompt_width = scored, out.prompt_tokens.shape[1]
        metrics = self._metrics(out, scored, clock) | staleness(step - version)
        return parallel.host_mean(metrics)  # each process saw its own rows

    def close(self) -> None:
        """Stops the rollout thread (split), the environments and the verifier workers."""
        if self.rollout_thread is not None:
            self.rollout_thread.close()
        if self.env_rollout is not None:
            self.env_rollout.close()
        self.pool.close()

    def sample(
        self, batch, step: int, round: int = 0, version: int | None = None, params=None
    ) -> sampling.SampleOutput:
        """G completions of each prompt by `params` (default: the current ones), whose
        version (updates applied) is `version` (default: step). The random key depends on
        step and round only, so a rollout sampled ahead draws with its step's key."""
        rounds = 1 + (self.algo.max_resample_rounds if self.algo.dynamic_sampling else 0)
        with self.compile_log.program("sampler") as compiled:
            out = self.sampler.sample(
                self.sampler_params() if params is None else params,
                batch.prompt_ids, batch.prompt_mask, self.spec,
                step * rounds + round, version=step if version is None else version,
            )  # fmt: skip
            compiled.detail = _bucket(out)
        return out

    def play(self, batch, step: int, clock):
        """Multi-turn rollouts of `batch` (`envs.EnvRollout`), scored by their environments."""
        with self.compile_log.program("sampler", "multi-turn", runs=True):
            out, scored = self.env_rollout(self.sampler_params(), batch, step)
        clock.mark("sample")
        clock.mark("score")
        return out, scored

    def reads_reference(self, step: int) -> bool:
        """Whether `step`'s update reads the reference model's log-probs: not at a fresh
        run's step 0 when the reference is the initial policy (the params are then the
        reference's, and the update takes the policy's own: `rl.make_update_fn`)."""
        return self.ref_logprobs is not None and not (
            self.ref_is_initial and step == 0 and not self.updated
        )

    def reference(self, out, step: int):
        """Dispatches the reference log-probs [N, T] (async); None when beta = 0. A step
        whose update does not read them (`reads_reference`) gets the rollout's log-probs
        in their place, an input of the same shape and sharding (the update compiled for
        one serves both): no reference forward runs."""
        if self.ref_logprobs is None:
            return None
        if not self.reads_reference(step):  # a copy only where the rows are laid out apart
            return jax.device_put(out.logprobs, self.row_sharding)
        self.reference_gate.open()
        with self.compile_log.program("reference", _bucket(out)):
            return self.ref_logprobs(self.ref_params, out)

    def score(self, out, batch, clock) -> rollout.Scored:
        clock.wait("sample", out.tokens)
        scored = self.scorer(out, batch)
        clock.mark("score")
        return scored

    def _check_verifiers(self, scored, step: int) -> None:
        """Warns on a step where a verifier or the environment failed too often; stops the
        run after train.max_failed_steps such steps in a row (hosts decide on the mean)."""
        rates = None
        if jax.process_count() > 1:
            rates = parallel.host_mean(scored.details.error_rates())
        self.warning = self.budget.check(scored.details, step, rates=rates)

    def evaluate(self, step: int) -> dict:
        e = self.config.eval
        with self.compile_log.program("evaluation", runs=True):
            if self.env_rollout is not None:  # whole trajectories, scored by the environments
                metrics = self.env_rollout.evaluate(
                    self.sampler_params(), self.eval_batches, pass_k=e.pass_k,
                    temperature=e.temperature, step=step,
                )  # fmt: skip
                return parallel.host_mean(metrics)
            metrics = evaluation.evaluate(
                self.sampler, self.sampler_params(), self.eval_batches, self.scorer,
                correct_label=self.correct_label, pass_k=e.pass_k, temperature=e.temperature,
                step=step,
            )  # fmt: skip
        return parallel.host_mean(metrics)

    def _transfer_guard(self):
        if self.config.train.transfer_guard:
            return jax.transfer_guard("disallow")
        return contextlib.nullcontext()

    def _metrics(self, out, scored, clock) -> dict:
        s, step_s = clock.seconds, clock.total
        rows, P, T = out.tokens.shape[0], out.prompt_tokens.shape[1], out.tokens.shape[1]
        flops = perf.step_flops(
            self.model_cfg,
            rows=rows,
            prompts=rows // self.spec.num_generations,
            prompt_len=float(scored.prompt_lengths.mean()),
            new_tokens=float(scored.lengths.mean()),
            reference=self.ref_logprobs is not None,
            update_forwards=self.update.forward_passes,
            update_shared_forwards=self.update.shared_prompt_passes,
            reference_shares_prompts=self.spec.num_generations > 1,
        )
        return (
            scored.metrics
            | self.data_iter.metrics()
            | {
                "reward/mean": float(scored.rewards.mean()),
                "reward/std": float(scored.rewards.std()),
                "perf/step_s": step_s,
                "perf/sample_s": s["sample"],
                "perf/reference_s": s["reference"],
                "perf/score_s": s["score"],
                "perf/update_s": s["update"],
                "perf/rollout_tokens_per_s": float(scored.lengths.sum()) / max(s["sample"], 1e-9),
                "perf/update_tokens_per_s": rows * (P + T) / max(s["update"], 1e-9),
                "perf/mfu": sum(flops.values()) / step_s / self.peak,
            }
        )


def tuned(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str]:
    """The config with the speed settings it leaves unset picked for this backend and
    model (`tuning.resolve`), and the line saying which ("" when it sets them all), with
    the XLA:CPU optimisation level where XLA_FLAGS sets it (`parallel.xla_flags`)."""
    devices, _ = run_config.split_devices(config, jax.devices())
    shape = parallel.mesh_shape(run_config.mesh_axes(config.mesh), len(devices))
    model_cfg = models.builtin.model_config(run_config.resolve_model_path(config.model.path))
    backend = jax.default_backend()
    config, line = tuning.resolve(config, model_cfg, backend, batch_shards=shape[0] * shape[1])
    if backend == "cpu" and (level := xla_flags.named(xla_flags.LEVEL)):
        line = "; ".join(filter(None, [line, f"XLA_FLAGS: {xla_flags.LEVEL}={level}"]))
    return config, line


def _bucket(out) -> str:
    return f"bucket {out.prompt_tokens.shape[1]}"


def store_context(config) -> str:
    """The part of the stored executables' key that comes from the run config: every key
    but `HOST_ONLY_KEYS`, and `train.num_steps` only where the learning-rate schedule
    decays over it (a constant schedule, warmup or not, never reads it)."""
    c = config.to_dict()
    for key in HOST_ONLY_KEYS:
        section, _, name = key.partition(".")
        if name:
            c.get(section, {}).pop(name, None)
        else:
            c.pop(section, None)
    if c.get("optim", {}).get("schedule") == "constant":
        c.get("train", {}).pop("num_steps", None)
    return json.dumps(c, sort_keys=True, default=repr)

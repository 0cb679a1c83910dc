"""`Run`: everything a training run holds, built from a prepared config, and its step.

    run = Run.build(raw_config, workdir)     # = Run(config.prepare(raw_config), workdir)
    result = run.step(step)                  # -> StepResult; nothing is left on `run`
    metrics = run.evaluate(step)             # held-out pass@k

`trainer.loop` drives it: checkpoints, resume, logging. One step, three jitted programs
and the host in between:

    params = run.sampler_params()                     # the policy as the sampler reads it
    ro = source.next(step, params, clock)             # a rollout source per mode (`sources`)
    ref = ref_logprobs(ref_params, ro.out)            # jitted, dispatched, no wait
    teacher = teacher_logprobs(teacher_params, ro.out)  # (teacher.path) the same program
    scored = ro.scored or score(ro)                   # host: ids -> text -> verifiers
                                                      # (and judges, on the mesh),
                                                      # overlapping the two forwards
    state, metrics = update(state, RolloutBatch.from_sample(ro.out, rewards, ref, teacher))

`jax.transfer_guard("disallow")` holds around the step body: the only transfers are the
explicit ones (completion ids out, rewards in, metrics at log steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import jax
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import data, models, parallel, rl, verifiers
from jaxrl_llm.parallel import allocator
from jaxrl_llm.rollout import evaluation, scoring
from jaxrl_llm.rollout.agents import AgentRollout
from jaxrl_llm.rollout.modes import make_source
from jaxrl_llm.rollout.played import EnvRollout
from jaxrl_llm.rollout.sources import Sampling, bucket, make_sampler, staleness
from jaxrl_llm.startup import compilation, peak
from jaxrl_llm.trainer import perf, teachers
from jaxrl_llm.trainer.programs import make_reference, make_scorer, make_update
from jaxrl_llm.workers.remote import rollout_workers
from jaxrl_llm.workers.turns import Fleet


@dataclasses.dataclass
class StepResult:
    """What one step produced: its host metrics (floats, averaged over processes), the
    update's metrics (device arrays, fetched at log steps), the scored samples, the
    verifier warning line (None when every verifier was healthy), and the data position
    a checkpoint after this step stores."""

    host: dict
    device: dict
    scored: scoring.Scored
    warning: str | None
    data_position: object


class Run:
    """Everything a training run holds: built from a `config.Prepared`, stepped by
    `trainer.loop`."""

    def __init__(self, prepared: config_lib.Prepared, workdir: str):
        c = self.config = prepared.config
        self.tuning_line, self.workdir = prepared.tuning_line, workdir
        self.algo = config_lib.algo_config(c)
        # One mesh, or (rollout.mode='split') a training mesh and a rollout mesh.
        train_devices, rollout_devices = config_lib.split_devices(c, jax.devices())
        self.mesh = parallel.make_mesh(config_lib.mesh_axes(c.mesh), train_devices)
        rollout_mesh = self.mesh
        if rollout_devices:
            axes = config_lib.mesh_axes(c.mesh.rollout)
            rollout_mesh = parallel.make_mesh(axes, rollout_devices)
        self.compile_log = compilation.CompileLog()  # says what compiles, while it listens
        params = self._load_models(prepared)
        self._build_rollout(rollout_mesh)
        self._build_programs(params)
        self.fresh = True  # no update applied yet by this Run (`reads_reference`)
        # Compiled programs when free pages were last released (None: release before the
        # next update).
        self._compiled_at_release: int | None = 0
        cache = c.train.compilation_cache_dir  # the peak is kept there: reruns read it
        self.peak = peak.device_peak(c.model.dtype, cache and os.path.expanduser(cache))

    @classmethod
    def build(cls, raw: config_lib.ConfigDict, workdir: str) -> Run:
        """Prepares `raw` (`config.prepare`: checked, speed settings picked) and builds."""
        return cls(config_lib.prepare(raw), workdir)

    # ----------------------------------------------------------------- Model & tokenizer
    def _load_models(self, prepared: config_lib.Prepared):
        """Tokenizer, the data rows checked up front (before any weight is read), policy
        (-> its params) and, with beta > 0, the reference params."""
        c = self.config
        self.model_path = prepared.model_path
        self.tokenizer = models.builtin.load_tokenizer(prepared.tokenizer_path)
        rows = data.check_rows(c.data, self.tokenizer)
        if rows.bad and jax.process_index() == 0:
            print(rows.summary(), file=sys.stderr, flush=True)
        self.model_cfg, params = models.builtin.load_model(
            self.model_path, self.mesh, c.model.dtype, **config_lib.model_runtime(c)
        )
        # LoRA: the policy is the base model + adapters; the base (and the reference, with
        # the adapters off) is `base_cfg` over the same arrays.
        self.base_cfg = self.model_cfg
        if (lora_cfg := config_lib.lora_config(c)) is not None:
            self.model_cfg = self.model_cfg.replace(lora=lora_cfg)
        self.ref_params, self.ref_is_initial = None, False
        if self.algo.needs_ref and lora_cfg is not None and not c.model.ref_path:
            self.ref_params = params  # the frozen base itself: no second load, no copy
            self.ref_is_initial = True  # with the adapters' B = 0, the initial policy
        elif self.algo.needs_ref:
            ref_path = config_lib.resolve_model_path(
                c.model.ref_path or self.model_path, "model.ref_path"
            )
            _, self.ref_params = models.builtin.load_model(ref_path, self.mesh, c.model.dtype)
            self.ref_is_initial = ref_path == self.model_path
        self.teachers, self.teacher_index = teachers.load_teachers(
            c, self.algo, self.tokenizer, self.mesh
        )  # [(label, cfg, params)]; teacher name -> its index (teacher.path's: "")
        return params

    # ------------------------------------------------------------------------- Rollout
    def _build_rollout(self, rollout_mesh) -> None:
        """The rollout spec, the sampler, the scorer (verifier pool), the data and the
        rollout source."""
        c = self.config
        self.spec = config_lib.rollout_spec(c, self.tokenizer)
        self.merge = None  # LoRA, merged sampling: base + adapters -> plain weights
        sampler_cfg = self.model_cfg
        if self.model_cfg.lora is not None:  # rollout workers merge their own
            rows = c.rollout.batch_size * c.rollout.num_generations
            mode = models.lora.sampler_mode(c.model.lora.sampler, self.model_cfg, rows)
            if mode == "merged" or c.rollout.workers:
                self.merge = models.lora.make_merge_fn(self.model_cfg, self.mesh)
                sampler_cfg = self.base_cfg
        pad = data.prompts.pad_id(self.tokenizer)
        sampler = make_sampler(c, sampler_cfg, rollout_mesh, pad)  # rollout.engine
        scorer = make_scorer(
            c, self.tokenizer, self.spec, self.algo, self.mesh, rollout_mesh, self.compile_log
        )
        self.pool, self.judges = scorer.pool, scorer.judges
        self.budget = verifiers.ErrorBudget(
            c.train.max_verifier_error_rate, c.train.max_failed_steps
        )
        hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
        rounds = 1 + (self.algo.max_resample_rounds if self.algo.dynamic_sampling else 0)
        self.sampling = Sampling(
            sampler=sampler,
            spec=self.spec,
            scorer=scorer,
            data=data.make_iterator(c.data, self.tokenizer, c.rollout.batch_size, **hosts),
            mesh=self.mesh,
            rollout_mesh=rollout_mesh,
            compile_log=self.compile_log,
            rounds=rounds,
            guard=self.transfer_guard,
            workers=(workers := rollout_workers(c, pad)),
        )
        self.env_rollout = None
        turns = workers and Fleet(workers, {"kind": "turns"})  # multi-turn on the workers
        args = (c, self.tokenizer, sampler, self.spec, rollout_mesh)
        if c.env.name:  # multi-turn: the environments give the reward
            self.env_rollout = EnvRollout(*args, engine=turns)
        elif c.agent.entry:  # agents through the gateway: their return value is the reward
            self.env_rollout = AgentRollout(*args, engine=turns)
        self.source = make_source(c, self.sampling, self.algo, self.env_rollout)
        e = c.eval
        self.eval_batches = []
        if e.every > 0:
            self.eval_batches = evaluation.held_out_batches(c, self.tokenizer, c.rollout.batch_size)
        self.eval_specs = [s for s in evaluation.specs(self.spec, e.pass_k, e.temperature) if s]
        self.correct_label = e.correct_reward or next((s.label for s in scorer.specs), "")

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
        # Loaded weights may view host memory, which the first update could not donate.
        params, critic_params = rl.owned((params, critic_params))
        self.state = rl.init_train_state(
            params, opt, critic_params=critic_params, critic_optimizer=critic_opt, frozen=frozen
        )
        self.update = make_update(c, self.algo, self.model_cfg, opt, self.spec, critic_opt)
        # The reference's program, over each teacher.
        self.teacher_programs = [
            rl.make_logprob_fn(
                cfg,
                self.spec,
                chunk_size=c.train.logprob_chunk,
                micro_batches=o.micro_batches * o.mini_batches,
                mesh=self.mesh,
            )
            for _, cfg, _ in self.teachers
        ]
        self.pick_teacher = jax.jit(
            teachers.pick_rows, out_shardings=parallel.batch_sharding(self.mesh, 2)
        )
        self.ref_logprobs = make_reference(c, self.algo, self.base_cfg, self.spec, self.mesh)

    # ---------------------------------------------------------------------- the step
    def step(self, step: int) -> StepResult:
        """One RL step: rollout from the source, reference (dispatched), rewards, update."""
        clock = perf.PhaseClock()
        with self.transfer_guard():
            self._release_each_phase()
            ro = self.source.next(step, self.sampler_params(rollout=True), clock)
            ref = self.reference(ro.out, step)  # dispatched, no wait
            teacher = self.teacher(ro)  # dispatched, no wait
            scored = ro.scored or self.sampling.score(ro.out, ro.batch, clock)  # host
            clock.wait("reference", (ref, teacher))
            warning = self._check_verifiers(scored, step + 1)  # numbered as metrics.jsonl
            rewards = parallel.shard_local_batch(scored.rewards, self.mesh)  # [N], global
            with self.compile_log.program("update", bucket(ro.out)):
                self._release_after_compiles()
                self._release_each_phase()
                self.state, device = self.update(
                    self.state, rl.RolloutBatch.from_sample(ro.out, rewards, ref, teacher)
                )
            self.fresh = False
            clock.wait("update", self.state)
        host = self._metrics(ro.out, scored, clock) | ro.metrics | staleness(step - ro.version)
        return StepResult(
            host=parallel.host_mean(host),
            device=device,
            scored=scored,
            warning=warning,
            data_position=ro.position,
        )

    def _release_after_compiles(self) -> None:
        """Before an update that follows new compiles (the first step's, a new prompt
        bucket's), the allocator's free pages go back to the system: what compiling and
        sampling freed would otherwise stay resident beside the update's temporaries,
        which XLA takes as one block (`parallel.allocator.release_free_memory`)."""
        compiled = len(self.compile_log.programs)
        if compiled != self._compiled_at_release:
            allocator.release_free_memory()
            self._compiled_at_release = compiled

    def _release_each_phase(self) -> None:
        """`train.release_memory="phases"`: the free pages go back to the system before
        each rollout and each update. The update's and the sampler's temporaries are
        each one block that the other's freed block does not serve, so kept, both stay
        resident from the second step on; released, the peak holds one of them."""
        if self.config.train.release_memory == "phases":
            allocator.release_free_memory()

    def reads_reference(self, step: int) -> bool:
        """Whether `step`'s update needs the reference model's forward: not at a fresh
        run's first step when the reference is the initial policy (the params are then the
        reference's, and the rollout's behaviour log-probs stand in for its log-probs)."""
        return self.ref_logprobs is not None and not (
            self.ref_is_initial and self.fresh and step == 0
        )

    def reference(self, out, step: int):
        """Dispatches the reference log-probs [N, T] (async); None when beta = 0. Where
        `reads_reference` is False the sampler's behaviour log-probs of the rollout are
        the reference's (the same model, computed by the sampling program: equal up to
        float rounding), and no reference forward runs."""
        if self.ref_logprobs is None:
            return None
        if not self.reads_reference(step):  # a copy only where the rows are laid out apart
            return jax.device_put(out.logprobs, self.sampling.row_sharding)
        with self.compile_log.program("reference", bucket(out)):
            return self.ref_logprobs(self.ref_params, out)

    def teacher(self, ro):
        """Dispatches the teacher's log-probs of the rollout's sampled tokens [N, T]
        (async), by the reference's program over the teacher's params; None without a
        teacher. Several teachers (teacher.field): every one runs over the batch and each
        row keeps its own teacher's (`teacher_rows`)."""
        if not self.teachers:
            return None
        out = ro.out
        logps = []
        for (label, _, params), program in zip(self.teachers, self.teacher_programs, strict=True):
            with self.compile_log.program(label, bucket(out)):
                logps.append(program(params, out))
        if not self.config.teacher.field:
            return logps[0]
        rows = parallel.shard_local_batch(self.teacher_rows(ro), self.mesh)
        with self.compile_log.program("teacher rows", bucket(out)):
            return self.pick_teacher(rows, *logps)

    def teacher_rows(self, ro) -> np.ndarray:
        """[n] int32: the index into `self.teachers` of each of this process's rows,
        named by its data row's teacher.field (teacher.path where it names none;
        `teachers.teacher_rows`)."""
        return teachers.teacher_rows(self.config.teacher, self.teacher_index, ro)

    def close(self) -> None:
        """Stops the rollout source (the rollout thread, the environments) and the
        verifier workers."""
        self.source.close()
        self.pool.close()

    def sampler_params(self, rollout: bool = False):
        """The policy's params as the sampler reads them, where it runs: with LoRA, base +
        adapters merged into a transient weight set (one merge per call) or left unmerged
        (`self.merge` is None; the sampler's model then applies them); in split mode moved
        to the rollout mesh (device to device). The rollout's on rollout workers: base and
        adapters as they are (each worker merges them, `workers.weights`)."""
        params = self.state.policy_params()
        if self.merge is not None and not (rollout and self.sampling.workers is not None):
            params = self.merge(params)
        if self.sampling.rollout_mesh is self.mesh:
            return params
        return parallel.to_mesh(params, self.sampling.rollout_mesh)

    def _check_verifiers(self, scored, step: int) -> str | None:
        """The warning line of a step where a verifier or the environment failed too
        often; stops the run after train.max_failed_steps such steps in a row (every host
        decides on the mean)."""
        rates = None
        if jax.process_count() > 1:
            rates = parallel.host_mean(scored.details.error_rates())
        return self.budget.check(scored.details, step, rates=rates)

    def evaluate(self, step: int) -> dict:
        e = self.config.eval
        # Evaluation's sampler takes its temporaries as a block of its own, which the
        # update's freed block does not serve: the free pages go back to the system before
        # it and again before the next update (`_release_after_compiles`), so that neither
        # block stays resident beside the other. Once per evaluation, not per step.
        allocator.release_free_memory()
        self._compiled_at_release = None
        with self.compile_log.program("evaluation", runs=True):
            if self.env_rollout is not None:  # whole trajectories, scored by the environments
                metrics = self.env_rollout.evaluate(
                    self.sampler_params(),
                    self.eval_batches,
                    pass_k=e.pass_k,
                    temperature=e.temperature,
                    step=step,
                )
                return parallel.host_mean(metrics)
            metrics = evaluation.evaluate(
                self.sampling.sampler,
                self.sampler_params(),
                self.eval_batches,
                self.sampling.scorer,
                correct_label=self.correct_label,
                pass_k=e.pass_k,
                temperature=e.temperature,
                step=step,
            )
        return parallel.host_mean(metrics)

    def transfer_guard(self):
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
            | self.sampling.data.metrics()
            | {
                "reward/mean": float(scored.rewards.mean()),
                "reward/std": float(scored.rewards.std()),
                "perf/step_s": step_s,
                "perf/sample_s": s.get("sample", 0.0),
                "perf/reference_s": s.get("reference", 0.0),
                "perf/score_s": s.get("score", 0.0),
                "perf/update_s": s["update"],
                "perf/rollout_tokens_per_s": float(scored.lengths.sum())
                / max(s.get("sample", 0.0), 1e-9),
                "perf/update_tokens_per_s": rows * (P + T) / max(s["update"], 1e-9),
                "perf/mfu": sum(flops.values()) / step_s / self.peak,
                "rollout/prompt_width": float(P),
            }
        )

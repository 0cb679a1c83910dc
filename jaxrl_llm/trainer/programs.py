"""What a run builds from its config besides the models: its jitted update and reference
programs (`make_update`, `make_reference`; the compile-only run, `tpu.compile_for`, builds
the same ones for TPU chips) and the scorer of its rollouts (`make_scorer`: the verifier
pool, the reward terms, DAPO's overlong penalty, the judges)."""

from __future__ import annotations

from jaxrl_llm import rl, verifiers
from jaxrl_llm.rollout import scoring
from jaxrl_llm.trainer import judges


def make_update(c, algo, model_cfg, opt, spec, critic_opt=None) -> rl.UpdateFn:
    """The run's jitted update (`rl.make_update_fn`) with run config `c`'s settings."""
    o = c.optim
    return rl.make_update_fn(
        model_cfg,
        algo,
        opt,
        spec,
        micro_batches=o.micro_batches,
        mini_batches=o.mini_batches,
        chunk_size=c.train.logprob_chunk,
        critic_optimizer=critic_opt,
        skip_nonfinite=c.train.skip_nonfinite,
        seed=c.train.seed,
        packing=o.packing,
        packing_capacity=o.packing_capacity,
    )


def make_reference(c, algo, base_cfg, spec, mesh):
    """The reference's jitted log-prob program on `mesh`; None when the algorithm reads
    no reference (beta = 0). The update's row slices bound its memory the same way."""
    if not algo.needs_ref:
        return None
    o = c.optim
    return rl.make_logprob_fn(
        base_cfg,
        spec,
        chunk_size=c.train.logprob_chunk,
        micro_batches=o.micro_batches * o.mini_batches,
        mesh=mesh,
        packing=o.packing,
        packing_capacity=o.packing_capacity,
        replay=algo.routing_replay == "rollout",
    )


def make_scorer(c, tokenizer, spec, algo, mesh, rollout_mesh, compile_log) -> scoring.Scorer:
    """The rollout's scorer: the verifier pool (its workers start loading the reward
    functions now, while the programs build), the reward terms of `rewards`, DAPO's
    overlong penalty, and a judge model for each judge entry, on the mesh that scores
    (the rollout mesh in split mode, where the rollout thread scores; else the one mesh)."""
    pool = verifiers.VerifierPool(
        c.train.verifier_workers or None,
        timeout_s=c.train.verifier_timeout_s,
        memory_mb=c.train.verifier_memory_mb,
    )
    specs = verifiers.parse_specs(c.rewards) if c.rewards else []
    overlong = 0  # DAPO's L_c in tokens (0: no overlong penalty)
    if algo.overlong_penalty:
        overlong = max(1, round(algo.overlong_buffer_frac * spec.max_new_tokens))
    made = judges.make_judges(
        specs,
        rollout_mesh,
        c.model.dtype,
        c.train.seed,
        prompt_budget=c.data.max_prompt_len + c.rollout.max_new_tokens,
        compile_log=compile_log,
    )
    scorer = scoring.Scorer(
        tokenizer, pool, specs, spec, overlong_buffer=overlong, mesh=mesh, judges=made
    )
    if scorer.pool_specs:
        pool.prepare(scorer.pool_specs)
    return scorer

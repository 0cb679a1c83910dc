"""The step's programs compiled before the first step, at the shapes it will read.

    precompile_step(run, background=True, evaluate_first=False, step=start)

The sampler, the reference, the teacher (on-policy distillation), each judge's sampler
(judge reward entries, at their fixed prompt width), and the update (and evaluation's
sampler programs when it is scheduled) are lowered here and compiled by
`CompileLog.ahead_of_time`: side by side, one by one, or in the background beside the
first step, in the order the run needs them. The rollouts and log-probs are pinned to row
sharding (`Sampler.row_sharding`), so the reference, the teacher and the update can be
compiled from the sampler's output shapes alone. Other prompt buckets compile when they
first come.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm import parallel, rl
from jaxrl_llm.startup.compilation import shaped


def precompile_step(
    run,
    side_by_side: bool = True,
    background: bool = False,
    evaluate_first: bool = False,
    step: int = 0,
) -> None:
    """Compiles a `trainer.Run`'s step programs before its first step (`step`).

    evaluate_first: evaluation's programs come first, for a run that evaluates before its
    first step. When the first step's update does not read the reference's log-probs
    (`Run.reads_reference`: a fresh run whose reference is the initial policy), the
    reference is built after the update, deferred to the end of that step (or its first
    call), so that it does not share the cores with the first step's programs."""
    data = run.sampling.data
    position = data.state()
    batch = next(data)
    data.restore(position)
    params, rows = run.sampler_params(), run.sampling.row_sharding
    sampler = run.sampling.sampler
    bucket = f"bucket {sampler.bucketed(batch.prompt_ids, batch.prompt_mask)[0].shape[1]}"
    with run.compile_log.ahead_of_time(side_by_side, background) as build:
        if run.eval_batches and evaluate_first:
            _evaluation(run, build, params)
        program, args, kwargs = sampler.sample_program(
            params, batch.prompt_ids, batch.prompt_mask, run.spec
        )
        out = shaped(build("sampler", bucket, program, *args, **kwargs), rows)
        later = background and run.ref_logprobs is not None and not run.reads_reference(step)
        # The reference's log-probs are shaped and placed like the rollout's (rows, float32).
        ref = None if run.ref_logprobs is None else out.logprobs
        if run.ref_logprobs is not None and not later:
            build("reference", bucket, run.ref_logprobs, run.ref_params, out)
        teacher = None  # on-policy distillation: the teacher's log-probs, shaped the same
        for (label, _, params), program in zip(run.teachers, run.teacher_programs, strict=True):
            build(label, bucket, program, params, out)
            teacher = out.logprobs
        local_rows = out.tokens.shape[0] // jax.process_count()
        for judge in run.judges:  # scores this process's rows, after the reference
            program, args, kwargs = judge.program(local_rows)
            build(judge.name, f"bucket {judge.width}", program, *args, **kwargs)
        rewards = parallel.shard_local_batch(np.zeros(local_rows, np.float32), run.mesh)
        rollouts = rl.RolloutBatch.from_sample(out, rewards, ref, teacher)
        program, args = run.update.program(run.state, rollouts)
        build("update", bucket, program, *args)
        if later:
            build("reference", bucket, run.ref_logprobs, run.ref_params, out, deferred=True)
        if run.eval_batches and not evaluate_first:
            _evaluation(run, build, params)


def _evaluation(run, build, params) -> None:
    """Evaluation's sampler programs (greedy, pass@k) at its first batch's bucket."""
    first = run.eval_batches[0]
    ids, mask = first.prompt_ids, first.prompt_mask
    sampler = run.sampling.sampler
    bucket = f"bucket {sampler.bucketed(ids, mask)[0].shape[1]}"
    for spec in run.eval_specs:
        what = "greedy" if spec.temperature == 0 else f"pass@{spec.num_generations}"
        program, args, kwargs = sampler.sample_program(params, ids, mask, spec)
        build(f"evaluation sampler, {what}", bucket, program, *args, serves="evaluation", **kwargs)

"""rollout.mode: where a step's rollout comes from, and the staleness it has.

- sync: sampled in the step, by the parameters the step updates (`Run.step`).
- overlap: sampled during the previous step by the parameters before its update
  (`_sample_ahead`, taken by `_rollout`); staleness 1.
- split: sampled and scored on the rollout mesh by `rollout_thread.RolloutThread`, up to
  `rollout.max_staleness` versions ahead (`_split_step`); parameters move to the rollout
  mesh device to device (`sampler_params`), rollouts to the training mesh.

DAPO's dynamic sampling adds rounds to any of them: `refill` samples more batches until
the step has B mixed-reward groups.

`RolloutModes` is a part of `run.Run` (its methods read the run's sampler, data iterator
and programs); docs/async.md describes the modes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl_llm import parallel, perf, rl, rollout, sampling
from jaxrl_llm.rollout_thread import RolloutThread


class RolloutModes:
    """The overlap and split parts of `Run`."""

    def _split_step(self, step: int) -> dict:
        """rollout.mode='split': the rollout thread samples and scores on the rollout mesh;
        here the rollout moves to the training mesh, then reference and update; the new
        parameters go back to the rollout mesh for the thread."""
        if self.rollout_thread is None:
            self.rollout_thread = RolloutThread(self, step, self.sampler_params(), step)
        clock = perf.PhaseClock()
        with self._transfer_guard():
            item = self.rollout_thread.take(step)  # waits while the thread is behind
            clock.mark("learner_wait")
            out = jax.device_put(item.out, self.row_sharding)  # rollout -> training mesh
            ref = self.reference(out, step)
            clock.wait("reference", ref)
            self._check_verifiers(item.scored, step)
            rewards = parallel.shard_local_batch(item.scored.rewards, self.mesh)
            batch = rl.RolloutBatch.from_sample(out, rewards, ref)
            with self.compile_log.program("update", f"bucket {out.prompt_tokens.shape[1]}"):
                self.state, self.last_update_metrics = self.update(self.state, batch)
            self.updated = True
            clock.wait("update", self.state)
            self.reference_gate.open()
            self.rollout_thread.publish(self.sampler_params(), step + 1)
        self.last_scored, self.last_prompt_width = item.scored, out.prompt_tokens.shape[1]
        clock.seconds |= {"sample": item.sample_s, "score": item.score_s}
        waits = {"perf/rollout_wait_s": item.wait_s,
                 "perf/learner_wait_s": clock.seconds["learner_wait"]}  # fmt: skip
        return (self._metrics(out, item.scored, clock) | staleness(step - item.version)
                | waits | token_staleness(step, item))  # fmt: skip

    def _rollout(self, step: int):
        """(prompts, rollouts, their policy version) of this step: the rollout sampled
        ahead during the previous step (overlap), or one sampled now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.step == step:
            return ahead.batch, ahead.out, ahead.version
        batch = next(self.data_iter)
        return batch, self.sample(batch, step), step

    def _sample_ahead(self, step: int) -> None:
        """rollout.mode='overlap': dispatches step + 1's rollout with the current
        parameters (version `step`, the ones this step's update starts from) before this
        step's host work; the data position before its prompts is kept for checkpoints."""
        if self.config.rollout.mode != "overlap" or step + 1 >= self.config.train.num_steps:
            return
        position = self.data_iter.state()
        batch = next(self.data_iter)
        out = self.sample(batch, step + 1, version=step)
        self._ahead = _Ahead(step + 1, batch, out, step, position)

    def refill(self, out, scored, step: int, clock):
        """DAPO's dynamic sampling: up to `algo.max_resample_rounds` more batches until
        every process has B mixed-reward groups (the sampler is collective, so all
        processes sample while any is short)."""
        G, parts = self.spec.num_generations, [(out, scored)]
        groups = len(scored.rewards) // G
        mixed = rollout.mixed_groups(scored, G)
        while (
            parallel.host_max(int(mixed < groups)) and len(parts) <= self.algo.max_resample_rounds
        ):
            batch = next(self.data_iter)
            more = self.sample(batch, step, round=len(parts))
            parts.append((more, self.score(more, batch, clock)))
            mixed += rollout.mixed_groups(parts[-1][1], G)
        degenerate_frac = 1.0 - min(mixed, groups) / groups
        if len(parts) > 1:
            out, scored = rollout.merge_mixed_groups(parts, G, groups, self.mesh)
        scored.metrics["rollout/degenerate_frac"] = degenerate_frac
        scored.metrics["rollout/dynamic_rounds"] = float(len(parts) - 1)
        return out, scored

    def data_state(self):
        """The data position after the batches consumed so far (a rollout sampled ahead
        is not consumed: a resumed run draws its prompts again and samples them anew)."""
        if self.rollout_thread is not None:
            return self.rollout_thread.consumed
        return self.data_iter.state() if self._ahead is None else self._ahead.position

    def sampler_params(self):
        """The current policy parameters where the sampler runs (with LoRA: as the sampler
        reads them): as they are on one mesh, resharded device to device onto the rollout
        mesh in split mode."""
        params = self._policy_params()  # LoRA: adapters merged in, or applied unmerged
        if self.rollout_mesh is self.mesh:
            return params
        return parallel.to_mesh(params, self.rollout_mesh)

    @property
    def row_sharding(self):
        """Rollout rows on the training mesh (what the reference and the update read)."""
        return parallel.batch_sharding(self.mesh, 1)


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A rollout dispatched for a later step: its prompts, outputs, the parameter version
    that samples it, and the data position before its prompts."""

    step: int
    batch: object
    out: sampling.SampleOutput
    version: int
    position: object


def staleness(lag: int) -> dict:
    """Policy versions between the rollout's sampler and the update that trains on it."""
    return {"rollout/staleness_mean": float(lag), "rollout/staleness_max": float(lag)}


def token_staleness(step: int, item) -> dict:
    """Split mode: the mean staleness over completion tokens, and the fraction of rows
    with tokens of a newer version than the one that started them (partial rollouts)."""
    lengths = np.asarray(item.scored.lengths)
    per_token = [step - item.token_versions[:n] for n in lengths]
    tokens = np.concatenate(per_token) if per_token else np.zeros(0)
    later = [bool((item.token_versions[:n] > item.version).any()) for n in lengths]
    return {
        "rollout/token_staleness_mean": float(tokens.mean()) if tokens.size else 0.0,
        "rollout/partial_frac": float(np.mean(later)) if later else 0.0,
    }

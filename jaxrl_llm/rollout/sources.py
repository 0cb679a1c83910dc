"""Rollout sources: where a step's rollout comes from, one object per way of getting it.

    source = Sampled(sampling, config)                 # `modes.make_source` picks one
    rollout = source.next(step, params, clock)          # -> `Rollout`
    ...
    source.close()

| source | mode | the rollout of step s | staleness |
|---|---|---|---|
| `Sampled` | sync | sampled now, by the parameters step s updates | 0 |
| `SampledAhead` | overlap | sampled during step s - 1, before its update | 1 |
| `Threaded` | split | sampled and scored by a thread on the rollout mesh | <= bound |
| `Played` | sync + env | multi-turn trajectories with environments | 0 |
| `Threaded` + player | overlap / split + env | trajectories played by the thread | <= bound |
| `Refilled` | sync + DAPO | `Sampled`, then more batches until B mixed groups | 0 |

(`Threaded` is in thread.py, `Played` in played.py; the bound is
`rollout.max_staleness`.) Every source samples with the engine `make_sampler` builds:
`rollout.engine` static (`sampling.Sampler`) or paged (`sampling.PagedSampler`); with the
paged engine, overlap too is `Threaded` (one engine session across steps: its `sample`
does not dispatch ahead).

`next(step, params, clock)` gets the current policy parameters as the sampler reads them
(version `step`: `step` updates applied) and the step's `perf.PhaseClock`; it returns the
rollout on the training mesh, with its scores when the source scored it (else the step
scores it while the reference forward runs), the parameter version that sampled it and the
data position a checkpoint after this step stores. Adding a mode is a new class with
`next` and `close`, an entry in `modes.SOURCES` (or a case in `modes.make_source`) and its
config check (`config.checks_rollout.check_rollout`); docs/step.md says how.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jaxrl_llm import parallel, sampling
from jaxrl_llm.rollout import scoring


@dataclasses.dataclass
class Rollout:
    """One step's rollout: the sampler's output on the training mesh, the prompts it was
    sampled from, the parameter version that sampled it, the data position after its
    prompts (what a checkpoint after this step stores), its scores when the source scored
    it (None: the step scores it), and the source's own host metrics."""

    out: sampling.SampleOutput
    batch: object  # data.PromptBatch
    version: int
    position: object
    scored: scoring.Scored | None = None
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What every source samples and scores with.

    rounds: key indices per step (DAPO's refill rounds draw with step * rounds + round);
    guard: the transfer guard a thread of the source holds (a context-manager factory);
    workers: the rollout thread's engine when rollout.workers > 0 (the sampler then
    serves evaluation only)."""

    sampler: sampling.Sampler  # or a sampling.PagedSampler (`make_sampler`)
    spec: sampling.RolloutSpec
    scorer: scoring.Scorer
    data: object  # the training data iterator (`data.make_iterator`)
    mesh: object  # the training mesh
    rollout_mesh: object  # the sampler's mesh (the training mesh but in split mode)
    compile_log: object  # startup.CompileLog: names the sampler's compiles
    rounds: int = 1
    guard: object = contextlib.nullcontext
    # rollout.workers: the worker processes (`workers.remote.Workers`) whose stream
    # session the rollout thread opens instead of the sampler's; None: the sampler's.
    workers: object = None

    def sample(self, params, batch, step: int, round: int = 0, version: int | None = None):
        """G completions of each prompt of `batch` by `params`, whose version is `version`
        (default: step). The key depends on step and round only, so a rollout sampled
        ahead draws with its own step's key."""
        with self.compile_log.program("sampler") as compiled:
            out = self.sampler.sample(
                params,
                batch.prompt_ids,
                batch.prompt_mask,
                self.spec,
                step * self.rounds + round,
                version=step if version is None else version,
            )
            compiled.detail = bucket(out)
        return out

    def draw(self, params, step: int, version: int | None = None) -> Rollout:
        """The next batch of prompts, sampled: a `Rollout` not yet scored."""
        batch = next(self.data)
        out = self.sample(params, batch, step, version=version)
        return Rollout(
            out=out,
            batch=batch,
            version=step if version is None else version,
            position=self.data.state(),
        )

    def score(self, out, batch, clock) -> scoring.Scored:
        """`out` scored on the host (`scoring.Scorer`), charged to the clock's phases."""
        clock.wait("sample", out.tokens)
        scored = self.scorer(out, batch)
        clock.mark("score")
        return scored

    @property
    def row_sharding(self):
        """Rollout rows on the training mesh (what the reference and the update read)."""
        return parallel.batch_sharding(self.mesh, 1)


def make_sampler(config, model_cfg, mesh, pad_id: int):
    """The rollout engine `rollout.engine` names, on `mesh`: the static `sampling.Sampler`
    or the continuous-batching `sampling.PagedSampler` (settings `rollout.paged`)."""
    r = config.rollout
    common = dict(seed=config.train.seed, pad_id=pad_id, bucket_steps=r.bucket_steps)
    if r.engine == "paged":
        p = r.paged
        return sampling.PagedSampler(
            model_cfg,
            mesh,
            slots=p.slots,
            pages=p.pages,
            page_size=p.page_size,
            chunk_steps=p.chunk_steps,
            prefill_chunk=p.prefill_chunk,
            attention=p.attention,
            **common,
        )
    return sampling.Sampler(model_cfg, mesh, cache_segments=r.cache_segments, **common)


def bucket(out) -> str:
    """How compile lines name a rollout's programs: by its prompt bucket."""
    return f"bucket {out.prompt_tokens.shape[1]}"


class Sampled:
    """rollout.mode='sync': sampled in the step, by the parameters it updates."""

    def __init__(self, s: Sampling, config=None):
        self.s = s

    def next(self, step: int, params, clock) -> Rollout:
        return self.s.draw(params, step)

    def close(self) -> None:
        pass


class SampledAhead:
    """rollout.mode='overlap': step s + 1's rollout is dispatched during step s, by the
    parameters before step s's update (version s), before its host work; so the devices
    sample while the host scores. A rollout sampled ahead is not consumed: its position is
    the one after step s's prompts, and a resumed run draws and samples it anew."""

    def __init__(self, s: Sampling, config):
        self.s, self.num_steps = s, config.train.num_steps
        self._ahead: tuple[int, Rollout] | None = None

    def next(self, step: int, params, clock) -> Rollout:
        ahead, self._ahead = self._ahead, None
        rollout = ahead[1] if ahead is not None and ahead[0] == step else None
        if rollout is None:
            rollout = self.s.draw(params, step)
        if step + 1 < self.num_steps:
            self._ahead = (step + 1, self.s.draw(params, step + 1, version=step))
        return rollout

    def close(self) -> None:
        self._ahead = None


class Refilled:
    """DAPO's dynamic sampling over `inner` (sync): the rollout scored at once, then up to
    `algo.max_resample_rounds` more batches until every process has B mixed-reward groups
    (the sampler is collective, so all processes sample while any is short); the step's
    batch is the first B mixed groups of all of them (`scoring.merge_mixed_groups`)."""

    def __init__(self, inner, s: Sampling, max_rounds: int):
        self.inner, self.s, self.max_rounds = inner, s, max_rounds

    def next(self, step: int, params, clock) -> Rollout:
        first = self.inner.next(step, params, clock)
        G = self.s.spec.num_generations
        parts = [(first.out, self.s.score(first.out, first.batch, clock))]
        groups = len(parts[0][1].rewards) // G
        mixed = scoring.mixed_groups(parts[0][1], G)
        while parallel.host_max(int(mixed < groups)) and len(parts) <= self.max_rounds:
            batch = next(self.s.data)
            more = self.s.sample(params, batch, step, round=len(parts))
            parts.append((more, self.s.score(more, batch, clock)))
            mixed += scoring.mixed_groups(parts[-1][1], G)
        out, scored = parts[0]
        if len(parts) > 1:
            out, scored = scoring.merge_mixed_groups(parts, G, groups, self.s.mesh)
        scored.metrics["rollout/degenerate_frac"] = 1.0 - min(mixed, groups) / groups
        scored.metrics["rollout/dynamic_rounds"] = float(len(parts) - 1)
        return dataclasses.replace(first, out=out, scored=scored, position=self.s.data.state())

    def close(self) -> None:
        self.inner.close()


def staleness(lag: int) -> dict:
    """Policy versions between the rollout's sampler and the update that trains on it."""
    return {"rollout/staleness_mean": float(lag), "rollout/staleness_max": float(lag)}

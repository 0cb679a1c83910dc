"""The rollout engines behind one protocol: a session of rows that decode turns.

    session = open_session(engine, "turns", params, prompt_ids, prompt_mask, spec,
                           settings, live, step, version, mesh)   # envs.TurnSettings
    while session.busy or <environment steps in flight>:
        for r in session.run_chunk():            # rows whose turn ended
            row = session.result(r)              # .tokens, .versions, .turn_from
            ...                                  # the caller steps r's environment
        session.resume(r, observation_ids, turn_tokens)   # when its observation is back
        session.end(r)                                    # or: its trajectory is over
        session.refused()                        # rows ended because the model's context ran out
    out = session.output(final_turn)             # SampleOutput [n, T]

Every consumer of multi-turn rows (the environment turn loop, `envs.play`) is written
once against `TurnRows`, the gateway's requests against `serve`'s sessions;
`open_session` picks the session class of the engine it is given (`SESSIONS`, keyed by
the engine's class: a new engine is its session classes and one entry).

- `StaticTurns`: the static `Sampler` as a session (one batch, no admission, the exact
  reference). Its rows decode together: `run_chunk` waits until every row whose turn
  ended is resumed or ended, appends the observations (`Sampler.append`, one width for the
  batch rounded up to 8 and the cache bound to a bucket, `append_end`), and decodes the
  next turn of the resumed rows. A swap recomputes the cache before that decode
  (`Sampler.refresh`). A batch whose shared cache layout would pass the model's positions
  refuses every observation of that turn. Several processes: each holds its own rows, and
  every process runs the same programs (the widths are agreed, `host_max`).
- `PagedTurns`: the paged engine's `TurnSession`: a row whose turn ends leaves its slot
  and another takes it; a row is refused when its own prompt, completion, observation and
  next turn would pass the model's positions. Single process.

A 'stream' session (`StepStream`) holds single-turn rollouts of training steps, queued
across steps; the rollout thread (`rollout.thread`) is written once against it:

    stream = open_session(engine, "stream", params, version, spec, chunk=0)
    stream.submit(step, prompt_ids, prompt_mask, key)    # step's prompts, G rows each
    stream.swap(params, version)        # newer parameters (the caller says when)
    for step in stream.run_chunk():     # steps whose rows all ended
        out, token_versions = stream.output(step)

- `StaticStream`: the static `Sampler`; run_chunk samples the oldest queued step with
  the parameters current then (`Sampler.sample`, key `key`), or with chunk > 0 decodes it
  chunk tokens at a time, a swap recomputing its cache before the next chunk
  (`Sampler.refresh`). token_versions [T]: every row's column j was drawn by one version.
- `PagedStream`: the paged engine's `paged_schedule.Session` (`PagedSampler.stream`):
  the queued steps' rows share the slots; a swap preempts the rows in flight, which draw
  on with the new parameters. token_versions [N, T] (-1 past a row's end).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling.decode import FINISH_STOP, SampleOutput, fit_routes
from jaxrl_llm.sampling.paged import PagedSampler
from jaxrl_llm.sampling.paged_schedule import rows_output
from jaxrl_llm.sampling.paged_turns import TurnSession
from jaxrl_llm.sampling.sampler import Sampler, append_end
from jaxrl_llm.sampling.serve import PagedRequests, StaticRequests


class RowsLost(RuntimeError):
    """An engine lost a session's rows (a rollout worker died with them): the caller plays
    them again (`rollout.thread.PlayerStream`)."""


class TurnRows(Protocol):
    """A batch of multi-turn rows on an engine (the module docstring). `result(r)` has
    the row's completion so far: `tokens` (sampled and appended ids), `versions` (the
    version that drew each, -1 on appended ones) and `turn_from` (where its last turn
    began)."""

    version: int  # the parameters' version the rows draw with
    stats: dict  # the session's counters ('decode_chunks': decodes so far)
    busy: bool  # run_chunk has rows to decode (or a turn to finish)

    def run_chunk(self) -> list: ...  # -> rows whose turn ended

    def resume(self, r: int, ids, turn_tokens: int) -> None: ...

    def end(self, r: int) -> None: ...

    def result(self, r: int): ...

    def swap(self, params, version: int) -> None: ...  # newer parameters, from the next decode

    def refused(self) -> list: ...  # rows ended since the last call: context

    def output(self, final_turn) -> SampleOutput: ...  # [n, total_tokens] on the row sharding


class StepStream(Protocol):
    """Single-turn rollouts of training steps on an engine (the module docstring)."""

    version: int  # the parameters' version the next draws use
    stats: dict  # the session's counters
    busy: bool  # run_chunk has a step to sample or decode
    in_flight: bool  # a step has started and not finished (a swap changes its rows)
    detail: str  # how compile lines name what the last run_chunk ran

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None: ...

    def swap(self, params, version: int) -> None: ...

    def run_chunk(self) -> list: ...  # -> steps whose rows all ended

    def output(self, step: int) -> tuple: ...  # -> (SampleOutput, token_versions)


def open_session(engine, kind: str, *args, **kwargs):
    """A session of `kind` on `engine`: 'turns', a `TurnRows` (`StaticTurns` /
    `PagedTurns`: the rows of a batch of prompts, G each), 'stream', a `StepStream`
    (`StaticStream` / `PagedStream`: training steps' rollouts), or 'requests' (`serve`:
    conversations asked one request at a time); of the class `SESSIONS` names for the
    engine's class, args as that class takes them."""
    for cls in type(engine).__mro__:
        if cls in SESSIONS:
            return SESSIONS[cls][kind](engine, *args, **kwargs)
    raise TypeError(f"no {kind} session for a {type(engine).__name__} (sampling.engine.SESSIONS)")


@dataclasses.dataclass
class TurnRow:
    """A row's completion so far, as `TurnRows.result` gives it (the static and remote
    sessions' record; the paged session's own record has these fields too)."""

    tokens: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    turn_from: int = 0


class StaticTurns:
    """`TurnRows` on the static `Sampler` (the module docstring): the rows of prompts
    ids / mask [B, W] (left-padded host arrays), spec.num_generations each (live[r]: row r
    plays; the others draw nothing). turns (`envs.TurnSettings`): turn_tokens, a turn's budget;
    stop_ids, ids that end a turn; max_total_tokens, a row's completion (sampled and
    appended tokens). step: the random key's (None: 0); version: the parameters'; mesh:
    the rows' (the paged engine's are its own). first_row: the rows' place in a larger
    batch decoded in parts (rollout workers sharing a step, `workers.turns`); the paged
    engine's rows draw with their own keys from it, the static engine's draw batch-wide
    (`Sampler.row_keys`), so a part of a batch is greedy only."""

    def __init__(
        self, sampler, params, ids, mask, spec, turns, live, step, version, mesh, first_row=0
    ):
        if first_row and spec.temperature > 0:
            raise ValueError(
                f"rows from {first_row} of a batch on the static engine: its rows draw "
                "batch-wide, so a part of a batch draws other tokens unless greedy"
            )
        self.sampler, self.params, self.version, self.mesh = sampler, params, version, mesh
        self.turn_tokens, self.stop_ids = turns.turn_tokens, tuple(turns.stop_ids)
        self.total = turns.max_total_tokens
        state = sampler.start(params, ids, mask, spec, step, version=version)
        self.state = sampler.stop(state, [not x for x in live])  # reset failed: no turn
        n = len(live)
        self.rows = [TurnRow() for _ in range(n)]
        self.drawing = {r for r in range(n) if live[r]}  # rows the next decode draws for
        self.parked: set = set()  # turn ended: not resumed or ended yet
        self.appended: dict = {}  # row -> observation ids for the next append
        self.newer = None  # swapped-in (params, version), for the next decode
        self.done, self.dropped = False, []
        self.stats = {"decode_chunks": 0, "appends": 0, "swaps": 0}

    @property
    def busy(self) -> bool:
        return not self.done and not self.parked

    def resume(self, r: int, ids, turn_tokens: int) -> None:
        self.parked.discard(r)
        self.appended[r] = [int(x) for x in ids]

    def end(self, r: int) -> None:
        self.parked.discard(r)

    def result(self, r: int) -> TurnRow:
        return self.rows[r]

    def swap(self, params, version: int) -> None:
        self.newer = (params, int(version))

    def refused(self) -> list:
        out, self.dropped = self.dropped, []
        return out

    def run_chunk(self) -> list:
        """Appends the observations of the rows resumed since the last turn and decodes the
        next turn of every resumed row -> the rows that drew (all at once); nothing while
        a row's environment is still out."""
        if self.done or self.parked:
            return []
        sampler = self.sampler
        if self.stats["decode_chunks"] and not self._append():
            self.done = True
            return []
        if self.newer is not None:  # the cache as the newer parameters compute it
            self.state = sampler.refresh(self.newer[0], self.state)
            (self.params, self.version), self.newer = self.newer, None
            self.stats["swaps"] += 1
        self.state = sampler.decode(self.params, self.state, self.turn_tokens, self.stop_ids)
        self.stats["decode_chunks"] += 1
        out = sampler.result(self.state)
        tokens, lengths = mesh_lib.local_rows((out.tokens, out.lengths), self.mesh)
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        ended, self.drawing = sorted(self.drawing), set()
        for r in ended:
            row, L = self.rows[r], int(lengths[r])
            row.turn_from = len(row.tokens)
            row.versions += [self.version] * (L - row.turn_from)
            row.tokens = tokens[r, :L].tolist()
        self.parked = set(ended)
        return ended

    def _append(self) -> bool:
        """The observations queued since the last decode go into the cache -> whether any
        row goes on (on any process)."""
        sampler, n, appended = self.sampler, len(self.rows), self.appended
        # Every process appends the same width (or none): the programs are collective.
        width = mesh_lib.host_max(-(-max(map(len, appended.values()), default=0) // 8) * 8)
        limit = sampler.cfg.max_position_embeddings - self.turn_tokens
        if self.state.end + width > limit:  # the shared cache slots would pass the context
            self.dropped += sorted(appended)
            appended, width = {}, 0
        self.appended = {}
        if not width:  # `output` marks the rows stopped
            return False
        self.state = sampler.stop(self.state, [r not in appended for r in range(n)])
        ids = np.full((n, width), sampler.pad_id, np.int32)
        mask = np.zeros((n, width), bool)
        for r, obs in appended.items():
            ids[r, : len(obs)], mask[r, : len(obs)] = obs, True
            row = self.rows[r]
            row.tokens += obs
            row.versions += [-1] * len(obs)
        # Masked columns are holes that `result` compacts away; the bound is bucketed so
        # the observations' varying widths compile a few programs.
        end = append_end(self.state.end + width, limit)
        self.state = sampler.append(self.params, self.state, ids, mask, end)
        self.drawing = set(appended)
        self.stats["appends"] += 1
        return True

    def output(self, final_turn) -> SampleOutput:
        """The rows' completions in total_tokens columns; a row whose final turn ran out
        of budget FINISH_LENGTH."""
        self.state = self.sampler.stop(self.state, ~np.asarray(final_turn, bool))
        return fit(self.sampler.result(self.state), self.total, self.sampler.pad_id)


@functools.partial(jax.jit, static_argnums=(1, 2))
def fit(out: SampleOutput, width: int, pad_id: int) -> SampleOutput:
    """The completion columns cut or padded to `width` (rows are compacted to the left
    and no longer than `width`, so nothing real is cut)."""

    P = out.prompt_tokens.shape[1]

    def fix(x, fill):
        x = x[:, :width]
        return jnp.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill)

    return out.replace(
        tokens=fix(out.tokens, pad_id),
        mask=fix(out.mask, False),
        loss_mask=fix(out.loss_mask, False),
        logprobs=fix(out.logprobs, 0.0),
        routes=fit_routes(out.routes, P, P, width),
    )


class PagedTurns:
    """`TurnRows` on the paged engine: its `TurnSession` (the module docstring); args
    as `StaticTurns`'. busy, version, stats, run_chunk, end, result and swap are the
    session's."""

    def __init__(
        self, engine, params, ids, mask, spec, turns, live, step, version, mesh, first_row=0
    ):
        ids, mask = engine.bucketed(ids, mask)
        G, n, T = spec.num_generations, len(live), turns.max_total_tokens
        if ids.shape[0] * G != n:
            raise ValueError(f"{n} trajectories for {ids.shape[0]} prompts x G={G}")
        self.engine, self.ids, self.mask, self.spec = engine, ids, mask, spec
        self.session = TurnSession(
            engine,
            params,
            version,
            spec.replace(max_new_tokens=T, stop_ids=tuple(turns.stop_ids)),
            seed=engine.seed,
            step=0 if step is None else int(step),
            slots=engine.slots or n,
            pages=engine.pages or engine.auto_pages(n, ids.shape[1] + T),
            prompts=ids.shape[0],
        )
        self.session.submit(ids, mask, turns.turn_tokens, live, key_base=first_row)
        self.first_version, self.total, self.dropped = version, T, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def resume(self, r: int, ids, turn_tokens: int) -> None:
        t = self.session.result(r)
        limit = self.engine.cfg.max_position_embeddings
        if len(t.prompt) + len(t.tokens) + len(ids) + turn_tokens > limit:
            self.session.end(r)
            self.dropped.append(r)
        else:
            self.session.resume(r, ids, turn_tokens)

    def refused(self) -> list:
        out, self.dropped = self.dropped, []
        return out

    def output(self, final_turn) -> SampleOutput:
        """The static loop's output: each row's completion (sampled tokens with their
        log-probs, appended ones with loss mask 0) in total_tokens columns, a row whose
        final turn ran out of budget FINISH_LENGTH, and its routes (MoE) prompt then
        completion."""
        e, session = self.engine, self.session
        out, _ = rows_output(
            session.pool, self.ids, self.mask, session.trajs, self.total, session.prompt_routes
        )
        out = out.replace(
            finish=np.where(np.asarray(final_turn, bool), out.finish, FINISH_STOP),
            policy_version=np.full_like(out.policy_version, self.first_version),
        )
        e.stats = session.stats
        return mesh_lib.put(out, e.row_sharding)


class StaticStream:
    """`StepStream` on the static `Sampler` (the module docstring): a queued step is
    sampled only when run_chunk reaches it, with the parameters current then, and its
    rows report the version that started them. chunk: 0, each step in one program;
    else partial rollouts, chunk tokens per run_chunk, newer parameters swapped in
    between chunks (the cache recomputed by them) unless every row has stopped."""

    def __init__(self, sampler, params, version: int, spec, *, chunk: int = 0):
        self.sampler, self.params, self.version, self.spec = sampler, params, version, spec
        self.chunk, self.detail = chunk, ""
        self.queued: dict = {}  # step -> (prompt_ids, prompt_mask, key), in order
        self.running = None  # [step, state, columns, first column of the next chunk]
        self.newer = None  # (params, version) swapped in while a step runs
        self.finished: dict = {}  # step -> (output, token_versions)
        self.stats = {"decode_chunks": 0, "swaps": 0}

    busy = property(lambda self: bool(self.queued or self.running))
    in_flight = property(lambda self: self.running is not None)

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None:
        self.queued[step] = (prompt_ids, prompt_mask, key)

    def swap(self, params, version: int) -> None:
        """Samples on with `params`: from the next step, or (a step running) from its
        next chunk."""
        if self.running is None:
            self.params, self.version = params, version
        else:
            self.newer, self.version = (params, version), version

    def output(self, step: int) -> tuple:
        return self.finished.pop(step)

    def run_chunk(self) -> list:
        sampler, spec, T = self.sampler, self.spec, self.spec.max_new_tokens
        self.stats["decode_chunks"] += 1
        if self.running is None:
            step = next(iter(self.queued))
            ids, mask, key = self.queued.pop(step)
            if not self.chunk:
                out = sampler.sample(self.params, ids, mask, spec, key, version=self.version)
                self.detail = f"bucket {out.prompt_tokens.shape[1]}"
                self.finished[step] = (out, np.full(T, self.version))
                return [step]
            state = sampler.start(self.params, ids, mask, spec, key, version=self.version)
            self.running = [step, state, np.full(T, self.version), 0]
        step, state, columns, first = self.running
        self.detail = (
            f"bucket {state.prompt_tokens.shape[1]}, "
            f"partial tokens {first}-{min(first + self.chunk, T)}"
        )
        if self.newer is not None:  # first > 0: a swap while nothing runs is at once
            if bool(mesh_lib.to_host(state.done).all()):
                return self._finish()  # every row has stopped: nothing left to draw
            state = sampler.refresh(self.newer[0], state)
            self.params, self.newer = self.newer[0], None
            self.stats["swaps"] += 1
        columns[first:] = self.version
        self.running[1] = sampler.decode(self.params, state, min(self.chunk, T - first))
        self.running[3] = first + self.chunk
        return self._finish() if first + self.chunk >= T else []

    def _finish(self) -> list:
        step, state, columns, _ = self.running
        self.finished[step], self.running = (self.sampler.result(state), columns), None
        if self.newer is not None:
            self.params, self.newer = self.newer[0], None
        return [step]


class PagedStream:
    """`StepStream` on the paged engine (the module docstring): its `paged_schedule.Session`,
    opened at the first submit for that step's rows and bucket; step s's rows draw with
    key_base key * rows (`PagedSampler.stream`). chunk: unused (the engine's own
    `chunk_steps`; a swap between them)."""

    detail = "paged stream"

    def __init__(self, engine, params, version: int, spec, *, chunk: int = 0):
        self.engine, self.params, self.first_version, self.spec = engine, params, version, spec
        self.session = None

    version = property(lambda self: self.session.version if self.session else self.first_version)
    stats = property(lambda self: self.session.stats if self.session else {})
    busy = property(lambda self: bool(self.session and self.session.busy))
    in_flight = property(lambda self: bool(self.session and self.session.in_flight))

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None:
        ids, mask = self.engine.bucketed(prompt_ids, prompt_mask)
        rows, T = ids.shape[0] * self.spec.num_generations, self.spec.max_new_tokens
        if self.session is None:
            self.session = self.engine.stream(
                self.params, self.version, self.spec, width=ids.shape[1], rows=rows
            )
        self.session.submit(step, ids, mask, np.full(rows, T, np.int64), key_base=key * rows)

    def swap(self, params, version: int) -> None:
        if self.session is None:
            self.params, self.first_version = params, version
        else:
            self.session.swap(params, version)

    def run_chunk(self) -> list:
        return self.session.run_chunk()

    def output(self, step: int) -> tuple:
        return self.session.output(step)


# The session classes of each engine class (`open_session`).
SESSIONS = {
    Sampler: {"turns": StaticTurns, "stream": StaticStream, "requests": StaticRequests},
    PagedSampler: {"turns": PagedTurns, "stream": PagedStream, "requests": PagedRequests},
}

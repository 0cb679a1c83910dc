"""The turn loop: decode a turn, step the environments, append their observations.

    out, turns = play(engine, params, prompt_ids, prompt_mask, spec, settings, pool,
                      trajs, renderer, tokenizer, step=step)

One loop for every rollout engine, written against `sampling.engine.TurnRows` (the
static `Sampler` or the paged engine; `open_session` picks the session). A row whose turn
ends (an end-of-turn or tool-call stop id, or `settings.turn_tokens` spent) comes back
from `run_chunk`; the host decodes its new tokens as the action and a thread steps its
environment (`EnvPool.step`; rows whose turns ended together, or while a step ran, go in
one step), so on the paged engine environment latency overlaps the other rows' decoding.
Each observation that comes back is rendered as the row's next turn ids (`Renderer.turn`:
the new turn only) and the row resumes with them (the session appends them to its KV
cache); the static sampler's session waits for the whole batch's observations and
appends them in one program. A trajectory ends when its environment says done, fails, or
would pass `max_turns` or `max_total_tokens` (an observation longer than the tokens left,
bounded in characters before it leaves the worker, ends it as `long_observation`), or
`context` when the session refuses the observation (the model's positions would run
out); its row gets nothing appended and draws nothing more. At temperature 0 both engines
give the same tokens, masks, lengths, finish reasons and `Turns` row by row.

The completion of a row is its sampled turns and the observations between them, as the
sampler saw them (loss mask 1 and a behaviour log-prob on sampled tokens only); the
output has exactly `max_total_tokens` columns, so the reference and the update compile
once whatever the number of turns.

Partial rollouts (`refresh`, the rollout thread of the async modes): before each decode
after the first, `refresh()` gives the newest parameters and their version; when they are
newer than the ones the trajectories were drawn with, the session swaps them in (the KV
cache recomputed by them) and the rows draw on with them: between turns on the static
sampler, between decode chunks on the paged engine (a turn may then hold tokens of two
versions). `Turns.versions` records the version that drew each sampled token (-1 on
prompt-side and observation tokens).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from jaxrl_llm.sampling.engine import open_session


@dataclasses.dataclass(frozen=True)
class TurnSettings:
    """max_turns: model turns per trajectory; turn_tokens: decode budget of one turn;
    max_total_tokens: completion tokens of a trajectory (its turns and observations);
    stop_ids: ids that end a turn; end_of_turn_ids: those after which a chat template
    does not close the turn again."""

    max_turns: int
    turn_tokens: int
    max_total_tokens: int
    stop_ids: tuple[int, ...]
    end_of_turn_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Turns:
    """Per row: [(kind, start, end)] spans of its completion, kind "model" or "env"."""

    spans: list
    obs_tokens: np.ndarray  # [n] observation tokens appended per row
    model_turns: np.ndarray  # [n] decoded turns per row
    versions: np.ndarray  # [n, max_total_tokens] version that drew each token, else -1


def play(
    engine,
    params,
    prompt_ids,
    prompt_mask,
    spec,
    settings: TurnSettings,
    pool,
    trajs,
    renderer,
    tokenizer,
    *,
    step=None,
    version: int = 0,
    mesh=None,
    refresh=None,
):
    """Plays every trajectory to its end on `engine` (a rollout engine: `sampling.engine`)
    -> (SampleOutput [n, max_total_tokens], Turns). step: the random key's (None draws as
    step 0); version: the parameters'; mesh: the static sampler's rows'; refresh: None, or
    a function -> (newest params, their version), read before every decode after the
    first."""
    s, n = settings, len(trajs)
    live = [t.live for t in trajs]
    session = open_session(
        engine, "turns", params, prompt_ids, prompt_mask, spec, s, live, step, version, mesh
    )
    turns = Turns(
        [[] for _ in range(n)],
        np.zeros(n, np.int64),
        np.zeros(n, np.int64),
        np.full((n, s.max_total_tokens), -1, np.int64),
    )
    game = _Game(session, s, trajs, turns, renderer, tokenizer)
    stepper = _Stepper(pool, trajs)
    try:
        while session.busy or stepper.waiting:
            for i, observation in stepper.collect(block=not session.busy):
                game.observed(i, observation)
            if refresh is not None and session.busy and session.stats["decode_chunks"]:
                newest, newest_version = refresh()
                if newest_version != session.version:  # the rows' caches recomputed by them
                    session.swap(newest, newest_version)
            ended = session.run_chunk()
            stepper.submit({i: game.turn_ended(i) for i in ended})
            for i in session.refused():  # the model's positions would run out
                trajs[i].finish("context")
    finally:
        stepper.close()
    return session.output(turns.model_turns == s.max_turns), turns


class _Game:
    """The decode loop's side of the trajectories: turns ended, observations back."""

    def __init__(self, session, s: TurnSettings, trajs, turns: Turns, renderer, tokenizer):
        self.session, self.s, self.trajs, self.turns = session, s, trajs, turns
        self.renderer, self.tokenizer = renderer, tokenizer

    def turn_ended(self, i: int) -> tuple[str, int]:
        """Records row i's turn (and the observation before it) -> (its action text, the
        observation's bound in characters: -1 when none is wanted)."""
        row, s, turns = self.session.result(i), self.s, self.turns
        a, b = row.turn_from, len(row.tokens)
        before = turns.spans[i][-1][2] if turns.spans[i] else 0
        if a > before:  # the observation appended after its last turn
            turns.spans[i].append(("env", before, a))
            turns.obs_tokens[i] += a - before
        turns.spans[i].append(("model", a, b))
        turns.versions[i, a:b] = row.versions[a:b]  # the version that drew each token
        turns.model_turns[i] += 1
        # Tokens left for the observation; its text may have as many characters as that
        # many tokens can cover (more stays in the worker, `long_observation`).
        room = s.max_total_tokens - b - s.turn_tokens
        last = turns.model_turns[i] == s.max_turns
        bound = -1 if last or room < 1 else self.renderer.max_chars(room)
        return self.tokenizer.decode(row.tokens[a:b], skip_special_tokens=True), bound

    def observed(self, i: int, observation) -> None:
        """Row i's environment answered: its trajectory ends, or the observation goes to
        the row's cache."""
        row, s, traj = self.session.result(i), self.s, self.trajs[i]
        b = len(row.tokens)
        ids = None
        if not traj.live:
            pass
        elif self.turns.model_turns[i] == s.max_turns:
            traj.finish("max_turns")
        elif s.max_total_tokens - b - s.turn_tokens < 1:  # no room whatever it says
            traj.finish("max_total_tokens")
        else:
            last = row.tokens[-1] if b else None
            ids = render_observation(observation, traj, last, b, self.renderer, s)
        if ids is None:
            self.session.end(i)
        else:
            self.session.resume(i, ids, s.turn_tokens)


class _Stepper:
    """Steps environments in threads, off the decode loop: one per lane of the pool
    (`EnvPool(lanes=)`), each taking the rows submitted so far as one `EnvPool.step`. With
    one lane the rows submitted while a step runs go together in the next one; with more,
    they start on a free lane while it runs."""

    def __init__(self, pool, trajs):
        self.pool, self.trajs = pool, trajs
        self.cv = threading.Condition()
        self.todo: dict = {}  # row -> (action, bound)
        self.done: list = []  # (row, observation or None)
        self.waiting = 0  # rows submitted and not collected yet
        self.error: BaseException | None = None
        self.closed = False
        lanes = len(getattr(pool, "lanes", ())) or 1
        self.threads = [
            threading.Thread(target=self._run, name=f"env-steps-{k}", daemon=True)
            for k in range(lanes)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, rows: dict) -> None:
        """rows: row -> (action, bound), stepped together."""
        if rows:
            with self.cv:
                self.todo.update(rows)
                self.waiting += len(rows)
                self.cv.notify_all()

    def collect(self, block: bool) -> list:
        """The answers back so far (block: wait for at least one)."""
        with self.cv:
            while block and not self.done and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise self.error
            out, self.done = self.done, []
            self.waiting -= len(out)
            return out

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        for thread in self.threads:
            thread.join()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.todo and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                batch, self.todo = self.todo, {}
            try:
                actions = {i: a for i, (a, _) in batch.items()}
                got = self.pool.step(self.trajs, actions, {i: b for i, (_, b) in batch.items()})
            except BaseException as err:  # the decode loop raises it
                with self.cv:
                    self.error = self.error or err
                    self.cv.notify_all()
                return
            with self.cv:
                self.done += [(i, got.get(i)) for i in batch]
                self.cv.notify_all()


def render_observation(obs, traj, last, length: int, renderer, s: TurnSettings):
    """The ids of a trajectory's observation after a model turn that ended on token
    `last` at completion length `length` -> ids, or None where the trajectory ends here:
    its observation and next turn would pass max_total_tokens (`long_observation`: no
    observation is cut, the policy never sees half a tool output), or the observation
    cannot be rendered (it fails)."""
    try:
        ids = renderer.turn(obs, last if last in s.end_of_turn_ids else None)
    except Exception as err:  # a template that refuses the message: that trajectory
        traj.finish("error", f"render: {type(err).__name__}: {err}"[:500])
        return None
    if not ids:
        traj.finish("error", "render: the observation has no tokens")
    elif length + len(ids) + s.turn_tokens > s.max_total_tokens:
        traj.finish("long_observation")
    else:
        return ids
    return None

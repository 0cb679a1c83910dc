"""The turn loop on the paged engine: environments step while other rows decode.

    out, turns = play_paged(engine, params, prompt_ids, prompt_mask, spec, settings, pool,
                            trajs, renderer, tokenizer, step=step)

The same trajectories, output and `Turns` record as `loop.play`, played by a
`sampling.PagedSampler`'s `TurnSession` instead of the static sampler's turn-by-turn
batch. A row whose turn ends (a turn stop id, or `settings.turn_tokens` spent) leaves its
decode slot at once and keeps its pages; its action goes to a thread that steps the
environments (`EnvPool.step`; rows whose turns ended while a step ran go together in the
next one), so environment latency overlaps the other rows' decoding, and a free slot
takes the next waiting row (a new trajectory, or one whose observation is back). An
observation comes back to the decode loop, is rendered there (`loop.render_observation`)
and queued: its ids, after the pending last-drawn token, are prefilled into the row's own
pages, and the row waits for a slot again.

A trajectory ends as in `loop.play`: its environment says done or fails, max_turns,
max_total_tokens, long_observation, or `context` (per row here: its real prompt, its
completion, the observation and a turn past the model's positions; the static loop's
shared cache layout can end a row on `context` earlier). At temperature 0 the tokens,
masks, lengths, finish reasons and `Turns` equal `loop.play`'s row by row; sampled rows
draw each row's t-th token with its own key (`TurnSession`), not the static sampler's.
An MoE model's `routes` are laid out as `loop.play`'s (`TurnSession.trajectory_routes`).
Single process.

Partial rollouts (`refresh`): before each decode chunk after the first, `refresh()` gives
the newest parameters and their version; when they are newer, the session swaps them in
(`TurnSession.swap`: every row's keys and values recomputed by them, in its next prefill)
and the rows draw on with them. The static loop switches between turns, all rows at once;
here the switch comes between chunks, so a turn may hold tokens of two versions.
`Turns.versions` records the version that drew each sampled token either way.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from jaxrl_llm import sampling
from jaxrl_llm.envs.loop import Turns, TurnSettings, render_observation
from jaxrl_llm.sampling.paged_turns import TurnSession


def play_paged(engine, params, prompt_ids, prompt_mask, spec, settings: TurnSettings, pool,
               trajs, renderer, tokenizer, *, step=None, version: int = 0, mesh=None,
               refresh=None):  # fmt: skip
    """Plays every trajectory to its end on `engine` -> (SampleOutput [n,
    max_total_tokens], Turns), as `loop.play`. mesh: unused (the engine's rows come out
    in its row sharding); refresh: None, or a function -> (newest params, their version),
    read before every decode chunk after the first."""
    s, n = settings, len(trajs)
    ids, mask = engine.bucketed(prompt_ids, prompt_mask)
    G = spec.num_generations
    if ids.shape[0] * G != n:
        raise ValueError(f"{n} trajectories for {ids.shape[0]} prompts x G={G}")
    width, T = ids.shape[1], s.max_total_tokens
    session = TurnSession(
        engine, params, version, spec.replace(max_new_tokens=T, stop_ids=s.stop_ids),
        seed=engine.seed, step=0 if step is None else int(step), slots=engine.slots or n,
        pages=engine.pages or engine.auto_pages(n, width + T),
        prompts=ids.shape[0],
    )  # fmt: skip
    session.submit(ids, mask, s.turn_tokens, [t.live for t in trajs])
    turns = Turns([[] for _ in range(n)], np.zeros(n, np.int64), np.zeros(n, np.int64),
                  np.full((n, T), -1, np.int64))  # fmt: skip
    game = _Game(session, s, trajs, turns, renderer, tokenizer,
                 engine.cfg.max_position_embeddings)  # fmt: skip
    stepper = _Stepper(pool, trajs)
    try:
        while session.busy or stepper.waiting:
            for i, observation in stepper.collect(block=not session.busy):
                game.observed(i, observation)
            if refresh is not None and session.busy and session.stats["decode_chunks"]:
                newest, newest_version = refresh()
                if newest_version != session.version:  # the rows' caches recomputed by them
                    session.swap(newest, newest_version)
            for i in session.run_chunk():
                stepper.submit(i, *game.turn_ended(i))
    finally:
        stepper.close()
    engine.stats = session.stats
    return _output(engine, session, ids, mask, spec, s, turns, version), turns


class _Game:
    """The decode loop's side of the trajectories: turns ended, observations back."""

    def __init__(self, session, s: TurnSettings, trajs, turns: Turns, renderer, tokenizer,
                 limit: int):  # fmt: skip
        self.session, self.s, self.trajs, self.turns = session, s, trajs, turns
        self.renderer, self.tokenizer, self.limit = renderer, tokenizer, limit

    def turn_ended(self, i: int) -> tuple[str, int | None]:
        """Records row i's turn -> (its action text, the observation's bound in
        characters: -1 when none is wanted), as `loop.play` does."""
        row, s, turns = self.session.result(i), self.s, self.turns
        a, b = row.turn_from, len(row.tokens)
        turns.spans[i].append(("model", a, b))
        turns.versions[i, a:b] = row.versions[a:b]  # the version that drew each token
        turns.model_turns[i] += 1
        room = s.max_total_tokens - b - s.turn_tokens
        last = turns.model_turns[i] == s.max_turns
        bound = -1 if last or room < 1 else self.renderer.max_chars(room)
        return self.tokenizer.decode(row.tokens[a:b], skip_special_tokens=True), bound

    def observed(self, i: int, observation) -> None:
        """Row i's environment answered: its trajectory ends, or the observation is
        queued for the row's pages."""
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
            ids = render_observation(observation, traj, row.tokens[-1], b, self.renderer, s)
        if ids is not None and len(row.prompt) + b + len(ids) + s.turn_tokens > self.limit:
            traj.finish("context")
            ids = None
        if ids is None:
            self.session.end(i)
            return
        self.turns.spans[i].append(("env", b, b + len(ids)))
        self.turns.obs_tokens[i] += len(ids)
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
        self.threads = [threading.Thread(target=self._run, name=f"env-steps-{k}", daemon=True)
                        for k in range(lanes)]  # fmt: skip
        for thread in self.threads:
            thread.start()

    def submit(self, i: int, action: str, bound) -> None:
        with self.cv:
            self.todo[i] = (action, bound)
            self.waiting += 1
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


def _output(engine, session, ids, mask, spec, s: TurnSettings, turns: Turns, version: int):
    """`loop.play`'s SampleOutput: each row's completion (sampled tokens with their
    log-probs, observations with loss mask 0) in max_total_tokens columns, and its
    routes (MoE) prompt then completion."""
    G, T, n = spec.num_generations, s.max_total_tokens, len(turns.spans)
    tokens = np.full((n, T), engine.pad_id, np.int32)
    real, sampled = np.zeros((n, T), bool), np.zeros((n, T), bool)
    logprobs = np.zeros((n, T), np.float32)
    lengths = np.zeros(n, np.int32)
    finish = np.full(n, sampling.FINISH_STOP, np.int32)
    for i, row in session.trajs.items():
        L = lengths[i] = len(row.tokens)
        tokens[i, :L], real[i, :L], sampled[i, :L] = row.tokens, True, row.sampled
        logprobs[i, :L] = row.logprobs
        if turns.model_turns[i] == s.max_turns and not row.stopped:
            finish[i] = sampling.FINISH_LENGTH  # its last turn ran out of budget
    out = sampling.SampleOutput(
        tokens=tokens, mask=real, loss_mask=sampled, logprobs=logprobs, lengths=lengths,
        finish=finish, prompt_tokens=np.repeat(ids, G, axis=0),
        prompt_mask=np.repeat(mask, G, axis=0), policy_version=np.full(n, version, np.int32),
        num_generations=G, routes=session.trajectory_routes(ids, mask, n),
    )  # fmt: skip
    return jax.tree.map(lambda x: jax.device_put(x, engine.row_sharding), out)

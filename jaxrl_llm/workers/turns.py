"""Multi-turn rows on rollout workers: `RemoteTurns`, the turn seam
(`sampling.engine.TurnRows`) over a `fleet.Fleet`, so the environment turn loop
(`envs.play`) is written once for local and remote engines; `RemoteRequests`, the
gateway's requests (`sampling.serve`) the same way for agents; `handle`, the worker's side.

    fleet = Fleet(workers, {"kind": "turns"})          # the run's, kept across steps
    session = open_session(fleet, "turns", params, prompt_ids, prompt_mask, spec, settings,
                           live, step, version, mesh)  # a RemoteTurns
    ... as any TurnRows: run_chunk, result, resume, end, swap, refused, output

The environments stay on the trainer (they are the trainer's processes, `envs.EnvPool`);
a step's rows are one worker's session (`Fleet.pick`: steps go round the workers),
opened with the parameters of the step's version (pushed first when the workers hold
another) and run by the worker's engine exactly as the local session of that engine would
run them: greedy, the same tokens. The trainer's resumes and ends go with its next
`run_chunk` (one request a chunk: `turn_run`), whose answer brings the rows whose turn
ended (each row's completion so far, its versions, where its turn began) and the rows the
session refused. A swap (partial rollouts) pushes the parameters to every worker; the
worker holding the rows swaps them into its session.

A worker lost while it holds the rows (`Fleet.lost`) takes their turns with it: the
session raises `sampling.engine.RowsLost`, and the caller plays the step again from its
environments' resets on the workers left (`rollout.thread.PlayerStream`), so no row is
trained twice or as a failure. A worker of several processes does not serve turns yet.

`RemoteRequests` is the agents' counterpart: the gateway's episodes ask requests
(`ask`, `forget`) that go with the next `run_chunk` (`req_run`) to the worker's requests
session of its engine (`StaticRequests` / `PagedRequests`), whose answers (each choice's
ids, log-probs, versions, whether it stopped) come back with it. A lost worker raises
`RowsLost` the same way; the agents' player then ends the step's episodes
(`gateway.Server.abandon`) before the step is played again.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np

from jaxrl_llm import parallel, sampling
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS, RowsLost, TurnRow, open_session
from jaxrl_llm.workers import wire
from jaxrl_llm.workers.fleet import Fleet

REQUESTS = ("turns", "turn_run", "turn_output", "requests", "req_run")  # `handle`


class RemoteTurns:
    """`TurnRows` on one of `fleet`'s workers (the module docstring); args as
    `StaticTurns`' (mesh unused: the rows are the worker's)."""

    def __init__(
        self, fleet: Fleet, params, prompt_ids, prompt_mask, spec, turns, live, step, version, mesh
    ):
        del mesh
        self.fleet, self.spec, self.version = fleet, spec, version
        self.step = 0 if step is None else int(step)
        self.rows = [TurnRow() for _ in live]
        self.ops: list = []  # [row, turn_tokens] resumes, [row, -1] ends, for the next chunk
        self.resumed: dict = {}  # row -> its observation ids
        self.dropped: list = []
        self.stats, self.worker_busy = {"decode_chunks": 0}, True
        self.link = _hold(fleet, params, version, self.step)
        fields = dict(
            spec=dataclasses.asdict(spec),
            turns=dict(
                turn_tokens=int(turns.turn_tokens),
                max_total_tokens=int(turns.max_total_tokens),
                stop_ids=[int(x) for x in turns.stop_ids],
            ),
            live=[bool(x) for x in live],
            step=step if step is None else int(step),
        )
        ids, mask = np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, bool)
        self._ask("turns", fields, {"prompt_ids": ids, "prompt_mask": mask})

    @property
    def busy(self) -> bool:
        return self.worker_busy or bool(self.ops)

    def resume(self, r: int, ids, turn_tokens: int) -> None:
        self.ops.append([int(r), int(turn_tokens)])
        self.resumed[str(r)] = np.asarray(ids, np.int32)

    def end(self, r: int) -> None:
        self.ops.append([int(r), -1])

    def result(self, r: int) -> TurnRow:
        return self.rows[r]

    def swap(self, params, version: int) -> None:
        self.fleet.push(params, version)  # the worker swaps them into the rows' session
        self.version = version

    def refused(self) -> list:
        out, self.dropped = self.dropped, []
        return out

    def run_chunk(self) -> list:
        """The resumes and ends since the last chunk, then one chunk on the worker -> the
        rows whose turn ended."""
        ops, arrays = self.ops, self.resumed
        self.ops, self.resumed = [], {}
        fields, got = self._ask("turn_run", {"ops": ops}, arrays)
        self.worker_busy, self.version = fields["busy"], fields["version"]
        self.stats = {"decode_chunks": fields["decode_chunks"]}
        self.dropped += fields["refused"]
        for r, turn_from in zip(fields["ended"], fields["turn_from"], strict=True):
            row = self.rows[r]
            row.tokens = got[f"{r}/tokens"].tolist()
            row.versions = got[f"{r}/versions"].tolist()
            row.turn_from = turn_from
        return fields["ended"]

    def output(self, final_turn) -> SampleOutput:
        final = [bool(x) for x in np.asarray(final_turn)]
        _, arrays = self._ask("turn_output", {"final_turn": final, "step": self.step})
        self.link.steps.discard(self.step)
        return SampleOutput(**arrays, num_generations=self.spec.num_generations)

    def _ask(self, kind: str, fields: dict, arrays: dict | None = None) -> tuple:
        return _ask(self.fleet, self.link, kind, fields, arrays, f"step {self.step}'s rows")


class RemoteRequests:
    """The gateway's requests (`sampling.serve`'s session protocol: ask, run_chunk,
    answer, forget, swap) on one of `fleet`'s workers (the module docstring); args as
    `PagedRequests`' (mesh unused)."""

    def __init__(self, fleet: Fleet, params, version: int, spec, *, mesh=None, **settings):
        del mesh
        self.fleet, self.version, self.key = fleet, version, int(settings["key"])
        self.link = _hold(fleet, params, version, None)
        self.ops: list = []  # ["ask", episode, max_tokens, n, rewrite] / ["forget", episode]
        self.ids: dict = {}  # episode -> the context ids it asked with
        self.answers: dict = {}  # episode -> its choices
        self.forgotten: set = set()  # episodes already forgotten (a forget is sent once)
        self.stats, self.worker_busy = {"decode_chunks": 0}, False
        fields = dict(spec=dataclasses.asdict(spec), **{k: int(v) for k, v in settings.items()})
        self._ask("requests", fields)

    @property
    def busy(self) -> bool:
        """The worker has rows to decode, or a request is asked (a forget is no work)."""
        return self.worker_busy or bool(self.ids)

    def ask(self, episode, ids, max_tokens: int, n: int = 1, rewrite: bool = False) -> None:
        self.ops.append(["ask", episode, int(max_tokens), int(n), bool(rewrite)])
        self.ids[str(episode)] = np.asarray(ids, np.int32)

    def forget(self, episode) -> None:
        """The episode ended (the gateway's loop says so after every chunk: sent once)."""
        if episode not in self.forgotten:
            self.forgotten.add(episode)
            self.ops.append(["forget", episode])

    def swap(self, params, version: int) -> None:
        self.fleet.push(params, version)  # the worker swaps them into its session
        self.version = version

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def run_chunk(self) -> list:
        """The asks and forgets since the last chunk, then one chunk on the worker -> the
        episodes answered."""
        ops, arrays = self.ops, self.ids
        self.ops, self.ids = [], {}
        fields, got = self._ask("req_run", {"ops": ops}, arrays)
        self.worker_busy, self.version, self.stats = (
            fields["busy"],
            fields["version"],
            fields["stats"],
        )
        for episode, stopped in fields["answered"]:
            self.answers[episode] = [
                tuple(
                    got[f"{episode}/{k}/{name}"].tolist()
                    for name in ("ids", "logprobs", "versions")
                )
                + (bool(s),)
                for k, s in enumerate(stopped)
            ]
        return [episode for episode, _ in fields["answered"]]

    def _ask(self, kind: str, fields: dict, arrays: dict | None = None) -> tuple:
        return _ask(self.fleet, self.link, kind, fields, arrays, "the agents' requests")


def _hold(fleet: Fleet, params, version: int, tag) -> object:
    """The worker a session's rows go to (`Fleet.pick`), `tag` (None: nothing) on its link
    while they are there; the fleet connected first, refreshed (who joined, left or is
    back) and holding `version`."""
    if not fleet.links:
        fleet.connect()
    fleet.refresh()
    if fleet.host is None or fleet.version != version:
        fleet.push(params, version)
    link = fleet.pick()
    if tag is not None:
        link.steps.add(tag)
    return link


def _ask(fleet: Fleet, link, kind: str, fields: dict, arrays, what: str) -> tuple:
    """One request to `link`'s worker -> its answer's (fields, arrays); `RowsLost` when
    the worker is lost (`what` it held with it)."""
    answers = fleet.exchange([link], kind, fields, arrays)
    if not answers:
        raise RowsLost(f"rollout worker {link.address} lost {what}")
    return answers[0][1]


def handle(worker, kind: str, fields: dict, arrays: dict) -> tuple:
    """A `REQUESTS` request on `worker` (a `serve.Worker` opened with kind 'turns', its
    weights given) -> (its turns session now, the answer's (fields, arrays))."""
    session = worker.turns
    if kind == "turns":
        if jax.process_count() > 1:
            raise wire.WorkerError(
                "multi-turn rows on a worker of several processes are not served yet; "
                "start the worker as one process"
            )
        session = open_session(
            worker.engine,
            "turns",
            worker.params,
            arrays["prompt_ids"],
            arrays["prompt_mask"],
            sampling.RolloutSpec(**fields["spec"]),
            types.SimpleNamespace(**fields["turns"]),
            fields["live"],
            fields["step"],
            worker.version,
            worker.mesh,
        )
        return session, ({}, {})
    if kind == "requests":
        settings = {k: fields[k] for k in ("key", "width", "episodes")}
        settings |= {k: fields[k] for k in ("prompt_tokens", "total_tokens")}
        spec = sampling.RolloutSpec(**fields["spec"])
        session = open_session(
            worker.engine,
            "requests",
            worker.params,
            worker.version,
            spec,
            mesh=worker.mesh,
            **settings,
        )
        return session, ({}, {})
    if session is None:
        raise wire.WorkerError(f"{kind!r} before 'turns' or 'requests'")
    if kind == "req_run":
        return session, _requests_run(session, fields, arrays)
    if kind == "turn_output":
        out = session.output(np.asarray(fields["final_turn"], bool))
        got = {
            f.name: parallel.to_host(getattr(out, f.name))
            for f in dataclasses.fields(out)
            if f.name != "num_generations" and getattr(out, f.name) is not None
        }
        return None, ({"steps": [fields["step"]]}, got)
    for r, turn_tokens in fields["ops"]:  # in the trainer's order
        if turn_tokens < 0:
            session.end(r)
        else:
            session.resume(r, arrays[str(r)].tolist(), turn_tokens)
    ended = session.run_chunk() if session.busy else []
    got = {}
    for r in ended:
        row = session.result(r)
        got[f"{r}/tokens"] = np.asarray(row.tokens, np.int32)
        got[f"{r}/versions"] = np.asarray(row.versions, np.int32)
    answer = dict(
        ended=[int(r) for r in ended],
        turn_from=[int(session.result(r).turn_from) for r in ended],
        refused=[int(r) for r in session.refused()],
        busy=bool(session.busy),
        version=int(session.version),
        decode_chunks=int(session.stats["decode_chunks"]),
    )
    return session, (answer, got)


def _requests_run(session, fields: dict, arrays: dict) -> tuple:
    """`req_run` on a requests session -> the answer's (fields, arrays)."""
    for op in fields["ops"]:  # in the trainer's order
        if op[0] == "forget":
            session.forget(op[1])
        else:
            _, episode, max_tokens, n, rewrite = op
            session.ask(episode, arrays[str(episode)].tolist(), max_tokens, n, rewrite)
    answered, got = [], {}
    for episode in session.run_chunk() if session.busy else []:
        choices = session.answer(episode)
        for k, (ids, logprobs, versions, _) in enumerate(choices):
            got[f"{episode}/{k}/ids"] = np.asarray(ids, np.int32)
            got[f"{episode}/{k}/logprobs"] = np.asarray(logprobs, np.float32)
            got[f"{episode}/{k}/versions"] = np.asarray(versions, np.int32)
        answered.append([episode, [bool(c[3]) for c in choices]])
    stats = {k: int(v) for k, v in session.stats.items()}
    answer = dict(answered=answered, busy=bool(session.busy), version=int(session.version))
    return answer | {"stats": stats}, got


# open_session(fleet, "turns" | "requests", ...)
SESSIONS[Fleet] = {"turns": RemoteTurns, "requests": RemoteRequests}

"""Multi-turn rows on rollout workers: `RemoteTurns`, the turn seam
(`sampling.engine.TurnRows`) over a `fleet.Fleet`, so the environment turn loop
(`envs.play`) is written once for local and remote engines; `handle`, the worker's side.

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
"""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np

from jaxrl_llm import parallel, sampling
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS, RowsLost, open_session
from jaxrl_llm.workers import wire
from jaxrl_llm.workers.fleet import Fleet

REQUESTS = ("turns", "turn_run", "turn_output")  # the worker's side: `handle`


@dataclasses.dataclass
class _Row:
    tokens: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    turn_from: int = 0


class RemoteTurns:
    """`TurnRows` on one of `fleet`'s workers (the module docstring); args as
    `StaticTurns`' (mesh unused: the rows are the worker's)."""

    def __init__(
        self, fleet: Fleet, params, prompt_ids, prompt_mask, spec, turns, live, step, version, mesh
    ):
        del mesh
        if not fleet.links:
            fleet.connect()
        fleet.refresh()  # between steps: who joined, who left, who is back
        if fleet.host is None or fleet.version != version:
            fleet.push(params, version)
        self.fleet, self.spec, self.version = fleet, spec, version
        self.step = 0 if step is None else int(step)
        self.rows = [_Row() for _ in live]
        self.ops: list = []  # [row, turn_tokens] resumes, [row, -1] ends, for the next chunk
        self.resumed: dict = {}  # row -> its observation ids
        self.dropped: list = []
        self.stats, self.worker_busy = {"decode_chunks": 0}, True
        self.link = fleet.pick()
        self.link.steps.add(self.step)
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

    def result(self, r: int) -> _Row:
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
        answers = self.fleet.exchange([self.link], kind, fields, arrays)
        if not answers:  # the worker was lost, and the rows' turns with it
            raise RowsLost(f"rollout worker {self.link.address} lost step {self.step}'s rows")
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
    if session is None:
        raise wire.WorkerError(f"{kind!r} before 'turns'")
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


SESSIONS[Fleet] = {"turns": RemoteTurns}  # open_session(fleet, "turns", ...)

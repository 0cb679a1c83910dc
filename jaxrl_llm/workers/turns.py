"""Multi-turn rows on rollout workers: `RemoteTurns`, the turn seam
(`sampling.engine.TurnRows`) over a `fleet.Fleet`, so the environment turn loop
(`envs.play`) is written once for local and remote engines; `RemoteRequests`, the
gateway's requests (`sampling.serve`) the same way for agents; `handle`, the worker's side.

    fleet = Fleet(workers, {"kind": "turns"})          # the run's, kept across steps
    session = open_session(fleet, "turns", params, prompt_ids, prompt_mask, spec, settings,
                           live, step, version, mesh)  # a RemoteTurns
    ... as any TurnRows: run_chunk, result, resume, end, swap, refused, output

The environments stay on the trainer (they are the trainer's processes, `envs.EnvPool`);
a step's prompts are split over the workers (`Fleet.spread`, up to one part a prompt),
each part a session there with its place in the batch (`first_row`), opened with the
parameters of the step's version (pushed first when the workers hold another) and run by
the worker's engine as the local session of that engine would run those rows: the paged
engine's rows draw with their own keys, so split they draw the same tokens; the static
engine's draw batch-wide (`Sampler.row_keys`), so a step sampled at temperature > 0 on
static workers stays whole on one worker (steps go round the workers). The trainer's
resumes and ends go with its next `run_chunk`, which asks every worker with rows to
decode at once (one request each: `turn_run`), whose answers bring the rows whose turn
ended (each row's tokens since the trainer last had it, the observations it sent left
out, so a trajectory crosses the wire once; their versions; where its turn began) and
the rows the session refused; each part's rows go on to their next turn without waiting for the
other parts'. `output` joins the parts' rows in order. A swap (partial rollouts) pushes
the parameters to every worker; each swaps them into its rows' session.

A worker lost while it holds rows (`Fleet.lost`) takes their turns with it: the
session raises `sampling.engine.RowsLost`, and the caller plays the step again from its
environments' resets on the workers left (`rollout.thread.PlayerStream`), so no row is
trained twice or as a failure. On a worker of several processes each process holds its
own rows of the part, and process 0 answers for all (`handle`); agents' requests are not
served there yet.

`RemoteRequests` is the agents' counterpart: the gateway's episodes ask requests
(`ask`, `forget`) that go with the next `run_chunk` (`req_run`) to the worker's requests
session of its engine (`StaticRequests` / `PagedRequests`), whose answers (each choice's
ids, log-probs, versions, whether it stopped) come back with it. A lost worker raises
`RowsLost` the same way; the agents' player then ends the step's episodes
(`gateway.Server.abandon`) before the step is played again.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import types

import jax
import numpy as np

from jaxrl_llm import parallel, sampling
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS, RowsLost, TurnRow, open_session
from jaxrl_llm.workers import wire
from jaxrl_llm.workers.fleet import Fleet

REQUESTS = ("turns", "turn_run", "turn_output", "requests", "req_run")  # `handle`


@dataclasses.dataclass(eq=False)
class _Part:
    """One worker's share of a step's rows: rows first .. first + n of the batch, with the
    resumes ([row, turn_tokens]) and ends ([row, -1]) for its next chunk, rows local."""

    link: object
    first: int
    n: int
    ops: list = dataclasses.field(default_factory=list)
    resumed: dict = dataclasses.field(default_factory=dict)  # row -> its observation ids
    busy: bool = True
    decode_chunks: int = 0


class RemoteTurns:
    """`TurnRows` on `fleet`'s workers, the step's prompts split over them (the module
    docstring); args as `StaticTurns`' (mesh unused: the rows are the workers')."""

    def __init__(
        self, fleet: Fleet, params, prompt_ids, prompt_mask, spec, turns, live, step, version, mesh
    ):
        del mesh
        self.fleet, self.spec, self.version = fleet, spec, version
        self.step = 0 if step is None else int(step)
        self.rows = [TurnRow() for _ in live]
        self.dropped: list = []
        self.stats = {"decode_chunks": 0}
        ids, mask = np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, bool)
        B, G = ids.shape[0], spec.num_generations
        links = _hold(fleet, params, version, self.step, B, spec.temperature == 0)
        m = max(k.prompt_multiple for k in links) if len(links) > 1 else 1
        cuts = [m * (B // m * i // len(links)) for i in range(len(links))] + [B]
        spans = list(itertools.pairwise(cuts))
        self.parts = [_Part(k, a * G, (b - a) * G) for k, (a, b) in zip(links, spans, strict=True)]
        self.firsts = [p.first for p in self.parts]
        settings = dict(
            turn_tokens=int(turns.turn_tokens),
            max_total_tokens=int(turns.max_total_tokens),
            stop_ids=[int(x) for x in turns.stop_ids],
        )
        opened = []
        for p, (a, b) in zip(self.parts, spans, strict=True):
            fields = dict(
                spec=dataclasses.asdict(spec),
                turns=settings,
                live=[bool(x) for x in live[p.first : p.first + p.n]],
                step=step if step is None else int(step),
                first_row=p.first,
            )
            opened.append((p, fields, {"prompt_ids": ids[a:b], "prompt_mask": mask[a:b]}))
        self._ask("turns", opened)

    @property
    def busy(self) -> bool:
        return any(p.busy or p.ops for p in self.parts)

    def resume(self, r: int, ids, turn_tokens: int) -> None:
        ids = np.asarray(ids, np.int32)
        row = self.rows[r]  # the observation is the row's, as the worker appends it
        row.tokens += ids.tolist()
        row.versions += [-1] * len(ids)
        p, r = self._part(r)
        p.ops.append([r, int(turn_tokens)])
        p.resumed[str(r)] = ids

    def end(self, r: int) -> None:
        p, r = self._part(r)
        p.ops.append([r, -1])

    def result(self, r: int) -> TurnRow:
        return self.rows[r]

    def swap(self, params, version: int) -> None:
        self.fleet.push(params, version)  # each worker swaps them into its rows' session
        self.version = version

    def refused(self) -> list:
        out, self.dropped = self.dropped, []
        return out

    def run_chunk(self) -> list:
        """Each worker with rows to decode or resumes and ends since its last chunk gets
        them and runs one chunk, all at once -> the rows whose turn ended."""
        asked = [(p, {"ops": p.ops}, p.resumed) for p in self.parts if p.busy or p.ops]
        for p, _, _ in asked:
            p.ops, p.resumed = [], {}
        ended = []
        for p, (fields, got) in self._ask("turn_run", asked):
            p.busy, p.decode_chunks = fields["busy"], fields["decode_chunks"]
            self.version = fields["version"]
            self.dropped += [p.first + r for r in fields["refused"]]
            answered = zip(fields["ended"], fields["turn_from"], fields["lengths"], strict=True)
            for r, turn_from, length in answered:  # each row's completion since the last
                row = self.rows[p.first + r]
                row.tokens += got[f"{r}/tokens"].tolist()
                row.versions += got[f"{r}/versions"].tolist()
                row.turn_from = turn_from
                if len(row.tokens) != length:
                    raise RuntimeError(
                        f"row {p.first + r}: {len(row.tokens)} tokens here, {length} on "
                        f"rollout worker {p.link.address}"
                    )
                ended.append(p.first + r)
        self.stats = {"decode_chunks": sum(p.decode_chunks for p in self.parts)}
        return ended

    def output(self, final_turn) -> SampleOutput:
        final = [bool(x) for x in np.asarray(final_turn)]
        asked = [
            (p, {"final_turn": final[p.first : p.first + p.n], "step": self.step}, None)
            for p in self.parts
        ]
        outs = [arrays for _, (_, arrays) in self._ask("turn_output", asked)]
        for p in self.parts:
            p.link.steps.discard(self.step)
        out = _joined(outs, self.fleet.workers.pad_id)
        return SampleOutput(**out, num_generations=self.spec.num_generations)

    def _part(self, r: int) -> tuple:
        """Row r's part and its row there."""
        p = self.parts[bisect.bisect_right(self.firsts, int(r)) - 1]
        return p, int(r) - p.first

    def _ask(self, kind: str, asked: list) -> list:
        """[(part, fields, arrays)] -> [(part, answer)]; a worker lost: `RowsLost`, the
        step's tag off every worker (the lost one's went to the fleet's requeued count)."""
        try:
            answers = _ask(self.fleet, [(p.link, f, a) for p, f, a in asked], kind)
        except RowsLost as err:
            for p in self.parts:
                p.link.steps.discard(self.step)
            raise RowsLost(f"{err} step {self.step}'s rows") from None
        return [(p, got) for (p, _, _), got in zip(asked, answers, strict=True)]


def _joined(outs: list, pad_id: int) -> dict:
    """The parts' outputs (field -> host array) as one, rows in order: each part's prompt
    columns left-padded to the widest part's bucket (masked: pad ids, no route)."""
    P = max(o["prompt_tokens"].shape[1] for o in outs)
    fill = {"prompt_tokens": pad_id, "prompt_mask": False, "routes": -1}

    def widen(o, name):
        x, cols = o[name], P - o["prompt_tokens"].shape[1]
        if name not in fill or not cols:
            return x
        pad = [(0, 0)] * x.ndim
        pad[1] = (cols, 0)  # routes: [N, P + T, ...], the prompt's columns first
        return np.pad(x, pad, constant_values=fill[name])

    return {name: np.concatenate([widen(o, name) for o in outs]) for name in outs[0]}


class RemoteRequests:
    """The gateway's requests (`sampling.serve`'s session protocol: ask, run_chunk,
    answer, forget, swap) on one of `fleet`'s workers (the module docstring); args as
    `PagedRequests`' (mesh unused)."""

    def __init__(self, fleet: Fleet, params, version: int, spec, *, mesh=None, **settings):
        del mesh
        self.fleet, self.version, self.key = fleet, version, int(settings["key"])
        self.link = _hold(fleet, params, version, None)[0]
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
        try:
            return _ask(self.fleet, [(self.link, fields, arrays)], kind)[0]
        except RowsLost as err:
            raise RowsLost(f"{err} the agents' requests") from None


def _hold(fleet: Fleet, params, version: int, tag, prompts: int = 1, greedy: bool = True):
    """The workers a session's rows go to (`Fleet.spread`): `prompts` split over up to
    one worker per `prompt_multiple` of them where the split draws what one worker would
    (greedy, or engines whose rows draw with their own keys), else one; `tag` (None:
    nothing) on their links while they hold the rows. The fleet is connected first,
    refreshed (who joined, left or is back) and holding `version`."""
    if not fleet.links:
        fleet.connect()
    fleet.refresh()
    if fleet.host is None or fleet.version != version:
        fleet.push(params, version)
    m = max((k.prompt_multiple for k in fleet.alive), default=1)
    parts = prompts // m if prompts % m == 0 else 1
    if not greedy and not all(k.row_keys for k in fleet.alive):
        parts = 1
    links = fleet.spread(parts)
    for link in links if tag is not None else ():
        link.steps.add(tag)
    return links


def _ask(fleet: Fleet, asked: list, kind: str) -> list:
    """Each worker's request ([(link, fields, arrays)]) -> their answers' (fields,
    arrays), in order; `RowsLost` when a worker is lost."""
    answers = fleet.exchange_each(asked, kind)
    if len(answers) < len(asked):
        lost = ", ".join(k.address for k, _, _ in asked if not k.alive)
        raise RowsLost(f"rollout worker {lost} lost")
    return [got for _, got in answers]


def handle(worker, kind: str, fields: dict, arrays: dict) -> tuple:
    """A `REQUESTS` request on `worker` (a `serve.Worker` opened with kind 'turns', its
    weights given) -> (its turns session now, the answer's (fields, arrays)). A worker of
    several processes: every process runs each request; each holds its own rows of the
    part (`own_rows`: process i the i-th of equal contiguous shares), and process 0
    answers for all (`_every_process`)."""
    session = worker.turns
    if kind == "turns":
        live = own_rows(np.asarray(fields["live"], bool))
        session = open_session(
            worker.engine,
            "turns",
            worker.params,
            own_rows(arrays["prompt_ids"]),
            own_rows(arrays["prompt_mask"]),
            sampling.RolloutSpec(**fields["spec"]),
            types.SimpleNamespace(**fields["turns"]),
            live.tolist(),
            fields["step"],
            worker.version,
            worker.mesh,
            first_row=fields["first_row"],
        )
        worker.own = (jax.process_index() * len(live), len(live))  # first row, rows
        worker.known = {}  # row -> the length of its completion the trainer holds
        return session, ({}, {})
    if kind == "requests":
        if jax.process_count() > 1:
            raise wire.WorkerError(
                "agents' requests on a worker of several processes are not served yet; "
                "start the worker as one process"
            )
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
        out = session.output(own_rows(np.asarray(fields["final_turn"], bool)))
        got = {
            f.name: parallel.to_host(getattr(out, f.name))
            for f in dataclasses.fields(out)
            if f.name != "num_generations" and getattr(out, f.name) is not None
        }
        return None, ({"steps": [fields["step"]]}, got)
    (first, n), known = worker.own, worker.known
    for r, turn_tokens in fields["ops"]:  # in the trainer's order; this process's rows
        if not first <= r < first + n:
            continue
        r -= first
        if turn_tokens < 0:
            session.end(r)
        else:
            ids = arrays[str(r + first)].tolist()
            session.resume(r, ids, turn_tokens)
            known[r] = known.get(r, 0) + len(ids)  # the trainer appends them itself
    # The static engine's programs are collective: every process decodes, or none.
    ended = session.run_chunk() if _everywhere(session.busy) else []
    refused = session.refused()
    rows = {}
    for r in ended:  # each row's completion from what the trainer holds of it on
        row, k = session.result(r), known.get(r, 0)
        rows[r] = TurnRow(row.tokens[k:], row.versions[k:], row.turn_from)
        known[r] = len(row.tokens)
    totals = {r: known[r] for r in ended}
    if jax.process_count() > 1:
        ended, rows, refused, totals = _every_process(ended, rows, refused, totals, n)
    got = {}
    for r in ended:
        got[f"{r}/tokens"] = np.asarray(rows[r].tokens, np.int32)
        got[f"{r}/versions"] = np.asarray(rows[r].versions, np.int32)
    answer = dict(
        ended=[int(r) for r in ended],
        turn_from=[int(rows[r].turn_from) for r in ended],
        lengths=[int(totals[r]) for r in ended],
        refused=[int(r) for r in refused],
        busy=_everywhere(session.busy),
        version=int(session.version),
        decode_chunks=int(session.stats["decode_chunks"]),
    )
    return session, (answer, got)


def own_rows(x: np.ndarray) -> np.ndarray:
    """This process's slice of a batch's rows (prompts, or their G rows each): with
    several processes each gives the engine its own, process i the i-th of equal
    contiguous parts (as each host of a run reads its slice of the batch,
    `data.iterator`), and the engine's rows are the whole batch in order."""
    n, i = jax.process_count(), jax.process_index()
    if len(x) % n:
        raise wire.WorkerError(f"{len(x)} rows do not split over this worker's {n} processes")
    part = len(x) // n
    return x[i * part : (i + 1) * part]


def _everywhere(flag: bool) -> bool:
    """Whether `flag` holds on every process (a collective with several)."""
    return not parallel.host_max(int(not flag))


def _every_process(ended: list, rows: dict, refused: list, totals: dict, n: int) -> tuple:
    """Each process's ended rows (in its order, with their `TurnRow` and total length)
    and refused rows, local to its `n` -> every process's, in process order, rows of the
    part: one gather of fixed-shape arrays (tokens padded to a multiple of 64 columns)."""
    from jax.experimental import multihost_utils

    longest = max((len(rows[r].tokens) for r in ended), default=0)
    width = max(64, -(-parallel.host_max(longest) // 64) * 64)
    mine = dict(
        order=np.full(n, -1, np.int32),
        tokens=np.zeros((n, width), np.int32),
        versions=np.full((n, width), -1, np.int32),
        lengths=np.zeros(n, np.int32),
        totals=np.zeros(n, np.int32),
        turn_from=np.zeros(n, np.int32),
        refused=np.zeros(n, bool),
    )
    for k, r in enumerate(ended):
        row, L = rows[r], len(rows[r].tokens)
        mine["order"][r], mine["lengths"][r], mine["turn_from"][r] = k, L, row.turn_from
        mine["totals"][r] = totals[r]
        mine["tokens"][r, :L], mine["versions"][r, :L] = row.tokens, row.versions
    mine["refused"][refused] = True
    every = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(mine).items()}
    ended, rows, refused, totals = [], {}, [], {}
    for p in range(every["order"].shape[0]):
        order = every["order"][p]
        for r in sorted(np.nonzero(order >= 0)[0], key=lambda r: order[r]):
            L, g = every["lengths"][p, r], p * n + int(r)
            rows[g] = TurnRow(
                tokens=every["tokens"][p, r, :L].tolist(),
                versions=every["versions"][p, r, :L].tolist(),
                turn_from=int(every["turn_from"][p, r]),
            )
            totals[g] = int(every["totals"][p, r])
            ended.append(g)
        refused += [p * n + int(r) for r in np.nonzero(every["refused"][p])[0]]
    return ended, rows, refused, totals


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

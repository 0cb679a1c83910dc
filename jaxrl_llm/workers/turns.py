"""Multi-turn rows on rollout workers: `RemoteTurns`, the turn seam
(`sampling.engine.TurnRows`) over a `fleet.Fleet`, so the environment turn loop
(`envs.play`) is written once for local and remote engines; `RemoteRequests`, the
gateway's requests (`sampling.serve`) the same way for agents. The worker's side is
`serve_turns`.

    fleet = Fleet(workers, {"kind": "turns"})          # the run's, kept across steps
    session = open_session(fleet, "turns", params, prompt_ids, prompt_mask, spec, settings,
                           live, step, version, mesh)  # a RemoteTurns
    ... as any TurnRows: run_chunk, result, resume, end, swap, refused, output

The environments stay on the trainer (they are the trainer's processes, `envs.EnvPool`);
a step's prompts are split over the workers (`Fleet.spread`; each part a multiple of
every worker's `prompt_multiple`), each part a session there with its place in the batch
(`first_row`), opened with the parameters of the step's version (pushed first when the
workers hold another) and run by the worker's engine as the local session of that engine
would run those rows: the paged engine's rows draw with their own keys, so split they
draw the same tokens; the static engine's draw batch-wide (`Sampler.row_keys`), so a
step sampled at temperature > 0 on static workers stays whole on one worker (steps go
round the workers). The trainer's resumes and ends go with its next `run_chunk`, which
asks every worker with rows to decode at once (one request each: `turn_run`), whose
answers bring the rows whose turn ended (each row's tokens since the trainer last had
it, the observations it sent left out, so a trajectory crosses the wire once; their
versions; where its turn began) and the rows the session refused; each part's rows go
on to their next turn without waiting for the other parts'. `output` joins the parts'
rows in order. A swap (partial rollouts) pushes the parameters to every worker; each
swaps them into its rows' session.

A worker lost while it holds rows (`Fleet.lost`) takes their turns with it: the
session raises `sampling.engine.RowsLost`, and the caller plays the step again from its
environments' resets on the workers left (`rollout.thread.PlayerStream`), so no row is
trained twice or as a failure. On a worker of several processes each process holds its
own rows of the part, and process 0 answers for all (`serve_turns`); agents' requests
are not served there yet.

`RemoteRequests` is the agents' counterpart, over every worker of the fleet: an episode
goes to one worker at its first request and stays there (its row keeps its KV cache), the
k-th new episode of E to worker k * N // E, so each holds an equal run of them (an
example's G episodes, asked together, mostly on one). The gateway's episodes ask requests
(`ask`, `forget`) that go with the next `run_chunk` (`req_run`, every worker with work at
once) to each worker's requests session of its engine (`StaticRequests` /
`PagedRequests`), whose answers (each choice's ids, log-probs, versions, whether it
stopped) come back with it. Each worker's session numbers its rows from 0, so each part
draws with its own seed (`part_seed`; part 0 the run's): greedy, the episodes draw what
one worker draws. A worker lost mid-step hands its episodes to the workers left, in
turn: a request it had not answered is asked there again with its whole context (the
request carries it: a prefill, then the turn), and the episode's next requests go there
too, so no episode ends and no agent process is killed. Only when every worker of the
step is lost does the session raise `RowsLost`; the agents' player then ends the step's
episodes (`gateway.Server.abandon`) and the step is played again.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math

import numpy as np

from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS, RowsLost, TurnRow
from jaxrl_llm.workers.fleet import Fleet


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
        m = math.lcm(*(k.prompt_multiple for k in links)) if len(links) > 1 else 1
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


@dataclasses.dataclass(eq=False)
class _Asker:
    """One worker's share of the agents' episodes: the asks (["ask", episode, max_tokens,
    n, rewrite], their context ids by episode) and forgets (["forget", episode]) for its
    next chunk, and what its last answer said."""

    link: object
    ops: list = dataclasses.field(default_factory=list)
    ids: dict = dataclasses.field(default_factory=dict)
    busy: bool = False  # the worker's session has rows to decode
    stats: dict = dataclasses.field(default_factory=dict)


class RemoteRequests:
    """The gateway's requests (`sampling.serve`'s session protocol: ask, run_chunk,
    answer, forget, swap) on `fleet`'s workers, each episode on the one its first request
    went to (the module docstring); args as `PagedRequests`' (mesh unused)."""

    def __init__(self, fleet: Fleet, params, version: int, spec, *, mesh=None, **settings):
        del mesh
        self.fleet, self.version = fleet, version
        links = _hold(fleet, params, version, None)
        n, m = len(links), math.lcm(*(k.prompt_multiple for k in links))
        self.parts = [_Asker(k) for k in links]
        self.gone: list = []  # the parts whose worker was lost (their counters still count)
        self.episodes = int(settings["episodes"])
        self.where: dict = {}  # episode -> its part
        self.asking: dict = {}  # episode -> its request not answered yet: its ask, ids
        self.answers: dict = {}  # episode -> its choices
        self.forgotten: set = set()  # episodes already forgotten (a forget is sent once)
        fields = dict(spec=dataclasses.asdict(spec), **{k: int(v) for k, v in settings.items()})
        fields["episodes"] = -(-self.episodes // n)
        fields["width"] = -(-fields["width"] // n // m) * m  # rows a worker's calls take
        seed = int(fleet.opened["seed"])
        opened = [
            (p, fields | {"seed": part_seed(seed, i)}, None) for i, p in enumerate(self.parts)
        ]
        self._ask("requests", opened)
        self._move()  # a worker lost already: the others take its share

    @property
    def busy(self) -> bool:
        """A worker has rows to decode, or a request is asked (a forget is no work)."""
        return any(p.busy or p.ids for p in self.parts)

    @property
    def stats(self) -> dict:
        """The workers' sessions' counters, summed (batch_max: the largest), a lost
        worker's as of its last answer."""
        out = {"decode_chunks": 0}
        for p in self.parts + self.gone:
            for k, v in p.stats.items():
                out[k] = max(out.get(k, 0), v) if k == "batch_max" else out.get(k, 0) + v
        return out

    def ask(self, episode, ids, max_tokens: int, n: int = 1, rewrite: bool = False) -> None:
        """To the episode's worker; a new episode's to the next part in turn, the k-th of
        `episodes` to part k * parts // episodes, so each holds an equal run of them."""
        part = self.where.get(episode)
        if part is None:
            k = len(self.where) * len(self.parts) // max(self.episodes, 1)
            part = self.where[episode] = self.parts[min(k, len(self.parts) - 1)]
        ask = ["ask", episode, int(max_tokens), int(n), bool(rewrite)]
        self.asking[episode] = (ask, np.asarray(ids, np.int32))
        part.ops.append(ask)
        part.ids[str(episode)] = self.asking[episode][1]

    def forget(self, episode) -> None:
        """The episode ended (the gateway's loop says so after every chunk: sent once, to
        its worker if it asked anything)."""
        if episode not in self.forgotten:
            self.forgotten.add(episode)
            if episode in self.where:
                self.where[episode].ops.append(["forget", episode])

    def swap(self, params, version: int) -> None:
        self.fleet.push(params, version)  # each worker swaps them into its session
        self.version = version

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def run_chunk(self) -> list:
        """Each worker with asks, forgets or rows to decode gets them and runs one chunk,
        all at once -> the episodes answered. A worker lost (its connection broke, or it
        stayed silent past the timeout) hands its episodes to the others (`_move`)."""
        self._move()
        asked = [(p, {"ops": p.ops}, p.ids) for p in self.parts if p.busy or p.ops]
        for p, _, _ in asked:
            p.ops, p.ids = [], {}
        links = [(p.link, f, a) for p, f, a in asked]
        answers = dict(self.fleet.exchange_each(links, "req_run"))
        answered = []
        for p, _, _ in asked:
            if p.link not in answers:
                continue
            fields, got = answers[p.link]
            p.busy, p.stats, self.version = fields["busy"], fields["stats"], fields["version"]
            for episode, stopped in fields["answered"]:
                self.answers[episode] = [
                    tuple(
                        got[f"{episode}/{k}/{name}"].tolist()
                        for name in ("ids", "logprobs", "versions")
                    )
                    + (bool(s),)
                    for k, s in enumerate(stopped)
                ]
                self.asking.pop(episode, None)
                answered.append(episode)
        self._move()
        return answered

    def _move(self) -> None:
        """The episodes of the parts whose worker is lost go to the parts left, in turn;
        each request not answered is asked there again with its whole context (that
        worker has no row of it: a prefill of the context, then its turn). No part left:
        `RowsLost` (the step is played again, `rollout.thread.PlayerStream`)."""
        lost = [p for p in self.parts if not p.link.alive]
        if not lost:
            return
        self.parts = [p for p in self.parts if p.link.alive]
        if not self.parts:
            gone = ", ".join(p.link.address for p in lost)
            raise RowsLost(f"rollout worker {gone} lost with the agents' requests")
        moved = [e for e, p in self.where.items() if p in lost and e not in self.forgotten]
        for i, episode in enumerate(moved):
            part = self.where[episode] = self.parts[i % len(self.parts)]
            if episode in self.asking:
                ask, ids = self.asking[episode]
                part.ops.append(ask)
                part.ids[str(episode)] = ids
        self.gone += lost
        logging.warning(
            "rollout worker %s lost with %d agents' episodes: they go on on %s",
            ", ".join(p.link.address for p in lost),
            len(moved),
            ", ".join(p.link.address for p in self.parts),
        )

    def _ask(self, kind: str, asked: list) -> list:
        """[(part, fields, arrays)] -> [(part, answer)] of the workers that answered."""
        answers = dict(self.fleet.exchange_each([(p.link, f, a) for p, f, a in asked], kind))
        return [(p, answers[p.link]) for p, _, _ in asked if p.link in answers]


def part_seed(seed: int, part: int) -> int:
    """The seed part `part` of a step's episodes draws with (part 0: the run's seed): each
    worker's session numbers its rows from 0 and keys a draw by (seed, key, row), so the
    parts' seeds differ or their rows would draw alike."""
    return (seed + part * 0x9E3779B9) % 2**32


def _hold(fleet: Fleet, params, version: int, tag, prompts=None, greedy: bool = True):
    """The workers a session's rows go to (`Fleet.spread`): `prompts` split over up to
    one worker per `prompt_multiple` of them where the split draws what one worker would
    (greedy, or engines whose rows draw with their own keys), else one; None: every
    worker (the agents' episodes, each whole on one); `tag` (None: nothing) on their
    links while they hold the rows. The fleet is connected first, refreshed (who joined,
    left or is back) and holding `version`."""
    if not fleet.links:
        fleet.connect()
    fleet.refresh()
    if fleet.host is None or fleet.version != version:
        fleet.push(params, version)
    m = math.lcm(*(k.prompt_multiple for k in fleet.alive))  # each part divides on each
    if prompts is None:
        parts = len(fleet.alive)
    elif prompts % m or not (greedy or all(k.row_keys for k in fleet.alive)):
        parts = 1
    else:
        parts = prompts // m
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


# open_session(fleet, "turns" | "requests", ...)
SESSIONS[Fleet] = {"turns": RemoteTurns, "requests": RemoteRequests}

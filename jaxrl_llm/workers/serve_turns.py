"""The worker's side of multi-turn rows and agents' requests (`turns`: the trainer's):
`handle` runs a `REQUESTS` request on the worker's turns or requests session.

A worker of several processes runs every request on each process (`serve.follow`). With
the static engine each process holds its own share of a part's rows (`own_rows`),
decodes only when every process's rows are ready (its programs are collective), and
process 0 answers for all (`_every_process`: one gather of fixed-shape arrays). The
paged engine's host state is replicated: each process holds every row and runs the same
schedule, and process 0 answers from its own.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import numpy as np

from jaxrl_llm import parallel, sampling
from jaxrl_llm.sampling.engine import TurnRow, open_session
from jaxrl_llm.workers import wire

REQUESTS = ("turns", "turn_run", "turn_output", "requests", "req_run")  # `handle`


def handle(worker, kind: str, fields: dict, arrays: dict) -> tuple:
    """A `REQUESTS` request on `worker` (a `serve.Worker` opened with kind 'turns', its
    weights given) -> (its turns session now, the answer's (fields, arrays)). A worker of
    several processes: every process runs each request, holding the rows `own_rows`
    gives it, and process 0 answers for all (`_every_process` where they split)."""
    if kind == "turns":
        return _open_turns(worker, fields, arrays), ({}, {})
    if kind == "requests":
        return _open_requests(worker, fields), ({}, {})
    session = worker.turns
    if session is None:
        raise wire.WorkerError(f"{kind!r} before 'turns' or 'requests'")
    if kind == "req_run":
        return session, _requests_run(session, fields, arrays)
    if kind == "turn_output":
        out = session.output(own_rows(worker.engine, np.asarray(fields["final_turn"], bool)))
        got = {
            f.name: parallel.to_host(getattr(out, f.name))
            for f in dataclasses.fields(out)
            if f.name != "num_generations" and getattr(out, f.name) is not None
        }
        return None, ({"steps": [fields["step"]]}, got)
    return session, _turns_run(worker, session, fields, arrays)


def _open_turns(worker, fields: dict, arrays: dict):
    """'turns': a turns session of this process's rows of a part -> the session."""
    engine = worker.engine
    own = functools.partial(own_rows, engine)
    live = own(np.asarray(fields["live"], bool))
    session = open_session(
        engine,
        "turns",
        worker.params,
        own(arrays["prompt_ids"]),
        own(arrays["prompt_mask"]),
        sampling.RolloutSpec(**fields["spec"]),
        types.SimpleNamespace(**fields["turns"]),
        live.tolist(),
        fields["step"],
        worker.version,
        worker.mesh,
        first_row=fields["first_row"],
    )
    first = jax.process_index() * len(live) if engine.splits_processes else 0
    worker.own = (first, len(live))  # its first row, rows
    worker.known = {}  # row -> the length of its completion the trainer holds
    return session


def _open_requests(worker, fields: dict):
    """'requests': a requests session for agents' episodes -> the session."""
    if processes(worker.engine) > 1:
        raise wire.WorkerError(
            "agents' requests on a worker of several processes take the paged engine "
            "(the static one splits a batch's rows over the processes); start the "
            "worker with --config.rollout.engine=paged, or as one process"
        )
    names = ("key", "width", "episodes", "prompt_tokens", "total_tokens")
    settings = {k: fields[k] for k in names}
    settings["seed"] = fields.get("seed")  # a part of a step's episodes: its own
    spec = sampling.RolloutSpec(**fields["spec"])
    params, version = worker.params, worker.version
    return open_session(
        worker.engine, "requests", params, version, spec, mesh=worker.mesh, **settings
    )


def _turns_run(worker, session, fields: dict, arrays: dict) -> tuple:
    """'turn_run': the trainer's resumes and ends, then one chunk -> the answer's (fields,
    arrays): each ended row's completion since the trainer last had it."""
    engine, (first, n), known = worker.engine, worker.own, worker.known
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
    split = processes(engine) > 1
    busy = _everywhere(session.busy) if split else session.busy
    ended = session.run_chunk() if busy else []
    refused = session.refused()
    rows = {}
    for r in ended:  # each row's completion from what the trainer holds of it on
        row, k = session.result(r), known.get(r, 0)
        rows[r] = TurnRow(row.tokens[k:], row.versions[k:], row.turn_from)
        known[r] = len(row.tokens)
    totals = {r: known[r] for r in ended}
    if split:
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
        busy=_everywhere(session.busy) if split else session.busy,
        version=int(session.version),
        decode_chunks=int(session.stats["decode_chunks"]),
    )
    return answer, got


def processes(engine) -> int:
    """How many processes a batch's rows split over for `engine`: this world's, for an
    engine whose programs take each process's own rows (`splits_processes`), else 1."""
    return jax.process_count() if engine.splits_processes else 1


def own_rows(engine, x: np.ndarray) -> np.ndarray:
    """This process's slice of a batch's rows (prompts, or their G rows each) for
    `engine`: with several processes and the static engine each gives it its own, process
    i the i-th of equal contiguous parts (as each host of a run reads its slice of the
    batch, `data.iterator`), and the engine's rows are the whole batch in order; the
    paged engine takes the whole batch on every process."""
    n = processes(engine)
    i = jax.process_index() if n > 1 else 0
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

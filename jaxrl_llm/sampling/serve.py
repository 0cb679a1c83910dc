"""Requests served one at a time: each asks for the next reply of a conversation (an agent
episode through the gateway) given its whole context.

    session = open_session(engine, "requests", params, version, spec, key=k, width=R,
                           episodes=E, prompt_tokens=P, total_tokens=T)  # `engine`
    session.ask(episode, context_ids, max_tokens, n)       # n choices of one request
    for episode in session.run_chunk():                     # requests answered
        choices = session.answer(episode)                   # [(ids, logprobs, versions, stopped)]
    session.forget(episode)                                 # the episode ended

- `StaticRequests`: the static `Sampler` keeps nothing between requests: `run_chunk`
  samples every request asked so far in calls of `width` rows (padded with copies of a
  real row whose draws are dropped, so one program), each re-reading its whole context.
- `PagedRequests`: the paged engine's `TurnSession`, a conversation a row of it that
  keeps its KV cache between requests. A request resumes its row when the row's tokens
  (its prompt, what it drew and what was appended) are a prefix of the context, which
  they are when the request extends the conversation: only the rest (the row's last drawn
  token, then the new ids) is prefilled. Else (a rewrite; a stop string that cut the
  reply, so the row holds tokens the conversation does not keep; a request after an
  n > 1 one) the row ends and a new row prefills the whole context (`cache_restarts`
  counts those the caller did not mark as rewrites). Requests with n > 1 are sampled as
  `StaticRequests` does, with the engine's `sample`, re-reading the context. A request is
  answered as soon as its turn ends; rows asked while others decode join between chunks.

`stats`: calls (sampler calls or decode chunks), batched (rows in them), batch_max,
prefill_tokens, cached_tokens, cache_restarts, evicted, decode_chunks.
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling.decode import FINISH_STOP
from jaxrl_llm.sampling.generate import pad_prompts
from jaxrl_llm.sampling.paged_turns import TurnSession

COUNTERS = (
    "calls batched batch_max prefill_tokens cached_tokens cache_restarts evicted decode_chunks"
)


def sample_rows(session, rows: list, stats: dict) -> list:
    """Each row's (drawn ids, log-probs, versions, stopped), rows being token-id lists
    sampled by the session's `engine.sample` with its params, spec and version in calls
    of `session.width` rows; a call's step is session.key + calls % 1024 (a fresh draw
    per call)."""
    drawn, width, version = [], session.width, session.version
    for first in range(0, len(rows), width):
        chunk = rows[first : first + width]
        real = len(chunk)
        chunk += [chunk[0]] * (width - real)  # fixed width: one program
        ids, mask = pad_prompts(chunk, session.engine.pad_id)
        step = session.key + stats["calls"] % 1024
        out = session.engine.sample(session.params, ids, mask, session.spec, step, version=version)
        got = (out.tokens, out.lengths, out.logprobs, out.finish)
        tokens, lengths, logprobs, finish = map(np.asarray, mesh_lib.local_rows(got, session.mesh))
        for r in range(real):
            n = int(lengths[r])
            stopped = int(finish[r]) == FINISH_STOP
            drawn.append((tokens[r, :n].tolist(), logprobs[r, :n].tolist(), [version] * n, stopped))
        _count(stats, real)
    return drawn


def _count(stats: dict, rows: int) -> None:
    stats["calls"] += 1
    stats["batched"] += rows
    stats["batch_max"] = max(stats["batch_max"], rows)


class StaticRequests:
    """Requests on the static `Sampler` (the module docstring); args as `PagedRequests`'
    (the sizes of a cache it does not keep unused)."""

    def __init__(self, engine, params, version: int, spec, *, key, width, mesh=None, **_):
        self.engine, self.params, self.version, self.spec = engine, params, version, spec
        self.key, self.width, self.mesh = key, width, mesh
        self.asked: list = []  # (episode, ids, n)
        self.answers: dict = {}
        self.stats = dict.fromkeys(COUNTERS.split(), 0)

    @property
    def busy(self) -> bool:
        return bool(self.asked)

    def ask(self, episode, ids, max_tokens: int, n: int = 1, rewrite: bool = False) -> None:
        self.asked.append((episode, list(ids), n))
        self.stats["prefill_tokens"] += len(ids) * n

    def run_chunk(self) -> list:
        """Samples every request asked so far -> their episodes."""
        asked, self.asked = self.asked, []
        rows = [ids for _, ids, n in asked for _ in range(n)]
        if not rows:
            return []
        drawn = sample_rows(self, rows, self.stats)
        self.stats["decode_chunks"] += 1
        first = 0
        for episode, _, n in asked:
            self.answers[episode] = drawn[first : first + n]
            first += n
        return [episode for episode, _, _ in asked]

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def forget(self, episode) -> None:
        pass

    def swap(self, params, version: int) -> None:
        self.params, self.version = params, int(version)


class PagedRequests:
    """Requests on the paged engine (the module docstring)."""

    def __init__(
        self,
        engine,
        params,
        version: int,
        spec,
        *,
        key: int,
        width: int,
        episodes: int,
        prompt_tokens: int,
        total_tokens: int,
        mesh=None,
    ):
        self.engine, self.params, self.spec = engine, params, spec
        self.key, self.width, self.mesh = key, width, mesh
        T = total_tokens  # a row's completion: drawn and appended tokens
        whole = prompt_tokens + T
        pages = engine.pages or engine.auto_pages(episodes, whole) + 2 * -(
            -whole // engine.page_size
        )
        self.session = TurnSession(
            engine,
            params,
            version,
            spec.replace(num_generations=1, max_new_tokens=T),
            seed=engine.seed,
            step=key,
            slots=engine.slots or episodes,
            pages=pages,
            prompts=episodes + 1,
        )
        self.rows: dict = {}  # episode -> its row
        self.asking: dict = {}  # row -> its episode, while its turn is in flight
        self.answers: dict = {}  # episode -> its choices (n > 1: sampled apart)
        self.unkept: set = set()  # episodes whose last request had n > 1 (no row)
        self.count = 0  # row ids used
        self.counts = dict.fromkeys(COUNTERS.split(), 0)

    @property
    def busy(self) -> bool:
        return self.session.busy

    @property
    def version(self) -> int:
        return self.session.version

    @property
    def stats(self) -> dict:
        s = self.session.stats
        return self.counts | {"decode_chunks": s["decode_chunks"], "evicted": s["evicted"]}

    def ask(self, episode, ids, max_tokens: int, n: int = 1, rewrite: bool = False) -> None:
        session, counts, row = self.session, self.counts, self.rows.pop(episode, None)
        ids = list(ids)
        if n > 1:  # re-read: its choices are not rows of the session
            if row is not None:
                session.end(row)
            self.unkept.add(episode)
            counts["prefill_tokens"] += len(ids) * n
            self.answers[episode] = sample_rows(self, [ids] * n, counts)
            return
        if row is not None:
            t = session.result(row)
            have = t.prompt.tolist() + t.tokens
            if ids[: len(have)] == have:  # the row's tokens, then the new ones
                session.resume(row, ids[len(have) :], max_tokens)
                counts["cached_tokens"] += len(have) - 1  # its last drawn one was not
                counts["prefill_tokens"] += len(ids) - len(have) + 1
                self.rows[episode], self.asking[row] = row, episode
                return
            session.end(row)
            counts["cache_restarts"] += not rewrite
        elif episode in self.unkept:  # after an n > 1 request
            self.unkept.discard(episode)
            counts["cache_restarts"] += not rewrite
        row, self.count = self.count, self.count + 1
        session.add(row, ids, max_tokens)
        counts["prefill_tokens"] += len(ids)
        self.rows[episode], self.asking[row] = row, episode

    def run_chunk(self) -> list:
        """One decode chunk -> the episodes answered (turns ended, n > 1 ones sampled)."""
        session = self.session
        chunks = session.stats["decode_chunks"]
        ended = session.run_chunk()
        if session.stats["decode_chunks"] > chunks:  # rows decoded in this chunk
            _count(self.counts, session.decoding + len(ended))
        for row in ended:
            t = session.result(row)
            a = t.turn_from
            drawn = (t.tokens[a:], t.logprobs[a:], t.versions[a:], t.stopped)
            self.answers[self.asking.pop(row)] = [drawn]
        return list(self.answers)

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def forget(self, episode) -> None:
        """The episode ended: its row's pages go back."""
        if episode in self.rows:
            self.session.end(self.rows.pop(episode))

    def swap(self, params, version: int) -> None:
        self.session.swap(params, version)
        self.params = params

"""Requests served one at a time: each asks for the next reply of a conversation (an agent
episode through the gateway) given its whole context.

    session = open_session(engine, "requests", params, version, spec, key=k, width=R,
                           episodes=E, prompt_tokens=P, total_tokens=T)  # `engine`
    session.ask(episode, context_ids, max_tokens, n)       # n choices of one request
    for episode in session.run_chunk():                     # requests answered
        choices = session.answer(episode)                   # [(ids, logprobs, versions, stopped)]
    session.forget(episode)                                 # the episode ended

- `StaticRequests`: the static `Sampler`. The first requests asked together (one per
  episode, up to `width`) are the rows of one `DecodeState`, a cohort (padded to `width`
  rows with copies that draw nothing, so one program): a prefill, then a turn's decode.
  An episode's next request extends its row when the row's tokens are a prefix of the
  context, as on the paged engine: `run_chunk` appends each such row's new ids in one
  program (`Sampler.append`, the environments' multi-turn path) and decodes the next
  turn of those rows together. Any other request (a rewrite, a reply cut by a stop
  string, n > 1, an episode without a row, a cache whose shared slots would pass its
  bound) is sampled in calls of `width` rows, re-reading its whole context
  (`sample_rows`); its row, if any, ends. A new cohort starts once every row of the last
  has ended. Several processes: every request is re-read.
- `PagedRequests`: the paged engine's `TurnSession`, a conversation a row of it that
  keeps its KV cache between requests. A request resumes its row when the row's tokens
  (its prompt, what it drew and what was appended) are a prefix of the context, which
  they are when the request extends the conversation: only the rest (the row's last drawn
  token, then the new ids) is prefilled. Else (a rewrite; a stop string that cut the
  reply, so the row holds tokens the conversation does not keep; a request after an
  n > 1 one) the row ends and a new row prefills the whole context (`cache_restarts`
  counts those the caller did not mark as rewrites). Requests with n > 1 are re-read
  (`sample_rows`, with the engine's `sample`). A request is
  answered as soon as its turn ends; rows asked while others decode join between chunks.

Both draw with the engine's seed, or the session's own (`seed=`: rollout workers sharing
a step's episodes give each part its own, `workers.turns.RemoteRequests`, so the parts'
rows, numbered alike, draw apart).

`stats`: calls (sampler calls or decode chunks), batched (rows in them), batch_max,
prefill_tokens, cached_tokens, cache_restarts, evicted, decode_chunks.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling.decode import FINISH_STOP
from jaxrl_llm.sampling.generate import pad_prompts
from jaxrl_llm.sampling.paged_turns import TurnSession
from jaxrl_llm.sampling.sampler import append_end

COUNTERS = (
    "calls batched batch_max prefill_tokens cached_tokens cache_restarts evicted decode_chunks"
)


def sample_rows(session, rows: list, stats: dict) -> list:
    """Each row's (drawn ids, log-probs, versions, stopped), rows being token-id lists
    sampled by the session's `engine.sample` with its params, spec, version and seed in
    calls of `session.width` rows; a call's step is session.key + calls % 1024 (a fresh
    draw per call)."""
    drawn, width, version = [], session.width, session.version
    for first in range(0, len(rows), width):
        chunk = rows[first : first + width]
        real = len(chunk)
        chunk += [chunk[0]] * (width - real)  # fixed width: one program
        ids, mask = pad_prompts(chunk, session.engine.pad_id)
        step = session.key + stats["calls"] % 1024
        out = session.engine.sample(
            session.params, ids, mask, session.spec, step, version=version, seed=session.seed
        )
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


def _shared_prefill(fresh: dict, width: int, multiple: int) -> tuple[list, list, int]:
    """A new cohort's rows in prefill order -> (episodes, their prompts, k): equal prompts
    are next to each other, in runs of k, so the cohort's prefill reads each run's prompt
    once and repeats its cache k times (`Sampler.start` with G = k). An agent's G episodes
    of one example usually open with the same request, so k is G there; k is the largest
    common divisor of the prompts' counts and `width` that leaves a multiple of the
    mesh's batch (`multiple`) rows to prefill (1: every row prefilled)."""
    groups: dict = {}
    for episode, ids in fresh.items():
        groups.setdefault(tuple(ids), []).append(episode)
    k = math.gcd(width, *(len(g) for g in groups.values()))
    k = max((d for d in range(1, k + 1) if k % d == 0 and (width // d) % multiple == 0), default=1)
    episodes = [episode for g in groups.values() for episode in g]
    return episodes, [fresh[episode] for episode in episodes], k


class _Cohort:
    """The static sampler's live rows: one `DecodeState` of `width` rows, an episode a
    row, whose KV cache the episodes' next requests extend (`Sampler.append`)."""

    def __init__(self, state, rows: dict, prompts: list):
        self.state = state
        self.rows = rows  # episode -> its row
        self.have = dict(enumerate(prompts))  # row -> its tokens: prompt, drawn, appended
        self.prompt_len = [len(p) for p in prompts]
        self.appended: dict = {}  # row -> (episode, new ids, the whole context)
        self.stale = False  # parameters swapped in since the cache was computed


class StaticRequests:
    """Requests on the static `Sampler` (the module docstring); args as `PagedRequests`'
    (`episodes` unused). A cohort's cache holds at most twice a record's slots, 2 x
    (prompt_tokens + total_tokens) (and the model's positions): the rows asked in
    different rounds, the appends rounded up, leave holes in its shared slots; past that
    bound requests are re-read, so it holds at most twice what the largest re-read call
    of `width` rows does."""

    def __init__(
        self,
        engine,
        params,
        version: int,
        spec,
        *,
        key,
        width,
        prompt_tokens: int,
        total_tokens: int,
        mesh=None,
        seed: int | None = None,
        **_,
    ):
        self.engine, self.params, self.version, self.spec = engine, params, version, spec
        self.key, self.width, self.mesh, self.seed = key, width, mesh, seed
        whole = 2 * (prompt_tokens + total_tokens)
        self.slots = min(engine.cfg.max_position_embeddings, whole)
        self.asked: list = []  # (episode, ids, n): re-read by `sample_rows`
        self.fresh: dict = {}  # episode -> ids: the first requests of the next cohort
        self.cohort: _Cohort | None = None
        self.answers: dict = {}
        self.stats = dict.fromkeys(COUNTERS.split(), 0)
        self.keeps = not engine.multi_process()  # a cohort's rows are one process's

    @property
    def busy(self) -> bool:
        return bool(self.asked or self.fresh or (self.cohort and self.cohort.appended))

    def ask(self, episode, ids, max_tokens: int, n: int = 1, rewrite: bool = False) -> None:
        ids, cohort, stats = list(ids), self.cohort, self.stats
        row = cohort.rows.pop(episode, None) if cohort else None
        if row is not None and n == 1:
            have = cohort.have[row]
            if ids[: len(have)] == have:  # the row's tokens, then the new ones
                cohort.rows[episode] = row
                cohort.appended[row] = (episode, ids[len(have) :], ids)
                stats["cached_tokens"] += len(have) - 1  # its last drawn one was not
                stats["prefill_tokens"] += len(ids) - len(have) + 1
                return
            stats["cache_restarts"] += not rewrite
        if cohort is not None and not cohort.rows:
            self.cohort = cohort = None  # every row ended: the next first requests start one
        stats["prefill_tokens"] += len(ids) * n
        if n == 1 and cohort is None and self.keeps and len(self.fresh) < self.width:
            self.fresh[episode] = ids
        else:
            self.asked.append((episode, ids, n))

    def run_chunk(self) -> list:
        """Decodes the cohort's asked rows (a new cohort's first) and samples every
        request re-read -> their episodes."""
        answered = []
        if self.fresh:
            answered += self._decode(self._start())
        elif self.cohort is not None and self.cohort.appended:
            answered += self._decode(self._append())
        asked, self.asked = self.asked, []
        rows = [ids for _, ids, n in asked for _ in range(n)]
        if rows:
            drawn = sample_rows(self, rows, self.stats)
            first = 0
            for episode, _, n in asked:
                self.answers[episode] = drawn[first : first + n]
                first += n
            answered += [episode for episode, _, _ in asked]
        return answered

    def _start(self) -> list:
        """A new cohort from the first requests asked -> its rows' episodes."""
        fresh, self.fresh = self.fresh, {}
        multiple = mesh_lib.batch_size_multiple(self.engine.mesh)
        episodes, prompts, shared = _shared_prefill(fresh, self.width, multiple)
        real = len(prompts)
        once = prompts[::shared] + [prompts[0]] * ((self.width - real) // shared)
        ids, mask = pad_prompts(once, self.engine.pad_id)
        step = self.key + self.stats["calls"] % 1024
        spec = self.spec.replace(num_generations=shared)
        state = self.engine.start(
            self.params, ids, mask, spec, step, version=self.version, seed=self.seed
        )
        # The rows' spec as every later program of the cohort reads it (one program each).
        state = state.replace(spec=self.spec)
        state = self.engine.stop(state, np.arange(self.width) >= real)  # the copies draw nothing
        rows = {episode: r for r, episode in enumerate(episodes)}
        self.cohort = _Cohort(state, rows, prompts)
        return episodes

    def _append(self) -> list:
        """The asked rows' new ids into the cohort's cache -> their episodes; none when
        the cache's shared slots would pass `slots`: those requests are then re-read and
        their rows end."""
        engine, cohort = self.engine, self.cohort
        appended, cohort.appended = cohort.appended, {}
        width = -(-max(len(new) for _, new, _ in appended.values()) // 8) * 8
        limit = self.slots - self.spec.max_new_tokens
        if cohort.state.end + width > limit:
            for episode, new, ids in appended.values():
                del cohort.rows[episode]
                self.asked.append((episode, ids, 1))
                kept = len(ids) - len(new) - 1  # counted as cached when asked
                self.stats["cached_tokens"] -= kept
                self.stats["prefill_tokens"] += kept
            return []
        ids = np.full((self.width, width), engine.pad_id, np.int32)
        mask = np.zeros((self.width, width), bool)
        for r, (_, new, _) in appended.items():
            ids[r, : len(new)], mask[r, : len(new)] = new, True
            cohort.have[r] = cohort.have[r] + new
        state = engine.stop(cohort.state, ~mask.any(axis=1))  # the others draw nothing
        end = append_end(state.end + width, limit)
        cohort.state = engine.append(self.params, state, ids, mask, end)
        return [episode for episode, _, _ in appended.values()]

    def _decode(self, episodes: list) -> list:
        """One turn of the cohort's live rows -> their episodes (answered)."""
        engine, cohort = self.engine, self.cohort
        if not episodes:
            return []
        if cohort.stale:  # the cache as the swapped-in parameters compute it
            cohort.state, cohort.stale = engine.refresh(self.params, cohort.state), False
        spec = self.spec
        cohort.state = engine.decode(self.params, cohort.state, spec.max_new_tokens, spec.stop_ids)
        out = engine.result(cohort.state)
        tokens, lengths, logprobs, finish = map(
            np.asarray, (out.tokens, out.lengths, out.logprobs, out.finish)
        )
        for episode in episodes:
            r = cohort.rows[episode]
            have = cohort.have[r]
            a, b = len(have) - cohort.prompt_len[r], int(lengths[r])
            drawn = tokens[r, a:b].tolist()
            stopped = int(finish[r]) == FINISH_STOP
            self.answers[episode] = [
                (drawn, logprobs[r, a:b].tolist(), [self.version] * len(drawn), stopped)
            ]
            cohort.have[r] = have + drawn
        _count(self.stats, len(episodes))
        self.stats["decode_chunks"] += 1
        return episodes

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def forget(self, episode) -> None:
        """The episode ended: its row draws no more (its cache is kept until the cohort ends)."""
        if self.cohort is not None:
            self.cohort.rows.pop(episode, None)

    def swap(self, params, version: int) -> None:
        self.params, self.version = params, int(version)
        if self.cohort is not None:
            self.cohort.stale = True


class PagedRequests:
    """Requests on the paged engine (the module docstring): `episodes` conversations (a
    slot each, unless the engine sets its slots), `prompt_tokens` + `total_tokens` at
    most each; key, the draws' step (`TurnSession`'s); width, rows per re-read call;
    seed, the draws' (None: the engine's)."""

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
        seed: int | None = None,
    ):
        self.engine, self.params, self.spec = engine, params, spec
        self.key, self.width, self.mesh, self.seed = key, width, mesh, seed
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
            seed=engine.seed if seed is None else seed,
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

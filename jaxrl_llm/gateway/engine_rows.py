"""The gateway's requests served by the paged engine (`rollout.engine='paged'`): an agent
episode is a row of a `TurnSession` that keeps its KV cache between the episode's
requests, so a request that extends its episode prefills only its new tokens.

`rollout.AgentRollout` plays a batch of episodes through `EngineRows.serve` when its
sampler is a `PagedSampler` (else it batches whole contexts into the static sampler
itself); requests are read, checked and answered as there (`AgentRollout.gather`,
`accept`, `reply`, `sample`), so only where the tokens are drawn differs.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

from jaxrl_llm.sampling.paged_turns import TurnSession

if TYPE_CHECKING:
    from jaxrl_llm.gateway.rollout import AgentRollout, Play


class EngineRows:
    """The gateway's requests served by the paged engine (`rollout.engine='paged'`): one
    `TurnSession` for a batch of episodes (a step's, or an evaluation batch's), an
    episode a row of it.

    An episode's first request adds a row with its context; the row decodes its turn in
    a slot, and when the turn ends (a stop id, or the request's max_tokens spent) the
    request is answered and the row leaves its slot but keeps its KV pages. The next
    request of the episode resumes the row when the row's tokens (its prompt, what it
    drew and what was appended) are a prefix of the request's context, which they are
    when the request extends the episode (`Episode`): only the rest (the row's last
    drawn token, then the new messages' ids) is prefilled, at the row's length. Else
    (a rewrite; a stop string that cut the reply, so the row holds tokens the episode
    does not keep; a request after an n > 1 one) the row ends and a new row prefills the
    whole context (`gateway/cache_restarts` counts those that were not rewrites).
    Requests with n > 1 are sampled by `PagedSampler.sample` as a batch of their own,
    re-reading the context. A row ends when its episode does.

    Requests are taken as they come: while rows decode, requests that arrived are added
    or resumed between decode chunks, and a request is answered as soon as its turn
    ends. `gateway/batch_mean` and `batch_max` are rows per decode chunk here.

    Partial rollouts (`refresh`): before each decode chunk after the first, `refresh()`
    gives the newest parameters and their version; when they are newer the session
    swaps them in (`TurnSession.swap`: every row, in a slot or parked between requests,
    recomputed by them) and draws on with them, and n > 1 requests are sampled with them
    too. A turn in flight may so hold tokens of two versions; each records its own.
    """

    def __init__(self, rollout: AgentRollout, params, play: Play, episodes: int):
        e, self.rollout, self.params, self.play = rollout.sampler, rollout, params, play
        T = rollout.width  # a row's completion: drawn and appended tokens
        spec = play.spec.replace(num_generations=1, max_new_tokens=T)
        whole = rollout.prompt_width + T
        pages = e.pages or e.auto_pages(episodes, whole) + 2 * -(-whole // e.page_size)
        self.session = TurnSession(
            e, params, play.version, spec, seed=e.seed, step=play.key, slots=e.slots or episodes,
            pages=pages, prompts=episodes + 1,
        )  # fmt: skip
        self.rows: dict = {}  # episode -> its row
        self.asked: dict = {}  # row -> (episode, body, reply, ask) of its turn in flight
        self.count = 0  # row ids used
        self.unkept: set = set()  # episodes whose last request had n > 1 (no row)

    def serve(self, futures, episodes, over, refresh=None) -> None:
        """Answers the episodes' requests until every episode has ended. refresh: None,
        or a function -> (newest params, their version), read before every decode chunk
        after the first."""
        r, session, play = self.rollout, self.session, self.play
        while True:
            if session.busy:
                pending = []
                while True:
                    try:
                        pending.append(play.server.requests.get_nowait())
                    except queue.Empty:
                        break
            else:
                pending = r.gather(futures, play.server)
                if not pending:
                    break
            self._start(r.accept(pending, episodes, over, play), episodes)
            if refresh is not None and session.busy and session.stats["decode_chunks"]:
                newest, newest_version = refresh()
                if newest_version != session.version:  # the rows' caches recomputed by them
                    session.swap(newest, newest_version)
                    self.params, play.version = newest, int(newest_version)
            chunks = session.stats["decode_chunks"]
            ended = session.run_chunk()
            if session.stats["decode_chunks"] > chunks:  # rows decoded in this chunk
                k = session.decoding + len(ended)
                play.stats["calls"] += 1
                play.stats["batched"] += k
                play.stats["batch_max"] = max(play.stats["batch_max"], k)
            for row in ended:
                episode, body, reply, ask = self.asked.pop(row)
                t = session.result(row)
                a = t.turn_from
                drawn = (t.tokens[a:], t.logprobs[a:], t.versions[a:], t.stopped)
                r.reply(episode, body, reply, ask, [drawn], episodes, play)
            for episode in [e for e, row in self.rows.items()
                            if futures[e].done() and row not in self.asked]:  # fmt: skip
                session.end(self.rows.pop(episode))
        play.stats["evicted"] += session.stats["evicted"]

    def _start(self, asks: list, episodes) -> None:
        """Adds or resumes each request's row (n = 1); samples the n > 1 ones apart."""
        session, stats, many = self.session, self.play.stats, []
        for episode, body, reply, ask in asks:
            ids, row = ask["ids"], self.rows.pop(episode, None)
            if ask["n"] > 1:
                if row is not None:
                    session.end(row)
                many.append((episode, body, reply, ask))
                self.unkept.add(episode)
                continue
            if row is not None:
                t = session.result(row)
                have = t.prompt.tolist() + t.tokens
                if ids[: len(have)] == have:  # the row's tokens, then the new ones
                    session.resume(row, ids[len(have) :], ask["max_tokens"])
                    stats["cached_tokens"] += len(have) - 1  # its last drawn one was not
                    stats["prefill_tokens"] += len(ids) - len(have) + 1
                    self.rows[episode], self.asked[row] = row, (episode, body, reply, ask)
                    continue
                session.end(row)
                stats["cache_restarts"] += not ask["rewrite"]
            elif episode in self.unkept:  # after an n > 1 request
                self.unkept.discard(episode)
                stats["cache_restarts"] += not ask["rewrite"]
            row, self.count = self.count, self.count + 1
            session.add(row, ids, ask["max_tokens"])
            stats["prefill_tokens"] += len(ids)
            self.rows[episode], self.asked[row] = row, (episode, body, reply, ask)
        if many:  # re-read: their choices are not rows of the session
            rows, firsts = [], []
            for *_, ask in many:
                firsts.append(len(rows))
                rows += [ask["ids"]] * ask["n"]
                stats["prefill_tokens"] += len(ask["ids"]) * ask["n"]
            drawn = self.rollout.sample(self.params, rows, self.play)
            for (episode, body, reply, ask), first in zip(many, firsts, strict=True):
                self.rollout.reply(episode, body, reply, ask, drawn[first : first + ask["n"]],
                                    episodes, self.play)  # fmt: skip

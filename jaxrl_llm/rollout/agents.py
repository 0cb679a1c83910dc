"""Agents as rollouts: each step runs the user's agent once per trajectory against the
gateway, batches the episodes' pending requests into the sampler, and turns each episode
into one trajectory.

    agents = AgentRollout(config, tokenizer, sampler, spec, mesh)   # agent.entry
    out, scored, versions = agents(params, batch, step)   # as `EnvRollout`: a player

The batching: the trainer's thread waits for requests (`Server.requests`) until every
episode still running has one pending, or a gap passes with no new one (an agent busy
with something else does not hold up the others): `agent.batch_wait_s`, or a quarter of
the last sampler call's time when that is longer (a request that misses a call waits a
whole call more, and the call is paid twice), then samples all
pending requests in one sampler call of fixed width (rollout.batch_size x G rows, padded
with copies of a real row whose draws are dropped; more rows than that take more calls).
`gateway/batch_mean` and `gateway/batch_max` are the requests per sampler call.

The requests are served through `sampling.engine.open_session`, one path for every
engine (`sampling/serve.py`): on the static sampler the episodes' first requests are
the rows of one decode state, and a request that extends its episode appends its new
ids to its row's KV cache (others re-read their whole record). On the paged engine
(`rollout.engine='paged'`) an episode is a row of a `TurnSession` that keeps its KV
cache between the episode's requests, and requests are taken as they come, between
decode chunks. The tokens are exact either way (`episodes.Episode`).
The request's `temperature` is not used: a training rollout samples at
`rollout.temperature`, the temperature the update's log-probs (and so the ratio to the
behaviour log-probs) are taken at; held-out evaluation samples greedily (and at
`eval.temperature` for pass@k), as evaluation of every kind does. Each response says so
in its `jaxrl_llm` field (the temperature used, the one requested, the parameters'
version), and `gateway/temperature_ignored` counts requests that asked for another.

Partial rollouts (`refresh`, `rollout.partial` in split): on the static sampler each
sampler call draws with the newest published parameters; on the engine the session
swaps them in between decode chunks (`TurnSession.swap`), so a reply may hold tokens of
two versions. Every drawn token records the version that drew it; a response's
`policy_version` is its oldest drawn token's (the version that started the turn; see
`AgentRollout.reply`).

This module holds the batching and the turning of episodes into rows; the protocol of a
request (its options, its choices, the response body) is `completions`, the engines'
serving of the requests `sampling.serve`.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import time

import jax
import numpy as np
from absl import logging

from jaxrl_llm import parallel, sampling
from jaxrl_llm.envs.render import Renderer
from jaxrl_llm.gateway import completions
from jaxrl_llm.gateway.episodes import Episode, Play, group_rows
from jaxrl_llm.gateway.server import Server
from jaxrl_llm.rollout import evaluation, scoring
from jaxrl_llm.sampling import engine
from jaxrl_llm.verifiers import ScoreDetails


class AgentRollout:
    """The gateway, the agent and the batching of a run (`config.agent`). Training samples
    on `engine` (default `sampler`; rollout workers: their `workers.turns.Fleet`, whose
    `stats` the thread logs), evaluation on `sampler`."""

    def __init__(
        self, config, tokenizer, sampler, spec: sampling.RolloutSpec, mesh=None, engine=None
    ):
        a, d = config.agent, config.data
        self.config, self.tokenizer, self.sampler, self.mesh = config, tokenizer, sampler, mesh
        self.remote = engine  # None: training on `sampler` too
        self.stats = {} if engine is None else engine.stats
        self.spec = spec
        self.turn_spec = dataclasses.replace(spec, num_generations=1)
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        self.renderer = Renderer(
            tokenizer, has_chat and d.chat_template != "never", d.system_prompt
        )
        self.rows = config.rollout.batch_size * spec.num_generations
        self.width, self.prompt_width = a.max_total_tokens, d.max_prompt_len
        self.timeout_s, self.wait_s = a.timeout_s, a.batch_wait_s
        self.new_server = functools.partial(
            Server, a.entry, dict(a.options), max_request_bytes=a.max_request_bytes
        )
        self.server: Server | None = None
        self.label = "agent"
        self.eval_server: Server | None = None  # evaluation's own (beside the rollout thread)
        self.warned_unshared = False  # `_warn_unshared`: once per run

    def close(self) -> None:
        for server in (self.server, self.eval_server):
            if server is not None:
                server.close()
        self.server = self.eval_server = None
        if self.remote is not None:  # rollout workers: their connections
            self.remote.close()

    def __call__(self, params, batch, step: int, *, version: int | None = None, refresh=None):
        """The agent run on each example of `batch`, G times, to the end -> (out on the
        mesh, scored, the version that drew each completion token [N, T], -1 elsewhere)."""
        if self.server is None:
            self.server = self.new_server()
        G, version = self.spec.num_generations, step if version is None else version
        examples = [ex for ex in batch.examples for _ in range(G)]
        play = Play(self.server, self.turn_spec, key=step * 1024, step=step, version=version)
        order, episodes, results, over = self._play(params, examples, play, refresh, self.remote)
        return self._rollout(order, episodes, results, over, batch, play, play.version)

    def evaluate(self, params, batches, *, pass_k: int, temperature: float, step: int = 0):
        """`eval/*` over held-out batches (`evaluation.run`): each example's episode played
        through the gateway as in training, once greedily (`eval/pass@1`: its reward above
        0.5, `evaluation.is_correct`; the mean reward, failed episodes, requests and length
        per episode), and with pass_k > 1 pass_k times at `temperature` (`eval/pass@k`).
        Runs on a server of its own, so an evaluation beside the rollout thread's episodes
        (overlap, split) keeps them apart."""
        if self.eval_server is None:
            self.eval_server = self.new_server()

        def play(batch, spec, key):  # an episode per row: G copies of each example
            examples = [ex for ex in batch.examples for _ in range(spec.num_generations)]
            if key >= evaluation.EVAL_KEY_OFFSET:  # an episode's draws take key + its index
                key = evaluation.EVAL_KEY_OFFSET + (key - evaluation.EVAL_KEY_OFFSET) % 2**14 * 1024
            spec = spec.replace(num_generations=1)
            game = Play(self.eval_server, spec, key=key, step=step, version=step)
            order, episodes, results, over = self._play(params, examples, game)
            rewards, ends, _ = self._rewards(order, results, over)
            rows = {
                "reward_mean": rewards,
                "failed_frac": [end != "done" for end in ends],
                "turns_mean": [episodes[e].turns for e in order],
                "length_mean": [sum(episodes[e].loss) for e in order],
            }
            return rewards, rows

        return evaluation.run(
            play, batches, self.turn_spec, pass_k=pass_k, temperature=temperature, step=step
        )

    def _play(self, params, examples: list, play: Play, refresh=None, on=None):
        """The agent's episodes of `examples`, to the end, on `play.server`, sampled with
        `play.spec` on engine `on` (default the sampler) -> (episode ids, their records,
        (reward, error, end) each, the ids refused for passing a limit). `play` collects
        the counters. A rollout worker lost with the requests (`engine.RowsLost`) ends the
        episodes (`Server.abandon`): the step is played again."""
        futures = play.server.run_episodes(examples, self.timeout_s)
        order = list(futures)
        episodes = {e: Episode(self.renderer, self.spec.stop_ids) for e in order}
        over = set()  # episodes refused for passing a limit
        started = time.perf_counter()
        try:
            session = engine.open_session(
                on or self.sampler,
                "requests",
                params,
                play.version,
                play.spec,
                key=play.key,
                width=self.rows,
                episodes=len(order),
                prompt_tokens=self.prompt_width,
                total_tokens=self.width,
                mesh=self.mesh,
            )
            self._serve(session, futures, episodes, over, play, refresh)
        except engine.RowsLost:
            play.server.abandon(order, "its rollout worker was lost: the step is played again")
            raise
        for k, v in session.stats.items():
            if k in play.stats:
                play.stats[k] = max(play.stats[k], v) if k == "batch_max" else play.stats[k] + v
        results = [futures[e].result() for e in order]
        for e in order:
            episodes[e].close()
        play.seconds = time.perf_counter() - started
        return order, episodes, results, over

    def _serve(self, session, futures, episodes, over, play: Play, refresh) -> None:
        """Answers the episodes' requests until every episode has ended: requests that
        arrived are asked between decode chunks while rows decode, else gathered
        (`gather`). refresh: None, or a function -> (newest params, their version), read
        before every decode chunk after the first."""
        asked: dict = {}  # episode -> (body, reply, ask) of its request in flight
        ended: list = []  # the episodes' futures done so far (`gather` counts the running)
        for future in futures.values():
            future.add_done_callback(ended.append)
        chunk_s = 0.0  # the last run_chunk's seconds
        while True:
            if session.busy:
                pending = []
                while True:
                    try:
                        pending.append(play.server.requests.get_nowait())
                    except queue.Empty:
                        break
            else:
                wait_s = max(self.wait_s, chunk_s / 4)
                pending = self.gather(len(futures), ended, play.server, wait_s)
                if not pending:
                    return
            for episode, body, reply, ask in self.accept(pending, episodes, over, play):
                session.ask(episode, ask["ids"], ask["max_tokens"], ask["n"], ask["rewrite"])
                asked[episode] = (body, reply, ask)
            if refresh is not None and session.busy and session.stats["decode_chunks"]:
                newest, newest_version = refresh()
                if newest_version != session.version:  # the rows' caches recomputed by them
                    session.swap(newest, newest_version)
                    play.version = int(newest_version)
            started = time.perf_counter()
            try:
                answered = session.run_chunk()
            except engine.RowsLost:  # their answers will not come (`_play` ends the episodes)
                for _, reply, _ in asked.values():
                    reply(503, completions.error("the rollout worker serving it was lost"))
                raise
            chunk_s = time.perf_counter() - started
            for episode in answered:
                body, reply, ask = asked.pop(episode)
                drawn = session.answer(episode)
                self.reply(episode, body, reply, ask, drawn, episodes, play)
            for episode in [e for e in futures if futures[e].done() and e not in asked]:
                session.forget(episode)

    @staticmethod
    def gather(episodes: int, ended: list, server, wait_s: float) -> list:
        """Pending requests: once every running episode has one (of `episodes`, less the
        `ended` ones, a list their futures' callbacks grow), or after `wait_s` without a
        new one; [] when every episode has ended."""
        pending, requests = [], server.requests
        while True:
            running = episodes - len(ended)
            if pending and len(pending) >= running:
                return pending
            if not running and requests.empty():
                return pending
            try:
                pending.append(requests.get(timeout=wait_s if pending else 0.01))
            except queue.Empty:
                if pending:
                    return pending

    def accept(self, pending, episodes, over, play: Play) -> list:
        """Each request's options and context -> [(episode, body, reply, ask)] of those
        to sample; malformed ones and those past agent.max_total_tokens are answered
        (an error) here."""
        asks = []
        for episode, body, reply in pending:
            ep = episodes.get(episode)
            if ep is None:  # an episode of a play given up (`Server.abandon`)
                reply(404, completions.error(f"episode {episode} has ended"))
                continue
            rewrites = ep.retokenized
            try:
                ask = completions.parse_request(body, ep, play, self.spec.max_new_tokens)
            except ValueError as err:  # a malformed request: that request's error only
                reply(400, completions.error(str(err)))
                continue
            ask["rewrite"] = ep.retokenized > rewrites
            if len(ask["ids"]) - min(ep.prompt_len, self.prompt_width) + ask["max_tokens"] > (
                self.width
            ):
                over.add(episode)
                message = f"the episode passes agent.max_total_tokens={self.width}"
                reply(400, completions.error(message, "context_length_exceeded"))
                continue
            asks.append((episode, body, reply, ask))
        return asks

    def reply(self, episode, body, reply, ask, drawn: list, episodes, play: Play) -> None:
        """Records a request's choices (drawn: (ids, log-probs, versions, stopped) each)
        in its episode and answers it. The response's `policy_version` is the version of
        its oldest drawn token (versions only grow along a row): the version that started
        the turn, as a row's `policy_version` is its oldest token's (`_rollout`). Every
        token of a static sampler's reply has that one; on the engine with partial
        rollouts the turn may end under a newer one."""
        prefix = f"call_{episode}_{episodes[episode].turns}"
        choices = [
            completions.make_choice(self.tokenizer, ask, *d, play, f"{prefix}_{k}")
            for k, d in enumerate(drawn)
        ]
        episodes[episode].record(body["messages"], [c[1:] for c in choices])
        first = [d[2][0] for d in drawn if d[2]]
        sampled = {
            "temperature": play.spec.temperature,
            "policy_version": int(min(first)) if first else play.version,
            "requested_temperature": ask["temperature"],
        }
        drew = sum(len(c[2]) for c in choices)
        reply(
            200,
            completions.response(
                episode,
                episodes[episode].turns,
                [c[0] for c in choices],
                len(ask["ids"]),
                drew,
                sampled,
            ),
        )
        play.stats["requests"] += 1

    def _rewards(self, order, results, over):
        """-> (rewards, ends, errors): 0 for an episode that failed or passed a limit."""
        rewards = np.zeros(len(order), np.float32)
        ends, errors = [], []
        for i, (e, (reward, error, end)) in enumerate(zip(order, results, strict=True)):
            if e in over:  # whatever the agent did with the refusal
                end, error = "max_total_tokens", "the episode passed agent.max_total_tokens"
            rewards[i] = reward if end == "done" else 0.0
            ends.append(end)
            errors.append(error)
        return rewards, ends, errors

    def _rollout(self, order, episodes, results, over, batch, play, version):
        """The episodes as the step's rows (prompt-major), with rewards and metrics."""
        G = self.spec.num_generations
        rewards, ends, errors = self._rewards(order, results, over)
        width, pad = self.width, self.sampler.pad_id
        parts = [
            group_rows([episodes[e] for e in order[g : g + G]], self.prompt_width, width, pad)
            for g in range(0, len(order), G)
        ]
        rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        versions, cut, unshared = rows.pop("versions"), rows.pop("cut"), rows.pop("unshared")
        sampled = np.where(versions >= 0, versions, np.iinfo(np.int64).max).min(axis=1)
        host = sampling.SampleOutput(
            tokens=rows["tokens"],
            mask=rows["mask"],
            loss_mask=rows["loss_mask"],
            logprobs=rows["logprobs"],
            lengths=rows["lengths"],
            finish=np.full(len(order), sampling.FINISH_STOP, np.int32),
            prompt_tokens=rows["prompt_tokens"],
            prompt_mask=rows["prompt_mask"],
            policy_version=np.where(versions.max(axis=1) >= 0, sampled, version).astype(np.int32),
            num_generations=G,
        )
        if self.mesh is None:  # no mesh: one device
            with jax.transfer_guard("allow"):
                out = jax.device_put(host)
        else:
            out = parallel.shard_local_batch(host, self.mesh)
        decode = self.tokenizer.decode
        completions = [
            decode(t[:n], skip_special_tokens=True)
            for t, n in zip(rows["tokens"], rows["lengths"], strict=True)
        ]
        prompts = [
            decode(p[m]) for p, m in zip(rows["prompt_tokens"], rows["prompt_mask"], strict=True)
        ]
        metrics = self._metrics(play, episodes, ends, rows["lengths"])
        metrics["gateway/truncated"] = float((cut > 0).sum())  # rows cut to the width
        metrics["gateway/prompt_not_shared"] = float(unshared[::G].sum())  # groups
        self._warn_unshared(int(unshared[::G].sum()), len(order) // G, play.step)
        scored = scoring.Scored(
            rewards=rewards,
            metrics=metrics,
            completions=completions,
            prompts=prompts,
            examples=[ex for ex in batch.examples for _ in range(G)],
            lengths=rows["lengths"].astype(np.int64),
            prompt_lengths=rows["prompt_mask"].sum(axis=1),
            details=self._details(rewards, ends, errors),
        )
        return out, scored, versions

    def _details(self, rewards, ends: list, errors: list) -> ScoreDetails:
        """The episodes' failures as a verifier's (the run's error budget reads them): an
        error or a limit passed counts as an error, a timeout as a timeout."""
        failed = [i for i, end in enumerate(ends) if end != "done"]
        return ScoreDetails(
            per_verifier={self.label: rewards.astype(np.float64)},
            weights={self.label: 1.0},
            errors={self.label: ends.count("error") + ends.count("max_total_tokens")},
            timeouts={self.label: ends.count("timeout")},
            messages=[f"episode {i}: {errors[i]}" for i in failed[:8]],
            failed={self.label: len(failed)},
            num_samples=len(ends),
            first_error=f"agent episode {failed[0]}: {errors[failed[0]]}" if failed else None,
            key="agent.entry",
            unit="episodes",
            fix="fix the agent (its failures end their episodes with reward 0)",
        )

    def _warn_unshared(self, groups: int, of: int, step: int) -> None:
        """Once per run: the first step where the G episodes of some prompt started with
        different messages (their rows share only the tokens those have in common as the
        prompt; each episode's own prompt goes into its completion, loss mask 0)."""
        if groups and not self.warned_unshared:
            self.warned_unshared = True
            logging.warning(
                "step %d: agent.entry: the %d episodes of %d of %d prompts started with "
                "different messages, so their rows do not share the prompt (each one's "
                "prompt moves into its completion, where agent.max_total_tokens may cut "
                "it); the episodes of one prompt must start with the same messages for "
                "the prompt to be shared (gateway/prompt_not_shared counts such prompts)",
                step + 1,
                self.spec.num_generations,
                groups,
                of,
            )

    def _metrics(self, play, episodes, ends, lengths) -> dict:
        """gateway/* counters of one rollout (docs/agents.md)."""
        stats = play.stats
        calls = max(stats["calls"], 1)
        return {
            "gateway/requests": float(stats["requests"]),
            "gateway/sampler_calls": float(stats["calls"]),
            "gateway/batch_mean": stats["batched"] / calls,
            "gateway/batch_max": float(stats["batch_max"]),
            "gateway/prefill_tokens": float(stats["prefill_tokens"]),
            "gateway/cached_tokens": float(stats["cached_tokens"]),
            "gateway/cache_restarts": float(stats["cache_restarts"]),
            "gateway/evicted": float(stats["evicted"]),
            "gateway/retokenized": float(sum(ep.retokenized for ep in episodes.values())),
            "gateway/temperature_ignored": float(stats["temperature_ignored"]),
            "gateway/tool_call_errors": float(stats["tool_call_errors"]),
            "gateway/errors": float(ends.count("error")),
            "gateway/timeouts": float(ends.count("timeout")),
            "gateway/over_limit": float(ends.count("max_total_tokens")),
            **{f"gateway/{k}": float(v) for k, v in play.server.take_counts().items()},
            "gateway/turns_mean": float(np.mean([ep.turns for ep in episodes.values()])),
            "gateway/seconds": play.seconds,
            "rollout/length_mean": float(lengths.mean()),
            "rollout/length_max": float(lengths.max()),
        }

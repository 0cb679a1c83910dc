"""The OpenAI-compatible gateway: agents written against the `openai` client only
(tests/agents_for_tests.py) trained through it. Exact tokens against a reference loop
that re-prefills the conversation with HF `generate` every turn; loss masks; history
rewrites counted; 64 concurrent episodes batched; failures cost their episode only;
tool calls in the model's formats; `verifiers` environments (agent.entry=verifiers:...)."""

import os
import queue
import threading
import time
import types

import jax
import numpy as np
import pytest
import torch
from hf_reference import hf_model
from tiny_run import TOKENIZER, make_model_dir, tiny_config

from jaxrl_llm import envs, models, rl, sampling, train
from jaxrl_llm.gateway import parse_tool_calls
from jaxrl_llm.models import builtin
from jaxrl_llm.rollout.agents import AgentRollout
from jaxrl_llm.sampling import engine, serve
from jaxrl_llm.trainer import metrics

AGENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agents_for_tests.py")
STOPS = (18, 22, 23, 25)  # "=" "." "," " ": the tiny model stops on some turns


@pytest.fixture(scope="module")
def tok():
    return builtin.load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = hf_model("qwen3", seed=3, vocab_size=33)
    d = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(d)
    return (model, *models.load_hf(d))


def agent_rollout(
    cfg,
    tok,
    entry: str,
    batch_size: int,
    G: int,
    wait_s: float = 1.0,
    temperature: float = 0.0,
    **agent,
):
    c = tiny_config("unused")
    c.agent.entry, c.agent.max_total_tokens, c.agent.batch_wait_s = entry, 40, wait_s
    c.agent.update(agent)
    c.rollout.batch_size, c.data.max_prompt_len = batch_size, 16
    spec = sampling.RolloutSpec(G, 5, temperature, stop_ids=STOPS)
    sampler = sampling.Sampler(cfg, None, seed=5, cache_segments=1)
    return AgentRollout(c, tok, sampler, spec), spec


def hf_greedy(model, seq: list, budget: int = 5) -> list:
    """HF `generate`'s greedy reply to the ids `seq`, read from scratch (until a STOPS id)."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([seq])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=list(STOPS),
            pad_token_id=0,
        )
    return out[0, len(seq) :].tolist()


def hf_turns(model, tok, question: str, rewrite: bool, budget: int = 5, replies=None):
    """The reference loop: each request's conversation re-read from scratch by HF
    `generate` (greedy), its tokens built as the gateway's docs say -> the trajectory
    (prompt included). `replies`, a list, gets each reply's ids."""
    renderer = envs.Renderer(tok, use_chat=False)

    def generate(seq):
        return hf_greedy(model, seq, budget)

    seq = renderer.prompt([{"role": "user", "content": question}])
    first = generate(seq)
    seq += first + renderer.turn([{"role": "user", "content": "7"}])
    second = generate(seq)
    seq += second
    if replies is not None:
        replies += [first, second]
    if rewrite:  # the history the agent sent, rendered anew, then the model's answer
        seq = renderer.prompt(
            [{"role": "user", "content": question}, {"role": "user", "content": "again"}]
        )
        seq += generate(seq)
    return seq


def test_agent_episodes_keep_the_tokens_the_model_produced(tiny, tok):
    """Two greedy episodes per question through the HTTP gateway: each trajectory (shared
    prompt + completion) equals the reference loop's tokens; model tokens have loss mask
    1 and the sampler's log-probs (equal to a teacher-forced forward), the user turns
    between them loss mask 0; the rewriting episodes are counted and trained on their
    last segment; the failing ones (an agent that raises, a request past
    agent.max_total_tokens) score 0 and are counted."""
    model, cfg, params = tiny
    agents, spec = agent_rollout(cfg, tok, f"{AGENTS}:two_turns", batch_size=4, G=2)
    examples = [
        {"question": "1+2="},
        {"question": "12*3=", "rewrite": True},
        {"question": "7-4=", "fail": True},
        {"question": "1" * 60},
    ]
    try:
        out, scored, versions = agents(params, types.SimpleNamespace(examples=examples), 3)
    finally:
        agents.close()
    tokens, mask, loss_mask, logprobs, lengths, prompt, prompt_mask = (
        np.asarray(x)
        for x in (
            out.tokens,
            out.mask,
            out.loss_mask,
            out.logprobs,
            out.lengths,
            out.prompt_tokens,
            out.prompt_mask,
        )
    )
    for i, ex in enumerate(examples[:3]):
        reference = hf_turns(model, tok, ex["question"], bool(ex.get("rewrite")))
        for row in (2 * i, 2 * i + 1):
            got = prompt[row][prompt_mask[row]].tolist() + tokens[row, : lengths[row]].tolist()
            assert got == reference, (row, got, reference)
    # Loss mask: exactly the drawn tokens; the "7" turn between them is not trained on.
    assert (versions >= 0).tolist() == loss_mask.tolist() and (versions[loss_mask] == 3).all()
    assert not (loss_mask & ~mask).any() and (~loss_mask & mask).any()
    forced = np.asarray(rl.make_logprob_fn(cfg, spec, chunk_size=8)(params, out))
    np.testing.assert_allclose(forced[loss_mask], logprobs[loss_mask], atol=1e-4)
    assert not logprobs[~loss_mask].any()
    m = scored.metrics
    assert m["gateway/retokenized"] == 2.0 and m["gateway/errors"] == 2.0
    assert m["gateway/over_limit"] == 2.0 and not loss_mask[6:].any()
    assert scored.rewards[4:].tolist() == [0.0] * 4
    assert scored.details.first_error.startswith("agent episode 4: RuntimeError")
    assert m["gateway/requests"] == 2 * 2 + 2 * 3 + 2 * 2  # the refused ones not counted
    assert np.asarray(out.policy_version).tolist() == [3] * 8


def test_the_paged_engine_keeps_each_episodes_cache(tiny, tok):
    """rollout.engine='paged': each episode is a row of one TurnSession, kept between its
    requests. The same greedy episodes as the static sampler's (tokens, masks, log-probs)
    and the reference loop's; a request that extends its episode prefills only its row's
    last drawn token and the new message (gateway/cached_tokens counts the rest), on both
    engines; a
    rewrite starts a new row (retokenized, still exact); a stop string that cut a reply
    (the row holds tokens the episode does not keep) and a request after an n=2 one
    (sampled apart) restart the row, counted."""
    model, cfg, params = tiny
    engine = sampling.PagedSampler(cfg, None, seed=5, page_size=4, chunk_steps=4, prefill_chunk=8)
    replies = {}
    examples = [
        {"question": "1+2="},
        {"question": "12*3=", "rewrite": True},
        {"question": "7-4=", "fail": True},
    ]
    for ex in examples:
        hf_turns(
            model,
            tok,
            ex["question"],
            bool(ex.get("rewrite")),
            replies=replies.setdefault(ex["question"], []),
        )
    # A stop string inside the first reply ("0-=" ends before its "-"); a first request
    # with n=2 (sampled apart, re-read).
    examples += [{"question": "5-1=", "stop": "-"}, {"question": "9*9=", "n": 2}]
    runs = {}
    for name in ("static", "paged"):
        agents, _ = agent_rollout(cfg, tok, f"{AGENTS}:two_turns", batch_size=5, G=2)
        if name == "paged":
            agents.sampler = engine
        try:
            runs[name] = agents(params, types.SimpleNamespace(examples=examples), 3)
        finally:
            agents.close()
    (static, s_scored, s_versions), (paged, scored, versions) = runs["static"], runs["paged"]
    for key in ("tokens", "mask", "loss_mask", "lengths", "prompt_tokens", "prompt_mask"):
        assert np.asarray(getattr(paged, key)).tolist() == np.asarray(getattr(static, key)).tolist()
    np.testing.assert_allclose(np.asarray(paged.logprobs), np.asarray(static.logprobs), atol=1e-5)
    assert versions.tolist() == s_versions.tolist()
    tokens, lengths = np.asarray(paged.tokens), np.asarray(paged.lengths)
    prompt, prompt_mask = np.asarray(paged.prompt_tokens), np.asarray(paged.prompt_mask)
    for i, ex in enumerate(examples[:3]):
        reference = hf_turns(model, tok, ex["question"], bool(ex.get("rewrite")))
        for row in (2 * i, 2 * i + 1):
            got = prompt[row][prompt_mask[row]].tolist() + tokens[row, : lengths[row]].tolist()
            assert got == reference, (row, got, reference)
    renderer = envs.Renderer(tok, use_chat=False)
    # The second request of each episode without a stop string reads its row's cache: its
    # prompt and first reply but the reply's last token (prefilled with the new message).
    cached = (
        sum(
            len(renderer.prompt([{"role": "user", "content": ex["question"]}]))
            + len(replies[ex["question"]][0])
            - 1
            for ex in examples[:3]
        )
        * 2
    )
    m, s = scored.metrics, s_scored.metrics
    assert m["gateway/cached_tokens"] == s["gateway/cached_tokens"] == cached
    assert m["gateway/prefill_tokens"] == s["gateway/prefill_tokens"]
    assert m["gateway/retokenized"] == s["gateway/retokenized"] == 2
    # The static sampler's n=2 episodes have no row to restart (their requests re-read).
    assert m["gateway/cache_restarts"] == 4 and s["gateway/cache_restarts"] == 2
    assert m["gateway/requests"] == s["gateway/requests"] == 2 * (2 + 3 + 2 + 2 + 2)
    assert m["gateway/batch_max"] <= 10


def test_static_requests_extend_their_rows_cache(tiny, tok):
    """On the static sampler the first requests of the episodes are the rows of one
    decode state (a cohort) and a request that extends its episode appends only its new
    ids to that row's cache: over three rounds each reply equals HF's greedy reply to the
    whole context read from scratch, and its log-probs a session's that re-reads every
    context; a request that does not extend its row (edited history) is re-read, counted
    as a cache restart; cached_tokens counts what the appends did not prefill. A cohort
    whose shared slots run out re-reads its requests, as exact; after newer parameters
    are swapped in, the replies and log-probs are a re-reading session's under them."""
    model, cfg, params = tiny
    sampler = sampling.Sampler(cfg, None, seed=5, cache_segments=1)
    spec = sampling.RolloutSpec(1, 5, 0.0, stop_ids=STOPS)

    def session(keeps: bool):
        s = engine.open_session(
            sampler, "requests", params, 0, spec, key=0, width=4, prompt_tokens=16, total_tokens=40
        )
        s.keeps = keeps
        return s

    live, reread = session(True), session(False)
    tight = session(True)  # its cohort's slots run out after the first turn
    tight.slots = 32
    contexts = {
        e: tok(q, add_special_tokens=False)["input_ids"]
        for e, q in enumerate(["1+2=", "12*3=", "7-4="])
    }
    cached, newer = 0, jax.tree.map(lambda x: x * 1.1, params)
    for turn in range(3):
        replies = {}
        for s in (live, reread, tight):
            if turn == 2:  # newer parameters: the cohort's cache is computed again by them
                s.swap(newer, 1)
            for e, ids in contexts.items():
                s.ask(e, ids, 5)
            assert sorted(s.run_chunk()) == sorted(contexts)
            replies[s] = {e: s.answer(e)[0] for e in contexts}
        for e, ids in contexts.items():
            got, again = replies[live][e], replies[reread][e]
            assert got[0] == again[0] == replies[tight][e][0], (turn, e)
            assert turn == 2 or got[0] == hf_greedy(model, ids)
            np.testing.assert_allclose(got[1], again[1], atol=1e-5)
            assert got[2] == again[2] == [int(turn == 2)] * len(got[0])
            cached += (len(ids) - 3) * (turn > 0 and e != 2)  # less its message, a reply id
            contexts[e] = ids + got[0] + [7 + turn, 18]  # the next message's ids
        if turn == 0:  # episode 2 edits its history: re-read from then on
            contexts[2] = contexts[2][1:]
        if turn == 1:
            live.forget(1), reread.forget(1), tight.forget(1)
            del contexts[1]
    assert live.stats["cache_restarts"] == 1 and reread.stats["cached_tokens"] == 0
    assert live.stats["cached_tokens"] == cached and tight.stats["cached_tokens"] == 0
    assert tight.stats["prefill_tokens"] == reread.stats["prefill_tokens"]


def test_static_requests_prefill_a_shared_first_request_once(tiny, tok):
    """A cohort whose first requests come in equal pairs (an agent's G=2 episodes of one
    example) prefills each pair's context once, for 2 rows (the start program reads 2 of
    the 4 rows); each reply is still HF's greedy reply to its own context and the
    episodes keep their rows: the next round's appends answer each episode's own
    conversation. The pairing is by equal contexts, in any order of asking, and the
    rows to prefill stay a multiple of the mesh's batch."""
    model, cfg, params = tiny
    sampler = sampling.Sampler(cfg, None, seed=5, cache_segments=1)
    spec = sampling.RolloutSpec(1, 5, 0.0, stop_ids=STOPS)
    s = engine.open_session(
        sampler, "requests", params, 0, spec, key=0, width=4, prompt_tokens=16, total_tokens=40
    )
    a, b = (tok(q, add_special_tokens=False)["input_ids"] for q in ("1+2=", "12*3="))
    contexts = {0: a, 1: b, 2: list(a), 3: list(b)}
    for turn in range(2):
        for e, ids in contexts.items():
            s.ask(e, ids, 5)
        assert sorted(s.run_chunk()) == [0, 1, 2, 3]
        for e, ids in contexts.items():
            got = s.answer(e)[0][0]
            assert got == hf_greedy(model, ids), (turn, e)
            contexts[e] = ids + got + [7 + e, 18]  # each episode's own next message
    starts = [key[1][0] for key in sampler.traces if key[0] == "start"]
    assert starts == [2] and s.stats["cached_tokens"] > 0
    fresh = {0: [1], 1: [2], 2: [1], 3: [2], 4: [1], 5: [2], 6: [1], 7: [2]}
    order = ([0, 2, 4, 6, 1, 3, 5, 7], [[1]] * 4 + [[2]] * 4, 4)
    assert serve._shared_prefill(fresh, 8, 1) == order
    assert serve._shared_prefill(fresh, 8, 4)[2] == 2  # 8 / 4 = 2 rows: not a multiple of 4
    assert serve._shared_prefill({0: [1], 1: [1], 2: [2]}, 4, 1)[2] == 1


def test_a_requests_session_draws_with_its_own_seed(tiny, tok):
    """Sampled (temperature 1), a requests session on the static sampler draws the same
    replies on the same seed and others on another (`seed=`: each rollout worker's part
    of a step's episodes has its own, `workers.turns.part_seed`), in its cohort's decode
    and in a re-read n = 2 request alike."""
    from jaxrl_llm.workers.turns import part_seed

    _, cfg, params = tiny
    sampler = sampling.Sampler(cfg, None, seed=5, cache_segments=1)
    spec = sampling.RolloutSpec(1, 5, 1.0, stop_ids=STOPS)
    contexts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("1+2=", "12*3=", "7-4=")]

    def replies(seed):
        s = engine.open_session(
            sampler, "requests", params, 0, spec, key=3, width=4, prompt_tokens=16,
            total_tokens=40, seed=seed,
        )  # fmt: skip
        for e, ids in enumerate(contexts):
            s.ask(e, ids, 5, n=1 + (e == 2))
        assert sorted(s.run_chunk()) == [0, 1, 2]
        return [[choice[0] for choice in s.answer(e)] for e in range(3)]

    first = replies(None)
    assert part_seed(5, 0) == 5 and replies(5) == first
    other = replies(part_seed(5, 1))
    assert other[:2] != first[:2] and other[2] != first[2]  # the cohort's, the re-read's


def test_the_paged_engine_swaps_parameters_mid_turn(tiny, tok):
    """Partial rollouts on the engine (`refresh`): newer parameters (version 4) handed
    over before the third decode chunk are swapped in while replies are being drawn.
    Every drawn token's behaviour log-prob equals the teacher-forced one under the
    parameters of the version it records (1e-5); some episodes hold tokens of both,
    versions never decrease along an episode, and some reply spans the two; each
    response's `policy_version` is its oldest drawn token's, each row's too."""
    _, cfg, p0 = tiny
    p1 = jax.tree.map(lambda x, y: x + 0.5 * y, p0, models.init_params(cfg, seed=4))
    agents, spec = agent_rollout(
        cfg, tok, f"{AGENTS}:two_turns", batch_size=3, G=2, temperature=0.8
    )
    agents.sampler = sampling.PagedSampler(
        cfg, None, seed=5, page_size=4, chunk_steps=2, prefill_chunk=8
    )
    calls, replies, answer = [], [], agents.reply

    def refresh():
        calls.append(len(calls))
        return (p0, 3) if len(calls) < 2 else (p1, 4)

    def recorded(episode, body, reply, ask, drawn, episodes, play):
        def captured(status, response):
            replies.append(([d[2] for d in drawn], response["jaxrl_llm"]["policy_version"]))
            reply(status, response)

        answer(episode, body, captured, ask, drawn, episodes, play)

    agents.reply = recorded
    examples = [{"question": "1+2="}, {"question": "12*3="}, {"question": "7-4="}]
    try:
        out, _, v = agents(p0, types.SimpleNamespace(examples=examples), 3, refresh=refresh)
    finally:
        agents.close()
    loss_mask = np.asarray(out.loss_mask)
    np.testing.assert_array_equal(v >= 0, loss_mask)
    teacher = rl.make_logprob_fn(cfg, spec, chunk_size=8)
    want = np.where(v == 4, np.asarray(teacher(p1, out)), np.asarray(teacher(p0, out)))
    assert np.abs(want - np.asarray(out.logprobs))[loss_mask].max() <= 1e-5
    assert any((row == 3).any() and (row == 4).any() for row in v)
    assert all(np.all(np.diff(row[row >= 0]) >= 0) for row in v)
    assert np.asarray(out.policy_version).tolist() == [3] * 6
    assert len(replies) == 12 and any({3, 4} <= set(d[0]) for d, _ in replies)
    for drawn, version in replies:
        assert version == min(d[0] for d in drawn) and drawn[0] == sorted(drawn[0])


def test_64_concurrent_episodes_are_batched(tiny, tok):
    """64 episodes of two requests each: the sampler sees two calls of 64 requests, not
    one request at a time; a request's temperature is counted as ignored. The gap that
    ends a gather is long (`wait_s`): a gather ends as soon as every running episode has
    a request waiting, and 64 agent processes started on a loaded machine (the other
    test worker compiling) can leave more than a second between two of them."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(cfg, tok, f"{AGENTS}:many", batch_size=32, G=2, wait_s=60.0)
    examples = [{"question": f"{i % 10}+{i // 10}="} for i in range(32)]
    try:
        _, scored, _ = agents(params, types.SimpleNamespace(examples=examples), 0)
    finally:
        agents.close()
    m = scored.metrics
    assert m["gateway/requests"] == 128 and m["gateway/sampler_calls"] == 2
    assert m["gateway/batch_max"] == 64 and m["gateway/batch_mean"] == 64
    assert m["gateway/temperature_ignored"] == 64 and scored.rewards.tolist() == [1.0] * 64


def test_episode_processes_inherit_the_clients_machinery(tiny, tok):
    """The launcher sends one request through the `openai` client before it forks, so an
    episode's process imports no module for its requests (hundreds otherwise: the
    client's lazily built modules and models, ~0.5 s of CPU each episode)."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(cfg, tok, f"{AGENTS}:imports", batch_size=2, G=1)
    examples = [{"question": "1+2="}, {"question": "3+4="}]
    try:
        _, scored, _ = agents(params, types.SimpleNamespace(examples=examples), 0)
    finally:
        agents.close()
    assert scored.metrics["gateway/requests"] == 4
    assert scored.rewards.tolist() == [0.0, 0.0]


def test_an_openai_client_agent_trains_through_the_gateway(tmp_path):
    """Two GRPO steps in rollout.mode='overlap' whose rollouts are the agent's episodes
    (played by the rollout thread): rewards from the agent, gateway metrics logged, a
    finite loss, staleness within 1."""
    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards, c.rollout.mode = {}, "overlap"
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.agent.entry, c.agent.max_total_tokens = f"{AGENTS}:two_turns", 24
    c.rollout.cache_segments, c.model.scan_layers = 1, True
    c.algo.beta = 0.0
    c.train.log_every = 1
    train.train(c, str(tmp_path / "run"))
    rows = [r for r in metrics.read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["gateway/requests"] == 16 and r["gateway/sampler_calls"] >= 2
        assert np.isfinite(r["loss/total"]) and r["gateway/errors"] == 0
        assert r["rollout/staleness_max"] <= 1


@pytest.mark.parametrize("mode", ["sync", pytest.param("split", marks=pytest.mark.slow)])
def test_an_agent_trains_through_the_gateway_on_the_paged_engine(mode, tmp_path, monkeypatch):
    """Two GRPO steps with rollout.engine='paged' in 'sync' and 'split' ('overlap', the
    rollout thread one version behind on the training mesh, is the other trainer runs of
    this file; split on 4 rollout devices): the episodes' second
    requests read their rows' caches; in split, staleness is within 1 and every
    sampled token's recorded version is the one its rollout started with (-1 elsewhere).
    Split takes partial rollouts: step 1's play (started by version 0) waits at its first
    read of the newest parameters for version 1 and swaps it in; a token's version is its
    rollout's or a newer one, up to the step's, never decreasing along a row, and step 1
    holds both."""
    from jaxrl_llm.rollout.thread import Handoff, PlayerStream

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards, c.rollout.engine = {}, "paged"
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.agent.entry, c.agent.max_total_tokens = f"{AGENTS}:two_turns", 24
    c.rollout.paged.page_size, c.rollout.paged.prefill_chunk = 4, 8
    c.algo.beta = 0.0
    c.train.log_every = 1
    c.rollout.mode = mode
    if mode == "split":
        c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
        c.rollout.partial, c.rollout.paged.chunk_steps = True, 2  # a reply spans 2 chunks
    take, taken, run_chunk, newest, playing = (
        Handoff.take,
        [],
        PlayerStream.run_chunk,
        Handoff.newest,
        [],
    )

    def tracked_run_chunk(self):  # plays the oldest queued step
        assert isinstance(self.player.sampler, sampling.PagedSampler)
        playing[:] = [self.queued[0], self.version, 0]
        return run_chunk(self)

    def held_newest(self):  # step 1's first read waits for the learner's version 1
        step, version, reads = playing
        playing[2] = reads + 1
        if (step, version, reads) == (1, 0, 0):
            self.wait(lambda v: v >= 1, timeout=120)
        return newest(self)

    def checked_take(self, t):
        item = take(self, t)
        v, loss_mask = item.token_versions, np.asarray(item.out.loss_mask)
        if mode == "split":  # partial: newer parameters swapped in while it plays
            assert np.all((v[loss_mask] >= item.version) & (v[loss_mask] <= t))
            assert all(np.all(np.diff(row[row >= 0]) >= 0) for row in v)
            assert (t, item.version) == (0, 0) or {0, 1} <= set(v[loss_mask].tolist())
            v = np.where(loss_mask, item.version, v)
        np.testing.assert_array_equal(v, np.where(loss_mask, item.version, -1))
        assert loss_mask.any(axis=1).all()
        taken.append(t)
        return item

    monkeypatch.setattr(Handoff, "take", checked_take)
    monkeypatch.setattr(PlayerStream, "run_chunk", tracked_run_chunk)
    monkeypatch.setattr(Handoff, "newest", held_newest)
    train.train(c, str(tmp_path / "run"))
    rows = [r for r in metrics.read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert len(rows) == 2
    assert taken == ([] if mode == "sync" else [0, 1])
    for r in rows:
        assert r["gateway/requests"] == 16 and r["gateway/cached_tokens"] > 0
        assert np.isfinite(r["loss/total"]) and r["gateway/errors"] == 0
        if mode != "sync":
            assert r["rollout/staleness_max"] <= 1
            assert 0 <= r["rollout/token_staleness_mean"] <= r["rollout/staleness_max"]


# `agent.entry=verifiers:<taskset>`: a verifiers 0.4.0 environment (tests/
# vf_tasks_for_tests.py, written with verifiers' own classes) through the gateway.


def test_verifiers_env_episodes_are_exact_and_scored_by_its_rubric(tiny, tok):
    """Two-turn verifiers episodes (the env answers "7" between the model's replies,
    through verifiers' interaction and its relaunch of the conversation): each
    trajectory equals the reference loop, no request is a rewrite, and each reward is
    the rubric (task reward on the last reply + 0.5 x the env's on the first) computed here
    on the decoded replies."""
    tasks = pytest.importorskip("vf_tasks_for_tests")  # verifiers (the test extra)
    model, cfg, params = tiny
    agents, _ = agent_rollout(cfg, tok, "verifiers:vf_tasks_for_tests", batch_size=4, G=2)
    examples = [{"task": i} for i in range(4)]
    batch = types.SimpleNamespace(examples=examples)
    try:
        out, scored, _ = agents(params, batch, 1)
        evaluated = agents.evaluate(params, [batch], pass_k=1, temperature=1.0, step=1)
    finally:
        agents.close()
    tokens, lengths, prompt, prompt_mask, loss_mask = (
        np.asarray(x)
        for x in (out.tokens, out.lengths, out.prompt_tokens, out.prompt_mask, out.loss_mask)
    )
    m = scored.metrics
    assert m["gateway/requests"] == 16 and m["gateway/retokenized"] == 0
    assert m["gateway/errors"] == 0
    replied = [[] for _ in tasks.QUESTIONS]
    references = [
        hf_turns(model, tok, q, False, replies=replied[i]) for i, q in enumerate(tasks.QUESTIONS)
    ]
    for row in range(8):
        reference = references[row // 2]  # greedy: the G episodes of a task are equal
        got = prompt[row][prompt_mask[row]].tolist() + tokens[row, : lengths[row]].tolist()
        assert got == reference, (row, got, reference)
        replies = _replies(tok, tokens[row, : lengths[row]], loss_mask[row, : lengths[row]])
        assert len(replies) == 2, (row, replies)
        expected = 0.5 * tasks.reply_reward(replies[0]) + tasks.reply_reward(replies[1])
        assert scored.rewards[row] == expected, (row, replies)
    assert len(set(scored.rewards.tolist())) > 1, scored.rewards  # the rubric varies
    # Held-out evaluation: one greedy episode per example through the same path; the
    # reference's rewards, the rubric on its decoded replies.
    text = [[tok.decode(ids, skip_special_tokens=True) for ids in r] for r in replied]
    reference = [0.5 * tasks.reply_reward(a) + tasks.reply_reward(b) for a, b in text]
    assert evaluated["eval/reward_mean"] == pytest.approx(np.mean(reference))
    assert evaluated["eval/pass@1"] == pytest.approx(np.mean(np.array(reference) > 0.5))
    assert evaluated["eval/num_prompts"] == 4 and evaluated["eval/turns_mean"] == 2
    assert evaluated["eval/failed_frac"] == 0


def test_verifiers_episode_reward_and_failure_without_a_model():
    """The adapter alone, the gateway's HTTP server answered by a fixed reply ("12", then
    " 3 "): a verifiers episode's reward is its rubric on those replies (0.5 x 2 + 1),
    and an episode whose env raises ends as an error naming verifiers' own message."""
    pytest.importorskip("verifiers.v1")
    from jaxrl_llm.gateway.server import Server

    server = Server("verifiers:vf_tasks_for_tests", {"failing": True})
    try:
        futures = server.run_episodes([{"task": 0}, {"task": 4}], 60)
        seen = []
        while not all(f.done() for f in futures.values()) or not server.requests.empty():
            try:
                _, body, reply = server.requests.get(timeout=0.1)
            except Exception:  # queue.Empty
                continue
            seen.append([m["content"] for m in body["messages"]])
            text = "12" if len(body["messages"]) == 1 else " 3 "
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            reply(
                200,
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [choice],
                },
            )
        done, failed = (futures[e].result() for e in sorted(futures, key=int))
    finally:
        server.close()
    assert seen == [["1+2="], ["1+2=", "12", "7"]]
    assert done == (0.5 * 2 + 1.0, "", "done")
    assert failed[0] is None and failed[2] == "error"
    assert "verifiers episode failed" in failed[1] and "the env gave up" in failed[1]


def _replies(tok, ids, loss) -> list[str]:
    """The model's turns (runs of loss-mask-1 tokens) decoded."""
    runs, current = [], []
    for t, keep in zip(ids.tolist(), loss.tolist(), strict=True):
        if keep:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    return [tok.decode(r, skip_special_tokens=True) for r in runs]


@pytest.mark.slow
def test_a_verifiers_env_trains_through_the_gateway(tmp_path):
    """Two GRPO steps (rollout.mode='overlap') whose rollouts are the verifiers env's
    episodes, evaluated at step 0 and at the end (eval/*, beside the rollout thread);
    agent.options (the taskset's `repeat`) are taken by the taskset's config."""
    pytest.importorskip("verifiers.v1")
    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards, c.rollout.mode = {}, "overlap"  # as the test above: its programs are reused
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.agent.entry, c.agent.max_total_tokens = "verifiers:vf_tasks_for_tests", 24
    c.agent.options = {"repeat": 2}
    c.eval.every, c.eval.num_prompts, c.eval.pass_k = 2, 4, 1  # at step 0 and step 2
    c.rollout.cache_segments, c.model.scan_layers, c.algo.beta = 1, True, 0.0
    c.train.log_every = 1
    train.train(c, str(tmp_path / "run"))
    logged = list(metrics.read_metrics(tmp_path / "run" / "metrics.jsonl"))
    rows = [r for r in logged if "loss/total" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["gateway/requests"] == 16 and r["gateway/errors"] == 0
        assert r["gateway/retokenized"] == 0 and np.isfinite(r["loss/total"])
    evals = {r["step"]: r for r in logged if "eval/reward_mean" in r}
    assert sorted(evals) == [0, 2], logged  # the initial policy's figure, then the trained one
    for r in evals.values():
        assert r["eval/num_prompts"] == 4 and r["eval/turns_mean"] == 2
        assert r["eval/failed_frac"] == 0 and r["eval/reward_mean"] >= 0


@pytest.mark.parametrize(
    "entry, options, message",
    [
        ("verifiers:no_such_taskset", {}, "no verifiers taskset 'no_such_taskset'"),
        ("verifiers:vf_tasks_for_tests", {"repeats": 2}, "agent.options for verifiers"),
        ("verifiers:textarena", {"game": "Chess-v0"}, "Input should be 'Wordle-v0'"),
    ],
)
def test_bad_verifiers_names_are_one_line(tmp_path_factory, entry, options, message):
    pytest.importorskip("verifiers.v1")
    from jaxrl_llm.config import ConfigError, validate

    c = tiny_config(make_model_dir(str(tmp_path_factory.mktemp("model"))))
    c.rewards, c.agent.entry, c.agent.options = {}, entry, options
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_verifiers_is_one_line(monkeypatch):
    """Without the package, agent.entry='verifiers:...' is one line naming what to install."""
    import sys

    from jaxrl_llm.gateway import agents

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    monkeypatch.delitem(sys.modules, "jaxrl_llm.gateway.verifiers_env", raising=False)
    with pytest.raises(ValueError, match=r"needs verifiers .*pip install verifiers==0.4.0"):
        agents.check("verifiers:textarena", {})


def test_tool_calls_in_the_model_formats():
    """Hermes / Qwen `<tool_call>` blocks and a Llama 3.1 JSON turn become OpenAI
    tool_calls; malformed ones stay in the content and are counted."""
    hermes = parse_tool_calls(
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "c"
    )
    assert hermes.content == "Let me add." and hermes.errors == 0
    call = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert hermes.calls == [{"id": "c_0", "type": "function", "function": call}]
    llama = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}')
    assert llama.content == "" and llama.calls[0]["function"]["arguments"] == '{"x": "y"}'
    bad = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call> and <tool_call>{oops</tool_call>'
    )
    assert bad.calls == [] and bad.errors == 2 and "{oops" in bad.content
    assert parse_tool_calls("just text").calls == []


def test_tools_render_through_the_chat_template(tok):
    """A request's `tools` reach the chat template (`tools=`); the message contents are
    tokenized as text, the template's markers as its own."""
    saved = tok.chat_template
    tok.chat_template = (
        "{% if tools %}{% for t in tools %}{{ t.function.name }}+{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.content }}={% endfor %}"
    )
    try:
        chat = envs.Renderer(tok, use_chat=True)
        tools = [{"type": "function", "function": {"name": "12", "parameters": {}}}]
        with_tools = chat.prompt([{"role": "user", "content": "3+4"}], tools=tools)
        without = chat.prompt([{"role": "user", "content": "3+4"}])
    finally:
        tok.chat_template = saved
    assert tok.decode(with_tools) == "12+3+4=" and tok.decode(without) == "3+4="


@pytest.mark.parametrize(
    "entry, options, message",
    [
        ("missing_file.py:run", {}, "agent.entry: agent 'missing_file.py:run'"),
        (f"{AGENTS}:openai", {}, "is not an async function"),
        (f"{AGENTS}:two_turns", {"tries": 2}, "agent.options"),
        (f"{AGENTS}:two_turns", {}, "algo.routing_replay='rollout': the gateway"),
    ],
)
def test_bad_agent_names_are_one_line(tmp_path_factory, entry, options, message):
    from jaxrl_llm.config import ConfigError, validate

    c = tiny_config(make_model_dir(str(tmp_path_factory.mktemp("model"))))
    c.rewards, c.agent.entry, c.agent.options = {}, entry, options
    if entry.endswith(":two_turns") and not options:  # a fine agent, replay refused
        c.algo.routing_replay = "rollout"
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    assert message in str(err.value) and "\n" not in str(err.value)


class Adder(envs.ToolEnv):
    """An environment with one tool; the answer 3 wins."""

    tools = {"add": lambda a, b: a + b}

    def answer(self, text):
        return float(text.strip() == "3")


def test_env_tools_are_called_in_the_model_format():
    """ToolEnv: well-formed calls run and answer tool messages; a malformed call is an
    error observation, counted; a turn without a call is the final answer."""
    env = Adder()
    step = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert step.observation == [{"role": "tool", "content": "3"}] and not step.done
    assert step.info == {"tool_calls": 1.0}
    step = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    assert step.observation[0]["content"].startswith("error: no tool 'mul'")
    step = env.step("<tool_call>{add(1, 2)}</tool_call>")
    assert step.observation.startswith("error: 1 malformed") and step.info["tool_errors"] == 1
    step = env.step("3")
    assert step.done and step.reward == 1.0


# Hostile input (docs/agents.md#security): a key per episode, agents in processes of
# their own, bounded requests.


def test_an_episode_cannot_post_into_another(tiny, tok):
    """Two concurrent episodes, each posting a conversation into the other's URL with its
    own key and into its own without one: all four are refused (401) and counted, and
    neither record is touched (no rewrite; one answered request each)."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(cfg, tok, f"{AGENTS}:intrude", batch_size=1, G=2, wait_s=30)
    try:
        _, scored, _ = agents(params, types.SimpleNamespace(examples=[{"question": "1+2="}]), 0)
    finally:
        agents.close()
    m = scored.metrics
    assert scored.rewards.tolist() == [1.0, 1.0] and m["gateway/refused"] == 4
    assert m["gateway/retokenized"] == 0 and m["gateway/requests"] == 2


def _below(pid: int) -> list[str]:
    """Command lines of the processes below `pid`."""
    from jaxrl_llm.verifiers import reaper

    lines = []
    for p in reaper.descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


def test_hostile_agents_cost_their_episode_only(tmp_path):
    """Two GRPO steps of 2 prompts x 2 episodes whose agents, in turn, block their thread
    for an hour, call sys.exit, raise KeyboardInterrupt, end their process with
    os._exit(0), and fork a copy that lives on: each fails its own episode (a timeout
    for the first, errors for the next three, the fork's episode scores 1), the run
    finishes both steps and checkpoints, and no agent process is left."""
    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards, c.rollout.batch_size, c.rollout.num_generations = {}, 2, 2
    c.mesh.fsdp, c.mesh.tensor = 2, 4
    c.rollout.max_new_tokens, c.rollout.cache_segments, c.algo.beta = 4, 1, 0.0
    claims = tmp_path / "claims"
    claims.mkdir()
    c.agent.entry, c.agent.max_total_tokens = f"{AGENTS}:misbehave", 24
    c.agent.options, c.agent.timeout_s = {"claims": str(claims)}, 5.0
    c.train.log_every = 1
    train.train(c, str(tmp_path / "run"))
    rows = [r for r in metrics.read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert len(rows) == 2
    first, second = rows
    assert first["gateway/timeouts"] == 1 and first["gateway/errors"] == 3
    assert first["gateway/agent_exits"] == 1  # os._exit: ended without a reward
    assert second["gateway/errors"] == second["gateway/timeouts"] == 0
    assert second["reward/mean"] == 1.0
    assert (tmp_path / "run" / "checkpoints").is_dir()
    forked = int((claims / "forked").read_text())
    try:
        with open(f"/proc/{forked}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except FileNotFoundError:
        pass  # dead and reaped
    assert not [line for line in _below(os.getpid()) if "gateway.launcher" in line]


def test_bad_requests_are_each_a_400_to_their_episode(tiny, tok):
    """On the paged engine: `stop: 5`, `stop: [null]`, n=0, max_tokens=0, n=true and a
    content that is an object are each a 400, a body over agent.max_request_bytes a 413
    (counted), to that episode only; OpenAI's tool-call message (content null) is
    accepted back, and two concurrent requests of one episode are both answered."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(
        cfg, tok, f"{AGENTS}:bad_requests", batch_size=1, G=2, max_request_bytes=4096
    )
    agents.sampler = sampling.PagedSampler(
        cfg, None, seed=5, page_size=4, chunk_steps=4, prefill_chunk=8
    )
    try:
        _, scored, _ = agents(params, types.SimpleNamespace(examples=[{"question": "1+2="}]), 0)
    finally:
        agents.close()
    m = scored.metrics
    assert scored.rewards.tolist() == [1.0, 1.0], scored.details.first_error
    assert m["gateway/too_large"] == 2 and m["gateway/errors"] == 0
    assert m["gateway/requests"] == 2 * 3


def test_queued_requests_of_ended_episodes_are_dropped():
    """A request still queued when its episode has ended is answered 404 and counted,
    never handed to the model."""
    from jaxrl_llm.gateway.server import Server

    server = Server(f"{AGENTS}:two_turns")
    answered = []
    try:
        server.requests.put(("7", {"messages": []}, lambda *a: answered.append(a)))
        with pytest.raises(queue.Empty):
            server.requests.get(timeout=0.05)
    finally:
        server.close()
    assert answered[0][0] == 404 and server.take_counts()["dropped"] == 1


def test_the_batcher_waits_for_every_running_episode_or_a_gap():
    """`gather` returns at once when every running episode has a request, else after a
    gap of wait_s with no new one; with every episode ended and nothing queued, []."""
    server = types.SimpleNamespace(requests=queue.Queue())
    for e in ("0", "1"):
        server.requests.put((e, {}, None))
    # 3 episodes, one ended: both running ones have asked; a 60 s gap is not waited for.
    got = AgentRollout.gather(3, ["ended"], server, wait_s=60.0)
    assert [r[0] for r in got] == ["0", "1"]

    def post_later():  # the second within the gap, the third long after it
        time.sleep(0.1)
        server.requests.put(("1", {}, None))
        time.sleep(3.0)
        server.requests.put(("2", {}, None))

    server.requests.put(("0", {}, None))
    poster = threading.Thread(target=post_later)
    poster.start()
    try:
        got = AgentRollout.gather(3, [], server, wait_s=1.0)
        assert [r[0] for r in got] == ["0", "1"]  # not waiting for episode 2
    finally:
        poster.join()
    assert AgentRollout.gather(3, [], server, wait_s=1.0)[0][0] == "2"
    assert AgentRollout.gather(3, [1, 2, 3], server, wait_s=1.0) == []


def test_a_tool_call_message_with_null_content_is_read(tok):
    """The assistant message the gateway returns for a tool call (content null,
    tool_calls) renders through a chat template when sent back in a rewritten history."""
    from jaxrl_llm.gateway import Episode, completions

    saved = tok.chat_template
    tok.chat_template = "{% for m in messages %}{{ m.content }}={% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    sent = [
        {"role": "user", "content": "3+4"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "7"}]},
    ]
    try:
        ids = Episode(envs.Renderer(tok, use_chat=True)).context(completions.messages(sent))
    finally:
        tok.chat_template = saved
    assert tok.decode(ids) == "3+4==7="


def test_an_agent_reward_must_be_a_float32_number(tiny, tok):
    """The string "0.75" is not a reward, and 1e300 overflows float32: each fails its
    episode (reward 0, an error naming the value); 0.5 and numpy's 2 are rewards."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(cfg, tok, f"{AGENTS}:returns", batch_size=4, G=1)
    examples = [{"value": "0.75"}, {"value": 1e300}, {"value": 0.5}, {"value": np.int64(2)}]
    try:
        _, scored, _ = agents(params, types.SimpleNamespace(examples=examples), 0)
    finally:
        agents.close()
    assert scored.rewards.tolist() == [0.0, 0.0, 0.5, 2.0]
    assert scored.metrics["gateway/errors"] == 2
    assert "returned str '0.75', not a number" in scored.details.messages[0]
    assert "1e+300, not a finite float32" in scored.details.messages[1]


def test_rows_cut_to_the_width_are_counted():
    """Two episodes of a group whose first messages differ share only their first
    token as prompt; the rest of each prompt fills the completion, so a record within
    the limits is cut to `width`, and `cut` counts the tokens dropped (numpy reference:
    the records themselves)."""
    from jaxrl_llm.gateway import Episode, group_rows

    eps = []
    for prompt, drawn in [([1, 2, 3, 4], [9, 9, 9]), ([1, 5, 6], [8, 8])]:
        ep = Episode(renderer=None)
        ep.ids, ep.loss = prompt + drawn, [False] * len(prompt) + [True] * len(drawn)
        ep.logprobs, ep.versions = [0.0] * len(ep.ids), [0] * len(ep.ids)
        eps.append(ep)
    rows = group_rows(eps, prompt_width=4, width=4, pad_id=0)
    assert rows["prompt_tokens"][:, -1].tolist() == [1, 1]
    assert rows["tokens"].tolist() == [[2, 3, 4, 9], [5, 6, 8, 8]]
    assert rows["cut"].tolist() == [len(eps[0].ids) - 1 - 4, 0]
    assert rows["unshared"].tolist() == [True, True]


def test_unshared_prompts_are_counted_and_warned_once(tiny, tok, tmp_path, caplog):
    """Two steps of 2 prompts x 2 episodes, where the episodes of one prompt start with
    different messages: `gateway/prompt_not_shared` is 1 at each step, that prompt's rows
    share only `<bos>`-long prompts, and one warning line (at the first step, numbered as
    metrics.jsonl numbers it) names the cause."""
    _, cfg, params = tiny
    agents, _ = agent_rollout(
        cfg, tok, f"{AGENTS}:numbered", batch_size=2, G=2, options={"claims": str(tmp_path)}
    )
    examples = [{"question": "1+2=", "numbered": True}, {"question": "1+2="}]
    try:
        for step in (0, 1):
            out, scored, _ = agents(params, types.SimpleNamespace(examples=examples), step)
            assert scored.metrics["gateway/prompt_not_shared"] == 1.0
    finally:
        agents.close()
    prompt = np.asarray(out.prompt_mask).sum(axis=1)
    assert prompt[0] == prompt[1] == 1 and prompt[2] == prompt[3] > 1
    lines = [r.getMessage() for r in caplog.records if "prompt_not_shared" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("step 1: agent.entry: the 2 episodes of 1")
    assert "must start with the same messages for the prompt to be shared" in lines[0]


def _completion(text: str) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}


def test_waiting_for_the_model_does_not_count_against_the_timeout(tmp_path):
    """With agent.timeout_s = 1 and every request held 2 s before its answer (a slow or
    compiling trainer), a two-request agent still ends with its reward; an agent that
    blocks after its answer still times out, about 1 s after that answer."""
    from jaxrl_llm.gateway.server import Server

    server = Server(f"{AGENTS}:two_turns")
    try:
        (future,) = server.run_episodes([{"question": "1+2="}], 1.0).values()
        for _ in range(2):
            _, _, reply = server.requests.get(timeout=60)
            time.sleep(2.0)
            assert not future.done()
            reply(200, _completion("3"))
        assert future.result(timeout=30) == (1.0, "", "done")
    finally:
        server.close()
    claims = tmp_path / "claims"
    claims.mkdir()
    server = Server(f"{AGENTS}:misbehave", {"claims": str(claims)})  # episode 0 sleeps
    try:
        (future,) = server.run_episodes([{"question": "1+2="}], 1.0).values()
        _, _, reply = server.requests.get(timeout=60)
        time.sleep(2.0)
        assert not future.done()
        reply(200, _completion("3"))
        answered = time.monotonic()
        result = future.result(timeout=30)
        assert result[0] is None and result[2] == "timeout"
        assert time.monotonic() - answered < 10
    finally:
        server.close()
    assert not [line for line in _below(os.getpid()) if "gateway.launcher" in line]


def test_closing_with_a_request_in_flight_raises_nothing():
    """A run that stops while an agent waits on a request closes the gateway without an
    error of its own (which would hide the run's): the request is answered 503, the
    episode ends as an error, its process is gone."""
    from jaxrl_llm.gateway.server import Server

    server = Server(f"{AGENTS}:two_turns")
    try:
        futures = server.run_episodes([{"question": "1+2="}], 60)
        server.requests.get(timeout=60)  # never answered
    finally:
        server.close()
    (result,) = [f.result(timeout=10) for f in futures.values()]
    assert result[0] is None and result[2] == "error"
    assert not [line for line in _below(os.getpid()) if "gateway.launcher" in line]

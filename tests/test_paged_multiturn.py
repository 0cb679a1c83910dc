"""Multi-turn rollouts on the paged engine (`envs.play` on a `PagedSampler`) against the static turn
loop (`envs.play`), the trainer's teacher-forced log-probs, and a 2-step training run."""

import os
import time

import numpy as np
import pytest
from tiny_run import TOKENIZER, make_model_dir, tiny_config, tiny_model_config

from jaxrl_llm import envs, models, rl, sampling
from jaxrl_llm.models import builtin
from jaxrl_llm.sampling.engine import open_session

TESTS = os.path.dirname(os.path.abspath(__file__))
SLEEPY = os.path.join(TESTS, "envs_for_tests.py") + ":Sleepy"
# Trajectories that end after 1, 2 and 3 actions (done), on a long observation, and on
# max_turns; observations of different lengths; turns that end on a stop id or on the
# turn budget (the tiny model draws 20 or 29 at some steps, not at others).
EXAMPLES = [
    {"question": "1+2=", "turns": 1},
    {"question": "12*3+45=", "turns": 2},
    {"question": "7=", "turns": 6},
    {"question": "(8-9)/3=", "turns": 3},
    {"question": "3*3=", "turns": 9, "obs_chars": [1, 3, 2]},
]
SETTINGS = envs.TurnSettings(
    max_turns=4, turn_tokens=6, max_total_tokens=40, stop_ids=(20, 29, 14), end_of_turn_ids=(29,)
)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_model_config(vocab_size=33, max_position_embeddings=256)
    tok = builtin.load_tokenizer(TOKENIZER)
    with envs.EnvPool(SLEEPY, {"delay_s": 0.0}, workers=2, lanes=2) as pool:  # steps at once
        yield cfg, models.init_params(cfg, seed=3), tok, pool


@pytest.fixture(scope="module")
def small_engine(setup):
    """3 slots over 18 pages of 4 tokens (the tests that share it compile its programs
    once)."""
    return sampling.PagedSampler(
        setup[0], seed=5, slots=3, pages=18, page_size=4, chunk_steps=4, prefill_chunk=8
    )


def play(setup, engine, examples=EXAMPLES, G=2, temperature=0.0, params=None, refresh=None):
    cfg, own, tok, pool = setup
    renderer = envs.Renderer(tok, use_chat=False)
    trajs, observations = pool.reset(examples)
    ids, mask = sampling.pad_prompts([renderer.prompt(o) for o in observations], 0)
    trajs, _ = envs.replicate(trajs, observations, G)
    spec = sampling.RolloutSpec(
        G, SETTINGS.turn_tokens, temperature, stop_ids=SETTINGS.end_of_turn_ids
    )
    player = envs.play  # one turn loop: the engine it is given decides
    out, turns = player(
        engine,
        own if params is None else params,
        ids,
        mask,
        spec,
        SETTINGS,
        pool,
        trajs,
        renderer,
        tok,
        step=1,
        version=3,
        refresh=refresh,
    )
    return out, turns, [t.end for t in trajs], spec


def test_greedy_trajectories_equal_the_static_turn_loop(setup):
    """Temperature 0: every row's tokens, masks, lengths, finish reason, log-probs (1e-5),
    `Turns` and trajectory end equal the static turn loop's, with 8 slots for 10 rows over
    a pool of 17 pages (one trajectory's worth and a page): rows wait for slots, park on
    their environments with their pages, are evicted while parked and preempted while
    decoding, and come back by appending or by recompute (of the whole sequence, or of the
    completion only, on the prompt's pages it kept)."""
    cfg, params, _, _ = setup
    static = sampling.Sampler(cfg, seed=5, cache_segments=1)
    ref, ref_turns, ref_ends, spec = play(setup, static)
    assert sorted(set(ref_ends)) == ["done", "long_observation", "max_turns"]
    # The static loop's appends round the cache's bound up to a bucket (holes after the
    # observations): its decodes start at bucket lengths only.
    starts = [k[2] for k in static.traces if k[0] == "decode"]
    assert len(starts) == SETTINGS.max_turns, starts
    assert all(e == sampling.bucket_length(e, 4) for e in starts), starts
    assert len(set(np.asarray(ref.lengths).tolist())) >= 4
    engine = sampling.PagedSampler(
        cfg, seed=5, slots=8, pages=18, page_size=4, chunk_steps=3, prefill_chunk=8
    )
    out, turns, ends, _ = play(setup, engine)
    stats = engine.stats
    # Which rows are evicted or preempted depends on when their environments answer.
    # Evicted rows come back on their prompt's pages, which they keep.
    assert stats["evicted"] > 0 and stats["prompt_kept"] > 0, stats
    assert stats["peak_pages"] <= 17
    assert ends == ref_ends
    for name in (
        "tokens",
        "mask",
        "loss_mask",
        "lengths",
        "finish",
        "prompt_tokens",
        "prompt_mask",
        "policy_version",
    ):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)), err_msg=name
        )
    assert np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)).max() <= 1e-5
    assert out.tokens.shape[1] == SETTINGS.max_total_tokens
    assert turns.spans == ref_turns.spans
    for name in ("obs_tokens", "model_turns", "versions"):
        np.testing.assert_array_equal(getattr(turns, name), getattr(ref_turns, name), name)
    teacher = rl.make_logprob_fn(cfg, spec, chunk_size=16)(params, out)
    loss_mask = np.asarray(out.loss_mask)
    assert np.abs(np.asarray(teacher) - np.asarray(out.logprobs))[loss_mask].max() <= 1e-5


def test_sampled_logprobs_are_teacher_forced_and_keys_follow_the_row(setup, small_engine):
    """Temperature 0.8, 3 slots over a small pool: the behaviour log-probs of the sampled
    tokens equal the trainer's teacher-forced ones (1e-5), observation tokens have loss
    mask 0 and log-prob 0; and the first two prompts' rows draw the same trajectories
    when played without the others, a slot each (a row's keys follow its index and its
    token count, not its slot, chunk or neighbours), and the last two's rows as a part
    of the batch (`first_row`) draw their first turns as in it; a static session refuses
    a part at this temperature."""
    cfg, params, _, _ = setup
    out, turns, _, spec = play(setup, small_engine, EXAMPLES[1:], 2, 0.8)
    teacher = np.asarray(rl.make_logprob_fn(cfg, spec, chunk_size=16)(params, out))
    mask, loss_mask = np.asarray(out.mask), np.asarray(out.loss_mask)
    logprobs = np.asarray(out.logprobs)
    assert loss_mask.sum() > 40 and (mask & ~loss_mask).sum() > 10  # observations in it
    assert np.abs(teacher - logprobs)[loss_mask].max() <= 1e-5
    assert not logprobs[~loss_mask].any()
    assert max(turns.model_turns) >= 2
    roomy = sampling.PagedSampler(cfg, seed=5, page_size=4, chunk_steps=4, prefill_chunk=8)
    alone, alone_turns, *_ = play(setup, roomy, EXAMPLES[1:3], 2, 0.8)
    # A slot per row and the static cache's pages: every observation is appended to the
    # pages its row kept, none evicted.
    appended = sum(kind == "env" for spans in alone_turns.spans for kind, *_ in spans)
    assert roomy.stats["appends"] == appended > 0
    assert roomy.stats["evicted"] == roomy.stats["preempted"] == 0
    for name in ("tokens", "mask", "loss_mask", "lengths"):
        np.testing.assert_array_equal(
            np.asarray(getattr(alone, name)), np.asarray(getattr(out, name))[:4], err_msg=name
        )
    # The last two prompts as a part of the batch from row 4 (rollout workers sharing a
    # step, `workers.turns`): their rows' first turns as in the whole batch.
    cfg, own, tok, pool = setup
    _, observations = pool.reset(EXAMPLES[3:])
    renderer = envs.Renderer(tok, use_chat=False)
    ids, mask = sampling.pad_prompts([renderer.prompt(o) for o in observations], 0)
    part = (own, ids, mask, spec, SETTINGS, [True] * 4, 1, 3, None)
    session = open_session(small_engine, "turns", *part, first_row=4)
    first = {}
    while session.busy:
        first |= {r: session.result(r).tokens for r in session.run_chunk()}
    for r in range(4):
        _, _, end = turns.spans[4 + r][0]
        assert first[r] == np.asarray(out.tokens)[4 + r, :end].tolist(), r
    static = sampling.Sampler(cfg, seed=5)
    with pytest.raises(ValueError, match="static engine: its rows draw batch-wide"):
        open_session(static, "turns", *part, first_row=4)


@pytest.mark.slow
def test_moe_routes_equal_the_static_turn_loops(setup):
    """A tiny Qwen3-MoE at temperature 0, 4 slots for 6 rows over a pool of 17 pages
    (parked rows evicted, come back by recompute): `envs.play`'s routes [N, P + T, L, k]
    equal `envs.play`'s at every real token but each row's last (a prompt's from its
    shared prefill, a sampled token's from the step that feeds it, a turn's last token and
    the observation after it from the prefill that appends them, or a recompute's), and
    are -1 at padding, past the end and at each row's last drawn token (never fed here;
    the static loop feeds a stop token when other rows go on, and no log-prob the
    trainer scores reads that token's route)."""
    cfg = tiny_model_config(
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
        vocab_size=33,
        max_position_embeddings=256,
    )
    params = models.init_params(cfg, seed=1)
    examples = EXAMPLES[1:4]
    static = sampling.Sampler(cfg, seed=5, cache_segments=1)
    ref, ref_turns, *_ = play(setup, static, examples, params=params)
    engine = sampling.PagedSampler(
        cfg, seed=5, slots=4, pages=18, page_size=4, chunk_steps=3, prefill_chunk=8
    )
    out, turns, *_ = play(setup, engine, examples, params=params)
    assert engine.stats["evicted"] + engine.stats["preempted"] > 0, engine.stats
    assert max(turns.model_turns) >= 3 and turns.spans == ref_turns.spans
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    routes, expected = np.asarray(out.routes), np.asarray(ref.routes)
    assert routes.shape == expected.shape and routes.dtype == expected.dtype
    real = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.mask)], axis=1)
    fed = real.copy()
    fed[np.arange(len(real)), out.prompt_tokens.shape[1] + np.asarray(out.lengths) - 1] = False
    np.testing.assert_array_equal(routes[fed], expected[fed])
    assert (routes[fed] >= 0).all()
    assert (routes[~fed] == -1).all()


def test_a_swap_between_chunks_recomputes_every_row(setup, small_engine):
    """Partial rollouts (`refresh`): newer parameters (version 4) come after the third
    decode chunk and are swapped in; every sampled token's behaviour log-prob equals the
    teacher-forced one under the parameters of the version `Turns.versions` records for
    it (1e-5), some rows hold tokens of both versions, versions only grow along a row,
    observations record -1, and each row's policy_version is the one it started with."""
    cfg, p0, _, _ = setup
    p1 = models.init_params(cfg, seed=4)
    calls = []

    def refresh():
        calls.append(len(calls))
        return (p0, 3) if len(calls) < 3 else (p1, 4)

    out, turns, _, spec = play(setup, small_engine, EXAMPLES[1:], 2, 0.8, refresh=refresh)
    assert small_engine.stats["swaps"] == 1 and len(calls) >= 3
    loss_mask, v = np.asarray(out.loss_mask), turns.versions
    np.testing.assert_array_equal(v >= 0, loss_mask)
    assert np.all(np.asarray(out.policy_version) == 3)
    teacher = rl.make_logprob_fn(cfg, spec, chunk_size=16)
    want = np.where(v == 4, np.asarray(teacher(p1, out)), np.asarray(teacher(p0, out)))
    assert np.abs(want - np.asarray(out.logprobs))[loss_mask].max() <= 1e-5
    both = [(row[row >= 0] == 3).any() and (row == 4).any() for row in v]
    assert any(both)
    assert all(np.all(np.diff(row[row >= 0]) >= 0) for row in v)


def test_trainer_plays_environments_on_the_paged_engine(tmp_path):
    """rollout.engine='paged' with env.name in rollout.mode='sync': 2 GRPO steps of the
    tiny model on the 8-device mesh (fsdp 4 x tensor 2; 4 slots for 8 trajectories); the
    config check passes partial rollouts and routing replay with environments."""
    from jaxrl_llm import train
    from jaxrl_llm.config import checks_rewards, checks_rollout
    from jaxrl_llm.trainer.metrics import read_metrics

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards = {}
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.env.name, c.env.options = SLEEPY, {"turns": 2, "delay_s": 0.0}
    c.env.max_turns, c.env.max_total_tokens, c.env.workers = 2, 16, 1
    c.model.scan_layers, c.algo.beta = True, 0.0
    c.rollout.engine, c.rollout.paged.slots, c.rollout.paged.page_size = "paged", 4, 8
    c.rollout.paged.prefill_chunk = 16
    last = train.train(c, str(tmp_path / "run"))
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in logged] == [1, 2]
    assert np.isfinite(last["loss/total"]) and last["env/turns_mean"] >= 1
    c.rollout.mode, c.rollout.partial = "split", True
    checks_rollout.check_engine(c, 1)  # partial rollouts: `TurnSession.swap`
    c.algo.routing_replay = "rollout"  # the engine records the turns' MoE routes
    checks_rewards.check_env(c, c.algo)


@pytest.mark.parametrize("mode", ["overlap", pytest.param("split", marks=pytest.mark.slow)])
def test_the_rollout_thread_plays_environments_on_the_paged_engine(mode, tmp_path, monkeypatch):
    """rollout.engine='paged' with env.name in 'overlap' (the training mesh) and 'split' (4 rollout
    devices, partial rollouts): the rollout thread plays each step's trajectories on the
    engine (`envs.play` on a `PagedSampler`), within max_staleness 1 (reached while the
    learner is slow); each row's policy_version is the version the thread started it with,
    and every sampled token's recorded version is that one (split: that one or a newer one
    published while it played, up to the step's), -1 on observation tokens and past the end."""
    from test_env_async import env_config

    from jaxrl_llm import train
    from jaxrl_llm.rollout.thread import Handoff, RolloutThread
    from jaxrl_llm.trainer.metrics import read_metrics
    from jaxrl_llm.trainer.run import Run

    steps = 3
    c = env_config(make_model_dir(str(tmp_path / "model")), mode, steps)
    c.rollout.engine, c.rollout.paged.slots, c.rollout.paged.page_size = "paged", 4, 8
    c.rollout.paged.prefill_chunk = 16
    c.rollout.partial = mode == "split"
    take, step, seen, init = Handoff.take, Run.step, [], RolloutThread.__init__

    def checked_init(self, s, *args, **kw):
        assert isinstance(s.sampler, sampling.PagedSampler)
        init(self, s, *args, **kw)

    def checked_take(self, t):
        item = take(self, t)
        assert np.all(np.asarray(item.out.policy_version) == item.version)
        v, loss_mask = item.token_versions, np.asarray(item.out.loss_mask)
        assert v.shape == (8, 16)
        if mode == "split":  # partial: newer parameters swapped in while it plays
            assert np.all((v[loss_mask] >= item.version) & (v[loss_mask] <= t))
            v = np.where(loss_mask, item.version, v)
        np.testing.assert_array_equal(v, np.where(loss_mask, item.version, -1))
        assert loss_mask.any(axis=1).all()
        seen.append((t, item.version))
        return item

    def slow_learner(self, t):
        if t >= 1:
            time.sleep(0.5)  # the thread runs ahead to the bound
        return step(self, t)

    monkeypatch.setattr(RolloutThread, "__init__", checked_init)
    monkeypatch.setattr(Handoff, "take", checked_take)
    monkeypatch.setattr(Run, "step", slow_learner)
    train.train(c, str(tmp_path / "run"))
    logged = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    lags = [m["rollout/staleness_max"] for m in logged]
    assert len(lags) == steps and max(lags) <= 1 and lags[0] == 0
    assert [t - v for t, v in seen] == lags
    assert max(lags[1:]) == 1  # the slow learner let the thread run to the bound
    assert all(m["env/turns_mean"] >= 1 and np.isfinite(m["loss/total"]) for m in logged)
    assert all(0 <= m["rollout/token_staleness_mean"] <= m["rollout/staleness_max"] for m in logged)

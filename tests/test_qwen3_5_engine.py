"""The paged engine on a hybrid model (a tiny random Qwen3.5: Gated DeltaNet layers, whose
recurrent state each sequence keeps in a state row, beside full-attention layers, whose
keys/values go to the page pool) against the static sampler and teacher-forced
log-probs."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hf_reference import hf_model
from tiny_run import teacher_forced_logprobs

from jaxrl_llm import models, sampling
from jaxrl_llm.sampling.paged_turns import TurnSession

# A prompt longer than a prefill chunk (its state carried from chunk to chunk), one shorter
# than a page, and more rows than slots.
PROMPTS = [
    [5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [11],
    [40, 41, 42, 43, 44],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 20, 21, 22, 23, 24, 25, 26, 27, 28],
]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """(cfg, params) of `test_qwen3_5`'s tiny random dense Qwen3.5 (3 DeltaNet layers,
    then a full-attention one)."""
    d = tmp_path_factory.mktemp("qwen3_5")
    hf_model("qwen3_5", seed=3).save_pretrained(d)
    return models.load_hf(d, linear_chunk=4)


def engine(cfg, **kw):
    return sampling.PagedSampler(cfg, page_size=4, chunk_steps=4, prefill_chunk=8, **kw)


def state_bytes(cfg) -> int:
    """A sequence's recurrent state from the config: per DeltaNet layer the last K - 1
    convolution inputs (float32 here) and the [Hv, Dk, Dv] float32 recurrence."""
    conv = (cfg.linear_conv_kernel - 1) * cfg.linear_conv_dim
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return sum(cfg.linear_layers) * (conv + ssm) * 4


def test_greedy_equals_the_static_sampler(qwen3_5):
    """Temperature 0, 5 slots for 10 rows over a pool that forces preemptions (a
    preempted row's state is recomputed with its tokens so far: from its prompt's state
    where the prompt's pages stayed, else from zero): tokens,
    lengths and finish reasons equal the static sampler's, log-probs within rounding (the
    two prefill the prompts in different chunks)."""
    cfg, params = qwen3_5
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    spec = sampling.RolloutSpec(
        num_generations=2, max_new_tokens=12, temperature=0.0, stop_ids=(70, 86)
    )
    ref = sampling.Sampler(cfg).sample(params, ids, mask, spec)
    assert len(set(np.asarray(ref.lengths).tolist())) > 1  # rows leave at different steps
    paged = engine(cfg, slots=5, pages=14)
    out = paged.sample(params, ids, mask, spec)
    assert paged.stats["preempted"] > 0
    recomputed = paged.stats["prefills"] + paged.stats["appends"] - len(PROMPTS)
    assert recomputed > 0  # a row recomputed with its tokens
    for name in ("tokens", "mask", "lengths", "finish"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)), err_msg=name
        )
    assert np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)).max() <= 1e-4
    assert paged.stats["state_bytes_per_row"] == state_bytes(cfg) > 0


@pytest.mark.slow
def test_logprobs_equal_teacher_forced(qwen3_5):
    """Sampled rows (temperature 0.7, 2 per prompt: each starts from its prompt's state,
    prefilled once; the greedy test's engine, with preemptions): the behaviour log-probs
    equal one teacher-forced forward's within the static sampler's bounds
    (`test_qwen3_5`: 1e-4 on O(1) random weights, 1e-5 at the model's initialisation)."""
    cfg, params = qwen3_5
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    spec = sampling.RolloutSpec(
        num_generations=2, max_new_tokens=12, temperature=0.7, stop_ids=(7, 20, 33)
    )
    paged = engine(cfg, slots=5, pages=14)
    out = paged.sample(params, ids, mask, spec, step=1)
    m = np.asarray(out.mask)
    assert not m.all() and m.sum() > 40
    ref = teacher_forced_logprobs(cfg, params, out, 0.7)
    assert np.abs(np.asarray(out.logprobs) - ref)[m].max() <= 1e-4
    # at the model's own initialisation (`init_params`) instead of O(1) random weights:
    # within 1e-5, as in `test_qwen3_5`
    fresh = models.init_params(cfg, 0)
    out = paged.sample(fresh, ids, mask, spec, step=1)
    ref = teacher_forced_logprobs(cfg, fresh, out, 0.7)
    assert np.abs(np.asarray(out.logprobs) - ref)[np.asarray(out.mask)].max() <= 1e-5


def test_gather_attention_is_refused(qwen3_5):
    """`attention='gather'` (a dense prefix of keys/values: `forward_after_prefix`) is
    refused for a hybrid model, by the engine and by the config check naming its key;
    `rollout.engine='paged'` itself passes the check, and a set pool past the machine's
    memory counts the state rows (two per slot and two more) too."""
    from tiny_run import tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_model

    cfg, _ = qwen3_5
    with pytest.raises(ValueError, match="recurrent state"):
        engine(cfg, attention="gather")
    pool = engine(cfg).pool(cfg, 3, 4, np.float32, state_rows=5)
    assert jax.tree.leaves(pool.state)[0].shape[:2] == (sum(cfg.linear_layers), 5)
    c = tiny_config("unused")
    c.rollout.engine = "paged"
    checks_model.check_context(c, cfg)
    c.rollout.paged.attention = "gather"
    with pytest.raises(config_lib.ConfigError, match="rollout.paged.attention='gather'"):
        checks_model.check_context(c, cfg)
    c.rollout.paged.attention, c.rollout.paged.pages, c.rollout.paged.slots = "auto", 10**9, 3
    with pytest.raises(config_lib.ConfigError, match="pages of 16 tokens and 8 recurrent-state"):
        checks_model.check_page_pool(c, cfg)


def play_turns(cfg, params, pages):
    """3 prompts x 2 rows of 3 turns (4 tokens each at most, a turn stop id) with an
    observation of 3 ids after each of the first two, on 3 slots over `pages` pages ->
    (the session, {row: its trajectory})."""
    ids, mask = sampling.pad_prompts(PROMPTS[:3], 0)
    spec = sampling.RolloutSpec(
        num_generations=2, max_new_tokens=24, temperature=0.7, stop_ids=(7,)
    )
    engine_ = engine(cfg, slots=3, pages=pages)
    session = TurnSession(engine_, params, 0, spec, seed=0, step=1, slots=3, pages=pages, prompts=3)
    session.submit(ids, mask, 4, np.ones(6, bool))
    turns = dict.fromkeys(range(6), 0)
    while session.busy:
        for r in session.run_chunk():
            turns[r] += 1
            if turns[r] < 3:
                session.resume(r, [30 + r, 50 + turns[r], 60], 4)
            else:
                session.end(r)
    return session, {r: session.result(r) for r in range(6)}


def test_multi_turn_logprobs_equal_teacher_forced(qwen3_5):
    """`TurnSession` rows that park between turns (their state kept in a row of their
    own), are resumed (the pending token and an observation appended onto that state),
    and, over a small pool, evicted or preempted and recomputed: every sampled token's
    log-prob equals a teacher-forced forward's over prompt, turns and observations."""
    cfg, params = qwen3_5
    session, trajs = play_turns(cfg, params, pages=13)
    assert session.stats["evicted"] > 0, session.stats
    # appends onto a parked row's own state; completions recomputed on the pages (and
    # from the state row) of the prompt an evicted row kept
    assert session.stats["appends"] > 0 and session.stats["prompt_kept"] > 0
    width = max(len(t.prompt) for t in trajs.values())
    T = max(len(t.tokens) for t in trajs.values())
    rows = [trajs[r] for r in range(6)]
    out = SimpleNamespace(
        prompt_tokens=np.array([[0] * (width - len(t.prompt)) + list(t.prompt) for t in rows]),
        prompt_mask=np.array([[0] * (width - len(t.prompt)) + [1] * len(t.prompt) for t in rows]),
        tokens=np.array([t.tokens + [0] * (T - len(t.tokens)) for t in rows]),
        mask=np.array([[1] * len(t.tokens) + [0] * (T - len(t.tokens)) for t in rows]),
    )
    out.prompt_mask, out.mask = out.prompt_mask.astype(bool), out.mask.astype(bool)
    ref = teacher_forced_logprobs(cfg, params, out, 0.7)
    sampled = np.array([t.sampled + [False] * (T - len(t.sampled)) for t in rows])
    got = np.array([t.logprobs + [0.0] * (T - len(t.logprobs)) for t in rows])
    assert sampled.sum() > 40 and (~sampled & out.mask).sum() == 6 * 2 * 3
    assert np.abs(got - ref)[sampled].max() <= 1e-4

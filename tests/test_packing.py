"""Sequence packing (rl/packing.py): the layout against a plain Python first-fit, and the
packed update's loss and gradients against the padded update's on ragged rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, rl, sampling
from jaxrl_llm.rl import packing
from jaxrl_llm.rl import update as U
from jaxrl_llm.rl.advantages import compute_advantages
from jaxrl_llm.rl.gradients import Carry, Rows, Setup, gradients

CFG = tiny_model_config()
P, T, N = 6, 16, 16
SPEC = sampling.RolloutSpec(num_generations=2, max_new_tokens=T, temperature=1.0)


def ragged_rows(seed=0, full=False):
    """N rows of left-padded prompts and right-padded completions, long-tailed lengths
    (about half the positions padding), a hole in one completion's mask (attended,
    not trained: a tool output) and one completion of a single token."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, P + 1, N)
    clen = np.array([16, 2, 5, 1, 3, 16, 4, 2, 8, 1, 3, 6, 2, 12, 1, 4])
    if full:
        plen[:], clen[:] = P, T
    prompt_mask = np.arange(P)[None] >= (P - plen)[:, None]
    mask = np.arange(T)[None] < clen[:, None]
    loss_mask = mask.copy()
    loss_mask[5, 4:7] = False
    prompt_tokens = np.where(prompt_mask, rng.integers(1, 64, (N, P)), 0).astype(np.int32)
    tokens = np.where(mask, rng.integers(1, 64, (N, T)), 0).astype(np.int32)
    return prompt_tokens, prompt_mask, tokens, mask, loss_mask, rng


# ------------------------------------------------------------------------------ layout
def python_first_fit(lengths, width, bins):
    """First-fit decreasing, a plain loop: (bin, offset) per row, or None if one misses."""
    fill, place = [0] * bins, {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b in range(bins):
            if fill[b] + lengths[i] <= width:
                place[i] = (b, fill[b])
                fill[b] += lengths[i]
                break
        else:
            return None
    return [place[i] for i in range(len(lengths))]


@pytest.mark.parametrize("bins", [6, 8, 10])
def test_plan_is_first_fit_decreasing_and_pack_moves_each_token(bins):
    prompt_tokens, prompt_mask, tokens, mask, _, _ = ragged_rows()
    ids = np.concatenate([prompt_tokens, tokens], 1)
    attend = np.concatenate([prompt_mask, mask], 1)
    plan = packing.plan_packing(prompt_mask, mask, bins)
    # spans: first real prompt token .. last attended token (numpy)
    start = np.argmax(attend, 1)
    end = P + T - np.argmax(attend[:, ::-1], 1)
    np.testing.assert_array_equal(plan.start, start)
    np.testing.assert_array_equal(plan.end, end)
    want = python_first_fit(list(end - start), P + T, bins)
    assert bool(plan.fits) == (want is not None)
    if want is None:
        return
    assert [(int(s), int(o)) for s, o in zip(plan.seq, plan.offset, strict=True)] == want
    p_ids, p_att, p_pos, p_seg = map(np.asarray, packing.pack(plan, ids, attend))
    for i, (s, o) in enumerate(want):
        span = slice(o, o + end[i] - start[i])
        np.testing.assert_array_equal(p_ids[s, span], ids[i, start[i] : end[i]])
        np.testing.assert_array_equal(p_att[s, span], attend[i, start[i] : end[i]])
        assert (p_seg[s, span] == i + 1).all()
        real_before = np.cumsum(attend[i]) - 1  # HF-style position ids of the padded row
        np.testing.assert_array_equal(p_pos[s, span], real_before[start[i] : end[i]])
    assert (p_seg == 0).sum() == bins * (P + T) - (end - start).sum()
    assert not p_att[p_seg == 0].any()


# ------------------------------------------------------------------- loss and gradients
@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, seed=0)


def setup(preset, capacity, micro=2):
    return Setup(
        model_cfg=CFG,
        algo=rl.preset(preset),
        opt=U.make_optimizer(learning_rate=1e-3),
        critic_opt=None,
        spec=SPEC,
        micro_batches=micro,
        mini_batches=1,
        chunk_size=8,
        skip_nonfinite=False,
        seed=0,
        share_prompts=False,
        packing=capacity,
    )


def rows_of(full=False):
    prompt_tokens, prompt_mask, tokens, mask, loss_mask, rng = ragged_rows(full=full)
    rewards = rng.normal(size=N).astype(np.float32)
    behaviour = np.where(mask, -rng.uniform(0.5, 4.0, (N, T)), 0.0).astype(np.float32)
    ref = np.where(mask, behaviour + rng.normal(0, 0.1, (N, T)), 0.0).astype(np.float32)
    adv = compute_advantages(rl.preset("grpo"), jnp.asarray(rewards), loss_mask, 2)
    return Rows(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        tokens=tokens,
        mask=mask,
        loss_mask=loss_mask,
        behaviour_logp=behaviour,
        advantages=adv.advantages,
        old_logp=None,
        ref_logp=ref,
        returns=None,
        old_values=None,
    )


@functools.cache
def grads_fn(preset, capacity, micro=2):
    s = setup(preset, capacity, micro)
    return jax.jit(lambda carry, rows: gradients(s, carry, rows))


def max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), a, b)))


def test_packed_loss_and_gradients_equal_the_padded_ones(params, preset="grpo"):
    rows = rows_of()
    for sl in range(2):  # each micro-batch (rows sl, sl + 2, ...) fits 5 of its 8 rows
        part = rows.mask[sl::2], rows.prompt_mask[sl::2]
        assert bool(packing.plan_packing(part[1], part[0], 5).fits)
    carry = Carry(params=params, opt_state=None, critic_params=None, critic_opt_state=None)
    padded, m_padded = grads_fn(preset, 0.0)(carry, rows)
    packed, m_packed = grads_fn(preset, 0.625)(carry, rows)
    assert max_diff(padded["policy"], jax.tree.map(jnp.zeros_like, padded["policy"])) > 1e-3
    assert max_diff(padded["policy"], packed["policy"]) <= 1e-5
    for name in m_padded:
        np.testing.assert_allclose(m_packed[name], m_padded[name], atol=1e-5, err_msg=name)


def test_rows_that_do_not_fit_run_padded(params):
    rows = rows_of(full=True)  # no padding: 8 rows cannot go into 5 sequences
    assert not bool(packing.plan_packing(rows.prompt_mask[::2], rows.mask[::2], 5).fits)
    carry = Carry(params=params, opt_state=None, critic_params=None, critic_opt_state=None)
    padded, m_padded = grads_fn("grpo", 0.0)(carry, rows)
    packed, m_packed = grads_fn("grpo", 0.625)(carry, rows)
    assert max_diff(padded["policy"], packed["policy"]) <= 1e-6
    assert float(m_packed["loss/total"]) == pytest.approx(float(m_padded["loss/total"]), abs=1e-6)


def test_packed_reference_logprobs_equal_the_padded_ones(params):
    """With 8 more prompt columns, S (P + T) > n T: the log-probs are taken over the
    rows' completion steps (hidden states gathered back), not over the packed layout."""
    rows = rows_of()
    wider = lambda x: np.pad(x, ((0, 0), (8, 0)))  # noqa: E731
    rows = rows.replace(
        prompt_tokens=wider(rows.prompt_tokens), prompt_mask=wider(rows.prompt_mask)
    )
    spec = sampling.RolloutSpec(num_generations=1, max_new_tokens=T, temperature=0.7)
    out = [
        rl.make_logprob_fn(CFG, spec, chunk_size=8, micro_batches=2, packing=mode)(params, rows)
        for mode in ("off", "on")
    ]
    assert np.abs(np.asarray(out[0])).max() > 1.0
    assert max_diff(out[0], out[1]) <= 1e-5
    assert not np.asarray(out[1])[~rows.mask].any()


def test_packing_modes_are_checked():
    assert packing.resolve_packing("auto", 0.5, 1) == 0.5
    assert packing.resolve_packing("auto", 0.5, 4) == 0.0
    assert packing.resolve_packing("off", 0.5, 1) == 0.0
    with pytest.raises(ValueError, match="packing='yes'"):
        packing.resolve_packing("yes", 0.5, 1)
    with pytest.raises(ValueError, match="capacity=1.5"):
        packing.resolve_packing("on", 1.5, 1)

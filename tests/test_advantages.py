"""Advantage estimators against plain numpy / Python loops (float64 references)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rl import advantages as A
from jaxrl_llm.rl import shaping
from jaxrl_llm.rl.algos import AlgoConfig, preset

EPS = 1e-6


def _std(xs):
    """Sample std (ddof=1) of a Python list."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _mask(rng, n, t, holes=True):
    """Random loss mask [N, T]: lengths 0..T, row 0 of length 1, row 1 empty, some holes."""
    lengths = rng.integers(1, t + 1, n)
    lengths[0], lengths[1] = 1, 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:
        mask *= rng.random((n, t)) > 0.2
        mask[0, 0] = 1.0
    return mask


def naive_grpo(r, g, scale):
    out = np.zeros(len(r))
    batch_std = _std(list(r))
    for start in range(0, len(r), g):
        group = list(r[start : start + g])
        mean = sum(group) / g
        for j, x in enumerate(group):
            if max(group) == min(group):
                out[start + j] = 0.0
            elif scale == "group":
                out[start + j] = (x - mean) / (_std(group) + EPS)
            elif scale == "batch":
                out[start + j] = (x - mean) / (batch_std + EPS)
            else:
                out[start + j] = x - mean
    return out


def naive_rloo(r, g):
    out = np.zeros(len(r))
    for i in range(len(r)):
        start = i - i % g
        others = [r[j] for j in range(start, start + g) if j != i]
        out[i] = r[i] - sum(others) / (g - 1)
    return out


def naive_whiten(x, mask):
    vals = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean, std = sum(vals) / len(vals), _std(vals)
    return np.where(mask > 0, (x - mean) / (std + EPS), 0.0)


def _compact(mask_row):
    return [t for t in range(len(mask_row)) if mask_row[t]]


def naive_returns(rewards, mask, gamma):
    """G_t = sum_{s >= t} gamma^(s - t) r_s over the row's valid tokens (a double sum)."""
    out = np.zeros_like(rewards, dtype=np.float64)
    for i in range(rewards.shape[0]):
        idx = _compact(mask[i])
        for k, t in enumerate(idx):
            out[i, t] = sum(gamma**j * rewards[i, s] for j, s in enumerate(idx[k:]))
    return out


def naive_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l}, V after the last valid token = 0."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for i in range(rewards.shape[0]):
        idx = _compact(mask[i])
        v = [values[i, t] for t in idx] + [0.0]
        delta = [rewards[i, t] + gamma * v[k + 1] - v[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):
            adv[i, t] = sum((gamma * lam) ** j * d for j, d in enumerate(delta[k:]))
    return adv, np.where(mask > 0, adv + values, 0.0)


def naive_token_rewards(outcome, mask, kl, beta):
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        idx = _compact(mask[i])
        for t in idx:
            out[i, t] -= beta * kl[i, t]
        if idx:
            out[i, idx[-1]] += outcome[i]
    return out


def _rewards(rng, b, g):
    r = rng.integers(0, 3, b * g).astype(np.float32) * 0.5 + rng.normal(0, 0.1, b * g)
    r[:g] = 0.1  # a group of equal rewards whose float mean is not exactly 0.1
    r[g : 2 * g] = 1.0
    return r.astype(np.float32)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_naive(scale):
    rng = np.random.default_rng(0)
    r = _rewards(rng, 5, 4)
    got = np.asarray(A.group_advantages(jnp.asarray(r), 4, scale, EPS))
    np.testing.assert_allclose(got, naive_grpo(r.astype(np.float64), 4, scale), atol=2e-5)
    assert np.all(got[:8] == 0.0)


def test_rloo_matches_naive():
    rng = np.random.default_rng(1)
    r = _rewards(rng, 4, 3)
    got = np.asarray(A.rloo_advantages(jnp.asarray(r), 3))
    np.testing.assert_allclose(got, naive_rloo(r.astype(np.float64), 3), atol=1e-5)
    assert np.all(got[:6] == 0.0)


def _central_diff(f, x, h=1e-4):
    g = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e.flat[i] = h
        g.flat[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_gradient(scale):
    rng = np.random.default_rng(2)
    r = _rewards(rng, 3, 4)
    w = rng.normal(size=r.shape)
    grad = jax.grad(lambda x: jnp.sum(A.group_advantages(x, 4, scale, EPS) * w))(jnp.asarray(r))
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad))  # no NaN through the zero std of the equal groups
    if scale != "batch":  # the batch std still depends on the equal groups' rewards
        assert np.all(grad[:8] == 0.0)
    ref = _central_diff(lambda x: np.sum(naive_grpo(x, 4, scale) * w), r.astype(np.float64))
    # The batch std couples every row; in the equal groups the naive function is 0 only at
    # the equality point, so compare the other rows.
    np.testing.assert_allclose(grad[8:], ref[8:], rtol=1e-3, atol=1e-3)


def test_multi_reward_gdpo_matches_naive():
    rng = np.random.default_rng(3)
    g, k = 4, 3
    r = np.stack([_rewards(rng, 4, g) for _ in range(k)], axis=-1)
    r[:g] = 0.5  # every function equal within group 0
    weights = (1.0, 0.5, 2.0)
    got = np.asarray(A.multi_reward_advantages(jnp.asarray(r), g, weights, EPS))
    per_fn = [naive_grpo(r[:, j].astype(np.float64), g, "group") for j in range(k)]
    total = sum(w * a for w, a in zip(weights, per_fn, strict=True))
    np.testing.assert_allclose(got, total / (_std(list(total)) + EPS), atol=2e-5)
    assert np.all(got[:g] == 0.0)


def test_whiten_matches_naive():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, 7)).astype(np.float32)
    mask = _mask(rng, 6, 7)
    got = np.asarray(A.whiten(jnp.asarray(x), jnp.asarray(mask), EPS))
    np.testing.assert_allclose(got, naive_whiten(x.astype(np.float64), mask), atol=1e-5)
    const = np.asarray(A.whiten(jnp.full((3, 4), 0.3), jnp.ones((3, 4))))
    assert np.all(const == 0.0)


def test_token_rewards_and_returns_match_naive():
    rng = np.random.default_rng(5)
    n, t = 6, 8
    mask = _mask(rng, n, t)
    outcome = rng.normal(size=n).astype(np.float32)
    kl = rng.normal(size=(n, t)).astype(np.float32)
    tr = np.asarray(A.token_rewards(jnp.asarray(outcome), jnp.asarray(mask), jnp.asarray(kl), 0.1))
    ref = naive_token_rewards(outcome, mask, kl, 0.1)
    np.testing.assert_allclose(tr, ref, atol=1e-6)
    for gamma in (1.0, 0.9):
        got = np.asarray(A.discounted_returns(jnp.asarray(tr), jnp.asarray(mask), gamma))
        np.testing.assert_allclose(got, naive_returns(ref, mask, gamma), atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_naive(gamma, lam):
    rng = np.random.default_rng(6)
    n, t = 5, 9
    mask = _mask(rng, n, t)
    rewards = rng.normal(size=(n, t)).astype(np.float32) * mask
    values = rng.normal(size=(n, t)).astype(np.float32)
    adv, ret = A.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, atol=1e-5)


def _reference_overlong(n, max_len, buffer):
    """DAPO eq. 13 written out: 0 up to L_max - L_c, a linear ramp to -1 at L_max, -1 after."""
    if n <= max_len - buffer:
        return 0.0
    if n <= max_len:
        return ((max_len - buffer) - n) / buffer
    return -1.0


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray, list])
def test_overlong_penalty_and_degenerate_groups(as_array):
    """One home (rl.shaping) for both, on host (numpy, lists) and device (jax) arrays."""
    for max_len, buffer in ((16, 4), (20, 5), (4, 4)):
        lengths = [0, 1, 10, 12, 13, 15, 16, 17, 20, 21, 40]
        got = np.asarray(shaping.overlong_penalty(as_array(lengths), max_len, buffer))
        assert got.dtype == np.float32
        ref = [_reference_overlong(n, max_len, buffer) for n in lengths]
        np.testing.assert_allclose(got, ref, atol=1e-6)
    with pytest.raises(ValueError, match="buffer=0"):
        shaping.overlong_penalty(np.ones(3), 16, 0)
    if as_array is list:
        return
    r = np.array([1, 1, 1, 0, 1, 0, 2, 2, 2, 0.5, 0.5, 0.5000001], np.float32)
    got = np.asarray(shaping.degenerate_groups(as_array(r), 3))
    assert got.tolist() == [len(set(r[i : i + 3].tolist())) == 1 for i in range(0, 12, 3)]


def _kl_k1(old, ref, mask):
    return np.where(mask > 0, old - ref, 0.0)


def test_compute_advantages_group_kinds_with_kl_in_reward():
    rng = np.random.default_rng(7)
    g, n, t = 4, 12, 6
    mask = _mask(rng, n, t)
    r = _rewards(rng, 3, g)
    old, ref = rng.normal(size=(2, n, t)).astype(np.float32)
    for kind, naive in (("grpo", lambda x: naive_grpo(x, g, "group")), ("rloo", None)):
        cfg = AlgoConfig(advantage=kind, beta=0.1, kl_estimator="k1")
        cfg_r = AlgoConfig(**{**cfg.__dict__, "kl_in_reward": True})
        for c, seq in ((cfg, r), (cfg_r, r - 0.1 * _kl_k1(old, ref, mask).sum(-1))):
            out = A.compute_advantages(
                c, jnp.asarray(r), jnp.asarray(mask), g, old_logp=old, ref_logp=ref
            )
            seq = seq.astype(np.float64)
            ref_seq = naive(seq) if naive else naive_rloo(seq, g)
            assert out.returns is None
            np.testing.assert_allclose(out.advantages, ref_seq[:, None] * mask, atol=3e-5)


def test_compute_advantages_multi_reward():
    rng = np.random.default_rng(8)
    r = np.stack([_rewards(rng, 3, 4), _rewards(rng, 3, 4)], axis=-1)
    mask = np.ones((12, 3), np.float32)
    summed = AlgoConfig(reward_weights=[1.0, 2.0])
    out = A.compute_advantages(summed, jnp.asarray(r), jnp.asarray(mask), 4).advantages
    ref = naive_grpo(r[:, 0] + 2.0 * r[:, 1], 4, "group")
    np.testing.assert_allclose(out[:, 0], ref, atol=3e-5)
    decoupled = AlgoConfig(decouple_rewards=True)
    out = A.compute_advantages(decoupled, jnp.asarray(r), jnp.asarray(mask), 4).advantages
    ref = np.asarray(A.multi_reward_advantages(jnp.asarray(r), 4))
    np.testing.assert_allclose(out[:, 1], ref, atol=1e-6)


def test_compute_advantages_reinforce_pp():
    rng = np.random.default_rng(9)
    n, t = 8, 7
    mask = _mask(rng, n, t)
    r = rng.normal(size=n).astype(np.float32)
    old, ref = rng.normal(size=(2, n, t)).astype(np.float32)
    cfg = preset("reinforce_pp", beta=0.05)
    out = A.compute_advantages(cfg, jnp.asarray(r), jnp.asarray(mask), old_logp=old, ref_logp=ref)
    tokens = naive_token_rewards(r, mask, _kl_k1(old, ref, mask), 0.05)
    expected = naive_whiten(naive_returns(tokens, mask, 1.0), mask)
    np.testing.assert_allclose(out.advantages, expected, atol=3e-5)


def test_compute_advantages_ppo_gae():
    rng = np.random.default_rng(10)
    n, t = 6, 8
    mask = _mask(rng, n, t)
    r = rng.normal(size=n).astype(np.float32)
    values = rng.normal(size=(n, t)).astype(np.float32)
    old, ref = rng.normal(size=(2, n, t)).astype(np.float32)
    cfg = preset("ppo")
    out = A.compute_advantages(
        cfg, jnp.asarray(r), jnp.asarray(mask), old_logp=old, ref_logp=ref, values=values
    )
    tokens = naive_token_rewards(r, mask, _kl_k1(old, ref, mask), cfg.beta)
    adv, ret = naive_gae(tokens, values, mask, 1.0, 0.95)
    np.testing.assert_allclose(out.returns, ret, atol=2e-5)
    np.testing.assert_allclose(out.advantages, naive_whiten(adv, mask), atol=3e-5)
    with pytest.raises(ValueError, match="values"):
        A.compute_advantages(cfg, jnp.asarray(r), jnp.asarray(mask), old_logp=old, ref_logp=ref)


def test_compute_advantages_jits_and_rejects_bad_groups():
    cfg = preset("grpo")
    fn = jax.jit(A.compute_advantages, static_argnums=(0, 3))
    out = fn(cfg, jnp.zeros(8), jnp.ones((8, 3)), 4)
    assert np.all(np.asarray(out.advantages) == 0.0)
    with pytest.raises(ValueError, match="num_generations=4: need >= 2 and dividing N=6"):
        A.group_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match="num_generations=1"):
        fn(cfg, jnp.zeros(8), jnp.ones((8, 3)), 1)

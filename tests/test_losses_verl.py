"""SAPO, GMPO, Clip-Cov, KL-Cov and DPPO (TV, KL) against verl 0.9.1, in float64.

The references are verl's own functions transcribed into torch (tests/verl_reference.py);
values and gradients w.r.t. log pi_theta must agree to 1e-5 on ragged masks (holes, a
length-1 row, a fully masked row holding garbage log-probs) in every aggregation mode.
Where jaxrl_llm's convention differs on purpose (policy_losses.py's module doc) the test
applies the adjustment explicitly:
- seq-mean-token-sum-norm divides by every row (N L_max), verl by the non-empty rows;
- SAPO honours `loss_agg` (verl forces seq-mean-token-mean): other modes aggregate verl's
  per-token matrix with verl's `agg_loss`;
- GMPO's seq-mean-token-mean averages the non-empty rows (verl: all rows); other modes
  aggregate verl's per-row losses spread over the row's tokens;
- DPPO's value is sum(d loss / d log pi) (pi / sg(pi) instead of log pi; same gradient).
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import verl_reference as V

from jaxrl_llm.rl import losses as L
from jaxrl_llm.rl import policy_losses as P
from jaxrl_llm.rl.algos import AlgoConfig

N, T = 7, 8
MAX_LEN = 10
TOL = dict(rtol=1e-5, atol=1e-9)


def _batch(seed):
    """float64 log-probs in (-4, 0), |log rho| up to ~2, a ragged mask with holes, a
    length-1 row (0) and a fully masked row (1) whose log-ratio is 200."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, N)
    lengths[0], lengths[1] = 1, 0
    mask = (np.arange(T)[None, :] < lengths[:, None]) & (rng.random((N, T)) > 0.15)
    mask[0, 0] = True
    old = rng.uniform(-4.0, -0.05, (N, T))
    logp = np.minimum(old + rng.normal(0, 0.5, (N, T)), -1e-3)
    logp[1] = old[1] + 200.0
    adv = rng.normal(0, 1, (N, T))
    adv[rng.random((N, T)) < 0.1] = 0.0  # A = 0 tokens (SAPO's tau_neg, GMPO's sign 0)
    return dict(logp=logp, old=old, adv=adv, mask=mask.astype(np.float64))


def _ours(cfg, d):
    """(loss, d loss / d logp) of policy_objective, float64."""
    with jax.enable_x64(True):

        def f(logp):
            loss, _ = L.policy_objective(
                cfg,
                logp,
                jnp.asarray(d["old"]),
                None,
                None,
                jnp.asarray(d["adv"]),
                jnp.asarray(d["mask"]),
                max_len=MAX_LEN,
            )
            return loss

        loss, grad = jax.value_and_grad(f)(jnp.asarray(d["logp"]))
        assert loss.dtype == jnp.float64
        return float(loss), np.asarray(grad)


def _metrics(cfg, d) -> dict:
    with jax.enable_x64(True):
        args = [jnp.asarray(d[k]) for k in ("logp", "old")]
        _, metrics = L.policy_objective(
            cfg, *args, None, None, jnp.asarray(d["adv"]), jnp.asarray(d["mask"])
        )
        return {k: float(v) for k, v in metrics.items()}


def _verl(fn, d, *args, **kwargs):
    """(loss, d loss / d logp, per-token matrix) of a verl function, float64."""
    logp = torch.tensor(d["logp"], requires_grad=True)
    t = {k: torch.tensor(d[k]) for k in ("old", "adv", "mask")}
    loss, mat = fn(t["old"], logp, t["adv"], t["mask"], *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss.detach()), grad.numpy(), mat


def _verl_agg(d, matrix_fn, mode):
    """verl's agg_loss over the matrix matrix_fn(logp) builds, with its gradient."""
    logp = torch.tensor(d["logp"], requires_grad=True)
    mask = torch.tensor(d["mask"])
    loss = V.agg_loss(matrix_fn(logp), mask, mode, loss_scale_factor=MAX_LEN)
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss.detach()), grad.numpy()


def _norm_factor(d, mode):
    """ours / verl for seq-mean-token-sum-norm (every row vs the non-empty ones)."""
    if mode != "seq-mean-token-sum-norm":
        return 1.0
    return float((d["mask"].sum(-1) > 0).sum()) / N


def _check(ours, ref, factor=1.0):
    np.testing.assert_allclose(ours[0], ref[0] * factor, **TOL)
    np.testing.assert_allclose(ours[1], ref[1] * factor, **TOL)
    assert np.all(ours[1][1] == 0.0)  # the fully masked row gets no gradient


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_matches_verl(mode, taus):
    d = _batch(1)
    cfg = AlgoConfig(
        policy_loss="sapo",
        sapo_tau_pos=taus[0],
        sapo_tau_neg=taus[1],
        loss_agg=mode,
        off_policy="none",
    )
    ours = _ours(cfg, d)
    if mode == "seq-mean-token-mean":  # verl's own aggregation
        loss, grad, _ = _verl(V.sapo, d, *taus)
        _check(ours, (loss, grad))
    old, adv = torch.tensor(d["old"]), torch.tensor(d["adv"])
    mask = torch.tensor(d["mask"])
    ref = _verl_agg(d, lambda lp: V.sapo(old, lp, adv, mask, *taus)[1], mode)
    _check(ours, ref, _norm_factor(d, mode))


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_verl(mode, eps):
    d = _batch(2)
    cfg = AlgoConfig(
        policy_loss="gmpo", eps_low=eps[0], eps_high=eps[1], loss_agg=mode, off_policy="none"
    )
    ours = _ours(cfg, d)
    nonempty = float((d["mask"].sum(-1) > 0).sum())
    if mode == "seq-mean-token-mean":
        loss, grad, _ = _verl(V.geo_mean, d, *eps)
        _check(ours, (loss, grad), N / nonempty)
    old, adv = torch.tensor(d["old"]), torch.tensor(d["adv"])
    mask = torch.tensor(d["mask"])

    def spread(lp):
        rows = V.geo_mean(old, lp, adv, mask, *eps)[1]
        return rows[:, None].expand(N, T)

    _check(ours, _verl_agg(d, spread, mode), _norm_factor(d, mode))


def test_gmpo_clips_in_log_space_by_advantage_sign():
    """A > 0 tokens are capped at log rho = eps_high, A < 0 tokens floored at -eps_low."""
    x = jnp.asarray([[1.0, -1.0, 0.1, -2.0]])
    valid = jnp.ones((1, 4), bool)
    for a, expected in ((1.0, (0.3 - 1.0 + 0.1 - 2.0) / 4), (-1.0, (1.0 - 0.2 + 0.1 - 0.2) / 4)):
        s = P.gmpo_ratio(x, jnp.full((1, 4), a), valid, 0.2, 0.3)
        np.testing.assert_allclose(np.asarray(s), np.exp(expected), rtol=1e-6)


def _clip_cov_cfg(mode, ratio, lb=0.05, ub=0.8):
    return AlgoConfig(
        policy_loss="clip_cov",
        loss_agg=mode,
        off_policy="none",
        eps_low=0.2,
        eps_high=0.28,
        clip_cov_ratio=ratio,
        clip_cov_lb=lb,
        clip_cov_ub=ub,
    )


def _selected(cfg, d):
    with jax.enable_x64(True):
        args = [jnp.asarray(d[k]) for k in ("logp", "old", "adv")]
        x = L.clamp_log_ratio(L.log_ratio(args[0], args[1], jnp.asarray(d["mask"])))
        valid = jnp.asarray(d["mask"]) > 0
        return np.asarray(P.clip_cov_selected(x, *args, valid, cfg))


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_clip_cov_matches_verl(mode):
    """Budget >= candidates: verl's random draw takes every candidate, ours too."""
    d = _batch(3)
    cfg = _clip_cov_cfg(mode, ratio=0.6)
    ours = _ours(cfg, d)
    ref = _verl(V.clip_cov, d, mode, 0.2, 0.28, 0.6, 0.05, 0.8, loss_scale_factor=MAX_LEN)
    picked = _selected(cfg, d)
    assert 2 <= picked.sum() < int(0.6 * d["mask"].sum())  # all candidates, under budget
    _check(ours, ref[:2], _norm_factor(d, mode))
    assert np.all(ours[1][picked] == 0.0)
    m = d["mask"] > 0
    np.testing.assert_allclose(_metrics(cfg, d)["policy/masked_frac"], picked[m].mean(), **TOL)


def test_clip_cov_draws_the_budget_among_candidates():
    """Budget < candidates: ours detaches exactly `budget` candidates; verl given that same
    draw gives the same loss and gradient."""
    d = _batch(4)
    mode = "token-mean"
    cfg = _clip_cov_cfg(mode, ratio=0.1, lb=-10.0, ub=10.0)
    picked = _selected(cfg, d)
    budget = max(int(0.1 * d["mask"].sum()), 1)
    assert picked.sum() == budget and budget >= 2
    seen = {}

    def choose(top_k_idx, clip_num):
        seen["candidates"] = {tuple(r) for r in top_k_idx.tolist()}
        assert clip_num == budget
        return torch.tensor(np.argwhere(picked))

    ref = _verl(V.clip_cov, d, mode, 0.2, 0.28, 0.1, -10.0, 10.0, choose=choose)
    assert {tuple(r) for r in np.argwhere(picked).tolist()} <= seen["candidates"]
    assert len(seen["candidates"]) > budget
    _check(_ours(cfg, d), ref[:2])
    assert np.array_equal(picked, _selected(cfg, d))  # the same batch, the same draw


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("ratio,coef", [(0.2, 1.0), (0.02, 0.1)])
def test_kl_cov_matches_verl(mode, ratio, coef):
    d = _batch(5)
    cfg = AlgoConfig(
        policy_loss="kl_cov", loss_agg=mode, off_policy="none", kl_cov_ratio=ratio, kl_cov_coef=coef
    )
    ref = _verl(V.kl_cov, d, mode, ratio, coef, loss_scale_factor=MAX_LEN)
    _check(_ours(cfg, d), ref[:2], _norm_factor(d, mode))


def test_kl_cov_penalty_has_no_gradient_on_policy():
    """At log rho = 0 the |log rho| term adds nothing (as torch.abs): plain -rho A."""
    d = _batch(6)
    d["logp"] = d["old"].copy()
    on = AlgoConfig(policy_loss="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=5.0, off_policy="none")
    plain = AlgoConfig(policy_loss="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=0.0, off_policy="none")
    np.testing.assert_allclose(_ours(on, d)[1], _ours(plain, d)[1], rtol=1e-12)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("eps,cap", [((0.2, 0.2), 20.0), ((0.05, 0.1), 1.5)])
def test_dppo_matches_verl(mode, kind, eps, cap):
    d = _batch(7)
    cfg = AlgoConfig(
        policy_loss=f"dppo_{kind}",
        loss_agg=mode,
        off_policy="none",
        eps_low=eps[0],
        eps_high=eps[1],
        ratio_cap=cap,
    )
    fn = V.dppo_tv if kind == "tv" else V.dppo_kl
    _, grad, mat = _verl(fn, d, mode, *eps, clip_ratio_c=cap, loss_scale_factor=MAX_LEN)
    f = _norm_factor(d, mode)
    ours = _ours(cfg, d)
    np.testing.assert_allclose(ours[1], grad * f, **TOL)
    np.testing.assert_allclose(ours[0], grad.sum() * f, **TOL)  # pi / sg(pi) in place of log pi
    m = d["mask"] > 0
    dropped = (mat.detach().numpy() == 0) & m & (d["adv"] != 0)
    assert 0 < dropped.sum() < m.sum()  # the trust region masks some tokens, not all
    # policy/masked_frac is verl's pg_clipfrac, the masked mean of 1 - valid_mask: with no
    # A = 0 token, exactly the valid tokens whose loss verl zeroes.
    d["adv"] = np.where(d["adv"] == 0, 0.5, d["adv"])
    mat = _verl(fn, d, mode, *eps, clip_ratio_c=cap, loss_scale_factor=MAX_LEN)[2]
    masked = (mat.detach().numpy() == 0)[m]
    np.testing.assert_allclose(_metrics(cfg, d)["policy/masked_frac"], masked.mean(), **TOL)


@pytest.mark.parametrize("name", ["sapo", "gmpo"])
def test_new_presets(name):
    from jaxrl_llm.rl.algos import preset

    cfg = preset(name)
    assert cfg.policy_loss == name and cfg.loss_agg == "seq-mean-token-mean"
    with pytest.raises(ValueError, match="algo.sapo_tau_neg"):
        preset(name, sapo_tau_neg=0.0)


@pytest.mark.parametrize("ratio", [0.53, 0.29, 0.05, 2e-4, 0.1, 0.3, 0.7, 1.0, 0.123457])
@pytest.mark.parametrize("n", [0, 1, 7, 100, 1000, 4096, 30001])
def test_covariance_budget_is_exact(ratio, n):
    """max(floor(r n), 1) with r the decimal as written, against Python's Fraction: 0.53 of
    100 tokens is 53 (float32 gives 52), 0.29 of 100 is 29 (float64 gives 28)."""
    valid = jnp.arange(32768).reshape(64, 512) < n  # the batch's static size is 32768
    expected = max(math.floor(Fraction(str(ratio)) * n), 1)
    assert int(P.budget(valid, ratio)) == expected


def test_covariance_losses_select_the_exact_budget():
    """Clip-Cov detaches and KL-Cov penalises 53 of 100 valid tokens at ratio 0.53."""
    rng = np.random.default_rng(0)
    valid = jnp.asarray(np.arange(128).reshape(8, 16) < 100)
    logp = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    x = jnp.zeros((8, 16))  # on-policy: the clip clips nothing, every valid token a candidate
    cfg = _clip_cov_cfg("token-mean", ratio=0.53, lb=-100.0, ub=100.0)
    assert int(P.clip_cov_selected(x, logp, logp, adv, valid, cfg).sum()) == 53
    assert int(P.kl_cov_selected(logp, adv, valid, 0.53).sum()) == 53


def test_covariance_ratio_with_too_many_decimals_is_a_config_error():
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        AlgoConfig(policy_loss="clip_cov", clip_cov_ratio=0.1234567)


def test_clip_cov_draw_ignores_the_last_bits_of_old_logp():
    """The draw's seed is sum m old_logp to 12 significant bits: one ulp here and there (a
    CPU with another vector width sums in another order) picks the same tokens."""
    d = _batch(4)
    cfg = _clip_cov_cfg("token-mean", ratio=0.1, lb=-10.0, ub=10.0)
    picked = _selected(cfg, d)
    d["old"] = np.nextafter(d["old"], 0.0)  # every old log-prob one ulp toward 0
    assert np.array_equal(picked, _selected(cfg, d))

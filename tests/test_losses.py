"""Policy / KL / value losses and aggregation against plain Python loops (float64).

Gradients are checked against per-token derivatives written out by hand as loops.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rl import losses as L
from jaxrl_llm.rl.algos import AlgoConfig

N, T = 6, 5
MAX_LEN = 7  # L_max of seq-mean-token-sum-norm (the rollout's max_new_tokens)


def _batch(seed, extreme=True):
    """Random inputs with a length-1 row (0), a fully masked row (1) holding garbage log-probs
    (|log rho| = 200, which overflows if it is ever exponentiated), holes in the mask and,
    when `extreme`, log-ratios of exactly +-20 on valid tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, T + 1, N)
    lengths[0], lengths[1] = 1, 0
    mask = (np.arange(T)[None, :] < lengths[:, None]) & (rng.random((N, T)) > 0.15)
    mask[0, 0] = True
    old = rng.normal(-1.5, 0.5, (N, T))
    logp = old + rng.normal(0, 0.3, (N, T))
    if extreme:
        logp[2, 0], logp[3, 0] = old[2, 0] + 20.0, old[3, 0] - 20.0
        mask[2, 0] = mask[3, 0] = True
    logp[1] = old[1] + 200.0
    data = dict(
        logp=logp,
        old=old,
        sampler=old + rng.normal(0, 0.5, (N, T)),
        ref=logp + rng.normal(0, 0.5, (N, T)),
        adv=rng.normal(0, 1, (N, T)),
        ent=rng.uniform(0, 3, (N, T)),
        mask=mask.astype(np.float32),
    )
    return {k: v.astype(np.float32) for k, v in data.items()}


def _row_weights(mask, mode, max_len=None):
    """Per-token weight of the aggregated loss: d(aggregate)/d(L_it) for valid tokens."""
    counts = mask.sum(-1)
    rows = max(int((counts > 0).sum()), 1)
    w = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            if mode == "token-mean":
                w[i, t] = 1.0 / mask.sum()
            elif mode == "seq-mean-token-mean":
                w[i, t] = 1.0 / (counts[i] * rows)
            elif mode == "seq-mean-token-sum":
                w[i, t] = 1.0 / rows
            else:
                w[i, t] = 1.0 / (mask.shape[0] * (max_len or mask.shape[1]))
    return w


def naive_aggregate(per_token, mask, mode, max_len=None):
    return float(np.sum(_row_weights(mask, mode, max_len) * np.where(mask > 0, per_token, 0)))


def naive_kl(lp, ref, kind):
    x = ref - lp
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[kind]


def naive_kl_grad(lp, ref, kind):
    x = ref - lp
    return {"k1": 1.0, "k2": -x, "k3": 1.0 - math.exp(x)}[kind]


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def naive_token_pg(cfg, rho, a):
    """(loss, d loss / d log pi) of one token; rho is s_i for GSPO (token form)."""
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    if cfg.policy_loss == "cispo":
        return -_clip(rho, lo, hi) * a, -_clip(rho, lo, hi) * a
    j_unclipped, j_clipped = rho * a, _clip(rho, lo, hi) * a
    j, grad = (j_unclipped, rho * a) if j_unclipped <= j_clipped else (j_clipped, 0.0)
    if cfg.dual_clip is not None and a < 0 and cfg.dual_clip * a > j:
        j, grad = cfg.dual_clip * a, 0.0
    return -j, -grad


def naive_off_policy_weight(cfg, k):
    """The weight of a token whose pi_old / pi_behaviour is k, for cfg.off_policy."""
    mode = cfg.off_policy
    if mode == "none" or (mode == "tis" and cfg.tis_cap is None):
        return 1.0
    if mode == "tis":
        return min(k, cfg.tis_cap)
    if mode == "icepop":
        return k if cfg.icepop_low <= k <= cfg.icepop_high else 0.0
    assert mode == "decoupled"
    return k if k <= cfg.tis_cap else 0.0


def naive_policy(cfg, d, use_tis=True, use_ref=True):
    """Loss and its gradients w.r.t. logp and entropy, by explicit loops."""
    m = d["mask"]
    w = _row_weights(m, cfg.loss_agg, MAX_LEN)
    loss, g_lp, g_ent = 0.0, np.zeros(m.shape), np.zeros(m.shape)
    for i in range(N):
        idx = [t for t in range(T) if m[i, t]]
        lr = [float(d["logp"][i, t]) - float(d["old"][i, t]) for t in idx]
        s = math.exp(sum(lr) / len(idx)) if idx else 1.0
        for t in idx:
            token_rho = math.exp(float(d["logp"][i, t]) - float(d["old"][i, t]))
            rho = s if cfg.policy_loss == "gspo" else token_rho
            pg, dpg = naive_token_pg(cfg, rho, float(d["adv"][i, t]))
            if use_tis:
                k = math.exp(float(d["old"][i, t]) - float(d["sampler"][i, t]))
                weight = naive_off_policy_weight(cfg, k)
                pg, dpg = pg * weight, dpg * weight
            lp, ref = float(d["logp"][i, t]), float(d["ref"][i, t])
            kl = naive_kl(lp, ref, cfg.kl_estimator) if use_ref else 0.0
            dkl = naive_kl_grad(lp, ref, cfg.kl_estimator) if use_ref else 0.0
            ent = float(d["ent"][i, t])
            loss += w[i, t] * (pg + cfg.beta * kl - cfg.entropy_coef * ent)
            g_lp[i, t] = w[i, t] * (dpg + cfg.beta * dkl)
            g_ent[i, t] = -w[i, t] * cfg.entropy_coef
    return loss, g_lp, g_ent


def _objective(cfg, d, use_tis=True, use_ref=True, denominator=None):
    def f(logp, ent):
        return L.policy_objective(
            cfg,
            logp,
            jnp.asarray(d["old"]),
            jnp.asarray(d["sampler"]) if use_tis else None,
            jnp.asarray(d["ref"]) if use_ref else None,
            jnp.asarray(d["adv"]),
            jnp.asarray(d["mask"]),
            ent,
            denominator=denominator,
            max_len=MAX_LEN,
        )

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.asarray(d["logp"]), jnp.asarray(d["ent"])
    )


CASES = [
    dict(policy_loss="ppo", eps_high=0.28, dual_clip=3.0, beta=0.04, kl_estimator="k3"),
    dict(policy_loss="ppo", eps_low=0.1, beta=0.1, kl_estimator="k2", entropy_coef=0.01),
    dict(policy_loss="ppo", tis_cap=None, beta=0.1, kl_estimator="k1"),
    dict(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, beta=0.05),
    dict(policy_loss="gspo", eps_low=0.2, eps_high=0.3, dual_clip=2.0, entropy_coef=0.1),
    dict(policy_loss="cispo", eps_low=0.9, eps_high=0.3, entropy_coef=0.01),
    dict(policy_loss="ppo", off_policy="none", beta=0.04),
    dict(policy_loss="ppo", off_policy="icepop", icepop_low=0.8, icepop_high=1.25),
    dict(policy_loss="gspo", off_policy="icepop", eps_low=0.2, eps_high=0.3),
    dict(policy_loss="ppo", off_policy="decoupled", tis_cap=1.5, dual_clip=3.0, beta=0.04),
]


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_policy_objective_matches_naive(case, mode):
    cfg = AlgoConfig(loss_agg=mode, **CASES[case])
    d = _batch(case)
    (loss, metrics), (g_lp, g_ent) = _objective(cfg, d)
    ref_loss, ref_g_lp, ref_g_ent = naive_policy(cfg, d)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_lp), ref_g_lp, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_ent), ref_g_ent, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g_lp)[1] == 0.0)  # the fully masked row
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_kl_skipped_without_beta_and_required_with_it():
    d = _batch(10)
    cfg = AlgoConfig(beta=0.0, tis_cap=None)
    (loss, metrics), (g_lp, _) = _objective(cfg, d, use_tis=False, use_ref=False)
    ref_loss, ref_g, _ = naive_policy(cfg, d, use_tis=False, use_ref=False)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(g_lp), ref_g, rtol=2e-4, atol=1e-7)
    assert "loss/kl" not in metrics
    in_reward = AlgoConfig(beta=0.1, kl_in_reward=True)
    (loss_r, _), _ = _objective(in_reward, d, use_ref=False)
    np.testing.assert_allclose(float(loss_r), naive_policy(in_reward, d, use_ref=False)[0], 2e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        _objective(AlgoConfig(beta=0.1), d, use_ref=False)


def _seq_objective_np(lp_flat, d, cfg):
    """GSPO's sequence-level objective (not the token form), seq-mean-token-mean, as -J."""
    lp = lp_flat.reshape(N, T)
    total, rows = 0.0, 0
    for i in range(N):
        idx = [t for t in range(T) if d["mask"][i, t]]
        if not idx:
            continue
        rows += 1
        s = math.exp(sum(lp[i, t] - d["old"][i, t] for t in idx) / len(idx))
        a = float(d["adv"][i, 0])
        total += -min(s * a, _clip(s, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    return total / rows


@pytest.mark.parametrize("eps", [0.5, 0.05])
def test_gspo_token_form_has_sequence_gradient(eps):
    d = _batch(11, extreme=False)
    d["adv"] = np.repeat(d["adv"][:, :1], T, axis=1)  # one advantage per sequence
    cfg = AlgoConfig(policy_loss="gspo", eps_low=eps, eps_high=eps, tis_cap=None)
    cfg = AlgoConfig(**{**cfg.__dict__, "loss_agg": "seq-mean-token-mean"})
    d["logp"][1] = d["old"][1]  # finite differences below see the garbage row too
    (loss, _), (g_lp, _) = _objective(cfg, d, use_tis=False, use_ref=False)
    x = d["logp"].astype(np.float64).ravel()
    h = 1e-5
    fd = np.array(
        [
            (_seq_objective_np(x + h * e, d, cfg) - _seq_objective_np(x - h * e, d, cfg)) / (2 * h)
            for e in np.eye(x.size)
        ]
    ).reshape(N, T)
    np.testing.assert_allclose(float(loss), _seq_objective_np(x, d, cfg), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_lp), fd * d["mask"], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_micro_batches_sum_to_full_batch(mode):
    cfg = AlgoConfig(loss_agg=mode, beta=0.05, entropy_coef=0.01, dual_clip=3.0)
    d = _batch(12)
    d = {k: np.concatenate([v, v[::-1] * 0.9 + 0.01], axis=0) for k, v in d.items()}
    d["mask"] = (d["mask"] > 0.5).astype(np.float32)
    rows = d["mask"].shape[0]
    den = L.loss_denominator(jnp.asarray(d["mask"]), mode, MAX_LEN)

    def run(part, denominator=None):
        return _objective(cfg, {k: v[part] for k, v in d.items()}, denominator=denominator)

    (full, _), (g_full, _) = run(slice(None))
    parts = [run(slice(j, j + rows // 4), den) for j in range(0, rows, rows // 4)]
    np.testing.assert_allclose(sum(float(p[0][0]) for p in parts), float(full), rtol=1e-5)
    g_sum = np.concatenate([np.asarray(p[1][0]) for p in parts], axis=0)
    np.testing.assert_allclose(g_sum, np.asarray(g_full), rtol=1e-5, atol=1e-8)
    nums_dens = [
        L.aggregation_parts(d["adv"][j : j + 3], d["mask"][j : j + 3], mode) for j in (0, 3, 6, 9)
    ]
    num, dn = (sum(float(x[k]) for x in nums_dens) for k in (0, 1))
    np.testing.assert_allclose(num / dn, naive_aggregate(d["adv"], d["mask"], mode), rtol=1e-5)


@pytest.mark.parametrize("kind", L.KL_ESTIMATORS)
def test_kl_estimators(kind):
    d = _batch(13)
    d["logp"][1] = d["old"][1]
    lp, ref, m = (jnp.asarray(d[k]) for k in ("logp", "ref", "mask"))
    got = np.asarray(L.kl_penalty(lp, ref, m, kind))
    grad = np.asarray(jax.grad(lambda x: jnp.sum(L.kl_penalty(x, ref, m, kind)))(lp))
    for i in range(N):
        for t in range(T):
            on = bool(d["mask"][i, t])
            args = float(d["logp"][i, t]), float(d["ref"][i, t])
            np.testing.assert_allclose(got[i, t], naive_kl(*args, kind) if on else 0.0, rtol=1e-5)
            g = naive_kl_grad(*args, kind) if on else 0.0
            np.testing.assert_allclose(grad[i, t], g, rtol=1e-4, atol=1e-6)
    assert np.all(got[np.asarray(d["mask"]) > 0] >= -1e-7) or kind == "k1"


def test_ppo_clip_token_values_and_grads_at_extreme_ratios():
    cfg = AlgoConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    log_r = np.array([-20.0, -1.0, -0.1, 0.0, 0.1, 1.0, 20.0], np.float32)
    for a in (-1.5, 0.7):
        adv = jnp.full(log_r.shape, a)

        def f(x, adv=adv):
            return L.ppo_clip_loss(jnp.exp(x), adv, 0.2, 0.28, 3.0)

        got = np.asarray(f(jnp.asarray(log_r)))
        grad = np.asarray(jax.grad(lambda x: jnp.sum(f(x)))(jnp.asarray(log_r)))
        for k, lr in enumerate(log_r):
            ref, ref_g = naive_token_pg(cfg, math.exp(float(lr)), a)
            np.testing.assert_allclose(got[k], ref, rtol=1e-5)
            np.testing.assert_allclose(grad[k], ref_g, rtol=1e-4, atol=1e-12)
    assert grad[-1] == 0.0  # A > 0, rho = e^20: clipped


def test_policy_metrics_match_naive():
    cfg = AlgoConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, tis_cap=2.0)
    d = _batch(14)
    (_, metrics), _ = _objective(cfg, d)
    m = d["mask"] > 0
    rho = np.exp(d["logp"].astype(np.float64) - d["old"])[m]
    a = d["adv"][m]
    x = (d["old"].astype(np.float64) - d["logp"])[m]
    gap = (d["old"].astype(np.float64) - d["sampler"])[m]
    tis = np.minimum(np.exp(gap), 2.0)
    expected = {
        "policy/clipfrac_low": np.mean((rho < 0.8) & (a < 0)),
        "policy/clipfrac_high": np.mean((rho > 1.28) & (a > 0)),
        "policy/clipfrac_dual": np.mean((rho > 3.0) & (a < 0)),
        "policy/approx_kl": np.mean(np.exp(x) - 1 - x),
        "policy/ratio_mean": np.mean(rho),
        "policy/ratio_min": np.min(rho),
        "policy/ratio_max": np.max(rho),
        "adv/mean": np.mean(a),
        "adv/std": np.std(a),
        "adv/min": np.min(a),
        "adv/max": np.max(a),
        "rollout/logprob_gap": np.mean(np.abs(d["old"] - d["sampler"])[m]),
        "rollout/mismatch_k3": np.mean(np.exp(gap) - 1 - gap),
        "rollout/is_weight_mean": np.mean(tis),
        "rollout/is_weight_max": np.max(tis),
        "rollout/is_masked_frac": 0.0,
        "rollout/tis_capped_frac": np.mean(tis >= 2.0),
        "policy/entropy": np.mean(d["ent"][m]),
    }
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-4, err_msg=key)


def test_all_masked_batch_is_zero_not_nan():
    d = _batch(15)
    d["mask"][:] = 0.0
    for mode in L.AGGREGATIONS:
        cfg = AlgoConfig(loss_agg=mode, beta=0.1, entropy_coef=0.1)
        (loss, metrics), (g_lp, g_ent) = _objective(cfg, d)
        assert float(loss) == 0.0 and np.all(np.asarray(g_lp) == 0) and np.all(g_ent == 0)
        assert all(np.isfinite(float(v)) for v in metrics.values())


def naive_value(v, v_old, r, eps):
    """(loss, d loss / d V) of one token; eps None = unclipped."""
    if eps is None:
        return 0.5 * (v - r) ** 2, v - r
    vc = _clip(v, v_old - eps, v_old + eps)
    a, b = (v - r) ** 2, (vc - r) ** 2
    if a >= b:
        return 0.5 * a, v - r
    return 0.5 * b, (vc - r) * (1.0 if abs(v - v_old) < eps else 0.0)


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_objective_matches_naive(clip):
    rng = np.random.default_rng(16)
    d = _batch(16)
    v, v_old, ret = (rng.normal(0, 1, (N, T)).astype(np.float32) for _ in range(3))
    v_old = (v + rng.normal(0, 0.3, (N, T))).astype(np.float32)
    cfg = AlgoConfig(value_clip=clip, loss_agg="token-mean")
    m = jnp.asarray(d["mask"])

    def f(x):
        return L.value_objective(cfg, x, jnp.asarray(v_old), jnp.asarray(ret), m)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(v))
    w = _row_weights(d["mask"], "token-mean")
    ref_loss, ref_grad = 0.0, np.zeros((N, T))
    for i, t in zip(*np.nonzero(d["mask"]), strict=True):
        args = float(v[i, t]), float(v_old[i, t]), float(ret[i, t])
        lv, gv = naive_value(*args, clip)
        ref_loss += w[i, t] * lv
        ref_grad[i, t] = w[i, t] * gv
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-7)
    sel = d["mask"] > 0
    ev = 1 - np.var(ret[sel] - v[sel]) / np.var(ret[sel])
    np.testing.assert_allclose(float(metrics["value/explained_variance"]), ev, rtol=1e-4)


def test_jitted_step_math_needs_no_host_transfers():
    from jaxrl_llm.rl.advantages import compute_advantages
    from jaxrl_llm.rl.algos import preset

    d = {k: jax.device_put(v) for k, v in _batch(17).items()}
    rewards = jax.device_put(np.arange(N, dtype=np.float32) % 3)
    for name in ("grpo", "dr_grpo", "gspo", "reinforce_pp", "ppo"):
        cfg = preset(name, dual_clip=3.0, entropy_coef=0.01)

        @jax.jit
        def step(d, rewards, cfg=cfg):
            adv = compute_advantages(
                cfg, rewards, d["mask"], 3, old_logp=d["old"], ref_logp=d["ref"], values=d["ent"]
            )
            den = L.loss_denominator(d["mask"], cfg.loss_agg, MAX_LEN)

            def loss(logp):
                args = (d["old"], d["sampler"], d["ref"], adv.advantages, d["mask"], d["ent"])
                return L.policy_objective(cfg, logp, *args, denominator=den, max_len=MAX_LEN)

            return jax.grad(loss, has_aux=True)(d["logp"])

        with jax.transfer_guard("disallow"):
            grad, metrics = step(d, rewards)
        assert np.all(np.isfinite(np.asarray(grad))), name


@pytest.mark.parametrize(
    "axis_type,name", [("Explicit", "grpo"), ("Explicit", "ppo"), ("Auto", "grpo")]
)
def test_step_math_on_an_8_device_mesh_equals_one_device(axis_type, name):
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxrl_llm.rl.advantages import compute_advantages
    from jaxrl_llm.rl.algos import preset
    from jaxrl_llm.rl.logprobs import token_logprobs

    if len(jax.devices()) < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py")
    rng = np.random.default_rng(18)
    n, t, dim, vocab = 16, 6, 8, 32
    data = dict(
        rewards=rng.integers(0, 2, n).astype(np.float32),  # groups of 4 straddle 2 devices
        mask=(rng.random((n, t)) > 0.3).astype(np.float32),
        hidden=rng.normal(size=(n, t, dim)).astype(np.float32),
        targets=rng.integers(0, vocab, (n, t)),
        old=rng.normal(-3, 0.3, (n, t)).astype(np.float32),
    )
    unembed = (rng.normal(size=(dim, vocab)) * 0.3).astype(np.float32)
    cfg = preset(name, entropy_coef=0.01, beta=0.02)

    def step(d, unembed):
        adv = compute_advantages(
            cfg, d["rewards"], d["mask"], 4, old_logp=d["old"], ref_logp=d["old"], values=d["old"]
        ).advantages
        den = L.loss_denominator(d["mask"], cfg.loss_agg)

        def loss(hidden, unembed):
            logp, ent = token_logprobs(hidden, unembed, d["targets"], chunk_size=4)
            args = (d["old"], d["old"], d["old"], adv, d["mask"], ent)
            return L.policy_objective(cfg, logp, *args, denominator=den)[0]

        return jax.value_and_grad(loss, argnums=(0, 1))(d["hidden"], unembed)

    expected = jax.jit(step)(data, unembed)
    axes = ("data", "fsdp", "tensor")
    mesh = jax.make_mesh((2, 2, 2), axes, axis_types=(getattr(AxisType, axis_type),) * 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    with jax.set_mesh(mesh):
        sharded = {k: jax.device_put(v, rows) for k, v in data.items()}
        vocab_parallel = jax.device_put(unembed, NamedSharding(mesh, PartitionSpec(None, "tensor")))
        got = jax.jit(step)(sharded, vocab_parallel)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "policy_loss,dual_clip", [("ppo", None), ("ppo", 3.0), ("gspo", None), ("cispo", None)]
)
def test_huge_log_ratio_gives_a_finite_gradient(policy_loss, dual_clip):
    """A log-ratio past exp's float32 range (~88) in a clipped token: without the clamp the
    loss stayed finite (max picked the clipped branch) while the gradient was NaN (the
    unselected branch's exp overflowed: 0 * inf). Now both are finite, and for the
    token-level losses every other token's gradient is what it is without that token."""
    d = _batch(20, extreme=False)
    d["mask"][:] = 1.0
    eps = 3e-4 if policy_loss == "gspo" else 0.2
    cfg = AlgoConfig(
        policy_loss=policy_loss,
        eps_low=eps,
        eps_high=eps,
        dual_clip=dual_clip,
        tis_cap=None,
        loss_agg="token-mean",
    )
    base = _objective(cfg, d, use_tis=False, use_ref=False)
    d["adv"][0, 0], d["logp"][0, 0] = 1.0, d["old"][0, 0] + 100.0  # rho = e^100, A > 0
    d["adv"][2, 1], d["logp"][2, 1] = -1.0, d["old"][2, 1] + 95.0  # rho = e^95, A < 0
    d["adv"][3, 2], d["logp"][3, 2] = 1.0, d["old"][3, 2] - 100.0  # rho = e^-100
    (loss, _), (g_lp, _) = _objective(cfg, d, use_tis=False, use_ref=False)
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(g_lp))), np.asarray(g_lp)
    if policy_loss != "gspo":  # GSPO's sequence ratio ties a row's tokens together
        g, g_base = np.asarray(g_lp), np.asarray(base[1][0])
        others = np.ones((N, T), bool)
        others[[0, 2, 3], [0, 1, 2]] = False
        np.testing.assert_allclose(g[others], g_base[others], rtol=1e-6)
    if policy_loss == "ppo":  # the clipped A > 0 token carries no gradient
        assert float(g_lp[0, 0]) == 0.0


def test_value_clipfrac_counts_only_clipped_tokens():
    """V_old + clip(V - V_old) differs from V by one ulp on many unclipped tokens; the
    clip fraction counts exactly the tokens where the clip is active and wins."""
    rng = np.random.default_rng(21)
    n, t, clip = 64, 16, 0.2
    # V_old + (V - V_old) rounds at V_old's ulp: not back to V where |V| < |V_old|.
    v = rng.normal(0, 1, (n, t)).astype(np.float32)
    v_old = (v + rng.uniform(-0.19, 0.19, (n, t))).astype(np.float32)
    ret = (v + rng.normal(0, 1, (n, t))).astype(np.float32)
    mask = np.ones((n, t), np.float32)
    cfg = AlgoConfig(value_clip=clip, loss_agg="token-mean")

    def clipfrac(v):
        args = (jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask))
        return float(L.value_objective(cfg, *args)[1]["value/clipfrac"])

    # The data does exercise the rounding: the unguarded formula calls some tokens clipped.
    unguarded = v_old + np.clip(v - v_old, -clip, clip)
    assert ((unguarded - ret) ** 2 > (v - ret) ** 2).sum() > 0
    assert clipfrac(v) == 0.0
    v2 = v.copy()
    v2[:8] = v_old[:8] + rng.choice([-1.0, 1.0], (8, t)) * rng.uniform(0.3, 2.0, (8, t))
    expected = 0
    for i, j in np.ndindex(n, t):
        vv, vo, r = float(v2[i, j]), float(v_old[i, j]), float(ret[i, j])
        if abs(vv - vo) > clip:
            vc = vo + max(-clip, min(clip, vv - vo))
            expected += (vc - r) ** 2 > (vv - r) ** 2
    assert 0 < expected < n * t
    np.testing.assert_allclose(clipfrac(v2), expected / (n * t), rtol=1e-6)


@pytest.mark.parametrize("mode", ["icepop", "decoupled"])
def test_masking_corrections_count_what_they_mask(mode):
    """icepop and decoupled give tokens outside their band weight 0 (no gradient there)
    and report the fraction; the numpy reference decides which tokens those are."""
    cfg = AlgoConfig(off_policy=mode, tis_cap=1.2, icepop_low=0.8, icepop_high=1.25)
    d = _batch(21, extreme=False)
    (_, metrics), (g_lp, _) = _objective(cfg, d, use_ref=False)
    m = d["mask"] > 0
    k = np.exp(d["old"].astype(np.float64) - d["sampler"])
    w = np.vectorize(lambda x: naive_off_policy_weight(cfg, x))(k)
    assert 0.1 < np.mean(w[m] == 0) < 0.9  # the case masks some tokens and keeps others
    np.testing.assert_allclose(float(metrics["rollout/is_masked_frac"]), np.mean(w[m] == 0))
    np.testing.assert_allclose(float(metrics["rollout/is_weight_max"]), np.max(w[m]), rtol=1e-5)
    assert np.all(np.asarray(g_lp)[m & (w == 0)] == 0.0)
    _, ref_g_lp, _ = naive_policy(cfg, d, use_ref=False)
    np.testing.assert_allclose(np.asarray(g_lp), ref_g_lp, rtol=2e-4, atol=1e-6)

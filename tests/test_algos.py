"""AlgoConfig validation and the named presets, checked against ALGORITHMS.md's table."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm.rl import algos
from jaxrl_llm.rl.algos import AlgoConfig, preset

# The presets as ../shared/ALGORITHMS.md states them (written out here, not read from code).
EXPECTED = {
    "grpo": dict(
        advantage="grpo",
        adv_scale="group",
        policy_loss="ppo",
        eps_low=0.2,
        eps_high=0.2,
        beta=0.04,
        kl_estimator="k3",
        kl_in_reward=False,
        loss_agg="seq-mean-token-mean",
    ),
    "dr_grpo": dict(
        advantage="grpo", adv_scale="none", beta=0.0, loss_agg="seq-mean-token-sum-norm"
    ),
    "dapo": dict(
        eps_low=0.2,
        eps_high=0.28,
        loss_agg="token-mean",
        beta=0.0,
        dynamic_sampling=True,
        overlong_penalty=True,
    ),
    "gspo": dict(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "rloo": dict(advantage="rloo", policy_loss="ppo", eps_low=0.2, loss_agg="token-mean"),
    "reinforce_pp": dict(
        advantage="reinforce_pp",
        policy_loss="ppo",
        loss_agg="token-mean",
        kl_in_reward=True,
        kl_estimator="k1",
        whiten_advantages=True,
    ),
    "ppo": dict(advantage="gae", gamma=1.0, lam=0.95, kl_in_reward=True, value_clip=0.2),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_match_the_paper_table(name):
    cfg = preset(name)
    assert cfg.name == name
    for field, value in EXPECTED[name].items():
        assert getattr(cfg, field) == value, (name, field)


def test_ppo_preset_trains_a_critic_with_warmup():
    cfg = preset("ppo")
    assert cfg.uses_critic and cfg.critic_warmup_steps > 0
    assert not preset("grpo").uses_critic
    assert preset("grpo").needs_ref and not preset("dapo").needs_ref


def test_overrides_apply_and_are_validated():
    cfg = preset("dapo", entropy_coef=1e-3, reward_weights=[1, 0.5])
    assert (cfg.entropy_coef, cfg.reward_weights) == (1e-3, (1.0, 0.5))
    assert cfg.eps_high == 0.28
    with pytest.raises(ValueError, match=r"^algo\.eps_low=1\.5: must be in \[0, 1\)$"):
        preset("grpo", eps_low=1.5)
    with pytest.raises(ValueError, match="algo.nonsense"):
        preset("grpo", nonsense=1)


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError) as err:
        preset("grpoo")
    message = str(err.value)
    assert "grpoo" in message and "\n" not in message
    for name in EXPECTED:
        assert name in message


@pytest.mark.parametrize(
    "field,value",
    [
        ("advantage", "a2c"),
        ("adv_scale", "global"),
        ("policy_loss", "trpo"),
        ("kl_estimator", "k4"),
        ("loss_agg", "mean"),
        ("eps_low", -0.1),
        ("eps_low", 1.0),
        ("eps_high", -0.1),
        ("dual_clip", 1.0),
        ("tis_cap", 0.0),
        ("beta", -0.01),
        ("gamma", 1.1),
        ("lam", -0.5),
        ("num_iterations", 0),
        ("value_clip", 0.0),
        ("critic_warmup_steps", -1),
        ("overlong_buffer_frac", 0.0),
        ("max_resample_rounds", -1),
        ("adv_eps", -1e-3),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=rf"^algo\.{field}=") as err:
        AlgoConfig(**{field: value})
    assert "\n" not in str(err.value)


def test_group_estimators_need_two_samples():
    """G is the rollout's (num_generations), checked against the estimator in one place."""
    for kind in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=r"^num_generations=1: .*needs >= 2$"):
            algos.check_num_generations(AlgoConfig(advantage=kind), 1)
        algos.check_num_generations(AlgoConfig(advantage=kind), 2)
    algos.check_num_generations(AlgoConfig(advantage="gae"), 1)
    with pytest.raises(ValueError, match="num_generations=1"):
        algos.check_num_generations(AlgoConfig(decouple_rewards=True), 1)
    with pytest.raises(ValueError, match=r"algo\.decouple_rewards"):
        AlgoConfig(advantage="rloo", decouple_rewards=True)
    fields = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert not fields & {"group_size", "max_completion_len", "num_generations"}


def test_config_is_frozen_hashable_and_a_static_jit_argument():
    cfg = preset("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 0.0
    assert hash(cfg) == hash(preset("grpo"))
    fn = jax.jit(lambda c, x: x * c.beta, static_argnums=0)
    assert float(fn(cfg, jnp.float32(2.0))) == pytest.approx(0.08)


def test_every_preset_is_documented():
    for name in algos.PRESETS:
        assert f"  {name} " in algos.__doc__

"""The checks of a run config, one per section, run before anything is loaded or compiled.

    config.validate(raw)   # raises ConfigError naming the key, e.g.
    # rollout.batch_size=6 is not divisible by mesh data x fsdp x expert = 4
    # rollout.batchsize: unknown key; did you mean rollout.batch_size?

This module holds the entry (`validate`, every section's check in order) and the check of
the key names (`check_keys`); the sections' own checks live by topic beside it:
`checks_model` (mesh, model, LoRA, the model's context), `checks_rollout` (rollout and
its engine), `checks_rewards` (algorithm, teacher, rewards and judges, environments,
agents) and `checks_train` (optimizer, train loop, eval, checkpoints, data).

No check touches the network: a hub model name is accepted by its form, and what needs the
model's own config (its context length) is checked here only for local models; the
trainer checks the rest with `checks_model.check_context` once the model is loaded, still
before anything compiles.
"""

from __future__ import annotations

import difflib

import jax
import ml_collections

from jaxrl_llm.config.checks_model import check_context, check_mesh, check_model
from jaxrl_llm.config.checks_rewards import (
    check_agent,
    check_algo,
    check_env,
    check_rewards,
    check_teacher,
)
from jaxrl_llm.config.checks_rollout import check_rollout
from jaxrl_llm.config.checks_train import (
    check_checkpoint,
    check_data,
    check_eval,
    check_optim,
    check_train,
)
from jaxrl_llm.config.defaults import base_config
from jaxrl_llm.config.derived import ConfigError

# Sections whose keys are the user's own names.
FREE_FORM = (
    "rewards",
    "data.fields",
    "data.options",
    "env.options",
    "teacher.paths",
    "agent.options",
)


def validate(config, num_devices: int | None = None, process_count: int = 1):
    """Every section's check; raises ConfigError naming the first bad key. -> the model's
    `models.ModelConfig` where the model is local (read once, for `prepare`), else None."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    check_keys(config, base_config())
    mesh_shape = check_mesh(config, num_devices)
    path = check_model(config)
    check_rollout(config, mesh_shape, process_count)
    check_teacher(config)  # before the algo, which takes teacher.weight
    algo = check_algo(config)
    check_optim(config)
    labels = check_rewards(config, algo)
    check_env(config, algo)
    check_agent(config, algo, process_count)
    check_train(config)
    check_eval(config, labels)
    check_checkpoint(config)
    check_data(config)
    if path is None:
        return None
    from jaxrl_llm import models

    model_cfg = models.builtin.model_config(path)
    check_context(config, model_cfg)
    return model_cfg


def check_keys(config, defaults, prefix: str = "") -> None:
    """Every key of `config` exists in `defaults` (sections recursively, FREE_FORM ones
    excepted); an unknown one is named with the closest known key."""
    for key in config.keys():
        name = prefix + key
        if key not in defaults:
            known = list(defaults.keys())
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {sorted(known)}"
            raise ConfigError(f"{name}: unknown key; {hint}")
        value, default = config[key], defaults[key]
        if isinstance(default, ml_collections.ConfigDict) and name not in FREE_FORM:
            if not isinstance(value, ml_collections.ConfigDict | dict):
                raise ConfigError(f"{name}: expected a section, got {value!r}")
            check_keys(value, default, name + ".")

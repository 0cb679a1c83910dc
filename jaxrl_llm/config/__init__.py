"""Run configs: every knob with its default (`defaults`), the checks that stop a bad one
before anything loads (`checks`), what the trainer derives from it (`derived`), the speed
settings picked at start-up (`tuning`), a config's model shapes without a download
(`model_shapes`), and `prepare`, the one entry that does all of it.

    from jaxrl_llm import config
    c = config.base_config()             # experiment files start here
    prepared = config.prepare(c)         # checked, model config read, speed settings picked

Nothing here imports the trainer or the start-up layer.
"""

from jaxrl_llm.config.checks import validate
from jaxrl_llm.config.defaults import base_config, default_compilation_cache_dir
from jaxrl_llm.config.derived import (
    MESH_AXES,
    ConfigError,
    algo_config,
    lora_config,
    mesh_axes,
    model_runtime,
    resolve_model_path,
    rollout_spec,
    split_devices,
    stop_ids,
)
from jaxrl_llm.config.prepared import Prepared, prepare

__all__ = [
    "MESH_AXES",
    "ConfigError",
    "Prepared",
    "algo_config",
    "base_config",
    "default_compilation_cache_dir",
    "lora_config",
    "mesh_axes",
    "model_runtime",
    "prepare",
    "resolve_model_path",
    "rollout_spec",
    "split_devices",
    "stop_ids",
    "validate",
]

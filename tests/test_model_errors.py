"""Bad checkpoints and configs: each one clear error naming what is wrong."""

import json

import numpy as np
import pytest
import safetensors.numpy
from hf_reference import hf_config, hf_model

from jaxrl_llm import models
from jaxrl_llm.models import safetensors_io


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    hf_model("qwen2").save_pretrained(d)
    return d


def copy_with(src, dst, edit_tensors=None, edit_config=None):
    """A copy of the model dir with tensors and/or config.json edited."""
    dst.mkdir()
    ckpt = safetensors_io.Checkpoint(src)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names()}
    if edit_tensors:
        edit_tensors(tensors)
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor(good_dir, tmp_path):
    d = copy_with(good_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        models.CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias' is missing"
    ):
        models.load_hf(d)


def test_wrong_shape(good_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    d = copy_with(good_dir, tmp_path / "m", shrink)
    with pytest.raises(
        models.CheckpointError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[95, 64\], "
        r"expected \[96, 64\]",
    ):
        models.load_hf(d)


def test_unexpected_tensor_is_not_ignored(good_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((3,), np.float32)

    d = copy_with(good_dir, tmp_path / "m", add)
    with pytest.raises(models.CheckpointError, match=r"unexpected tensor 'model\.layers\.0\."):
        models.load_hf(d)


def test_shape_mismatch_from_config(good_dir, tmp_path):
    d = copy_with(good_dir, tmp_path / "m", edit_config=lambda c: c.update(intermediate_size=128))
    with pytest.raises(
        models.CheckpointError,
        match=r"mlp\.(gate|up|down)_proj\.weight' has shape \[\d+, \d+\], "
        r"expected \[(128, 64|64, 128)\] from config\.json",
    ):
        models.load_hf(d)


def test_unknown_architecture(good_dir, tmp_path):
    d = copy_with(
        good_dir, tmp_path / "m", edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(
        models.UnsupportedModelError,
        match=r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM",
    ):
        models.load_hf(d)


def test_missing_config_json(good_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json in the model directory"):
        models.load_hf(tmp_path)


def test_missing_weights(tmp_path):
    hf_config("qwen2").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        models.load_hf(tmp_path)


def test_unsupported_dtype(good_dir, tmp_path):
    def quantize(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int8)

    d = copy_with(good_dir, tmp_path / "m", quantize)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has dtype I8"):
        models.load_hf(d)


@pytest.mark.parametrize(
    "arch,change,message",
    [
        ("mistral", {"sliding_window": 32}, r"sliding-window attention \(sliding_window=32\)"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, r"sliding-window"),
        ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ("llama", {"mlp_bias": True}, r"mlp_bias"),
        ("qwen3", {"num_experts": 8}, r"mixture-of-experts"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rope type 'yarn' is not supported; supported: default, linear, llama3",
        ),
    ],
)
def test_unsupported_options_refused(arch, change, message):
    d = hf_config(arch).to_dict()
    d["architectures"] = [
        {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
        }[arch]
    ]
    d.update(change)
    if "rope_scaling" in change:
        d.pop("rope_parameters", None)
    with pytest.raises(models.UnsupportedModelError, match=message):
        models.ModelConfig.from_hf_dict(d)


def test_moe_architectures_refused_or_checked():
    """Another MoE family is refused naming it (and the supported list); a Qwen3-MoE
    config without experts is refused naming the key."""
    with pytest.raises(models.UnsupportedModelError, match=r"'MixtralForCausalLM'.*Qwen3Moe"):
        models.ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"]})
    with pytest.raises(models.UnsupportedModelError, match=r"num_experts=0 .*Qwen3Moe"):
        models.ModelConfig.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"]})


def test_transformers4_config_layout():
    """4.x configs spell RoPE as top-level rope_theta + rope_scaling with `type`."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = models.ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 500000.0 and cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3"

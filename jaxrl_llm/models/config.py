"""ModelConfig: the decoder's hyperparameters, one frozen dataclass for every supported
architecture, checked when built (`config_checks`), and the counts derived from them
(parameters, layer segments, KV sharing, rotary dimensions).

One config class covers every supported architecture; the differences between them are a
handful of flags (qkv bias, q/k RMSNorm, tied embeddings, RoPE scaling) and, for Gemma 3,
its layer pattern (sliding-window and global layers, each kind with its own RoPE base).
Qwen3-MoE and GLM-4.5 (`Glm4MoeForCausalLM`, DeepSeek-V3's routing on GQA attention with
partial rotary embeddings) add their mixture-of-experts MLP (`num_experts` > 0,
`models.moe`), with the dense-MLP layers their configs name (`dense_layers`).

A config is read from and written to a Hugging Face `config.json` through
`ModelConfig.from_hf_dir` / `from_hf_dict` / `to_hf_dict`; the per-architecture
translation and the refusal of options the decoder does not implement live in
`models.hf_config`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from jaxrl_llm.models import param_count
from jaxrl_llm.models.config_checks import check
from jaxrl_llm.models.hf_config import (
    GEMMA3,
    GEMMA4,
    SUPPORTED_ARCHITECTURES,
    fields_from_hf,
    hf_dict,
    load_config_json,
)

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections LoRA can adapt


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


class Segment(NamedTuple):
    """A run of consecutive alike layers [start, stop): its MLP stack (`mlp`:
    `ModelConfig.mlp_kinds`, True the experts, False the dense MLP, "double" Gemma 4's
    double-wide one); its attention kind (`linear`: Gated DeltaNet; `wide`: Gemma 4's
    full attention with its own head size) and the index of `start` among the layers of
    that kind (`first_attn`); its part in KV sharing (`share`: `ModelConfig.kv_sharing`).
    Which rows of each stacked parameter the run reads: `segments.stacked_over`."""

    start: int
    stop: int
    mlp: bool | str = False
    linear: bool = False
    first_attn: int = 0
    wide: bool = False
    share: tuple[str, str] | None = None

    @property
    def attn(self) -> str:
        """The run's attention kind (`ModelConfig.attention_kinds`)."""
        return "linear" if self.linear else "wide" if self.wide else "softmax"


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
    # Gemma 3 / 4: `layer_types[i]` is "sliding_attention" (a key is seen only from queries
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
    # best of `n_group` expert groups, weights times `routed_scaling_factor`) or
    # "topk_softmax" (GPT-OSS: the top-k of the logits plus `router_bias`, weighted by
    # the softmax over those k) or "gemma4" (Gemma 4's MoE block, `enable_moe_block`: the
    # router reads the residual stream RMS-normed and scaled, its renormalised top-k
    # weights times a learned scale per expert; the experts run beside the layer's dense
    # GeGLU of width `intermediate_size`, each branch with its own norms), see
    # `models.moe`. `n_shared_experts`: a dense SwiGLU
    # of width n * moe_intermediate_size every token goes through besides (GLM-4.5).
    # `dense_layers`: indices of the layers whose MLP is the dense one of width
    # `intermediate_size` (GLM-4.5's first `first_k_dense_replace`, Qwen3-MoE's
    # `mlp_only_layers` / `decoder_sparse_step`).
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
    # GPT-OSS: `attention_sinks`, a learned logit per query head in every softmax
    # denominator (a key no query position owns, with a zero value); `expert_bias`, biases
    # on the router's logits and on each expert's three projections; `swiglu_limit` > 0,
    # the experts' clamped SwiGLU: (clip(up, -l, l) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, l), alpha = `swiglu_alpha` (0: the plain silu(gate) * up).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # Qwen3.5: `layer_types[i]` "linear_attention" is a Gated DeltaNet layer
    # (`models.gated_deltanet`): `linear_num_key_heads` query/key heads of
    # `linear_key_head_dim`, `linear_num_value_heads` value heads of
    # `linear_value_head_dim`, a causal depthwise convolution of `linear_conv_kernel`
    # taps. The full-attention layers multiply their output by sigmoid of a per-head gate
    # projected with q (`attn_output_gate`). `zero_centered_norm`: every RMSNorm but the
    # DeltaNet's output norm scales by (1 + weight), as Gemma's. Qwen3.5-MoE's shared
    # expert has its own width (`shared_expert_size`) and a sigmoid gate [D] -> 1.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    # Gemma 4: the logits z become c tanh(z / c), c = `final_logit_softcapping` (None: as
    # they are), wherever they are computed (`transformer.project`, `rl.token_logprobs`).
    final_logit_softcapping: float | None = None
    # Gemma 4's full-attention layers with a head size and KV head count of their own
    # (`global_head_dim`, `global_kv_heads`; None: the sliding layers' `head_dim` /
    # `num_kv_heads`, and one stack of attention parameters for every layer). `k_eq_v`
    # (transformers' `attention_k_eq_v`): those layers have no value projection, their
    # values are the key projection's output (RMS-normed without a weight, not rotated).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    # Gemma 4's per-layer input embeddings (transformers' `hidden_size_per_layer_input`
    # P > 0, `vocab_size_per_layer_input` Vp): each layer adds
    # norm(out(gelu(gate(x)) * e_l)) to its output, e_l [P] its slice of the token's own
    # embedding [Vp, L * P] mixed with a projection of the token's input embedding
    # (`layers.Transformer.per_layer_inputs`). 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Gemma 4's KV sharing (transformers' `num_kv_shared_layers`): the last
    # `kv_shared_layers` layers project no keys/values of their own and attend over those
    # of the last earlier layer of their type (`kv_sharing`), so they keep no KV cache.
    # `double_wide_mlp`: those layers' dense MLP is twice `intermediate_size` wide.
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
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
    # Gated DeltaNet: tokens per chunk of the chunked (parallel) form of the recurrence
    # (training, reference, prefill); memory O(T * chunk), a scan over T / chunk chunks.
    linear_chunk: int = 64
    # How the chunked form runs: "xla", "pallas" (the TPU kernel, `deltanet_kernel`;
    # interpret mode elsewhere) or "auto" (pallas on one TPU chip, else xla). See
    # `LINEAR_IMPLS`.
    linear_impl: str = "auto"
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        check(self)  # one error naming the key of fields that do not fit together

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def gemma(self) -> bool:
        """Gemma 3's and Gemma 4's shared traits: embeddings times sqrt(hidden), norms after
        attention and after the MLP as well as before, GeGLU (tanh-approximated GELU)
        instead of SwiGLU."""
        return self.architecture in (GEMMA3, GEMMA4)

    @property
    def gemma4(self) -> bool:
        """Gemma 4's own traits: RMSNorm scaling by the weight (Gemma 3's by 1 + weight),
        values RMS-normed without a weight, scores not scaled (q and k are RMS-normed;
        `query_pre_attn_scalar` unused), each layer's output times its `layer_scalar`."""
        return self.architecture == GEMMA4

    @property
    def centered_norm(self) -> bool:
        """RMSNorm scales by (1 + weight) (Gemma 3, Qwen3.5), else by the weight."""
        return self.architecture == GEMMA3 or self.zero_centered_norm

    @property
    def local_rope(self) -> bool:
        """Sliding-window layers have a RoPE of their own (Gemma: base `rope_local_theta`,
        unscaled); else every layer's RoPE is the global one (GPT-OSS)."""
        return self.gemma

    @property
    def hybrid(self) -> bool:
        """Some layers are Gated DeltaNet linear attention (Qwen3.5)."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """Per layer: it is a Gated DeltaNet layer (else full attention)."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(t == "linear_attention" for t in types)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's convolution: q, k (key heads) and v (value heads)."""
        k = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * k + self.linear_num_value_heads * self.linear_value_head_dim

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

    @property
    def split_attention(self) -> bool:
        """Gemma 4 whose full-attention layers have their own head size, KV heads or
        keys-as-values: their attention parameters, KV cache and pages are stacks of their
        own ("wide"), apart from the sliding layers' ("softmax")."""
        return self.global_head_dim is not None

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        """Per layer, the stack its attention parameters and cache rows belong to:
        "linear" (Gated DeltaNet), "wide" (`split_attention`'s full layers) or "softmax"."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        if self.split_attention:
            return tuple("wide" if t == "full_attention" else "softmax" for t in types)
        return tuple("linear" if t == "linear_attention" else "softmax" for t in types)

    @property
    def full_head_dim(self) -> int:
        """The head size of the full-attention layers."""
        return self.global_head_dim or self.head_dim

    @property
    def full_kv_heads(self) -> int:
        """The KV heads of the full-attention layers."""
        return self.global_kv_heads or self.num_kv_heads

    @property
    def kv_per_token(self) -> int:
        """Elements of keys and values a token keeps in a KV cache, over the layers of
        softmax attention (each kind with its own heads and head size) that are not
        KV-shared."""
        n = self.cache_layers("softmax") * self.num_kv_heads * self.head_dim
        return 2 * (n + self.cache_layers("wide") * self.full_kv_heads * self.full_head_dim)

    @property
    def kv_sharing(self) -> tuple[tuple[str, str] | None, ...]:
        """Per layer (`kv_shared_layers`): ("reuse", type) for a layer that attends over
        the keys/values of the last earlier layer of its type ("sliding_attention" or
        "full_attention"), ("store", type) for that earlier layer, else None (as
        transformers' `kv_sharing_modes`)."""
        n, L = self.kv_shared_layers, self.num_layers
        if not n:
            return (None,) * L
        types = self.layer_types or ("full_attention",) * L
        out: list = [None] * (L - n) + [("reuse", t) for t in types[L - n :]]
        for i in range(L - n, L):
            out[self.kv_source(i)] = ("store", types[i])
        return tuple(out)

    def kv_source(self, i: int) -> int:
        """The layer whose keys/values layer i attends over: i itself, or for a shared
        layer the last layer of its type before the shared ones."""
        first = self.num_layers - self.kv_shared_layers
        if i < first:
            return i
        types = self.layer_types or ("full_attention",) * self.num_layers
        return max(j for j in range(first) if types[j] == types[i])

    @property
    def mlp_kinds(self) -> tuple[bool | str, ...]:
        """Per layer, the stack its MLP parameters belong to: True (the experts), False
        (the dense MLP) or "double" (Gemma 4's double-wide MLP of a KV-shared layer)."""
        double = self.double_wide_mlp
        return tuple(
            "double" if double and share and share[0] == "reuse" else sparse
            for sparse, share in zip(self.sparse_layers, self.kv_sharing, strict=True)
        )

    def cache_layers(self, kind: str = "softmax") -> int:
        """Layers of attention kind `kind` that keep keys/values in a KV cache or page
        pool (all of that kind but the KV-shared ones)."""
        return sum(
            k == kind and not (s and s[0] == "reuse")
            for k, s in zip(self.attention_kinds, self.kv_sharing, strict=True)
        )

    def layer_segments(self) -> tuple[Segment, ...]:
        """The runs of consecutive layers with the same MLP kind, attention kind and part
        in KV sharing (`Segment`; a storing layer is a run of its own). One run for a model
        whose layers are all alike. The layer loop scans each run over its parameters,
        which the layers of one kind share in a stack of their own."""
        runs, seen = [], {}
        kinds = zip(self.mlp_kinds, self.attention_kinds, self.kv_sharing, strict=True)
        for i, kind in enumerate(kinds):
            last = runs[-1] if runs else None
            store = kind[2] is not None and kind[2][0] == "store"
            if last and (last.mlp, last.attn, last.share) == kind and not store:
                runs[-1] = last._replace(stop=i + 1)
            else:
                first_attn = seen.get(kind[1], 0)
                linear, wide = kind[1] == "linear", kind[1] == "wide"
                runs.append(Segment(i, i + 1, kind[0], linear, first_attn, wide, kind[2]))
            seen[kind[1]] = seen.get(kind[1], 0) + 1
        return tuple(runs)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_intermediate_size(self) -> int:
        """The width of the dense MLP every token of an MoE layer goes through besides its
        experts: the shared experts', or Gemma 4's dense GeGLU (`intermediate_size`)."""
        if self.router == "gemma4":
            return self.intermediate_size
        if self.shared_expert_size:
            return self.shared_expert_size * self.n_shared_experts
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def windowed(self) -> bool:
        """Some layers attend within a sliding window (then each layer reads its kind)."""
        return self.layer_types is not None and "sliding_attention" in self.layer_types

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count, as `sum(p.size for p in params)` would give
        (`param_count.num_params`)."""
        return param_count.num_params(self, include_embeddings)

    def active_params(self, include_embeddings: bool = True) -> int:
        """Parameters one token reads (`param_count.active_params`)."""
        return param_count.active_params(self, include_embeddings)

    # ----------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, **runtime) -> ModelConfig:
        """Reads `<path>/config.json`."""
        d, config_path = load_config_json(path)
        return cls.from_hf_dict(d, source=config_path, **runtime)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json", **runtime) -> ModelConfig:
        """Builds the config from a HF config dict, refusing what the decoder lacks
        (`hf_config.fields_from_hf`)."""
        return cls(**fields_from_hf(d, source), **runtime)

    def to_hf_dict(self) -> dict:
        """The HF config dict: the original one when loaded from HF, else built from fields
        (`hf_config.hf_dict`)."""
        return hf_dict(self)

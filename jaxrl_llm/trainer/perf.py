"""Throughput accounting: model FLOPs and a matmul peak measured on the device in use.

MFU everywhere in jaxrl_llm = model FLOPs / seconds / the measured matmul peak
(`startup.peak.matmul_peak`), where model FLOPs count the matmuls of the parameters (2
per parameter per token forward, 6 forward + backward; for a mixture of experts the
active parameters only: router and k experts), the attention scores and values, and the
unembedding only at the positions whose log-probs are used; the peak is measured on the
device in use, so the ratio says how close a step is to what this device's matmul unit
can do, not to a datasheet number. The trainer keeps the measurement next to its
compilation cache (`startup.peak`): a rerun on the same machine starts without
measuring, and its MFU has the same denominator.
"""

from __future__ import annotations

import time

import jax


class PhaseClock:
    """Wall-clock seconds of a step's phases, each measured up to the moment the host
    waited for it: `wait(name, arrays)` blocks until `arrays` are ready and charges the
    time since the previous mark to `name`; `mark(name)` charges it without waiting."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def wait(self, name: str, arrays) -> None:
        if arrays is not None:
            jax.block_until_ready(arrays)
        self.mark(name)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


def layer_matmul_params(model_cfg) -> int:
    """Parameters of the decoder layers that take part in a token's matmuls (no norms, no
    biases). Mixture of experts: the active ones, the router and the k experts a token
    goes through (not the E - k idle ones) and the shared experts, in the sparse layers;
    the dense-MLP layers of an MoE model (`dense_layers`) count their dense MLP; Gemma 4's
    per-layer inputs, their projection from the embedding and each layer's gate and
    projection; its KV-shared layers without keys and values, their MLP double-wide
    where it is. So MoE FLOPs and MFU count the work done."""
    c = model_cfg
    D = c.hidden_size
    q_heads = c.num_heads * (2 if getattr(c, "attn_output_gate", False) else 1)

    def attn(head_dim, kv_heads, kv_proj=2):  # q, k, v (kv_proj 1: keys as values), o
        return D * head_dim * (q_heads + c.num_heads + kv_proj * kv_heads)

    n_linear = sum(getattr(c, "linear_layers", ()))
    wide = _wide_layers(c)  # Gemma 4's full layers of their own head size
    mixers = (c.num_layers - n_linear - wide) * attn(c.head_dim, c.num_kv_heads)
    if wide:
        mixers += wide * attn(c.full_head_dim, c.full_kv_heads, 1 if c.k_eq_v else 2)
    if getattr(c, "kv_shared_layers", 0):  # Gemma 4's KV-shared layers: no k, v of their own
        shared = c.num_layers - wide - c.cache_layers()
        mixers -= shared * D * c.head_dim * 2 * c.num_kv_heads
        kv_proj = (1 if c.k_eq_v else 2) * c.full_kv_heads
        mixers -= (wide - c.cache_layers("wide")) * D * c.full_head_dim * kv_proj
    if n_linear:  # Gated DeltaNet: in_proj_qkv / z / a / b and out_proj
        value = c.linear_num_value_heads * c.linear_value_head_dim
        mixers += n_linear * D * (c.linear_conv_dim + 2 * value + 2 * c.linear_num_value_heads)
    dense_mlp = 3 * D * c.intermediate_size
    mixers += dense_mlp * list(getattr(c, "mlp_kinds", ())).count("double")  # twice as wide
    P = getattr(c, "per_layer_input_size", 0)  # Gemma 4: the model's projection, each layer's
    mixers += 3 * D * P * c.num_layers
    if getattr(c, "moe", False):
        width = c.num_experts_per_tok * c.moe_intermediate_size + c.shared_intermediate_size
        sparse, n = D * c.num_experts + 3 * D * width, c.num_sparse_layers
        sparse += D if getattr(c, "shared_expert_gate", False) else 0
        return mixers + n * sparse + (c.num_layers - n) * dense_mlp
    return mixers + c.num_layers * dense_mlp


def _wide_layers(c) -> int:
    """Layers with their own head size (`ModelConfig.split_attention`), else 0."""
    return getattr(c, "attention_kinds", ()).count("wide")


def forward_flops(model_cfg, positions: float, context: float, unembedded: float) -> float:
    """Model FLOPs of a forward over `positions` tokens whose mean attention context is
    `context` keys, with the output projection applied at `unembedded` of them.

    Matmuls of the parameters (2 per parameter per token) + attention scores and values
    (4 * heads * head_dim per key per full-attention layer; a Gated DeltaNet layer's
    recurrence 7 * Dk * Dv per value head and its convolution, whatever the context) +
    the unembedding (2 * vocab * hidden per
    projected token). The embedding lookup is not a matmul and is not counted.
    """
    c = model_cfg
    n_linear, wide = sum(getattr(c, "linear_layers", ())), _wide_layers(c)
    attn = 4 * (c.num_layers - n_linear - wide) * c.num_heads * c.head_dim * context
    attn += 4 * wide * c.num_heads * getattr(c, "full_head_dim", 0) * context
    if n_linear:  # the delta rule per token and value head: decay, read, update, query
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        attn += n_linear * (7 * state + 2 * c.linear_conv_kernel * c.linear_conv_dim)
    per_token = 2 * layer_matmul_params(c) + attn
    return positions * per_token + unembedded * 2 * c.vocab_size * c.hidden_size


def step_flops(
    model_cfg,
    *,
    rows: int,
    prompts: int,
    prompt_len: float,
    new_tokens: float,
    reference: bool,
    update_forwards: int,
    reference_shares_prompts: bool = False,
    update_shared_forwards: int = 0,
) -> dict[str, float]:
    """Model FLOPs of one RL step, by phase: the least math the step needs.

    prompt_len / new_tokens: mean real (unpadded) tokens per prompt / completion, so the
    floor does not count padding. sample: one prefill per prompt (groups share it; one
    projected position) + a decode forward per generated token after the first; a
    sequence forward (reference, old policy, update) runs over prompt + completion minus
    its last token and projects only the completion positions; the update costs
    `update_forwards` of those (`UpdateFn.forward_passes`: 3 per forward + backward pass,
    +1 when old-policy log-probs are recomputed). reference_shares_prompts: the reference
    forward reads each prompt once (`rl.prefix.shared_prompt_logprobs`), then the
    completions of every row against it; update_shared_forwards: how many of the
    update's forwards do the same (`UpdateFn.shared_prompt_passes`).
    """
    P, T = float(prompt_len), float(new_tokens)
    prefill = prompts * forward_flops(model_cfg, P, (P + 1) / 2, 1)
    decode = rows * forward_flops(model_cfg, max(T - 1, 0), P + T / 2, max(T - 1, 0))
    seq = rows * forward_flops(model_cfg, P + T - 1, (P + T) / 2, T)
    completions = rows * forward_flops(model_cfg, max(T - 1, 0), P + T / 2, T)
    shared = prompts * forward_flops(model_cfg, P, (P + 1) / 2, 0) + completions
    ref = shared if reference_shares_prompts else seq
    return {
        "sample": prefill + decode,
        "reference": ref if reference else 0.0,
        "update": seq * (update_forwards - update_shared_forwards)
        + shared * update_shared_forwards,
    }

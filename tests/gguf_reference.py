"""GGUF files written the way llama.cpp's `convert_hf_to_gguf.py` writes them, with the
`gguf` package: the test side of the GGUF loader, independent of `jaxrl_llm.models.gguf_io`
(tensor names from `gguf.get_tensor_name_map`, metadata from `GGUFWriter.add_*`)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
# Byte offsets of the fp16 scale fields in one block (ggml-common.h block_q*).
_HALF_FIELDS = {
    Q.Q5_0: (0,),
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q6_K: (208,),
}
# Scale magnitudes that keep dequantized values O(0.1) (max |quant x sub-scale| per type).
_HALF_SCALE = {Q.Q5_0: 1e-2, Q.Q8_0: 1e-3, Q.Q4_0: 1e-2, Q.Q4_1: 1e-2, Q.Q4_K: 1e-4, Q.Q6_K: 2e-5}


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF's rotary halves -> adjacent pairs, per head."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random quantized blocks with finite, small fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[qtype]:
        half = rng.uniform(0.5, 1.5, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        half = (half * _HALF_SCALE[qtype]).astype(np.float16)
        raw[..., offset : offset + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def add_tensor(writer: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: Q, seed: int = 0):
    """A float [rows, cols] (or [n]) tensor stored as `qtype`; 1-D tensors stay F32, as
    llama.cpp keeps norms and biases; K-quants are random blocks of x's shape."""
    if x.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, x.astype(np.float32))
    elif qtype in (Q.Q4_K, Q.Q6_K):
        writer.add_tensor(name, random_blocks(qtype, *x.shape, seed=seed), raw_dtype=qtype)
    elif qtype == Q.F16:
        writer.add_tensor(name, x.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)


def write_model(
    model, path, arch: str, qtype: Q, arch_name: str | None = None, skip: str = "", edit=None
) -> None:
    """A transformers model as a GGUF file: hyperparameters as metadata, weights as `qtype`
    (Q/K rows permuted for llama). `arch_name` overrides `general.architecture`; the HF
    tensor `skip` is left out; `edit(writer)` adds metadata."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "qwen3":  # llama.cpp's Qwen3 reads head_dim from the key/value lengths
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    if edit is not None:
        edit(w)
    names = gguf.get_tensor_name_map(ARCHS[arch], c.num_hidden_layers)
    for k, (name, t) in enumerate(model.state_dict().items()):
        if name == skip or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        x = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = llama_permute(x, c.num_attention_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = llama_permute(x, c.num_key_value_heads)
        add_tensor(w, names.get_name(name, try_suffixes=(".weight", ".bias")), x, qtype, seed=k)
    _close(w)


MOE_ARCHS = {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "glm4moe": gguf.MODEL_ARCH.GLM4_MOE}


def write_moe_model(model, path, arch: str, nextn: int = 0) -> None:
    """A transformers Qwen3-MoE or GLM-4.5 model as an F32 GGUF file, as llama.cpp's
    converter writes it: each layer's experts stacked in one tensor per projection
    (`ffn_{gate,up,down}_exps` [E, rows, cols]), the expert metadata under its keys.
    glm4moe: `nextn` multi-token-prediction blocks counted in `block_count`, one tensor
    of each written after the decoder's layers."""
    c = model.config
    layers = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers + nextn)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
    else:
        factor = c.rope_parameters.get("partial_rotary_factor", 0.5)
        w.add_rope_dimension_count(int(c.head_dim * factor))
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_nextn_predict_layers(nextn)
    names = gguf.get_tensor_name_map(MOE_ARCHS[arch], layers + nextn)
    for name, t in model.state_dict().items():
        x = t.float().numpy()
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows, then up
            f = x.shape[1] // 2
            w.add_tensor(names.get_name(prefix + ".gate_proj") + ".weight", x[:, :f].copy())
            w.add_tensor(names.get_name(prefix + ".up_proj") + ".weight", x[:, f:].copy())
        elif name.endswith("e_score_correction_bias"):  # llama.cpp: exp_probs_b.bias
            w.add_tensor(names.get_name(name.removesuffix("_bias")) + ".bias", x)
        elif name.endswith("mlp.experts.down_proj"):
            w.add_tensor(names.get_name(name) + ".weight", x)
        else:
            w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    for k in range(nextn):  # a multi-token-prediction block the decoder does not use
        w.add_tensor(f"blk.{layers + k}.nextn.eh_proj.weight", np.ones((4, 8), np.float32))
    _close(w)


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): GPT-2's 256 byte symbols, a few merges, three control
    tokens, as a byte-level BPE GGUF vocabulary spells them."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = sorted(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ is", "1 2", "W h", "a t", "Wh at"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials)
    return tokens + specials, merges, [int(t) for t in types]


def write_tokenizer(path) -> None:
    """A GGUF file holding only a byte-level BPE tokenizer with a ChatML chat template."""
    tokens, merges, types = byte_level_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    _close(w)


def write_tensors(path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    """A GGUF file holding only tensors {name: (raw data, type)} (already in their type)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    _close(w)


def _close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

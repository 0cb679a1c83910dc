"""Rollout generation: a resumable, jitted prefill / decode / append over the KV cache.

from jaxrl_llm import sampling
spec = sampling.RolloutSpec(num_generations=8, max_new_tokens=64, stop_ids=(eos,))
sampler = sampling.Sampler(model_cfg, mesh, seed=0, pad_id=pad)
out = sampler.sample(params, prompt_ids, prompt_mask, spec, step)
# out.tokens, out.mask, out.loss_mask, out.logprobs, out.lengths, out.finish (device arrays)
engine = sampling.PagedSampler(model_cfg, mesh, seed=0, pad_id=pad, slots=32)  # paged.py
out = sampling.generate(cfg, params, prompts, max_new_tokens=64, num_samples=8)  # lists
"""

from jaxrl_llm.sampling.decode import (
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeState,
    SampleOutput,
    cache_lengths,
    fit_routes,
    prefill_groups,
)
from jaxrl_llm.sampling.generate import generate, pad_prompts
from jaxrl_llm.sampling.paged import PagedSampler
from jaxrl_llm.sampling.sampler import (
    BUCKET_STEPS,
    CACHE_SEGMENTS,
    Sampler,
    append_end,
    bucket_length,
)
from jaxrl_llm.sampling.sampling import sample_tokens, top_k_mask, top_p_mask
from jaxrl_llm.sampling.spec import RolloutSpec

__all__ = [
    "BUCKET_STEPS",
    "CACHE_SEGMENTS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "PagedSampler",
    "DecodeState",
    "RolloutSpec",
    "SampleOutput",
    "Sampler",
    "append_end",
    "bucket_length",
    "cache_lengths",
    "fit_routes",
    "generate",
    "pad_prompts",
    "prefill_groups",
    "sample_tokens",
    "top_k_mask",
    "top_p_mask",
]

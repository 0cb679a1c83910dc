"""Rollout generation: a jitted prefill + decode loop over the model's KV cache.

from jaxrl_llm import sampling
out = sampling.generate(cfg, params, prompts, max_new_tokens=64, num_samples=8,
                        temperature=1.0, stop_ids=(eos,), seed=0, mesh=mesh)
# out.tokens, out.mask, out.logprobs, out.lengths, out.finish (device arrays)
"""

from jaxrl_llm.sampling.sampler import (
    BUCKET_STEPS,
    CACHE_SEGMENTS,
    FINISH_LENGTH,
    FINISH_STOP,
    SampleOutput,
    SamplingParams,
    bucket_length,
    cache_lengths,
    generate,
    pad_prompts,
    prefill_groups,
)
from jaxrl_llm.sampling.sampling import sample_tokens, top_k_mask, top_p_mask

__all__ = [
    "BUCKET_STEPS",
    "CACHE_SEGMENTS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "SampleOutput",
    "SamplingParams",
    "bucket_length",
    "cache_lengths",
    "generate",
    "pad_prompts",
    "prefill_groups",
    "sample_tokens",
    "top_k_mask",
    "top_p_mask",
]

"""RL math: chunked logprobs (advantages, losses and presets follow)."""

from jaxrl_llm.rl.logprobs import token_logprobs

__all__ = ["token_logprobs"]

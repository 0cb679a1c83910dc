"""jaxrl_llm: reinforcement learning for language models in JAX.

Subpackages are imported on use (``from jaxrl_llm import models``) so that importing one
part does not pull in the others.
"""

__version__ = "0.1.0"

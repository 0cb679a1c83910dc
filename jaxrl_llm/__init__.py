"""jaxrl_llm: reinforcement learning for language models in JAX.

Subpackages are imported on use (``from jaxrl_llm import models``) so that importing one
part does not pull in the others.
"""

import logging as _logging

__version__ = "0.1.0"


class _NoTorchNotice(_logging.Filter):
    """Drops the notice `transformers` logs at import when PyTorch is not installed: this
    package uses only its tokenizers and configs, which need no PyTorch, so the notice
    asks the user for nothing. Every other transformers message passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found.")


_logging.getLogger("transformers").addFilter(_NoTorchNotice())

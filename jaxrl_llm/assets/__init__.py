"""Files shipped inside the package: the arithmetic tokenizer and the quickstart model.

    from jaxrl_llm import assets
    assets.ARITHMETIC_TOKENIZER   # HF tokenizer directory (character level, 33 tokens)
    assets.QUICKSTART_MODEL       # HF model directory (config, safetensors, tokenizer)

Both are plain directories that `transformers.AutoTokenizer.from_pretrained`,
`models.load_hf` and `transformers.AutoModelForCausalLM.from_pretrained` read; nothing is
downloaded. How they were made: `docs/sft_and_quickstart_model.md`.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

ARITHMETIC_TOKENIZER = os.path.join(_HERE, "arithmetic_tokenizer")
QUICKSTART_MODEL = os.path.join(_HERE, "quickstart_model")

__all__ = ["ARITHMETIC_TOKENIZER", "QUICKSTART_MODEL"]

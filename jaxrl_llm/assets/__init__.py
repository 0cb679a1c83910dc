"""Files shipped inside the package: the arithmetic tokenizer and the quickstart model.

    from jaxrl_llm import assets
    assets.ARITHMETIC_TOKENIZER   # HF tokenizer directory (character level, 33 tokens)
    assets.CALCULATOR_TOKENIZER   # the same + the calculator's <calc> </calc> (35 tokens)
    assets.QUICKSTART_MODEL       # HF model directory (config, safetensors, tokenizer)
    assets.CALCULATOR_MODEL       # the tiny model that calls the calculator (same files)

Both are plain directories that `transformers.AutoTokenizer.from_pretrained`,
`models.load_hf` and `transformers.AutoModelForCausalLM.from_pretrained` read; nothing is
downloaded. How they were made: `docs/sft_and_quickstart_model.md`.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

ARITHMETIC_TOKENIZER = os.path.join(_HERE, "arithmetic_tokenizer")
CALCULATOR_TOKENIZER = os.path.join(_HERE, "calculator_tokenizer")  # + <calc>, </calc>
QUICKSTART_MODEL = os.path.join(_HERE, "quickstart_model")
CALCULATOR_MODEL = os.path.join(_HERE, "calculator_model")

__all__ = ["ARITHMETIC_TOKENIZER", "CALCULATOR_MODEL", "CALCULATOR_TOKENIZER", "QUICKSTART_MODEL"]

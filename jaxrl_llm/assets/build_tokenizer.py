"""Builds the character-level tokenizer of the arithmetic task, in Hugging Face format.

    python -m jaxrl_llm.assets.build_tokenizer [--out=jaxrl_llm/assets/arithmetic_tokenizer]
    python -m jaxrl_llm.assets.build_tokenizer --calculator   # + <calc>, </calc>

One token per character, so a tiny model sees every digit on its own (multi-digit tokens
make carries much harder to learn). The alphabet covers the `arithmetic` prompts
("What is 48 * 17?"), the answers (digits and a minus sign) and a little slack for other
templates (`=`, `####`, newline); anything else becomes `<unk>`. Special tokens: `<pad>`
(0), `<bos>` (1, added in front of every encoded text), `<eos>` (2, ends a completion: the
sampler's stop token), `<unk>` (3). `--calculator` adds the calculator environment's
call tags `<calc>` (33) and `</calc>` (34) as whole tokens (not special: decoding keeps
them, so the environment reads the call), written to `calculator_tokenizer`.

Written with the `tokenizers` library (a WordLevel model over single characters, a
pre-tokenizer that splits every character, a decoder that concatenates) and wrapped in
`transformers.PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(out)` loads it.
The ids are fixed by the order below: rebuilding gives the same files.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Order matters: it fixes the ids the shipped model was trained with.
CHARACTERS = "0123456789" + "+-*/=()?.,# \n" + "Whatis"

CALCULATOR_TOKENS = ("<calc>", "</calc>")

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(_HERE, "arithmetic_tokenizer")
CALCULATOR_OUT = os.path.join(_HERE, "calculator_tokenizer")


def build(out_dir: str, extra_tokens: tuple[str, ...] = ()):
    """Writes tokenizer.json, tokenizer_config.json (and what else transformers saves) to
    `out_dir`; returns the `PreTrainedTokenizerFast`. extra_tokens: whole-word tokens after
    the characters (ids 33, 34, ...), matched before the split into characters."""
    import tokenizers
    import transformers
    from tokenizers import decoders, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    if len(vocab) != len(SPECIAL_TOKENS) + len(CHARACTERS):
        raise ValueError("CHARACTERS has a repeated character")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    # `[\s\S]` rather than `.`: the regex dot does not match a newline.
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(
        [tokenizers.AddedToken(t, special=False, normalized=False) for t in extra_tokens]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # " ?" must decode as written
        model_max_length=512,
    )
    fast.save_pretrained(out_dir)
    _portable_config(out_dir, fast)
    return fast


def _portable_config(out_dir: str, fast) -> None:
    """transformers 5 records its own class name (`TokenizersBackend`), which 4.x cannot
    resolve; `PreTrainedTokenizerFast` names the same class in both. 4.x also reads the
    special tokens from `special_tokens_map.json`, which 5.x no longer writes."""
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    special = {name: getattr(fast, name) for name in ("bos_token", "eos_token", "pad_token")}
    special["unk_token"] = fast.unk_token
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, sort_keys=True)
        f.write("\n")


_OUT = flags.DEFINE_string("out", None, "Directory to write the tokenizer files to.")
_CALCULATOR = flags.DEFINE_bool("calculator", False, "Add the <calc> and </calc> tokens.")


def main(argv):
    del argv
    extra = CALCULATOR_TOKENS if _CALCULATOR.value else ()
    out = _OUT.value or (CALCULATOR_OUT if _CALCULATOR.value else DEFAULT_OUT)
    tokenizer = build(out, extra)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {out}")


if __name__ == "__main__":
    app.run(main)

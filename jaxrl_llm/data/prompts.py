"""Prompt text and token ids from a row: the tokenizer's chat template when it has one,
else a plain template string; left-padded batches with a bucketed length.

The user turn is always `template.format_map(example)` (`"{question}\\nAnswer after ####."`;
literal braces are written `{{ }}`). With a chat template the system prompt and the user turn
become messages and `apply_chat_template(..., add_generation_prompt=True)` adds the
assistant header; without one the text is `system + "\\n\\n" + user`.

A prompt is refused from its length in characters before it is tokenized when it cannot
fit: no token of the vocabulary covers more than `max_token_chars` characters, so a text
longer than `max_len * max_token_chars` has more than `max_len` tokens. Tokenizing a
30 MB row only to find it too long would take gigabytes.
"""

from __future__ import annotations

import string

import numpy as np

from jaxrl_llm.data.sources import BadRow

DEFAULT_TEMPLATES = {
    "gsm8k": "{question}\nSolve it step by step, then give the final answer after '####'.",
    "arithmetic": "{question}\nGive the final answer after '####'.",
    "countdown": (
        "{question}\nThink in <think> </think> tags, then give only the equation in "
        "<answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
    ),
}
CHAT_MODES = ("auto", "always", "never")


def default_template(tfds_name: str) -> str:
    """The built-in template for a TFDS name (`countdown/numbers_4` -> countdown's), else
    `{question}`."""
    return DEFAULT_TEMPLATES.get(tfds_name.split("/")[0].split(":")[0], "{question}")


def template_fields(template: str) -> list[str]:
    """Top-level field names a template uses; ValueError with a hint on a malformed one."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(
            f"data.template: {err} in {template!r}; write literal braces as {{{{ }}}}"
        ) from None
    names = [name for _, name, _, _ in parsed if name is not None]
    if any(name == "" or name[0].isdigit() for name in names):
        raise ValueError(
            f"data.template: use named fields like {{question}} and write literal braces as "
            f"{{{{ }}}}; got {template!r}"
        )
    return [name.split(".")[0].split("[")[0] for name in names]


class PromptBuilder:
    """Row -> (prompt text, token ids), with a length check.

    Args:
      tokenizer: a Hugging Face tokenizer (`transformers.PreTrainedTokenizerBase`).
      template: format string for the user turn over the row's fields.
      system_prompt: optional system message (prepended as plain text without a chat
        template).
      chat_template: `auto` (use the tokenizer's chat template when it has one), `always`
        (require it), `never`.
      max_len: longest prompt in tokens; a longer one is a bad row.
    """

    def __init__(
        self,
        tokenizer,
        template: str,
        system_prompt: str = "",
        chat_template: str = "auto",
        max_len: int = 512,
    ):
        if chat_template not in CHAT_MODES:
            raise ValueError(
                f"data.chat_template must be one of {CHAT_MODES}, got {chat_template!r}"
            )
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not has_chat:
            raise ValueError("data.chat_template='always' but the tokenizer has no chat template")
        if max_len < 1:
            raise ValueError(f"data.max_prompt_len must be >= 1, got {max_len}")
        self.fields = template_fields(template)
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.use_chat = has_chat and chat_template != "never"
        self.max_len = max_len
        longest = max_token_chars(tokenizer)
        self.max_chars = None if longest is None else max_len * longest

    def text(self, example: dict, where: str = "row") -> str:
        missing = [name for name in self.fields if name not in example]
        if missing:
            raise BadRow(f"{where}: data.template uses {missing} but the row has {sorted(example)}")
        user = self.template.format_map(example)
        if not self.use_chat:
            return f"{self.system_prompt}\n\n{user}" if self.system_prompt else user
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def __call__(self, example: dict, where: str = "row") -> tuple[str, list[int]]:
        text = self.text(example, where)
        self.check_chars(text, where)
        # A chat template writes its own BOS; adding special tokens again would double it.
        ids = list(self.tokenizer(text, add_special_tokens=not self.use_chat)["input_ids"])
        if len(ids) > self.max_len:
            raise BadRow(
                f"{where}: prompt is {len(ids)} tokens, above data.max_prompt_len={self.max_len}"
            )
        return text, ids

    def check_chars(self, text: str, where: str = "row") -> None:
        """Raises BadRow when `text` has too many characters to fit `max_len` tokens."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise BadRow(
                f"{where}: prompt is {len(text):,} characters, more than any prompt of "
                f"data.max_prompt_len={self.max_len} tokens can have with this tokenizer "
                f"({self.max_chars:,})"
            )


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token of `tokenizer` stands for (None if it has no
    vocabulary listing). Byte-level vocabularies spell a token's bytes one character per
    byte, so this bounds characters from above there too."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    return max((len(token) for token in get_vocab()), default=None)


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id, else 0 (padding is masked out anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def collate(ids: list[list[int]], pad: int, multiple: int, max_len: int):
    """Left-pads token id lists to one length.

    The length is the longest prompt rounded up to `multiple` (capped at `max_len`), so a
    jitted sampler sees a handful of shapes instead of one per batch. Left padding puts
    every prompt's last token in the last column, where decoding starts.

    Returns:
      ids: [B, T] int32, `pad` in the padding.
      mask: [B, T] bool, True on real tokens.
    """
    longest = max((len(row) for row in ids), default=1)
    length = min(-(-longest // multiple) * multiple, max(max_len, longest))
    out = np.full((len(ids), length), pad, np.int32)
    mask = np.zeros((len(ids), length), bool)
    for i, row in enumerate(ids):
        if row:
            out[i, length - len(row) :] = row
            mask[i, length - len(row) :] = True
    return out, mask

"""Observations -> token ids: the first one as the prompt, later ones as the next turn.

Only the new turn is tokenized, never the conversation so far: the ids the sampler
appends follow the ids it sampled, so a trajectory is trained on exactly the tokens the
policy saw (re-tokenizing the whole text could merge or split tokens at a boundary).

With a chat template (`data.chat_template` = auto with a template, or always) a turn is
the text the template adds for the observation after an assistant message: the
observation goes in as a `tool` message where the template mentions that role, else as
a `user` message, and the template's assistant header for the next turn follows. The
difference is taken against the same conversation without the observation, with a
sentinel assistant message; when the model's turn ended on its end-of-turn token, that
token's text (which the template writes after the assistant message) is not repeated.

Without a chat template the plain format is the observation on its own lines:
`"\\n" + observation + "\\n"` (a list of messages: their contents joined by newlines),
tokenized without special tokens.

An environment's text never becomes a control token: its contents are tokenized with
special tokens split (`<|im_end|>` in a tool's output is the characters, not the id that
ends a turn), so no observation can close its turn and forge the assistant's. Only the
template's own markers, rendered around a placeholder for each content, are parsed as
special tokens.
"""

from __future__ import annotations

import json
import re

LAYOUTS_KEPT = 1024  # turn layouts kept per renderer (`Renderer._template_ids`)
_SENTINEL = "\u2063JAXRL-TURN\u2063"
_CONTENT = "\u2063JAXRL-CONTENT-{}\u2063"
_CONTENT_RE = re.compile("\u2063JAXRL-CONTENT-([0-9]+)\u2063")


class Renderer:
    """Token ids of prompts and observation turns for one tokenizer.

    Args:
      tokenizer: a Hugging Face tokenizer.
      use_chat: render with the tokenizer's chat template.
      system_prompt: system message of prompts built from a text observation.
    """

    def __init__(self, tokenizer, use_chat: bool, system_prompt: str = ""):
        template = getattr(tokenizer, "chat_template", None) or ""
        if use_chat and not template:
            raise ValueError("env: the tokenizer has no chat template to render turns with")
        self.tokenizer, self.use_chat, self.system_prompt = tokenizer, use_chat, system_prompt
        self.role = "tool" if "tool" in template else "user"
        from jaxrl_llm.data.prompts import max_token_chars  # not in the workers' imports

        self.token_chars = max_token_chars(tokenizer)
        self._layouts: dict = {}  # turn layouts (`_template_ids`)

    def max_chars(self, tokens: int) -> int | None:
        """The most characters an observation of at most `tokens` tokens can have (no
        token covers more than the vocabulary's longest); None: unknown."""
        return None if self.token_chars is None else max(tokens, 0) * self.token_chars

    def _ids(self, text: str, special: bool = False) -> list[int]:
        """Ids of an environment's text: special tokens split into ordinary ones."""
        return list(
            self.tokenizer(text, add_special_tokens=special, split_special_tokens=True)["input_ids"]
        )

    def _template_ids(self, messages: list, render, key=None) -> list[int]:
        """Ids of `render(placeholder messages)` (the template's text, whose markers are
        parsed as special tokens) with each message's content tokenized as an
        environment's text in place of its placeholder. The rendered layout (the
        template's pieces as ids, and where each content goes) depends only on what
        `render` is given, the placeholders included: it is kept under `key` (None: not
        kept), so a turn like an earlier one renders and tokenizes only its contents."""
        layout = self._layouts.get(key) if key is not None else None
        if layout is None:
            held = [m | {"content": _CONTENT.format(k)} for k, m in enumerate(messages)]
            pieces = _CONTENT_RE.split(render(held))
            layout = [
                int(piece)
                if j % 2
                else tuple(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
                for j, piece in enumerate(pieces)
                if j % 2 or piece  # odd pieces: a content placeholder's index
            ]
            if key is not None:
                if len(self._layouts) >= LAYOUTS_KEPT:
                    self._layouts.clear()
                self._layouts[key] = layout
        ids = []
        for part in layout:
            ids += self._ids(messages[part]["content"]) if isinstance(part, int) else part
        return ids

    def prompt(self, observation, tools=None) -> list[int]:
        """The prompt of a trajectory from `reset`'s observation (text or messages);
        `tools`: JSON schemas the chat template renders (its `tools=`)."""
        if isinstance(observation, list):
            if not self.use_chat:
                return self._ids(
                    "\n".join(m.get("content") or "" for m in observation), special=True
                )
            extra = {"tools": tools} if tools else {}
            return self._template_ids(
                observation,
                lambda held: self.tokenizer.apply_chat_template(
                    held, tokenize=False, add_generation_prompt=True, **extra
                ),
            )
        if not self.use_chat:
            text = f"{self.system_prompt}\n\n{observation}" if self.system_prompt else observation
            return self._ids(text, special=True)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self.prompt([*system, {"role": "user", "content": observation}])

    def turn(self, observation, closed_by: int | None = None) -> list[int]:
        """The ids of an observation turn; `closed_by`: the end-of-turn token id that ended
        the model's turn (None: it ran out of budget, the template closes it)."""
        messages = observation if isinstance(observation, list) else None
        if not self.use_chat:
            text = "\n".join(m.get("content") or "" for m in messages) if messages else observation
            return self._ids(f"\n{text}\n")
        messages = messages or [{"role": self.role, "content": observation}]
        try:  # the layout's key: what the template reads of the messages but their contents
            shape = json.dumps([m | {"content": None} for m in messages])
            key = (self.tokenizer.chat_template, closed_by, shape)
        except (TypeError, ValueError):  # not JSON: rendered every time
            key = None
        return self._template_ids(messages, lambda held: self._delta(held, closed_by), key)

    def _delta(self, messages: list, closed_by: int | None) -> str:
        """The text the template adds for `messages` after an assistant message."""
        before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        full = self.tokenizer.apply_chat_template(
            before + messages, tokenize=False, add_generation_prompt=True
        )
        start = full.find(_SENTINEL)
        if start < 0:
            raise ValueError("env: the chat template drops the assistant's message")
        delta = full[start + len(_SENTINEL) :]
        if closed_by is not None:
            closing = self.tokenizer.decode([closed_by])
            if closing and delta.startswith(closing):
                delta = delta[len(closing) :]
        return delta

"""One agent episode's exact tokens, and a group of episodes as rollout rows.

    ep = Episode(renderer, end_of_turn_ids)
    ids = ep.context(messages, tools)       # the ids the model reads for this request
    ep.record(messages, choices)            # what it drew: [(message, ids, logprobs, versions)]
    ...
    rows = group_rows([ep, ...], prompt_width=P, width=T, pad_id=0)   # prompt-major arrays

**Exact tokens.** An episode keeps the token ids the model has read and drawn, in order:
the first request's messages rendered (the prompt), then per turn the tokens the model
drew (loss mask 1, their behaviour log-probs and the parameter version that drew each:
a turn on the paged engine with partial rollouts may hold two), then the tokens of
the messages the agent added after them (tool results, user turns; loss mask 0). A request
*extends* the episode when its messages are the previous request's messages, then an
assistant message equal to one of the choices the gateway returned for it (content and
tool calls), then new messages: only the new messages are rendered (`Renderer.turn`, the
text the chat template adds after an assistant message) and appended; the model's own
tokens are never re-tokenized. Any other request is a *rewrite* (the agent edited,
dropped or summarised history): the whole conversation is rendered again as a new prompt
(`retokenized` counts it) and the episode's trajectory restarts from it, so the episode
trains on its last segment: the context the model read at the last rewrite, with loss
mask 0, and every turn drawn after it. Turns drawn before the last rewrite are not
trained on (their text, as the agent sent it back, is part of the new context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxrl_llm.gateway.server import Server
    from jaxrl_llm.sampling import RolloutSpec


class Episode:
    """The token record of one agent episode (host side)."""

    def __init__(self, renderer, end_of_turn_ids=()):
        self.renderer, self.end_of_turn_ids = renderer, tuple(end_of_turn_ids)
        self.ids: list[int] = []
        self.loss: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.prompt_len = 0  # the current segment's prompt
        self.messages: list | None = None  # the last request's messages
        self.choices: list = []  # [(assistant message, ids, logprobs, versions)]
        self.retokenized = 0
        self.turns = 0

    def context(self, messages: list, tools=None) -> list[int]:
        """The ids the model reads for a request with `messages`: the episode's ids plus
        the new messages' when it extends the last turn, else the whole conversation
        rendered anew (a rewrite; the record restarts from it)."""
        new = self._extension(messages)
        if new is None:  # first request, or history rewritten
            self.retokenized += self.messages is not None
            self.ids = self.renderer.prompt(messages, tools=tools)
            self.loss, self.logprobs = [False] * len(self.ids), [0.0] * len(self.ids)
            self.versions, self.prompt_len = [-1] * len(self.ids), len(self.ids)
            return list(self.ids)
        k, added = new
        _, ids, logprobs, versions = self.choices[k]
        last = ids[-1] if ids else None
        closed = last if last in self.end_of_turn_ids else None
        turn = self.renderer.turn(added, closed) if added else []
        self._extend(ids, [True] * len(ids), logprobs, versions)
        self._extend(turn, [False] * len(turn), [0.0] * len(turn), [-1] * len(turn))
        return list(self.ids)

    def record(self, messages: list, choices: list) -> None:
        """The request's messages and what the model drew for it: per choice
        (assistant message as returned, drawn ids, their log-probs, the parameter version
        that drew each id)."""
        self.messages, self.choices, self.turns = list(messages), list(choices), self.turns + 1

    def _extension(self, messages: list):
        """(choice index, messages after it) when `messages` extends the last request."""
        if self.messages is None:
            return None
        n = len(self.messages)
        if len(messages) <= n or messages[:n] != self.messages:
            return None
        for k, (assistant, *_) in enumerate(self.choices):
            if _same_assistant(messages[n], assistant):
                return k, messages[n + 1 :]
        return None

    def _extend(self, ids, loss, logprobs, versions) -> None:
        self.ids += list(ids)
        self.loss += list(loss)
        self.logprobs += list(logprobs)
        self.versions += list(versions)

    def close(self) -> None:
        """Adds the last turn's drawn tokens (the first choice when the agent did not
        say which one it kept) to the record."""
        if self.choices:
            _, ids, logprobs, versions = self.choices[0]
            self._extend(ids, [True] * len(ids), logprobs, versions)
            self.choices = []


def _same_assistant(sent: dict, returned: dict) -> bool:
    """Whether the agent's assistant message is the one the gateway returned."""
    if not isinstance(sent, dict) or sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (returned.get("content") or ""):
        return False
    calls = [
        (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
        for c in sent.get("tool_calls") or []
    ]
    mine = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in returned.get("tool_calls") or []
    ]
    return calls == mine


def group_rows(episodes: list, prompt_width: int, width: int, pad_id: int) -> dict:
    """A group's episodes as rollout rows (numpy): the prompt is the longest common
    prefix of their records before any sampled token (the G rows of a group must share
    their prompt), left-padded to `prompt_width`; the rest is the completion, `width`
    wide. A record longer than that is cut to it; `cut` counts each row's dropped tokens:
    the gateway refuses requests past the limits, but when the episodes' prompts differ
    (an agent whose G episodes start with different messages) the shared prompt is
    shorter than each one's and the rest of each prompt fills the completion;
    `unshared` marks the rows of such a group (every row of it)."""
    played = [ep for ep in episodes if ep.ids]
    first = [ep.loss.index(True) if True in ep.loss else len(ep.ids) for ep in played]
    common, unshared = min(first + [prompt_width]), False
    for j in range(common):
        if len({ep.ids[j] for ep in played}) > 1:
            common, unshared = j, True
            break
    # One token at least (every row attends to something); an episode that never asked
    # gets the others' prompt and an empty completion.
    shared = played[0].ids[: max(common, 1)] if played else [pad_id]
    n = len(episodes)
    out = {
        "prompt_tokens": np.full((n, prompt_width), pad_id, np.int32),
        "prompt_mask": np.zeros((n, prompt_width), bool),
        "tokens": np.full((n, width), pad_id, np.int32),
        "mask": np.zeros((n, width), bool),
        "loss_mask": np.zeros((n, width), bool),
        "logprobs": np.zeros((n, width), np.float32),
        "versions": np.full((n, width), -1, np.int64),
        "lengths": np.zeros(n, np.int32),
        "cut": np.zeros(n, np.int32),
        "unshared": np.full(n, unshared),
    }
    for i, ep in enumerate(episodes):
        out["prompt_tokens"][i, prompt_width - len(shared) :] = shared
        out["prompt_mask"][i, prompt_width - len(shared) :] = True
        rest = slice(len(shared), len(ep.ids))
        m = min(max(len(ep.ids) - len(shared), 0), width)
        out["tokens"][i, :m] = ep.ids[rest][:m]
        out["mask"][i, :m] = True
        out["loss_mask"][i, :m] = ep.loss[rest][:m]
        out["logprobs"][i, :m] = ep.logprobs[rest][:m]
        out["versions"][i, :m] = ep.versions[rest][:m]
        out["lengths"][i] = m
        out["cut"][i] = max(len(ep.ids) - len(shared) - width, 0)
    return out


class Play:
    """One batch of episodes in progress: where its requests arrive, the spec and key
    stream it samples with, the parameters' version, and its counters."""

    def __init__(self, server: Server, spec: RolloutSpec, *, key: int, step: int, version: int):
        self.server, self.spec, self.key, self.step, self.version = (
            server,
            spec,
            key,
            step,
            version,
        )
        self.stats = {
            "requests": 0,
            "calls": 0,
            "batched": 0,
            "batch_max": 0,
            "temperature_ignored": 0,
            "tool_call_errors": 0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "cache_restarts": 0,
            "evicted": 0,
        }
        self.seconds = 0.0

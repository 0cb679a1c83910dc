"""The gateway's side of the OpenAI chat-completions protocol: a request's options read and
checked (`parse_request`: n, max_tokens, stop, stream, the context rendered from its
messages and tools), the drawn tokens cut into a choice (`make_choice`: max_tokens, stop
strings, tool calls in the model's format) and the response and error bodies
(`response`, `error`).

`rollout.AgentRollout` batches the requests into the sampler, and `sampling.serve`
serves them on the paged engine; both read and answer a request through these, so an
agent sees the same protocol whichever engine draws its tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxrl_llm.envs.tool_calls import parse_tool_calls
from jaxrl_llm.gateway.episodes import Episode

if TYPE_CHECKING:
    from jaxrl_llm.gateway.episodes import Play

MAX_N = 16  # choices per request


def parse_request(body: dict, ep: Episode, play: Play, budget: int) -> dict:
    """The request's options, checked, and its context ids. budget: the most tokens a
    turn may draw (`rollout.max_new_tokens`), which caps the request's max_tokens; a
    temperature other than `play.spec`'s is counted (`temperature_ignored`), not used.
    Every malformed field is a ValueError naming it (the request's 400, its episode goes
    on). `body["messages"]` becomes the messages as read (`messages`)."""
    n = _option(body, "n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ValueError(f"n={n!r}: expected an integer in [1, {MAX_N}]")
    max_tokens = _option(body, "max_completion_tokens", _option(body, "max_tokens", budget))
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an integer >= 1")
    stop = _option(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop={stop!r:.80}: expected a string or a list of strings")
    if body.get("stream"):
        raise ValueError("stream=true: the gateway answers whole responses only")
    temperature = body.get("temperature")
    if temperature is not None and temperature != play.spec.temperature:
        play.stats["temperature_ignored"] += 1
    body["messages"] = messages(body["messages"])
    try:
        ids = ep.context(body["messages"], body.get("tools"))
    except Exception as err:  # a message the template or the renderer refuses
        raise ValueError(f"messages: {type(err).__name__}: {err}"[:500]) from None
    return {
        "ids": ids,
        "n": n,
        "max_tokens": min(max_tokens, budget),
        "stop": stop,
        "tools": bool(body.get("tools")),
        "temperature": temperature,
    }


def messages(sent: list) -> list:
    """The request's messages as the episode reads them: each an object with a string
    `role`; a `content` of None (an assistant message holding only tool calls) is "",
    a list of text parts their texts joined; anything else a ValueError naming it."""
    out = []
    for k, m in enumerate(sent):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{k}]: expected an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list) and all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
        ):
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{k}].content: expected a string, a list of text "
                f"parts or null, got {type(content).__name__}"
            )
        out.append(m | {"content": content or ""})
    return out


def _option(body: dict, name: str, default):
    """body[name], the default when absent or null (0 and "" are values, and checked)."""
    value = body.get(name)
    return default if value is None else value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_choice(
    tokenizer,
    ask: dict,
    ids: list,
    logprobs: list,
    versions: list,
    stopped: bool,
    play: Play,
    call_ids: str,
):
    """-> (the response's choice, assistant message, kept ids, log-probs, versions).
    max_tokens and stop strings cut the drawn tokens; the kept ones are the trajectory's."""
    finish = "stop" if stopped else "length"
    if len(ids) > ask["max_tokens"]:
        ids, finish = ids[: ask["max_tokens"]], "length"
    if ask["stop"]:
        for k in range(1, len(ids) + 1):  # the first token that completes a stop string
            text = tokenizer.decode(ids[:k], skip_special_tokens=True)
            if any(s in text for s in ask["stop"]):
                ids, finish = ids[: k - 1], "stop"
                break
    logprobs, versions = logprobs[: len(ids)], [int(v) for v in versions[: len(ids)]]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    message = {"role": "assistant", "content": text}
    calls = parse_tool_calls(text, call_ids) if ask["tools"] else None
    if calls is not None and calls.calls:
        message = {"role": "assistant", "content": calls.content or None, "tool_calls": calls.calls}
        finish = "tool_calls"
    play.stats["tool_call_errors"] += bool(calls is not None and calls.errors)
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return choice, message, ids, logprobs, versions


def response(
    episode: str,
    turn: int,
    choices: list,
    prompt_tokens: int,
    completion_tokens: int,
    sampled: dict,
) -> dict:
    """A `chat.completion`; `jaxrl_llm` says how it was drawn: the temperature the gateway
    sampled at (the run's, whatever the request asked), the one requested (None when
    the request named none), and the version of the parameters that drew it."""
    for k, choice in enumerate(choices):
        choice["index"] = k
    return {
        "id": f"chatcmpl-{episode}-{turn}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "jaxrl-llm",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "jaxrl_llm": sampled,
    }


def error(message: str, code: str = "invalid_request") -> dict:
    """An OpenAI error body: what a malformed request or one past a limit is answered."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}

"""Tool calls in the model's own format -> OpenAI `tool_calls` (the gateway's responses)
and calls of an environment's tools (`ToolEnv`).

    parsed = parse_tool_calls(text)     # ParsedCalls(content, calls, errors)

Two formats are read:

- Qwen / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  anywhere in the turn; the text outside them is the message's content.
- Llama 3.1 (JSON tool calling): the whole turn is one JSON object
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`).

A call whose JSON does not parse, is not an object with a string `name`, or whose
arguments are not an object is malformed: it is left in the content as text and counted
in `errors` (the gateway's `gateway/tool_call_errors`), so the agent sees what the model
wrote. `arguments` in the result is a JSON string, as the OpenAI API sends it.
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxrl_llm.envs.base import Env, Step

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass
class ParsedCalls:
    content: str  # the text outside well-formed calls
    calls: list  # [{"id", "type": "function", "function": {"name", "arguments"}}]
    errors: int  # malformed calls


def _call(obj, key: str):
    """One well-formed call's name and arguments (JSON string), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, id_prefix: str = "call") -> ParsedCalls:
    """The calls in `text` (either format), the content left, and the malformed count."""
    calls, errors, kept = [], 0, []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            errors += 1
            continue  # left in the content
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    if calls or errors:
        content = "".join(kept) + text[last:]
    else:
        content = text
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{") and body.endswith("}"):
            try:
                call = _call(json.loads(body), "parameters")
            except ValueError:
                call = None
            if call is not None:
                calls, content = [call], ""
            elif '"name"' in body:
                errors += 1
    return ParsedCalls(
        content=content.strip(),
        calls=[
            {
                "id": f"{id_prefix}_{k}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for k, (name, args) in enumerate(calls)
        ],
        errors=errors,
    )


class ToolEnv(Env):
    """An environment whose tools the model calls in its own format (Hermes / Qwen
    `<tool_call>` blocks, a Llama 3.1 JSON turn): subclass it, give `tools` (name ->
    function of keyword arguments returning text) and `answer(text) -> reward`.

    Each turn with well-formed calls runs them and answers their results as `tool`
    messages (one per call, in order); a call of an unknown tool or one that raises
    answers `error: ...` as its result. A turn with a malformed call answers an error
    observation naming it, and counts it in `info["tool_errors"]`; a turn with no call is
    the final answer, scored by `answer`. `info["tool_calls"]` counts the calls run."""

    tools: dict = {}

    def answer(self, text: str) -> float:
        raise NotImplementedError(f"{type(self).__name__} does not define answer(text)")

    def step(self, action: str):
        parsed = parse_tool_calls(action)
        if parsed.errors:
            return Step(
                f"error: {parsed.errors} malformed tool call(s); write "
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
                info={"tool_errors": float(parsed.errors)},
            )
        if not parsed.calls:
            return Step(reward=float(self.answer(action)), done=True)
        results = [{"role": "tool", "content": self._run(c["function"])} for c in parsed.calls]
        return Step(results, info={"tool_calls": float(len(results))})

    def _run(self, function: dict) -> str:
        tool = self.tools.get(function["name"])
        if tool is None:
            return f"error: no tool {function['name']!r}; tools: {', '.join(self.tools)}"
        try:
            return str(tool(**json.loads(function["arguments"])))
        except Exception as err:  # the model's call failed: it reads why
            return f"error: {type(err).__name__}: {err}"[:500]

"""Agents the gateway tests name as `tests/agents_for_tests.py:function`. They are
written against the `openai` client only: nothing here imports jaxrl_llm."""

import asyncio

import openai


async def two_turns(client: openai.AsyncOpenAI, example, rewrite: bool = False,
                    stop: str | None = None) -> float:  # fmt: skip
    """Asks the row's question, says "again" after the answer, returns 1 when the second
    answer starts with a digit. With `rewrite` (or the row's `rewrite`), a third request
    drops the first answer from the history (a rewrite the gateway must detect). `stop`
    (or the row's): the requests' stop string. The row's `n`: the first request's
    choices (the agent goes on with the first)."""
    stop = example.get("stop", stop)
    options = {"stop": stop} if stop else {}
    messages = [{"role": "user", "content": example["question"]}]
    n = {"n": example["n"]} if example.get("n") else {}
    first = await client.chat.completions.create(model="policy", messages=messages, **options,
                                                 **n)  # fmt: skip
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "7"}]  # fmt: skip
    second = await client.chat.completions.create(model="policy", messages=messages, **options)
    answer = second.choices[0].message.content
    if rewrite or example.get("rewrite"):
        messages = [messages[0], {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="policy", messages=messages)
    if example.get("fail"):
        raise RuntimeError("the agent gave up")
    return float(answer[:1].isdigit())


async def many(client: openai.AsyncOpenAI, example) -> float:
    """Two requests, a short pause between them; the second asks for temperature 0.7.
    Returns 1 when the responses say they were sampled at the run's temperature (0 in
    the test), the second one that 0.7 was asked for."""
    messages = [{"role": "user", "content": example["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    await asyncio.sleep(0.01)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "="}]  # fmt: skip
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  temperature=0.7)  # fmt: skip
    said = [first.model_extra["jaxrl_llm"], second.model_extra["jaxrl_llm"]]
    expected = [
        {"temperature": 0.0, "requested_temperature": None, "policy_version": 0},
        {"temperature": 0.0, "requested_temperature": 0.7, "policy_version": 0},
    ]
    return float(said == expected and first.usage.completion_tokens >= 1)

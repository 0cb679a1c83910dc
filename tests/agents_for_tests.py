"""Agents the gateway tests name as `tests/agents_for_tests.py:function`. They are
written against the `openai` client only: nothing here imports jaxrl_llm."""

import asyncio
import os
import sys
import time

import httpx
import openai


async def two_turns(
    client: openai.AsyncOpenAI, example, rewrite: bool = False, stop: str | None = None
) -> float:
    """Asks the row's question, says "again" after the answer, returns 1 when the second
    answer starts with a digit. With `rewrite` (or the row's `rewrite`), a third request
    drops the first answer from the history (a rewrite the gateway must detect). `stop`
    (or the row's): the requests' stop string. The row's `n`: the first request's
    choices (the agent goes on with the first)."""
    stop = example.get("stop", stop)
    options = {"stop": stop} if stop else {}
    messages = [{"role": "user", "content": example["question"]}]
    n = {"n": example["n"]} if example.get("n") else {}
    first = await client.chat.completions.create(model="policy", messages=messages, **options, **n)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "7"},
    ]
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
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "="},
    ]
    second = await client.chat.completions.create(
        model="policy", messages=messages, temperature=0.7
    )
    said = [first.model_extra["jaxrl_llm"], second.model_extra["jaxrl_llm"]]
    expected = [
        {"temperature": 0.0, "requested_temperature": None, "policy_version": 0},
        {"temperature": 0.0, "requested_temperature": 0.7, "policy_version": 0},
    ]
    return float(said == expected and first.usage.completion_tokens >= 1)


# Hostile agents: each must cost its own episode only (docs/agents.md#security).

MISDEEDS = ("sleep", "exit", "interrupt", "os_exit", "fork")


def claim_number(claims: str) -> int:
    """The lowest number k not yet claimed in the directory `claims` (each episode, in
    whatever process it runs, claims one by creating the file `claims/k`)."""
    k = 0
    while True:
        try:
            os.close(os.open(os.path.join(claims, str(k)), os.O_CREAT | os.O_EXCL))
            return k
        except FileExistsError:
            k += 1


async def misbehave(client: openai.AsyncOpenAI, example, claims: str) -> float:
    """Episode k of a run (numbered by claiming files in the directory `claims`) asks one
    question, then does MISDEEDS[k]: blocks its thread for an hour, calls sys.exit,
    raises KeyboardInterrupt, ends its process, or forks a copy that sleeps (its pid
    written to claims/forked) and returns 1. Later episodes return 1."""
    k = claim_number(claims)
    deed = MISDEEDS[k] if k < len(MISDEEDS) else "play"
    messages = [{"role": "user", "content": example["question"]}]
    await client.chat.completions.create(model="policy", messages=messages)
    if deed == "sleep":
        time.sleep(3600)
    elif deed == "exit":
        sys.exit(3)
    elif deed == "interrupt":
        raise KeyboardInterrupt
    elif deed == "os_exit":
        os._exit(0)
    elif deed == "fork" and os.fork() == 0:
        with open(os.path.join(claims, "forked"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return 1.0


async def intrude(client: openai.AsyncOpenAI, example) -> float:
    """Posts a conversation into the other episode of its pair (ids 2k, 2k+1) with its
    own key, and into its own without a key, then plays one request. Returns 1 when
    both posts were refused with 401."""
    url = str(client.base_url).rstrip("/")  # http://127.0.0.1:PORT/e/<id>/v1
    mine = int(url.split("/")[-2])
    other = url.replace(f"/e/{mine}/", f"/e/{mine ^ 1}/")
    body = {"model": "policy", "messages": [{"role": "user", "content": "injected"}]}
    async with httpx.AsyncClient() as http:
        stolen = await http.post(
            f"{other}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {client.api_key}"},
        )
        bare = await http.post(f"{url}/chat/completions", json=body)
    messages = [{"role": "user", "content": example["question"]}]
    await client.chat.completions.create(model="policy", messages=messages)
    return float(stolen.status_code == 401 and bare.status_code == 401)


async def numbered(client: openai.AsyncOpenAI, example, claims: str) -> float:
    """One request; for a row with `numbered`, the question starts with the episode's
    number k (claimed as a file in the directory `claims`), so the episodes of that row
    start with different messages."""
    question = example["question"]
    if example.get("numbered"):
        question = f"{claim_number(claims)}{question}"
    messages = [{"role": "user", "content": question}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


async def returns(client: openai.AsyncOpenAI, example) -> object:
    """Returns the row's `value` as it is (a reward the gateway must check)."""
    return example["value"]


async def bad_requests(client: openai.AsyncOpenAI, example) -> float:
    """Malformed requests, each of which must be a 400 (413 past the body limit) to this
    episode alone; then OpenAI's own tool-call message sent back, and two requests at
    once, both answered. Returns 1 when every status is the expected one."""
    question = [{"role": "user", "content": example["question"]}]
    bad = [
        {"stop": 5},
        {"stop": [None]},
        {"n": 0},
        {"max_tokens": 0},
        {"n": True},
        {"messages": [{"role": "user", "content": {"a": 1}}]},
        {"messages": [{"role": "user", "content": "9" * 4096}]},
    ]
    statuses = []
    for options in bad:
        try:
            await client.chat.completions.create(
                **({"model": "policy", "messages": question} | options)
            )
            statuses.append(200)
        except openai.APIStatusError as err:
            statuses.append(err.status_code)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    tool_turn = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    await client.chat.completions.create(model="policy", messages=tool_turn)
    both = await asyncio.gather(
        *(client.chat.completions.create(model="policy", messages=question) for _ in range(2))
    )
    return float(statuses == [400] * 6 + [413] and len(both) == 2)


async def imports(client: openai.AsyncOpenAI, example) -> float:
    """The number of modules its process imported for two requests (the first builds
    the client's machinery): those the launcher did not build before forking it."""
    before = set(sys.modules)
    messages = [{"role": "user", "content": example["question"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "7"}]
    return float(len(set(sys.modules) - before))

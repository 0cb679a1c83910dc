"""An agent written only against the `openai` client: it answers a reasoning-gym
arithmetic problem, is told when it is wrong, and tries again.

    async def run(client, example, tries=2) -> float

The answer is the last number in the reply; the reward is reasoning-gym's own score of
it: 1.0 when the first answer is right, `retry_reward` when only a later one is, else 0.
Nothing here imports jaxrl_llm; the trainer hands `client` pointed at its gateway
(docs/agents.md).
"""

from __future__ import annotations

import json
import re

import openai
import reasoning_gym

ASK = "{question} Answer with just the number."
RETRY = "That is not right. Check the arithmetic and answer with just the number."


def _score(example: dict, text: str) -> float:
    numbers = re.findall(r"-?\d+", text)
    if not numbers:
        return 0.0
    metadata = json.loads(example["metadata"])
    entry = {"question": example["question"], "answer": example["answer"], "metadata": metadata}
    scorer = reasoning_gym.get_score_answer_fn(metadata["source_dataset"])
    return float(scorer(answer=numbers[-1], entry=entry))


async def run(
    client: openai.AsyncOpenAI, example: dict, tries: int = 2, retry_reward: float = 0.5
) -> float:
    messages = [{"role": "user", "content": ASK.format(question=example["question"])}]
    for attempt in range(tries):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content or ""
        if _score(example, answer) >= 1.0:
            return 1.0 if attempt == 0 else retry_reward
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": RETRY}]
    return 0.0

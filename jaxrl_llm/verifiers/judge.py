"""The `judge` reward entry: a model on the mesh reads each completion and writes a verdict.

    rewards = {
        "correct": 1.0,                                  # a rule-based verifier
        "judge": {"weight": 0.5, "options": {
            "model": "path/to/judge",                    # any model path jaxrl_llm loads
            "template": "Question: {question}\\nAnswer: {completion}\\nCorrect? ",
            "parser": "yes_no",                          # number | yes_no | regex:<pattern>
            "max_new_tokens": 8, "temperature": 0.0,     # greedy by default
        }},
    }

The trainer (`trainer.judges.Judge`) loads the model with its own tokenizer and `Sampler`,
renders the template for every completion of the step, samples all verdicts in ONE
batched sampler call, and parses each into a number (`parse_verdict`); the reward is
weight * verdict, summed with the other entries. A verdict the parser cannot read costs
that sample's term (0), is counted as an error of the entry, and the first one is shown,
exactly as a verifier that raises (`ScoreDetails`, `ErrorBudget`).

This module is the host side: the entry's options (`judge`'s signature, checked like any
verifier's), the template and the parsers. The `judge` function itself is never called:
the verifier pool refuses it (a judge needs the devices).
"""

from __future__ import annotations

import math
import re
import string

PARSERS = ("number", "yes_no", "regex:<pattern>")
NAMES = ("judge", "jaxrl_llm.verifiers.judge:judge")  # the entry's name, canonical or not
TEMPLATE_FIELDS = ("completion", "question", "answer")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def judge(
    completion: str,
    example: dict,
    *,
    model: str,
    template: str = "{question}\n{completion}\n",
    parser: str = "number",
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    question_field: str = "question",
    answer_field: str = "answer",
    prompt_len: int = 0,
) -> float:
    """The options of a `judge` reward entry (module doc). Not callable as a verifier: the
    trainer runs the judge on the mesh.

    Args:
      model: the judge model (a path as `model.path` takes).
      template: the judge's prompt; {completion}, {question} (the row's `question_field`,
        else the rendered prompt) and {answer} (the row's `answer_field`, else "").
      parser: number (the first number in the verdict) | yes_no (the verdict starts with
        yes -> 1 or no -> 0, case-insensitive) | regex:<pattern> (its first group, else
        the whole match, as a number).
      max_new_tokens: the verdict's token budget (the judge stops at its EOS).
      temperature: 0 = greedy.
      prompt_len: the judge prompts' width in the judge's tokens, rounded up to a bucket:
        one sampler program for every step whose prompts fit it, compiled before the
        first step. 0 = the template's tokens + data.max_prompt_len +
        rollout.max_new_tokens (the question and the completion at their budgets); a
        step with a longer prompt compiles its own bucket when it comes.
    """
    raise RuntimeError(
        "the judge reward entry runs on the mesh (trainer.judges), not in the verifier pool"
    )


def is_judge(spec) -> bool:
    """Whether a `VerifierSpec` is a judge entry (run by the trainer, not the pool)."""
    return spec.name in NAMES


def check_options(options: dict, where: str) -> None:
    """ValueError naming `where` (e.g. `rewards.judge.options`) for a bad template, parser,
    budget or temperature. The model path is checked by the trainer's config checks."""
    template = options.get("template", "{question}\n{completion}\n")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as err:
        raise ValueError(f"{where}.template: {err}") from None
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}.template: unknown field {{{unknown[0]}}}; known: "
            + ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
        )
    if "completion" not in fields:
        raise ValueError(f"{where}.template: must contain {{completion}}")
    parser = options.get("parser", "number")
    if parser not in ("number", "yes_no") and not str(parser).startswith("regex:"):
        raise ValueError(f"{where}.parser={parser!r}: expected one of {', '.join(PARSERS)}")
    if str(parser).startswith("regex:"):
        try:
            re.compile(parser[len("regex:") :])
        except re.error as err:
            raise ValueError(f"{where}.parser: bad pattern: {err}") from None
    budget = options.get("max_new_tokens", 16)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{where}.max_new_tokens={budget!r}: must be an integer >= 1")
    temp = options.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, int | float) or not temp >= 0:
        raise ValueError(f"{where}.temperature={temp!r}: must be >= 0 (0 = greedy)")
    width = options.get("prompt_len", 0)
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"{where}.prompt_len={width!r}: must be an integer >= 0 (0 = derived)")


def render(template: str, completion: str, example: dict, prompt: str, options: dict) -> str:
    """The judge's prompt for one completion (module doc)."""
    question = example.get(options.get("question_field", "question"), prompt)
    answer = example.get(options.get("answer_field", "answer"), "")
    return template.format(completion=completion, question=question, answer=answer)


def parse_verdict(text: str, parser: str) -> float:
    """The verdict as a number; ValueError("unparsable verdict ...") when the parser
    cannot read it."""
    if parser == "yes_no":
        word = text.strip().lower()
        if word.startswith("yes"):
            return 1.0
        if word.startswith("no"):
            return 0.0
    elif parser == "number":
        if (m := _NUMBER.search(text)) is not None:
            return _finite(m.group(0), text)
    else:
        m = re.search(parser[len("regex:") :], text)
        if m is not None:
            return _finite(m.group(1) if m.groups() else m.group(0), text)
    raise ValueError(f"unparsable verdict {text!r} (parser {parser})")


def _finite(value: str, text: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"unparsable verdict {text!r}: {value!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"unparsable verdict {text!r}: {value!r} is not finite")
    return x

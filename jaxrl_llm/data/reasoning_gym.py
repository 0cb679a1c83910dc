"""reasoning-gym tasks as a data source, scored by the task's own scorer.

    config.data.name = "reasoning_gym/basic_arithmetic"     # any reasoning-gym task
    config.data.options = {"max_terms": 2}                  # the task's settings (optional)
    config.rewards = {"reasoning_gym": 1.0}

reasoning-gym (`pip install reasoning-gym==0.1.25`) generates each task's rows
procedurally from a seed: row i of a split is the task's generator at (split seed, i), so
the rows are fixed, random access needs no file, and the iterator's saved position
resumes exactly. `data.options` are the task's own settings (the fields of its
config class, e.g. chain_sum's `min_terms`, `max_terms`, `max_digits`: its difficulty),
checked when the config is read. `data.split` is `train` or `test` (different seeds:
the held-out rows are not the training rows), each `ROWS` rows. A row is
`{"question", "answer", "metadata"}`; the verifier `reasoning_gym` scores a completion
with the task's `score_answer` on the text inside the completion's last
`<answer>...</answer>` (the whole completion when it has none), as reasoning-gym's own
evaluation does. The default template asks for the tags.
"""

from __future__ import annotations

import json
import re

PREFIX = "reasoning_gym/"
ROWS = 100_000
SPLIT_SEEDS = {"train": 1, "test": 2}
TEMPLATE = "{question}\nGive your final answer inside <answer></answer>."
INSTALL = "pip install reasoning-gym==0.1.25"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _module():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"data.name='reasoning_gym/...' needs reasoning-gym: {INSTALL}") from None
    return reasoning_gym


def check_name(name: str, split: str, options: dict | None = None) -> None:
    """ValueError naming the key when the task is unknown, the package missing, the
    split not one of SPLIT_SEEDS or an option not one the task's config takes (or a value
    it refuses)."""
    task = name.removeprefix(PREFIX)
    rg = _module()
    known = sorted(rg.factory.DATASETS)
    if task not in known:
        import difflib

        close = difflib.get_close_matches(task, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(known)} tasks)"
        raise ValueError(f"data.name={name!r}: no reasoning-gym task {task!r}{hint}")
    if split not in SPLIT_SEEDS:
        raise ValueError(
            f"data.split={split!r}: a reasoning-gym task has the splits {', '.join(SPLIT_SEEDS)}"
        )
    if options:
        import dataclasses

        config_class = rg.factory.DATASETS[task][1]
        fields = {f.name for f in dataclasses.fields(config_class)} - {"seed", "size"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"data.options.{unknown[0]}: not a setting of reasoning-gym task "
                f"{task!r} (its settings: {', '.join(sorted(fields))})"
            )
        try:
            rg.create_dataset(task, size=1, seed=0, **options)
        except Exception as err:  # the task's own validation (asserts, value errors)
            raise ValueError(
                f"data.options={options}: reasoning-gym task {task!r} refuses "
                f"them: {type(err).__name__}: {err}"
            ) from None


class ReasoningGymSource:
    """Rows of one reasoning-gym task (len, [i] -> dict, describe)."""

    def __init__(self, name: str, split: str = "train", options: dict | None = None):
        options = dict(options or {})
        check_name(name, split, options)
        self.name, self.split = name, split
        self._data = _module().create_dataset(
            name.removeprefix(PREFIX), size=ROWS, seed=SPLIT_SEEDS[split], **options
        )

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        entry = self._data[int(i)]
        # Metadata as JSON text: plain values for the iterator, the workers and samples.jsonl.
        return {
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "metadata": json.dumps(entry["metadata"], default=str),
        }

    def describe(self, i: int) -> str:
        return f"{self.name} split {self.split!r} row {i}"


def extract_answer(completion: str) -> str:
    """The text inside the last <answer>...</answer>, else the whole completion."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def score(completion: str, example: dict) -> float:
    """The task's own score of the completion's answer, in [0, 1]."""
    rg = _module()
    metadata = json.loads(example["metadata"])
    entry = {"question": example["question"], "answer": example["answer"], "metadata": metadata}
    scorer = rg.get_score_answer_fn(metadata["source_dataset"])
    return float(scorer(answer=extract_answer(completion), entry=entry))

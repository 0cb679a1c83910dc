"""TFDS builders for synthetic verifiable tasks, generated locally from a fixed seed.

    arithmetic/digits_N   "What is 482 * 17?"  answer "8194"; +, -, * on N-digit operands
    arithmetic/add_N      "What is 482 + 917?" answer "1399"; addition only (N = 2..6)
    arithmetic/mul_N      "What is 482 * 917?" answer "441994"; products only (N = 2..4)
                          (every arithmetic row also has `expression`: "482 * 917")
    countdown/numbers_N   N numbers in 1..100 and a target reachable with + - * / using each
                          number at most once (built from a random expression, so always
                          solvable); the building expression is kept as `solution`

Nothing is downloaded. Importing this module registers both builders with TFDS, so
`tfds.data_source("countdown/numbers_4", split="train", data_dir=...)` prepares the data on
first use (a few seconds) and reads it back as an array_record random-access source.
The same version always produces the same rows: generation is seeded per (config, split).

Preparing says one line (`data: generating arithmetic/digits_3 in DIR (once)`) instead of
TFDS's "Downloading and preparing dataset Unknown size ...", its progress bars and its
warnings about the not-yet-written version folder (`quiet_preparation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import sys
import zlib
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

_OPS = ("+", "-", "*")


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of generated datasets: no download, so no checksums file next to the code.

    TFDS would look for one through `importlib_resources`, which it does not install.
    """

    code_path = None

    def _log_download_bytes(self) -> None:
        name = f"{self.name}/{self.builder_config.name}"
        print(f"data: generating {name} in {self.data_dir} (once)", file=sys.stderr)

    def _log_download_done(self) -> None:
        pass


class _FreshVersionFolder(logging.Filter):
    """TFDS warns that the version folder it is about to fill has no dataset_info.json,
    and that an older version of the dataset is there (the new one is generated next to
    it, which the `data: generating ...` line says)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not msg.startswith(("Variant folder %s has no ", "Found a different version"))


@contextlib.contextmanager
def quiet_preparation():
    """Around opening one of these builders: no TFDS progress bars or fresh-folder
    warnings (the builder itself replaces TFDS's "Downloading ..." line with one of its
    own). Other warnings pass; the progress-bar setting is put back afterwards."""
    from tensorflow_datasets.core.utils import tqdm_utils

    shown = getattr(tqdm_utils, "_active", True)
    quiet = _FreshVersionFolder()
    absl_logger = logging.getLogger("absl")
    tfds.display_progress_bar(False)
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)
        tfds.display_progress_bar(shown)


def arithmetic_problem(rng: random.Random, digits: int, ops: tuple[str, ...] = _OPS) -> dict:
    """One problem with two `digits`-digit operands (1-digit operands include 0) and an
    operator drawn from `ops`."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    a, b = rng.randint(low, 10**digits - 1), rng.randint(low, 10**digits - 1)
    op = rng.choice(ops)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    expression = f"{a} {op} {b}"
    return {
        "question": f"What is {expression}?",
        "answer": str(value),
        "digits": digits,
        "expression": expression,
    }


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]):
    """A random exact-integer, positive combination of two (value, expression) pairs; each
    result is parenthesised, so `a / (b * c)` can never be written as `a / b * c`."""
    (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)
    options = [(x + y, f"({ex} + {ey})"), (x * y, f"({ex} * {ey})")]
    if x > y:
        options.append((x - y, f"({ex} - {ey})"))
    if y > 1 and x % y == 0:
        options.append((x // y, f"({ex} / {ey})"))
    return rng.choice(options)


def countdown_problem(rng: random.Random, count: int, max_target: int = 1000) -> dict:
    """`count` numbers in 1..100 and a target in 1..max_target built from all of them."""
    while True:
        numbers = [rng.randint(1, 100) for _ in range(count)]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            a = pool.pop(rng.randrange(len(pool)))
            b = pool.pop(rng.randrange(len(pool)))
            pool.append(_combine(rng, a, b))
        target, solution = pool[0]
        if 1 <= target <= max_target:
            break
    shown = ", ".join(map(str, numbers))
    question = (
        f"Using the numbers [{shown}], create an equation that equals {target}. You can use "
        "+, -, * and / and each number at most once."
    )
    return {"question": question, "numbers": numbers, "target": target, "solution": solution}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())  # stable across runs, unlike hash()


@dataclasses.dataclass
class ArithmeticConfig(tfds.core.BuilderConfig):
    digits: int = 2
    ops: tuple[str, ...] = _OPS  # operators drawn from, uniformly
    train_size: int = 20_000
    test_size: int = 1_000


class Arithmetic(_LocalBuilder):
    """Two-operand integer arithmetic, one difficulty level per config."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "1.1.0": "The `expression` field and the mul_N configs; rows unchanged.",
    }
    BUILDER_CONFIGS = (
        [ArithmeticConfig(name=f"digits_{d}", digits=d) for d in range(1, 7)]
        + [
            # From 2 digits: 1-digit addition has only 100 problems, too few to hold some out.
            ArithmeticConfig(name=f"add_{d}", digits=d, ops=("+",))
            for d in range(2, 7)
        ]
        + [ArithmeticConfig(name=f"mul_{d}", digits=d, ops=("*",)) for d in range(2, 5)]
    )

    def _info(self) -> tfds.core.DatasetInfo:
        features = {"question": tfds.features.Text(), "answer": tfds.features.Text()}
        features["digits"] = np.int32
        features["expression"] = tfds.features.Text()
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        del dl_manager  # generated locally: nothing to download
        cfg = self.builder_config
        test = list(self._problems("test", cfg.test_size, exclude=set()))
        held_out = {row["question"] for row in test}
        return {
            "train": self._generate_examples(self._problems("train", cfg.train_size, held_out)),
            "test": self._generate_examples(iter(test)),
        }

    def _problems(self, split: str, size: int, exclude: set) -> Iterator[dict]:
        """`size` problems; train never repeats a test question (below 2 digits, the space
        of problems is small, so train itself may repeat)."""
        cfg = self.builder_config
        # The digits_N seeds predate `ops`: they stay as they were, so their rows do too.
        key = ("arithmetic", cfg.digits, split)
        rng = random.Random(_seed(*key) if cfg.ops == _OPS else _seed(*key, cfg.ops))
        made = 0
        while made < size:
            row = arithmetic_problem(rng, cfg.digits, cfg.ops)
            if row["question"] not in exclude:
                made += 1
                yield row

    def _generate_examples(self, rows):
        yield from enumerate(rows)


@dataclasses.dataclass
class CountdownConfig(tfds.core.BuilderConfig):
    count: int = 4
    max_target: int = 1000
    train_size: int = 20_000
    test_size: int = 1_000


class Countdown(_LocalBuilder):
    """Countdown number puzzles, solvable by construction."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [CountdownConfig(name=f"numbers_{n}", count=n) for n in (3, 4, 5, 6)]

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict(
            {
                "question": tfds.features.Text(),
                "numbers": tfds.features.Sequence(np.int32),
                "target": np.int32,
                "solution": tfds.features.Text(),
            }
        )
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(split) for split in ("train", "test")}

    def _generate_examples(self, split: str):
        cfg = self.builder_config
        rng = random.Random(_seed("countdown", cfg.count, cfg.max_target, split))
        size = cfg.train_size if split == "train" else cfg.test_size
        for index in range(size):
            yield index, countdown_problem(rng, cfg.count, cfg.max_target)

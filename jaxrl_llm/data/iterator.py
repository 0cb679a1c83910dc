"""The resumable, per-process prompt iterator.

Order: epoch e visits the rows in `permutation(seed, e)` (or in file order without
shuffling); batches run across epoch ends, so every step is full. The position is the
GLOBAL one, `(epoch, index)` = the next row of the epoch's order, identical on every
process; each step takes the next `batch_size` usable rows globally and process p keeps
slice p of them. So a checkpointed position resumes exactly, and even a run resumed on a
different number of hosts sees the same global batches.

A bad row stops with `BadRow` (naming the file/split, row and field), or with
`skip_bad_rows` is skipped and counted; with skipping every process checks the whole global
window, so all processes skip the same rows and stay in step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_llm.data.prompts import collate
from jaxrl_llm.data.sources import BadRow


@dataclasses.dataclass
class Batch:
    """This process's share of one step's prompts.

    Attributes:
      prompt_ids: [b, T] int32, left-padded (b = batch_size / process_count).
      prompt_mask: [b, T] bool, True on real tokens.
      prompts: [b] prompt texts as given to the tokenizer.
      examples: [b] rows (canonical fields + the source's other columns) for the verifiers.
      rows: [b] source row indices.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    prompts: list[str]
    examples: list[dict]
    rows: list[int]


class PromptIterator:
    """Endless (or `num_epochs`-long) iterator of `Batch`es with a saveable position.

    Args:
      source: rows with `len`, `[i]` and `describe(i)` (see `sources`).
      prepare: `(row, where) -> (example, prompt text, token ids)`; raises `BadRow`.
      batch_size: prompts per step over ALL processes.
      seed: shuffling seed; shuffle: False keeps the source order.
      process_index, process_count: this host's slice (`jax.process_index()`, ...).
      skip_bad_rows: skip and count bad rows instead of stopping.
      num_epochs: stop after this many passes (None: endless).
      pad_id, pad_multiple, max_len: padding of the token ids (see `prompts.collate`).
    """

    def __init__(
        self,
        source,
        prepare: Callable,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        skip_bad_rows: bool = False,
        num_epochs: int | None = None,
        pad_id: int = 0,
        pad_multiple: int = 64,
        max_len: int = 512,
    ):
        if len(source) == 0:
            raise ValueError("the data source has no rows (check data.split / data.path)")
        if batch_size < 1 or batch_size % process_count:
            raise ValueError(
                f"batch_size={batch_size} must be a positive multiple of "
                f"process_count={process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        self.source, self.prepare, self.batch_size = source, prepare, batch_size
        self.seed, self.shuffle, self.skip_bad_rows = int(seed), shuffle, skip_bad_rows
        self.process_index, self.process_count, self.num_epochs = (
            process_index,
            process_count,
            num_epochs,
        )
        self.pad_id, self.pad_multiple, self.max_len = pad_id, pad_multiple, max_len
        self.skipped = 0  # bad rows skipped so far, saved with the position (a metric)
        self._epoch, self._index = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.source)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _take(self) -> int:
        """The next row id in global order; advances the position."""
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        row = int(self._order(self._epoch)[self._index])
        self._index += 1
        if self._index == len(self.source):
            self._epoch, self._index = self._epoch + 1, 0
        return row

    def _prepared(self, row: int):
        return self.prepare(self.source[row], self.source.describe(row))

    def _window(self) -> list[tuple[int, tuple]]:
        """This process's (row, prepared) share of the next global batch."""
        per_process = self.batch_size // self.process_count
        mine = range(self.process_index * per_process, (self.process_index + 1) * per_process)
        if not self.skip_bad_rows:
            rows = [self._take() for _ in range(self.batch_size)]
            return [(rows[i], self._prepared(rows[i])) for i in mine]
        good, bad_in_a_row = [], 0
        while len(good) < self.batch_size:
            row = self._take()
            try:
                good.append((row, self._prepared(row)))
                bad_in_a_row = 0
            except BadRow:
                self.skipped += 1
                bad_in_a_row += 1
                if bad_in_a_row >= len(self.source):
                    raise ValueError(
                        "every row of the data source is bad (skip_bad_rows)"
                    ) from None
        return [good[i] for i in mine]

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> Batch:
        saved = (self._epoch, self._index)
        try:
            window = self._window()
        except BaseException:
            self._epoch, self._index = saved  # an incomplete final batch is not consumed
            raise
        ids, mask = collate([p[2] for _, p in window], self.pad_id, self.pad_multiple, self.max_len)
        return Batch(
            prompt_ids=ids,
            prompt_mask=mask,
            prompts=[p[1] for _, p in window],
            examples=[p[0] for _, p in window],
            rows=[row for row, _ in window],
        )

    def whole(self) -> PromptIterator:
        """An iterator of whole global batches (every process's rows, in their order) from
        this position on, this one left where it is: what one process reads on behalf of
        all (a trainer of several processes fed by rollout workers, `rollout.shared`)."""
        whole = copy.copy(self)
        whole.process_index, whole.process_count = 0, 1
        return whole

    def metrics(self) -> dict[str, float]:
        """`data/skipped_rows`: bad rows skipped since the run began (resumes included)."""
        return {"data/skipped_rows": float(self.skipped)}

    def state(self) -> dict:
        """The position as a JSON-able dict: {"epoch", "index", "seed", "size", "skipped"}."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "size": len(self.source),
            "skipped": self.skipped,
        }

    def restore(self, state: dict) -> None:
        """Continue from a position saved by `state()`; refuses one from another dataset or
        seed, which would silently change the prompts. (A position saved before `skipped`
        was part of it restores with a count of 0.)"""
        expected = {"epoch", "index", "seed", "size"}
        if not isinstance(state, dict) or set(state) - {"skipped"} != expected:
            raise ValueError(f"data position must have keys {sorted(expected)}, got {state!r}")
        if state["seed"] != self.seed:
            raise ValueError(
                f"data position was saved with seed {state['seed']}, data.seed is {self.seed}"
            )
        if state["size"] != len(self.source):
            raise ValueError(
                f"data position was saved for {state['size']} rows, "
                f"the source has {len(self.source)}"
            )
        if not (0 <= state["index"] < len(self.source) and state["epoch"] >= 0):
            raise ValueError(f"data position {state!r} is out of range")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self.skipped = int(state.get("skipped", 0))

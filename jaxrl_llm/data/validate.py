"""Up-front checks of the data rows, so a bad row stops the run before anything compiles.

    check = data.check_rows(config.data, tokenizer)   # BadRow naming file and line...
    print(check.summary())                            # ...or, with skip_bad_rows, a count

What is checked per row, exactly as the iterator will see it: that it is UTF-8 and one JSON
object (JSONL), has the configured fields with the right types (`data.fields`), fills the
template, and is not longer in characters than `data.max_prompt_len` tokens can be (see
`prompts.PromptBuilder.check_chars`). Rows are not tokenized: a row whose token count
alone is over the limit is still found when the iterator reaches it.

Which rows: every row of a JSONL file up to `max_bytes`, else the first `max_rows`; the
first `max_rows` of a TFDS split.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_llm.data.config import check_config, make_source, prompt_builder, row_format
from jaxrl_llm.data.sources import BadRow

MAX_BYTES = 64 << 20  # a JSONL file this small is checked whole (about a second)
MAX_ROWS = 10_000
_LISTED = 3


@dataclasses.dataclass
class RowCheck:
    """What `check_rows` found.

    Attributes:
      checked: rows read; total: rows in the source.
      bad: bad rows among the checked (only with data.skip_bad_rows: else the first
        one raised).
      examples: the first few bad rows' messages.
    """

    checked: int
    total: int
    bad: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.checked == self.total

    def summary(self) -> str:
        """One line for the console, e.g. `data: 3 of 1,000 rows checked are bad and will
        be skipped (first: ...)`."""
        scope = "rows" if self.complete else f"rows checked (of {self.total:,})"
        if not self.bad:
            return f"data: {self.checked:,} {scope}, none bad"
        return (
            f"data: {self.bad:,} of {self.checked:,} {scope} are bad and will be skipped "
            f"(data.skip_bad_rows); first: {self.examples[0]}"
        )


def _rows_to_check(cfg, source, max_bytes: int, max_rows: int) -> int:
    if cfg.get("source", "tfds") == "jsonl" and os.path.getsize(cfg.path) <= max_bytes:
        return len(source)
    return min(len(source), max_rows)


def check_rows(
    cfg, tokenizer=None, *, max_bytes: int = MAX_BYTES, max_rows: int = MAX_ROWS
) -> RowCheck:
    """Reads the configured rows up front (see module docstring).

    Args:
      cfg: the `data` config section.
      tokenizer: when given, prompts are built and their length in characters checked.
      max_bytes, max_rows: how much is read (module docstring).

    Raises:
      BadRow: the first bad row (`<file> line <n>: <what>`) unless data.skip_bad_rows;
        with it, only when every row checked is bad.
    """
    check_config(cfg)
    source = make_source(cfg)
    fields = row_format(cfg)
    builder = None if tokenizer is None else prompt_builder(cfg, tokenizer)
    skip = bool(cfg.get("skip_bad_rows", False))
    result = RowCheck(checked=_rows_to_check(cfg, source, max_bytes, max_rows), total=len(source))
    try:
        for index in range(result.checked):
            where = source.describe(index)
            try:
                example = fields(source[index], where)
                if builder is not None:
                    builder.check_chars(builder.text(example, where), where)
            except BadRow as err:
                if not skip:
                    raise
                result.bad += 1
                if len(result.examples) < _LISTED:
                    result.examples.append(str(err))
    finally:
        if hasattr(source, "close"):
            source.close()
    if result.checked and result.bad == result.checked:
        raise BadRow(
            f"data: every one of the {result.checked:,} rows checked is bad; first: "
            f"{result.examples[0]}"
        )
    return result

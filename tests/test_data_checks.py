"""Data that fails fast and cheap: a 30 MB row under a memory ceiling, bad JSONL rows named
up front (file and line), skipped rows counted across a resume."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxrl_llm import data
from jaxrl_llm.data import prompts
from jaxrl_llm.errors import format_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "jaxrl_llm", "assets", "arithmetic_tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def jsonl(path, lines) -> str:
    """Writes raw lines (bytes, str, or rows as dicts) to `path`."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write(line if isinstance(line, bytes) else line.encode())
            f.write(b"\n")
    return str(path)


def config(path, **overrides):
    cfg = data.default_config()
    cfg.source, cfg.path, cfg.shuffle = "jsonl", path, False
    cfg.fields = {"question": "question", "answer": "answer"}
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


_HUGE_ROW = """
import json, resource, sys
from transformers import AutoTokenizer
from jaxrl_llm import data

tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
cfg = data.default_config()
cfg.source, cfg.path, cfg.shuffle, cfg.max_prompt_len = "jsonl", sys.argv[1], False, 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
errors = []
try:
    data.check_rows(cfg, tokenizer)
except data.BadRow as err:
    errors.append(str(err))
iterator = data.make_iterator(cfg, tokenizer, batch_size=2)
next(iterator)  # rows 1-2 are fine
try:
    next(iterator)
except data.BadRow as err:
    errors.append(str(err))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth_mb": (after - before) / 1024, "errors": errors}))
"""


def test_30mb_row_is_refused_by_length_under_a_memory_ceiling(tmp_path, tokenizer):
    """Tokenizing the row whole would take gigabytes; refused by its character count, the
    peak memory grows by a few copies of the 30 MB line."""
    huge = "1" * (30 << 20)
    path = jsonl(
        tmp_path / "d.jsonl",
        [{"question": "1+1"}, {"question": "2+2"}, {"question": huge}, {"question": "3+3"}],
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_HUGE_ROW), path, TOKENIZER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    limit = 20 * prompts.max_token_chars(tokenizer)
    expected = (
        f"{path} line 3: prompt is {len(huge):,} characters, more than any prompt of "
        f"data.max_prompt_len=20 tokens can have with this tokenizer ({limit:,})"
    )
    assert out["errors"] == [expected, expected]  # up front, and from the iterator
    assert out["peak_growth_mb"] < 400, out


def test_character_bound_never_refuses_a_prompt_that_fits(tokenizer):
    """The bound is sound: at most max_token_chars characters per token."""
    builder = prompts.PromptBuilder(tokenizer, "{question}", chat_template="never", max_len=64)
    longest = max(tokenizer.get_vocab(), key=len)
    text, ids = builder({"question": longest * 8})
    assert len(ids) <= 64 and len(text) <= builder.max_chars


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 3: invalid JSON (Expecting property name"),
        ('{"answer": "4"}', "line 3: missing field 'question' (data.fields.question)"),
        ('{"question": 7, "answer": "4"}', "line 3: field 'question': expected a string"),
        (b'{"question": "caf\xe9", "answer": "1"}', "line 3: not UTF-8 (byte 0xe9 at column 18)"),
        ('["a list"]', "line 3: expected a JSON object, got list"),
    ],
)
def test_bad_rows_are_found_up_front_naming_file_and_line(tmp_path, tokenizer, line, message):
    rows = (
        [{"question": "1+1", "answer": "2"}] * 2 + [line] + [{"question": "2+2", "answer": "4"}] * 2
    )
    path = jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(data.BadRow) as err:
        data.check_rows(config(path), tokenizer)
    assert str(err.value).startswith(f"{path} {message}")
    assert format_error(err.value).startswith(f"error: {path} {message}")


def test_template_fields_are_checked_up_front(tmp_path, tokenizer):
    path = jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "2"}])
    cfg = config(path, template="{question} in {unit}")
    with pytest.raises(data.BadRow, match=r"line 1: data.template uses \['unit'\]"):
        data.check_rows(cfg, tokenizer)
    assert data.check_rows(cfg).checked == 1  # without a tokenizer prompts are not built


def test_skip_bad_rows_counts_them_up_front(tmp_path, tokenizer):
    rows = [{"question": "1+1", "answer": "2"}, "{oops", {"answer": "3"}, b'{"question": "\xff"}']
    path = jsonl(tmp_path / "d.jsonl", rows + [{"question": "2+2", "answer": "4"}])
    check = data.check_rows(config(path, skip_bad_rows=True), tokenizer)
    assert (check.checked, check.total, check.bad, check.complete) == (5, 5, 3, True)
    assert check.summary().startswith(
        f"data: 3 of 5 rows are bad and will be skipped (data.skip_bad_rows); first: {path} "
        "line 2: invalid JSON"
    )
    all_bad = jsonl(tmp_path / "bad.jsonl", ["{oops", "{oops"])
    with pytest.raises(data.BadRow, match="every one of the 2 rows checked is bad"):
        data.check_rows(config(all_bad, skip_bad_rows=True), tokenizer)


def test_a_large_file_is_checked_only_up_to_max_rows(tmp_path, tokenizer):
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(50)] + ["{late"]
    path = jsonl(tmp_path / "d.jsonl", rows)
    check = data.check_rows(config(path), tokenizer, max_bytes=100, max_rows=20)
    assert (check.checked, check.total, check.complete) == (20, 51, False)
    assert check.summary() == "data: 20 rows checked (of 51), none bad"
    with pytest.raises(data.BadRow, match="line 51: invalid JSON"):
        data.check_rows(config(path), tokenizer)  # small enough: every row


def test_skipped_rows_metric_survives_a_resume(tmp_path, tokenizer):
    rows = [{"question": "1+1", "answer": "2"}, "{oops", {"answer": "3"}]
    path = jsonl(tmp_path / "d.jsonl", rows * 4)
    cfg = config(path, skip_bad_rows=True)
    it = data.make_iterator(cfg, tokenizer, batch_size=2)
    next(it)  # rows 1 and 4; 2 and 3 skipped
    assert it.metrics() == {"data/skipped_rows": 2.0}
    saved = json.loads(json.dumps(it.state()))
    resumed = data.make_iterator(cfg, tokenizer, batch_size=2)
    resumed.restore(saved)
    assert resumed.metrics() == {"data/skipped_rows": 2.0}
    next(resumed)  # rows 7 and 10; 5, 6, 8 and 9 skipped
    assert resumed.metrics() == {"data/skipped_rows": 6.0}
    old = {k: v for k, v in saved.items() if k != "skipped"}  # a checkpoint from before
    resumed.restore(old)
    assert resumed.metrics() == {"data/skipped_rows": 0.0}

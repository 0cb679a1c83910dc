"""Data: the synthetic TFDS builders, TFDS (mock gsm8k) and JSONL sources, prompt building,
and the iterator's determinism, resumption, sharding and bad-row handling."""

import itertools
import json
import random
import re
import zlib
from fractions import Fraction

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")
tokenizers = pytest.importorskip("tokenizers")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from jaxrl_llm import data, verifiers  # noqa: E402
from jaxrl_llm.data import builders  # noqa: E402

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer(chat_template=None):
    """One token per UTF-8 byte, a BOS added to plain text, optional chat template."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(sorted(alphabet))}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _prepare(builder_cls, config, data_dir, split="train"):
    builder = builder_cls(config=config, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    return [data.plain(r) for r in builder.as_data_source(split=split)]


def test_arithmetic_answers_are_right(data_dir):
    config = builders.ArithmeticConfig(name="t3", digits=3, train_size=300, test_size=50)
    rows = _prepare(builders.Arithmetic, config, data_dir)
    test = _prepare(builders.Arithmetic, config, data_dir, "test")
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["question"]).groups()
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert int(row["answer"]) == ops[op](int(a), int(b))
        assert row["expression"] == f"{a} {op} {b}"
    assert not {r["question"] for r in rows} & {r["question"] for r in test}
    again = _prepare(builders.Arithmetic, config, data_dir + "/again")
    assert rows == again  # same version, same rows


def test_addition_configs_hold_out_additions_only(data_dir):
    config = builders.ArithmeticConfig(name="a2", digits=2, ops=("+",), train_size=300)
    rows = _prepare(builders.Arithmetic, config, data_dir)
    test = _prepare(builders.Arithmetic, config, data_dir, "test")
    for row in rows + test:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["question"]).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(row["answer"]) == a + b
    assert not {r["question"] for r in rows} & {r["question"] for r in test}
    names = [c.name for c in builders.Arithmetic.BUILDER_CONFIGS]
    assert {"add_2", "add_3", "digits_2", "mul_3"} <= set(names)


def test_digits_rows_are_those_of_the_original_recipe(data_dir):
    """digits_N is unchanged by `ops`: rows as the original generator drew them (seed = crc32
    of the config and split; two operands, then an operator out of + - *), redone here."""
    config = builders.ArithmeticConfig(name="d2", digits=2, train_size=40, test_size=30)
    test = _prepare(builders.Arithmetic, config, data_dir, "test")
    rng = random.Random(zlib.crc32(repr(("arithmetic", 2, "test")).encode()))
    expected = []
    for _ in test:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        expected.append((f"What is {a} {op} {b}?", str({"+": a + b, "-": a - b, "*": a * b}[op])))
    # TFDS stores the rows in its own shuffled order.
    assert sorted((r["question"], r["answer"]) for r in test) == sorted(expected)


def _reachable(numbers: list[int]) -> set[Fraction]:
    """Every value an expression using each number at most once can take (brute force)."""
    values = set()
    for size in range(1, len(numbers) + 1):
        for subset in itertools.permutations(numbers, size):
            values |= _combine_all([Fraction(n) for n in subset])
    return values


def _combine_all(nums):
    if len(nums) == 1:
        return {nums[0]}
    out = set()
    for split in range(1, len(nums)):
        for x in _combine_all(nums[:split]):
            for y in _combine_all(nums[split:]):
                out |= {x + y, x - y, x * y}
                if y:
                    out.add(x / y)
    return out


def test_countdown_is_solvable_by_construction(data_dir):
    config = builders.CountdownConfig(name="t3", count=3, train_size=60, test_size=5)
    rows = _prepare(builders.Countdown, config, data_dir)
    score = verifiers.get("countdown", use_all=True)
    for row in rows:
        assert len(row["numbers"]) == 3 and 1 <= row["target"] <= 1000
        assert Fraction(row["target"]) in _reachable(row["numbers"])  # independent solver
        assert score(f"<answer>{row['solution']}</answer>", row) == 1.0
        assert f"equals {row['target']}" in row["question"]


def test_registered_builder_end_to_end(data_dir):
    cfg = data.default_config()
    cfg.name, cfg.data_dir, cfg.split = "arithmetic/digits_2", data_dir, "test"
    it = data.make_iterator(cfg, byte_tokenizer(), batch_size=4)
    batch = next(it)
    assert batch.prompt_ids.shape == (4, 64) and batch.prompt_ids.dtype == np.int32
    assert all(p.startswith("What is ") and "####" in p for p in batch.prompts)
    gsm8k = verifiers.get("gsm8k")
    assert all(gsm8k(f"#### {ex['answer']}", ex) == 1.0 for ex in batch.examples)


def test_gsm8k_through_tfds_mock_data():
    cfg = data.default_config()
    cfg.name = "gsm8k"
    with tfds.testing.mock_data(num_examples=12):
        source = data.make_source(cfg)
        assert len(source) == 12
        row = source[3]
        assert set(row) >= {"question", "answer"} and isinstance(row["question"], str)
        it = data.make_iterator(cfg, byte_tokenizer(), batch_size=6)
        batch = next(it)
    assert [ex["question"] in p for ex, p in zip(batch.examples, batch.prompts, strict=True)] == [
        True
    ] * 6


def test_missing_tfds_dataset_errors_clearly(tmp_path):
    with pytest.raises(ValueError, match="no TFDS dataset named 'no_such_dataset_xyz'"):
        data.TfdsSource("no_such_dataset_xyz", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tfds build gsm8k"):
        data.TfdsSource("gsm8k", data_dir=str(tmp_path))


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _jsonl_iterator(path, batch_size=4, **overrides):
    cfg = data.default_config()
    cfg.source, cfg.path = "jsonl", path
    cfg.fields = {"question": "problem", "answer": "solution"}
    cfg.template = "Q: {question}"
    cfg.pad_multiple = 8
    cfg.update(overrides)
    return data.make_iterator(cfg, byte_tokenizer(), batch_size=batch_size)


@pytest.fixture
def good_jsonl(tmp_path):
    rows = [{"problem": f"p{i}", "solution": str(i), "extra": i} for i in range(10)]
    return _write_jsonl(tmp_path / "good.jsonl", rows)


def test_same_seed_same_order_and_epochs_are_permutations(good_jsonl):
    first = [next(_jsonl_iterator(good_jsonl, batch_size=5)).rows for _ in range(1)]
    order = [
        row for batch in itertools.islice(_jsonl_iterator(good_jsonl, 5), 4) for row in batch.rows
    ]
    assert first[0] == order[:5]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert order[:10] != order[10:]  # reshuffled per epoch
    other = [r for b in itertools.islice(_jsonl_iterator(good_jsonl, 5, seed=1), 2) for r in b.rows]
    assert other != order[:10]
    plain = [
        r
        for b in itertools.islice(_jsonl_iterator(good_jsonl, 5, shuffle=False), 2)
        for r in b.rows
    ]
    assert plain == list(range(10))


def test_resume_from_saved_position_continues_identically(good_jsonl):
    it = _jsonl_iterator(good_jsonl, batch_size=3)
    for _ in range(4):  # crosses the epoch boundary (12 > 10 rows)
        next(it)
    saved = json.loads(json.dumps(it.state()))
    expected = [next(it) for _ in range(5)]
    resumed = _jsonl_iterator(good_jsonl, batch_size=3)
    resumed.restore(saved)
    for want, got in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        assert want.rows == got.rows and want.prompts == got.prompts
        np.testing.assert_array_equal(want.prompt_ids, got.prompt_ids)
    with pytest.raises(ValueError, match="saved with seed 0, data.seed is 7"):
        _jsonl_iterator(good_jsonl, seed=7).restore(saved)
    with pytest.raises(ValueError, match="keys"):
        resumed.restore({"epoch": 0})


def _sharded(path, batch_size, count, steps, start=None, **overrides):
    """rows[step][process] for `count` processes."""
    iterators = []
    for p in range(count):
        cfg = data.default_config()
        cfg.source, cfg.path, cfg.template = "jsonl", path, "{question}"
        cfg.fields = {"question": "problem"}
        cfg.update(overrides)
        it = data.make_iterator(
            cfg, byte_tokenizer(), batch_size, process_index=p, process_count=count
        )
        if start:
            it.restore(start)
        iterators.append(it)
    return [[next(it).rows for it in iterators] for _ in range(steps)]


def test_processes_split_the_global_batch(good_jsonl):
    single = _sharded(good_jsonl, 4, 1, 5)
    double = _sharded(good_jsonl, 4, 2, 5)
    for one, two in zip(single, double, strict=True):
        assert one[0] == two[0] + two[1]
    assert not set(sum(double[0] + double[1], [])) - set(range(10))  # steps 0-1: epoch 0
    assert len(set(sum(double[0] + double[1], []))) == 8  # no row twice within an epoch
    # Resuming on a different number of hosts keeps the global batches.
    it = _jsonl_iterator(good_jsonl, batch_size=4)
    next(it)
    after = _sharded(good_jsonl, 4, 4, 3, start=it.state())
    assert [sum(step, []) for step in after] == [s[0] for s in single[1:4]]


@pytest.fixture
def bad_jsonl(tmp_path):
    rows = [
        {"problem": "p0", "solution": "0"},
        {"problem": "p1", "solution": "1"},
        "{not json",
        {"problem": "p3", "solution": "3"},
        {"problem": 4, "solution": "4"},
        {"solution": "5"},
        {"problem": "p6", "solution": "6"},
        {"problem": "x" * 100, "solution": "7"},
    ]
    return _write_jsonl(tmp_path / "bad.jsonl", rows)


def test_bad_rows_stop_with_file_row_and_field(bad_jsonl):
    with pytest.raises(data.BadRow, match=r"bad.jsonl line 3: invalid JSON"):
        list(itertools.islice(_jsonl_iterator(bad_jsonl, 8, shuffle=False), 1))
    source = data.JsonlSource(bad_jsonl)
    fmt = data.RowFormat({"question": "problem"})
    with pytest.raises(data.BadRow, match=r"bad.jsonl line 5: field 'problem': expected a string"):
        fmt(source[4], source.describe(4))
    with pytest.raises(
        data.BadRow, match=r"line 6: missing field 'problem' \(data.fields.question\)"
    ):
        fmt(source[5], source.describe(5))
    it = _jsonl_iterator(bad_jsonl, 1, shuffle=False, max_prompt_len=40)
    with pytest.raises(
        data.BadRow, match=r"line 8: prompt is 104 tokens, above data.max_prompt_len=40"
    ):
        it.restore({"epoch": 0, "index": 7, "seed": 0, "size": 8})
        next(it)


def test_skip_bad_rows_counts_and_keeps_processes_in_step(bad_jsonl):
    overrides = {"skip_bad_rows": True, "shuffle": False, "max_prompt_len": 40}
    it = _jsonl_iterator(bad_jsonl, 4, **overrides)
    assert next(it).rows == [0, 1, 3, 6] and it.skipped == 3  # lines 3, 5, 6
    both = _sharded(bad_jsonl, 4, 2, 3, **overrides)
    assert [a + b for a, b in both] == [[0, 1, 3, 6], [0, 1, 3, 6], [0, 1, 3, 6]]


def test_num_epochs_stops(good_jsonl):
    batches = list(_jsonl_iterator(good_jsonl, 3, num_epochs=2))
    assert len(batches) == 6  # 20 rows, the incomplete 7th batch is not served


def test_prompt_building_with_and_without_chat_template():
    example = {"question": "2+2?"}
    plain = data.PromptBuilder(byte_tokenizer(), "Q: {question}", system_prompt="Be brief.")
    text, ids = plain(example)
    assert text == "Be brief.\n\nQ: 2+2?" and ids[0] == 1 and len(ids) == len(text) + 1
    chat = data.PromptBuilder(byte_tokenizer(CHAT), "Q: {question}", system_prompt="Be brief.")
    text, ids = chat(example)
    assert text == "<|system|>Be brief.\n<|user|>Q: 2+2?\n<|assistant|>"
    assert ids[0] != 1 and len(ids) == len(text.encode())  # no second BOS
    never = data.PromptBuilder(byte_tokenizer(CHAT), "{question}", chat_template="never")
    assert never(example)[0] == "2+2?"
    with pytest.raises(ValueError, match="no chat template"):
        data.PromptBuilder(byte_tokenizer(), "{question}", chat_template="always")
    with pytest.raises(ValueError, match="literal braces"):
        data.PromptBuilder(byte_tokenizer(), "Put it in \\boxed{} please: {question}")
    with pytest.raises(data.BadRow, match=r"row 3: data.template uses \['answer'\]"):
        data.PromptBuilder(byte_tokenizer(), "{question} {answer}")(example, "row 3")


def test_collate_left_pads_to_bucket():
    rows = [[5, 6, 7], [8], list(range(10, 19))]
    ids, mask = data.collate(rows, pad=0, multiple=4, max_len=64)
    assert ids.shape == (3, 12)
    for i, row in enumerate(rows):  # naive reference: pad on the left by hand
        expected = [0] * (12 - len(row)) + row
        assert ids[i].tolist() == expected
        assert mask[i].tolist() == [False] * (12 - len(row)) + [True] * len(row)
    assert data.collate(rows, 0, 8, 10)[0].shape == (3, 10)  # bucket capped at max_len


def test_config_errors_name_the_key():
    ml_collections = pytest.importorskip("ml_collections")
    cfg = ml_collections.ConfigDict({**data.default_config().to_dict(), "seed": "zero"})
    with pytest.raises(ValueError, match=r"data.seed: expected int"):
        data.check_config(cfg)
    cfg = data.default_config()
    cfg.source = "csv"
    with pytest.raises(ValueError, match="data.source must be"):
        data.check_config(cfg)
    cfg = data.default_config()
    cfg.source = "jsonl"
    with pytest.raises(ValueError, match="data.path: required"):
        data.check_config(cfg)
    with pytest.raises(FileNotFoundError, match="data.path: JSONL file 'nope.jsonl'"):
        data.JsonlSource("nope.jsonl")
    cfg = data.default_config().to_dict()
    cfg["batchsize"] = 3
    with pytest.raises(ValueError, match="data.batchsize: unknown key"):
        data.check_config(ml_collections.ConfigDict(cfg))

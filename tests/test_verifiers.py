"""Built-in verifiers on hand-written correct / incorrect / malformed completions, and the
registry's parsing of reward configs."""

import os
import pickle
import random
import re
from fractions import Fraction

import pytest

from jaxrl_llm import verifiers
from jaxrl_llm.verifiers import countdown as countdown_lib
from jaxrl_llm.verifiers import extract, numeric

GSM8K_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_REF, 1.0),
        ("#### 71", GSM8K_REF, 0.0),
        ("The answer is \\boxed{72}.", GSM8K_REF, 1.0),
        ("So in total 72", GSM8K_REF, 1.0),  # last number
        ("72 is wrong, the total is 73", GSM8K_REF, 0.0),
        ("The total is 1,000.", "1000", 1.0),  # thousands separator
        ("#### $1,000", "1000", 1.0),
        ("#### 1000.0", "1,000", 1.0),  # trailing .0
        ("It costs 5.", "5", 1.0),  # sentence dot is not a decimal point
        ("It costs 5.5", "5", 0.0),
        ("The temperature is -3 degrees", "-3", 1.0),
        ("The change is −3", "-3", 1.0),  # Unicode minus
        ("10-4", "-4", 0.0),  # a binary minus is not a sign
        ("10-4", "4", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{3} or maybe \\boxed{4}", "4", 0.0),  # hedging
        ("\\boxed{3} or maybe \\boxed{4}", "3", 0.0),
        ("\\boxed{4} and again \\boxed{4.0}", "4", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("#### 18 dollars", "18", 1.0),
        ("#### 7\nthen I kept talking about 9", "7", 1.0),  # #### wins over the last number
        ("no answer here", "7", 0.0),
        ("", "7", 0.0),
        ("\\boxed{72", GSM8K_REF, 1.0),  # unclosed box: falls back to the last number
        ("50%", "50", 1.0),
        ("so 3/4 of them", "0.75", 1.0),
    ],
)
def test_gsm8k(completion, answer, expected):
    assert verifiers.get("gsm8k")(completion, {"answer": answer}) == expected


def test_gsm8k_numeric_reference_and_bad_rows():
    fn = verifiers.get("gsm8k")
    assert fn("#### 72", {"answer": 72}) == 1.0
    assert fn("#### 0.1", {"answer": 0.1}) == 1.0
    with pytest.raises(ValueError, match="has no number"):
        fn("#### 3", {"answer": "no digits"})
    with pytest.raises(KeyError, match="'answer'"):
        fn("#### 3", {"question": "q"})
    assert verifiers.get("gsm8k", answer_key="label")("#### 3", {"label": "3"}) == 1.0


def test_numbers_against_python_float_parsing():
    """`numbers` on random formatted numbers agrees with a plain float() of the original."""
    rng = random.Random(0)
    for _ in range(300):
        value = rng.randint(-(10**7), 10**7)
        cents = rng.randint(0, 99)
        text = f"{value:,}.{cents:02d}" if rng.random() < 0.5 else f"{value:,}"
        parsed = numeric.numbers(f"pay {text} now")
        assert len(parsed) == 1
        assert float(parsed[0]) == pytest.approx(float(text.replace(",", "")))


def test_boxed_and_tags():
    assert extract.boxed_contents(r"x \boxed{\frac{1}{2}} y \boxed{3}") == [r"\frac{1}{2}", "3"]
    assert extract.boxed_contents(r"\boxed{open") == []
    assert extract.tagged("<answer>1</answer> <answer> 2 </answer>", "answer") == "2"
    assert extract.tagged("nothing", "answer") is None
    text = "text\n```python\ndef f(): pass\n```\nmore\n```python\ndef g(): pass\n```"
    assert extract.code_block(text) == "def g(): pass\n"
    assert extract.code_block("```python\ndef cut(") == "def cut("
    assert extract.code_block("plain code") == "plain code"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("so \\boxed{\\frac{2}{4}}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{3} or \\boxed{4}", "4", 0.0),  # two boxed answers: a set, not 4
        ("I do not know", "4", 0.0),
        ("the answer is 5.", "5", 1.0),
        ("... hence \\boxed{-7}", "Solution: ... \\boxed{-7}", 1.0),
    ],
)
def test_math(completion, answer, expected):
    assert verifiers.get("math")(completion, {"answer": answer}) == expected


def test_math_require_boxed_and_bad_reference():
    assert verifiers.get("math", require_boxed=True)("the answer is 5", {"answer": "5"}) == 0.0
    assert verifiers.get("math", require_boxed=True)("\\boxed{5}", {"answer": "5"}) == 1.0
    with pytest.raises(KeyError):
        verifiers.get("math")("\\boxed{5}", {})


def test_format():
    fn = verifiers.get("format")
    assert fn("<think>a\nb</think>\n<answer>4</answer>", {}) == 1.0
    assert fn("<think>a</think> extra <answer>4</answer>", {}) == 0.0
    assert fn("<answer>4</answer>", {}) == 0.0
    search = verifiers.get("format", pattern=r"<answer>\d+</answer>", mode="search")
    assert search("blah <answer>42</answer> blah", {}) == 1.0
    assert search("blah <answer>x</answer>", {}) == 0.0
    with pytest.raises(ValueError, match="mode"):
        verifiers.get("format", mode="match")("x", {})


def _reference_value(expr: str) -> Fraction:
    """Independent evaluation for the test: Python's own evaluator on Fractions."""
    return eval(re.sub(r"\d+", r"Fraction(\g<0>)", expr), {"Fraction": Fraction})  # test-made


def test_countdown_parser_matches_python_on_random_expressions():
    rng = random.Random(1)
    ops = ["+", "-", "*", "/"]
    for _ in range(300):
        nums = [rng.randint(1, 99) for _ in range(rng.randint(2, 5))]
        expr = str(nums[0])
        for n in nums[1:]:
            expr = (
                f"({expr} {rng.choice(ops)} {n})"
                if rng.random() < 0.5
                else f"{expr} {rng.choice(ops)} {n}"
            )
        try:
            expected = _reference_value(expr)
        except ZeroDivisionError:
            continue
        value, used = countdown_lib.parse_expression(expr)
        assert value == expected and sorted(used) == sorted(nums)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>(25 - 5) * 4</answer>", 1.0),
        ("reasoning <answer>wrong</answer> <answer>25 * 4 - 5 * 4</answer>", 0.0),  # 5 twice
        ("<answer>(25 - 5) * 4 = 80</answer>", 1.0),
        ("<answer>25 * 4</answer>", 0.0),  # 100
        ("<answer>(25 - 5) × 4</answer>", 1.0),
        ("<answer>(25 - 5) * 4 * 1</answer>", 0.0),  # 1 is not given
        ("<answer>-(5 - 25) * 4</answer>", 0.0),  # unary minus
        ("<answer>__import__('os').system('true')</answer>", 0.0),  # never evaluated
        ("<answer>(25 - 5) ** 4</answer>", 0.0),
        ("<answer>80.0</answer>", 0.0),
        ("<answer>4 * 20 / (3 - 3)</answer>", 0.0),  # division by zero
        ("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", 0.0),
        ("(25 - 5) * 4", 0.0),  # no tags
    ],
)
def test_countdown(completion, expected):
    example = {"numbers": [25, 5, 4, 3], "target": 80}
    assert verifiers.get("countdown")(completion, example) == expected


def test_countdown_options():
    example = {"numbers": [6, 4, 2], "target": 3}
    assert verifiers.get("countdown")("<answer>6 / 4 * 2</answer>", example) == 1.0  # exact
    assert verifiers.get("countdown", use_all=True)("<answer>6 / 2</answer>", example) == 0.0
    assert (
        verifiers.get("countdown", format_score=0.1)("<answer>6 / 2 * 4</answer>", example) == 0.1
    )
    assert verifiers.get("countdown", answer_tag="")("thinking...\n6 / 2\n", example) == 1.0
    dup = {"numbers": [5, 5, 2], "target": 12}
    assert verifiers.get("countdown")("<answer>5 + 5 + 2</answer>", dup) == 1.0


def test_overlong_is_not_a_verifier():
    """DAPO's overlong penalty has one home, the trainer's shaping of the sampled token
    counts (tests/test_rollout.py, tests/test_advantages.py); its old verifier name says
    where it went instead of scoring anything."""
    with pytest.raises(ValueError, match="'overlong' is not a verifier: .*algo.overlong_penalty"):
        verifiers.get("overlong", max_len=4, buffer=2)
    with pytest.raises(ValueError, match="algo.overlong_penalty"):
        verifiers.parse_specs({"overlong": 1.0})


def test_python_tests_verifier():
    fn = verifiers.get("python_tests", cpu_s=1, wall_s=3.0)
    row = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert fn(good, row) == 1.0
    assert fn("```python\ndef add(a, b):\n    return a - b\n```", row) == 0.0
    constant = "```python\ndef add(a, b):\n    return 3\n```"  # passes the first test only
    assert fn(constant, row) == 0.0
    assert verifiers.get("python_tests", partial=True)(constant, row) == pytest.approx(0.5)
    humaneval = {"tests": "def check(f):\n    assert f(2, 2) == 4\n", "entry_point": "add"}
    assert fn(good, humaneval) == 1.0
    assert fn("```python\nimport sys; sys.exit(0)\n```", row) == 0.0
    assert fn("```python\nimport os; os._exit(0)\n```", row) == 0.0
    setup = {"tests": ["assert add(1, 2) == OFFSET + 3"], "test_setup": "OFFSET = 0"}
    assert fn(good, setup) == 1.0
    with pytest.raises(TypeError):
        fn(good, {"tests": 3})


_LIMIT_FILE = os.path.join(os.path.dirname(__file__), "data", "verifier_with_options.py")


def test_get_checks_options():
    with pytest.raises(ValueError, match="no option 'patern'.*pattern"):
        verifiers.get("format", patern="x")
    with pytest.raises(ValueError, match="needs option.*limit"):
        verifiers.get(f"{_LIMIT_FILE}:below", scale=2)
    with pytest.raises(ValueError, match="unknown verifier 'gsm9k'"):
        verifiers.get("gsm9k")
    fn = verifiers.get("format", pattern="^a$")
    assert pickle.loads(pickle.dumps(fn))("a", {}) == 1.0


def test_user_verifier_from_file_and_module(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def brevity(completion, example, scale=1.0):\n    return scale / (1 + len(completion))\n"
    )
    monkeypatch.chdir(tmp_path)
    fn = verifiers.get("my_rewards.py:brevity", scale=2.0)
    assert fn("abc", {}) == 0.5
    by_module = verifiers.get("jaxrl_llm.verifiers.numeric:gsm8k")  # package.module:function
    assert by_module("#### 3", {"answer": "3"}) == 1.0
    with pytest.raises(ValueError, match="not a function"):
        verifiers.get("my_rewards.py:nothing")
    with pytest.raises(ValueError, match=r"verifier 'missing.py:fn': file .* does not exist"):
        verifiers.get("missing.py:fn")


def test_parse_specs_shapes_and_errors(tmp_path):
    specs = verifiers.parse_specs(
        [("gsm8k", 1.0), ("format", 0.1, {"pattern": "x"}), ("format", 0.2), "countdown"]
    )
    assert [(s.label, s.weight) for s in specs] == [
        ("gsm8k", 1.0),
        ("format", 0.1),
        ("format_2", 0.2),
        ("countdown", 1.0),
    ]
    mapping = verifiers.parse_specs({"gsm8k": 1, "fmt": {"name": "format", "weight": 0.5}})
    assert [(s.label, s.name, s.weight) for s in mapping] == [
        ("gsm8k", "gsm8k", 1.0),
        ("fmt", "format", 0.5),
    ]
    ml_collections = pytest.importorskip("ml_collections")
    cfg = ml_collections.ConfigDict({"format": {"weight": 0.1, "options": {"pattern": "^a"}}})
    assert verifiers.parse_specs(cfg)[0].options == {"pattern": "^a"}
    with pytest.raises(ValueError, match=r"rewards\[0\].weight"):
        verifiers.parse_specs([("gsm8k", "heavy")])
    with pytest.raises(ValueError, match=r"rewards.format: verifier 'format' has no option 'x'"):
        verifiers.parse_specs({"format": {"weight": 1.0, "options": {"x": 1}}})
    with pytest.raises(ValueError, match="no verifier"):
        verifiers.parse_specs([])

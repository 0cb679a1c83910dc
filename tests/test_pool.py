"""The verifier pool under verifiers that raise, hang, spin, and kill their own process;
order of results, reuse across steps, weights and metrics."""

import os
import time

import numpy as np
import pytest

from jaxrl_llm import verifiers
from jaxrl_llm.verifiers import VerifierPool

HOSTILE = """
import os, signal, time

def echo(completion, example):
    return float(example["value"])

def misbehave(completion, example):
    if completion == "raise":
        raise ValueError("bad row")
    if completion == "hang":
        time.sleep(60)
    if completion == "spin":
        while True:
            pass
    if completion == "exit":
        os._exit(3)
    if completion == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if completion == "nan":
        return float("nan")
    return 1.0

def pid(completion, example):
    return float(os.getpid())
"""


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "hostile_rewards.py"
    path.write_text(HOSTILE)
    return str(path)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=1.0) as pool:
        yield pool


def test_results_in_input_order_with_weights(pool, rewards_file):
    n = 101
    examples = [{"value": i, "answer": str(i)} for i in range(n)]
    completions = [f"#### {i if i % 3 else i + 1}" for i in range(n)]
    specs = [(f"{rewards_file}:echo", 0.5), ("gsm8k", 2.0)]
    rewards, details = pool.score(specs, completions, examples)
    expected_gsm8k = np.array([float(i % 3 != 0) for i in range(n)])
    np.testing.assert_array_equal(details.per_verifier["echo"], np.arange(n, dtype=float))
    np.testing.assert_array_equal(details.per_verifier["gsm8k"], expected_gsm8k)
    np.testing.assert_allclose(rewards, 0.5 * np.arange(n) + 2.0 * expected_gsm8k)
    metrics = details.metrics()
    assert metrics["reward/gsm8k"] == pytest.approx(expected_gsm8k.mean())
    assert metrics["verifier/errors"] == 0 and metrics["verifier/timeouts"] == 0


def test_verifiers_never_run_in_the_calling_process(pool, rewards_file):
    rewards, _ = pool.score([(f"{rewards_file}:pid", 1.0)], ["a"] * 8, [{}] * 8)
    assert os.getpid() not in set(rewards.astype(int))


def test_raise_hang_spin_and_crash_score_zero_and_are_counted(pool, rewards_file):
    completions = ["ok", "raise", "hang", "ok", "spin", "exit", "segv", "nan", "ok"]
    restarts = pool.restarts
    start = time.monotonic()
    rewards, details = pool.score(
        [(f"{rewards_file}:misbehave", 1.0)], completions, [{}] * len(completions)
    )
    np.testing.assert_array_equal(rewards, [1, 0, 0, 1, 0, 0, 0, 0, 1])
    assert details.timeouts == {"misbehave": 2}  # hang (killed), spin (CPU timer or killed)
    assert details.errors == {"misbehave": 4}  # raise, exit, segv, nan
    assert pool.restarts - restarts >= 3  # hang, exit, segv each cost a worker
    assert time.monotonic() - start < 8
    text = " | ".join(details.messages)
    assert "ValueError: bad row" in text and "SIGSEGV" in text and "exit code 3" in text


def test_pool_is_reusable_after_failures(pool, rewards_file):
    for step in range(3):
        examples = [{"answer": str(step)}] * 16
        rewards, details = pool.score([("gsm8k", 1.0)], [f"#### {step}"] * 16, examples)
        assert rewards.tolist() == [1.0] * 16
        assert details.metrics()["verifier/errors"] == 0


def test_dead_idle_worker_is_replaced(pool):
    pool.score([("gsm8k", 1.0)], ["#### 1"], [{"answer": "1"}])
    for w in pool._workers:  # killed between steps, e.g. by the OOM killer
        if w is not None:
            os.kill(w.proc.pid, 9)
            w.proc.wait()
    rewards, details = pool.score([("gsm8k", 1.0)], ["#### 1"] * 4, [{"answer": "1"}] * 4)
    assert rewards.tolist() == [1.0] * 4 and details.metrics()["verifier/errors"] == 0


def test_num_tokens_reach_verifiers(pool):
    """The sampler's token counts reach every verifier as example["num_tokens"]."""
    here = os.path.join(os.path.dirname(__file__), "data", "verifier_with_options.py")
    specs = [(f"{here}:tokens_over", 1.0, {"limit": 5})]
    rewards, _ = pool.score(specs, ["a", "b", "c"], [{}, {}, {}], num_tokens=[3, 8, 12])
    np.testing.assert_allclose(rewards, [0.0, 3.0, 7.0])
    _, details = pool.score(specs, ["a"], [{}])  # no count given: the verifier's error
    assert details.errors == {"tokens_over": 1} and "num_tokens" in details.messages[0]


def test_python_tests_through_the_pool(pool):
    row = {"tests": ["assert double(4) == 8"]}
    good = "```python\ndef double(x):\n    return 2 * x\n```"
    bad = "```python\ndef double(x):\n    return x\n```"
    specs = [("python_tests", 1.0, {"wall_s": 0.8, "cpu_s": 1})]
    rewards, details = pool.score(specs, [good, bad, good], [row] * 3)
    assert rewards.tolist() == [1.0, 0.0, 1.0]


def test_input_errors_are_clear(pool):
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        pool.score([("gsm8k", 1.0)], ["a", "b"], [{}])
    with pytest.raises(TypeError, match=r"completions\[1\] is bytes"):
        pool.score([("gsm8k", 1.0)], ["a", b"b"], [{}, {}])
    with pytest.raises(ValueError, match="unknown verifier"):
        pool.score([("nope", 1.0)], ["a"], [{}])
    with pytest.raises(ValueError, match=r"rewards.python_tests.options.wall_s=4.0 must be below"):
        pool.score([("python_tests", 1.0)], ["a"], [{"tests": ["assert 1"]}])
    rewards, details = pool.score([("gsm8k", 1.0)], [], [])
    assert rewards.shape == (0,) and details.per_verifier["gsm8k"].shape == (0,)


def test_one_shot_score_and_close(rewards_file):
    rewards, details = verifiers.score(
        [("gsm8k", 1.0, {}), ("format", 0.1, {"pattern": r"^#### \d+$"})],
        ["#### 4", "#### 5", "it is 4"],
        [{"answer": "4"}] * 3,
        workers=1,
        timeout_s=5.0,
    )
    np.testing.assert_allclose(rewards, [1.1, 0.1, 1.0])
    pool = VerifierPool(workers=1, timeout_s=1.0)
    pool.score([("gsm8k", 1.0)], ["1"], [{"answer": "1"}])
    procs = [w.proc for w in pool._workers if w is not None]
    pool.close()
    pool.close()
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([("gsm8k", 1.0)], ["1"], [{"answer": "1"}])


def test_prepare_loads_the_verifiers_before_the_first_score(tmp_path):
    """`prepare` starts the workers loading the specs at once (each worker's import leaves
    a marker file, seen before any score); the first score with those specs uses them,
    and a score with other specs still loads those."""
    module = tmp_path / "marked.py"
    module.write_text(
        "import os\n"
        f"open(os.path.join({str(tmp_path)!r}, f'loaded.{{os.getpid()}}'), 'w').close()\n"
        "def pid(completion, example):\n"
        "    return float(os.getpid())\n"
    )
    specs = [(f"{module}:pid", 1.0)]
    with VerifierPool(workers=2, timeout_s=5.0) as pool:
        pool.prepare(specs)
        deadline = time.monotonic() + 60
        workers = lambda: {int(p.suffix[1:]) for p in tmp_path.glob("loaded.*")} - {os.getpid()}  # noqa: E731
        while len(workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        loaded = workers()
        assert len(loaded) == 2  # both workers imported the module without a score
        rewards, details = pool.score(specs, ["a"] * 8, [{}] * 8)
        assert set(rewards.astype(int)) <= loaded and details.errors == {"pid": 0}
        rewards, _ = pool.score([("gsm8k", 1.0)], ["#### 3", "#### 4"], [{"answer": "3"}] * 2)
        np.testing.assert_array_equal(rewards, [1.0, 0.0])
        assert workers() == loaded  # no worker restarted

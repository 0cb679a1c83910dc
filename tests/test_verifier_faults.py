"""User rewards that fork, exit, hang, return strings, allocate gigabytes or leave
processes behind; verifiers that always fail; sandbox timeouts. Each is contained in its
sample, counted, bounded in time, and reported in one line."""

import os
import time

import numpy as np
import pytest

from jaxrl_llm import verifiers
from jaxrl_llm.errors import format_error
from jaxrl_llm.verifiers import ErrorBudget, VerifierFailure, VerifierPool, reaper

REWARDS = """
import fractions, os, subprocess, sys, time
import numpy as np

def fork(completion, example):
    child = os.fork()  # both copies return: only the worker's answer may count
    if child == 0 and completion == "slow":
        time.sleep(300)
    return 1.0 if child else 0.5

def always_exit(completion, example):
    os._exit(7)

def always_hang(completion, example):
    time.sleep(300)

def returns(completion, example):
    values = {"str": "0.75", "none": None, "list": [1.0], "bool": True,
              "np": np.float32(0.25), "fraction": fractions.Fraction(1, 4), "int": 2,
              "huge": 10**400}
    return values[completion]

def allocate(completion, example):
    if completion == "3gb":
        blob = b"x" * (3 << 30)
        return float(len(blob))
    return 1.0

def leave_behind(completion, example):
    if completion == "setsid":
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        pid = proc.pid
    else:  # a daemon: fork, setsid, fork again, the middle one exits
        read, write = os.pipe()
        if os.fork() == 0:
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(300)
                os._exit(0)
            os.write(write, str(grandchild).encode())
            os._exit(0)
        pid = int(os.read(read, 32))
    with open(example["pid_file"], "a") as f:
        f.write(f"{pid}\\n")
    if completion == "hang":
        time.sleep(300)
    return 1.0
"""


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "hostile.py"
    path.write_text(REWARDS)
    return str(path)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=1.0, memory_mb=512) as pool:
        yield pool


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_reward_that_forks_counts_once_and_its_copy_is_gone(pool, rewards):
    before = set(reaper.descendants(os.getpid()))
    completions = ["fast"] * 6 + ["slow"] * 2
    values, details = pool.score([(f"{rewards}:fork", 1.0)], completions, [{}] * 8)
    assert values.tolist() == [1.0] * 8  # the worker's own answer, never the copy's 0.5
    assert details.errors == {"fork": 0}
    workers = {w.proc.pid for w in pool._workers if w is not None}
    left = set(reaper.descendants(os.getpid())) - before - workers
    assert not [p for p in left if alive(p)]  # the sleeping copies were killed


def test_worker_killing_reward_trips_the_breaker(pool, rewards):
    restarts = pool.restarts
    values, details = pool.score([(f"{rewards}:always_exit", 1.0)], ["a"] * 64, [{}] * 64)
    assert values.tolist() == [0.0] * 64 and details.errors == {"always_exit": 64}
    assert pool.restarts - restarts <= pool.breaker_after + 1  # not 64 restarts
    assert "5 calls in a row timed out or killed their worker" in details.tripped["always_exit"]
    assert "exit code 7" in details.tripped["always_exit"]
    values, _ = pool.score([("gsm8k", 1.0)], ["#### 3"] * 4, [{"answer": "3"}] * 4)
    assert values.tolist() == [1.0] * 4  # the pool is fine afterwards


def test_hanging_reward_trips_the_breaker_instead_of_timing_out_every_sample(pool, rewards):
    start = time.monotonic()
    values, details = pool.score([(f"{rewards}:always_hang", 1.0)], ["a"] * 64, [{}] * 64)
    elapsed = time.monotonic() - start
    assert values.tolist() == [0.0] * 64
    assert details.timeouts["always_hang"] >= pool.breaker_after
    assert details.failed == {"always_hang": 64}
    assert "no result within 1 s" in details.tripped["always_hang"]
    assert elapsed < 20, elapsed  # 64 timeouts on 2 workers: 32 s, plus 64 restarts


def test_non_numbers_are_errors_naming_the_verifier(pool, rewards):
    names = ["str", "none", "list", "bool", "np", "fraction", "int", "huge"]
    values, details = pool.score([(f"{rewards}:returns", 1.0)], names, [{}] * len(names))
    assert values.tolist() == [0.0, 0.0, 0.0, 1.0, 0.25, 0.25, 2.0, 0.0]
    assert details.errors == {"returns": 4}
    assert sorted(details.messages) == [  # messages come in arrival order
        "returns sample 0: returned str '0.75', expected a number",
        "returns sample 1: returned NoneType None, expected a number",
        "returns sample 2: returned list [1.0], expected a number",
        "returns sample 7: returned a int that is not usable (int too large to convert to float)",
    ]


def test_allocation_beyond_the_memory_limit_is_that_sample_error(pool, rewards):
    restarts = pool.restarts
    values, details = pool.score([(f"{rewards}:allocate", 1.0)], ["3gb", "ok", "ok"], [{}] * 3)
    assert values.tolist() == [0.0, 1.0, 1.0]
    assert details.messages == [
        "allocate sample 0: MemoryError: out of memory (the 512 MB verifier memory limit)"
    ]
    assert pool.restarts == restarts + 1  # replaced: what it leaked goes with it (issue 40)


@pytest.mark.parametrize("how", ["setsid", "daemon"])
def test_processes_a_reward_leaves_behind_do_not_outlive_the_call(pool, rewards, tmp_path, how):
    pid_file = tmp_path / "pids"
    values, _ = pool.score(
        [(f"{rewards}:leave_behind", 1.0)], [how] * 4, [{"pid_file": str(pid_file)}] * 4
    )
    assert values.tolist() == [1.0] * 4
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 4 and not [p for p in pids if alive(p)]


def test_a_timed_out_call_takes_its_setsid_processes_with_it(pool, rewards, tmp_path):
    pid_file = tmp_path / "pids"
    values, details = pool.score(
        [(f"{rewards}:leave_behind", 1.0)], ["hang"], [{"pid_file": str(pid_file)}]
    )
    assert details.timeouts == {"leave_behind": 1}
    time.sleep(0.2)
    assert not alive(int(pid_file.read_text()))


_HELPER = """
import subprocess
SERVER = subprocess.Popen(["sleep", "300"])  # a long-lived helper, started at import

def uses_helper(completion, example):
    return float(SERVER.poll() is None)
"""


def test_helper_started_at_import_lives_as_long_as_its_worker(tmp_path):
    path = tmp_path / "helper.py"
    path.write_text(_HELPER)
    with VerifierPool(workers=1, timeout_s=5.0) as pool:
        for _ in range(2):
            values, _ = pool.score([(f"{path}:uses_helper", 1.0)], ["a"] * 3, [{}] * 3)
            assert values.tolist() == [1.0] * 3
        (worker,) = [w.proc.pid for w in pool._workers if w is not None]
        helpers = reaper.children(worker)
        assert len(helpers) == 1 and alive(helpers[0])
    assert not alive(helpers[0])  # gone with the pool


def test_always_failing_reward_warns_then_stops_the_run(pool):
    budget = ErrorBudget(max_error_rate=0.5, max_failed_steps=3)
    rows = [{"question": "1 + 1"}] * 8  # the rows lack `answer`
    lines = []
    with pytest.raises(VerifierFailure) as stop:
        for step in range(1, 10):
            _, details = pool.score([("gsm8k", 1.0)], ["#### 2"] * 8, rows)
            lines.append(budget.check(details, step))
    assert len(lines) == 2 and details.failed == {"gsm8k": 8}
    assert lines[0].startswith("warning: step 1: rewards.gsm8k: 100% of 8 calls failed; ")
    assert "first error: gsm8k sample " in lines[0] and "'answer'" in lines[0]
    assert lines[0].endswith("; the run stops after 2 more such steps")
    line = format_error(stop.value)
    assert line.startswith("error: rewards.gsm8k: 100% of 8 calls failed; first error: gsm8k")
    assert "(3 steps in a row); fix the verifier or the rows it reads" in line
    assert "\n" not in line


def test_error_budget_counts_only_failed_steps_in_a_row():
    def details(failed, n=10):
        first = "v sample 0: KeyError: 'answer'" if failed else None
        return verifiers.ScoreDetails({}, {}, {"v": failed}, {"v": 0}, [], {"v": failed}, n, first)

    budget = ErrorBudget(max_error_rate=0.5, max_failed_steps=2)
    assert budget.check(details(5)) is None  # exactly the limit is tolerated
    assert budget.check(details(6)).startswith("warning: rewards.v: 60% of 10 calls failed")
    assert budget.check(details(0)) is None  # a good step resets the count
    assert budget.check(details(9)) is not None
    with pytest.raises(VerifierFailure):
        budget.check(details(9))
    other_host = ErrorBudget()  # judged on rates averaged over hosts
    line = other_host.check(details(0), step=4, rates={"v": 0.75})
    assert line == (
        "warning: step 4: rewards.v: 75% of calls on all hosts failed; first error: (on "
        "another host); the run stops after 2 more such steps"
    )
    never = ErrorBudget(max_error_rate=0.0, max_failed_steps=0)
    for _ in range(5):
        assert never.check(details(1)) is not None
    with pytest.raises(ValueError, match="max_error_rate=1.5"):
        ErrorBudget(max_error_rate=1.5)


def test_sandbox_timeouts_are_counted_but_are_not_verifier_failures():
    slow = "```python\nimport time\ntime.sleep(30)\n```"
    fast = "```python\ndef f():\n    return 1\n```"
    row = {"tests": ["assert f() == 1"]}
    specs = [("python_tests", 1.0, {"wall_s": 0.5, "cpu_s": 1})]
    with VerifierPool(workers=1, timeout_s=4.0) as pool:
        values, details = pool.score(specs, [slow, fast], [row, row])
    assert values.tolist() == [0.0, 1.0]
    assert details.timeouts == {"python_tests": 1} and details.failed == {"python_tests": 0}
    assert details.metrics()["verifier/timeouts"] == 1.0
    assert details.metrics()["verifier/error_rate"] == 0.0
    assert "wall_s=0.5" in details.messages[0]
    with pytest.raises(verifiers.VerifierTimeout):
        verifiers.get("python_tests", wall_s=0.5, cpu_s=1)(slow, row)
    assert np.isfinite(values).all()


def test_items_requeued_after_a_trip_are_not_called():
    """A worker that dies after its verifier tripped puts its other items back in the
    queue; they are finished as not called, never run (each would cost a worker)."""
    from jaxrl_llm.verifiers import parse_specs
    from jaxrl_llm.verifiers import worker as wire
    from jaxrl_llm.verifiers.work import WorkBatch

    specs = parse_specs([("gsm8k", 1.0), ("format", 1.0, {"pattern": "x"})])
    batch = WorkBatch(specs, ["a"] * 4, [{"answer": "1"}] * 4, breaker_after=2)
    taken, _ = batch.chunk(8)  # every item is out with the workers
    for item in (0, 2):  # two calls of verifier 0 killed their workers: it trips
        batch.record(item, 0.0, wire.ERROR, "worker died", costly=True)
    assert 0 in batch.tripped
    batch.queue.extend(i for i in taken if i not in (0, 2))  # the dead worker's other items
    items, (_, runs, _) = batch.chunk(8)
    assert items == [1, 3, 5, 7] and all(k == 1 for _, _, k in runs)
    assert batch.remaining == 4  # items 4 and 6 (verifier 0) finished as not called
    assert batch.status[2, 0] == batch.status[3, 0] != -1

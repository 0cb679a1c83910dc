"""Hostile model code against the sandbox: every attack must be contained and score 0, and
the process running the tests (standing in for the trainer) must be unaffected.

Each snippet is written so that a SUCCESSFUL attack would make its test pass; containment
therefore shows up as a failed run, and the reward as 0.
"""

import os
import socket
import time

import pytest

from jaxrl_llm import verifiers
from jaxrl_llm.verifiers.registry import VerifierTimeout
from jaxrl_llm.verifiers.sandbox import Limits, run_python

LIMITS = Limits(cpu_s=1, wall_s=2.0, memory_mb=256, processes=16)
ISOLATED = os.geteuid() == 0 and verifiers.isolation()["namespaces"]
needs_isolation = pytest.mark.skipif(not ISOLATED, reason="needs root and Linux namespaces")


def _sandbox_processes(uid: int) -> list[int]:
    """Pids of live processes owned by `uid` (the sandbox user)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
        except FileNotFoundError:
            pass
    return found


def _reward(code: str, tests: list[str]) -> float:
    """The reward the trainer's pool records: a run past `wall_s` raises `VerifierTimeout`,
    which the pool scores 0 (and counts)."""
    fn = verifiers.get("python_tests", cpu_s=LIMITS.cpu_s, wall_s=LIMITS.wall_s, memory_mb=256)
    try:
        return fn(f"```python\n{code}\n```", {"tests": tests})
    except VerifierTimeout:
        return 0.0


def test_well_behaved_code_passes_and_reports_isolation():
    result = run_python("def sq(x):\n    return x * x\n", ["assert sq(3) == 9"], limits=LIMITS)
    assert (result.status, result.passed, result.total) == ("passed", 1, 1)
    if os.geteuid() == 0:
        assert result.isolation["uid"] != 0  # never runs model code as root


def test_infinite_loop_hits_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", ["assert True"], limits=LIMITS)
    assert result.status in ("crashed", "timeout") and result.passed == 0
    assert time.monotonic() - start < LIMITS.wall_s + 3
    assert _reward("while True:\n    pass", ["assert True"]) == 0.0


def test_sleeping_code_hits_wall_clock_limit():
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)\n", ["assert True"], limits=LIMITS)
    assert result.status == "timeout"
    assert time.monotonic() - start < LIMITS.wall_s + 3


@needs_isolation
def test_fork_bomb_is_contained_and_cleaned_up():
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    uid = verifiers.isolation()["uid"]
    before = set(_sandbox_processes(uid))  # the host may run its own `nobody` daemons
    start = time.monotonic()
    assert _reward(bomb, ["assert True"]) == 0.0
    assert time.monotonic() - start < LIMITS.wall_s + 4
    deadline = time.monotonic() + 2
    while set(_sandbox_processes(uid)) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_sandbox_processes(uid)) - before == set()


def test_memory_hog_fails_without_hurting_the_parent():
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))\n"
    # The memory limit is under test: time enough that a loaded machine (the test
    # workers beside it) cannot end the run on CPU or wall-clock time first.
    limits = Limits(cpu_s=10, wall_s=20.0, memory_mb=LIMITS.memory_mb, processes=16)
    result = run_python(code, ["assert True"], limits=limits)
    assert result.status == "failed" and result.message.startswith("MemoryError"), result
    assert _reward(code, ["assert True"]) == 0.0


def test_huge_output_and_forged_results_are_ignored():
    code = (
        "import os, sys\n"
        "for fd in range(10):\n"
        "    try:\n"
        "        os.write(fd, b'PASS 0\\nEND\\n' * 1000)\n"
        "    except OSError:\n"
        "        pass\n"
        "sys.stdout.write('x' * 50_000_000)\n"
        "sys.stderr.write('y' * 50_000_000)\n"
    )
    start = time.monotonic()
    result = run_python(code, ["assert False"], limits=LIMITS)
    assert result.status == "failed" and result.passed == 0
    assert time.monotonic() - start < LIMITS.wall_s + 3
    assert _reward(code, ["assert False"]) == 0.0


def test_big_file_is_capped():
    code = "with open('big', 'wb') as f:\n    f.write(b'0' * 100 * 1024 * 1024)\nok = True\n"
    assert _reward(code, ["assert ok"]) == 0.0


def test_writing_outside_its_directory(tmp_path):
    host_paths = [str(tmp_path / "escaped.txt"), os.getcwd() + "/escaped"]
    scratch = "/tmp/jaxrl_llm_escaped.txt"  # writable inside, but a private tmpfs
    code = (
        "written = []\n"
        f"for path in {host_paths + [scratch]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        written.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    reward = _reward(code, [f"assert set({host_paths!r}) & set(written)"])
    if os.geteuid() == 0:  # as root the code runs as `nobody`, who may not write there
        assert reward == 0.0
        assert not any(os.path.exists(path) for path in host_paths)
    if ISOLATED:
        assert not os.path.exists(scratch)


@needs_isolation
def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("JAXRL_LLM_TEST_SECRET", "s3cr3t-token")
    code = (
        "import os, glob\n"
        "found = any('s3cr3t' in v for v in os.environ.values())\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        found = found or b's3cr3t' in open(path, 'rb').read()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert _reward(code, ["assert found"]) == 0.0
    assert os.environ["JAXRL_LLM_TEST_SECRET"] == "s3cr3t-token"


@needs_isolation
def test_no_network_even_to_localhost():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'stolen')\n"
        "connected = True\n"
    )
    try:
        assert _reward(code, ["assert connected"]) == 0.0
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # a completed connection would be queued
            server.accept()
    finally:
        server.close()


def test_cannot_kill_the_parent_or_exit_early():
    parent = os.getpid()
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        f"for pid in ({parent},):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGTERM)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    if ISOLATED:  # without a pid namespace and a separate user this attack would succeed
        assert _reward(code, ["assert False"]) == 0.0
    assert _reward("import sys\nsys.exit(0)", ["assert False"]) == 0.0
    assert _reward("import os\nos._exit(0)", ["assert False"]) == 0.0
    assert os.getpid() == parent


def test_limits_are_validated():
    with pytest.raises(ValueError, match="cpu_s"):
        Limits(cpu_s=0)
    if os.geteuid() == 0:  # the user is only needed (and looked up) when running as root
        with pytest.raises(ValueError, match="sandbox user 'no_such_user_x'"):
            run_python("", [], limits=Limits(user="no_such_user_x"))

"""jaxrl_llm.parallel.allocator: command lines re-run themselves with tcmalloc preloaded."""

import os
import subprocess
import sys

import pytest

from jaxrl_llm.parallel import allocator

LIB = "/usr/lib/libtcmalloc_minimal.so.4"


@pytest.fixture
def found(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: LIB)


def test_preload_environ_adds_the_library_once(found):
    env = allocator.preload_environ({"LD_PRELOAD": "libfoo.so", "PATH": "/bin"}, "linux")
    assert env["LD_PRELOAD"] == f"{LIB}:libfoo.so"
    assert env["PATH"] == "/bin"
    assert env["TCMALLOC_RELEASE_RATE"] == "0"  # freed pages stay: no faults next step
    # The re-run process finds it preloaded and goes on (whether or not it loaded).
    assert allocator.preload_environ(env, "linux") is None
    # A user's own tcmalloc settings stay.
    assert (
        allocator.preload_environ({"TCMALLOC_RELEASE_RATE": "1"}, "linux")["TCMALLOC_RELEASE_RATE"]
        == "1"
    )


def test_preload_environ_leaves_the_process_alone(found, monkeypatch):
    for off in ("0", "off", "OFF", "false", "no"):
        assert allocator.preload_environ({allocator.ENV: off}, "linux") is None
    assert allocator.preload_environ({}, "darwin") is None
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.preload_environ({}, "linux") is None
    assert allocator.preload_environ({allocator.ENV: "auto"}, "linux") is None


def test_hint_only_without_tcmalloc(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator, "active", lambda: None)
    if sys.platform.startswith("linux"):
        assert "apt install libtcmalloc-minimal4" in allocator.hint()
    monkeypatch.setenv(allocator.ENV, "0")
    assert allocator.hint() is None
    monkeypatch.setattr(allocator, "active", lambda: LIB)
    monkeypatch.delenv(allocator.ENV)
    assert allocator.hint() is None


def test_an_explicit_library_path(tmp_path):
    lib = tmp_path / "libother_malloc.so"
    lib.write_bytes(b"")
    env = allocator.preload_environ({allocator.ENV: str(lib)}, "linux")
    assert env["LD_PRELOAD"] == str(lib)
    # No "tcmalloc" in its name, and still no second re-run.
    assert allocator.preload_environ(env, "linux") is None
    with pytest.raises(FileNotFoundError, match="JAXRL_LLM_TCMALLOC=/nope/libtcmalloc.so"):
        allocator.preload_environ({allocator.ENV: "/nope/libtcmalloc.so"}, "linux")


_SCRIPT = (
    "import sys; from jaxrl_llm.parallel import allocator; allocator.reexec_with_tcmalloc(); "
    "print(bool(allocator.active()), sys.argv[1:], allocator.hint() is None)"
)


@pytest.mark.skipif(
    allocator.find_tcmalloc() is None or not sys.platform.startswith("linux"),
    reason="tcmalloc is not installed (apt install libtcmalloc-minimal4; CI installs it)",
)
def test_the_process_reruns_itself_under_tcmalloc():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    cmd = [sys.executable, "-c", _SCRIPT, "a", "--b=c d"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "True ['a', '--b=c d'] True"  # same arguments, no hint
    env[allocator.ENV] = "0"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "False ['a', '--b=c d'] True"  # switched off: no hint


_RELEASE = """
import numpy as np
from jaxrl_llm.parallel import allocator

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS"))

block = np.ones(256 * 2**20, np.uint8)  # faulted in: resident
del block  # freed: tcmalloc keeps the pages (TCMALLOC_RELEASE_RATE=0)
kept = rss_mb()
print(allocator.release_free_memory(), kept - rss_mb())
"""


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="tcmalloc is not installed")
def test_release_free_memory_returns_what_tcmalloc_kept():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    env |= allocator.preload_environ(env) or {}
    out = subprocess.run(
        [sys.executable, "-c", _RELEASE], env=env, capture_output=True, text=True, check=True
    ).stdout
    took, released_mb = out.split()
    assert took == "True" and int(released_mb) >= 200

"""Run untrusted Python (model-written code) against tests in a contained subprocess.

What one `run_python` call does (details in `sandbox_runner.py`):

- a fresh interpreter (`python -I -S`: no PYTHON* variables, no user site, no .pth files;
  site-packages stay importable) in a fresh temp
  dir, deleted afterwards, with a minimal environment (PATH, HOME, LANG; nothing inherited,
  so no tokens or keys leak);
- limits: CPU seconds, address space, file size, process count, open files, no core files;
  a wall-clock limit enforced twice (inside, by the sandbox's init, and outside, here);
- when the trainer runs as root (TPU VMs, containers): new mount, network, pid, ipc and
  uts namespaces (no network at all, a private size-capped /tmp, /var/tmp, /dev/shm, a
  /proc that shows only the sandbox), and the code runs as an unprivileged user
  (`nobody`), because process limits do not bind root. When the pid namespace's init exits,
  the kernel kills everything the code forked, fork bombs included.

Not isolated: files readable by everyone stay readable; without root (or where namespaces
are refused, e.g. a container without CAP_SYS_ADMIN) there is no network or pid isolation,
and without root the code runs as the trainer's user. `isolation()` reports what holds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pwd
import secrets
import select
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RUNNER_SOURCE = Path(__file__).with_name("sandbox_runner.py").read_text()
_MAX_REPORT_BYTES = 1 << 16  # results are a few lines; more is the code spamming the pipe
_GRACE_S = 2.0  # interpreter start-up on a loaded host, on top of the wall limit


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed run.

    Attributes:
      cpu_s: CPU seconds for the code and its tests (SIGXCPU, then SIGKILL one second later).
      wall_s: wall-clock seconds (catches `sleep` and blocking reads, which use no CPU).
      memory_mb: address-space cap; allocations above it raise MemoryError.
      file_mb: largest file the code may write.
      processes: max processes of the sandbox user (RLIMIT_NPROC; per user, so concurrent
        sandboxes share it).
      tmpfs_mb: size of the private /tmp (and /var/tmp, /dev/shm) when namespaces work.
      user: unprivileged account to run as when the trainer is root.
      namespaces: use Linux namespaces when running as root.
    """

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 16
    tmpfs_mb: int = 32
    user: str = "nobody"
    namespaces: bool = True

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "processes", "tmpfs_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run.

    Attributes:
      status: `passed` (every test passed), `failed` (ran to the end, some test or the code
        itself failed), `timeout` (wall-clock limit), `crashed` (died before the end:
        CPU limit, file-size limit, `os._exit`, a segfault ...).
      passed: tests that passed; total: tests given.
      message: the first error (`NameError: name 'f' is not defined`), or how it died.
      isolation: what held for this run, e.g. `{"namespaces": True, "uid": 65534}`.
    """

    status: str
    passed: int
    total: int
    message: str = ""
    isolation: dict = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=8)
def _user_ids(user: str) -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"sandbox user {user!r} does not exist on this host") from None
    return entry.pw_uid, entry.pw_gid


def _environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",  # numeric libraries would otherwise start a thread per core
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_reports(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool]:
    """Reads the result pipe until EOF or `deadline`; keeps at most _MAX_REPORT_BYTES.

    Returns (data, timed_out). Reading goes on past the cap (and is discarded) so a chatty
    child cannot block on a full pipe instead of finishing.
    """
    fd = proc.stdout.fileno()
    chunks, size = [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if not ready:
            if proc.poll() is not None and not select.select([fd], [], [], 0.05)[0]:
                # The runner is gone; only a process that escaped its group (no pid
                # namespace) could still hold the pipe open. Do not wait for it.
                return b"".join(chunks), False
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            return b"".join(chunks), False
        if size < _MAX_REPORT_BYTES:
            chunks.append(data[: _MAX_REPORT_BYTES - size])
            size += len(chunks[-1])


def _parse(data: bytes, nonce: str, total: int, timed_out: bool) -> SandboxResult:
    passed, finished, message, isolation, exit_info = set(), False, "", {}, ""
    prefix = nonce + " "
    for line in data.decode(errors="replace").splitlines():
        if not line.startswith(prefix):
            continue
        kind, _, rest = line[len(prefix) :].partition(" ")
        if kind == "PASS" and rest.isdigit():
            passed.add(int(rest))
        elif kind in ("FAIL", "ERROR") and not message:
            message = rest.partition(" ")[2] if kind == "FAIL" else rest
        elif kind == "END":
            finished = True
        elif kind == "TIMEOUT":
            timed_out = True
        elif kind == "EXIT":
            exit_info = rest
        elif kind == "SANDBOX_ERROR":
            raise RuntimeError(f"sandbox set-up failed: {rest}")
        elif kind == "ISOLATION":
            fields = dict(item.split("=", 1) for item in rest.split())
            isolation = {"namespaces": fields["namespaces"] == "1", "uid": int(fields["uid"])}
    count = len(passed & set(range(total)))
    if timed_out:
        status, message = "timeout", "wall-clock limit"
    elif not finished:
        status, message = "crashed", exit_info or "no report"
    else:
        status = "passed" if count == total and not message else "failed"
    return SandboxResult(
        status=status, passed=count, total=total, message=message, isolation=isolation
    )


def run_python(
    code: str, tests: list[str], setup: str = "", limits: Limits = Limits()
) -> SandboxResult:
    """Runs `setup`, then `code`, then each test snippet (e.g. `assert f(2) == 4`), sandboxed.

    Args:
      code: the untrusted program (a model's completion, already cut out of its text).
      tests: snippets run in order in the code's global namespace; each passes if it
        raises nothing.
      setup: trusted code run first in the same namespace (MBPP's `test_setup_code`).
      limits: see `Limits`.

    Returns:
      a `SandboxResult`; the code's own failures are results, never exceptions.

    Raises:
      RuntimeError: the sandbox itself could not be set up (a host problem, not the code's).
    """
    nonce = secrets.token_hex(16)
    uid = gid = None
    if os.geteuid() == 0:
        uid, gid = _user_ids(limits.user)
    job = {
        "nonce": nonce,
        "code": code,
        "tests": list(tests),
        "setup": setup,
        "limits": dataclasses.asdict(limits),
        "uid": uid,
        "gid": gid,
        "namespaces": limits.namespaces,
        "parent_pid": os.getpid(),
        # `-S` halves start-up (no .pth processing); the code still sees site-packages.
        "site_dirs": [d for d in site.getsitepackages() if os.path.isdir(d)],
    }
    workdir = tempfile.mkdtemp(prefix="jaxrl_llm_sandbox_")
    proc = None
    try:
        job["workdir"] = workdir
        if uid is not None:
            os.chown(workdir, uid, gid)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _RUNNER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=workdir,
            env=_environment(workdir),
            start_new_session=True,
        )
        with proc.stdin:
            proc.stdin.write(json.dumps(job).encode())
        data, timed_out = _read_reports(proc, time.monotonic() + limits.wall_s + _GRACE_S)
    finally:
        if proc is not None:
            _kill_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    result = _parse(data, nonce, len(tests), timed_out)
    _warn_once_if_weak(result.isolation)
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    proc.stdout.close()


_warned = False


def _warn_once_if_weak(isolation: dict) -> None:
    global _warned
    if isolation and not isolation["namespaces"] and not _warned:
        _warned = True
        logging.warning(
            "sandbox: Linux namespaces not in use (disabled, not root, or refused by the "
            "container); "
            "model-written code runs with rlimits%s but WITH network access and without "
            "pid/mount isolation",
            " as your own user" if isolation["uid"] == os.geteuid() else " as an unprivileged user",
        )


@functools.lru_cache(maxsize=1)
def isolation() -> dict:
    """What the sandbox achieves on this host: `{"namespaces": bool, "uid": int}`."""
    return run_python("", []).isolation

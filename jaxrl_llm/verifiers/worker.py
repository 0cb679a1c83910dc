"""The pool's worker process: its main loop, and the parent's handle on it (`WorkerProcess`).

A worker receives verifier specs and batches of samples over pipes and returns one result
per (sample, verifier) as soon as it has it.

Wire format: 8-byte little-endian length, then a pickle. Messages in:

    ("specs", key, [(name, options), ...])   resolve and bind; answer ("ready", key) or
                                             ("spec_error", key, message)
    ("run", [(item, sample, k), ...], {sample: (completion, example)})
                                             answer ("result", item, value, status, message)
                                             per item, in order
    ("exit",)

status: 0 ok, 1 error (exception or non-finite value), 2 timeout. The parent owns the hard
wall-clock timeout (it kills this process); here a CPU-time timer raises inside a runaway
Python verifier a little earlier, so the common case costs no process restart.
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import os
import pickle
import signal
import struct
import subprocess
import sys
import time

OK, ERROR, TIMEOUT = 0, 1, 2
_HEADER = struct.Struct("<Q")


def send(fd: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    parts = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def receive(fd: int):
    """One message from `fd`; raises EOFError when the other side is gone."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


class SoftTimeout(BaseException):
    """Raised by the CPU timer; a BaseException so a verifier's `except Exception` cannot
    swallow it."""


def _on_timer(signum, frame):
    raise SoftTimeout()


def _call(fn, completion: str, example: dict, soft_timeout_s: float):
    """(value, status, message) of one verifier call."""
    try:
        signal.setitimer(signal.ITIMER_VIRTUAL, soft_timeout_s)
        try:
            value = float(fn(completion, example))
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    except SoftTimeout:  # also when the timer fires between the call and the disarm
        return 0.0, TIMEOUT, f"exceeded {soft_timeout_s:.3g} s of CPU"
    except Exception as err:
        return 0.0, ERROR, f"{type(err).__name__}: {err}"[:500]
    if not math.isfinite(value):
        return 0.0, ERROR, f"returned {value}"
    return value, OK, ""


def _bind(specs):
    from jaxrl_llm.verifiers.registry import get

    return [get(name, **options) for name, options in specs]


def serve(in_fd: int, out_fd: int, soft_timeout_s: float) -> None:
    fns, key = None, None
    signal.signal(signal.SIGVTALRM, _on_timer)
    while True:
        try:
            message = receive(in_fd)
        except EOFError:
            return
        if message[0] == "exit":
            return
        if message[0] == "specs":
            try:
                fns, key = _bind(message[2]), message[1]
                send(out_fd, ("ready", key))
            except Exception as err:
                send(out_fd, ("spec_error", message[1], f"{type(err).__name__}: {err}"))
            continue
        _, items, samples = message
        for item, sample, k in items:
            completion, example = samples[sample]
            send(out_fd, ("result", item, *_call(fns[k], completion, example, soft_timeout_s)))


def main() -> None:
    """Entry point (see pool.py): protocol on the original stdin/stdout, which are then
    pointed away so a verifier's print() or input() cannot corrupt the stream."""
    try:  # die with the trainer even if it is SIGKILLed (Linux)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    in_fd, out_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when workers stop
    serve(in_fd, out_fd, float(sys.argv[2]))


_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from jaxrl_llm.verifiers.worker import main; main()"
)


class WorkerProcess:
    """The parent's handle on one worker subprocess, and what it knows about it."""

    def __init__(self, soft_timeout_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), repr(soft_timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # killpg reaches anything the verifier started
        )
        self.key = None  # which spec list is loaded
        self.loading_since = None
        self.busy: collections.deque = collections.deque()  # item ids, in run order
        self.since = 0.0  # when the item at busy[0] started
        self.done = 0

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()

    @property
    def idle(self) -> bool:
        return not self.busy and self.loading_since is None

    def send(self, message) -> bool:
        try:
            send(self.proc.stdin.fileno(), message)
            return True
        except (BrokenPipeError, OSError):
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def exit_info_within(self, timeout_s: float) -> str:
        code = self.proc.wait(timeout_s)
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def shutdown(workers: list) -> None:
    for w in workers:
        if w is not None and w.proc.poll() is None:
            w.send(("exit",))
    deadline = time.monotonic() + 1.0
    for w in workers:
        if w is not None:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
    workers[:] = [None] * len(workers)

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

status: 0 ok, 1 error (an exception, a value that is not a finite number, the memory
limit), 2 timeout (the pool's limit), 3 the verifier's own time limit ran out (it raised
`VerifierTimeout`, e.g. the sandbox's wall_s: counted as a timeout, never as a broken
verifier). The parent owns the hard wall-clock timeout (it kills this process); here a
CPU-time timer raises inside a runaway Python verifier a little earlier, so the common
case costs no process restart.

Containment of user code: the worker is a child subreaper, and after each call it kills
every process the call left behind (see `reaper`); processes a verifier module starts
while it is imported (a long-lived helper such as a proof checker) are kept. A forked copy
of the worker that returns from the verifier exits at once instead of answering on the
worker's pipe. With `memory_mb`, the worker's address space is capped at what it holds
once the verifiers are loaded plus `memory_mb`: an allocation beyond it raises MemoryError
in the verifier (an error for that call), not the OOM killer. Capped workers run with
MALLOC_ARENA_MAX=2, so that glibc's 64 MB per-thread arenas do not eat the headroom of
a verifier that uses threads.
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import numbers
import os
import pickle
import reprlib
import resource
import signal
import struct
import subprocess
import sys
import time

from jaxrl_llm.verifiers import reaper
from jaxrl_llm.verifiers.registry import VerifierTimeout

OK, ERROR, TIMEOUT, OWN_TIMEOUT = 0, 1, 2, 3
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


def as_number(value) -> float | None:
    """`value` as a float if it is a real number (bool, int, float, Fraction, a numpy or JAX
    scalar); None for anything else, strings included: "0.75" is a bug, not a score."""
    if type(value) is float or isinstance(value, numbers.Real):  # float: the fast path
        return float(value)
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kind is not None and kind in "biuf" and getattr(value, "shape", None) == ():
        return float(value)
    return None


def _call(
    fn,
    completion: str,
    example: dict,
    soft_timeout_s: float,
    memory_mb: int = 0,
    contain: bool = True,
    raw: bool = False,
):
    """(value, status, message) of one verifier call; `contain`: it may fork; `raw`: the
    value is returned as it is (any picklable object: `VerifierPool.call`), not as a score."""
    pid = os.getpid() if contain else None
    try:
        signal.setitimer(signal.ITIMER_VIRTUAL, soft_timeout_s)
        try:
            value = fn(completion, example)
        finally:
            if pid is not None and os.getpid() != pid:  # a fork the verifier made
                os._exit(0)
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    except SoftTimeout:  # also when the timer fires between the call and the disarm
        return 0.0, TIMEOUT, f"exceeded {soft_timeout_s:.3g} s of CPU"
    except VerifierTimeout as err:
        return 0.0, OWN_TIMEOUT, f"its own time limit: {err}"[:500]
    except MemoryError:
        limit = f" (the {memory_mb} MB verifier memory limit)" if memory_mb else ""
        return 0.0, ERROR, f"MemoryError: out of memory{limit}"
    except BaseException as err:  # SystemExit too: a verifier cannot stop the worker
        return 0.0, ERROR, f"{type(err).__name__}: {err}"[:500]
    if raw:
        return value, OK, ""
    try:
        number = as_number(value)
        shown = "" if number is not None else reprlib.repr(value)
    except Exception as err:  # float(10**400), a __float__ or __repr__ that raises
        return 0.0, ERROR, f"returned a {type(value).__name__} that is not usable ({err})"[:500]
    if number is None:
        return 0.0, ERROR, f"returned {type(value).__name__} {shown}, expected a number"
    if not math.isfinite(number):
        return 0.0, ERROR, f"returned {number}"
    return number, OK, ""


def _limit_memory(memory_mb: int) -> None:
    """Caps the address space at what the worker maps now plus `memory_mb` (0: lifts the
    cap). Soft limit only, so the sandbox below may still set its own."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = hard
    if memory_mb > 0:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                mapped = int(f.read().split()[0]) * resource.getpagesize()
        except OSError:  # no /proc: no way to know the baseline, so no cap
            return
        soft = mapped + memory_mb * (1 << 20)
        soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# Built-ins that are pure Python and start no process: no containment checks (they would
# add ~5 us to calls of ~50 us).
_STARTS_NO_PROCESS = frozenset({"gsm8k", "math", "format", "countdown"})


def _bind(specs):
    """[(fn, contain, raw)] for the spec list: the bound verifier, whether its calls need
    the fork and leftover-process checks, and whether its value is returned as it is
    (specs of `VerifierPool.call` carry a third element, True)."""
    from jaxrl_llm.verifiers.registry import get

    return [
        (get(name, **options), name not in _STARTS_NO_PROCESS, bool(raw and raw[0]))
        for name, options, *raw in specs
    ]


def serve(in_fd: int, out_fd: int, soft_timeout_s: float, memory_mb: int = 0) -> None:
    fns, key, helpers = None, None, frozenset()
    signal.signal(signal.SIGVTALRM, _on_timer)
    while True:
        try:
            message = receive(in_fd)
        except EOFError:
            message = ("exit",)
        if message[0] == "exit":
            reaper.kill_children()
            return
        if message[0] == "specs":
            try:
                if memory_mb:
                    _limit_memory(0)  # loading verifiers is not theirs to pay for
                fns, key = _bind(message[2]), message[1]
                helpers = frozenset(reaper.children(os.getpid()))  # started at import
                _limit_memory(memory_mb)
                send(out_fd, ("ready", key))
            except Exception as err:
                send(out_fd, ("spec_error", message[1], f"{type(err).__name__}: {err}"))
            continue
        _, items, samples = message
        for item, sample, k in items:
            completion, example = samples[sample]
            fn, contain, raw = fns[k]
            result = _call(fn, completion, example, soft_timeout_s, memory_mb, contain, raw)
            if contain and reaper.has_children():  # what the call started must not outlive it
                reaper.kill_children(keep=helpers)
            try:
                send(out_fd, ("result", item, *result))
            except Exception as err:  # a raw value that does not pickle (nothing was written)
                send(out_fd, ("result", item, 0.0, ERROR, f"result not picklable: {err}"[:500]))


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
    reaper.become_subreaper()
    serve(in_fd, out_fd, float(sys.argv[2]), int(sys.argv[3]))


_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from jaxrl_llm.verifiers.worker import main; main()"
)


class WorkerProcess:
    """The parent's handle on one worker subprocess, and what it knows about it."""

    def __init__(self, soft_timeout_s: float, memory_mb: int = 0):
        argv = [json.dumps(sys.path), repr(soft_timeout_s), str(int(memory_mb))]
        env = {**os.environ}
        if memory_mb:
            env.setdefault("MALLOC_ARENA_MAX", "2")  # see the module docstring
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # Ctrl-C at the terminal is the trainer's to handle
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
        """Kills the worker and every process below it, `setsid` ones included."""
        if self.proc.returncode is None:  # not reaped yet: the pid is still this worker's
            reaper.kill_tree(self.proc.pid)
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

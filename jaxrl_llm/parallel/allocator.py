"""The host memory allocator: command-line entry points re-run themselves under tcmalloc.

XLA:CPU allocates each call's large temporaries (the update's logits and their
cotangents: gigabytes per GRPO update of a 25M model) from its worker threads. glibc
serves allocations that large from a worker thread's arena with a fresh `mmap` every time
and unmaps them on free, so every call faults in and zeroes hundreds of thousands of new
pages. tcmalloc keeps freed pages and hands them out again: no faults after the first
step (the measured gain: benchmarks/RESULTS.md, "tcmalloc").

The allocator has to be in place before the process starts (`LD_PRELOAD`), so
`reexec_with_tcmalloc()` replaces the process with itself, same interpreter and
arguments, with tcmalloc preloaded; the `__main__` blocks of the trainer and the
benchmarks call it first. Programs that use the library in-process (a notebook, a test)
are left alone; start them with `LD_PRELOAD=<the library>` for the same effect.

`JAXRL_LLM_TCMALLOC`: unset or `auto` finds the library (Debian / Ubuntu:
`apt install libtcmalloc-minimal4`); `0` / `off` keeps the system allocator; a path
preloads that library.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

ENV = "JAXRL_LLM_TCMALLOC"
_OFF = ("0", "off", "false", "no")
# Where distributions put it, for when ld.so's cache is not searchable (no ldconfig).
_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def find_tcmalloc() -> str | None:
    """The tcmalloc library's name or path as `LD_PRELOAD` takes it, or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        if found := ctypes.util.find_library(name):
            return found
    return next((p for p in _PATHS if os.path.exists(p)), None)


def preload_environ(environ: dict[str, str], platform: str = sys.platform) -> dict | None:
    """The environment to re-run this process with tcmalloc preloaded, or None when there
    is nothing to do: switched off, not Linux, already preloaded (so the re-run process,
    whether or not the library loaded, never runs again), not found."""
    setting = environ.get(ENV, "auto").strip()
    preload = environ.get("LD_PRELOAD", "")
    if setting.lower() in _OFF or not platform.startswith("linux") or "tcmalloc" in preload:
        return None
    if setting.lower() in ("", "auto"):
        lib = find_tcmalloc()
        if lib is None:
            return None
    else:
        lib = setting
        if not os.path.exists(lib):
            raise FileNotFoundError(f"{ENV}={lib}: no such file (0 keeps the system malloc)")
        if lib in preload.split(":"):
            return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    # Freed pages stay with tcmalloc (returning them is what makes the faults).
    env.setdefault("TCMALLOC_RELEASE_RATE", "0")
    # gperftools prints a backtrace for every allocation over 1 GiB by default (the
    # trainer's one-micro-batch logits are one).
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**50))
    return env


def reexec_with_tcmalloc() -> None:
    """Replace this process with itself under tcmalloc, when `preload_environ` says so.
    Call it first in a `__main__` block: before threads, subprocesses or devices exist."""
    try:
        env = preload_environ(dict(os.environ))
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def release_free_memory() -> bool:
    """Hands the allocator's free pages back to the system: tcmalloc's page heap (which
    `TCMALLOC_RELEASE_RATE=0` otherwise keeps for good), or glibc's heap top
    (`malloc_trim`). XLA takes a program's temporaries as one block; the smaller spans
    that compiling and earlier programs freed cannot serve it, so kept, they would stay
    resident beside it. Once after a round of compiles the cost is one page fault per
    page of the next block; every step, it would undo what tcmalloc is here for. Returns
    whether an allocator took the call."""
    process = ctypes.CDLL(None)
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):
        process.MallocExtension_ReleaseFreeMemory()
        return True
    if hasattr(process, "malloc_trim"):
        process.malloc_trim(0)
        return True
    return False


def active() -> str | None:
    """The path of the tcmalloc library mapped into this process, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                if "tcmalloc" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def hint() -> str | None:
    """One line for the log when a CPU run uses the system malloc on Linux."""
    if active() or os.environ.get(ENV, "").strip().lower() in _OFF:
        return None
    if not sys.platform.startswith("linux"):
        return None
    return (
        "host allocator: system malloc; XLA:CPU's large temporaries fault in fresh pages "
        "every step. `apt install libtcmalloc-minimal4` and the trainer preloads it (faster "
        f"steps on CPU); {ENV}=0 silences this"
    )

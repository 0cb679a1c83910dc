"""Every process a verifier started, found and killed, even the ones that left its group.

A verifier that starts a process and returns (a server it forgot, `setsid` and a double
fork, a forked copy of itself) must not outlive its call. Process groups miss the ones that
call `setsid`; so a pool worker makes itself a *child subreaper* (Linux): orphans anywhere
below it are re-parented to it instead of to init, and stay its children until it kills
them. After each call the worker kills whatever children it has (`kill_children`; one
cheap `waitpid` when there are none), and the pool kills a worker together with everything
below it (`kill_tree`).

The process tree is read from `/proc/<pid>/task/<tid>/children` (Linux >= 3.5), or, where
that file is missing, from the parent pid of every process in `/proc`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

PR_SET_CHILD_SUBREAPER = 36
_MAX_ROUNDS = 64  # each round kills one generation; a fork bomb gets no further than this


def become_subreaper() -> bool:
    """Makes orphaned descendants of this process its children; False where unsupported."""
    try:
        return ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """Live and zombie children of `pid` (empty if it is gone)."""
    tasks = f"/proc/{pid}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/children", encoding="ascii") as f:
                found += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            return _children_from_stat(pid)
        except OSError:
            continue
    return found


def _children_from_stat(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children."""
    found, frontier = [], [pid]
    while frontier:
        below = [c for p in frontier for c in children(p)]
        found += below
        frontier = below
    return found


def _signal(pids, signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _reap(pid: int = -1) -> bool:
    """Reaps `pid` (or any finished child): True if something was reaped."""
    try:
        return os.waitpid(pid, 0 if pid > 0 else os.WNOHANG)[0] != 0
    except ChildProcessError:
        return False


def has_children() -> bool:
    """Whether this process has any child, live or zombie (one waitpid; no /proc read)."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


def kill_children(keep: frozenset[int] = frozenset()) -> int:
    """SIGKILLs and reaps every process below this one except the children in `keep`
    (and what is below them); returns how many.

    Call it in a subreaper: the children of each killed generation become this process's
    children and are killed in the next round.
    """
    killed = 0
    for _ in range(_MAX_ROUNDS):
        kids = [pid for pid in children(os.getpid()) if pid not in keep]
        if not kids:
            break
        _signal(kids, signal.SIGKILL)
        for pid in kids:
            _reap(pid)
        killed += len(kids)
    if not keep:
        while _reap():
            pass
    return killed


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid`, its process group and every process below it (not waited for).

    The tree is frozen (SIGSTOP) before the kill, so nothing in it can fork a process the
    kill would miss."""
    seen: set[int] = set()
    for _ in range(_MAX_ROUNDS):
        new = [p for p in [pid, *descendants(pid)] if p not in seen]
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        seen.update(new)
    _signal(seen, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)

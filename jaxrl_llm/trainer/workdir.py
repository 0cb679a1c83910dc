"""The run directory: one trainer at a time, and the config each start of the run used.

    wd = workdir.lock(path)                  # UserError if another trainer holds it
    lines = workdir.check_resume(path, cfg, allow=cfg["train"]["allow_config_change"])
    workdir.save_config(path, cfg)           # config.json + configs/config.<n>.json
    ...
    wd.release()                             # or let the process end: the OS releases it

Lock: `flock` on `<workdir>/trainer.lock`, which holds the holder's pid, host and start
time for the message a second trainer prints. The kernel drops the lock when the holder's
process ends in any way (kill -9 included), so a crashed run never leaves a stale lock;
the file stays behind and is simply locked again. On a shared file system (several hosts
on one workdir) only process 0 should take it.

Config history: `config.json` is always the config of the latest start (export and
evaluation read it); `configs/config.<n>.json` keeps every distinct config the run was
started or resumed with, n = 1, 2, ... in order. A resume whose config differs from the
saved one lists the differences; differences in keys that change what the run means
(`meaningful`) stop it unless allowed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.errors import UserError

LOCK_FILE = "trainer.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
CONFIG_FILE = "config.json"
HISTORY_DIR = "configs"
ALLOW_KEY = "train.allow_config_change"
MISSING = "<absent>"  # a key one of the two configs does not have

# What the run optimises, on which data, with which model and sampling distribution:
# changing any of these mid-run makes its steps mean something else.
# env.*: the environment is the reward function and the trajectories' shape (its name and
# options, turns, tokens, stop tokens, the turns' discount).
# teacher.*: the distillation target; agent.*: the agent is the run's reward function.
MEANINGFUL_SECTIONS = (
    "model.",
    "data.",
    "rollout.",
    "algo.",
    "optim.",
    "rewards.",
    "env.",
    "teacher.",
    "agent.",
)
MEANINGFUL_KEYS = ("train.seed", "rewards", "env.options", "teacher.paths", "agent.options")
# Sections whose keys are names the user picks: a key added or removed there (a reward, an
# environment option) changes the run as much as a changed value does.
FREE_FORM = ("rewards", "env.options", "teacher.paths", "agent.options")
# ...except these, which change how it is computed, where files live, or how long it runs
# (and some are the very fix for a stopped run: a prompt limit, skipping bad rows, memory).
NOT_MEANINGFUL = frozenset(
    {
        "model.remat",  # recompute vs store activations: same math
        "model.scan_layers",  # scanned vs unrolled layers: same math
        "model.moe_impl",  # how the experts' matmuls run: same math
        "model.linear_impl",  # how the DeltaNet's chunked form runs: same math
        "model.linear_chunk",  # its chunk size: same function
        "model.attention",  # attention implementation: same math
        "model.attention_block",
        "data.data_dir",  # where TFDS files live
        "data.download",
        "data.skip_bad_rows",  # the fix for a run stopped by a bad row
        "data.num_epochs",  # how long, like train.num_steps
        "data.pad_multiple",  # padding is masked out
        "data.max_prompt_len",  # a limit; raising it is the fix for a too-long prompt
        "rollout.bucket_steps",  # prompt padding buckets: masked
        "rollout.cache_segments",  # KV cache layout of the decode loop
        "rollout.prefill_chunk",  # prefill in chunks: same cache
        "optim.micro_batches",  # gradient accumulation: the same gradient, less memory
        "rollout.workers",  # where the rollouts are drawn: any worker draws a step as
        "rollout.worker_addresses",  # the others do (the trainer's key and weights), so
        "rollout.worker_timeout_s",  # a restart may find its workers elsewhere, or
        "rollout.worker_start_s",  # fewer or more of them
        "rollout.worker_retry_s",
        "rollout.worker_tls_ca",
        "rollout.worker_sync",  # how the same weights reach them
        "env.step_timeout_s",  # limits of the environment's workers: how long, how
        "env.trajectory_timeout_s",  # many and how much memory; raising one is the fix
        "env.workers",  # for a run stopped by timeouts or memory errors
        "env.memory_mb",
        "agent.timeout_s",  # the agent's limits, as the environment workers' above
        "agent.batch_wait_s",
        "agent.max_request_bytes",
    }
)


# ----------------------------------------------------------------------------- the lock
def prepare(workdir: str | os.PathLike) -> str:
    """Creates `workdir` if needed and checks it is a writable directory; returns its
    absolute path. Raises UserError naming the path."""
    path = os.path.abspath(os.fspath(workdir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(path, "--workdir is a file, not a directory", "choose another --workdir")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as err:
        raise UserError(
            path, f"--workdir is not writable ({_reason(err)})", "choose a writable --workdir"
        ) from None
    return path


def _reason(err: OSError) -> str:
    if err.errno == errno.EROFS:
        return "read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    return err.strerror or type(err).__name__


class WorkdirLock:
    """A held lock on a run directory (see `lock`)."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Gives the directory back; idempotent. The file stays (see module docstring)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock(workdir: str | os.PathLike) -> WorkdirLock:
    """Takes the run directory for this process (creating it), or raises UserError naming
    the trainer that has it: `<workdir>: in use by another trainer (pid 123 on host-a,
    since 2025-01-31 12:00:00); ...`."""
    path = prepare(workdir)
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(
            lock_path, f"cannot be opened ({_reason(err)})", "fix its permissions"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            path,
            f"in use by another trainer ({holder(path) or 'holder unknown'})",
            "wait for it to finish or stop it, or choose another --workdir",
        ) from None
    except OSError as err:  # a file system without locks (some network mounts)
        if err.errno not in _NO_LOCKS:
            raise
        logging.warning(
            "%s: the file system has no locks (%s); one trainer per workdir is not enforced there",
            path,
            _reason(err),
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {started}\n".encode(), 0)
    return WorkdirLock(lock_path, fd)


def holder(workdir: str | os.PathLike, wait_s: float = 1.0) -> str | None:
    """ "pid 123 on host-a, since ..." from the lock file, or None if it says nothing.

    A trainer writes the file right after it takes the lock; `wait_s` covers that gap."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            with open(os.path.join(workdir, LOCK_FILE), encoding="utf-8") as f:
                fields = f.read().split(maxsplit=2)
            if len(fields) == 3:
                pid, host, since = fields
                return f"pid {pid} on {host}, since {since.strip()}"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


# ------------------------------------------------------------------------- the configs
def flatten(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"optim.learning_rate": 1e-6, ...} from nested dicts (JSON-normalised values)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _plain(config) -> dict:
    """A ConfigDict or dict as JSON sees it (tuples become lists, odd values strings)."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return json.loads(json.dumps(config, sort_keys=True, default=str))


def diff(saved: Mapping, new: Mapping) -> list[tuple[str, Any, Any]]:
    """[(dotted key, saved value, new value)] for every key whose value differs, sorted;
    a key only one side has shows `MISSING` on the other."""
    a, b = flatten(_plain(saved)), flatten(_plain(new))
    keys = sorted(set(a) | set(b))
    return [
        (k, a.get(k, MISSING), b.get(k, MISSING))
        for k in keys
        if a.get(k, MISSING) != b.get(k, MISSING)
    ]


def meaningful(key: str, saved: Mapping, new: Mapping) -> bool:
    """Whether changing `key` on resume changes what the run means (module constants).

    `train.num_steps` counts only when a schedule decays over it (optim.schedule other
    than constant, in either config): extending such a run bends its learning rate."""
    if key == "train.num_steps":
        flat = [flatten(_plain(c)) for c in (saved, new)]
        return any(c.get("optim.schedule", "constant") != "constant" for c in flat)
    if key in NOT_MEANINGFUL:
        return False
    return key in MEANINGFUL_KEYS or key.startswith(MEANINGFUL_SECTIONS)


def _free_form(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in FREE_FORM)


def read_config(workdir: str | os.PathLike) -> dict | None:
    """The config of the run's latest start (`config.json`), or None for a new run."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(path, f"cannot be read ({err})", "restore it from configs/") from None


def history(workdir: str | os.PathLike) -> list[str]:
    """Paths of `configs/config.<n>.json`, oldest first."""
    directory = os.path.join(workdir, HISTORY_DIR)
    if not os.path.isdir(directory):
        return []
    numbered = []
    for name in os.listdir(directory):
        middle = name.removeprefix("config.").removesuffix(".json")
        if name.startswith("config.") and name.endswith(".json") and middle.isdigit():
            numbered.append((int(middle), os.path.join(directory, name)))
    return [path for _, path in sorted(numbered)]


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # never a half-written config.json


def save_config(workdir: str | os.PathLike, config) -> str:
    """Writes `config` as `config.json` and, when it differs from the latest one, as the
    next `configs/config.<n>.json`; returns the history file holding it.

    A `config.json` from before the history existed is kept as `configs/config.1.json`."""
    config = _plain(config)
    os.makedirs(os.path.join(workdir, HISTORY_DIR), exist_ok=True)
    kept = history(workdir)
    if not kept and (previous := read_config(workdir)) is not None:
        kept = [os.path.join(workdir, HISTORY_DIR, "config.1.json")]
        _write_json(kept[0], previous)
    latest = None
    if kept:
        with open(kept[-1], encoding="utf-8") as f:
            latest = json.load(f)
    if latest != config:
        number = int(os.path.basename(kept[-1]).split(".")[1]) + 1 if kept else 1
        kept.append(os.path.join(workdir, HISTORY_DIR, f"config.{number}.json"))
        _write_json(kept[-1], config)
    _write_json(os.path.join(workdir, CONFIG_FILE), config)
    return kept[-1]


def _show(value) -> str:
    return value if value == MISSING else json.dumps(value)


def check_resume(workdir: str | os.PathLike, config, allow: bool = False) -> list[str]:
    """Compares `config` with the run's saved one before resuming.

    Returns one line per difference (`optim.learning_rate: 1e-06 -> 3e-06`) for the
    trainer to print; [] for a new run or the same config. Raises UserError listing the
    differences in `meaningful` keys unless `allow`. Keys that only one config has (added
    to or removed from the code since) are listed, never refused, except in the FREE_FORM
    sections, where the user names the keys (a reward or an environment option added).
    """
    saved = read_config(workdir)
    if saved is None:
        return []
    changes = diff(saved, config)
    lines = [f"{key}: {_show(old)} -> {_show(new)}" for key, old, new in changes]
    refused = [
        line
        for line, (key, old, new) in zip(lines, changes, strict=True)
        if (MISSING not in (old, new) or _free_form(key)) and meaningful(key, saved, config)
    ]
    if refused and not allow:
        raise UserError(
            os.path.join(os.fspath(workdir), CONFIG_FILE),
            f"resuming with a config that changes what the run means ({', '.join(refused)})",
            f"rerun with the saved values, use a new --workdir, or pass --config.{ALLOW_KEY}=True",
        )
    return lines

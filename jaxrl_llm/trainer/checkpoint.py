"""Orbax checkpoints of the training state, and a stop flag for SIGTERM and Ctrl-C.

    ckpt = Checkpointer(workdir / "checkpoints", keep=3, save_interval_steps=10)
    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(target=abstract_state)  # straight into its sharding
    for step in ...:
        ckpt.save(step, state, extra={"data": iterator.state(), "seed": seed})
    ckpt.close()  # waits for the last async save

Each step is a directory `<step>/` holding two orbax items: `state` (any pytree of arrays,
written by every process, each its own shards, in OCDBT format) and `extra` (a small JSON
dict written by process 0: data-iterator position, config, seeds). orbax writes a step
under `<step>.orbax-checkpoint-tmp` and renames it when every item is complete, so a run
killed mid-save leaves no half checkpoint behind: `latest_step` never sees it and the
next `Checkpointer` (not a read-only one) deletes it.

Async saves copy the arrays to host memory before `save` returns, so the caller may
donate or overwrite the state right away; the write to disk runs in a background thread.
The arrays are stored uncompressed: a compressed save holds the compressed copy of the
whole state in host memory until it is written.

A full disk (or quota) while saving raises `DiskFullError`, one line naming the directory,
its free space and the last complete step, instead of orbax's tracebacks from each of its
writer threads; the half-written step is a temp dir that the next run removes. A failed
save abandons its event loop while tensorstore still has writes in flight; their completion
callbacks then find the loop closed, and tensorstore reports each through
`sys.unraisablehook` as a bare "Event loop is closed" traceback. Nothing awaits those
results any more, so the hook this module installs drops exactly that report.

PRNG keys: typed keys (`jax.random.key`) round-trip as they are (orbax stores their
uint32 key data and restores a typed key when the target leaf is one), checked by the
tests with orbax-checkpoint 0.12.8.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxrl_llm.errors import UserError, free_space


class DiskFullError(UserError):
    """The checkpoint directory's disk (or quota) ran out while saving."""


def _disk_full(err: BaseException | None) -> bool:
    """Whether `err` or an exception it was raised from is ENOSPC / EDQUOT (orbax wraps
    tensorstore's write errors in ValueError, keeping only the text)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in ("No space left on device", "Disk quota exceeded")):
            return True
        err = err.__cause__ or err.__context__
    return False


class _ReportedRecords(logging.Filter):
    """Drops orbax's log records of what is reported elsewhere in one line: a full disk (a
    traceback per writer thread; the Checkpointer raises DiskFullError once) and a second
    Ctrl-C that cut a wait for a save (`errors.cli_main`'s line). Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, KeyboardInterrupt):
            return False
        return not (_disk_full(error) or _disk_full(Exception(record.getMessage())))


_REPORTED_FILTER = _ReportedRecords()


def _callback_into_closed_loop(unraisable) -> bool:
    """True for the report of a completion callback that reached a closed event loop:
    `RuntimeError('Event loop is closed')` raised by `loop.call_soon_threadsafe` called
    from native code (tensorstore), so the call is the traceback's first frame."""
    err, tb = unraisable.exc_value, unraisable.exc_traceback
    return (
        type(err) is RuntimeError
        and str(err) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
    )


def _drop_callbacks_into_closed_loops() -> None:
    """Wraps `sys.unraisablehook` (once) to drop `_callback_into_closed_loop` reports;
    every other report goes to the hook that was there."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
        return

    def hook(unraisable):
        if not _callback_into_closed_loop(unraisable):
            previous(unraisable)

    hook._drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


class Checkpointer:
    """Saves and restores `(state, extra)` every `save_interval_steps`, keeping the last K.

    Every process calls every method (orbax synchronises them); only arrays go into
    `state`. `keep=None` keeps every checkpoint. `read_only=True` opens a directory that a
    running trainer may be writing to (export, evaluation): it neither creates nor cleans.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int | None = 3,
        save_interval_steps: int = 10,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps={save_interval_steps}: must be >= 1")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (or None to keep every checkpoint)")
        directory = os.fspath(directory)
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.save_interval_steps = save_interval_steps
        self.read_only = read_only
        self._failed: DiskFullError | None = None
        logging.getLogger("absl").addFilter(_REPORTED_FILTER)  # orbax logs through absl
        _drop_callbacks_into_closed_loops()
        if read_only:
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                save_interval_steps=0,
                create=False,
                enable_async_checkpointing=False,
            )
        else:
            options = ocp.CheckpointManagerOptions(
                save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                    save_interval_steps
                ),
                preservation_policy=ocp.checkpoint_managers.LatestN(keep),
                enable_async_checkpointing=async_save,
                # A temp dir left by a killed save is garbage, unless another process is
                # still writing it: only the owner of the directory cleans up, not a reader.
                cleanup_tmp_directories=True,
            )
        # Handlers given up front, so that a fresh manager can read metadata before any
        # save or restore has told it which handler each item uses.
        # Uncompressed: zstd kept each array's compressed copy in host memory until the
        # step was written (a second copy of the state at every save), for a few percent
        # less disk on float weights. Uncompressed, tensorstore writes straight from the
        # arrays (on CPU, the device buffers themselves). Compressed checkpoints (older
        # ones) still restore: the format records the codec.
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(use_compression=False),
            "extra": ocp.JsonCheckpointHandler(),
        }
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, step: int, state, extra: Mapping[str, Any] | None = None, force=False) -> bool:
        """Saves if `step % save_interval_steps == 0` or `force`; returns whether it did.

        A step that is already saved is not saved again (a forced save on preemption
        right after a scheduled one is then a no-op). `extra` must be JSON-serialisable;
        numpy scalars and arrays are converted.
        """
        if self.read_only:
            raise ValueError(f"{self.directory}: opened read-only, cannot save")
        step = int(step)
        if step in self._mgr.all_steps():
            return False
        # Fail here, in the caller's frame, rather than in the background writer thread.
        extra = json.loads(json.dumps(dict(extra or {}), default=_json_default))
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), extra=ocp.args.JsonSave(extra))
        if self._failed is not None:
            raise self._failed
        with self._reporting_disk_full():
            return bool(self._mgr.save(step, args=args, force=force))

    def restore(self, step: int | None = None, target=None, partial: bool = False):
        """Returns `(state, extra)` of `step` (default: the latest).

        Args:
          target: pytree with the structure of the saved state whose array leaves are
            `jax.ShapeDtypeStruct`s with a `.sharding` (or `jax.Array`s): each array is
            read straight into that sharding and dtype, whatever sharding it was saved
            with. None restores the saved structure (dicts and lists) as numpy arrays.
          partial: `target` holds only some top-level entries of the state, e.g.
            `{"params": abstract_params}`; the rest is not read.
        """
        step = self._resolve(step)
        if target is None:
            meta = self._mgr.item_metadata(step)["state"].tree
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
            state_args = ocp.args.PyTreeRestore(restore_args=restore_args)
        else:
            _check_target(target)
            state_args = ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=partial,
            )
        out = self._mgr.restore(
            step, args=ocp.args.Composite(state=state_args, extra=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["extra"] or {})

    def abstract_state(self, step: int | None = None):
        """The saved state's structure with `jax.ShapeDtypeStruct` leaves (no sharding)."""
        meta = self._mgr.item_metadata(self._resolve(step))["state"].tree
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), meta)

    def wait(self) -> None:
        """Blocks until every pending async save is on disk (and old ones deleted).

        Raises DiskFullError if a save ran out of space (once: after that it returns)."""
        if self._failed is None:
            with self._reporting_disk_full():
                self._mgr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and stops orbax's threads (see `wait` for errors)."""
        if self._failed is None:
            with self._reporting_disk_full():
                self._mgr.close()
            return
        try:  # the failure is reported already; only the threads need stopping
            self._mgr.close()
        except Exception as err:
            if not _disk_full(err):
                raise

    @contextlib.contextmanager
    def _reporting_disk_full(self):
        try:
            yield
        except Exception as err:
            if not _disk_full(err):
                raise
            steps = self._all_steps_or_none()
            last = "unknown" if steps is None else f"step {steps[-1]}" if steps else "none"
            free = free_space(self.directory) or "free space unknown"
            self._failed = DiskFullError(
                self.directory,
                f"no space left on device while saving a checkpoint ({free}; the last "
                f"complete checkpoint: {last})",
                "free some space or point --workdir at a larger disk, then rerun to resume",
            )
            raise self._failed from None

    def _all_steps_or_none(self) -> list[int] | None:
        try:
            return sorted(int(name) for name in os.listdir(self.directory) if name.isdigit())
        except OSError:
            return None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"{self.directory}: no checkpoint")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(
                f"{self.directory}: no checkpoint for step {step}; saved steps: {steps}"
            )
        return int(step)


def with_shardings(tree) -> Any:
    """A restore target from live arrays: `jax.ShapeDtypeStruct`s with their shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _check_target(target) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
            raise ValueError(
                f"restore target {jax.tree_util.keystr(path)}: ShapeDtypeStruct without "
                f"a sharding; give every leaf the sharding to restore into"
            )


def _json_default(x):
    if isinstance(x, np.generic | np.ndarray):
        return x.tolist()
    if isinstance(x, jax.Array):
        return np.asarray(x).tolist()
    raise TypeError(f"checkpoint extra: {type(x).__name__} is not JSON-serialisable")


# ----------------------------------------------------------------------------- preemption
_CTRL_C_NOTE = (
    "\nCtrl-C: saving a checkpoint after this step, then stopping "
    "(press Ctrl-C again to abort without saving)\n"
)


class PreemptionFlag:
    """Set by SIGTERM (TPU maintenance, GKE/SLURM preemption) or a first Ctrl-C: save and
    exit cleanly. A second Ctrl-C raises KeyboardInterrupt (abort without saving).

    Single process: `requested` turns True in the signal handler; the trainer checks it
    once per step, saves with `force=True`, waits for the save and exits 0.

    Several processes: each host may get the signal at a different step, yet all must
    save the same step (an orbax save is collective). `stop_at(step)`, called by every
    process at every step, returns True on all of them at the same step. It uses JAX's
    preemption sync service (`multihost_utils.reached_preemption_sync_point`), which is on
    by default after `jax.distributed.initialize` and catches SIGTERM itself; without the
    service, the hosts' local flags are all-gathered each step. With the service, Ctrl-C
    keeps Python's default (KeyboardInterrupt): the service could not stop the other hosts.
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.reason: str | None = None  # "SIGTERM", "SIGINT" or "request"

    @property
    def requested(self) -> bool:
        """True once this process got SIGTERM or Ctrl-C (or `request()` was called)."""
        return self._event.is_set()

    @property
    def installed(self) -> bool:
        """Whether this flag's Python signal handlers are in place."""
        return bool(self._previous)

    def request(self) -> None:
        self.reason = self.reason or "request"
        self._event.set()

    def stop_at(self, step: int) -> bool:
        """Whether every process should save and stop at `step` (call it on all of them)."""
        if jax.process_count() == 1:
            return self.requested
        if _preemption_service_running():
            return multihost_utils.reached_preemption_sync_point(int(step))
        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return bool(np.any(flags))

    def restore(self) -> None:
        """Puts back the handlers that were there before (at the end of training)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _install(self, signum: int) -> None:
        self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt("second Ctrl-C")
        # Set before the note: a Ctrl-C pressed once the note is out finds the flag set,
        # even when it runs this handler again before the first call has returned.
        self.reason = self.reason or signal.Signals(signum).name
        self._event.set()
        if signum == signal.SIGINT:
            # os.write: print() or logging could re-enter a stderr write the signal cut.
            os.write(2, _CTRL_C_NOTE.encode())
        else:
            logging.warning("SIGTERM received: saving a checkpoint and stopping after this step")


def install_sigterm_handler() -> PreemptionFlag:
    """Returns a flag that SIGTERM and a first Ctrl-C set instead of stopping the process.

    Must be called from the main thread. With several processes and JAX's preemption
    service running, no Python handler is installed: it would replace the service's own
    SIGTERM handler, and `stop_at` asks the service instead.
    """
    flag = PreemptionFlag()
    if jax.process_count() > 1 and _preemption_service_running():
        return flag
    flag._install(signal.SIGTERM)
    flag._install(signal.SIGINT)
    return flag


def _preemption_service_running() -> bool:
    """jax starts its preemption sync service with the distributed runtime (several
    processes) when `jax_enable_preemption_service` is on (its default)."""
    return jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)

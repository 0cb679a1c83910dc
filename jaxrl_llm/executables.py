"""Stored executables: the step's compiled programs kept next to the compilation cache and
loaded by a later start of the same code and config without tracing or lowering them.

XLA's persistent cache (`compilation.use_cache`) keys a program by its lowered HLO, so a
rerun still traces and lowers every program in Python before the cache can answer: most of
a warm start. A `Store` keys a program instead by everything that decides it before
tracing: this package's source, the versions of jax, jaxlib, flax, optax and numpy, jax's
options and `XLA_FLAGS`, the devices and the host CPU, what the run was built from
(`context`: its config, model config, rollout spec, algorithm), and the program's name,
static arguments and the shapes, dtypes and shardings of its arguments. A program found
there is deserialized (`jax.experimental.serialize_executable`) and serves the calls with
exactly those arguments; any other call traces and compiles as before.

    program = Program(jax.jit(f, static_argnames="spec"), static_argnames=("spec",))
    store = Store(directory, context)
    if (entry := store.read(name, program, args, kwargs)) and (loaded := entry.load()):
        program.install(loaded)                    # -> calls skip tracing and compiling
    else:
        compiled = program.lower(*args, **kwargs).compile()
        program.install(store.save(name, program, args, kwargs, compiled))

One process only (several hosts would have to agree on every load) and programs over all
of the devices (a deserialized executable runs on the devices it is given).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import os
import pickle
import platform
import threading

import jax
import numpy as np
from jax.experimental import serialize_executable

FORMAT = "jaxrl_llm executables 1"
MAX_BYTES = 2 * 2**30  # the store's size; the least recently used programs go first
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")
_IGNORED_OPTIONS = ("cache", "log", "traceback", "pprint", "transfer_guard", "dump")


class Program:
    """A jitted function and the executables installed for given arguments: a call with
    the signature of one runs it; any other call goes to the jitted function.
    static_argnames: the keyword arguments the function takes as static."""

    def __init__(self, jitted, static_argnames: tuple[str, ...] = ()):
        self.jitted, self.static_argnames = jitted, tuple(static_argnames)
        self.installed: dict = {}
        self.pending: dict = {}  # signature -> Future of a build that installs it

    def __call__(self, *args, **kwargs):
        if self.installed or self.pending:
            sig = self.signature(args, kwargs)
            if (future := self.pending.get(sig)) is not None:
                try:  # still being built: wait for it (its error raises here)
                    future.result()
                except concurrent.futures.CancelledError:  # dropped unbuilt: jit compiles
                    pass
                self.pending.pop(sig, None)
            if (executable := self.installed.get(sig)) is not None:
                return executable(*args, **self._dynamic(kwargs))
        return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def install(self, entry) -> None:
        """entry: (signature, executable), from `Entry.load` or `Store.save`."""
        sig, executable = entry
        self.installed[sig] = executable

    def _dynamic(self, kwargs: dict) -> dict:
        return {k: v for k, v in kwargs.items() if k not in self.static_argnames}

    def signature(self, args, kwargs) -> tuple:
        """Hashable: the argument tree, the static arguments, and per array its shape,
        dtype, weak type and sharding (None for host arrays). Arrays and their
        `ShapeDtypeStruct`s with the same sharding give the same signature."""
        leaves, tree = jax.tree.flatten((args, self._dynamic(kwargs)))
        statics = tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs)
        return tree, statics, tuple(map(_leaf, leaves))


def _leaf(x) -> tuple:
    return (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)),
            bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None))  # fmt: skip


def _describe(sig: tuple) -> str:
    """A signature as text that names the devices of each sharding (a sharding's repr
    names the mesh's shape, not which device sits where)."""
    tree, statics, leaves = sig
    parts = [str(tree), repr(statics)]
    for shape, dtype, weak, sharding in leaves:
        devices = ()
        if sharding is not None:
            devices = tuple(d.id for d in sharding._device_assignment)
        parts.append(f"{shape}{dtype}{weak}{sharding!r}{devices}")
    return "\n".join(parts)


@functools.cache
def fingerprint() -> str:
    """This package's source, the packages its programs are traced with, jax's options,
    XLA_FLAGS, the devices and the host CPU: what makes a stored program stale when it
    changes."""
    h = hashlib.sha256(FORMAT.encode())
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    for package in _PACKAGES:
        try:
            h.update(f"{package}={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package}=absent".encode())
    for name, value in sorted(jax.config.values.items()):
        if not any(word in name for word in _IGNORED_OPTIONS):
            h.update(f"{name}={value!r}".encode())
    h.update(os.environ.get("XLA_FLAGS", "").encode())
    h.update(os.environ.get("LIBTPU_INIT_ARGS", "").encode())
    devices = jax.devices()
    h.update(f"{devices[0].client.platform_version}|{jax.process_count()}".encode())
    h.update(repr([(d.id, d.device_kind, d.process_index) for d in devices]).encode())
    h.update(_host_cpu().encode())
    return h.hexdigest()


def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags: XLA:CPU compiles for the features
    of the machine it runs on, so a cache directory shared between machines (a network
    home) must not hand one machine's executables to another."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n\n")[0].splitlines()
    except OSError:
        return text + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return text + "".join(line for line in lines if line.split(":")[0].strip() in keep)


@dataclasses.dataclass
class Entry:
    """A stored program as read: `out_info` (its outputs' shapes and dtypes) at once,
    the executable from `load` (deserializing it; no GIL held, so threads may share it)."""

    signature: tuple
    path: str
    blob: bytes
    in_tree: object
    out_tree: object
    out_info: object
    device_ids: tuple[int, ...]  # the program's devices, in its order (the mesh's)

    def load(self):
        """-> (signature, executable) for `Program.install`; None, and the file deleted,
        when it does not load (e.g. written by another jaxlib build)."""
        by_id = {d.id: d for d in jax.devices()}
        try:
            devices = [by_id[i] for i in self.device_ids]
            args = (self.blob, self.in_tree, self.out_tree)
            executable = serialize_executable.deserialize_and_load(*args, execution_devices=devices)
        except Exception:
            _remove(self.path)
            return None
        return self.signature, executable


class Store:
    """Serialized executables in `directory`, keyed by `fingerprint()`, `context` (text
    naming what the programs were built from) and each program's name and signature."""

    def __init__(self, directory: str, context: str):
        self.directory, self.context = directory, context
        os.makedirs(directory, exist_ok=True)

    def _path(self, name: str, sig: tuple) -> str:
        text = "\n".join([fingerprint(), self.context, name, _describe(sig)])
        return os.path.join(self.directory, hashlib.sha256(text.encode()).hexdigest() + ".pkl")

    def read(self, name: str, program: Program, args, kwargs) -> Entry | None:
        """The stored program for these arguments, not yet loaded, or None."""
        sig = program.signature(args, kwargs)
        path = self._path(name, sig)
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree, out_info, device_ids = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:  # a truncated or foreign file: compile instead, and replace it
            _remove(path)
            return None
        os.utime(path)  # recently used
        return Entry(sig, path, blob, in_tree, out_tree, out_info, device_ids)

    def save(self, name: str, program: Program, args, kwargs, compiled, cached=None):
        """Writes a compiled program (atomically; a program that cannot be serialized is
        not stored) -> (signature, compiled) for `Program.install`.

        cached: the serialized executable as XLA's persistent cache wrote or read it for
        `compiled` (`cache_held`), stored as the program's executable instead of
        serializing it again: a second serialization of a fresh compile costs as long as
        the first, and an executable loaded from that cache serializes without its
        kernels, so it would not run once loaded again."""
        sig = program.signature(args, kwargs)
        path = self._path(name, sig)
        try:
            if cached is not None:
                blob, in_tree, out_tree = _serialize_with(compiled, cached)
            else:
                blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            out_info = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type),
                compiled.out_info,
            )  # shardings left out: they name devices (the caller pins its own)
            # Loaded onto these devices in this order: any other order would misplace
            # the shards (the inputs' shardings, in the key, fix the order).
            first = jax.tree.leaves(compiled.input_shardings)[0]
            device_ids = tuple(d.id for d in first._device_assignment)
            data = pickle.dumps((blob, in_tree, out_tree, out_info, device_ids))
        except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
            return sig, compiled
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self._evict()
        return sig, compiled

    def _evict(self) -> None:
        """Deletes the least recently used programs beyond MAX_BYTES."""
        entries = []
        for name in os.listdir(self.directory):
            if not name.endswith(".pkl"):
                continue
            try:
                st = os.stat(os.path.join(self.directory, name))
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= MAX_BYTES:
                break
            _remove(os.path.join(self.directory, name))
            total -= size


def _serialize_with(compiled, serialized: bytes):
    """`serialize_executable.serialize(compiled)` with `serialized` pickled as its one
    executable's bytes (the executable itself is not serialized); ValueError where that
    cannot be done."""
    found = []

    class Writer(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, (serialize_executable.xc.LoadedExecutable,
                                serialize_executable._jax.Executable)):  # fmt: skip
                found.append(obj)
                return ("exec", serialized)
            return super().persistent_id(obj)

    try:  # the steps of `serialize`, with the writer above
        unloaded = getattr(compiled._executable, "_unloaded_executable", None)
        mut = getattr(unloaded, "mut", None)
        if unloaded is None or compiled._params.const_args or (mut and mut.in_mut):
            raise ValueError("jax does not serialize this program")
        args_info, in_tree = jax.tree.flatten(compiled.args_info)
        with io.BytesIO() as out:
            Writer(out).dump((unloaded, args_info, compiled._no_kwargs))
            data = out.getvalue()
    except Exception as err:  # jax's private serialization changed: not stored
        raise ValueError(f"cannot serialize the program with the cache's bytes: {err}") from err
    if len(found) != 1:
        raise ValueError(f"{len(found)} executables in one serialized program")
    return data, in_tree, compiled.out_tree


_HELD = threading.local()


@contextlib.contextmanager
def cache_held():
    """-> a list that collects, in this block and thread, the serialized executables that
    XLA's persistent cache writes (a compile) or answers with (a cache hit), for
    `Store.save`'s `cached`.

    jax serializes and deserializes cache entries in the thread that compiles; its two
    helpers (`jax._src.compilation_cache.combine_executable_and_time` and
    `extract_executable_and_time`) are wrapped once to hand the bytes to the block. A jax
    without them collects nothing: a program is then serialized again to be stored, and
    one that XLA's cache answers is not stored."""
    _wrap_cache_io()
    _HELD.held = held = []
    try:
        yield held
    finally:
        _HELD.held = None


def _hold(serialized: bytes) -> None:
    held = getattr(_HELD, "held", None)
    if held is not None:
        held.append(serialized)


@functools.cache
def _wrap_cache_io() -> None:
    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    read = getattr(compilation_cache, "extract_executable_and_time", None)
    combine = getattr(compilation_cache, "combine_executable_and_time", None)
    if read is not None:

        @functools.wraps(read)
        def extract_executable_and_time(data):
            serialized, compile_time = read(data)
            _hold(serialized)
            return serialized, compile_time

        compilation_cache.extract_executable_and_time = extract_executable_and_time
    if combine is not None:

        @functools.wraps(combine)
        def combine_executable_and_time(serialized, compile_time):
            _hold(serialized)
            return combine(serialized, compile_time)

        compilation_cache.combine_executable_and_time = combine_executable_and_time


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass

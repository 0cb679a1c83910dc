"""XLA compilation at start-up: the persistent cache, one line per compiled program, and
the step's programs built before they are first called, in threads.

    compilation.use_cache(config.train.compilation_cache_dir)    # "" = off
    with compilation.CompileLog(write=progress.write) as log:    # or log.listen() ... close()
        with log.program("sampler", "bucket 24"):   # "compiling sampler (bucket 24)... 9.8 s"
            out = sampler.sample(...)
        with log.ahead_of_time() as build:          # compiled side by side, in threads
            out_info = build("sampler", "bucket 24", jitted, *args, **kwargs)
        with log.ahead_of_time(background=True) as build:
            ...   # the block ends once traced; `log.program(name)` waits for name's build

Everything here uses jax's public API on the core's plain `jax.jit` programs:
`jitted.lower(*args).compile()` compiles a program for given shapes and shardings (a
`jax.ShapeDtypeStruct` per array), and jax's own caches then serve the first call with
those shapes without compiling again. A call that comes while its program is still being
built in another thread would compile it a second time, so the trainer makes its calls
inside `log.program(name, ...)`, which first waits for the builds serving `name`.

Attribution: XLA reports each compile through `jax.monitoring` in the thread that
compiles, so a thread-local label names the program. A program found in the persistent
cache is reported as loaded from it. `log.seconds` is the XLA compile time outside
background builds (a step's `perf/compile_s`; loads from the cache count there).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
import time

import jax
from jax.experimental.compilation_cache import compilation_cache

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
# What comes right before XLA compiles: the end of lowering, the persistent cache's lookup.
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"


def use_cache(path: str) -> str | None:
    """Turns XLA's persistent compilation cache on in `path` (every program, however
    small or quick to compile), or off for "" -> the directory in use, or None.

    The setting is process-wide (a jax option); changing it resets jax's cache handle so
    the new directory takes effect."""
    path = os.path.abspath(os.path.expanduser(path)) if path else None
    if jax.config.jax_compilation_cache_dir != path:
        if path:
            os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclasses.dataclass
class Compiled:
    """What building a program cost: XLA compiles (count and seconds, loads from the
    persistent cache included), how many of them the cache answered, and the wall time
    of the build, tracing and lowering included (None where the block also ran
    programs)."""

    name: str
    detail: str = ""
    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    wall_s: float | None = 0.0
    background: bool = False  # built beside the first step: not in `CompileLog.seconds`
    announced: bool = False  # its "compiling NAME..." line went out while it built

    @property
    def label(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    @property
    def line(self) -> str:
        label = self.label
        seconds = self.compile_s if self.wall_s is None else self.wall_s
        where = " (compilation cache)" if self.cache_hits == self.compiles else ""
        return f"compiling {label}... {seconds:.1f} s{where}"


@dataclasses.dataclass
class _Build:
    """A program being built ahead of its first call: its future, the calls it serves
    (`CompileLog.program(serves)`), and, for a deferred build, the event that starts it."""

    future: concurrent.futures.Future
    serves: str
    start: threading.Event | None = None


class CompileLog:
    """Listens to XLA compile events while entered; see the module doc.

    write: called with one line per program that compiled or was loaded from the cache
    (None: silent). Programs built outside `program(...)` only add to `seconds`.
    announce: called with "compiling NAME (DETAIL)..." when a program's compile has run
    for `announce_after_s` and is still running, so that a slow compile shows while it
    runs (its `write` line follows when it ends); None: silent."""

    def __init__(self, write=None, announce=None, announce_after_s: float = 1.0):
        self.write = write
        self.announce, self.announce_after_s = announce, announce_after_s
        self._timers: dict[int, threading.Timer] = {}
        self.seconds = 0.0
        self.programs: list[Compiled] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._listening = False
        self._builds: list[_Build] = []
        self._closing = threading.Event()

    def listen(self, write=None, announce=None) -> CompileLog:
        """Starts listening to XLA's compile events (and writing lines with `write` and
        `announce`, when given) until `close`."""
        if write is not None:
            self.write = write
        if announce is not None:
            self.announce = announce
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        return self

    def close(self) -> None:
        """Stops listening, once the programs still building in the background are done
        (their errors are left to the calls that wait for them); deferred builds that
        have not started are dropped."""
        self._closing.set()
        for build in self._builds:
            if build.start is not None:
                build.start.set()
        concurrent.futures.wait([b.future for b in self._builds])
        self._builds.clear()
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False

    def __enter__(self) -> CompileLog:
        return self.listen()

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == LOWERED:
            self._announce_later(getattr(self._local, "current", None))
        if event != BACKEND_COMPILE:  # reported for loads from the persistent cache too
            return
        current = getattr(self._local, "current", None)
        with self._lock:
            if current is None or not current.background:
                self.seconds += duration
            if current is not None:
                current.compiles += 1
                current.compile_s += duration

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_LOOKUP:
            self._announce_later(getattr(self._local, "current", None))
        if event == CACHE_HIT and (current := getattr(self._local, "current", None)):
            with self._lock:
                current.cache_hits += 1

    @contextlib.contextmanager
    def program(
        self,
        name: str,
        detail: str = "",
        traced_s: float = 0.0,
        runs: bool = False,
        background: bool = False,
        wait: bool = True,
        compiling: bool = False,
    ):
        """Attributes the compiles of this thread inside the block to `name`; on exit,
        when any happened, records the program and writes its line. Before the block, the
        builds ahead of time that serve `name` are waited for (a deferred one started),
        unless `wait` is False (a build's own block: it would wait for itself).
        traced_s: tracing and lowering time spent before the block, added to its wall
        time. runs: the block also waits for programs to run, so its line gives XLA's
        compile seconds instead of the block's wall time. compiling: the block compiles
        from its start (a build ahead of time), for `announce`."""
        if wait and not background:
            self.wait(name)
        record = Compiled(name, detail, background=background)
        outer = getattr(self._local, "current", None)
        self._local.current, start = record, time.perf_counter()
        if compiling:
            self._announce_later(record)
        try:
            yield record
        finally:
            self._local.current = outer
            with self._lock:
                timer = self._timers.pop(id(record), None)
            if timer is not None:
                timer.cancel()
            record.wall_s = None if runs else traced_s + time.perf_counter() - start
            if record.compiles:
                with self._lock:
                    self.programs.append(record)
                if self.write is not None:
                    self.write(record.line)
            elif record.announced and self.write is not None:  # another thread compiled it
                seconds = record.wall_s or 0.0
                self.write(f"compiling {record.label}... {seconds:.1f} s (another build's)")

    def _announce_later(self, record: Compiled | None) -> None:
        """Starts the timer that announces `record`'s compile (once per program block)."""
        if record is None or self.announce is None:
            return
        with self._lock:
            if id(record) in self._timers:
                return
            timer = threading.Timer(self.announce_after_s, self._announce, (record,))
            timer.daemon = True
            self._timers[id(record)] = timer
        timer.start()

    def _announce(self, record: Compiled) -> None:
        record.announced = True
        self.announce(f"compiling {record.label}...")

    def wait(self, serves: str | None = None) -> None:
        """Waits for the builds ahead of time that serve calls named `serves` (None: all),
        starting deferred ones; the first error among them raises here."""
        with self._lock:
            builds = [b for b in self._builds if serves is None or b.serves == serves]
        for build in builds:
            if build.start is not None:
                build.start.set()
        for build in builds:
            try:
                build.future.result()
            except concurrent.futures.CancelledError:  # dropped unbuilt: jit compiles
                pass

    def start_deferred(self) -> None:
        """Starts the deferred builds (`build(..., deferred=True)`): the first step is done."""
        for build in self._builds:
            if build.start is not None:
                build.start.set()

    @contextlib.contextmanager
    def ahead_of_time(self, side_by_side: bool = True, background: bool = False):
        """Yields `build(name, detail, jitted, *args, serves=name, deferred=False,
        **kwargs) -> out_info` (the program's output shapes, which shape the next
        program's inputs). `build` traces and lowers the program here (tracing holds the
        GIL) and compiles it in a thread of its own: XLA compiles outside the GIL, so the
        programs share the cores; jax then serves the program's first call with the same
        shapes and shardings without compiling. serves: the `program(name)` calls that
        wait for this build.

        The block ends when every program is ready; side_by_side=False: each is ready
        before `build` returns. background=True: the block ends once every program is
        traced and its build started, so the first step runs while later programs still
        compile: the first program built compiles alone (the step needs it first), the
        rest side by side once it is done. The "programs ready" line comes when the last
        is done. deferred=True (background only): that program is traced and built at
        `start_deferred()` or when a call it serves first waits for it (`build` returns
        None), and dropped unbuilt if `close` comes first (a program the first step does
        not run). Tracing the others in their build threads instead was measured: the
        first step starts sooner, the first update comes later on a cold start (RESULTS)."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=4 if side_by_side else 1)
        futures, start_all = [], time.perf_counter()

        def build(name, detail, jitted, *args, serves=None, deferred=False, **kwargs):
            lowering = _Lowering(jitted, args, kwargs)
            here = not (background and deferred)
            if here:
                lowering()
            start = threading.Event() if background and deferred else None
            after = futures[0] if background and futures and start is None else None
            job = functools.partial(self._build, name, detail, lowering, background, after, start)
            futures.append(pool.submit(job))
            with self._lock:
                self._builds.append(_Build(futures[-1], serves or name, start))
            if not side_by_side:
                futures[-1].result()
            return lowering.lowered.out_info if here else None

        try:
            yield build
            if not background:
                for future in futures:
                    future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            pool.shutdown(wait=True)
            raise
        pool.shutdown(wait=not background)
        if futures:
            how = "side by side" if side_by_side else "one by one"
            self._say_ready(futures, "beside the first step" if background else how, start_all)

    def _say_ready(self, futures, how: str, start_all: float) -> None:
        """Writes "programs ready in S s (...)" once every build is done (none failed)."""
        written = []

        def ready(_) -> None:
            with self._lock:
                if written or not all(f.done() for f in futures):
                    return
                written.append(True)
            failed = any(f.cancelled() or f.exception() is not None for f in futures)
            if self.write is not None and not failed:
                built = [f.result() for f in futures]
                cached = sum(0 < p.compiles == p.cache_hits for p in built)
                seconds = time.perf_counter() - start_all
                self.write(
                    f"programs ready in {seconds:.1f} s ({len(built)} built {how}, "
                    f"{cached} from the compilation cache)"
                )

        for future in futures:
            future.add_done_callback(ready)

    def _build(self, name, detail, lowering, background=False, after=None, start=None):
        """One build: waits for `start` (a deferred build; cancelled if the log closes
        first), lowers the program (a deferred one, not lowered where `build` was called),
        waits for `after` (the first program, which compiles alone) and compiles."""
        if start is not None:
            start.wait()
            if self._closing.is_set():
                raise concurrent.futures.CancelledError("the run ended before it was needed")
        lowered = lowering()
        if after is not None:
            concurrent.futures.wait([after])
        with self.program(
            name, detail, lowering.seconds, background=background, wait=False, compiling=True
        ) as record:
            lowered.compile()
        return record


class _Lowering:
    """A program's lowering for given arguments, done once, where it is first called;
    `seconds` is what tracing and lowering took."""

    def __init__(self, jitted, args, kwargs):
        self.jitted, self.args, self.kwargs = jitted, args, kwargs
        self.lowered, self.seconds = None, 0.0

    def __call__(self):
        if self.lowered is None:
            start = time.perf_counter()
            self.lowered = self.jitted.lower(*self.args, **self.kwargs)
            self.seconds = time.perf_counter() - start
        return self.lowered


def shaped(out_info, sharding):
    """A program's output shapes (`Lowered.out_info`) as ShapeDtypeStructs with the given
    (pinned) sharding: the inputs of the programs that read them."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type),
        out_info,
    )

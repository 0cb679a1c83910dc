"""XLA compilation at start-up: the persistent cache, one line per compiled program, and
the step's programs built before they are first called, in threads.

    compilation.use_cache(config.train.compilation_cache_dir)    # "" = off
    with compilation.CompileLog(write=progress.write) as log:    # or log.listen() ... close()
        with log.program("sampler", "bucket 24"):   # "compiling sampler (bucket 24)... 9.8 s"
            out = sampler.sample(...)
        with log.ahead_of_time(store=store) as build:   # compiled side by side, in threads
            out_info = build("sampler", "bucket 24", program, *args, **kwargs)
        with log.ahead_of_time(store=store, background=True) as build:
            ...   # the block ends once traced: each program's first call waits for its build

Attribution: XLA reports each compile through `jax.monitoring` in the thread that
compiles, so a thread-local label names the program. A program found in the persistent
cache is reported as loaded from it; so is one from the executable store
(`executables`), which a rerun of the same code and config loads without tracing it.
`log.seconds` is the XLA compile time outside background builds (a step's
`perf/compile_s`; loads from either count as compiles there).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_llm import executables

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


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
    programs). A stored executable counts as one compile answered by the cache."""

    name: str
    detail: str = ""
    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    wall_s: float | None = 0.0
    stored: bool = False  # loaded from the executable store (`executables`)
    background: bool = False  # built beside the first step: not in `CompileLog.seconds`

    @property
    def line(self) -> str:
        label = f"{self.name} ({self.detail})" if self.detail else self.name
        seconds = self.compile_s if self.wall_s is None else self.wall_s
        if self.stored:
            return f"loading {label}... {seconds:.1f} s (stored executable)"
        where = " (compilation cache)" if self.cache_hits == self.compiles else ""
        return f"compiling {label}... {seconds:.1f} s{where}"


class CompileLog:
    """Listens to XLA compile events while entered; see the module doc.

    write: called with one line per program that compiled or was loaded from the cache
    (None: silent). Programs built outside `program(...)` only add to `seconds`."""

    def __init__(self, write=None):
        self.write = write
        self.seconds = 0.0
        self.programs: list[Compiled] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._listening = False
        self._background: list[concurrent.futures.Future] = []
        self._gates: list[Gate] = []

    def listen(self, write=None) -> CompileLog:
        """Starts listening to XLA's compile events (and writing lines with `write`,
        when given) until `close`."""
        if write is not None:
            self.write = write
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        return self

    def close(self) -> None:
        """Stops listening, once the programs still building in the background are done
        (their errors are left to the calls that wait for them); builds waiting for a
        `Gate` are dropped."""
        for gate in self._gates:
            gate.close()
        for future in self._background:
            future.cancel()
        concurrent.futures.wait(self._background)
        self._background.clear()
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False

    def __enter__(self) -> CompileLog:
        return self.listen()

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_duration(self, event: str, duration: float, **_) -> None:
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
        if event == CACHE_HIT and (current := getattr(self._local, "current", None)):
            with self._lock:
                current.cache_hits += 1

    @contextlib.contextmanager
    def program(self, name: str, detail: str = "", traced_s: float = 0.0, runs: bool = False,
                background: bool = False):  # fmt: skip
        """Attributes the compiles of this thread inside the block to `name`; on exit,
        when any happened, records the program and writes its line. traced_s: tracing
        and lowering time spent before the block, added to its wall time. runs: the block
        also waits for programs to run, so its line gives XLA's compile seconds instead
        of the block's wall time."""
        record = Compiled(name, detail, background=background)
        outer = getattr(self._local, "current", None)
        self._local.current, start = record, time.perf_counter()
        try:
            yield record
        finally:
            self._local.current = outer
            record.wall_s = None if runs else traced_s + time.perf_counter() - start
            if record.compiles:
                with self._lock:
                    self.programs.append(record)
                if self.write is not None:
                    self.write(record.line)

    @contextlib.contextmanager
    def ahead_of_time(self, side_by_side: bool = True, store=None, background: bool = False):
        """Yields `build(name, detail, program, *args, **kwargs) -> out_info` (the
        program's output shapes, which shape the next program's inputs).

        store (an `executables.Store`; None: none): a `executables.Program` found there
        is loaded, not traced, lowered or compiled; one that is not is stored once
        compiled. Otherwise `build` traces and lowers the program here (tracing holds the
        GIL) and compiles it in a thread of its own: XLA compiles (and deserializes)
        outside the GIL, so the programs share the cores. Each program then serves its
        first call with the same shapes and shardings without compiling (a
        `executables.Program` has it installed).

        The block ends when every program is ready; side_by_side=False: each is ready
        before `build` returns. background=True: the block ends once every program is
        traced and its build started, so the first step runs while later programs still
        compile: the first program built compiles alone (the step needs it first), the
        rest side by side once it is done, while this thread traces them; a
        `executables.Program`'s first call with the built arguments waits for its own
        build (and raises its error). The "programs ready" line comes when the last is
        done; `wait()` waits for them. `build(..., gate=g)` (background only): that
        program's build starts when the `Gate` g opens, and is dropped unbuilt if `close`
        comes first (a program the first step does not run, built once that step is
        done)."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=4 if side_by_side else 1)
        futures, start_all = [], time.perf_counter()

        def build(name: str, detail: str, program, *args, gate: Gate | None = None, **kwargs):
            start = time.perf_counter()
            keep = store if isinstance(program, executables.Program) else None
            if keep is not None and (entry := keep.read(name, program, args, kwargs)):
                job = (self._load, name, detail, program, entry, (keep, program, args, kwargs))
                out_info = entry.out_info
            else:
                lowered = program.lower(*args, **kwargs)
                traced_s = time.perf_counter() - start
                save = (keep, program, args, kwargs)
                job = (self._compile, name, detail, lowered, traced_s, save)
                out_info = lowered.out_info
            if background:
                job = (*job, True)
                if gate is not None:
                    with self._lock:
                        self._gates.append(gate)
                    job = (_gated, gate, *job)
                elif futures:
                    job = (_after, futures[0], *job)
            futures.append(pool.submit(*job))
            if background and isinstance(program, executables.Program):
                program.pending[program.signature(args, kwargs)] = futures[-1]
            if not side_by_side:
                futures[-1].result()
            return out_info

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
        if not futures:
            return
        how = "side by side" if side_by_side else "one by one"
        how = "beside the first step" if background else how
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
                self.write(f"programs ready in {seconds:.1f} s ({len(built)} built {how}, "
                           f"{cached} from the compilation cache)")  # fmt: skip

        if background:
            self._background.extend(futures)
        for future in futures:
            future.add_done_callback(ready)

    def wait(self) -> None:
        """Waits for the programs built in the background (`ahead_of_time`); the first
        error among them raises here."""
        while self._background:
            self._background.pop(0).result()

    def _compile(self, name, detail, lowered, traced_s, save, background=False) -> Compiled:
        """save: (store or None, program, args, kwargs). A `executables.Program` gets the
        executable installed for these arguments (and stored, with a store)."""
        store, program, args, kwargs = save
        with (
            self.program(name, detail, traced_s, background=background) as record,
            executables.cache_held() as held,
        ):
            compiled = lowered.compile()
            # Stored as XLA's persistent cache holds it: the bytes it just wrote (no
            # second serialization before the program's first call can run it), or those
            # it answered with (reloaded, it would serialize without its kernels).
            cached = held[0] if len(held) == 1 else None
            if store is not None and (cached is not None or not record.cache_hits):
                program.install(store.save(name, program, args, kwargs, compiled, cached))
            elif isinstance(program, executables.Program):
                program.install((program.signature(args, kwargs), compiled))
        return record

    def _load(self, name, detail, program, entry, save, background=False) -> Compiled:
        """A stored program: deserialized here, counted as a compile answered by the
        cache; one that does not load is compiled (and stored again) instead."""
        start = time.perf_counter()
        if (loaded := entry.load()) is None:
            _, _, args, kwargs = save
            lowered = program.lower(*args, **kwargs)
            traced_s = time.perf_counter() - start
            return self._compile(name, detail, lowered, traced_s, save, background)
        program.install(loaded)
        seconds = time.perf_counter() - start
        record = Compiled(name, detail, 1, seconds, 1, seconds, stored=True, background=background)
        with self._lock:
            if not background:
                self.seconds += seconds
            self.programs.append(record)
        if self.write is not None:
            self.write(record.line)
        return record


class Gate:
    """When a build of `CompileLog.ahead_of_time` may start: `open()` starts it; `close()`
    (from `CompileLog.close`) drops it if it has not opened."""

    def __init__(self):
        self._event, self._opened = threading.Event(), False

    def open(self) -> None:
        if not self._event.is_set():
            self._opened = True
            self._event.set()

    def close(self) -> None:
        self._event.set()

    def wait(self) -> bool:
        """Blocks until open (True) or closed (False)."""
        self._event.wait()
        return self._opened


def _gated(gate: Gate, job, *args):
    """`job(*args)` once `gate` opens; cancelled if it is closed instead."""
    if not gate.wait():
        raise concurrent.futures.CancelledError("the run ended before this program was needed")
    return job(*args)


def _after(first: concurrent.futures.Future, job, *args):
    """`job(*args)` once `first` is done (whether it failed or not)."""
    concurrent.futures.wait([first])
    return job(*args)


def shaped(out_info, sharding):
    """A program's output shapes (`Lowered.out_info`) as ShapeDtypeStructs with the given
    (pinned) sharding: the inputs of the programs that read them."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type),
        out_info,
    )


def precompile_step(
    run,
    side_by_side: bool = True,
    background: bool = False,
    evaluate_first: bool = False,
    step: int = 0,
) -> None:
    """Compiles a `train.Run`'s sampler, reference and update before its first step, at
    the shapes of the batch that step will read, and evaluation's sampler programs when
    evaluation is scheduled (`CompileLog.ahead_of_time`: side by side, one by one, or in
    the background beside the first step, in the order the run needs them;
    evaluate_first: evaluation's come first, for a run that evaluates before its first
    step). The rollouts and log-probs are pinned to row sharding
    (`Sampler.row_sharding`), so the reference and the update can be compiled from the
    sampler's output shapes alone. Other prompt buckets compile when they first come.
    step: the first step to run. When its update does not read the reference's log-probs
    (`Run.reads_reference`: a fresh run whose reference is the initial policy), the
    reference is built after the update, in the background once that step is done (or
    the reference is first called: `Run.reference_gate`), so it does not share the
    cores with the first step's programs."""
    from jaxrl_llm import parallel, rl

    position = run.data_iter.state()
    batch = next(run.data_iter)
    run.data_iter.restore(position)
    params, rows = run.sampler_params(), run.row_sharding
    bucket = f"bucket {run.sampler.bucketed(batch.prompt_ids, batch.prompt_mask)[0].shape[1]}"
    store = run.executable_store()
    with run.compile_log.ahead_of_time(side_by_side, store, background) as build:
        if run.eval_batches and evaluate_first:
            _evaluation(run, build, params)
        program, args, kwargs = run.sampler.sample_program(
            params, batch.prompt_ids, batch.prompt_mask, run.spec
        )
        out, ref = shaped(build("sampler", bucket, program, *args, **kwargs), rows), None
        later = background and run.ref_logprobs is not None and not run.reads_reference(step)
        if run.ref_logprobs is not None:  # later: the update's input of that shape, unread
            ref = out.logprobs if later else shaped(build("reference", bucket,
                run.ref_logprobs, run.ref_params, out), rows)  # fmt: skip
        local_rows = out.tokens.shape[0] // jax.process_count()
        rewards = parallel.shard_local_batch(np.zeros(local_rows, np.float32), run.mesh)
        rollouts = rl.RolloutBatch.from_sample(out, rewards, ref)
        program, args = run.update.program(run.state, rollouts)
        build("update", bucket, program, *args)
        if later:
            build("reference", bucket, run.ref_logprobs, run.ref_params, out,
                  gate=run.reference_gate)  # fmt: skip
        if run.eval_batches and not evaluate_first:
            _evaluation(run, build, params)


def _evaluation(run, build, params) -> None:
    """Evaluation's sampler programs (greedy, pass@k) at its first batch's bucket."""
    from jaxrl_llm import evaluation

    e, first = run.config.eval, run.eval_batches[0]
    ids, mask = first.prompt_ids, first.prompt_mask
    bucket = f"bucket {run.sampler.bucketed(ids, mask)[0].shape[1]}"
    for spec in filter(None, evaluation.specs(run.spec, e.pass_k, e.temperature)):
        what = "greedy" if spec.temperature == 0 else f"pass@{spec.num_generations}"
        program, args, kwargs = run.sampler.sample_program(params, ids, mask, spec)
        build(f"evaluation sampler, {what}", bucket, program, *args, **kwargs)

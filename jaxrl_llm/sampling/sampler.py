"""The rollout sampler: a class that owns its compiled programs, trace counts and settings.

    sampler = Sampler(model_cfg, mesh, seed=0, pad_id=pad)
    out = sampler.sample(params, prompt_ids, prompt_mask, spec, step)     # one program
    # or, resumable (multi-turn: a tool's output appended between turns):
    state = sampler.start(params, prompt_ids, prompt_mask, spec, step)
    state = sampler.decode(params, state, max_new_tokens=32, stop_ids=(tool_end,))
    state = sampler.append(params, state, tool_ids, tool_mask)
    state = sampler.decode(params, state)
    out = sampler.result(state)

Prompts come as `data` produces them: left-padded host arrays [B, W]. They are cut (or
left-padded) to a bucket length (16, 24, 32, 48, 64, ... by default: `bucket_length`), so
a run compiles a bounded number of programs. The parameters are read in whatever sharding
they have (the training sharding); the batch, the KV cache and the outputs are sharded
over ('data', 'fsdp'). Randomness: the key is fold_in(key(seed), step), both given per
call (the trainer passes its step, so a resumed run draws the same samples; a call without
`step` draws as step 0, without `seed` with the sampler's). The sampler keeps no random
state: the same call draws the same samples whatever came before it, and the seed is an
argument of the compiled programs, so another seed compiles nothing. The device programs
are in `decode.py`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling import decode as D
from jaxrl_llm.sampling.spec import RolloutSpec

MIN_BUCKET = 16
CACHE_SEGMENTS = 4  # default decode segments (`decode.cache_lengths`)
BUCKET_STEPS = (1, 2, 4, 8)


def bucket_length(n: int, steps: int = 2) -> int:
    """Prompt length rounded up to the next bucket, at least MIN_BUCKET.

    `steps` buckets per doubling: 1 = powers of two (16, 32, 64, ...); 2 (the default) adds
    1.5x each power of two (16, 24, 32, 48, 64, ...); 4 adds 1.25x, 1.5x, 1.75x (16, 20,
    24, 28, 32, 40, ...); 8 eighths. Padding is at most 100% / steps of the prompt, for
    `steps` times as many possible programs (still logarithmic in the longest prompt). The
    padding is paid again by the reference forward and the update, which read the padded
    prompt; a run whose prompt lengths vary little can take more steps for less padding.
    """
    if steps not in BUCKET_STEPS:
        raise ValueError(f"bucket steps={steps!r}: expected one of {BUCKET_STEPS}")
    n = max(n, 1)
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    lower = 1 << (n - 1).bit_length() - 1  # the largest power of two < n (>= MIN_BUCKET)
    step = lower // steps
    return lower + -(-(n - lower) // step) * step


def append_end(need: int, limit: int) -> int:
    """The bound on cache slots a multi-turn loop gives `Sampler.append` for `need` slots:
    rounded up to a bucket (`bucket_length`, 4 per doubling), or `need` where the bucket
    would pass `limit` (what the next turn leaves of the model's context). Each distinct
    bound is a program shape for the appends and decodes after it (for a 30-layer model,
    seconds to compile and memory held for the run); bucketed, the turns' varying
    observation widths meet a few of them. The slots past the observations stay holes
    (invalid, never attended, but read by every later step's attention: at most a quarter
    more slots than the bound needs)."""
    end = bucket_length(need, 4)
    return end if end <= limit else need


class Sampler:
    """Jitted prefill / decode / append programs of one model on one mesh.

    Args:
      model_cfg: the `models.ModelConfig`.
      mesh: the device mesh (None: one device).
      seed: the default sampling seed (a call's `seed=` overrides it); the key of a call
        is fold_in(key(seed), step).
      pad_id: the padding token of prompts and completions.
      bucket_steps: prompt-length buckets per doubling (`bucket_length`).
      cache_segments: decode loops over a growing KV cache (`decode.cache_lengths`).

    `traces` counts the programs this sampler compiled, by (program, prompt shape), and
    for `decode` and `append` the state's bound on cache slots they start from.
    """

    # `sample` returns once its one program is dispatched: a rollout sampled ahead
    # (rollout.mode='overlap', `rollout.sources.SampledAhead`) runs while the host goes on.
    dispatches_ahead = True
    # A batch's rows draw together (one key a token for the batch): a part of a batch
    # decoded alone draws other tokens unless greedy (`engine.StaticTurns`' first_row).
    row_keys = False
    # Its programs take a batch's rows from every process, each giving its own share
    # (`parallel.shard_local_batch`): a worker of several processes splits a batch.
    splits_processes = True

    @property
    def prompt_multiple(self) -> int:
        """What a prompt batch's size must be a multiple of (the mesh's data x fsdp)."""
        return mesh_lib.batch_size_multiple(self.mesh)

    def __init__(
        self,
        model_cfg,
        mesh=None,
        *,
        seed: int = 0,
        pad_id: int = 0,
        bucket_steps: int = 2,
        cache_segments: int = CACHE_SEGMENTS,
    ):
        if bucket_steps not in BUCKET_STEPS:
            raise ValueError(f"bucket_steps={bucket_steps!r}: expected one of {BUCKET_STEPS}")
        if not isinstance(cache_segments, int) or cache_segments < 1:
            raise ValueError(f"cache_segments={cache_segments}: must be >= 1 (1 = one loop)")
        self.cfg, self.mesh = model_cfg, mesh
        self.seed, self.pad_id = int(seed), int(pad_id)
        self.bucket_steps, self.cache_segments = bucket_steps, cache_segments
        self.traces: collections.Counter = collections.Counter()
        self._start = jax.jit(self._start_program, static_argnames="spec")
        # The rollouts come out sharded by rows, pinned: the programs that read them (the
        # reference, the update) can then be compiled before the first rollout exists.
        rows = {} if mesh is None else {"out_shardings": self.row_sharding}
        self._sample = jax.jit(self._sample_program, static_argnames="spec", **rows)
        self._decode = jax.jit(self._decode_program, static_argnums=(2, 3), donate_argnums=1)
        self._append = jax.jit(self._append_program, static_argnums=4, donate_argnums=1)
        self._result = jax.jit(functools.partial(D.result, pad_id=self.pad_id))
        self._refresh = jax.jit(self._refresh_program, donate_argnums=1)
        self._stop = jax.jit(
            lambda state, rows: state.replace(done=state.done | rows), donate_argnums=0
        )

    # ------------------------------------------------------------------ public programs
    def sample(
        self,
        params,
        prompt_ids,
        prompt_mask,
        spec: RolloutSpec,
        step: int | None = None,
        *,
        version: int = 0,
        seed: int | None = None,
    ) -> D.SampleOutput:
        """start + decode(spec.max_new_tokens) + result, as ONE program (the single-turn
        rollout: the KV cache never leaves it). step / seed: the random key's (None: step 0,
        the sampler's seed). version: the parameters' version, recorded per row as
        `policy_version`."""
        ids, mask, seed_index = self._inputs(prompt_ids, prompt_mask, spec, step, version, seed)
        return self._sample(params, ids, mask, seed_index, spec=spec)

    def lower(self, params, prompt_ids, prompt_mask, spec: RolloutSpec, step: int = 0):
        """`jax.jit(...).lower` of `sample` for these prompts' bucket (ahead-of-time
        compilation: the compiled program serves `sample` calls of the same shapes)."""
        program, args, kwargs = self.sample_program(params, prompt_ids, prompt_mask, spec, step)
        return program.lower(*args, **kwargs)

    def sample_program(
        self,
        params,
        prompt_ids,
        prompt_mask,
        spec: RolloutSpec,
        step: int = 0,
        *,
        seed: int | None = None,
    ):
        """`sample`'s jitted program and the arguments a call with these prompts gives it:
        what start-up lowers and compiles ahead of the first call."""
        ids, mask, seed_index = self._inputs(prompt_ids, prompt_mask, spec, step, 0, seed)
        return self._sample, (params, ids, mask, seed_index), {"spec": spec}

    def device_programs(self, params, prompt_ids, prompt_mask, spec: RolloutSpec) -> list:
        """[(name, jitted program, args, kwargs)] a rollout of these prompts runs, for
        compiling ahead of a run (`jaxrl_llm.tpu.compile_for`): the one `sample` program."""
        return [("sampler", *self.sample_program(params, prompt_ids, prompt_mask, spec))]

    @property
    def row_sharding(self):
        """The sharding of `sample`'s outputs: rows over ('data', 'fsdp') (None: no mesh)."""
        return None if self.mesh is None else NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))

    def start(
        self,
        params,
        prompt_ids,
        prompt_mask,
        spec: RolloutSpec,
        step: int | None = None,
        *,
        version: int = 0,
        seed: int | None = None,
    ) -> D.DecodeState:
        """Prefills B prompts once for their G rows -> a `DecodeState` (nothing drawn yet).
        step / seed / version: as in `sample`."""
        ids, mask, seed_index = self._inputs(prompt_ids, prompt_mask, spec, step, version, seed)
        return self._start(params, ids, mask, seed_index, spec=spec)

    def decode(
        self, params, state: D.DecodeState, max_new_tokens: int | None = None, stop_ids=None
    ) -> D.DecodeState:
        """Draws until every row has stopped or drawn `max_new_tokens` (default the spec's)
        in this call; `stop_ids` (default the spec's) end a row. The state is donated."""
        budget = int(max_new_tokens or state.spec.max_new_tokens)
        stops = state.spec.stop_ids if stop_ids is None else tuple(int(s) for s in stop_ids)
        self._check_stops(stops)
        self._check_length(state.end + budget, "decode")
        with _growing():
            return self._decode(params, state, budget, stops)

    def append(
        self, params, state: D.DecodeState, token_ids, token_mask, end: int | None = None
    ) -> D.DecodeState:
        """Extends each row's cache with token_ids [N, A] where token_mask [N, A] (each row's
        real tokens, e.g. a tool's output; not sampled: loss mask 0). The state is donated.
        Host arrays are put on the mesh like the rows; with several processes each gives
        its own rows, as with the prompts. end: the state's new bound on cache slots
        (default state.end + A; more leaves holes, see `append_end`)."""
        token_ids, token_mask = np.asarray(token_ids), np.asarray(token_mask, bool)
        n = state.tokens.shape[0] // (
            jax.process_count() if self.multi_process() else 1
        )  # own rows
        if token_ids.shape != token_mask.shape or token_ids.shape[0] != n:
            raise ValueError(
                f"append: token_ids {token_ids.shape} and token_mask {token_mask.shape} "
                f"must both be [{n}, A]"
            )
        self._check_ids(token_ids[token_mask], "append: token_ids")
        need = state.end + token_ids.shape[1]
        end = need if end is None else int(end)
        if end < need:
            raise ValueError(f"append: end {end} < {need} (the state's slots + the tokens)")
        self._check_length(end, "append")
        ids, mask = self._put((token_ids.astype(np.int32), token_mask))
        with _growing():
            return self._append(params, state, ids, mask, end)

    def refresh(self, params, state: D.DecodeState) -> D.DecodeState:
        """The state's KV cache recomputed by `params` over everything so far, so that
        later `decode` calls with `params` draw what those parameters would (a partial
        rollout switching to newer parameters mid-generation). The tokens drawn so far keep
        their log-probs. The state is donated."""
        with _growing():
            return self._refresh(params, state)

    def stop(self, state: D.DecodeState, rows) -> D.DecodeState:
        """Marks rows (host bool [N], own rows as in `append`) as stopped: later `decode`
        calls draw nothing for them (a multi-turn trajectory that ended while its row still
        had budget); an `append` to such a row makes it live again. The state is donated."""
        rows = np.asarray(rows, bool)
        n = state.done.shape[0] // (jax.process_count() if self.multi_process() else 1)
        if rows.shape != (n,):
            raise ValueError(f"stop: rows {rows.shape} must be [{n}]")
        (rows,) = self._put((rows,))
        return self._stop(state, rows)

    def result(self, state: D.DecodeState) -> D.SampleOutput:
        """The rollouts of a state (it is not consumed)."""
        return self._result(state)

    # ----------------------------------------------------------------- device programs
    def _start_program(self, params, ids, mask, seed_index, *, spec):
        self.traces["start", ids.shape] += 1
        return D.start(
            self.cfg,
            params,
            ids,
            mask,
            seed_index,
            spec,
            self.pad_id,
            self.cache_segments,
            self.mesh,
        )

    def _decode_program(self, params, state, budget, stops):
        self.traces["decode", state.prompt_tokens.shape, state.end] += 1
        return D.decode(
            self.cfg, params, state, budget, stops, self.pad_id, self.cache_segments, self.mesh
        )

    def _append_program(self, params, state, ids, mask, end):
        self.traces["append", state.prompt_tokens.shape, state.end] += 1
        return D.append(self.cfg, params, state, ids, mask, self.pad_id, self.mesh, end)

    def _refresh_program(self, params, state):
        self.traces["refresh", state.prompt_tokens.shape] += 1
        return D.refresh(self.cfg, params, state, self.mesh)

    def _sample_program(self, params, ids, mask, seed_index, *, spec):
        self.traces["sample", ids.shape] += 1
        state = D.start(
            self.cfg,
            params,
            ids,
            mask,
            seed_index,
            spec,
            self.pad_id,
            self.cache_segments,
            self.mesh,
        )
        state = D.decode(
            self.cfg,
            params,
            state,
            spec.max_new_tokens,
            spec.stop_ids,
            self.pad_id,
            self.cache_segments,
            self.mesh,
            final=True,
        )
        return D.result(state, self.pad_id)

    # ---------------------------------------------------------------------- host side
    def multi_process(self) -> bool:
        """Whether each process gives (and reads) only its own rows: a mesh over several."""
        return self.mesh is not None and jax.process_count() > 1

    def _put(self, arrays):
        """Host rows -> device arrays sharded over ('data', 'fsdp') (explicit transfers).
        Several processes: each gives its own rows; the result is the global batch."""
        put = mesh_lib.shard_local_batch if self.multi_process() else mesh_lib.shard_batch
        return put(arrays, self.mesh)

    def _inputs(self, prompt_ids, prompt_mask, spec, step, version, seed):
        """Prompts at their bucket width on the mesh, and seed_index (seed, step, version):
        a device array, not a static value, so any seed and step share one program."""
        self._check_stops(spec.stop_ids)
        if isinstance(prompt_ids, (jax.Array, jax.ShapeDtypeStruct)):  # placed (or abstract,
            # for compiling only): the caller chose the width
            ids, mask = prompt_ids, prompt_mask
            width = ids.shape[1]
        else:
            ids, mask = self.bucketed(prompt_ids, prompt_mask)
            width = ids.shape[1]
            rows, multiple = ids.shape[0], mesh_lib.batch_size_multiple(self.mesh)
            if not self.multi_process() and rows % multiple:
                raise ValueError(
                    f"prompt batch of {rows} rows is not divisible by the mesh's data x "
                    f"fsdp = {multiple}"
                )
            ids, mask = self._put((ids, mask))
        self._check_length(width + spec.max_new_tokens, "prompt bucket + max_new_tokens")
        seed = self.seed if seed is None else int(seed)
        seed_index = np.array([seed, 0 if step is None else int(step), version], np.uint32)
        replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        if isinstance(ids, jax.ShapeDtypeStruct):
            return ids, mask, jax.ShapeDtypeStruct((3,), np.uint32, sharding=replicated)
        return ids, mask, jax.device_put(seed_index, replicated)

    def bucketed(self, prompt_ids, prompt_mask) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded host prompts [B, W] -> [B, bucket] (leading padding columns cut or
        added). With several processes, all agree on the longest prompt's bucket."""
        ids = np.asarray(prompt_ids, np.int32)
        mask = np.asarray(prompt_mask, bool)
        if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[0] == 0:
            raise ValueError(f"prompts: ids {ids.shape} and mask {mask.shape}: expected [B, W]")
        lengths = mask.sum(axis=1)
        if not lengths.any():
            raise ValueError("prompts: no real token in any row")
        # Rows without any real token are allowed: dummy rows that make B divide the mesh.
        if (np.diff(mask.astype(np.int8), axis=1) < 0).any() or not mask[lengths > 0, -1].all():
            raise ValueError("prompts: expected left-padded rows (real tokens at the end)")
        self._check_ids(ids[mask], "prompts")
        bucket = bucket_length(int(lengths.max()), self.bucket_steps)
        if self.multi_process():
            bucket = mesh_lib.host_max(bucket)
        W = ids.shape[1]
        if W >= bucket:
            return ids[:, W - bucket :], mask[:, W - bucket :]
        pad = ((0, 0), (bucket - W, 0))
        return np.pad(ids, pad, constant_values=self.pad_id), np.pad(mask, pad)

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"{what}: token id outside [0, {self.cfg.vocab_size})")

    def _check_stops(self, stop_ids) -> None:
        for s in stop_ids:
            if not 0 <= s < self.cfg.vocab_size:
                raise ValueError(
                    f"stop_ids: {s} is outside the vocabulary [0, {self.cfg.vocab_size})"
                )

    def _check_length(self, length: int, what: str) -> None:
        limit = self.cfg.max_position_embeddings
        if length > limit:
            raise ValueError(
                f"{what} ({length} positions) exceeds the model's max_position_embeddings {limit}"
            )


@contextlib.contextmanager
def _growing():
    """A call that grows the KV cache or the completion buffers cannot reuse the donated
    arrays whose shape changes (it reuses the others); JAX warns at each such compile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield

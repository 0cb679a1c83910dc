"""Continuous batching over a paged KV cache: the `paged` rollout engine.

    engine = PagedSampler(model_cfg, mesh, seed=0, pad_id=pad, slots=32, pages=512)
    out = engine.sample(params, prompt_ids, prompt_mask, spec, step)   # a SampleOutput

The static `Sampler` decodes a dense batch: every row keeps its slot and its KV cache
reservation (prompt + max_new_tokens) until the slowest row of the batch stops, and each
of a prompt's G rows holds a copy of the prompt's keys and values. This engine instead:

- keeps keys/values in a pool of fixed-size pages per layer (`Pages`: [L, pages,
  page_size, K, H]); each sequence has a page table. Page 0 is the null page: writes of
  masked tokens go there and it is never read unmasked. A prompt is prefilled once (in
  chunks of `prefill_chunk` tokens, left-padded to a multiple of it, pages that hold only
  padding mapped to the null page) and its pages are shared, read-only, by its G rows:
  reference-counted, returned when the last of them ends. A row's own tokens go to pages
  taken as it grows (before each decode chunk, for that chunk's steps) and returned when
  it ends. A waiting row is admitted only when the pool keeps, besides its prefill and
  first chunk, the pages the rows already in need for their next chunk.
- keeps a hybrid model's (Qwen3.5's) Gated DeltaNet state, which does not grow with the
  sequence, in state rows beside the pages (`Pages.state`; one per prompt held, its G
  rows starting from it, and one per slot; `state_bytes` per sequence): the pages then
  hold the full-attention layers only.
- decodes `slots` sequences at once in a `lax.while_loop` of `chunk_steps` steps on
  device; between chunks the host returns the pages of finished rows, gives their slots
  to the next waiting rows (prefilling their prompts chunk by chunk, those admitted
  together in one batched program) and takes pages for
  the next chunk. When the pool runs short, the youngest rows are preempted: their pages
  are returned and they wait again; a preempted row comes back with its prompt and tokens
  so far prefilled (recompute) and draws on with the same keys.

Attention: inside each layer the new tokens' keys/values are written to that layer's
pages and the queries attend to the layer's pages of each row through its table
(`models.paged_forward`, `models/paged_attention.py`), in the model's own layer code, so
every architecture the model supports runs here; `attention="gather"` keeps the
portable reference (every layer's pages gathered into a dense block,
`models.forward_after_prefix` over it). On TPU (`attention="auto"`, `uses_pallas`) the
pool is laid out for JAX's Pallas paged-attention kernel and decode steps run it
(`models/paged_kernel.py`); prefill reads the same pool through the portable path.
Randomness: row n's t-th draw uses fold_in(fold_in(fold_in(key(seed), step), n), t),
independent of which slot, chunk or neighbours it had; greedy (temperature 0) draws the
static sampler's tokens. Log-probs are the static sampler's: log softmax(logits /
temperature) of the drawn token.

Results come back in request order as a `SampleOutput` (tokens, masks, log-probs, lengths,
finish reasons, prompts at their bucket width, policy version), rows on the mesh like the
static sampler's. A row whose prompt has no real token (a dummy row that makes the batch
divide the mesh) draws nothing (length 0). `sample` and `stream` are single-turn
(`paged_schedule.Session`: the requests' rows on a `paged_turns.TurnSession` whose rows
end at their first turn); the multi-turn rows of environment rollouts are a
`TurnSession`'s own (a row parks between turns, keeping its pages; `envs.play`); all on
one process. The session's `paged_pool.Pool` is a record of pages and slots changed by
plain functions; `stream` keeps one session across training steps
(the overlap / split rollout source). The device programs this class jits (the pool,
`forward_paged`, `decode_chunk`, `prefill_chunk`) are `paged_programs`'s. The
engine's small state (slots, page pool) is replicated over the mesh; the parameters are
read in their own sharding.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import models
from jaxrl_llm.models import gated_deltanet
from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.parallel import target
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.paged_programs import (
    ATTENTION,
    Pages,
    Slots,
    ahead_of_time,
    decode_chunk,
    init_pages,
    prefill_chunk,
    row_bucket,
    table_width,
    uses_pallas,
)
from jaxrl_llm.sampling.paged_schedule import Session
from jaxrl_llm.sampling.sampler import Sampler
from jaxrl_llm.sampling.spec import RolloutSpec


class PagedSampler:
    """A continuous-batching engine with `Sampler.sample`'s interface (single-turn; its
    multi-turn sessions are `paged_turns.TurnSession`).

    Args:
      model_cfg, mesh, seed, pad_id, bucket_steps: as `Sampler` (prompts come out at
        their bucket width, as the static sampler gives them).
      slots: sequences decoded at once (0: the request's rows, B * G).
      pages: KV pages in the pool, the null page included (0: as many tokens as the
        static sampler's cache for the request, B * G * (bucket + max_new_tokens)).
      page_size: tokens per page.
      chunk_steps: decode steps per device loop between host checks.
      prefill_chunk: prompt tokens per prefill program (a multiple of page_size).
      attention: "pages": each layer reads its pages in place (`forward_paged`'s impl);
        "gather": the portable reference, every layer's pages gathered first; "pallas":
        "pages" with the pool in the Pallas TPU kernel's layout, decode steps run the
        kernel (off TPU in interpret mode: tests); "auto": "pallas" where `uses_pallas`
        says so (TPU, no sliding window, a bfloat16 model), else "pages".

    `traces` counts compiled programs; `stats` holds the last call's counters (decode
    chunks, prefills, preemptions, peak pages in use).

    What the sessions (`paged_pool`, `paged_schedule`, `paged_turns`) call: `prefill` and
    `decode` (the jitted programs), `decode_slots`, `weights`, `pool`, `put`.
    """

    # The host schedules between decode chunks until a rollout is done: one sampled
    # ahead needs a thread to run beside the step (`rollout.thread`).
    dispatches_ahead = False
    # Each row draws with its own key (the module docstring): a batch's rows split over
    # sessions (`engine.PagedTurns`' first_row) draw what they draw together.
    row_keys = True
    prompt_multiple = 1  # prompts take slots one at a time
    # Its host state and inputs are replicated: in a worker of several processes each
    # process runs the whole batch, its scheduling the same on each (the same requests in
    # the same order), and the device programs span every process's devices.
    splits_processes = False

    def __init__(
        self,
        model_cfg,
        mesh=None,
        *,
        seed=0,
        pad_id=0,
        bucket_steps=2,
        slots=0,
        pages=0,
        page_size=16,
        chunk_steps=16,
        prefill_chunk=32,
        attention="auto",
    ):
        if page_size < 1 or prefill_chunk % page_size:
            raise ValueError(
                f"prefill_chunk={prefill_chunk}: must be a multiple of page_size={page_size}"
            )
        if chunk_steps < 1 or slots < 0 or pages < 0:
            raise ValueError("chunk_steps must be >= 1, slots and pages >= 0")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
        if attention == "pallas" and model_cfg.windowed:
            raise ValueError("attention='pallas': the kernel has no sliding window")
        if attention == "gather" and model_cfg.hybrid:
            raise ValueError(
                "attention='gather': its prefix is keys/values, not a hybrid model's "
                "recurrent state; use 'pages'"
            )
        self.attention = attention
        self.impl = "gather" if attention == "gather" else "pages"  # `forward_paged`'s
        self.cfg, self.mesh = model_cfg, mesh
        self.seed, self.pad_id = int(seed), int(pad_id)
        self.slots, self.pages, self.page_size = slots, pages, page_size
        self.chunk_steps, self.prefill_chunk = chunk_steps, prefill_chunk
        # Bucketing, id checks and the rows' sharding are the static sampler's.
        self.static = Sampler(model_cfg, mesh, seed=seed, pad_id=pad_id, bucket_steps=bucket_steps)
        self.traces: collections.Counter = collections.Counter()
        self.stats: dict = {}
        self.decode = jax.jit(
            self._decode_program, static_argnames=("steps", "spec"), donate_argnums=(1, 2)
        )
        self.prefill = jax.jit(self._prefill_program, donate_argnums=(1, 2))
        self._slice = jax.jit(models.layer_params)
        # The pool is made on device (zeros from the host would be an implicit transfer).
        where = None if mesh is None else NamedSharding(mesh, P())
        self._init_pool = jax.jit(init_pages, static_argnums=range(6), out_shardings=where)

    # ----------------------------------------------------------- Sampler's interface
    def device_programs(self, params, prompt_ids, prompt_mask, spec) -> list:
        """[(name, jitted program, args, kwargs)] a rollout of these prompts runs, with
        abstract arguments, for compiling ahead of a run (`jaxrl_llm.tpu.compile_for`):
        `sample_program` (the output's shapes), the decode chunk and the prefill chunk
        (`paged_programs.ahead_of_time`)."""
        (prompts, width), rows = prompt_ids.shape, prompt_ids.shape[0] * spec.num_generations
        own = ahead_of_time(self, params, rows, prompts, width, spec)
        return [("sampler", *self.sample_program(params, prompt_ids, prompt_mask, spec))] + own

    @property
    def row_sharding(self):
        return self.static.row_sharding

    def bucketed(self, prompt_ids, prompt_mask):
        return self.static.bucketed(prompt_ids, prompt_mask)

    def sample_program(self, params, prompt_ids, prompt_mask, spec, step=0, *, seed=None):
        """A program of `sample`'s output shapes (start-up compiles what reads the rollout
        ahead from it; the engine's own programs compile at its first call)."""
        ids = prompt_ids  # abstract prompts (compiling ahead) are at their bucket already
        if not isinstance(ids, jax.ShapeDtypeStruct):
            ids, _ = self.bucketed(prompt_ids, prompt_mask)
        N, width, T = ids.shape[0] * spec.num_generations, ids.shape[1], spec.max_new_tokens
        G = spec.num_generations
        rows = {} if self.mesh is None else {"out_shardings": self.row_sharding}

        def shapes():
            z = lambda shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
            cfg = self.cfg
            routes = None
            if cfg.moe:
                shape = (N, width + T, cfg.num_layers, cfg.num_experts_per_tok)
                routes = z(shape, models.ROUTE_DTYPE)
            return SampleOutput(
                tokens=z((N, T), jnp.int32),
                mask=z((N, T), bool),
                loss_mask=z((N, T), bool),
                logprobs=z((N, T), jnp.float32),
                lengths=z((N,), jnp.int32),
                finish=z((N,), jnp.int32),
                prompt_tokens=z((N, width), jnp.int32),
                prompt_mask=z((N, width), bool),
                policy_version=z((N,), jnp.int32),
                num_generations=G,
                routes=routes,
            )

        return jax.jit(shapes, **rows), (), {}

    def sample(
        self,
        params,
        prompt_ids,
        prompt_mask,
        spec: RolloutSpec,
        step=None,
        *,
        version=0,
        seed=None,
        budgets=None,
    ) -> SampleOutput:
        """G completions of each prompt (prompt-major rows, as `Sampler.sample`).
        budgets: optional per-row max_new_tokens [B * G] (each <= spec.max_new_tokens)."""
        ids, mask = self.bucketed(prompt_ids, prompt_mask)
        limit = self.cfg.max_position_embeddings
        if ids.shape[1] + spec.max_new_tokens > limit:
            raise ValueError(
                f"prompt bucket + max_new_tokens ({ids.shape[1] + spec.max_new_tokens}) "
                f"exceeds the model's max_position_embeddings {limit}"
            )
        for s in spec.stop_ids:
            if not 0 <= s < self.cfg.vocab_size:
                raise ValueError(f"stop_ids: {s} is outside the vocabulary")
        B, width = ids.shape
        G, T = spec.num_generations, spec.max_new_tokens
        N = B * G
        budgets = np.full(N, T, np.int64) if budgets is None else np.asarray(budgets, np.int64)
        if budgets.shape != (N,) or budgets.min() < 1 or budgets.max() > T:
            raise ValueError(f"budgets: expected [{N}] values in [1, {T}]")
        run = self.stream(
            params,
            version,
            spec,
            width=width,
            rows=N,
            prompts=B,
            seed=seed,
            step=0 if step is None else int(step),
        )
        run.submit(0, ids, mask, budgets)
        while run.busy:
            run.run_chunk()
        self.stats = run.stats
        return run.output(0)[0]

    def stream(
        self,
        params,
        version: int,
        spec: RolloutSpec,
        *,
        width: int,
        rows: int,
        prompts: int = 0,
        seed=None,
        step: int = 0,
    ) -> Session:
        """A `paged_schedule.Session` over this engine's settings, sized for requests of
        `rows` rows over `prompts` prompts (0: rows) of bucket `width` (slots 0: `rows`
        slots; pages 0: the static sampler's cache for them); kept across training steps
        by a streaming rollout source, which submits step s's bucketed prompts with
        key_base s * rows (rows of step 0 draw the keys `sample(..., step=0)` gives them).
        (seed, step) go to the device as numbers and the keys are made there: a key built
        on the host would be an implicit transfer (refused under the trainer's guard)."""
        seed = self.seed if seed is None else int(seed)
        slots = self.slots or rows
        pages = self.pages or self.auto_pages(rows, width + spec.max_new_tokens)
        return Session(
            self,
            params,
            version,
            spec,
            slots=slots,
            pages=pages,
            seed=seed,
            step=step,
            prompt_rows=min(prompts or rows, slots + 1),
        )

    def auto_pages(self, rows: int, tokens: int) -> int:
        """The pool of `rollout.paged.pages=0` for `rows` sequences of `tokens` tokens:
        the pages they fill, at least one whole sequence as a session lays it out (its
        tokens rounded up to prefill chunks, plus one chunk: `paged_pool.fit`), and the
        null page."""
        C, PS = self.prefill_chunk, self.page_size
        one = -(-(-(-tokens // C) * C + C) // PS)
        return 1 + max(-(-rows * tokens // PS), one)

    def pool(
        self, cfg, pages: int, page_size: int, dtype, *, shapes: bool = False, state_rows: int = 0
    ) -> Pages:
        """A zero page pool, in the Pallas kernel's layout where `uses_pallas` says so,
        with `state_rows` recurrent-state rows for a hybrid model; shapes=True: its
        `jax.ShapeDtypeStruct`s only (nothing allocated)."""
        pallas = uses_pallas(cfg, self.attention, dtype, target.backend(), page_size)
        make = self._init_pool.eval_shape if shapes else self._init_pool
        return make(cfg, pages, page_size, dtype, pallas, state_rows if cfg.hybrid else 0)

    def state_bytes(self, dtype) -> int:
        """Bytes of one sequence's recurrent state (every DeltaNet layer's convolution
        inputs and float32 recurrence; 0 for a model without one): a hybrid model's
        memory per sequence besides its pages, fixed however long the sequence grows."""
        return gated_deltanet.state_bytes(self.cfg, dtype) if self.cfg.hybrid else 0

    # ----------------------------------------------------------------- device programs
    def weights(self, params) -> tuple:
        """The parameters as the engine's programs take them: (params, each unrolled
        layer's parameters sliced out, or None for a scanned model). A program that
        slices the layers itself copies every layer's weights at each call, a cost of
        about two decode steps per chunk and per prefill on CPU; sliced here, once per
        session and parameter version, the copy is held while the session decodes (the
        static sampler makes the same copy inside its one decode program)."""
        if self.cfg.scan_layers:
            return params, None
        return params, self._slice({"layers": params["layers"]})

    def _decode_program(
        self, weights, pages, slots, prompt_logits, seed_step, stops, *, steps, spec
    ):
        self.traces["decode", slots.tokens.shape, pages.k.shape] += 1
        key = jax.random.fold_in(jax.random.key(seed_step[0]), seed_step[1])
        params, layers = weights
        with self._kernel_mesh():
            return decode_chunk(
                self.cfg,
                params,
                pages,
                slots,
                prompt_logits,
                key,
                stops,
                steps,
                spec,
                self.impl,
                layers,
            )

    def _kernel_mesh(self):
        """The context of a program's trace: on a TPU mesh of several chips, the mesh set,
        so that the Pallas kernels run per device (`models.paged_kernel`)."""
        if self.mesh is None or self.mesh.size == 1 or target.backend() != "tpu":
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    def _prefill_program(
        self, weights, pages, prompt_logits, index, tokens, mask, table, start, length, states
    ):
        self.traces["prefill", tokens.shape, pages.k.shape] += 1
        params, layers = weights
        with self._kernel_mesh():
            return prefill_chunk(
                self.cfg,
                params,
                pages,
                prompt_logits,
                index,
                tokens,
                mask,
                table,
                start,
                length,
                self.impl,
                layers,
                states,
            )

    def decode_slots(
        self, weights, pages, host: dict, occupied, held: int, prompt_logits, seed_step, stops, spec
    ):
        """One decode chunk of the occupied slots -> (pages, host arrays after it).

        weights: `weights(params)`.
        host: the slots' host arrays (`Slots`' fields, [S, ...] each); occupied: the slots
        that hold a row; held: the most pages any of them holds. The program runs over the
        occupied slots only, padded with empty ones to a few sizes (`row_bucket`), and
        over the page table cut to `held` pages rounded up (`table_width`): a step's work
        follows the rows still running and their lengths, not the slots' count or the
        longest possible sequence, with few compiled shapes. The other slots' host arrays
        are left as they are."""
        S, M = host["table"].shape
        occupied = sorted(occupied)
        rows = row_bucket(len(occupied), S)
        taken = set(occupied)
        spare = [s for s in range(S) if s not in taken][: rows - len(occupied)]
        pick = np.asarray(occupied + spare, np.int64)
        width = table_width(held, M)
        names = [f.name for f in dataclasses.fields(Slots) if f.name in host]
        cut = {k: host[k][pick] for k in names}
        cut["table"] = cut["table"][:, :width]
        pages, slots = self.decode(
            weights,
            pages,
            self.put(Slots(**cut)),
            prompt_logits,
            seed_step,
            stops,
            steps=self.chunk_steps,
            spec=spec,
        )
        got = jax.device_get(slots)
        out = {k: np.array(host[k]) for k in names}
        for k in names:
            if k != "table":
                out[k][pick] = np.asarray(getattr(got, k))
        return pages, out

    def put(self, tree):
        """Host arrays -> device, replicated over the mesh (the engine's state is small
        next to the parameters; the pages stay where the programs put them)."""
        where = None if self.mesh is None else NamedSharding(self.mesh, P())
        return mesh_lib.put(tree, where)

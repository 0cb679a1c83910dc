"""The page pool and decode slots the paged engine's sessions share: `PagePool` holds the
KV pages (a free list, page 0 the null page), the page-table columns, the prompts' shared
pages and first-draw logits rows, the slots' host arrays, and the prefill queue; it runs
the queued prefills and one decode chunk of the occupied slots.

What fills the slots is its subclasses': `paged_schedule.Session` (single-turn requests,
streamed across training steps) and `paged_turns.TurnSession` (multi-turn rows that park
on their environments). A subclass admits rows (`_admit`), gives them pages as they grow
(`_grow`) and collects what they drew (`run_chunk`).
"""

from __future__ import annotations

import collections
import contextlib
import math

import jax
import numpy as np

from jaxrl_llm import errors

NULL_PAGE = 0  # writes of masked tokens go here; never read unmasked
PREFILL_BATCH = 8  # sequences prefilled by one program (batches of 1, 2, 4 or 8)


class PagePool:
    """A page pool, decode slots and their host state over one engine.

    Args:
      engine: the `PagedSampler` whose programs run the chunks and prefills.
      params, version: the parameters decoding starts with, and their version.
      spec: the `RolloutSpec` every row samples with.
      seed_step: (seed, salt) on device, uint32 [2] (the keys' base).
      slots: sequences decoded at once.
      pages: KV pages in the pool, the null page included.
      prompt_rows: prompts whose first-draw logits are held at once (a slot whose prompt
        has no free row waits).
    """

    def __init__(self, engine, params, version: int, spec, *, seed_step, slots: int,
                 pages: int, prompt_rows: int):  # fmt: skip
        e = engine
        self.e, self.version, self.spec = e, int(version), spec
        self.weights = e.weights(params)  # the programs' parameters (`PagedSampler.weights`)
        self.seed_step = seed_step
        self.T, self.C, self.PS, self.S = spec.max_new_tokens, e.prefill_chunk, e.page_size, slots
        self.total = pages
        self.M = 1  # page-table columns (grows with the widest request)
        self.free = list(range(pages - 1, 0, -1))  # page 0: the null page
        self.prompt_pages: dict = {}  # (request, b) -> [pages, padded, start, rows, logits row]
        self.logit_rows = list(range(prompt_rows - 1, -1, -1))
        self.scratch = prompt_rows  # prompt_logits row of a resumed row's prefill (not read)
        self.waiting: collections.deque = collections.deque()
        self.owner: list = [None] * slots  # slot -> its row (None: free)
        self.order: list = []  # occupied slots, oldest first
        self.stats = dict(decode_chunks=0, prefills=0, prefill_calls=0, preempted=0,
                          peak_pages=0, swaps=0)  # fmt: skip
        # Prefill jobs (`_run_prefills`): (sequence, lo, hi, offset, first, pages, logits
        # row, record or None)
        self.prefills: list = []
        T, S = self.T, slots
        z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        self.host = dict(
            table=z(S, 1), start=z(S), length=z(S), cap=z(S), last=z(S),
            fresh=z(S, dtype=bool), live=z(S, dtype=bool), stopped=z(S, dtype=bool), n=z(S),
            budget=z(S), row=z(S), prompt=z(S), tokens=z(S, T), logprobs=z(S, T, dtype=np.float32),
        )  # fmt: skip
        cfg = e.cfg
        if cfg.moe:  # each drawn token's experts (sampling/decode.py's routes)
            shape = (S, T, cfg.num_layers, cfg.num_experts_per_tok)
            self.host["routes"] = np.full(shape, -1, np.int16)
        dtype = params["embed"].dtype
        self.dtype = dtype
        with self.out_of_memory():
            # Blocked on: an allocation that fails is reported here, not by a later program.
            self.pages = jax.block_until_ready(e.pool(e.cfg, pages, self.PS, dtype))
        rows = np.zeros((prompt_rows + 1, e.cfg.vocab_size), np.float32)
        self.prompt_logits = e._put(rows)  # noqa: SLF001
        self.stops = e._put(np.asarray(spec.stop_ids or (-1,), np.int32))  # noqa: SLF001

    @contextlib.contextmanager
    def out_of_memory(self):
        """Device out of memory while the pool is allocated or a program over it runs:
        one line naming the pool's size and `rollout.paged.pages`, the setting that sizes
        it (the generic line would suggest the update's batch and remat)."""
        try:
            yield
        except Exception as err:
            if not errors.out_of_memory(err):
                raise
            raise errors.UserError(self._out_of_memory_line(err)) from err

    def _out_of_memory_line(self, err: BaseException) -> str:
        shapes = self.e.pool(self.e.cfg, self.total, self.PS, self.dtype, shapes=True)
        size = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        cause = str(err).strip().splitlines()[0][:200]
        pool = f"{self.total} pages of {self.PS} tokens, {size / 2**30:,.2f} GiB of KV cache"
        if self.e.pages:
            return (
                f"rollout.paged.pages={self.total}: device out of memory ({cause}) with a "
                f"page pool of {pool}; lower rollout.paged.pages (0 = automatic)"
            )
        return (
            f"rollout.paged.pages=0: device out of memory ({cause}) with the automatic page "
            f"pool of {pool}; set rollout.paged.pages below {self.total}, or lower "
            "rollout.batch_size or rollout.max_new_tokens (they size the automatic pool)"
        )

    def _fit(self, width: int) -> None:
        """Page-table columns for a prompt of `width` tokens and all it may draw (or, in
        a multi-turn session, its whole trajectory); ValueError when the pool cannot
        hold one such sequence."""
        longest = -(-(width + self.T) // self.C) * self.C + self.C
        M = -(-longest // self.PS)
        if self.total < M + 1:
            raise ValueError(
                f"pages={self.total}: the pool must hold one whole sequence ({M} pages of "
                f"{self.PS} tokens) besides the null page"
            )
        if M > self.M:
            self.host["table"] = np.pad(self.host["table"], ((0, 0), (0, M - self.M)))
            self.M = M

    # ------------------------------------------------------------------------ pages
    def _take(self, count: int) -> list:
        return [self.free.pop() for _ in range(count)]

    def _width(self, pages: int) -> int:
        """Page-table columns a program reads: a power of two >= pages, at most M."""
        return min(self.M, 1 << max(1, pages - 1).bit_length())

    def _in_use(self) -> int:
        return self.total - 1 - len(self.free)

    def _drop_prompt(self, key) -> None:
        entry = self.prompt_pages.pop(key)
        self.free.extend(p for p in entry[0] if p != NULL_PAGE)
        self.logit_rows.append(entry[4])

    def _prefill(self, tokens: np.ndarray, index: int, record=None) -> tuple[list, int, int] | None:
        """Takes pages for a sequence (real token ids) and queues its prefill (run by
        `_run_prefills`) -> (pages, padded length, start), or None when the pool lacks
        the pages. record: None, or a function given the routes of the sequence's real
        tokens [p, L, k] (MoE)."""
        C, PS = self.C, self.PS
        p = len(tokens)
        padded = -(-p // C) * C
        start = padded - p
        first = start // PS  # pages before it hold only padding: the null page
        count = padded // PS - first
        if count > len(self.free):
            return None
        pages = [NULL_PAGE] * first + self._take(count)
        seq = np.full(padded, self.e.pad_id, np.int32)
        seq[start:] = tokens
        self.prefills.append((seq, start, padded, 0, start, pages, index, record))
        self.stats["prefills"] += 1
        return pages, padded, start

    def _run_prefills(self) -> None:
        """The queued prefills, up to PREFILL_BATCH per program (the batch padded to a
        power of two with empty rows). A job (seq, lo, hi, offset, first, pages, row,
        record) writes seq's tokens [lo, hi) at cache slots offset + their index, in
        chunks of C aligned at the end: the k-th of K calls feeds each job its chunk
        k - (K - its chunks), or nothing before its first chunk with a real token, so
        every job's last chunk is in the last call and its logits row ends with the
        logits after its last token. first: the table's first valid slot; record (MoE),
        if any, is given the routes of tokens [lo, hi) [hi - lo, L, k]. A batch of one
        chunk each runs in the narrowest window (page_size times a power of two) that
        holds every job's tokens: a prompt shorter than a chunk, an observation of a few
        tokens appended (`TurnSession`)."""
        C, e = self.C, self.e
        jobs, self.prefills = self.prefills, []
        for at in range(0, len(jobs), PREFILL_BATCH):
            batch = jobs[at : at + PREFILL_BATCH]
            b = 1 << (len(batch) - 1).bit_length()
            chunks = [len(j[0]) // C for j in batch]
            K = max(chunks)
            table = np.zeros((b, self._width(max(len(j[5]) for j in batch))), np.int32)
            start = np.zeros(b, np.int32)
            index = np.full(b, self.scratch, np.int32)
            for i, (_, _, _, _, first, pages, row, _) in enumerate(batch):
                table[i, : len(pages)], start[i], index[i] = pages, first, row
            owns = []
            W = C  # tokens per call: one chunk's window that holds every job's tokens
            most = max(hi - lo for _, lo, hi, *_ in batch)
            while K == 1 and W // 2 % self.PS == 0 and W // 2 >= max(most, 1):
                W //= 2
            for k in range(K):
                tokens = np.full((b, W), e.pad_id, np.int32)
                mask = np.zeros((b, W), bool)
                length = np.zeros(b, np.int32)
                for i, (seq, lo, hi, offset, *_) in enumerate(batch):
                    c = k - (K - chunks[i])
                    if c < lo // C:
                        continue  # before its first chunk with a real token
                    at = min(lo, C - W) if W < C else c * C  # (W < C: one chunk, c = 0)
                    tokens[i] = seq[at : at + W]
                    where = np.arange(at, at + W)
                    mask[i] = (where >= lo) & (where < hi)
                    length[i] = offset + at
                with self.out_of_memory():
                    self.pages, self.prompt_logits, own = e._prefill(  # noqa: SLF001
                        self.weights, self.pages, self.prompt_logits,
                        *e._put((index, tokens, mask, table, start, length)),  # noqa: SLF001
                    )  # fmt: skip
                owns.append(own)
                self.stats["prefill_calls"] += 1
            if owns[0] is not None and any(j[7] is not None for j in batch):
                owns = jax.device_get(owns)  # K x [b, W, L, k]
                for i, (_, lo, hi, *_, record) in enumerate(batch):
                    if record is not None:  # its chunks, in the last chunks[i] calls
                        got = np.concatenate([o[i] for o in owns[K - chunks[i] :]], axis=0)
                        shift = min(lo, C - W)  # where the window starts (0: W == C)
                        record(got[lo - shift : hi - shift])

    def _pages_of(self, tokens: int) -> int:
        """Pages a prefill of `tokens` tokens takes (those of padding only are null)."""
        padded = -(-tokens // self.C) * self.C
        return padded // self.PS - (padded - tokens) // self.PS

    def _need(self, s: int) -> int:
        """Pages slot s lacks for its next chunk of steps."""
        h = self.host
        end = int(h["length"][s]) + int(h["budget"][s]) - int(h["n"][s])
        want = min(int(h["length"][s]) + self.e.chunk_steps, end)
        return max(0, -(-want // self.PS) - self.owner[s].held)

    def _decode_occupied(self) -> dict:
        """One decode chunk of the occupied slots -> the slots' host arrays after it. The
        program runs over those slots and the table cut to the most pages any of them
        holds (`PagedSampler.decode_slots`)."""
        held = max(self.owner[s].held for s in self.order)
        with self.out_of_memory():
            self.pages, self.host = self.e.decode_slots(
                self.weights, self.pages, self.host, self.order, held, self.prompt_logits,
                self.seed_step, self.stops, self.spec,
            )  # fmt: skip
        self.stats["decode_chunks"] += 1
        return self.host

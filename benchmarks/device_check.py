"""What this project does on one accelerator, in one command (under 8 minutes).

    python benchmarks/device_check.py --out=device_check.md              # one GPU / a TPU host
    python benchmarks/device_check.py --preset=tiny --out=/tmp/check.md  # CPU, seconds

Needs, besides this package's own dependencies: jax with the accelerator's plugin
(`jax[cuda12]` on an H100 / H200, `jax[tpu]` on a TPU VM), flax, optax, orbax-checkpoint,
transformers (for the tokenizer files) and numpy. It installs nothing and downloads
nothing: the model is a random one of Qwen2.5-0.5B's shapes (`--preset=0.5b`, bfloat16)
saved with the package's arithmetic tokenizer.

Sections, each a markdown table in --out (and printed):
1. The trainer's GRPO step (`train.Run.step`: sample, reference, score, update), phase by
   phase: seconds, sampler tokens/s, and the model FLOPs of the reference and the update
   over the matmul peak measured on this device (`startup.peak.measure_matmul_peak`), i.e.
   their MFU. The reference's seconds are the wait for it after scoring (what did not
   overlap), so its MFU is an upper bound. On a TPU, H100 or H200, each phase's roofline
   seconds beside it (`jaxrl_llm.tpu.roofline`: the chip's published peak and bandwidth).
2. Decode at batch 1 and 64 (the sampler, one prompt per row): seconds per token and the
   bytes a decode step must read (the weights + the mean KV cache) over that time, as a
   fraction of the memory bandwidth measured by a large on-device copy.
3. Attention at 4k and 16k tokens (Qwen2.5-0.5B's 14 query / 2 kv heads of 64, bfloat16,
   causal with left padding): forward + backward seconds of each path this backend runs
   (`xla` only where its [T, T] scores fit, `blockwise`, `cudnn` on GPU, `pallas` on TPU)
   and its largest difference from `blockwise`.
4. The GRPO update and the reference forward with sequence packing (`optim.packing`)
   against padded rows, on a long-tailed batch (about half its positions padding) at the
   preset's model shapes: median seconds of interleaved padded / packed pairs, the
   speed-up, the loss of each update, and whether every micro-batch packed
   (`benchmarks/packing.py`'s functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, measure_matmul_peak, preset_config, table  # noqa: E402
from grpo_step import TOKENIZER, make_config  # noqa: E402
from packing import long_tailed_batch, measure, packed_micro_batches, padding_fraction  # noqa: E402

from jaxrl_llm import models, parallel, sampling  # noqa: E402
from jaxrl_llm import train as train_lib  # noqa: E402
from jaxrl_llm.models import attention as A  # noqa: E402
from jaxrl_llm.tpu import chips, roofline  # noqa: E402
from jaxrl_llm.trainer import perf  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each preset runs: the GRPO step, decode batches, attention lengths."""

    dtype: str
    prompts: int
    generations: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    decode_tokens: int
    attention_lengths: tuple[int, ...]
    heads: tuple[int, int, int]  # N, K, H of the attention section
    packing: tuple[int, int, int, int]  # rows, prompt and completion length, timed pairs


SIZES = {
    "0.5b": Sizes(
        "bfloat16", 16, 8, 512, (1, 64), 256, (4096, 16384), (14, 2, 64), (32, 64, 960, 5)
    ),
    "tiny": Sizes("float32", 8, 2, 8, (2,), 8, (128,), (4, 2, 16), (8, 16, 48, 2)),
}
PACKING_MICRO_BATCHES = 2
XLA_MAX_SCORE_BYTES = 8 * 2**30  # the xla path's [N, T, T] float32 scores, at most


def grpo_step(preset: str, sizes: Sizes, model_dir: str, workdir: str, peak: float) -> list[dict]:
    """Section 1: the last of a few steps (the first ones compile), phase by phase."""
    args = argparse.Namespace(
        dtype=sizes.dtype,
        remat="full",
        scan_layers=preset == "tiny",
        beta=0.04,
        prompts=sizes.prompts,
        generations=sizes.generations,
        new_tokens=sizes.new_tokens,
        bucket_steps=4,
        cache_segments=sampling.CACHE_SEGMENTS,
        micro_batches=2,
        logprob_chunk=128,
        warmup=1,
        steps=1,
        ignore_eos=True,
    )
    run = train_lib.Run.build(make_config(args, model_dir), workdir)
    try:  # the last step's phases: the earlier ones compile
        for i in range(2 if preset == "tiny" else 3):
            result = run.step(i)
    finally:
        run.close()
    host, scored = dict(result.host), result.scored
    rows_n = sizes.prompts * sizes.generations
    flops = perf.step_flops(
        run.model_cfg,
        rows=rows_n,
        prompts=sizes.prompts,
        prompt_len=float(scored.prompt_lengths.mean()),
        new_tokens=float(scored.lengths.mean()),
        reference=True,
        update_forwards=run.update.forward_passes,
        update_shared_forwards=run.update.shared_prompt_passes,
        reference_shares_prompts=sizes.generations > 1,
    )
    generated = rows_n * float(scored.lengths.mean())
    predicted = roofline_prediction(run, flops, scored, rows_n)
    out = []
    for phase, key in (
        ("sample", "sample"),
        ("reference (not overlapped)", "reference"),
        ("update", "update"),
        ("whole step", "step"),
    ):
        s = host[f"perf/{key}_s"]
        f = sum(flops.values()) if key == "step" else flops.get(key, 0.0)
        row = {
            "phase": phase,
            "s": f"{s:.3f}",
            "GFLOP": f"{f / 1e9:.1f}",
            "MFU": f"{f / s / peak:.1%}" if s > 0 else "-",
        }
        if key == "sample":
            row["tokens/s"] = f"{generated / s:.0f}"
        if predicted is not None:  # the chip's roofline for this phase, beside the measure
            p = sum(predicted.values()) if key == "step" else predicted.get(key, 0.0)
            row["roofline s"] = f"{p:.3f}"
        out.append(row)
    return out


def roofline_prediction(run, flops: dict, scored, rows: int) -> dict | None:
    """{phase: roofline seconds} of the step just measured, on this device's chip
    (`jaxrl_llm.tpu.roofline`, from its published peak and bandwidth); None on a device
    not in `tpu.chips`' tables (a CPU)."""
    chip = chips.chip_of(jax.devices()[0].device_kind)
    if chip is None:
        return None
    m, o = dict(run.mesh.shape), run.config.optim
    costs = roofline.phase_costs(
        run.model_cfg,
        flops,
        rows=rows,
        prompt_len=float(scored.prompt_lengths.mean()),
        new_tokens=float(scored.lengths.mean()),
        chips=run.mesh.size,
        weight_shards=m.get("tensor", 1) * m.get("expert", 1),
        row_shards=parallel.batch_size_multiple(run.mesh),
        itemsize=jnp.dtype(run.config.model.dtype).itemsize,
        micro_batches=o.micro_batches * o.mini_batches,
        update_forwards=run.update.forward_passes,
        reference=run.ref_logprobs is not None,
    )
    return roofline.predicted_seconds(costs, chip)


def bandwidth() -> float:
    """Bytes/s of a large on-device copy (read + write), the best of a few."""
    n = (256 if jax.default_backend() != "cpu" else 32) * 2**20
    x = jnp.ones((n // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def decode(cfg, params, sizes: Sizes, bw: float) -> list[dict]:
    """Section 2: per-token seconds of the sampler at each batch, against the bytes a
    decode step reads (weights + mean KV cache) at the measured bandwidth."""
    sampler = sampling.Sampler(cfg, seed=0, pad_id=0)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    out = []
    for batch in sizes.decode_batches:
        ids = np.ones((batch, 16), np.int32)
        mask = np.ones((batch, 16), bool)
        times = {}
        for n in (1, sizes.decode_tokens):  # the difference removes prefill and dispatch
            spec = sampling.RolloutSpec(num_generations=1, max_new_tokens=n)
            jax.block_until_ready(sampler.sample(params, ids, mask, spec))
            times[n] = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(sampler.sample(params, ids, mask, spec))
                times[n] = min(times[n], time.perf_counter() - t0)
        per_token = (times[sizes.decode_tokens] - times[1]) / (sizes.decode_tokens - 1)
        if per_token <= 0:  # below the timer's noise (a tiny model)
            out.append({"batch": batch, "ms/token": "below timer noise"})
            continue
        itemsize = jnp.dtype(params["embed"].dtype).itemsize
        kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        cache = batch * kv * (16 + sizes.decode_tokens / 2)
        out.append(
            {
                "batch": batch,
                "ms/token": f"{per_token * 1e3:.2f}",
                "tokens/s": f"{batch / per_token:.0f}",
                "GB read/step": f"{(weights + cache) / 1e9:.3f}",
                "of bandwidth": f"{(weights + cache) / per_token / bw:.1%}",
            }
        )
    return out


def attention(sizes: Sizes) -> list[dict]:
    """Section 3: forward + backward of each attention path against blockwise."""
    N, K, H = sizes.heads
    dtype = jnp.dtype(sizes.dtype)
    backend = jax.default_backend()
    paths = ["xla", "blockwise"] + {"gpu": ["cudnn"], "tpu": ["pallas"]}.get(backend, [])
    out = []
    for T in sizes.attention_lengths:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(1, T, N, H)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(1, T, K, H)), dtype) for _ in range(2))
        valid = jnp.arange(T)[None] >= T // 8  # left padding
        mask = A.causal_mask(valid, jnp.maximum(jnp.cumsum(valid, 1) - 1, 0))

        def run(path, q=q, k=k, v=v, mask=mask):
            def loss(q, k, v):
                return jnp.sum(A.attention(q, k, v, mask, path).astype(jnp.float32) ** 2)

            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            seconds = time.perf_counter() - t0
            return seconds, jax.jit(lambda *a: A.attention(*a, mask, path))(q, k, v)

        base_s, base = run("blockwise")
        for path in paths:
            if path == "xla" and N * T * T * 4 > XLA_MAX_SCORE_BYTES:
                out.append({"T": T, "path": path, "fwd+bwd s": "skipped: [N,T,T] scores"})
                continue
            try:
                s, o = (base_s, base) if path == "blockwise" else run(path)
            except Exception as err:  # a kernel this device or jax build lacks: say so
                out.append({"T": T, "path": path, "fwd+bwd s": f"failed: {err!s:.80}"})
                continue
            real = np.asarray(valid)[0]
            diff = np.abs(np.asarray(o, np.float32) - np.asarray(base, np.float32))[0, real]
            out.append(
                {
                    "T": T,
                    "path": path,
                    "fwd+bwd s": f"{s:.4f}",
                    "blockwise / this": f"{base_s / s:.2f}x",
                    "max |diff|": f"{diff.max():.2e}",
                }
            )
    return out


def packed_vs_padded(cfg, params, sizes: Sizes) -> list[dict]:
    """Section 4: padded against packed update and reference forward on a long-tailed
    batch, in interleaved pairs; each row says whether every micro-batch packed."""
    rows_n, prompt_len, completion_len, repeats = sizes.packing
    batch = long_tailed_batch(cfg, rows_n, prompt_len, completion_len, padding=0.5)
    args = argparse.Namespace(
        completion_len=completion_len,
        micro_batches=PACKING_MICRO_BATCHES,
        chunk_size=128,
        repeats=repeats,
    )
    fits = packed_micro_batches(batch, PACKING_MICRO_BATCHES)
    label = f"{rows_n} x {prompt_len} + {completion_len}, {padding_fraction(batch):.0%} padding"
    out = measure(cfg, args, batch, label, params=params)
    for row in out:
        row["micro-batches packed"] = f"{sum(fits)}/{len(fits)}"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--out", required=True, help="markdown file to write")
    args = p.parse_args(argv)
    sizes = SIZES[args.preset]
    start = time.perf_counter()
    cfg = preset_config(args.preset).replace(remat="full")
    peak = measure_matmul_peak(sizes.dtype, repeats=3)
    bw = bandwidth()
    head = (
        f"# device_check: {device_name()}\n\n"
        f"`python benchmarks/device_check.py --preset={args.preset} --out=...`; jax "
        f"{jax.__version__}; model {args.preset} ({cfg.num_params() / 1e6:.0f}M params), "
        f"{sizes.dtype}; measured matmul peak {peak / 1e12:.2f} TFLOP/s ({sizes.dtype}), "
        f"copy bandwidth {bw / 1e9:.0f} GB/s\n"
    )
    print(head, flush=True)
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        params = models.init_params(cfg, seed=0, dtype=sizes.dtype)
        models.save_hf(cfg, params, model_dir, tokenizer_dir=TOKENIZER)
        step = grpo_step(args.preset, sizes, model_dir, os.path.join(tmp, "run"), peak)
        sections.append(
            (
                f"## GRPO step ({sizes.prompts} prompts x {sizes.generations} samples, "
                f"{sizes.new_tokens} new tokens, beta 0.04, remat full)",
                step,
            )
        )
        print(sections[-1][0] + "\n" + table(step, list(step[0])) + "\n", flush=True)
    print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
    rows = decode(cfg, params, sizes, bw)
    sections.append((f"## Decode ({sizes.decode_tokens} tokens after a 16-token prompt)", rows))
    print(sections[-1][0] + "\n" + table(rows, _columns(rows)) + "\n", flush=True)
    print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
    rows = attention(sizes)
    sections.append(("## Attention, forward + backward, causal + left padding", rows))
    print(sections[-1][0] + "\n" + table(rows, _columns(rows)) + "\n", flush=True)
    print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
    rows = packed_vs_padded(cfg, params, sizes)
    sections.append(
        (
            f"## Packed vs padded update ({PACKING_MICRO_BATCHES} micro-batches, "
            f"{sizes.packing[3]} interleaved pairs; s per call)",
            rows,
        )
    )
    print(sections[-1][0] + "\n" + table(rows, _columns(rows)) + "\n", flush=True)
    text = head
    for title, rows in sections:
        text += f"\n{title}\n\n{table(rows, _columns(rows))}\n"
    text += f"\n{time.perf_counter() - start:.0f} s in all\n"
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"{time.perf_counter() - start:.0f} s in all; wrote {args.out}", flush=True)


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    return cols


if __name__ == "__main__":
    main()

"""One whole GRPO step of the trainer against its FLOP floor.

    python benchmarks/grpo_step.py                          # ~25M Qwen3-like, CPU
    python benchmarks/grpo_step.py --preset=0.5b --dtype=bfloat16 --prompts=64   # a GPU

The step is the trainer's own (`jaxrl_llm.train.Run.step`, what `python -m
jaxrl_llm.train` runs): sample G completions per prompt on device, dispatch the
reference model's log-probs, decode and score the text in the verifier pool while the
reference runs, then the jitted GRPO update (beta > 0: KL to the reference). The model is
a random --preset saved as a Hugging Face directory with the arithmetic tokenizer; it
never emits EOS, so every completion is --new-tokens long. Prompts are two-digit
arithmetic questions.

Reported, as medians over --steps measured steps after --warmup steps (compilation):
seconds per step and per phase (sample = prefill + decode + transfer of the ids;
reference = the wait for its log-probs after scoring, i.e. what did not overlap; score =
decode to text + verifiers; update = the GRPO step), tokens/s, peak memory, and the FLOP
floor: model FLOPs of each phase (`jaxrl_llm.trainer.perf.step_flops`: real prompt and
completion tokens only, attention included; the prefill, the reference forward and the
update read each prompt once per group, as they run) over the float32 / bfloat16 matmul
peak measured before every step (the best of those; --peak-gflops fixes it instead).
ratio = seconds / floor seconds, per step, then the median; the whole step's ratio is the
figure of merit (1.0 = nothing but the model's matmuls at peak costs time).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    bool_flag,
    cpu_steal_s,
    device_name,
    measure_matmul_peak,
    peak_memory,
    preset_config,
    table,
    uptime,
)

from jaxrl_llm import assets, models, sampling  # noqa: E402
from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm import train as train_lib  # noqa: E402
from jaxrl_llm.parallel import allocator, xla_flags  # noqa: E402
from jaxrl_llm.trainer import perf  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(assets.__file__), "arithmetic_tokenizer")


def make_config(args, model_dir: str):
    c = config_lib.base_config()
    c.model.path = model_dir
    c.model.dtype = args.dtype
    c.model.remat = args.remat
    c.model.scan_layers = args.scan_layers
    c.algo.name = "grpo"
    c.algo.beta = args.beta
    c.data.name = "arithmetic/digits_2"
    c.data.template = "{question}="
    c.data.chat_template = "never"
    c.data.max_prompt_len = 64
    c.rollout.batch_size = args.prompts
    c.rollout.num_generations = args.generations
    c.rollout.max_new_tokens = args.new_tokens
    c.rollout.temperature = 1.0
    c.rollout.bucket_steps = args.bucket_steps
    c.rollout.cache_segments = args.cache_segments
    if args.ignore_eos:  # every completion runs to --new-tokens
        c.rollout.stop_tokens = ()
    c.rewards = {"gsm8k": 1.0}
    c.optim.micro_batches = args.micro_batches
    c.train.num_steps = args.warmup + args.steps
    c.train.logprob_chunk = args.logprob_chunk
    c.train.print_samples_every = 0
    c.logging.tensorboard = False
    c.checkpoint.every = 0
    c.eval.every = 0
    return c


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="25m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat", default="none")
    # The speed settings are set here, not left to the trainer's start-up picks (`tuning`),
    # so that a change of those rules cannot change this benchmark silently.
    # optim.micro_batches / train.logprob_chunk: 4 / 32 keep the update's and the
    # reference's temporaries 4x smaller than one batch / 128 (cache-resident on CPU, fewer
    # fresh pages to fault in). Same math either way.
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--logprob-chunk", type=int, default=32)
    # model.scan_layers: unrolled, the update's backward reads each layer's residuals in place.
    p.add_argument("--scan-layers", type=bool_flag, default=False)
    # rollout.bucket_steps: 4 pads the 18-token prompts to 20, not 24.
    p.add_argument("--bucket-steps", type=int, default=4, choices=(1, 2, 4, 8))
    # rollout.cache_segments: decode loops over a growing KV cache (1 = one loop).
    p.add_argument("--cache-segments", type=int, default=sampling.CACHE_SEGMENTS)
    # A fixed peak for the floor (e.g. 200 for these 2 cores' fast mode) instead of the best
    # one measured: runs on different days then share one floor.
    p.add_argument("--peak-gflops", type=float, default=0.0)
    # No stop token: every completion is --new-tokens long even where a small vocabulary
    # makes EOS likely (--preset=tiny).
    p.add_argument("--ignore-eos", type=bool_flag, default=False)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.peak_gflops < 0:
        p.error(f"--peak-gflops={args.peak_gflops}: must be > 0 (or 0 = measure it)")
    print(f"device: {device_name()}; {uptime()}", flush=True)

    cfg = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        models.save_hf(cfg, models.init_params(cfg, seed=0), model_dir, tokenizer_dir=TOKENIZER)
        run = train_lib.Run.build(make_config(args, model_dir), os.path.join(tmp, "run"))
        try:
            steps = []
            for i in range(args.warmup + args.steps):
                # Measured before every step; the floor uses the best of them. On a shared
                # machine a 2048^2 matmul alternates between two speeds (~175 and ~200
                # GFLOP/s on the 2 development cores): one measurement may see either.
                peak = measure_matmul_peak(args.dtype, repeats=3)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                steal = cpu_steal_s()
                result = run.step(i)
                host = dict(result.host)
                steal = cpu_steal_s() - steal
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                host["page_faults"] = float(faults)
                scored = result.scored
                host["prompt_len"] = float(scored.prompt_lengths.mean())
                host["new_tokens"] = float(scored.lengths.mean())
                host["padded_len"] = host["rollout/prompt_width"]
                host["peak"] = peak
                print(
                    f"step {i}{' (warmup)' if i < args.warmup else ''}: "
                    f"{host['perf/step_s']:.2f} s, {faults} page faults, "
                    f"{steal:.2f} s of CPU taken by the hypervisor, "
                    f"matmul peak before it {peak / 1e9:.0f} GFLOP/s",
                    flush=True,
                )
                if i >= args.warmup:
                    steps.append(host)
        finally:
            run.close()

    rows_n = args.prompts * args.generations
    peak = args.peak_gflops * 1e9 or max(s["peak"] for s in steps)
    for s in steps:
        flops = perf.step_flops(
            run.model_cfg,
            rows=rows_n,
            prompts=args.prompts,
            prompt_len=s["prompt_len"],
            new_tokens=s["new_tokens"],
            reference=args.beta > 0,
            update_forwards=run.update.forward_passes,
            update_shared_forwards=run.update.shared_prompt_passes,
            reference_shares_prompts=args.generations > 1,
        )
        flops["step"] = sum(flops.values())
        for k, v in flops.items():
            s[f"flops/{k}"] = v
            s[f"floor/{k}"] = v / peak
            s[f"ratio/{k}"] = s[f"perf/{k}_s"] / s[f"floor/{k}"]
    med = {k: float(np.median([s[k] for s in steps])) for k in steps[0]}
    phases = [
        ("sample", "sample"),
        ("reference (not overlapped)", "reference"),
        ("score", None),
        ("update", "update"),
        ("whole step", "step"),
    ]
    rows = [
        {
            "phase": name,
            "s": f"{med[f'perf/{key or name}_s']:.3f}",
            "floor s": f"{med[f'floor/{key}']:.3f}" if key else "-",
            "ratio": f"{med[f'ratio/{key}']:.2f}" if key else "-",
            "GFLOP": f"{med[f'flops/{key}'] / 1e9:.1f}" if key else "-",
        }
        for name, key in phases
    ]
    n_params = run.model_cfg.num_params()
    print(
        f"\n{args.preset} ({n_params / 1e6:.1f}M params, {args.dtype}); "
        f"{args.prompts} prompts x {args.generations} samples; "
        f"prompt {med['prompt_len']:.1f} tokens (padded to {med['padded_len']:.0f}); "
        f"{med['new_tokens']:.0f} new tokens; beta {args.beta}; "
        f"micro-batches {args.micro_batches}, log-prob chunk {args.logprob_chunk}, "
        f"scan_layers {args.scan_layers}, bucket steps {args.bucket_steps}, "
        f"cache segments {args.cache_segments}; "
        f"matmul peak {peak / 1e9:.1f} GFLOP/s{' (given)' if args.peak_gflops else ''}; "
        f"measured before the steps: {min(s['peak'] for s in steps) / 1e9:.1f}-"
        f"{max(s['peak'] for s in steps) / 1e9:.1f}"
    )
    print(table(rows, list(rows[0])))
    gen = rows_n * med["new_tokens"]
    print(
        f"generated tokens/s (sample phase): {gen / med['perf/sample_s']:.0f}; "
        f"trained tokens/s (whole step): {gen / med['perf/step_s']:.0f}; "
        f"MFU of the whole step: {1 / med['ratio/step']:.1%}; "
        f"memory: {peak_memory()}"
    )
    print(f"after: {uptime()}")


if __name__ == "__main__":
    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()  # as the trainer's command line does
    main()

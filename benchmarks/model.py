"""Decoder throughput: forward and forward+backward tokens/s and MFU, beside HF PyTorch.

    python benchmarks/model.py                          # ~100M Qwen3-like, 8 x 512, fp32, CPU
    python benchmarks/model.py --preset=0.5b --dtype=bfloat16 --batch=16 --seq=1024   # GPU

MFU = model FLOPs / measured matmul peak of the same device in the same run, with model
FLOPs = 2·N·tokens (forward) or 6·N·tokens (forward + backward), N = parameters that take
part in matmuls (non-embedding + output projection); attention score FLOPs are reported
separately and not counted in N. The backward pass differentiates the mean next-token
negative log-likelihood of the batch, as a training step would.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, matmul_peak, peak_memory, preset_config, table, time_fn  # noqa: E402

from jaxrl_llm import models, rl  # noqa: E402
from jaxrl_llm.parallel import allocator, xla_flags  # noqa: E402
from jaxrl_llm.trainer import perf


def loss_fn(cfg, params, ids):
    """Mean next-token NLL through the trainer's own log-prob path: the decoder, then
    `rl.token_logprobs` (chunked over the sequence, hand-written backward)."""
    hidden = models.forward(cfg, params, ids[:, :-1])
    w = models.unembed_matrix(cfg, params)
    logp, _ = rl.token_logprobs(hidden, w, ids[:, 1:], chunk_size=128)
    return -jnp.mean(logp)


def bench_jax(cfg, ids, dtype, repeats):
    params = models.init_params(cfg, seed=0, dtype=dtype)
    fwd = jax.jit(lambda p, x: models.logits.__wrapped__(cfg, p, x))
    grad = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(cfg, p, x)))
    x = jnp.asarray(ids)
    return time_fn(fwd, params, x, repeats=repeats), time_fn(grad, params, x, repeats=repeats)


def bench_torch(cfg, ids, dtype, repeats):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf_cfg = transformers.Qwen3Config(
        **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    )
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(getattr(torch, dtype))
    x = torch.tensor(ids)

    def fwd():
        with torch.no_grad():
            return model(input_ids=x).logits

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss

    return time_fn(lambda: fwd().detach(), repeats=repeats), time_fn(fwd_bwd, repeats=repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m", choices=["25m", "100m", "0.5b"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip the HF PyTorch baseline")
    args = ap.parse_args()

    cfg = preset_config(args.preset)
    # Decoder-layer matmuls + the output projection (tied or not): what a token's forward
    # multiplies by; norms and the embedding lookup are not matmuls.
    n_matmul = perf.layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    tokens = args.batch * args.seq
    attn_flops = 4 * cfg.num_layers * args.batch * args.seq**2 * cfg.num_heads * cfg.head_dim / 2
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
    print(
        f"device {device_name()}; {args.preset}: {cfg.num_params() / 1e6:.1f}M params "
        f"({n_matmul / 1e6:.1f}M in matmuls); batch {args.batch} x {args.seq}; {args.dtype}"
    )
    peak = matmul_peak(args.dtype)
    print(f"measured matmul peak: {peak / 1e9:.1f} GFLOP/s")

    rows = []
    results = {"jaxrl_llm": bench_jax(cfg, ids, args.dtype, args.repeats)}
    if not args.no_torch:
        results["HF transformers (torch)"] = bench_torch(cfg, ids, args.dtype, args.repeats)
    for impl, (fwd, fwd_bwd) in results.items():
        for name, (first, t), mult in (("forward", fwd, 2), ("forward+backward", fwd_bwd, 6)):
            rows.append(
                {
                    "impl": impl,
                    "pass": name,
                    "compile+first s": f"{first:.2f}",
                    "step s": f"{t:.3f}",
                    "tokens/s": f"{tokens / t:,.0f}",
                    "MFU": f"{mult * n_matmul * tokens / t / peak:.1%}",
                }
            )
    print(table(rows, ["impl", "pass", "compile+first s", "step s", "tokens/s", "MFU"]))
    print(
        f"attention-score FLOPs per forward (not in MFU): {attn_flops / 1e9:.1f} GFLOP; "
        f"memory: {peak_memory()}"
    )


if __name__ == "__main__":
    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()  # as the trainer's command line does
    main()

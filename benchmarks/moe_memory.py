"""Compiled per-device memory of the GRPO update of configs/math_grpo_qwen3_30b_a3b_tpu.py.

    python benchmarks/moe_memory.py                       # 48 layers (the model as it is)
    python benchmarks/moe_memory.py --layers=2,4          # fewer, extrapolated per layer
    python benchmarks/moe_memory.py --moe-impl=ragged     # another expert path

Compiles (never runs) the trainer's update program (`rl.make_update_fn`, with the
config's algorithm, optimizer, micro-batches and log-prob chunk) for Qwen3-30B-A3B's
shapes on a mesh of the config's shape, from abstract arrays (`jax.ShapeDtypeStruct` with
the run's shardings: parameters by the rule table, the optimizer state as its
initialisation compiles to, the batch over the batch axes): nothing is allocated. The
devices are host CPU devices (`--xla_force_host_platform_device_count`, set before jax
is imported), so XLA:CPU compiles the partitioned program: the figures are the CPU
compiler's buffer assignment for one device of that mesh, which estimates a TPU's (its
fusion and scheduling differ). Prints XLA's `memory_analysis()` per device: arguments
(parameters, master copy, moments, batch), outputs, aliased bytes (the state donated to
its update) and temporaries, for each layer count, and with two layer counts or more the
per-layer growth and the 48-layer figure extrapolated linearly from the last two.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time

CONFIG = "configs/math_grpo_qwen3_30b_a3b_tpu.py"
# Qwen/Qwen3-30B-A3B's config.json.
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    qk_norm=True,
    tie_word_embeddings=False,
    rope_theta=1e6,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)
GiB = 2**30


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--devices", type=int, default=32, help="chips of the slice (v5p-64: 32)")
    ap.add_argument("--layers", default="48", help="layer counts, comma-separated")
    ap.add_argument("--moe-impl", default="blocked", help="model.moe_impl compiled")
    ap.add_argument(
        "--set-mesh",
        action="store_true",
        help="trace under jax.set_mesh (gmm then runs per device in shard_map)",
    )
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # before jax is imported: the fake devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ARGS.devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table  # noqa: E402

from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm import models, parallel, rl, sampling  # noqa: E402
from jaxrl_llm.tpu import compile_for  # noqa: E402


def load_config(path):
    spec = importlib.util.spec_from_file_location("run_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def abstract_update(c, cfg, mesh):
    """(jitted update, abstract state, abstract batch) of run config `c` on `mesh`."""
    o = c.optim
    opt = rl.optimizer_from_config(o, c.train.num_steps)
    G = c.rollout.num_generations
    spec = sampling.RolloutSpec(num_generations=G, max_new_tokens=c.rollout.max_new_tokens)
    algo = config_lib.algo_config(c)
    update = rl.make_update_fn(
        cfg,
        algo,
        opt,
        spec,
        micro_batches=o.micro_batches,
        mini_batches=o.mini_batches,
        chunk_size=c.train.logprob_chunk,
        seed=c.train.seed,
        packing="off",  # an MoE model runs padded (docs/moe.md)
    )
    params = compile_for.abstract_params(cfg, mesh, c.model.dtype)
    state = compile_for.abstract_state(params, opt, mesh)
    rows, prompt, new = c.rollout.batch_size * G, c.data.max_prompt_len, spec.max_new_tokens

    def a(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=parallel.batch_sharding(mesh, len(shape)))

    batch = rl.RolloutBatch(
        prompt_tokens=a((rows, prompt), jnp.int32),
        prompt_mask=a((rows, prompt), jnp.bool_),
        tokens=a((rows, new), jnp.int32),
        mask=a((rows, new), jnp.bool_),
        loss_mask=a((rows, new), jnp.bool_),
        behaviour_logprobs=a((rows, new), jnp.float32),
        rewards=a((rows,), jnp.float32),
        policy_version=a((rows,), jnp.int32),
        ref_logprobs=a((rows, new), jnp.float32) if algo.beta > 0 else None,
        num_generations=G,
        routes=a((rows, prompt + new, cfg.num_layers, cfg.num_experts_per_tok), jnp.int16),
    )
    return update, state, batch


def main():
    args = ARGS
    c = load_config(args.config)
    mesh = parallel.make_mesh(config_lib.mesh_axes(c.mesh))
    m = c.model
    print(
        f"{args.config}: mesh {dict(mesh.shape)} on {mesh.size} host CPU devices; "
        f"{m.dtype}, remat {m.remat}, moe_impl {args.moe_impl}; rollout "
        f"{c.rollout.batch_size} x {c.rollout.num_generations} rows of "
        f"{c.data.max_prompt_len} + {c.rollout.max_new_tokens} tokens, "
        f"{c.optim.micro_batches} micro-batches; compiled, not run",
        flush=True,
    )
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        cfg = models.ModelConfig(
            "Qwen3MoeForCausalLM",
            **(QWEN3_30B_A3B | {"num_layers": layers}),
            remat=m.remat,
            scan_layers=True,
            moe_impl=args.moe_impl,
            attention="blockwise",
        )
        start = time.perf_counter()
        update, state, batch = abstract_update(c, cfg, mesh)
        context = jax.set_mesh(mesh) if args.set_mesh else contextlib.nullcontext()
        with context:  # no mesh set: as the trainer traces
            compiled = update.lower(state, batch).compile()
        mem = compiled.memory_analysis()
        row = {
            "layers": layers,
            "params (B)": f"{cfg.num_params() / 1e9:.2f}",
            "argument GiB": mem.argument_size_in_bytes / GiB,
            "output GiB": mem.output_size_in_bytes / GiB,
            "alias GiB": mem.alias_size_in_bytes / GiB,
            "temp GiB": mem.temp_size_in_bytes / GiB,
        }
        row["peak GiB"] = (
            row["argument GiB"] + row["output GiB"] - row["alias GiB"] + row["temp GiB"]
        )
        rows.append(row)
        print(
            f"  {layers} layers: {row['peak GiB']:.2f} GiB per device "
            f"({time.perf_counter() - start:.0f} s to compile)",
            flush=True,
        )
    keys = ["argument GiB", "output GiB", "alias GiB", "temp GiB", "peak GiB"]
    if len(rows) >= 2:
        a, b = rows[-2], rows[-1]
        span = b["layers"] - a["layers"]
        per = {k: (b[k] - a[k]) / span for k in keys}
        full = QWEN3_30B_A3B["num_layers"]
        rows.append({"layers": "per layer"} | per)
        rows.append(
            {"layers": f"{full} (extrapolated)"}
            | {k: b[k] + per[k] * (full - b["layers"]) for k in keys}
        )
    for row in rows:
        for k in keys:
            row[k] = f"{row[k]:.3f}"
    print(table(rows, ["layers", "params (B)"] + keys))


if __name__ == "__main__":
    main()

"""Memory of one GRPO update: full fine-tune against LoRA, from XLA's memory analysis.

    python benchmarks/lora_memory.py                   # Qwen2.5-0.5B shapes, float32, CPU
    python benchmarks/lora_memory.py --dtype=bfloat16

Compiles (never runs) the trainer's update program (`rl.make_update_fn`) for GRPO with
beta = 0.04 on one device, from abstract arrays: nothing of the model is allocated. For
each setting it prints XLA's `memory_analysis()` of the update (arguments, outputs,
aliased = donated, temporaries) and the weights the reference forward needs besides the
update's arguments: a second copy of the model for a full fine-tune, nothing for LoRA
(the reference is the frozen base the update already holds). "step peak" = arguments +
outputs - aliased + temporaries + that reference copy.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PRESETS, device_name, table  # noqa: E402

from jaxrl_llm import models, rl, sampling  # noqa: E402
from jaxrl_llm.models import lora  # noqa: E402
from jaxrl_llm.rl import update as U  # noqa: E402

# Qwen2.5-0.5B as it is (the shapes of common.PRESETS["0.5b"], with its biases and ties).
QWEN2P5_0P5B = dict(
    PRESETS["0.5b"],
    qkv_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=32768,
)
GiB = 2**30


def abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_state(cfg, opt, dtype, sharding):
    """TrainState of ShapeDtypeStructs: all weights train, or (cfg.lora) adapters + base."""
    base_cfg = cfg.replace(lora=None)
    specs = models.param_specs(base_cfg)
    full = models.params.unflatten(
        {p: jax.ShapeDtypeStruct(s.shape, dtype) for p, s in specs.items()}
    )
    frozen = None
    params = full
    if cfg.lora is not None:
        frozen = full
        params = jax.eval_shape(lambda: lora.init_adapters(cfg, dtype=dtype))
    opt_state = jax.eval_shape(opt.init, params)
    return U.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding),
        params=abstract(params, sharding),
        opt_state=abstract(opt_state, sharding),
        frozen=None if frozen is None else abstract(frozen, sharding),
    )


def abstract_batch(rows, prompt, new, G, sharding):
    def a(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return rl.RolloutBatch(
        prompt_tokens=a((rows, prompt), jnp.int32),
        prompt_mask=a((rows, prompt), jnp.bool_),
        tokens=a((rows, new), jnp.int32),
        mask=a((rows, new), jnp.bool_),
        loss_mask=a((rows, new), jnp.bool_),
        behaviour_logprobs=a((rows, new), jnp.float32),
        rewards=a((rows,), jnp.float32),
        policy_version=a((rows,), jnp.int32),
        ref_logprobs=a((rows, new), jnp.float32),
        num_generations=G,
    )


def measure(cfg, args, dtype) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    opt = U.make_optimizer(learning_rate=1e-6)
    spec = sampling.RolloutSpec(num_generations=args.g, max_new_tokens=args.new)
    update = U.make_update_fn(
        cfg,
        rl.preset("grpo", beta=0.04),
        opt,
        spec,
        micro_batches=args.micro_batches,
        chunk_size=args.chunk,
    )
    state = abstract_state(cfg, opt, dtype, sharding)
    batch = abstract_batch(args.prompts * args.g, args.prompt, args.new, args.g, sharding)
    m = update.lower(state, batch).compile().memory_analysis()
    nbytes = lambda t: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    weights = nbytes(state.params if state.frozen is None else state.frozen)
    reference = weights if cfg.lora is None else 0  # LoRA: the reference reads `frozen`
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + reference
    )
    return {
        "setting": "full fine-tune" if cfg.lora is None else f"LoRA r={cfg.lora.rank}",
        "trainable M": f"{nbytes(state.params) / dtype.itemsize / 1e6:.1f}",
        "optimizer state GiB": f"{nbytes(state.opt_state) / GiB:.2f}",
        "arguments GiB": f"{m.argument_size_in_bytes / GiB:.2f}",
        "outputs GiB": f"{m.output_size_in_bytes / GiB:.2f}",
        "aliased GiB": f"{m.alias_size_in_bytes / GiB:.2f}",
        "temporaries GiB": f"{m.temp_size_in_bytes / GiB:.2f}",
        "reference copy GiB": f"{reference / GiB:.2f}",
        "step peak GiB": f"{peak / GiB:.2f}",
        "_peak": peak,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8, help="B: prompts per update")
    ap.add_argument("--g", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    base = models.ModelConfig("Qwen2ForCausalLM", remat="full", **QWEN2P5_0P5B)
    print(
        f"device {device_name()}; Qwen2.5-0.5B shapes ({base.num_params() / 1e6:.0f}M params), "
        f"{args.dtype}, remat full; GRPO beta 0.04, {args.prompts} x {args.g} rows of "
        f"{args.prompt} + {args.new} tokens, {args.micro_batches} micro-batches; LoRA on "
        f"all projections; compiled, not run"
    )
    lcfg = base.replace(lora=models.LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    rows = [measure(cfg, args, dtype) for cfg in (base, lcfg)]
    cols = [c for c in rows[0] if not c.startswith("_")]
    print(table(rows, cols))
    print(f"full / LoRA step peak: {rows[0]['_peak'] / rows[1]['_peak']:.2f}x")


if __name__ == "__main__":
    main()

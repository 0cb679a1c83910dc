"""The Pallas kernels jaxrl_llm calls, compiled for each TPU chip kind (no TPU needed).

    python benchmarks/tpu_kernels.py                 # v5e, v6e, v5p; needs libtpu
    python benchmarks/tpu_kernels.py --chips=v6e --cases="deltanet layer fwd"

For each chip, on one chip of a libtpu topology description (`jaxrl_llm.tpu.chips`),
compiles with XLA:TPU (Mosaic for the kernels), at Qwen3-30B-A3B's attention and expert
shapes in bfloat16: splash attention forward + backward (`model.attention='pallas'`,
what `auto` takes on TPU), the megablox grouped matmul forward + backward
(`model.moe_impl='gmm'`), and the paged engine's decode attention
(`models.paged_kernel`, `rollout.paged.attention='auto'` on TPU), and the chunked Gated
DeltaNet layer's forward with its chunked form in the kernel (`models.deltanet_kernel`,
`model.linear_impl='pallas'`) at Qwen3-Next's DeltaNet shapes over a 4k row, beside the
same layer with its XLA form (`linear_impl='xla'`). Prints per kernel and
chip: compiles (with its temporaries) or the error's first line, and what each `auto`
picks on that chip.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table  # noqa: E402

from jaxrl_llm.models import ModelConfig, attention, gated_deltanet, moe_kernels, paged_kernel  # noqa: E402
from jaxrl_llm.models.attention_kernels import pallas as splash  # noqa: E402
from jaxrl_llm.parallel import target  # noqa: E402
from jaxrl_llm.tpu import chips  # noqa: E402

ONE_CHIP = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v5p": "v5p:1x1x1"}
B, T, N, K, H = 1, 4096, 32, 4, 128  # splash: a 4k row, Qwen3-30B-A3B's heads
TOKENS, D, E, F, TOP = 2048, 2048, 128, 768, 8  # gmm: one micro-batch's tokens
ROWS, PAGE, PAGES, WIDTH = 64, 16, 4096, 128  # paged decode: rows, page size, pool, table
DN, HV, DK, CHUNK = 2048, 32, 128, 64  # Gated DeltaNet: Qwen3-Next's width, heads, chunk


def splash_case():
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)

    def loss(q, k, v):
        mask = attention.Mask(
            q_idx=jnp.arange(T),
            k_idx=jnp.arange(T),
            k_valid=jnp.ones((B, T), bool),
            q_pos=jnp.broadcast_to(jnp.arange(T), (B, T)),
            k_pos=jnp.broadcast_to(jnp.arange(T), (B, T)),
        )
        return splash(q, k, v, mask).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv)


def gmm_case():
    x = jax.ShapeDtypeStruct((TOKENS, D), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((TOKENS, TOP), jnp.int32)
    w = jax.ShapeDtypeStruct((TOKENS, TOP), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16)

    def loss(x, ids, w, gate, up, down):
        y = moe_kernels.gmm_experts(x, ids, w, gate, up, down, interpret=False)
        return y.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 3, 4, 5)), (x, ids, w, gate, gate, down)


def paged_case():
    L = 2
    q = jax.ShapeDtypeStruct((ROWS, 1, N, H), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((K, L, PAGES, PAGE, H), jnp.bfloat16)
    table_ = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.int32)
    rows = jax.ShapeDtypeStruct((ROWS,), jnp.int32)

    def decode(q, k, v, table, start, length):
        return paged_kernel.decode_attention(q, (k, v), 1, table, start, length)

    return decode, (q, pool, pool, table_, rows, rows)


def deltanet_case(impl="pallas"):
    """One Gated DeltaNet layer's forward (`gated_deltanet`, bfloat16 weights) over a 4k
    row at Qwen3-Next-80B-A3B's DeltaNet shapes, its chunked form as `impl` runs it."""
    cfg = ModelConfig.from_hf_dict(
        dict(
            architectures=["Qwen3NextForCausalLM"],
            vocab_size=151936,
            hidden_size=DN,
            intermediate_size=5120,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            linear_num_key_heads=16,
            linear_num_value_heads=HV,
            linear_key_head_dim=DK,
            linear_value_head_dim=DK,
        ),
        linear_impl=impl,
        linear_chunk=CHUNK,
    )
    shapes = gated_deltanet.linear_shapes(cfg)
    w = {n: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for n, (shape, _) in shapes.items()}
    x = jax.ShapeDtypeStruct((B, T, DN), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, T), bool)

    def forward(w, x, mask):
        return gated_deltanet.gated_deltanet(cfg, w, x, mask, None)

    return forward, (w, x, mask)


CASES = {
    "splash fwd+bwd": splash_case,
    "gmm fwd+bwd": gmm_case,
    "paged decode": paged_case,
    "deltanet layer fwd": deltanet_case,
    "deltanet layer fwd (xla form)": lambda: deltanet_case("xla"),  # the reference
}


def compile_on(device, fn, args) -> str:
    mesh = Mesh([device], ("x",))
    placed = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), args
    )
    start = time.perf_counter()
    try:
        with target.compiling_for([device]):
            compiled = jax.jit(fn).lower(*placed).compile()
    except Exception as err:  # the kernel does not lower or compile on this chip
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"fails: {type(err).__name__}: {first[:160]}"
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return f"compiles ({time.perf_counter() - start:.0f} s; {temp:.0f} MiB temporaries)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chips", default="v5e,v6e,v5p")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: %(default)s")
    args = p.parse_args()
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        p.error(f"--cases: unknown {sorted(unknown)}; known: {list(CASES)}")
    rows = []
    for name in args.chips.split(","):
        device = chips.topology_devices(chips.parse_topology(ONE_CHIP[name]))[0]
        row = {"chip": f"{name} ({device.device_kind})"}
        for case in cases:
            row[case] = compile_on(device, *CASES[case]())
            print(f"{name} {case}: {row[case]}", flush=True)
        rows.append(row)
    print(table(rows, list(rows[0])))
    auto = {
        "model.attention": attention.resolve("auto", "tpu", T, T),
        "model.moe_impl (1 chip, or a mesh set)": moe_kernels.resolve("auto", "tpu", 4, True),
        "model.moe_impl (no mesh set)": moe_kernels.resolve("auto", "tpu", 4, False),
    }
    print("auto on TPU: " + "; ".join(f"{k} -> {v}" for k, v in auto.items()))


if __name__ == "__main__":
    main()

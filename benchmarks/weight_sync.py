"""Weight sync, trainer -> a worker process: the host path (`jaxrl_llm.workers.weights`) or
`jax.experimental.transfer` (`--path=transfer`).

    python benchmarks/weight_sync.py [--models=smollm2-135m,qwen2.5-0.5b] [--repeats=5]
        [--lora_rank=16] [--worker_processes=2] [--path=transfer --lora_rank=0]

Random float32 parameters of each model's shapes (no download) on this process's devices;
a receiver in a second process (its own JAX world) that accepts the token, places each
sync on its own mesh with the engine's shardings (`weights.place`) and acknowledges. One
sync is timed from the cast on the trainer's devices (float32 -> bfloat16) to the
acknowledgement: cast, fetch to host, TCP over loopback, placement. GB/s counts the
bytes sent. On a GPU or TPU host the same command measures the device-to-host
and host-to-device legs too.

--lora_rank > 0 adds a row per model for a LoRA run's sync (model.dtype bfloat16: a
bfloat16 base, float32 adapters of that rank on all seven projections): the base sent
once (not timed), then each sync the adapters alone, which the receiver merges into its
base on its mesh (`weights.Merger`) before it acknowledges; "placement" is then the
placement and the merge.

--worker_processes=N: the receiver is a worker of N processes, one JAX world (2 CPU
devices each, gloo between them, as `workers.serve` with JAXRL_DISTRIBUTED=1): process 0
reads each sync and shares it with the others (`parallel.share`, a broadcast), and every
process places it on the world's mesh; "placement" is then the share and the placement.

--path=transfer: the accelerator path, `rollout.worker_sync='transfer'`
(`jaxrl_llm.workers.transfer`): each receiving process pulls its own shards straight
from the trainer's devices through `jax.experimental.transfer` in place of the frame of
bytes, and process 0 acknowledges once every process has them (a barrier). The wire
carries only the address and the uuids. "placement" is then the pull, the assembly and
the barrier. The first sync also carries the host path's bytes, and the receiver checks
the pulled weights against them bit for bit.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from jaxrl_llm import models, parallel
from jaxrl_llm.config import model_shapes
from jaxrl_llm.parallel import distributed
from jaxrl_llm.workers import transfer, weights, wire

SHAPES = {  # config.json shapes (`config.model_shapes.HUB_CONFIGS`)
    "smollm2-135m": model_shapes.HUB_CONFIGS["HuggingFaceTB/SmolLM2-135M-Instruct"],
    "qwen2.5-0.5b": model_shapes.HUB_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"],
}
SHAPES["tiny"] = SHAPES["smollm2-135m"] | dict(  # tests/test_weight_sync.py's
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TOKEN_ENV = "WEIGHT_SYNC_TOKEN"
PATH_ENV = "WEIGHT_SYNC_PATH"


def model_cfg(name: str) -> models.ModelConfig:
    return models.ModelConfig.from_hf_dict(SHAPES[name], name)


def random_params(cfg) -> dict:
    """float32 normal(0, 0.02) parameters of cfg's shapes on the default device."""
    specs = models.param_specs(cfg)
    keys = jax.random.split(jax.random.key(0), len(specs))
    flat = {
        path: 0.02 * jax.random.normal(k, s.shape, "float32")
        for k, (path, s) in zip(keys, specs.items(), strict=True)
    }
    return models.params.unflatten(flat)


def receive(port: int, name: str) -> None:
    """The worker side: place every sync (LoRA: keep the base, merge each sync's adapters
    into it), acknowledge with its placement time. Several processes (JAXRL_DISTRIBUTED):
    process 0 reads and answers, sharing each sync with the others."""
    distributed.initialize()
    cfg = model_cfg(name)
    mesh = parallel.make_mesh()  # every device of the world on fsdp
    merger = weights.Merger(cfg, mesh)
    first = jax.process_index() == 0
    puller = transfer.Puller(cfg, mesh) if os.environ.get(PATH_ENV) == "transfer" else None
    if first:
        listener = wire.listen("127.0.0.1", port)
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        if not wire.authorize(conn, os.environ[TOKEN_ENV]):
            sys.exit("refused")
        if puller is not None:  # where each device's shards go, for the trainer to cut
            wire.send(conn, "layout", {"slices": transfer.slices(cfg, mesh)})
    while True:
        got = wire.recv(conn) if first else None
        t = time.perf_counter()
        kind, fields, arrays = parallel.share(got)
        if kind == "close":
            return
        if kind == "transfer":
            from jax.experimental import multihost_utils

            params = jax.block_until_ready(puller.pull(fields))
            multihost_utils.sync_global_devices("pulled")
            if arrays:  # the first sync also carries the host path's bytes: equal, bitwise
                same = jax.jit(lambda a, b: jax.tree.map(lambda u, w: (u == w).all(), a, b))
                equal = same(params, weights.place(arrays, cfg, mesh))
                if not all(bool(e) for e in jax.tree.leaves(equal)):
                    sys.exit("the pulled weights differ from the host path's")
        elif fields.get("part") == "base":
            merger.set_base(arrays)
            params = merger.base
        elif fields.get("part") == "adapters":
            params = merger.merge(arrays, fields["lora"], fields["dtype"])
        else:
            params = weights.place(arrays, cfg, mesh)
        jax.block_until_ready(params)
        if first:
            place_s = time.perf_counter() - t
            wire.send(conn, "ok", {"version": fields.get("version"), "place_s": place_s})
        del params, arrays


def lora_params(cfg, rank: int) -> tuple[dict, dict]:
    """A LoRA run's parameters (bfloat16 base, float32 adapters with B random) and the
    settings a sync carries."""
    lcfg = cfg.replace(lora=models.LoraConfig(rank=rank, alpha=2.0 * rank))
    base = jax.tree.map(lambda x: x.astype("bfloat16"), random_params(cfg))
    adapters = models.lora.init_adapters(lcfg)
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B nonzero: a merge that counts
    return models.lora.combine(base, adapters), weights.lora_settings(lcfg.lora)


def bench(name: str, repeats: int, lora_rank: int = 0, processes: int = 1, path: str = "host"):
    token = secrets.token_urlsafe(24)
    env = os.environ | {TOKEN_ENV: token, PATH_ENV: path}
    if processes > 1:  # one JAX world of `processes` processes, 2 CPU devices each
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        env |= {
            "JAXRL_DISTRIBUTED": "1",
            "JAXRL_COORDINATOR": coordinator,
            "JAXRL_NUM_PROCESSES": str(processes),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "JAX_PLATFORMS": "cpu",
        }
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--receive", name],
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            env=env | {"JAXRL_PROCESS_ID": str(i)},
            text=True,
        )
        for i in range(processes)
    ]
    child = children[0]
    try:
        port = int(child.stdout.readline())
        fields, base = {}, None
        if lora_rank:
            params, settings = lora_params(model_cfg(name), lora_rank)
            fields = {"part": "adapters", "lora": settings, "dtype": "bfloat16"}
        else:
            params = random_params(model_cfg(name))
        params = jax.block_until_ready(params)
        times, places = [], []
        with wire.connect(f"127.0.0.1:{port}", token) as sock:
            if path == "transfer":
                offer = transfer.Offer(toward="127.0.0.1")
                layout = wire.recv(sock)[1]["slices"]
                size = sum(2 * x.size for x in jax.tree.leaves(params))  # bfloat16 bytes
            for v in range(repeats + 1):  # the first compiles the casts: not counted
                t = time.perf_counter()
                if path == "transfer":
                    fields = {"version": v} | offer.offer(offer.cast(params, "bfloat16"), layout)
                    check = weights.host_copy(params) if v == 0 else None  # not timed
                    wire.send(sock, "transfer", fields, check)
                    _, fields_back, _ = wire.recv(sock)
                    if v:
                        times.append(time.perf_counter() - t)
                        places.append(fields_back["place_s"])
                    continue
                host = weights.host_copy(params, base=base)
                if host.base is not None and base is None:  # LoRA: the base, once
                    base = host.base
                    wire.send(sock, "weights", {"part": "base"}, base)
                    wire.recv(sock)
                    t = time.perf_counter()
                wire.send(sock, "weights", {"version": v} | fields, host)
                _, fields_back, _ = wire.recv(sock)
                if v:
                    times.append(time.perf_counter() - t)
                    places.append(fields_back["place_s"])
                size = weights.nbytes(host)
                del host
            wire.send(sock, "close")
        for c in children:
            c.wait(timeout=60)
    finally:
        for c in children:
            c.kill()
    t = np.array(times)
    return dict(
        model=name + (f", LoRA r{lora_rank} (adapters)" if lora_rank else ""),
        params=sum(x.size for x in jax.tree.leaves(params)),
        gb=size / 1e9,
        median_s=float(np.median(t)),
        min_s=float(t.min()),
        max_s=float(t.max()),
        gbps=size / 1e9 / float(np.median(t)),
        place_s=float(np.median(places)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora_rank", type=int, default=16, help="0: no LoRA rows")
    parser.add_argument("--worker_processes", type=int, default=1, help="the receiver's")
    parser.add_argument("--path", default="host", choices=("host", "transfer"))
    parser.add_argument("--receive", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        return receive(0, args.receive)
    if args.path == "transfer" and args.lora_rank:
        parser.error("--path=transfer sends whole weights: give --lora_rank=0")
    print("| model | params | GB sent | s per sync (median, min-max) | GB/s | placement s |")
    print("|---|---:|---:|---:|---:|---:|")
    ranks = (0, args.lora_rank) if args.lora_rank else (0,)
    for name, rank in [(name, rank) for name in args.models.split(",") for rank in ranks]:
        r = bench(name, args.repeats, rank, args.worker_processes, args.path)
        print(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['gb']:.3f} | "
            f"{r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | {r['gbps']:.2f} | "
            f"{r['place_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Weight sync over the host path (`jaxrl_llm.workers.weights`): trainer -> a worker process.

    python benchmarks/weight_sync.py [--models=smollm2-135m,qwen2.5-0.5b] [--repeats=5]

Random float32 parameters of each model's shapes (no download) on this process's devices;
a receiver in a second process (its own JAX world) that accepts the token, places each
sync on its own mesh with the engine's shardings (`weights.place`) and acknowledges. One
sync is timed from the cast on the trainer's devices (float32 -> bfloat16) to the
acknowledgement: cast, fetch to host, TCP over loopback, placement. GB/s counts the
bfloat16 bytes sent. On a GPU or TPU host the same command measures the device-to-host
and host-to-device legs too.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time

import jax
import numpy as np

from jaxrl_llm import models, parallel
from jaxrl_llm.tpu import model_shapes
from jaxrl_llm.workers import weights, wire

SHAPES = {  # config.json shapes (`tpu.model_shapes.HUB_CONFIGS`)
    "smollm2-135m": model_shapes.HUB_CONFIGS["HuggingFaceTB/SmolLM2-135M-Instruct"],
    "qwen2.5-0.5b": model_shapes.HUB_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"],
}
TOKEN_ENV = "WEIGHT_SYNC_TOKEN"


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
    """The worker side: place every sync, acknowledge with its placement time."""
    cfg = model_cfg(name)
    mesh = parallel.make_mesh()  # every device of this process on fsdp
    listener = wire.listen("127.0.0.1", port)
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    if not wire.authorize(conn, os.environ[TOKEN_ENV]):
        sys.exit("refused")
    while True:
        kind, fields, arrays = wire.recv(conn)
        if kind == "close":
            return
        t = time.perf_counter()
        params = weights.place(arrays, cfg, mesh)
        jax.block_until_ready(params)
        wire.send(conn, "ok", {"version": fields["version"], "place_s": time.perf_counter() - t})
        del params, arrays


def bench(name: str, repeats: int) -> dict:
    token = secrets.token_urlsafe(24)
    child = subprocess.Popen(
        [sys.executable, __file__, "--receive", name],
        stdout=subprocess.PIPE,
        env=os.environ | {TOKEN_ENV: token},
        text=True,
    )
    try:
        port = int(child.stdout.readline())
        params = jax.block_until_ready(random_params(model_cfg(name)))
        times, places = [], []
        with wire.connect(f"127.0.0.1:{port}", token) as sock:
            for v in range(repeats + 1):  # the first compiles the casts: not counted
                t = time.perf_counter()
                host = weights.host_copy(params)
                weights.send(sock, host, v)
                _, fields, _ = wire.recv(sock)
                if v:
                    times.append(time.perf_counter() - t)
                    places.append(fields["place_s"])
                size = weights.nbytes(host)
                del host
            wire.send(sock, "close")
        child.wait(timeout=60)
    finally:
        child.kill()
    t = np.array(times)
    return dict(
        model=name,
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
    parser.add_argument("--receive", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        return receive(0, args.receive)
    print("| model | params | bf16 GB | s per sync (median, min-max) | GB/s | placement s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = bench(name, args.repeats)
        print(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['gb']:.3f} | "
            f"{r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | {r['gbps']:.2f} | "
            f"{r['place_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

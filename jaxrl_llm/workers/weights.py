"""Policy weights from the trainer's devices to a rollout worker's, over the host (TCP).

    host = weights.host_copy(params)                       # {path: numpy bf16}, any layout
    weights.send(sock, host, version=7)                    # one frame (`wire`)
    ...                                                    # on the worker:
    kind, fields, arrays = wire.recv(conn)
    params = weights.place(arrays, cfg, mesh)              # the engine's shardings

The host path works on every backend: each parameter is cast on its devices to the wire
dtype (bfloat16 by default, what the rollout reads; `dtype=None` keeps each leaf's own),
gathered to the trainer's host once per sync whatever its mesh layout, sent as one frame
(a header of tree paths, shapes and dtypes, then the raw bytes), and put by the worker on
its own mesh with `models.param_shardings(cfg, mesh)`, so trainer and worker meshes need
not match. The bytes are the cast's bytes: `place(host_copy(p))` equals
`p.astype(bfloat16)` bit for bit. One host copy serves every worker of a sync.

A trainer of several processes: a parameter spanning them is gathered from all of them
(`parallel.to_host`), so there `host_copy` is a collective that every process calls, in
the same order; its `Host` result is then sent as it is (`rollout.shared`).

LoRA (parameters with adapters, `models.lora`): the base weights are frozen, so a sync
carries the adapters alone, in their own dtype, and the base crosses once per worker
connection (`Host.base`, copied once and kept by the caller for the next sync). The
worker merges them on its devices as the trainer's merge does (`Merger`: W + (alpha/r)
A B in float32, rounded to W's dtype, then cast to the wire dtype), so it samples what
the merged weights sent whole would give, for the adapters' bytes alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models, parallel
from jaxrl_llm.models import lora
from jaxrl_llm.workers import wire

SEP = "/"  # between the keys of a parameter's tree path on the wire


def flatten(params, prefix: tuple = ()) -> dict:
    """{('layers', 'q'): leaf} of a nested dict of parameters."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out |= flatten(value, prefix + (key,))
        else:
            out[prefix + (key,)] = value
    return out


class Host(dict):
    """A host copy ({'layers/q': numpy array}): what `host_copy` returns, and given to it
    again, returned as it is. With LoRA it holds the adapters; `base` is the frozen
    base's copy and `dtype` what the worker casts the merged weights to."""

    base: Host | None = None
    dtype: str | None = None


def host_copy(params, dtype: str | None = "bfloat16", base: Host | None = None) -> Host:
    """{'layers/q': numpy array} of `params` cast to `dtype` on their devices (None: as
    they are), fetched to this host; a parameter spanning processes is gathered from all
    of them (then a collective). Parameters with LoRA adapters: the adapters alone, as
    they are, with the base's copy (`base`, the one an earlier sync made, else made now)
    and `dtype` for the worker's merge (module docstring)."""
    if isinstance(params, Host):
        return params
    if lora.has_adapters(params):
        adapters, frozen = lora.split(params)
        host = _copy(adapters, None)
        host.base = base if base is not None else _copy(frozen, None)
        host.dtype = dtype
        return host
    return _copy(params, dtype)


def _copy(params, dtype: str | None) -> Host:
    flat = flatten(params)
    cast = flat if dtype is None else {p: jnp.asarray(x).astype(dtype) for p, x in flat.items()}
    spans = [p for p, x in cast.items() if isinstance(x, jax.Array) and not x.is_fully_addressable]
    got = jax.device_get({p: x for p, x in cast.items() if p not in spans})  # one wait for all
    got |= {p: parallel.to_host(cast[p]) for p in spans}
    return Host({SEP.join(map(str, p)): np.asarray(got[p]) for p in cast})


def send(sock, host: dict, version: int) -> None:
    """One `weights` frame: the host copy and its policy version."""
    wire.send(sock, "weights", {"version": int(version)}, host)


def place(arrays: dict, cfg, mesh, adapters: bool = False) -> dict:
    """The received {path: array} as the model's parameter tree on `mesh`, each with its
    sharding from the rule table; a missing, extra or misshapen parameter is an error
    naming it (the worker's model is not the trainer's). adapters: the LoRA adapters of
    `cfg` alone."""
    specs = {
        SEP.join(map(str, p)): (p, s)
        for p, s in models.param_specs(cfg).items()
        if not adapters or lora.is_adapter(p[-1])
    }
    missing, extra = sorted(specs.keys() - arrays.keys()), sorted(arrays.keys() - specs.keys())
    if missing or extra:
        raise wire.WorkerError(
            f"weights do not fit this worker's model: missing {missing[:3]}, extra {extra[:3]}"
        )
    shardings = flatten(models.param_shardings(cfg, mesh))
    placed = {}
    for name, (path, spec) in specs.items():
        x = arrays[name]
        if tuple(x.shape) != spec.shape:
            raise wire.WorkerError(
                f"weights: parameter {name} has shape {x.shape}, this worker's model {spec.shape}"
            )
        placed[path] = parallel.put(x, shardings[path])  # each process its own shards
    return models.params.unflatten(placed)


def lora_settings(cfg: models.LoraConfig) -> dict:
    """What a sync's adapters frame says of them (JSON), for `Merger.merge`."""
    return {"rank": int(cfg.rank), "alpha": float(cfg.alpha), "targets": list(cfg.targets)}


class Merger:
    """A worker's LoRA weights: the base placed once (`set_base`), then each sync's
    adapters merged into it on the worker's devices (`merge`) -> the plain model's
    parameters, cast to the wire dtype, in the engine's shardings."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh, self.base, self.programs = cfg, mesh, None, {}

    def set_base(self, arrays: dict) -> None:
        self.base = place(arrays, self.cfg, self.mesh)

    def merge(self, arrays: dict, settings: dict, dtype: str | None) -> dict:
        """`arrays`: the adapters of `settings` (`lora_settings`)."""
        if self.base is None:
            raise wire.WorkerError("LoRA adapters before the base weights")
        settings = models.LoraConfig(
            rank=int(settings["rank"]),
            alpha=float(settings["alpha"]),
            targets=tuple(settings["targets"]),
        )
        cfg = self.cfg.replace(lora=settings)
        adapters = place(arrays, cfg, self.mesh, adapters=True)
        key = (cfg.lora, dtype)
        if key not in self.programs:

            def merged(p):
                out = lora.merge(cfg, p)
                return out if dtype is None else jax.tree.map(lambda x: x.astype(dtype), out)

            shardings = models.param_shardings(self.cfg, self.mesh)
            self.programs[key] = jax.jit(merged, out_shardings=shardings)
        return self.programs[key](lora.combine(self.base, adapters))


def nbytes(host: dict) -> int:
    """Bytes a sync of this host copy sends."""
    return sum(x.nbytes for x in host.values())

"""Weight sync through `jax.experimental.transfer` (`rollout.worker_sync='transfer'`): each
process of a worker pulls its own shards straight from the trainer's devices; the
worker's link carries only the address and the uuids.

    layout = slices(cfg, worker_mesh)           # the worker, once ('open' answer)
    offer = Offer(toward="10.0.0.7")            # the trainer: a server the workers reach
    cast = offer.cast(params, "bfloat16")       # once per sync, on the trainer's devices
    fields = offer.offer(cast, layout)          # per worker: address, uuids, dtypes
    params = Puller(cfg, worker_mesh).pull(fields)   # every process of the worker

The worker's process 0 tells the trainer once which slice of each parameter each device
of its world holds (`Sharding.devices_indices_map` under the engine's shardings); each
sync the trainer casts the parameters on its devices, cuts each worker process's slices
there and offers each process its list under a random 63-bit uuid of its own (a process
pulling another's uuid would take buffers by its local index, and the second puller
would find them fetched); each process pulls its list onto its devices and assembles
the parameters (`jax.make_array_from_single_device_arrays`). What arrives equals the host
path's `place(host_copy(params))` bit for bit.

The transfer server checks nobody: whoever reaches its port and names a uuid offered
and not yet pulled takes those arrays. The uuids cross the worker's authenticated link
only, are random and are used once; the arrays cross unencrypted (the config check
refuses TLS with this path). An offer a lost worker never pulls stays in the server
until the fleet replaces the server (`Fleet.push`, after a sync that lost a worker).
"""

from __future__ import annotations

import functools
import json
import secrets
import socket

import jax

from jaxrl_llm import models
from jaxrl_llm.workers import weights, wire


def slices(cfg, mesh) -> dict:
    """{process (str): [(parameter, device id, [[start, stop] per axis])]}: the shard of
    each parameter that each device of `mesh` holds under the engine's shardings, in one
    order for both sides (JSON, the 'open' answer's `slices`)."""
    out, shardings = {}, weights.flatten(models.param_shardings(cfg, mesh))
    for path, spec in models.param_specs(cfg).items():
        for device, index in shardings[path].devices_indices_map(spec.shape).items():
            bounds = [
                [i.start or 0, spec.shape[a] if i.stop is None else i.stop]
                for a, i in enumerate(index)
            ]
            out.setdefault(str(device.process_index), []).append(
                (weights.SEP.join(map(str, path)), device.id, bounds)
            )
    return out


def local_address(toward: str) -> str:
    """This host's address on the route to host `toward` (no packet is sent): the one a
    server must listen on for that host to reach it."""
    family, kind, _, _, where = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(where)
        return s.getsockname()[0]


def _server(host: str):
    from jax.experimental import transfer

    client = jax.local_devices()[0].client
    where = f"[{host}]:0" if ":" in host else f"{host}:0"
    return transfer.start_transfer_server(client, where, [where])


class Offer:
    """The trainer's side: a transfer server on this host's address toward `toward` (a
    worker's host), and the offers of each sync."""

    def __init__(self, toward: str):
        self.host = local_address(toward)
        self.server = _server(self.host)
        self.cutters: dict = {}  # a worker process's slices (JSON) -> the program cutting them

    def reset(self) -> None:
        """A new server: the old one, and any offer nobody pulled, goes."""
        self.server = _server(self.host)

    @staticmethod
    def cast(params, dtype: str | None) -> dict:
        """{'layers/q': device array} of `params` cast to `dtype` (None: as they are) on
        their devices: one copy for every worker of a sync (and a worker that joins)."""
        return {
            weights.SEP.join(map(str, path)): x if dtype is None else x.astype(dtype)
            for path, x in weights.flatten(params).items()
        }

    def offer(self, cast: dict, layout: dict) -> dict:
        """Each process of a worker of `layout` (its `slices`) offered its slices of
        `cast` under a fresh uuid -> the weights frame's fields (address, uuids by
        process, each parameter's dtype)."""
        names = {name for items in layout.values() for name, _, _ in items}
        if names != cast.keys():
            raise wire.WorkerError(
                f"weights do not fit the worker's model: missing {sorted(names - cast.keys())[:3]}"
                f", extra {sorted(cast.keys() - names)[:3]}"
            )
        devices = {  # where each parameter's slices may go (a pull takes one device's)
            name: sorted(x.sharding.device_set, key=lambda d: d.id) for name, x in cast.items()
        }
        uuids = []
        for process in range(len(layout)):
            items = layout[str(process)]
            key = json.dumps(items)
            if key not in self.cutters:  # one program per worker process's slices
                self.cutters[key] = jax.jit(functools.partial(_cut, items))
            cut = self.cutters[key](cast)
            cut = [
                jax.device_put(x, devices[name][k % len(devices[name])])
                for k, (x, (name, _, _)) in enumerate(zip(cut, items, strict=True))
            ]
            uuids.append(secrets.randbits(63))
            self.server.await_pull(uuids[-1], cut)
        dtypes = {name: str(x.dtype) for name, x in cast.items()}
        return {"address": self.server.address(), "uuids": uuids, "dtypes": dtypes}


def _cut(items: list, cast: dict) -> list:
    """The slices `items` ([(parameter, device, bounds)]) of `cast`: one program for all.
    Each then goes to one trainer device holding its parameter (round robin, so the
    pulls spread over them): a pull takes single-device arrays, and a slice of a sharded
    parameter may span several devices."""
    return [
        jax.lax.slice(cast[name], [a for a, _ in bounds], [b for _, b in bounds])
        for name, _, bounds in items
    ]


class Puller:
    """A worker process's side: the world's slices (`layout`) and its own, the parameters'
    shardings, and (from the first pull) a transfer server and a connection to the
    trainer's; `pull(fields)` takes a sync's shards under this process's uuid -> the
    parameter tree on `mesh`."""

    def __init__(self, cfg, mesh):
        self.specs = models.param_specs(cfg)
        self.shardings = weights.flatten(models.param_shardings(cfg, mesh))
        self.layout = slices(cfg, mesh)  # every process's, for the 'open' answer
        self.mine = self.layout.get(str(jax.process_index()), [])
        self.devices = {d.id: d for d in mesh.devices.flat}
        self.server, self.conn, self.address, self.wants = None, None, None, {}

    def pull(self, fields: dict) -> dict:
        address, dtypes = fields["address"], fields["dtypes"]
        if set(dtypes) != {weights.SEP.join(map(str, p)) for p in self.specs}:
            raise wire.WorkerError("weights do not fit this worker's model (transfer sync)")
        if address != self.address:  # a new trainer, or its server replaced
            host = address.rpartition(":")[0].strip("[]")
            if self.server is None:
                self.server = _server(local_address(host))
            self.conn, self.address = self.server.connect(address), address
        key = tuple(sorted(dtypes.items()))
        if key not in self.wants:
            self.wants = {key: self._want(dtypes)}  # one dtype set at a time
        got = self.conn.pull(int(fields["uuids"][jax.process_index()]), self.wants[key])
        shards = {}
        for (name, _, _), x in zip(self.mine, got, strict=True):
            shards.setdefault(name, []).append(x)
        placed = {
            path: jax.make_array_from_single_device_arrays(
                spec.shape, self.shardings[path], shards[weights.SEP.join(map(str, path))]
            )
            for path, spec in self.specs.items()
        }
        return models.params.unflatten(placed)

    def _want(self, dtypes: dict) -> list:
        return [
            jax.ShapeDtypeStruct(
                tuple(b - a for a, b in bounds),
                dtypes[name],
                sharding=jax.sharding.SingleDeviceSharding(self.devices[device]),
            )
            for name, device, bounds in self.mine
        ]

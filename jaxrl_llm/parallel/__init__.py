"""Device mesh ('data', 'fsdp', 'context', 'tensor') and batch sharding (`mesh`, whose names are
also this package's), the host allocator, XLA's flags on CPU, multi-host start-up.

The mesh names are imported on first use: `from jaxrl_llm.parallel import allocator,
xla_flags`, the command lines' first step (they set XLA's CPU flags and re-run
themselves under tcmalloc), imports no jax.
"""

import importlib

__all__ = [
    "BATCH_AXES",
    "MESH_AXES",
    "batch_sharding",
    "batch_size_multiple",
    "host_max",
    "host_mean",
    "local_rows",
    "make_mesh",
    "mesh_shape",
    "put",
    "shard_batch",
    "shard_local_batch",
    "share",
    "to_host",
    "to_mesh",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("jaxrl_llm.parallel.mesh"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

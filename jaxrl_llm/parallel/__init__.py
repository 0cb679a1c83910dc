"""Device mesh ('data', 'fsdp', 'tensor') and batch sharding."""

from jaxrl_llm.parallel.mesh import (
    BATCH_AXES,
    MESH_AXES,
    batch_sharding,
    batch_size_multiple,
    host_max,
    host_mean,
    local_rows,
    make_mesh,
    mesh_shape,
    shard_batch,
    shard_local_batch,
    to_mesh,
)

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
    "shard_batch",
    "shard_local_batch",
    "to_mesh",
]

"""Mesh construction, the logical-axis rules and batch sharding on 8 fake CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from jaxrl_llm import models, parallel


def test_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize(
    "sizes,expected",
    [
        ({"fsdp": -1}, (1, 8, 1, 1, 1)),
        ({"data": 2, "fsdp": -1, "tensor": 2}, (2, 2, 1, 1, 2)),
        ({"data": 1, "fsdp": 2, "tensor": 4}, (1, 2, 1, 1, 4)),
        ({"tensor": -1}, (1, 1, 1, 1, 8)),
        ({"fsdp": -1, "context": 4}, (1, 2, 1, 4, 1)),
        ({"fsdp": 2, "expert": -1}, (1, 2, 4, 1, 1)),
    ],
)
def test_mesh_shape(sizes, expected):
    assert parallel.mesh_shape(sizes, 8) == expected


@pytest.mark.parametrize(
    "sizes,message",
    [
        ({"data": -1, "fsdp": -1}, r"only one axis may be -1"),
        ({"data": 3, "fsdp": -1}, r"mesh\.fsdp=-1: 8 devices are not divisible by .* 3"),
        (
            {"data": 2, "fsdp": 2},
            r"data x fsdp x expert x context x tensor = 4 but there are 8 devices",
        ),
        ({"pipeline": 2}, r"unknown mesh axis \['pipeline'\]"),
        ({"data": 0, "fsdp": -1}, r"mesh\.data=0"),
    ],
)
def test_mesh_shape_errors(sizes, message):
    with pytest.raises(ValueError, match=message):
        parallel.mesh_shape(sizes, 8)


def test_mesh_axes_are_auto():
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_rules_map_logical_axes():
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    spec = models.logical_to_spec(("layers", "embed", "mlp"), (2, 64, 128), mesh)
    assert spec == PartitionSpec(None, "fsdp", "tensor")
    # 2 KV heads cannot be split 4 ways: replicated over tensor instead of failing.
    spec = models.logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 2, 8), mesh)
    assert spec == PartitionSpec(None, "fsdp", None, None)
    with pytest.raises(KeyError, match=r"logical axis 'nope' has no partitioning rule"):
        models.logical_to_spec(("nope",), (4,), mesh)


def test_every_param_has_logical_axes():
    cfg = models.ModelConfig("Qwen2ForCausalLM", 64, 32, 48, 2, 4, 2, 8, qkv_bias=True)
    specs = models.param_specs(cfg)
    assert specs and all(len(s.axes) == len(s.shape) for s in specs.values())
    assert all(s.axes[0] == "layers" for p, s in specs.items() if p[0] == "layers")


def test_init_params_sharded():
    cfg = models.ModelConfig("LlamaForCausalLM", 64, 32, 48, 2, 4, 4, 8)
    mesh = parallel.make_mesh({"fsdp": 2, "tensor": 4})
    params = models.init_params(cfg, seed=0, mesh=mesh)
    assert params["layers"]["gate"].sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert params["embed"].sharding.spec == PartitionSpec("tensor", "fsdp")
    same = models.init_params(cfg, seed=0)
    np.testing.assert_array_equal(params["layers"]["gate"], same["layers"]["gate"])


def test_shard_batch():
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    x = np.arange(8 * 3).reshape(8, 3)
    y = parallel.shard_batch(x, mesh)
    assert y.sharding.spec == PartitionSpec(("data", "fsdp", "expert"), None)
    assert y.addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(y, x)
    message = r"batch size 6 is not divisible by data x fsdp x expert = 4"
    with pytest.raises(ValueError, match=message):
        parallel.shard_batch(np.zeros((6, 3)), mesh)


def test_to_mesh_keeps_specs_where_the_new_mesh_divides():
    """Parameters moved from a 4-device training mesh (fsdp 2 x tensor 2) to the other 4
    devices (fsdp 1 x tensor 4): same values, on the new devices, each spec kept where the
    new axis sizes divide the dimension, replicated or narrowed where they do not."""
    devices = jax.devices()
    train = parallel.make_mesh({"fsdp": 2, "tensor": 2}, devices[:4])
    rollout = parallel.make_mesh({"fsdp": 1, "tensor": 4}, devices[4:])
    tree = {
        "w": jax.device_put(
            np.arange(48.0).reshape(4, 12), NamedSharding(train, P("fsdp", "tensor"))
        ),
        "odd": jax.device_put(
            np.arange(12.0).reshape(2, 6), NamedSharding(train, P(None, "tensor"))
        ),
        "b": jax.device_put(np.arange(4.0), NamedSharding(train, P(("fsdp", "tensor")))),
    }
    moved = parallel.to_mesh(tree, rollout)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(tree[k]))
        assert set(moved[k].sharding.device_set) == set(devices[4:])
    assert moved["w"].sharding.spec == P("fsdp", "tensor")
    assert moved["odd"].sharding.spec == P(None, None)  # 6 is not divisible by tensor = 4
    assert moved["b"].sharding.spec == P(("fsdp", "tensor"))

"""Checkpointer: exact round trips across shardings, schedule, GC, crashes, SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import make_mesh
from jaxrl_llm.trainer import checkpoint
from jaxrl_llm.trainer.checkpoint import Checkpointer, install_sigterm_handler, with_shardings


@struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    critic: dict | None
    step: jax.Array
    rng: jax.Array


def _state(mesh):
    """Sharded params, an adamw state after two real updates, a typed key, critic=None."""
    w = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) / 7.0
    params = {
        "w": jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))),
        "b": jax.device_put(jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
    }
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    for i in range(2):
        grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)).astype(x.dtype), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return TrainState(params, opt_state, None, jnp.asarray(2, jnp.int32), jax.random.key(7))


def _host(tree):
    """Leaves as numpy (typed keys as their uint32 data), for bitwise comparison."""

    def get(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(get, tree)


def _assert_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def test_round_trip_is_exact_into_another_sharding(tmp_path):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = _state(mesh)
    expected = _host(state)
    extra = {"data": {"epoch": 1, "index": np.int64(37)}, "seed": 3, "config": {"lr": 1e-2}}
    ckpt = Checkpointer(tmp_path / "ckpt", save_interval_steps=1)
    target = with_shardings(state)
    assert ckpt.save(2, state, extra)
    # The save copied the arrays to host before returning: donating them now is safe.
    jax.tree.map(lambda x: x.delete(), state)
    ckpt.close()

    other = NamedSharding(mesh, P("tensor", ("data", "fsdp")))
    target = jax.tree.map(
        lambda x: (
            x.update(sharding=other) if x.ndim == 2 else x.update(sharding=NamedSharding(mesh, P()))
        ),
        target,
    )
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 2
    restored, got_extra = ckpt.restore(target=target)
    assert isinstance(restored, TrainState) and restored.critic is None
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert x.sharding == t.sharding
    _assert_identical(_host(restored), expected)
    assert got_extra == {"data": {"epoch": 1, "index": 37}, "seed": 3, "config": {"lr": 1e-2}}
    # The restored key draws the same numbers as the original one.
    np.testing.assert_array_equal(
        jax.random.uniform(restored.rng, (4,)), jax.random.uniform(jax.random.key(7), (4,))
    )


def test_a_compressed_checkpoint_still_restores_exactly(tmp_path, monkeypatch):
    """Saves are uncompressed (a compressed save holds a second copy of the state in host
    memory); checkpoints written compressed, as before, restore bit for bit."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = _state(mesh)
    expected = _host(state)
    handler = checkpoint.ocp.PyTreeCheckpointHandler
    monkeypatch.setattr(
        checkpoint.ocp,
        "PyTreeCheckpointHandler",
        lambda **kw: handler(**kw | {"use_compression": True}),
    )
    with Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
        ckpt.save(3, state, {"step": 3})
    monkeypatch.undo()
    restored, extra = Checkpointer(tmp_path, read_only=True).restore(target=with_shardings(state))
    _assert_identical(_host(restored), expected)
    assert extra == {"step": 3}


def test_schedule_force_and_keep_last_k(tmp_path):
    state = {"x": jnp.arange(4.0)}
    ckpt = Checkpointer(tmp_path, keep=2, save_interval_steps=2)
    saved = [s for s in range(1, 8) if ckpt.save(s, {"x": state["x"] + s}, {"s": s})]
    assert saved == [2, 4, 6]
    assert ckpt.save(7, {"x": state["x"] + 7}, {"s": 7}, force=True)
    assert not ckpt.save(7, state, force=True)  # already saved: a no-op, not an error
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]
    restored, extra = ckpt.restore(
        6, target={"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=state["x"].sharding)}
    )
    np.testing.assert_array_equal(restored["x"], np.arange(4.0) + 6)
    assert extra == {"s": 6}
    ckpt.close()


def test_restore_without_target_and_partial(tmp_path):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = _state(mesh)
    expected = _host(state)
    with Checkpointer(tmp_path, save_interval_steps=1, async_save=False) as ckpt:
        ckpt.save(5, state)
    ckpt = Checkpointer(tmp_path, read_only=True)
    raw, extra = ckpt.restore()
    assert extra == {} and raw["critic"] is None
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(raw))
    np.testing.assert_array_equal(raw["params"]["w"], expected.params["w"])
    np.testing.assert_array_equal(raw["rng"], expected.rng)

    abstract = ckpt.abstract_state()
    assert abstract["params"]["b"] == jax.ShapeDtypeStruct((16,), jnp.bfloat16)
    sharding = NamedSharding(mesh, P())
    target = {"params": jax.tree.map(lambda s: s.update(sharding=sharding), abstract["params"])}
    only, _ = ckpt.restore(5, target=target, partial=True)
    assert set(only) == {"params"}
    _assert_identical(_host(only["params"]), expected.params)


def test_errors_name_the_problem(tmp_path):
    with Checkpointer(tmp_path, save_interval_steps=1, async_save=False) as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            ckpt.restore()
        with pytest.raises(TypeError, match="object is not JSON"):
            ckpt.save(1, {"x": jnp.ones(2)}, {"bad": object()})
        ckpt.save(1, {"x": jnp.ones(2)})
        with pytest.raises(FileNotFoundError, match=r"step 3; saved steps: \[1\]"):
            ckpt.restore(3)
        with pytest.raises(ValueError, match=r"\['x'\]: ShapeDtypeStruct without a sharding"):
            ckpt.restore(target={"x": jax.ShapeDtypeStruct((2,), jnp.float32)})


_KILLED_MID_SAVE = """
import os, signal, sys
import jax.numpy as jnp
from jaxrl_llm.trainer.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], save_interval_steps=10)
ckpt.save(10, {"x": jnp.full((4,), 10.0)})
ckpt.wait()
ckpt.save(20, {"x": jnp.ones((16, 1024, 1024))})  # 64 MB: still being written when...
os.kill(os.getpid(), signal.SIGKILL)  # ...the process dies, as on a hard preemption
"""


def test_a_save_killed_midway_is_ignored(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_MID_SAVE), str(tmp_path)], env=env
    )
    assert proc.returncode == -signal.SIGKILL
    assert "20.orbax-checkpoint-tmp" in os.listdir(tmp_path)

    reader = Checkpointer(tmp_path, read_only=True)  # sees only finished steps, deletes nothing
    assert reader.latest_step() == 10
    assert "20.orbax-checkpoint-tmp" in os.listdir(tmp_path)
    owner = Checkpointer(tmp_path, save_interval_steps=10)  # the resumed trainer
    assert owner.latest_step() == 10
    target = {"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jnp.ones(1).sharding)}
    np.testing.assert_array_equal(owner.restore(target=target)[0]["x"], np.full(4, 10.0))
    # It removes the leftover (in the background, awaited before its first save) and
    # saves step 20 again.
    assert owner.save(20, {"x": jnp.full((4,), 20.0)})
    owner.wait()
    assert sorted(os.listdir(tmp_path)) == ["10", "20"]
    np.testing.assert_array_equal(owner.restore(target=target)[0]["x"], np.full(4, 20.0))
    owner.close()


def test_sigterm_sets_the_flag_instead_of_killing():
    before = signal.getsignal(signal.SIGTERM)
    flag = install_sigterm_handler()
    try:
        assert not flag.requested and not flag.stop_at(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.stop_at(3)
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) is before


_HOST = """
import os, signal, sys, time
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jaxrl_llm.trainer.checkpoint import Checkpointer, install_sigterm_handler
from jaxrl_llm.parallel import make_mesh, shard_batch
flag = install_sigterm_handler()
ckpt = Checkpointer(directory, save_interval_steps=1000)
x = shard_batch(np.arange(16.0).reshape(8, 2), make_mesh({"data": 4}))  # rows on both hosts
for step in range(1, 1000):
    if pid == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGTERM)  # only host 1 is preempted
    if flag.stop_at(step):
        ckpt.save(step, {"x": x * step}, {"step": step}, force=True)
        break
    time.sleep(0.02)
ckpt.close()
print(f"python handler: {flag.installed}; stopped at {step}")
jax.distributed.shutdown()
"""


def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    hosts = [
        subprocess.Popen(
            [sys.executable, "-c", _HOST, str(port), str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [h.communicate(timeout=120)[0].strip().splitlines()[-1] for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
    assert all(h.returncode == 0 for h in hosts), outs
    # JAX's preemption service caught the signal (no Python handler replaced its own)
    # and both hosts saved the same step.
    assert outs[0] == outs[1] and outs[0].startswith("python handler: False; stopped at ")
    step = int(outs[0].rsplit(" ", 1)[1])
    state, extra = Checkpointer(tmp_path, read_only=True).restore()  # one host reads it all
    assert extra == {"step": step}
    np.testing.assert_array_equal(state["x"], np.arange(16.0).reshape(8, 2) * step)

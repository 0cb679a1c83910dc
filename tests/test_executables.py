"""Stored executables: a program loaded from the store computes what its jitted function
computes, on the devices of its mesh in the mesh's order, with donation; any change of
what keys it (arguments, context) misses; a damaged file is replaced."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import compilation, executables


def _mesh():
    """8 devices in a permuted order: a loaded program must keep its shards in place."""
    devices = jax.devices()
    order = [3, 0, 6, 1, 7, 2, 5, 4]
    return Mesh(np.array([devices[i] for i in order]).reshape(2, 4), ("data", "fsdp"))


def _program(mesh):
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def f(state, x, *, scale):
        return state + scale * jnp.cumsum(x, axis=1), {"total": jnp.sum(x)}

    jitted = jax.jit(f, static_argnames="scale", donate_argnums=0, out_shardings=(rows, None))
    return executables.Program(jitted, static_argnames=("scale",)), rows


def _arrays(rows, n=16):
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 7
    return jax.device_put(np.ones((n, 4), np.float32), rows), jax.device_put(x, rows)


def test_loaded_program_equals_the_jitted_one_on_a_permuted_mesh(tmp_path):
    mesh = _mesh()
    program, rows = _program(mesh)
    store = executables.Store(str(tmp_path), "context")
    state, x = _arrays(rows)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            (state, x))  # fmt: skip
    assert store.read("f", program, abstract, {"scale": 2.0}) is None
    compiled = program.lower(*abstract, scale=2.0).compile()
    program.install(store.save("f", program, abstract, {"scale": 2.0}, compiled))
    expected = jax.device_get(program(state, x, scale=2.0))

    # As a new process would: a fresh jitted function, the executable from the store.
    fresh, rows = _program(mesh)
    entry = store.read("f", fresh, abstract, {"scale": 2.0})  # ShapeDtypeStructs: same key
    assert entry is not None and entry.out_info[0].shape == (16, 4)
    fresh.install(entry.load())
    state, x = _arrays(rows)
    out = fresh(state, x, scale=2.0)
    assert state.is_deleted()  # donated, as by the jitted function
    np.testing.assert_array_equal(jax.device_get(out[0]), expected[0])
    assert float(out[1]["total"]) == float(expected[1]["total"])
    assert out[0].sharding == rows
    for shard in out[0].addressable_shards:  # every row on the device the mesh puts it on
        np.testing.assert_array_equal(np.asarray(shard.data), expected[0][shard.index])

    # Other shapes or another static argument: the jitted function, traced as usual.
    state, x = _arrays(rows, n=8)
    np.testing.assert_allclose(fresh(state, x, scale=3.0)[1]["total"], float(jnp.sum(x)))
    assert len(fresh.installed) == 1


def _cumsum(x):
    return jnp.cumsum(x * jnp.arange(x.shape[1], dtype=jnp.float32)[None], axis=1)


def _saved_from_cache(tmp_path, compiled, held):
    """The program saved with the bytes XLA's cache held, loaded into a fresh Program."""
    assert len(held) == 1
    x = np.arange(16 * 64, dtype=np.float32).reshape(16, 64) / 100
    program = executables.Program(jax.jit(_cumsum))
    store = executables.Store(str(tmp_path / "store"), "context")
    store.save("f", program, (x,), {}, compiled, cached=held[0])
    fresh = executables.Program(jax.jit(_cumsum))
    fresh.install(store.read("f", fresh, (x,), {}).load())
    np.testing.assert_array_equal(np.asarray(fresh(x)), np.asarray(jax.jit(_cumsum)(x)))


def test_a_program_from_xla_cache_is_stored_as_the_cache_held_it(tmp_path, monkeypatch):
    """A fresh compile is stored with the bytes XLA's persistent cache wrote (serializing
    it again would cost as long, before its first call could run); an executable that
    the cache answers re-serializes without its kernels (`NOT_FOUND: Function ... not
    found` when run after loading), so the store keeps the bytes the cache held. Both
    load and run."""
    x = np.arange(16 * 64, dtype=np.float32).reshape(16, 64) / 100
    previous = jax.config.jax_compilation_cache_dir  # the test session's (conftest)
    compilation.use_cache(str(tmp_path / "xla"))
    try:
        jax.clear_caches()
        with executables.cache_held() as written:  # XLA compiles, the cache keeps it
            compiled = executables.Program(jax.jit(_cumsum)).lower(x).compile()
        jax.clear_caches()  # as a new process would: only the persistent cache is left
        with executables.cache_held() as reads:
            from_cache = executables.Program(jax.jit(_cumsum)).lower(x).compile()
    finally:
        compilation.use_cache(previous or "")
    assert written == reads  # the cache answers with the bytes it was given
    with monkeypatch.context() as m:  # nothing is serialized again
        m.setattr(executables.serialize_executable, "serialize", None)
        _saved_from_cache(tmp_path / "written", compiled, written)
    _saved_from_cache(tmp_path / "read", from_cache, reads)


def test_a_different_context_or_signature_misses_and_a_damaged_file_is_replaced(tmp_path):
    program, rows = _program(_mesh())
    store = executables.Store(str(tmp_path), "config A")
    state, x = _arrays(rows)
    compiled = program.lower(state, x, scale=1.0).compile()
    store.save("f", program, (state, x), {"scale": 1.0}, compiled)
    (path,) = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path)]
    assert store.read("f", program, (state, x), {"scale": 1.0}) is not None
    assert store.read("g", program, (state, x), {"scale": 1.0}) is None  # another program
    assert store.read("f", program, (state, x), {"scale": 0.5}) is None  # static argument
    assert store.read("f", program, (state, x.astype(jnp.bfloat16)), {"scale": 1.0}) is None
    replicated = jax.device_put(x, NamedSharding(rows.mesh, P()))
    assert store.read("f", program, (state, replicated), {"scale": 1.0}) is None  # sharding
    other = executables.Store(str(tmp_path), "config B")
    assert other.read("f", program, (state, x), {"scale": 1.0}) is None
    with open(path, "r+b") as f:  # truncated
        f.truncate(100)
    assert store.read("f", program, (state, x), {"scale": 1.0}) is None
    assert not os.path.exists(path)


def test_the_least_recently_used_programs_go_beyond_the_size(tmp_path, monkeypatch):
    program, rows = _program(_mesh())
    store = executables.Store(str(tmp_path / "store"), "context")
    aside = executables.Store(str(tmp_path / "aside"), "context")
    tmp_path = tmp_path / "store"
    sizes = []
    for i, n in enumerate((8, 16, 24)):
        state, x = _arrays(rows, n)
        store.save("f", program, (state, x), {"scale": 1.0},
                   program.lower(state, x, scale=1.0).compile())  # fmt: skip
        newest = max(os.listdir(tmp_path), key=lambda n: os.stat(tmp_path / n).st_mtime_ns)
        os.utime(tmp_path / newest, (1000 + i, 1000 + i))  # an ordered history
        sizes.append(os.path.getsize(tmp_path / newest))
    first = _arrays(rows, 8)
    assert store.read("f", program, first, {"scale": 1.0}) is not None  # used: now newest
    state, x = _arrays(rows, 32)
    compiled = program.lower(state, x, scale=1.0).compile()
    aside.save("f", program, (state, x), {"scale": 1.0}, compiled)
    (newest,) = os.listdir(aside.directory)
    # Room for the one just used and the new one: the two in between go.
    limit = sizes[0] + os.path.getsize(os.path.join(aside.directory, newest))
    monkeypatch.setattr(executables, "MAX_BYTES", limit)
    store.save("f", program, (state, x), {"scale": 1.0}, compiled)
    assert store.read("f", program, (state, x), {"scale": 1.0}) is not None
    assert store.read("f", program, first, {"scale": 1.0}) is not None
    assert store.read("f", program, _arrays(rows, 16), {"scale": 1.0}) is None
    assert store.read("f", program, _arrays(rows, 24), {"scale": 1.0}) is None


@pytest.mark.parametrize("change", ["source", "option", "cpu"])
def test_the_fingerprint_follows_the_source_jax_options_and_the_cpu(change, tmp_path, monkeypatch):
    before = executables.fingerprint()
    executables.fingerprint.cache_clear()
    precision = jax.config.jax_default_matmul_precision
    if change == "source":
        root = tmp_path / "jaxrl_llm"
        root.mkdir()
        (root / "executables.py").write_text("# another version\n")
        monkeypatch.setattr(executables, "__file__", str(root / "executables.py"))
    elif change == "option":
        jax.config.update("jax_default_matmul_precision", "highest")
    else:  # a cache directory shared with a machine of other instruction sets
        monkeypatch.setattr(executables, "_host_cpu", lambda: "x86_64 flags: sse2")
    try:
        assert executables.fingerprint() != before
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
        executables.fingerprint.cache_clear()

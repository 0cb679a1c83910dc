"""Rollout workers in their own processes: the wire, weight sync, a worker serving the
stream seam, a worker killed mid-step."""

import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel
from jaxrl_llm.workers import weights, wire

TOKEN = "test-token-0123456789"


def _receive_once(listener, cfg, mesh, got: dict) -> None:
    """A worker's side of one sync: authorize, receive, place, acknowledge."""
    conn, _ = listener.accept()
    with conn:
        if not wire.authorize(conn, TOKEN):
            got["refused"] = True
            return
        kind, fields, arrays = wire.recv(conn)
        got["params"] = weights.place(arrays, cfg, mesh)
        got["version"] = fields["version"]
        wire.send(conn, "ok", {"version": fields["version"]})


def test_weights_round_trip_to_another_mesh_bitwise():
    """Parameters sharded fsdp 4 x tensor 2 arrive on a 2-device fsdp mesh equal, bit for
    bit, to `params.astype(bfloat16)`, with their version, each with its engine sharding."""
    cfg = tiny_model_config()
    src = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, jax.devices())
    dst = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[6:])
    params = models.init_params(cfg, seed=1, mesh=src)
    listener = wire.listen("127.0.0.1", 0)
    got: dict = {}
    t = threading.Thread(target=_receive_once, args=(listener, cfg, dst, got))
    t.start()
    with wire.connect(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN) as sock:
        weights.send(sock, weights.host_copy(params), version=7)
        assert wire.recv(sock)[1] == {"version": 7}
    t.join()
    listener.close()
    assert got["version"] == 7
    want = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params)
    shardings = models.param_shardings(cfg, dst)
    for (path, a), b, s in zip(
        jax.tree_util.tree_leaves_with_path(got["params"]),
        jax.tree.leaves(want),
        jax.tree.leaves(shardings),
        strict=True,
    ):
        assert a.dtype == jax.numpy.bfloat16 and a.sharding == s, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), b.view(np.uint16))


def test_wrong_token_is_refused_with_one_line():
    cfg = tiny_model_config()
    listener = wire.listen("127.0.0.1", 0)
    got: dict = {}
    t = threading.Thread(target=_receive_once, args=(listener, cfg, None, got))
    t.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(wire.WorkerError, match=f"worker {address} refused .*: wrong token"):
        wire.connect(address, "not-the-token")
    t.join()
    listener.close()
    assert got == {"refused": True}


def test_frames_refuse_unknown_dtypes_and_oversized_hellos():
    """No pickled objects on the wire, and nothing big before the token is checked."""
    a, b = wire.socket.socketpair()
    with a, b:
        with pytest.raises(TypeError, match="dtype object"):
            wire.send(a, "x", {}, {"o": np.array([None], object)})
        wire.send(a, "hello", {"token": "t" * (2 * wire.HELLO_BYTES)})
        with pytest.raises(wire.WorkerError, match="header of .* refused"):
            wire.recv(b, max_header=wire.HELLO_BYTES)

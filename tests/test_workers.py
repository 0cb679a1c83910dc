"""Rollout workers in their own processes: the wire, weight sync, a worker serving the
stream seam, environments' turns and agents' requests, a worker killed mid-step."""

import importlib.util
import threading
import time
import types

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


def test_lora_copies_and_merges_leave_the_base_alone():
    """With LoRA adapters, the rollout thread's copy of what the update donates
    (`thread.owned`) copies the adapters and shares the frozen base; a plain tree is
    copied whole. A worker's `Merger` refuses adapters before it has the base."""
    from jaxrl_llm.models import lora
    from jaxrl_llm.rollout import thread

    cfg = tiny_model_config().replace(lora=models.LoraConfig(rank=2, alpha=4.0))
    base = models.init_params(tiny_model_config(), seed=1)
    params = lora.combine(base, lora.init_adapters(cfg, seed=2))
    copy = thread.owned(params)
    assert jax.tree.structure(copy) == jax.tree.structure(params)
    for path, leaf in weights.flatten(copy).items():
        original = weights.flatten(params)[path]
        assert (leaf is original) != lora.is_adapter(path[-1]), path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
    plain = zip(jax.tree.leaves(thread.owned(base)), jax.tree.leaves(base), strict=True)
    assert not any(a is b for a, b in plain)
    host = weights.host_copy(params)
    merger = weights.Merger(cfg, None)
    with pytest.raises(wire.WorkerError, match="LoRA adapters before the base weights"):
        merger.merge(dict(host), weights.lora_settings(cfg.lora), host.dtype)


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


def _self_signed(where, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (its subjectAltName) and its key, by the
    openssl command line -> (cert path, key path)."""
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = str(where / f"{name}.pem"), str(where / f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_serves_trainers_that_check_its_certificate(tmp_path):
    """A worker serving over TLS (`serve(..., tls=wire.server_context(cert, key))`): a
    trainer with its certificate as CA (`rollout.worker_tls_ca`) is served, encrypted; a
    plain trainer gets one line saying the worker speaks TLS; a trainer expecting another
    certificate refuses the worker before sending the token; a TLS trainer reaching a
    plain worker gets one line. Each refused connection leaves the worker serving."""
    import types

    from jaxrl_llm.workers import serve

    cert, key = _self_signed(tmp_path, "worker")
    other, _ = _self_signed(tmp_path, "other")
    echo = lambda kind, fields, arrays: ({"kind": kind}, {})  # noqa: E731
    worker = types.SimpleNamespace(reset=lambda: None, handle=echo)
    addresses = []
    for tls in (wire.server_context(cert, key), None):
        listener = wire.listen("127.0.0.1", 0)
        args = (worker, listener, TOKEN, tls)
        threading.Thread(target=serve.serve, args=args, daemon=True).start()
        addresses.append(f"127.0.0.1:{listener.getsockname()[1]}")
    secure, plain = addresses
    with pytest.raises(wire.WorkerError, match=f"worker {secure} refused .*speaks TLS"):
        wire.connect(secure, TOKEN, timeout_s=10)
    with pytest.raises(wire.WorkerError, match=f"worker {secure}: TLS handshake failed"):
        wire.connect(secure, TOKEN, timeout_s=10, tls=wire.client_context(other))
    with pytest.raises(wire.WorkerError, match=f"worker {plain}: TLS handshake failed"):
        wire.connect(plain, TOKEN, timeout_s=10, tls=wire.client_context(cert))
    sock = wire.connect(secure, TOKEN, timeout_s=10, tls=wire.client_context(cert))
    with sock:
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        wire.send(sock, "open", {}, {"x": np.arange(3, dtype=np.int32)})
        assert wire.recv(sock)[1] == {"kind": "open"}


def test_frames_refuse_unknown_dtypes_and_oversized_hellos():
    """No pickled objects on the wire, and nothing big before the token is checked."""
    a, b = wire.socket.socketpair()
    with a, b:
        with pytest.raises(TypeError, match="dtype object"):
            wire.send(a, "x", {}, {"o": np.array([None], object)})
        wire.send(a, "hello", {"token": "t" * (2 * wire.HELLO_BYTES)})
        with pytest.raises(wire.WorkerError, match="header of .* refused"):
            wire.recv(b, max_header=wire.HELLO_BYTES)


VANISHED_TRAINER = """
import subprocess, threading, types

from jaxrl_llm.workers import serve, wire

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # this network namespace's
serve.KEEPALIVE = (1, 1, 2)  # silent for 1 s, then 2 probes 1 s apart
dropped = threading.Event()
import numpy as np
big = {{"x": np.zeros(16 << 20, np.int32)}}  # 64 MiB: more than the socket buffers hold
echo = lambda kind, fields, arrays: ({{"kind": kind}}, big if kind == "run" else {{}})
worker = types.SimpleNamespace(reset=dropped.set, handle=echo)
listener = wire.listen("127.0.0.1", 0)
threading.Thread(target=serve.serve, args=(worker, listener, {token!r}), daemon=True).start()
address = "127.0.0.1:%d" % listener.getsockname()[1]
first = wire.connect(address, {token!r})
wire.send(first, "open")
assert wire.recv(first)[1] == {{"kind": "open"}}
dropped.clear()
if {sending}:  # the worker is sending it an answer when it goes
    wire.send(first, "run")
# The first trainer's host goes: its socket stays open, nothing reaches it, nothing comes.
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
assert dropped.wait(60), "the worker still holds the vanished trainer's connection"
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
second = wire.connect(address, {token!r}, timeout_s=60)
wire.send(second, "open")
print(wire.recv(second)[1]["kind"])
"""


@pytest.mark.parametrize("sending", [False, True], ids=["waiting", "sending"])
def test_a_worker_drops_a_trainer_whose_host_vanished(tmp_path, sending):
    """A trainer's host vanishes (its network gone: no FIN, no RST reaches the worker,
    here the loopback of a network namespace of its own taken down) while the worker
    waits for its next request (the keep-alive probes go unanswered) or while it sends
    an answer larger than the socket buffers (the user timeout bounds the unacknowledged
    bytes): the worker drops that connection and its session, and a new trainer is
    served. Needs `unshare -n` (root)."""
    import os
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare") or subprocess.run(["unshare", "-n", "true"]).returncode:
        pytest.skip("needs unshare -n (root) for a network of its own")
    script = tmp_path / "vanished.py"
    script.write_text(VANISHED_TRAINER.format(token=TOKEN, sending=sending))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = os.environ | {"PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        ["unshare", "-n", sys.executable, str(script)], env=env, capture_output=True, text=True
    )
    said = run.stdout.splitlines()  # the worker's lines, then the second trainer's answer
    assert run.returncode == 0 and said[-1] == "open", run.stderr[-3000:]
    assert said[1].endswith("gone: 0 steps sampled") and said[0].endswith("connected"), said


class _FakeWorker:
    """`serve.Worker`'s requests answered without an engine: each step submitted comes
    back from the next `run` as one row of `width` tokens (answers of 4 * width bytes),
    after `delay_s`."""

    def __init__(self, width: int, delay_s: float = 0.0):
        self.width, self.delay_s, self.steps, self.dropped = width, delay_s, [], threading.Event()

    def reset(self):
        self.steps, _ = [], self.dropped.set()

    def handle(self, kind, fields, arrays):
        import time

        if kind == "submit":
            self.steps.append(fields["step"])
        if kind != "run":
            return {}, {}
        time.sleep(self.delay_s)
        steps, self.steps = self.steps, []
        out, row = {}, lambda dtype: np.zeros((1, self.width), dtype)  # noqa: E731
        for step in steps:
            for name, value in dict(
                tokens=row(np.int32),
                mask=row(bool),
                loss_mask=row(bool),
                logprobs=row(np.float32),
                lengths=np.ones(1, np.int32),
                finish=np.zeros(1, np.int32),
                prompt_tokens=np.zeros((1, 2), np.int32),
                prompt_mask=np.ones((1, 2), bool),
                policy_version=np.zeros(1, np.int32),
                token_versions=row(np.int32),
            ).items():
                out[f"{step}/{name}"] = value
        return dict(steps=steps, in_flight=False, detail="fake"), out


def test_every_answer_is_read_as_it_comes(monkeypatch):
    """Two workers asked for a chunk: the first answers after 4 s, the second at once with
    an answer larger than the socket buffers. Read one after the other, the second's send
    would wait on a full window past its TCP_USER_TIMEOUT (3 s here: Linux counts that
    against it) and the worker would drop the trainer; read at once, both answer and no
    worker is lost."""
    from jaxrl_llm import sampling
    from jaxrl_llm.workers import serve
    from jaxrl_llm.workers.remote import RemoteStream, Workers

    monkeypatch.setattr(serve, "KEEPALIVE", (1, 1, 2))  # 3 s of unacknowledged data
    slow, fast = _FakeWorker(16, delay_s=4.0), _FakeWorker(4 << 20)  # 16 MiB per row
    addresses = []
    for worker in (slow, fast):
        listener = wire.listen("127.0.0.1", 0)
        threading.Thread(target=serve.serve, args=(worker, listener, TOKEN), daemon=True).start()
        addresses.append(f"127.0.0.1:{listener.getsockname()[1]}")
    spec = sampling.RolloutSpec(num_generations=1, max_new_tokens=4)
    params = {"w": np.zeros(2, np.float32)}
    stream = RemoteStream(Workers(tuple(addresses), TOKEN), params, 0, spec)
    try:
        for step in (0, 1):  # step 0 to the slow worker, step 1 to the fast one
            stream.submit(step, np.zeros((1, 2), np.int32), np.ones((1, 2), bool), step)
        assert sorted(stream.run_chunk()) == [0, 1]
        assert stream.output(1)[0].tokens.shape == (1, 4 << 20)
        assert stream.stats["workers_lost"] == 0 and not fast.dropped.is_set()
    finally:
        stream.close()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rollout.workers": -1}, "rollout.workers=-1: must be an integer >= 0"),
        ({"rollout.workers": 1}, r"rollout workers serve rollout.mode='split' \(got 'sync'\)"),
        (
            {"rollout.mode": "split", "rollout.workers": 2, "rollout.worker_addresses": "a:1"},
            "1 addresses for rollout.workers=2",
        ),
        (
            {"rollout.mode": "split", "rollout.workers": 1, "rollout.worker_addresses": "a:b"},
            "'a:b' is not host:port",
        ),
        (
            {"rollout.mode": "split", "rollout.workers": 1, "rollout.worker_addresses": "@"},
            "rollout.worker_addresses='@': give the file after @",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_timeout_s": 0,
            },
            "rollout.worker_timeout_s=0.0: must be a number of seconds > 0",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_start_s": -1.0,
            },
            "rollout.worker_start_s=-1.0: must be a number of seconds > 0",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_retry_s": -1.0,
            },
            "rollout.worker_retry_s=-1.0: must be a number of seconds >= 0",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_tls_ca": "/no/such/ca.pem",
            },
            "rollout.worker_tls_ca='/no/such/ca.pem': no such file",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "mesh.rollout_devices": 4,
            },
            "mesh.rollout_devices=4: with rollout.workers the workers sample",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "model.lora.rank": 4,
                "model.lora.sampler": "unmerged",
            },
            "model.lora.sampler='unmerged': rollout workers sample merged weights",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_sync": "rdma",
            },
            "rollout.worker_sync='rdma': must be 'host' or 'transfer'",
        ),
        (
            {
                "rollout.mode": "split",
                "rollout.workers": 1,
                "rollout.worker_addresses": "a:1",
                "rollout.worker_sync": "transfer",
                "model.lora.rank": 4,
            },
            "rollout.worker_sync='transfer' sends whole weights: with model.lora use 'host'",
        ),
    ],
)
def test_worker_config_checks(tmp_path, changes, message):
    from tiny_run import make_model_dir, tiny_config

    from jaxrl_llm.config import ConfigError, validate

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        node = c
        for part in section.split("."):
            node = node[part]
        node[name] = value
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_a_static_worker_of_several_processes_checks_that_a_step_splits_over_them():
    """A worker's config is checked as one process's (each process gets every request);
    with the static engine each process takes its own rows of a step, so a worker of
    several processes refuses at start, naming the key, a batch that does not split over
    them (`check_worker_processes`, run by `serve.Worker`); the paged engine takes it."""
    from tiny_run import tiny_config

    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.config.checks_rollout import check_worker_processes

    c = tiny_config("unused")
    c.rollout.batch_size = 3
    message = r"rollout.batch_size=3 is not divisible by this rollout worker's 2 processes"
    with pytest.raises(ConfigError, match=message):
        check_worker_processes(c, 2)
    check_worker_processes(c, 1)
    c.rollout.engine = "paged"
    check_worker_processes(c, 2)
    c.rollout.engine, c.rollout.batch_size = "static", 4
    check_worker_processes(c, 2)


def test_a_trainer_of_several_processes_with_workers_samples_on_them(tmp_path):
    """Split mode with rollout workers takes a trainer of several processes; its own
    engine (evaluation's) stays static, and the paged one's refusal says where it goes.
    Environments with workers, and the transfer sync, take a trainer of one process."""
    from tiny_run import make_model_dir, tiny_config

    from jaxrl_llm.config import ConfigError, validate

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rollout.mode, c.mesh.fsdp, c.mesh.rollout_devices = "split", -1, 4
    with pytest.raises(ConfigError, match="with a rollout mesh runs on one host; use 'overlap'"):
        validate(c, process_count=2)
    c.rollout.workers, c.rollout.worker_addresses = 2, "a:1,b:1"
    c.mesh.rollout_devices = 0  # the workers sample
    validate(c, process_count=2)
    c.rollout.engine = "paged"
    with pytest.raises(ConfigError, match="the workers take --config.rollout.engine=paged"):
        validate(c, process_count=2)
    c.rollout.engine, c.rewards = "static", {}
    c.env.name, c.env.workers, c.env.max_total_tokens = "calculator", 1, 64  # one process
    validate(c, process_count=1)
    with pytest.raises(ConfigError, match="env.name with rollout.workers: .* a trainer of one"):
        validate(c, process_count=2)
    c.env.name, c.rewards = "", {"gsm8k": 1.0}
    c.rollout.worker_sync = "transfer"  # its server is one process's
    validate(c, process_count=1)
    with pytest.raises(ConfigError, match="'transfer' offers the weights from a trainer of one"):
        validate(c, process_count=2)


# ------------------------------------------------------------------ worker processes
def _worker_env(path: str) -> dict:
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=4")
    return os.environ | {
        "TINY_MODEL_DIR": path,
        "JAXRL_WORKER_TOKEN": TOKEN,
        "XLA_FLAGS": flags,
        "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def _start_workers(path: str, engines, port: int = 0, flags=()) -> list:
    """Worker processes (4 devices each) serving the tiny model's config, one per engine
    (at `port`, 0: any free one; more command-line `flags`) -> [(process, address)], once
    each listens. The caller kills them (`_stop`)."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "jaxrl_llm.workers.serve", f"--port={port}", *flags]
    command += ["--config=" + os.path.join(tests, "tiny_run.py")]
    procs = [
        subprocess.Popen(
            command + [f"--config.rollout.engine={e}"],
            env=_worker_env(path),
            stdout=subprocess.PIPE,
            text=True,
        )
        for e in engines
    ]
    started = []
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("worker listening "), line
            started.append((p, line.split()[-1]))
    except BaseException:
        _stop(procs)
        raise
    return started


def _free_port() -> int:
    """A port of 127.0.0.1 nothing listens on (when asked)."""
    with wire.socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(procs) -> None:
    """SIGKILL (a stopped process too) and reap each of `procs`."""
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Three worker processes (4 devices each, mesh fsdp 4: `mesh.rollout`'s default over
    them, not the tests' fsdp 4 x tensor 2) serving the tiny model's config, two with the
    static engine, one with the paged; -> .config, .path (the model's), .static
    [(process, address)] and .paged (process, address)."""
    from tiny_run import make_model_dir, tiny_config

    path = make_model_dir(str(tmp_path_factory.mktemp("workers") / "model"))
    started = _start_workers(path, ["static", "static", "paged"])
    try:
        yield types.SimpleNamespace(
            config=tiny_config(path), path=path, static=started[:2], paged=started[2]
        )
    finally:
        _stop([p for p, _ in started])


def _local_reference(config, path, spec, prompts, chunk, params=None):
    """Each step's (output, token_versions) from a local stream of the config's engine on
    a mesh of the workers' shape (fsdp 4; in bfloat16 another shape moves log-probs by
    ~1e-4: other reduction orders), with the parameters cast to bfloat16 (what the wire
    carries); and the float32 parameters, sharded fsdp 4 x tensor 2 (`params` if given)."""
    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import model_shapes
    from jaxrl_llm.rollout.sources import make_sampler
    from jaxrl_llm.sampling.engine import open_session

    config = config_lib.prepare(config).config  # the speed settings a run (and a worker) picks
    cfg = model_shapes.model_config(config)
    trainer = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    if params is None:
        _, params = models.builtin.load_model(path, trainer, "float32")
    mesh = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, jax.devices()[:4])
    bf16 = jax.device_put(
        jax.tree.map(lambda x: x.astype("bfloat16"), params), models.param_shardings(cfg, mesh)
    )
    stream = open_session(make_sampler(config, cfg, mesh, 0), "stream", bf16, 0, spec, chunk=chunk)
    want = {}
    for step, (ids, mask) in prompts.items():
        stream.submit(step, ids, mask, step)
    while stream.busy:
        for step in stream.run_chunk():
            want[step] = jax.device_get(stream.output(step))
    return params, want


def _prompts(n):
    from jaxrl_llm import sampling

    rows = [[5, 6, 7], [1, 2, 3, 4, 9], [11], [4, 8]]
    return {s: sampling.pad_prompts(rows[s % 4 :] + rows[: s % 4], 0) for s in range(n)}


def _greedy_steps(workers, chunk: int, engine: str = "static"):
    """4 greedy steps of 4 prompts x 2, 6 tokens -> (the worker processes of `engine` as
    an engine, the spec, the float32 parameters, {step: (ids, mask)}, each step's local
    output)."""
    from jaxrl_llm import sampling
    from jaxrl_llm.workers.remote import Workers

    config = workers.config.copy_and_resolve_references()
    config.rollout.engine = engine
    started = workers.static if engine == "static" else [workers.paged]
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=6, temperature=0.0)
    prompts = _prompts(4)
    params, want = _local_reference(config, workers.path, spec, prompts, chunk=chunk)
    remote = Workers(tuple(a for _, a in started), TOKEN, pad_id=0, seed=config.train.seed)
    return remote, spec, params, prompts, want


def _drain(stream, chunks: int = 20) -> dict:
    """Every step the stream returns, each once, within `chunks` run_chunk calls."""
    got = {}
    for _ in range(chunks):
        if not stream.busy:
            return got
        for step in stream.run_chunk():
            assert step not in got
            got[step] = stream.output(step)
    raise AssertionError(f"steps never returned: {sorted(stream.queued)}")


def _same(got, want):
    (out, versions), (out_w, versions_w) = got, want
    np.testing.assert_array_equal(out.tokens, np.asarray(out_w.tokens))
    np.testing.assert_array_equal(out.mask, np.asarray(out_w.mask))
    np.testing.assert_array_equal(out.prompt_tokens, np.asarray(out_w.prompt_tokens))
    np.testing.assert_array_equal(out.policy_version, np.asarray(out_w.policy_version))
    np.testing.assert_allclose(out.logprobs, np.asarray(out_w.logprobs), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(versions, versions_w)


def _every_step_as_local(stream, prompts, want) -> dict:
    """Every step of `prompts` submitted to `stream` comes back once, as the local stream
    drew it (`want`) -> {step: (output, token_versions)}."""
    for step, (ids, mask) in prompts.items():
        stream.submit(step, ids, mask, step)
    got = _drain(stream)
    assert sorted(got) == sorted(want)
    for step in got:
        _same(got[step], want[step])
    return got


def test_remote_stream_draws_what_the_local_stream_draws(workers):
    """Steps spread over two worker processes come back, greedy, token for token as a local
    `StaticStream` draws them (log-probs within 1e-5); a swap reaches every worker."""
    from jaxrl_llm.sampling.engine import open_session
    from jaxrl_llm.workers.remote import RemoteStream

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
    stream = open_session(remote, "stream", params, 0, spec)
    assert isinstance(stream, RemoteStream)
    try:
        for step, (ids, mask) in prompts.items():
            stream.submit(step, ids, mask, step)
        assert sorted(len(k.steps) for k in stream.links) == [2, 2]
        got = _drain(stream)
        assert sorted(got) == sorted(want)
        for step in got:
            _same(got[step], want[step])
        stream.swap(params, 1)
        stream.submit(9, *prompts[0], 0)
        ((out, versions),) = _drain(stream).values()
        assert stream.version == 1 and (versions == 1).all()
        np.testing.assert_array_equal(out.tokens, want[0][0].tokens)
        # what the metrics log of the last sync: its seconds, the bfloat16 bytes each got
        assert stream.stats["weight_sync_s"] > 0
        assert stream.stats["weight_sync_gb"] == _bf16_gb(params)
    finally:
        stream.close()


def _bf16_gb(params) -> float:
    return round(sum(x.size * 2 for x in jax.tree.leaves(params)) / 1e9, 6)


def test_a_tls_worker_draws_for_a_trainer_with_its_ca(workers, tmp_path):
    """A worker started with --tls_cert / --tls_key serves a `RemoteStream` whose
    `Workers.tls_ca` (`rollout.worker_tls_ca`) is its certificate: every step comes back
    as the local stream draws it."""
    import dataclasses

    from jaxrl_llm.workers.remote import RemoteStream

    cert, key = _self_signed(tmp_path, "worker")
    flags = [f"--tls_cert={cert}", f"--tls_key={key}"]
    [(proc, address)] = _start_workers(workers.path, ["static"], flags=flags)
    try:
        remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
        remote = dataclasses.replace(remote, addresses=(address,), tls_ca=cert)
        stream = RemoteStream(remote, params, 0, spec)
        try:
            assert stream.links[0].sock.version() in ("TLSv1.2", "TLSv1.3")
            _every_step_as_local(stream, prompts, want)
        finally:
            stream.close()
    finally:
        _stop([proc])


def _start_world(path: str, processes: int = 2, flags=()) -> list:
    """One worker of `processes` processes (2 devices each: one JAX world through
    jax.distributed, gloo between them) serving the tiny model's config (more
    command-line `flags`) -> [(process 0, its address), (process 1, None), ...] once
    process 0 listens."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "jaxrl_llm.workers.serve", "--port=0"]
    command += ["--config=" + os.path.join(tests, "tiny_run.py"), *flags]
    env = _worker_env(path) | {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "JAXRL_DISTRIBUTED": "1",
        "JAXRL_COORDINATOR": f"127.0.0.1:{_free_port()}",
        "JAXRL_NUM_PROCESSES": str(processes),
    }
    procs = [
        subprocess.Popen(
            command,
            env=env | {"JAXRL_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        line = procs[0].stdout.readline()
        assert line.startswith("worker listening on "), line
    except BaseException:
        _stop(procs)
        raise
    return [(procs[0], line.split()[-1])] + [(p, None) for p in procs[1:]]


def test_a_worker_of_two_processes_draws_what_the_local_stream_draws(workers):
    """A worker that is a JAX world of two processes (2 devices each, the mesh fsdp 4 over
    both): process 0 takes the trainer's requests and shares each with process 1, each
    process gives the engine its half of a step's prompts, and the rows gathered from
    both come back as the local `StaticStream` of one process draws them, greedy, with
    partial rollouts of 2 tokens (log-probs within 1e-5); a swap while a step runs is
    taken between its chunks (each token's version). Then multi-turn rows
    (`workers.turns`), each process holding its half of the step's rows: greedy, as the
    local turn loop plays them."""
    import dataclasses

    from jaxrl_llm.sampling.engine import open_session
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet

    world = _start_world(workers.path)
    try:
        remote, spec, params, prompts, want = _greedy_steps(workers, chunk=2)
        remote = dataclasses.replace(remote, addresses=(world[0][1],))
        stream = open_session(remote, "stream", params, 0, spec, chunk=2)
        try:
            _every_step_as_local(stream, prompts, want)
            stream.submit(9, *prompts[0], 0)
            assert stream.run_chunk() == []  # its first 2 tokens, by version 0
            stream.swap(params, 1)
            ((out, versions),) = _drain(stream).values()
            np.testing.assert_array_equal(versions, [0, 0, 1, 1, 1, 1])
            np.testing.assert_array_equal(out.tokens, want[0][0].tokens)
        finally:
            stream.close()
        # rollout.worker_sync='transfer': each process pulls its own shards from this
        # process's devices (the parameters sharded fsdp 4 x tensor 2 here), as drawn.
        transfer = dataclasses.replace(remote, sync="transfer")
        stream = open_session(transfer, "stream", params, 0, spec, chunk=2)
        try:
            assert sorted(stream.links[0].layout) == ["0", "1"]  # each process's slices
            _every_step_as_local(stream, prompts, want)
            stream.swap(params, 1)
            stream.submit(9, *prompts[0], 0)
            ((out, versions),) = _drain(stream).values()
            assert (versions == 1).all()
            assert {str(x.dtype) for x in stream.fleet.host.values()} == {"bfloat16"}
            assert stream.stats["weight_sync_gb"] == _bf16_gb(params)
            np.testing.assert_array_equal(out.tokens, want[0][0].tokens)
        finally:
            stream.close()
        # Multi-turn rows: each process holds its half of a step's rows, process 0
        # answers for both; greedy, as the local turn loop plays them.
        play, params, local, bf16 = _turns_setup(workers, "static")
        fleet = Fleet(Workers((world[0][1],), TOKEN), {"kind": "turns"})
        try:
            _same_play(play(fleet, params), play(local, bf16))
        finally:
            fleet.close()
    finally:
        _stop([p for p, _ in world])


def test_a_paged_worker_of_two_processes_serves_streams_turns_and_agents(workers):
    """rollout.engine=paged on a worker of two processes (2 devices each, fsdp 4 over
    both): each process runs the whole batch (the engine's host state replicated, the
    same schedule on each) and process 0 answers. Greedy, token for token as the local
    paged engine: a stream's steps (token versions per token), a step's multi-turn rows,
    and agents' requests (rows, log-probs 1e-5, versions, rewards, completions)."""
    import dataclasses

    from jaxrl_llm.sampling.engine import open_session
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet

    world = _start_world(workers.path, flags=["--config.rollout.engine=paged"])
    address = world[0][1]
    try:
        remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0, engine="paged")
        stream = open_session(dataclasses.replace(remote, addresses=(address,)), "stream",
                              params, 0, spec)  # fmt: skip
        try:
            _every_step_as_local(stream, prompts, want)
        finally:
            stream.close()
        play, params, local, bf16 = _turns_setup(workers, "paged")
        fleet = Fleet(Workers((address,), TOKEN), {"kind": "turns"})
        try:
            _same_play(play(fleet, params), play(local, bf16))
        finally:
            fleet.close()
        batch = types.SimpleNamespace(examples=AGENT_EXAMPLES)
        want = _local_agents(workers, "paged", batch)
        fleet = Fleet(Workers((address,), TOKEN), {"kind": "turns"})
        agents, params = _agents(workers, "paged", fleet)
        try:
            _same_agents(agents(params, batch, 3), want)
        finally:
            agents.close()
    finally:
        _stop([p for p, _ in world])


def test_a_paged_worker_draws_what_the_local_paged_stream_draws(workers):
    """rollout.engine=paged in the worker's config: its `PagedStream` (the steps' rows
    sharing the slots) returns each step over the wire as the local `PagedStream` draws
    it, token versions per token included."""
    from jaxrl_llm.sampling.engine import open_session

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0, engine="paged")
    stream = open_session(remote, "stream", params, 0, spec)
    try:
        got = _every_step_as_local(stream, prompts, want)
        assert all(v.shape == (8, 6) for _, v in got.values())  # [N, T]: per token
    finally:
        stream.close()


# Trajectories that end after 1, 2 and 3 actions and on max_turns, observations of
# different lengths (the paged multi-turn tests' environment).
SLEEPY_EXAMPLES = [
    {"question": "1+2=", "turns": 1},
    {"question": "12*3+45=", "turns": 2},
    {"question": "7=", "turns": 6},
    {"question": "(8-9)/3=", "turns": 3, "obs_chars": [1, 3, 2]},
]


def _local_agents(workers, engine: str, batch):
    """The agents' step of `batch` played on a local engine of `engine` (`_agents`)."""
    local, bf16 = _agents(workers, engine)
    try:
        return local(bf16, batch, 3)
    finally:
        local.close()


def _turns_setup(workers, engine: str):
    """-> play(engine, params, refresh=None, examples) -> (out, turns, trajectory ends), the
    float32 parameters, and the local engine of `engine` on a mesh of the workers' shape
    with the parameters it samples (cast to bfloat16, what the wire carries)."""
    import os

    from tiny_run import TOKENIZER

    from jaxrl_llm import config as config_lib
    from jaxrl_llm import envs, sampling
    from jaxrl_llm.config import model_shapes
    from jaxrl_llm.models import builtin
    from jaxrl_llm.rollout.sources import make_sampler

    config = workers.config.copy_and_resolve_references()
    config.rollout.engine = engine
    config = config_lib.prepare(config).config
    cfg = model_shapes.model_config(config)
    trainer = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    _, params = models.builtin.load_model(workers.path, trainer, "float32")
    mesh = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, jax.devices()[:4])
    bf16 = jax.device_put(
        jax.tree.map(lambda x: x.astype("bfloat16"), params), models.param_shardings(cfg, mesh)
    )
    tok = builtin.load_tokenizer(TOKENIZER)
    renderer = envs.Renderer(tok, use_chat=False)
    settings = envs.TurnSettings(
        max_turns=4, turn_tokens=6, max_total_tokens=40, stop_ids=(20, 29, 14)
    )
    spec = sampling.RolloutSpec(2, settings.turn_tokens, 0.0)
    sleepy = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs_for_tests.py")

    def play(engine, params, refresh=None, examples=SLEEPY_EXAMPLES):
        with envs.EnvPool(sleepy + ":Sleepy", {"delay_s": 0.0}, workers=1) as pool:
            trajs, observations = pool.reset(examples)
            ids, mask = sampling.pad_prompts([renderer.prompt(o) for o in observations], 0)
            trajs, _ = envs.replicate(trajs, observations, 2)
            out, turns = envs.play(
                engine, params, ids, mask, spec, settings, pool, trajs, renderer, tok,
                step=1, version=0, mesh=mesh, refresh=refresh,
            )  # fmt: skip
        return jax.device_get(out), turns, [t.end for t in trajs]

    return play, params, make_sampler(config, cfg, mesh, 0), bf16


def _same_play(got, want) -> None:
    (out, turns, ends), (out_w, turns_w, ends_w) = got, want
    for name in ("tokens", "mask", "loss_mask", "lengths", "finish", "policy_version"):
        np.testing.assert_array_equal(getattr(out, name), getattr(out_w, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, out_w.logprobs, atol=1e-5, rtol=0)
    assert turns.spans == turns_w.spans and ends == ends_w
    np.testing.assert_array_equal(turns.versions, turns_w.versions)


def test_multi_turn_rows_on_a_worker_equal_the_local_turn_loop(workers):
    """`envs.play` on a `workers.turns.Fleet` (the environments here, each step's rows a
    session on one worker): greedy, every row's tokens, masks, finish, log-probs (1e-5),
    turn spans, token versions and trajectory ends equal the local turn loop's on the
    worker's engine (paged here; the static engine in the next test) over the same
    bfloat16 parameters; a second step plays on the weights the worker already holds."""
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet

    play, params, local, bf16 = _turns_setup(workers, "paged")
    want = play(local, bf16)
    assert want[1].model_turns.max() > 1  # turns went to and fro
    fleet = Fleet(Workers((workers.paged[1],), TOKEN), {"kind": "turns"})
    try:
        _same_play(play(fleet, params), want)
        assert fleet.version == 0 and fleet.stats["workers"] == 1
        host = fleet.host
        _same_play(play(fleet, params), want)
        assert fleet.host is host and [k.last for k in fleet.links] == [1]  # not sent again
        assert not any(k.steps for k in fleet.links)
    finally:
        fleet.close()


def test_a_worker_lost_mid_turns_costs_a_replay_of_the_step(workers):
    """A greedy step's 8 prompts split over both workers (fsdp 4 each: 4 a part) play as
    the local turn loop (static engine: greedy tokens, log-probs 1e-5, spans, versions,
    ends). The connection to the worker holding a step's 4 prompts breaks while they are
    between turns: `envs.play` raises `RowsLost`
    (nothing returned, so nothing trained), the fleet counts the worker lost and the step
    requeued, and the step played again goes to the other worker and equals the local
    turn loop. `PlayerStream` plays a step again on `RowsLost` until it is played."""
    import socket

    from jaxrl_llm.rollout.thread import PlayerStream
    from jaxrl_llm.sampling.engine import RowsLost
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet

    play, params, local, bf16 = _turns_setup(workers, "static")
    want = play(local, bf16)
    fleet = Fleet(Workers(tuple(a for _, a in workers.static), TOKEN), {"kind": "turns"})
    broken = []
    eight = SLEEPY_EXAMPLES[::-1] + SLEEPY_EXAMPLES  # two parts of the workers' fsdp 4

    def refresh():  # before the second decode: the rows are the worker's now
        if not broken:
            link = next(k for k in fleet.links if k.steps)
            link.sock.shutdown(socket.SHUT_RDWR)
            broken.append(link)
        return params, 0

    try:
        # Greedy: 8 prompts split over both workers, played as the local loop; 4 (the
        # workers' prompt multiple) stay whole on one.
        _same_play(play(fleet, params, examples=eight), play(local, bf16, examples=eight))
        assert sorted(k.last for k in fleet.links) == [0, 1]
        assert not any(k.steps for k in fleet.links)
        with pytest.raises(RowsLost, match="lost step 1's rows"):
            play(fleet, params, refresh)
        assert fleet.stats["workers_lost"] == 1 and fleet.stats["requeued"] == 1
        assert [k.alive for k in fleet.links].count(True) == 1 and not broken[0].alive
        _same_play(play(fleet, params), want)
    finally:
        fleet.close()

    tries = []

    def player(params, batch, step, version, refresh):
        tries.append(step)
        if len(tries) == 1:
            raise RowsLost("worker w lost step 4's rows")
        return "out", "scored", "versions"

    stream = PlayerStream(player, None, 3, lambda step: None)
    stream.submit(4, None, None, 4)
    assert stream.run_chunk() == [4] and tries == [4, 4]
    assert stream.output(4) == ("out", "versions")


def _agents(workers, engine: str, fleet=None):
    """An `AgentRollout` of the two-turn test agent (tests/agents_for_tests.py) on the
    local engine of `engine` (a mesh of the workers' shape, bfloat16 parameters), or with
    `fleet` training on the workers -> (it, its parameters: bfloat16 or float32)."""
    import os

    from tiny_run import TOKENIZER, tiny_config

    from jaxrl_llm import sampling
    from jaxrl_llm.models import builtin
    from jaxrl_llm.rollout.agents import AgentRollout

    _, params, local, bf16 = _turns_setup(workers, engine)
    c = tiny_config("unused")
    tests = os.path.dirname(os.path.abspath(__file__))
    c.agent.entry = os.path.join(tests, "agents_for_tests.py") + ":two_turns"
    c.agent.max_total_tokens, c.agent.batch_wait_s = 40, 1.0
    c.rollout.batch_size, c.data.max_prompt_len = 4, 16
    spec = sampling.RolloutSpec(2, 5, 0.0, stop_ids=(18, 22, 23, 25))
    tok = builtin.load_tokenizer(TOKENIZER)
    return AgentRollout(c, tok, local, spec, engine=fleet), (bf16 if fleet is None else params)


AGENT_EXAMPLES = [
    {"question": "1+2="},
    {"question": "12*3=", "rewrite": True},
    {"question": "7-4=", "n": 2},
    {"question": "5*5="},
]


def _same_agents(got, want) -> None:
    (out, scored, versions), (out_w, scored_w, versions_w) = got, want
    for name in ("tokens", "mask", "loss_mask", "lengths", "prompt_tokens", "policy_version"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, name)), np.asarray(getattr(out_w, name)), err_msg=name
        )
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(out_w.logprobs), atol=1e-5)
    np.testing.assert_array_equal(versions, versions_w)
    assert scored.rewards.tolist() == scored_w.rewards.tolist()
    assert scored.completions == scored_w.completions


@pytest.mark.slow  # the static engine's case is the next test's replay
def test_agents_on_a_paged_worker_equal_the_local_requests(workers):
    """agent.entry with rollout workers: the gateway and the agents here, the requests
    sampled by a worker's requests session (`workers.turns.RemoteRequests`): greedy, the
    rows, log-probs (1e-5), token versions, rewards and completions equal those of the
    agents on the worker's engine here (paged: each episode a row that keeps its cache),
    with a request extending its episode, a rewrite and an n = 2 request among them."""
    engine = "paged"
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet

    batch = types.SimpleNamespace(examples=AGENT_EXAMPLES)
    want = _local_agents(workers, engine, batch)
    started = workers.static if engine == "static" else [workers.paged]
    fleet = Fleet(Workers(tuple(a for _, a in started), TOKEN), {"kind": "turns"})
    agents, params = _agents(workers, engine, fleet)
    try:
        _same_agents(agents(params, batch, 3), want)
        assert agents.stats is fleet.stats and fleet.stats["workers_lost"] == 0
    finally:
        agents.close()
    assert not any(k.alive for k in fleet.links)  # closed with the agents


def test_agents_split_over_workers_go_on_without_a_lost_one(workers):
    """Agents on two static workers: a step's episodes are split between them (each
    episode's requests to one, each worker an equal run of them, each part's session with
    its own seed, `part_seed`), and the step's rows equal the local requests' (greedy:
    rows, log-probs 1e-5, versions, rewards, completions; an episode's request extending
    its row, a rewrite, an n = 2 request). The next step, the connection to one worker
    breaks after its first chunk: its episodes go on on the other (a request it had not
    answered asked there again with its whole context), and the step's rows still equal
    the local ones. Then the last worker's breaks: the step raises `RowsLost` and its
    episodes end (their agents' processes killed, `Server.abandon`)."""
    import socket

    from jaxrl_llm.sampling.engine import RowsLost
    from jaxrl_llm.workers.remote import Workers
    from jaxrl_llm.workers.turns import Fleet, part_seed

    batch = types.SimpleNamespace(examples=AGENT_EXAMPLES)
    want = _local_agents(workers, "static", batch)
    fleet = Fleet(Workers(tuple(a for _, a in workers.static), TOKEN), {"kind": "turns"})
    agents, params = _agents(workers, "static", fleet)
    seeds, asked, lose, exchange_each = [], {}, [], fleet.exchange_each

    def recorded(requests, kind):  # what each worker is asked; a connection broken
        for link, fields, _ in requests:
            if kind == "requests":
                seeds.append(fields["seed"])
            for op in fields["ops"] if kind == "req_run" else ():
                asked.setdefault(op[1], set()).add(link.address)
        answers = exchange_each(requests, kind)
        if kind == "req_run" and lose:  # after the step's first chunk
            lose.pop().sock.shutdown(socket.SHUT_RDWR)
        return answers

    fleet.exchange_each = recorded
    try:
        _same_agents(agents(params, batch, 3), want)  # on both workers
        assert sorted(seeds) == sorted([part_seed(0, 0), part_seed(0, 1)])
        assert all(len(at) == 1 for at in asked.values())  # an episode stays on one
        on = [a for at in asked.values() for a in at]
        assert len(asked) == 8 and sorted(on.count(a) for _, a in workers.static) == [4, 4]
        asked.clear()
        lose.append(fleet.alive[0])
        _same_agents(agents(params, batch, 3), want)  # one worker lost mid-step
        assert fleet.stats["workers_lost"] == 1 and len(fleet.alive) == 1
        moved = [e for e, at in asked.items() if len(at) == 2]
        assert moved and all(fleet.alive[0].address in asked[e] for e in moved)
        fleet.alive[0].sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(RowsLost):
            agents(params, batch, 3)
        deadline = time.monotonic() + 10
        while agents.server.live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not agents.server.live  # the given-up episodes ended
        assert fleet.stats["workers_lost"] == 2
    finally:
        agents.close()


def test_lora_syncs_send_the_adapters_and_each_worker_merges_them(workers):
    """LoRA parameters (base + rank-4 adapters, B random): the first sync gives each worker
    the base once, then the adapters, which it merges on its own devices; the steps come
    back as a local stream draws them from the trainer's merged weights (which differ from
    the base's). A swap to adapters with B = 0 sends the adapters alone and draws what the
    base alone draws."""
    import dataclasses

    from jaxrl_llm.models import lora
    from jaxrl_llm.sampling.engine import open_session

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
    trainer = parallel.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    cfg = models.builtin.load_model(workers.path)[0]
    cfg = cfg.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
    adapters = lora.init_adapters(cfg, seed=3, mesh=trainer)
    keys = iter(jax.random.split(jax.random.key(4), len(adapters["layers"])))

    def b(scale):
        return {
            "layers": {
                k: jax.device_put(scale * jax.random.normal(next(keys), v.shape), v.sharding)
                if k.endswith("_lora_b")
                else v
                for k, v in adapters["layers"].items()
            }
        }

    tuned = lora.combine(params, b(0.05))
    config = workers.config.copy_and_resolve_references()
    merged = lora.make_merge_fn(cfg, trainer)(tuned)
    _, want_tuned = _local_reference(config, workers.path, spec, prompts, 0, params=merged)
    assert any((want_tuned[s][0].tokens != want[s][0].tokens).any() for s in want)
    stream = open_session(dataclasses.replace(remote, lora=cfg.lora), "stream", tuned, 0, spec)
    try:
        assert [k.has_base for k in stream.links] == [True, True]
        sent, base = stream.host, stream.host.base
        assert all(lora.is_adapter(k.split("/")[-1]) for k in sent) and len(sent) == 14
        assert not any(lora.is_adapter(k.split("/")[-1]) for k in base)
        assert weights.nbytes(sent) == sum(x.nbytes for x in jax.tree.leaves(adapters))
        _every_step_as_local(stream, prompts, want_tuned)
        stream.swap(lora.combine(params, b(0.0)), 1)
        assert stream.host.base is base  # copied once
        stream.submit(9, *prompts[0], 0)
        ((out, versions),) = _drain(stream).values()
        assert (versions == 1).all()
        np.testing.assert_array_equal(out.tokens, want[0][0].tokens)
    finally:
        stream.close()


def test_a_worker_refuses_another_seed(workers):
    """The refusal is one `WorkerError` line, and the refused trainer's connection is
    closed with it: the worker serves the next trainer at once (a connection left open
    would hold the worker until the trainer's socket is collected)."""
    from jaxrl_llm import sampling
    from jaxrl_llm.workers.remote import RemoteStream, Workers

    params = models.builtin.load_model(workers.path)[1]
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=6)
    address = workers.static[0][1]
    with pytest.raises(wire.WorkerError, match="train.seed: the trainer samples with 12345"):
        RemoteStream(Workers((address,), TOKEN, seed=12345), params, 0, spec)
    stream = RemoteStream(Workers((address,), TOKEN, connect_timeout_s=5.0), params, 0, spec)
    try:
        assert stream.stats["workers"] == 1
    finally:
        stream.close()


RUN_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from tiny_run import signal_config


def get_config():
    c = signal_config({model_dir!r})
    c.train.num_steps, c.train.print_samples_every, c.train.log_every = 2, 1, 1
    c.rollout.mode, c.rollout.max_staleness = "split", 0
    c.mesh.fsdp, c.mesh.tensor = -1, 2
    c.mesh.rollout_devices = {rollout_devices}
    c.rollout.workers, c.rollout.worker_addresses = {n}, {addresses!r}
    c.model.lora.rank = {lora}
    c.rollout.worker_sync = {sync!r}
    if {env}:  # multi-turn: the environments here, the turns on the workers
        c.rewards = {{}}
        c.env.name = {tests!r} + "/envs_for_tests.py:Sleepy"
        c.env.options = {{"turns": 2, "delay_s": 0.0}}
        c.env.max_turns, c.env.max_total_tokens, c.env.workers = 2, 16, 1
    return c
"""


def _samples(workdir) -> list:
    import json

    with open(workdir / "samples.jsonl") as f:
        return [(r["step"], r["prompt"], r["completion"], r["reward"]) for r in map(json.loads, f)]


@pytest.mark.parametrize(
    "lora,processes,multi_turn",
    [
        (0, 2, False),
        pytest.param(4, 1, False, marks=pytest.mark.slow),
        pytest.param(4, 2, False, marks=pytest.mark.slow),
        (0, 1, True),
    ],
    ids=["two_hosts", "lora", "lora_two_hosts", "environments"],
)
def test_a_split_run_with_workers_trains_as_with_a_rollout_mesh(
    workers, tmp_path, lora, processes, multi_turn
):
    """rollout.workers=2: a trainer of 4 devices (fsdp 2 x tensor 2) whose rollouts come
    from the two worker processes (fsdp 4 each) samples, scores and trains as the split
    run whose rollout mesh is 4 devices of its own process (max_staleness 0, so each step's
    version is fixed): the same samples and rewards, the same parameters. "two_hosts": the
    trainer is two processes of 2 devices each (one JAX world, gloo), process 0 drawing
    every process's rows (`rollout.shared`); the update's sums then cross processes, so
    the parameters agree to float32 rounding. "lora": one process, LoRA rank 4, the
    workers getting the base once and the adapters each step, merged as the trainer's
    merge does for the rollout mesh; "lora_two_hosts": both. "environments": multi-turn
    (env.name), the trainer's environments stepping each step's turns played on a worker
    (`workers.turns`), the weights pulled by the workers through `jax.experimental.transfer`
    (`rollout.worker_sync='transfer'`)."""
    import os
    import subprocess
    import sys

    from test_multihost import free_port

    from jaxrl_llm import train
    from jaxrl_llm.trainer import checkpoint
    from jaxrl_llm.trainer.metrics import read_metrics

    tests = os.path.dirname(os.path.abspath(__file__))

    def write(name, **kw):
        file = tmp_path / f"{name}.py"
        file.write_text(RUN_CONFIG.format(tests=tests, model_dir=workers.path, **kw))
        return file

    sync = "transfer" if multi_turn else "host"
    kw = dict(lora=lora, env=multi_turn, sync=sync)
    local = write("local", rollout_devices=4, n=0, addresses="", **kw)
    addresses = ",".join(a for _, a in workers.static)
    remote = write("remote", rollout_devices=0, n=2, addresses=addresses, **kw)
    devices = f"device_count={4 // processes}"
    env = os.environ | {
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace("device_count=8", devices),
        "JAXRL_WORKER_TOKEN": TOKEN,
        "PYTHONPATH": os.path.dirname(tests),
        "JAX_PLATFORMS": "cpu",
    }
    if processes > 1:
        env |= {
            "JAXRL_DISTRIBUTED": "1",
            "JAXRL_COORDINATOR": f"127.0.0.1:{free_port()}",
            "JAXRL_NUM_PROCESSES": str(processes),
        }
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={remote}"]
    runs = [
        subprocess.Popen(
            cmd + [f"--workdir={tmp_path / 'remote'}"],
            env=env | {"JAXRL_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        for run in runs:
            output = run.communicate(timeout=600)[0]
            assert run.returncode == 0, output[-3000:]
    finally:
        _stop(runs)  # the other process, if one failed
    spec = importlib.util.spec_from_file_location("local_config", local)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train.train(module.get_config(), str(tmp_path / "local"))
    got, want = _samples(tmp_path / "remote"), _samples(tmp_path / "local")
    assert {r[0] for r in got} == {1, 2} and got == want
    ma, mb = (read_metrics(tmp_path / w / "metrics.jsonl") for w in ("local", "remote"))
    for key in ("reward/mean", "rollout/length_mean"):  # every process's rows
        np.testing.assert_allclose([m[key] for m in mb], [m[key] for m in ma], atol=1e-6)
    assert [m["rollout/workers"] for m in mb] == [2, 2]  # drawn by the workers
    assert all(m["rollout/weight_sync_s"] > 0 for m in mb)  # the last sync's seconds
    if multi_turn:
        assert [m["rollout/workers_lost"] for m in mb] == [0, 0]
        assert all(m["env/turns_mean"] > 1 for m in mb)

    def final(workdir):
        with checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ck:
            return ck.restore(ck.latest_step())[0]["params"]

    a, b = final(tmp_path / "remote"), final(tmp_path / "local")
    atol = 1e-6 if processes > 1 else 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


RESTART_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from tiny_run import signal_config


def get_config():
    c = signal_config({model_dir!r})
    c.rewards = {{"format": {{"name": {reward!r}, "weight": 1.0}}}}
    c.train.num_steps, c.train.log_every = 4, 1
    c.train.verifier_timeout_s = 120.0  # the gated reward's wait is not a hung verifier
    c.train.print_samples_every, c.train.num_printed_samples = 1, 1000  # every row
    c.checkpoint.every, c.checkpoint.async_save = 1, False
    c.rollout.mode, c.rollout.max_staleness = "split", 0
    c.rollout.partial, c.rollout.partial_chunk = True, 2
    c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 0
    c.rollout.workers, c.rollout.worker_addresses = 2, {addresses!r}
    c.rollout.worker_start_s = {start_s}
    return c
"""

# signal_config's format reward, which holds the step it scores while GATE exists once
# the run's first checkpoint is on disk (saying so in GATE.reached): the trainer is then
# stopped between two steps with a checkpoint behind it, whatever the machine's speed.
GATED_REWARD = """
import os, re, time


def gated(completion, example):
    if os.path.exists({gate!r}) and os.path.isdir({checkpoint!r}):
        open({gate!r} + ".reached", "a").close()
        while os.path.exists({gate!r}):
            time.sleep(0.05)
    return float(re.fullmatch("[0-9].*", completion, re.DOTALL) is not None)
"""


def _restart_run(workers, where, name: str, addresses: str, start_s: float = 60.0):
    """RESTART_CONFIG's run on `addresses` -> (its command, its workdir where/name); its
    reward is held while where/gate exists once the run's first checkpoint is on disk."""
    import os
    import sys

    workdir = where / name
    reward = where / f"{name}_reward.py"
    first = str(workdir / "checkpoints" / "1")
    reward.write_text(GATED_REWARD.format(gate=str(where / "gate"), checkpoint=first))
    file = where / f"{name}.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    text = RESTART_CONFIG.format(
        tests=tests,
        model_dir=workers.path,
        reward=f"{reward}:gated",
        addresses=addresses,
        start_s=start_s,
    )
    file.write_text(text)
    command = [sys.executable, "-m", "jaxrl_llm.train", f"--config={file}", f"--workdir={workdir}"]
    return command, workdir


def _trainer_env(workers) -> dict:
    return _worker_env(workers.path) | {"JAX_PLATFORMS": "cpu"}


def _killed_at_the_gate(workers, command, workdir, where) -> int:
    """Runs `command` (`_restart_run`'s, in `where`) until its reward is held at the gate,
    then kills it with SIGKILL (the trainer and its verifier processes) -> the step of
    the checkpoint it left."""
    import os
    import signal
    import subprocess
    import time

    from jaxrl_llm.trainer import checkpoint

    gate = where / "gate"
    gate.touch()
    log = where / "killed.log"
    with open(log, "w") as err:  # a file: a pipe nobody reads could fill and stop it
        trainer = subprocess.Popen(
            command, env=_trainer_env(workers), stdout=err, stderr=err, start_new_session=True
        )
    deadline = time.monotonic() + 600
    try:
        while not (where / "gate.reached").exists():
            assert trainer.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer never reached the gate"
            time.sleep(0.1)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        gate.unlink()
    with checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ck:
        return ck.latest_step()


def _ran_the_same(got, want) -> None:
    """Workdirs `got` and `want` hold the same samples.jsonl (every row of the 4 steps: its
    prompt, completion and reward) and the same final parameters, bit for bit."""
    from jaxrl_llm.trainer import checkpoint

    rows = _samples(got)
    assert [r[0] for r in rows] == [s for s in (1, 2, 3, 4) for _ in range(16)]
    assert rows == _samples(want)

    def final(workdir):
        with checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ck:
            assert ck.latest_step() == 4
            return ck.restore(4)[0]["params"]

    for x, y in zip(jax.tree.leaves(final(got)), jax.tree.leaves(final(want)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _logged(workdir) -> list:
    """metrics.jsonl's records of the rollout workers' counters."""
    import json

    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "rollout/workers" in r]


@pytest.fixture(scope="module")
def uninterrupted(workers, tmp_path_factory):
    """RESTART_CONFIG's 4 steps run through on the two static workers, the second listed
    first (steps go round the workers: it samples steps 1 and 3) -> the workdir: what a
    run with both workers draws."""
    import subprocess

    where = tmp_path_factory.mktemp("uninterrupted")
    addresses = ",".join(a for _, a in reversed(workers.static))
    command, workdir = _restart_run(workers, where, "whole", addresses)
    run = subprocess.run(command, env=_trainer_env(workers), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["rollout/workers"] for r in _logged(workdir)] == [2, 2, 2, 2]
    return workdir


def test_a_trainer_killed_and_restarted_resumes_on_the_same_workers(
    workers, uninterrupted, tmp_path
):
    """kill -9 of a split run's trainer (rollout.workers=2) once its first checkpoint is
    on disk, while it waits for a step's scores; started again on the same workdir, it
    resumes from that checkpoint on the same two worker processes (still running, their
    sessions freed when the connection broke) and ends as the uninterrupted run does:
    samples.jsonl (every row, its prompt, completion and reward) and the final parameters
    equal bit for bit. max_staleness=0 makes that a property of the checkpoint: each step
    is sampled by the parameters the previous update made, which the checkpoint holds,
    with keys from (train.seed, step) alone; with a bound above 0 the uninterrupted run
    samples the step after the checkpoint with older parameters than the resumed run.
    (Steps go round the two workers; the uninterrupted run's start with the other one.)"""
    import subprocess

    assert all(p.poll() is None for p, _ in workers.static), "a static worker died earlier"
    addresses = ",".join(a for _, a in workers.static)
    command, cut = _restart_run(workers, tmp_path, "cut", addresses)
    resume_at = _killed_at_the_gate(workers, command, cut, tmp_path)
    assert resume_at in (1, 2)  # held at step 2's or 3's scores (4 steps)

    rerun = subprocess.run(command, env=_trainer_env(workers), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"at step {resume_at}" in rerun.stderr
    assert all(p.poll() is None for p, _ in workers.static)  # the same processes served
    logged = _logged(cut)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(r["rollout/workers"] == 2 and r["rollout/workers_lost"] == 0 for r in logged)
    _ran_the_same(cut, uninterrupted)


@pytest.mark.slow
def test_a_run_starts_and_resumes_without_one_of_its_workers(workers, uninterrupted, tmp_path):
    """The restart above, each time with one of the two workers missing: the run starts
    with nothing at the first address (the trainer waits rollout.worker_start_s for both,
    warns once naming it, samples on the other), its trainer is killed at the gate, a
    worker comes up at the first address and the one that served the run is killed; the
    trainer started again resumes on the new one alone (warning of the lost one) and ends
    as the uninterrupted run does, bit for bit: samples.jsonl and the final parameters.
    The three runs' steps are drawn by three different worker processes: a step is
    sampled whole by one worker with the trainer's key (train.seed, step), by the same
    engine over the same weights, so which one draws it does not change the draw."""
    import subprocess

    port = _free_port()
    later = f"127.0.0.1:{port}"
    [(lost, address)] = _start_workers(workers.path, ["static"])
    command, cut = _restart_run(workers, tmp_path, "cut", f"{later},{address}", start_s=2.0)
    joined = []
    try:
        resume_at = _killed_at_the_gate(workers, command, cut, tmp_path)
        _stop([lost])  # the worker that served the run is gone before the trainer restarts
        joined = _start_workers(workers.path, ["static"], port=port)
        rerun = subprocess.run(command, env=_trainer_env(workers), capture_output=True, text=True)
    finally:
        _stop([lost] + [p for p, _ in joined])
    assert resume_at in (1, 2)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"at step {resume_at}" in rerun.stderr
    for log, missing in ((tmp_path / "killed.log").read_text(), later), (rerun.stderr, address):
        [warning] = [line for line in log.splitlines() if "did not answer" in line]
        assert f"rollout workers {missing} did not answer within 2 s: starting on 1 of 2" in warning
    logged = _logged(cut)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(r["rollout/workers"] == 1 and r["rollout/workers_lost"] == 0 for r in logged)
    _ran_the_same(cut, uninterrupted)


def test_a_trainer_gone_mid_step_leaves_the_worker_to_the_next(workers):
    """A trainer's connections close while the workers decode for it (their steps 4 of 6
    tokens in, a `run` sent and its answer, the finished steps, never read): each worker
    finishes the chunk, finds the connection gone as it answers, drops that session and
    serves the next trainer, which connects meanwhile; its steps (the same ones, the
    same keys) come back as the local stream draws them."""
    from jaxrl_llm.workers.remote import RemoteStream

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=2)
    first = RemoteStream(remote, params, 0, spec, chunk=2)
    for step, (ids, mask) in prompts.items():
        first.submit(step, ids, mask, step)
    assert first.run_chunk() == [] and first.run_chunk() == [] and first.in_flight
    for link in first.links:
        wire.send(link.sock, "run")
        link.sock.close()  # gone before the answer: the worker's reply finds no one
    second = RemoteStream(remote, params, 0, spec, chunk=2)
    try:
        for step, (ids, mask) in prompts.items():
            second.submit(step, ids, mask, step)
        got = _drain(second)
        assert sorted(got) == [0, 1, 2, 3] and second.stats["workers"] == 2
        for step in got:
            _same(got[step], want[step])
    finally:
        second.close()
    assert all(p.poll() is None for p, _ in workers.static)


def test_a_worker_killed_mid_step_loses_nothing(workers):
    """kill -9 of a worker while its steps are half decoded (partial rollouts, 2 tokens per
    chunk): its steps go to the other worker and every step comes back once, as the local
    stream draws it."""
    import os
    import signal

    from jaxrl_llm.workers.remote import RemoteStream

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=2)
    stream = RemoteStream(remote, params, 0, spec, chunk=2)
    try:
        for step, (ids, mask) in prompts.items():
            stream.submit(step, ids, mask, step)
        assert stream.run_chunk() == [] and stream.in_flight  # 2 of 6 tokens drawn
        victim = workers.static[1][0]
        held = set(stream.links[1].steps)
        assert len(held) == 2
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        got = _drain(stream)
        assert sorted(got) == [0, 1, 2, 3] and not stream.finished
        for step in got:
            _same(got[step], want[step])
        assert stream.stats["workers_lost"] == 1 and stream.stats["requeued"] == 2
        assert [k.alive for k in stream.links] == [True, False]
    finally:
        stream.close()


def test_a_hung_worker_is_dropped_after_the_timeout(workers):
    """A worker stopped with SIGSTOP keeps its connection open and never answers: after
    `timeout_s` of silence it is dropped as a dead one and the steps it held are drawn by
    the other worker; every step comes back once, as the local stream draws it."""
    import dataclasses
    import os
    import signal

    from jaxrl_llm.workers.remote import RemoteStream

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
    [(victim, address)] = _start_workers(workers.path, ["static"])
    try:
        remote = dataclasses.replace(remote, addresses=(remote.addresses[0], address))
        stream = RemoteStream(remote, params, 0, spec)
        try:
            for step, (ids, mask) in prompts.items():
                stream.submit(step, ids, mask, step)
            assert sorted(_drain(stream)) == [0, 1, 2, 3]  # both compiled and answered
            for link in stream.links:  # no compile ahead: answers come in well under this
                link.sock.settimeout(5.0)
            for step, (ids, mask) in prompts.items():  # steps 4..7: the same draws again
                stream.submit(4 + step, ids, mask, step)
            assert sorted(stream.links[1].steps) == [5, 7]
            os.kill(victim.pid, signal.SIGSTOP)
            got = _drain(stream)
            assert sorted(got) == [4, 5, 6, 7] and not stream.finished
            for step in got:
                _same(got[step], want[step - 4])
            assert stream.stats["workers_timed_out"] == 1 and stream.stats["requeued"] == 2
            assert [k.alive for k in stream.links] == [True, False]
        finally:
            stream.close()
    finally:
        _stop([victim])


KILL_RUN_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from tiny_run import signal_config


def get_config():
    c = signal_config({model_dir!r})
    c.train.num_steps, c.train.log_every = {steps}, 1
    c.train.print_samples_every, c.train.num_printed_samples = 1, 1000  # every row
    c.rollout.mode, c.rollout.max_staleness = "split", 0  # each step queued after a sync
    c.rollout.partial, c.rollout.partial_chunk = True, 2
    c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 0
    c.rollout.workers, c.rollout.worker_addresses = {workers}, {addresses!r}
    c.rollout.worker_retry_s = 0.0  # a lost worker is tried again before each step
    if {env}:  # multi-turn: the environments here, each step's turns on a worker
        c.rewards = {{}}
        c.env.name = {tests!r} + "/envs_for_tests.py:Sleepy"
        c.env.options = {{"turns": 2, "delay_s": 0.5, "mark": {mark!r}}}
        c.env.max_turns, c.env.max_total_tokens, c.env.workers = 2, 16, 2
    return c
"""


@pytest.mark.parametrize(
    "multi_turn", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["", "environments"]
)
def test_a_worker_killed_inside_a_training_run_loses_no_row_and_its_restart_joins(
    workers, tmp_path, multi_turn
):
    """kill -9 of one of the two workers of a split run once its first step is trained
    (the victim is listed first, so it samples step 1; max_staleness 0: a step is queued
    after the sync that finds it gone at the latest): the run goes on on the other; a
    worker then started at the victim's address (the trainer held meanwhile, so that
    steps remain) is taken back (`rollout.worker_retry_s=0`: tried before each step) and
    samples a step. Every step trains the data's next batch, each row once (samples.jsonl
    against the data order), and every reward is its own completion's (no lost generation
    trained as a zero reward). "environments": multi-turn steps (the environments here,
    each step's turns on a worker), the victim killed while it holds step 1's rows
    between their turns: the step is played again on the other worker, and every
    trajectory is played to its end (no error, reward > 0)."""
    import json
    import os
    import re
    import signal

    steps = 4
    [(victim, address)] = _start_workers(workers.path, ["static"])
    file = tmp_path / "run.py"
    addresses = f"{address},{workers.static[0][1]}"  # the victim first: it takes step 1
    mark = tmp_path / "turn_ended"
    trainer = _start_run(file, workers.path, steps, 2, addresses, multi_turn, mark)
    workdir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    restarted = []
    try:
        # multi-turn: step 1's first turn ended, its rows wait on the victim for their
        # next turn; single-turn: step 1 trained
        _wait_for(trainer, mark if multi_turn else metrics)
        os.kill(victim.pid, signal.SIGKILL)  # its connection breaks mid-run
        os.kill(trainer.pid, signal.SIGSTOP)  # steps 3 and 4 are still to be given out
        try:
            port = int(address.rpartition(":")[2])
            restarted = _start_workers(workers.path, ["static"], port=port)
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
        _, err = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, err[-3000:]
        assert _steps_sampled(restarted[0][0]) >= 1
    finally:
        _stop([victim, trainer] + [p for p, _ in restarted])
    with open(metrics) as f:
        logged = [r for r in map(json.loads, f) if "rollout/workers_lost" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    last = logged[-1]
    assert last["rollout/workers_lost"] == 1 and last["rollout/workers_joined"] == 1
    assert last["rollout/workers"] == 2
    if multi_turn:  # step 1 played again on the other worker
        assert logged[0]["rollout/requeued"] == 1, logged[0]
    rows = _rows_in_data_order(file, workdir, workers.path, steps, rendered=multi_turn)
    for r in rows:
        if multi_turn:  # Sleepy's: 0.5 at the first turn, 1 when done at the second
            assert r["reward"] > 0 and all(t["role"] != "error" for t in r["turns"]), r
            assert sum(t["role"] == "model" for t in r["turns"]) == 2, r
        else:  # the format reward: 1 when the completion starts with a digit
            digit = re.fullmatch("[0-9].*", r["completion"], re.DOTALL) is not None
            assert r["reward"] == float(digit), r


@pytest.mark.slow  # the stream's join test runs the same `Fleet.refresh`
def test_a_worker_listed_in_the_file_mid_run_takes_the_next_step(workers, tmp_path):
    """A split run reading its workers from a file (`rollout.worker_addresses=@FILE`)
    that lists one worker; once step 1 is trained (the trainer held meanwhile) a new
    worker is started and appended to the file: it joins (`rollout/workers_joined` 1,
    `rollout/workers` 2) and samples steps (its own count, said when the trainer goes),
    and every step trains the data's next batch, each row once."""
    import json
    import os
    import signal

    steps = 4
    listed = tmp_path / "workers"
    listed.write_text(workers.static[0][1] + "\n")
    file = tmp_path / "run.py"
    trainer = _start_run(file, workers.path, steps, 1, "@" + str(listed))
    workdir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    joined = []
    try:
        _wait_for(trainer, metrics)  # step 1 trained
        os.kill(trainer.pid, signal.SIGSTOP)  # steps 3 and 4 are still to be given out
        try:
            joined = _start_workers(workers.path, ["static"])
            with open(listed, "a") as f:
                f.write(joined[0][1] + "\n")
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
        _, err = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, err[-3000:]
        assert _steps_sampled(joined[0][0]) >= 1
    finally:
        _stop([trainer] + [p for p, _ in joined])
    with open(metrics) as f:
        logged = [r for r in map(json.loads, f) if "rollout/workers" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    assert logged[-1]["rollout/workers_joined"] == 1 and logged[-1]["rollout/workers"] == 2
    _rows_in_data_order(file, workdir, workers.path, steps)


def _start_run(file, model_dir, steps, n, addresses, multi_turn=False, mark=""):
    """Writes KILL_RUN_CONFIG (`n` workers at `addresses`) to `file` and starts its run,
    workdir 'run' beside it -> the trainer process."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    file.write_text(
        KILL_RUN_CONFIG.format(
            tests=tests,
            model_dir=model_dir,
            steps=steps,
            workers=n,
            addresses=addresses,
            env=multi_turn,
            mark=str(mark),
        )
    )
    workdir = file.parent / "run"
    env = _worker_env(model_dir) | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={file}", f"--workdir={workdir}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(trainer, path) -> None:
    """Until `path` exists with a line in it (a mark file: exists), the trainer running."""
    import time

    while not (path.exists() and (path.suffix != ".jsonl" or path.read_text().count("\n"))):
        assert trainer.poll() is None, trainer.communicate()[1][-3000:]
        time.sleep(0.05)


def _steps_sampled(worker) -> int:
    """How many steps a worker process says it sampled for the trainer that went (its
    stdout read until that line, for up to 60 s)."""
    import re
    import threading

    said = []

    def read():
        for line in worker.stdout:
            said.append(line)
            if "gone" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    [gone] = [line for line in said if "gone" in line]
    return int(re.search(r"gone: (\d+) steps sampled", gone)[1])


def _rows_in_data_order(file, workdir, model_dir, steps: int, rendered=False) -> list:
    """samples.jsonl of the run in `workdir` (config `file`): each step's rows are the
    data order's next batch, each prompt G times (rendered: the prompt is the
    environment's reset, Sleepy's question, rendered), and nothing else -> its rows."""
    import json

    from jaxrl_llm import data, envs

    with open(workdir / "samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    spec = importlib.util.spec_from_file_location("run_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    G = config.rollout.num_generations
    tokenizer = models.builtin.load_tokenizer(model_dir)
    order = data.make_iterator(config.data, tokenizer, config.rollout.batch_size)
    renderer = envs.Renderer(tokenizer, bool(getattr(tokenizer, "chat_template", None)))
    for step in range(1, steps + 1):
        batch = next(order)
        want = batch.prompts
        if rendered:
            want = [tokenizer.decode(renderer.prompt(e["question"])) for e in batch.examples]
        want = [p for p in want for _ in range(G)]
        assert [r["prompt"] for r in rows if r["step"] == step] == want, step
    assert len(rows) == steps * config.rollout.batch_size * G
    return rows


def _joined_takes_the_next_step(stream, prompts, want, got: dict, first: str, joined: str):
    """Steps 2 and 3 submitted after steps 0 and 1 (`got`) came back from `first`: the
    worker that joined at `joined` takes step 2 (never given one), `first` step 3, and
    all four are as the local stream draws them."""
    for step in (2, 3):
        stream.submit(step, *prompts[step], step)
    assert [(k.address, sorted(k.steps)) for k in stream.links] == [
        (first, [3]),
        (joined, [2]),
    ]
    got |= _drain(stream)
    assert sorted(got) == [0, 1, 2, 3]
    for step in got:
        _same(got[step], want[step])
    assert stream.stats["workers_joined"] == 1 and stream.stats["workers"] == 2


def test_a_worker_listed_mid_stream_joins_and_one_unlisted_leaves(workers, tmp_path):
    """Addresses from a file (`rollout.worker_addresses=@path`), read again before each
    step is given out: a worker started after the first steps and added to the file
    gets the weights and takes the next steps; one taken off the file takes no new step
    and is closed once its steps are back. Every step as the local stream draws it."""
    import dataclasses

    from jaxrl_llm.workers.remote import RemoteStream

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
    listed = tmp_path / "workers"
    first = workers.static[0][1]
    listed.write_text(first + "\n")
    remote = dataclasses.replace(remote, addresses=(), addresses_file=str(listed))
    stream = RemoteStream(remote, params, 0, spec)
    joined = []
    try:
        assert [k.address for k in stream.links] == [first]
        for step in (0, 1):
            stream.submit(step, *prompts[step], step)
        got = _drain(stream)
        joined = _start_workers(workers.path, ["static"])
        [(_, address)] = joined
        listed.write_text(f"{first}\n{address}\n")
        _joined_takes_the_next_step(stream, prompts, want, got, first, address)
        listed.write_text(address + "\n")  # the first leaves
        stream.submit(4, *prompts[0], 0)
        assert [sorted(k.steps) for k in stream.links] == [[], [4]]
        ((out, _),) = _drain(stream).values()
        np.testing.assert_array_equal(out.tokens, want[0][0].tokens)
        assert [k.alive for k in stream.links] == [False, True] and stream.stats["workers"] == 1
    finally:
        stream.close()
        _stop([p for p, _ in joined])


def test_a_stream_opens_without_a_given_worker_that_joins_when_it_answers(workers, caplog):
    """Two addresses given, nothing listening at the first: the stream waits
    connect_timeout_s (`rollout.worker_start_s`), opens on the other with one warning
    naming the missing one, and tries it again as a lost worker (every `retry_s`, here
    0: before each step): a worker started at that address joins, gets the weights and
    takes a step. Every step as the local stream draws it. None answering: one error."""
    import dataclasses
    import logging

    from jaxrl_llm.workers import remote as remote_lib

    remote, spec, params, prompts, want = _greedy_steps(workers, chunk=0)
    port = _free_port()
    missing, first = f"127.0.0.1:{port}", workers.static[0][1]
    remote = dataclasses.replace(
        remote, addresses=(missing, first), connect_timeout_s=1.0, retry_s=0.0
    )
    alone = f"none of the rollout workers answered within 1 s: {missing} \\(.*refused\\)$"
    with pytest.raises(wire.WorkerError, match=alone):
        remote_lib.RemoteStream(dataclasses.replace(remote, addresses=(missing,)), params, 0, spec)
    with caplog.at_level(logging.WARNING):
        stream = remote_lib.RemoteStream(remote, params, 0, spec)
    joined = []
    try:
        [warning] = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
        assert warning.startswith(f"rollout workers {missing} did not answer within 1 s: ")
        assert [k.address for k in stream.links] == [first] and stream.stats["workers"] == 1
        for step in (0, 1):
            stream.submit(step, *prompts[step], step)
        got = _drain(stream)
        joined = _start_workers(workers.path, ["static"], port=port)
        _joined_takes_the_next_step(stream, prompts, want, got, first, missing)
        assert stream.stats["workers_lost"] == 0
    finally:
        stream.close()
        _stop([p for p, _ in joined])

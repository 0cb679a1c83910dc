"""Framed messages between a trainer and its rollout workers over TCP, and who may send them.

    sock = wire.connect("10.0.0.7:7070", token)          # refused -> WorkerError
    wire.send(sock, "submit", {"step": 3}, {"prompt_ids": ids})
    kind, fields, arrays = wire.recv(sock)

    conn, _ = listener.accept()
    wire.authorize(conn, token)                           # first frame: "hello" + token

A frame is MAGIC, the protocol version (u32), the header's length (u64), the header (UTF-8
JSON: `kind`, `fields`, and `arrays`, a list of {name, shape, dtype, nbytes}), then each
array's raw bytes (C order, little-endian) in that order. Nothing is pickled: a header is
JSON, an array's dtype one of `DTYPES`, its byte count checked against its shape before a
byte of it is read.

Security: whoever can reach a worker's port could otherwise push weights into it or read
its rollouts. The first frame of a connection must be `hello` carrying the shared secret
(`hmac.compare_digest` against the worker's); a frame before it may not exceed
`HELLO_BYTES` nor carry arrays. A wrong or missing token gets one `error` frame ("wrong
token") and the connection is closed; the client raises `WorkerError` with that line.
With TLS (`server_context` on the worker, `client_context` on the trainer) every byte,
the token and the weights included, is encrypted and the trainer checks the worker's
certificate against its CA file before it sends the token; without it they travel in
clear (a private network then, or a tunnel: docs/workers.md). A plain trainer reaching a
TLS worker gets one `error` frame saying so.
"""

from __future__ import annotations

import hmac
import json
import math
import socket
import ssl
import struct

import ml_dtypes
import numpy as np

TOKEN_ENV = "JAXRL_WORKER_TOKEN"  # where a worker, and a trainer with workers, find it
MAGIC = b"JRLW"
PROTOCOL = 1
_PREFIX = struct.Struct("<4sIQ")  # magic, protocol version, header bytes
HELLO_BYTES = 4096  # the most a frame may hold before the token is checked
MAX_HEADER_BYTES = 64 << 20  # a header (names, shapes) past this is refused
DTYPES = {
    name: np.dtype(t)
    for name, t in {
        "bool": np.bool_,
        "int8": np.int8,
        "int16": np.int16,
        "int32": np.int32,
        "int64": np.int64,
        "uint8": np.uint8,
        "uint16": np.uint16,
        "uint32": np.uint32,
        "float16": np.float16,
        "float32": np.float32,
        "bfloat16": ml_dtypes.bfloat16,
    }.items()
}


class WorkerError(RuntimeError):
    """A worker refused a request, answered with an error, or broke the protocol."""


class Closed(WorkerError, ConnectionError):
    """The other side closed the connection (or died) in the middle of a frame."""


def send(sock: socket.socket, kind: str, fields: dict | None = None, arrays=None) -> None:
    """One frame: `fields` (JSON-able) and `arrays` ({name: numpy array}, any of `DTYPES`)."""
    arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
    table = []
    for name, a in arrays.items():
        if a.dtype.name not in DTYPES:
            raise TypeError(f"array {name!r}: dtype {a.dtype} is not one the wire carries")
        table.append({"name": name, "shape": list(a.shape), "dtype": a.dtype.name})
    header = json.dumps({"kind": kind, "fields": fields or {}, "arrays": table}).encode()
    sock.sendall(_PREFIX.pack(MAGIC, PROTOCOL, len(header)) + header)
    for a in arrays.values():
        if a.size:
            sock.sendall(memoryview(a.reshape(-1).view(np.uint8)))


def recv(sock: socket.socket, max_header: int = MAX_HEADER_BYTES) -> tuple[str, dict, dict]:
    """The next frame -> (kind, fields, {name: numpy array}); an `error` frame raises
    `WorkerError` with its message."""
    magic, version, size = _PREFIX.unpack(_read(sock, _PREFIX.size))
    if magic != MAGIC or version != PROTOCOL:
        raise WorkerError(f"not a worker frame (magic {magic!r}, protocol {version})")
    if size > max_header:
        raise WorkerError(f"frame header of {size} bytes refused (limit {max_header})")
    header = json.loads(_read(sock, size))
    arrays = {}
    for entry in header["arrays"]:
        if entry["dtype"] not in DTYPES:
            raise WorkerError(f"array {entry['name']!r}: dtype {entry['dtype']!r} refused")
        dtype, shape = DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"])
        if any(n < 0 for n in shape):
            raise WorkerError(f"array {entry['name']!r}: shape {shape} refused")
        buf = np.empty(math.prod(shape) * dtype.itemsize, np.uint8)
        _read_into(sock, memoryview(buf))
        arrays[entry["name"]] = buf.view(dtype).reshape(shape)
    if header["kind"] == "error":
        raise WorkerError(header["fields"].get("message", "error"))
    return header["kind"], header["fields"], arrays


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise Closed(f"connection closed after {got} of {len(view)} bytes")
        got += n


def connect(
    address: str,
    token: str,
    timeout_s: float | None = None,
    hello_s: float | None = None,
    tls: ssl.SSLContext | None = None,
) -> socket.socket:
    """A connection to `host:port` (made within `timeout_s`) that presented `token` and was
    accepted (answered within `hello_s`, default `timeout_s`); with `tls` (a
    `client_context`) encrypted, the worker's certificate checked first (for `host`)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except ssl.SSLError as err:  # not a TLS worker, or not the certificate expected
            sock.close()
            raise WorkerError(
                f"worker {address}: TLS handshake failed ({err.reason or err}); is it started "
                f"with --tls_cert and --tls_key, and is its certificate from "
                f"rollout.worker_tls_ca for {host}?"
            ) from None
    sock.settimeout(timeout_s if hello_s is None else hello_s)
    try:
        send(sock, "hello", {"token": token})
        recv(sock)  # within hello_s: a stopped worker accepts but never answers
    except (Closed, OSError):
        sock.close()
        raise
    except WorkerError as err:
        sock.close()
        raise WorkerError(f"worker {address} refused the connection: {err}") from None
    sock.settimeout(None)
    return sock


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A worker's TLS (1.2 or later): its certificate chain and private key (PEM files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def client_context(ca: str) -> ssl.SSLContext:
    """A trainer's TLS: the workers' certificates must chain to `ca` (a PEM file: a CA,
    or a worker's own self-signed certificate) and name the host dialled (a DNS name or
    an IP address in its subjectAltName)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def accept_tls(conn: socket.socket, tls: ssl.SSLContext) -> socket.socket | None:
    """The server side of TLS on an accepted connection (within its timeout) -> the
    encrypted socket, or None (the connection closed): a client that sent a plain frame
    gets one plain `error` frame saying this worker speaks TLS."""
    try:
        if conn.recv(len(MAGIC), socket.MSG_PEEK) == MAGIC:
            send(conn, "error", {"message": "this worker speaks TLS: set rollout.worker_tls_ca"})
            conn.close()
            return None
        return tls.wrap_socket(conn, server_side=True)
    except OSError:  # ssl.SSLError too: not TLS, a certificate refused, a timeout
        conn.close()
        return None


def authorize(sock: socket.socket, token: str) -> bool:
    """Reads the connection's first frame: True when it is `hello` with `token` (answered
    `ok`); else one `error` frame is sent back, the socket closed, and False."""
    try:
        kind, fields, arrays = recv(sock, max_header=HELLO_BYTES)
        sent = str(fields.get("token", "")) if kind == "hello" and not arrays else ""
    except (WorkerError, ValueError, OSError):
        sent = ""
    if sent and hmac.compare_digest(sent.encode(), token.encode()):
        send(sock, "ok")
        return True
    try:
        send(sock, "error", {"message": "wrong token"})
    except OSError:
        pass
    sock.close()
    return False


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free one; its own at `.getsockname()`)."""
    sock = socket.create_server((host, port), reuse_port=False)
    return sock

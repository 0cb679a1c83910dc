"""A GGUF file's header read into plain Python values, its tensors as memory-mapped views.

`gguf.GGUFReader` keeps two numpy views per string of every metadata array, so a
262k-token vocabulary (Gemma 3) costs ~700 MB of small objects that stay for as long as
the reader does and fragment the heap when freed. This reader walks the same layout
(GGUF v2/v3: header, key/values, tensor infos, aligned data) with `struct` and creates
only the values: strings, numbers, lists. A tensor is described by where it lies; its
data is a view into a mapping of the file (`open_data`) that the loader holds only while
it reads, shaped as `GGUFReader` shapes it (quantized tensors as rows of block bytes), so
`gguf.quants.dequantize` reads it unchanged.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

# GGUF value types: struct format (None: string / array, read by their own code).
_SCALARS = {
    0: "B",  # UINT8
    1: "b",  # INT8
    2: "H",  # UINT16
    3: "h",  # INT16
    4: "I",  # UINT32
    5: "i",  # INT32
    6: "f",  # FLOAT32
    7: "?",  # BOOL
    10: "Q",  # UINT64
    11: "q",  # INT64
    12: "d",  # FLOAT64
}
_STRING, _ARRAY = 8, 9
_NUMPY = {  # unquantized tensor types -> element dtype (others: bytes of blocks)
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class Truncated(ValueError):
    """The file ends before its header, its tensor infos or its tensors do."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    offset: int  # of its first byte in the file
    dtype: np.dtype  # of the view (uint8 rows of block bytes when quantized)
    view_shape: tuple[int, ...]

    def data(self, mm: np.memmap) -> np.ndarray:
        """The tensor as a view into `mm`, the file mapped by `open_data`."""
        n = int(np.prod(self.view_shape, dtype=np.int64)) * self.dtype.itemsize
        return mm[self.offset : self.offset + n].view(self.dtype).reshape(self.view_shape)


def open_data(path: str) -> np.memmap:
    """The file mapped read-only: `Tensor.data` views into it. The mapping (and the pages
    read through it) goes when the last view does."""
    return np.memmap(path, dtype=np.uint8, mode="r")


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str):
        """One value."""
        return self.many(fmt, 1)[0]

    def many(self, fmt: str, count: int) -> tuple:
        """`count` values in a row."""
        fmt = f"{self.order}{count}{fmt}"
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise Truncated(f"needs {size} bytes at offset {self.pos:,}")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise Truncated(f"a {n:,}-byte string at offset {self.pos:,}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at offset {self.pos:,}")
        etype, n = self.take("I"), self.take("Q")
        if etype in _SCALARS:  # numbers: one unpack
            return list(self.many(_SCALARS[etype], n))
        return [self.value(etype) for _ in range(n)]


def read(path: str):
    """(metadata {key: value}, [Tensor]) of a GGUF file; no tensor data is read.

    Raises `Truncated` when the file ends early, ValueError when it is not GGUF."""
    mm = open_data(path)
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number at the start of the file")
    cur = _Cursor(buf, "<")
    cur.pos = 4
    version = cur.take("I")
    if version >= 0x10000:  # written big-endian
        cur.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (readable: 2 and 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    meta = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.many("Q", cur.take("I"))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    align = int(meta.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment={align} is not a power of two")
    start = -(-cur.pos // align) * align
    tensors = [_tensor(len(buf), start, cur.order, *info) for info in infos]
    buf.release()
    return meta, tensors


def _tensor(size: int, start: int, order: str, name: str, dims, raw_type: int, offset: int):
    import gguf

    qtype = gguf.GGMLQuantizationType(raw_type)
    shape = tuple(reversed(dims))  # numpy order
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype.name in _NUMPY:
        dtype = np.dtype(_NUMPY[qtype.name]).newbyteorder(order)
    else:
        dtype = np.dtype(np.uint8)
        shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
    first = start + offset
    if first + n_bytes > size:
        raise Truncated(f"tensor {name!r} ends at {first + n_bytes:,} bytes")
    return Tensor(name, qtype, tuple(dims), first, dtype, tuple(shape))

"""Reading and writing the safetensors format without materialising whole checkpoints.

The format is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}}` and the raw little-endian tensor
bytes. Reading memory-maps each file, so a tensor (or a slice of one) is read from disk
only when it is copied into a device buffer; bfloat16 is read through `ml_dtypes`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def read_header(file: str) -> dict[str, TensorInfo]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: corrupt safetensors header ({e})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {entry['dtype']}; supported: "
                f"{', '.join(DTYPES)}"
            )
        begin, _ = entry["data_offsets"]
        out[name] = TensorInfo(
            file=file,
            dtype=DTYPES[entry["dtype"]],
            shape=tuple(entry["shape"]),
            offset=8 + size + begin,
        )
    return out


class Checkpoint:
    """All tensors of a HF model directory (one file, several files, or an index json)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(path, fn) for fn in weight_map.values()})
            for fn in files:
                if not os.path.isfile(fn):
                    raise FileNotFoundError(f"{index} names {fn}, which does not exist")
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            weight_map = None
        if not files:
            bins = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
            hint = (
                " (found PyTorch .bin files: re-save with safe_serialization=True)" if bins else ""
            )
            raise FileNotFoundError(f"{path}: no *.safetensors files{hint}")
        self.tensors: dict[str, TensorInfo] = {}
        for fn in files:
            for name, info in read_header(fn).items():
                if name in self.tensors:
                    raise ValueError(
                        f"tensor {name!r} is in both {self.tensors[name].file} and {fn}"
                    )
                self.tensors[name] = info
        if weight_map is not None:
            for name, fn in weight_map.items():
                info = self.tensors.get(name)
                if info is None or os.path.basename(info.file) != fn:
                    raise ValueError(f"{index}: tensor {name!r} is not in {fn}")
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of the tensor (no bytes read yet)."""
        info = self.tensors[name]
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        count = int(np.prod(info.shape, dtype=np.int64))
        data = self._maps[info.file][info.offset : info.offset + count * info.dtype.itemsize]
        return data.view(info.dtype).reshape(info.shape)


def write_file(file: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Writes one safetensors file, tensor by tensor."""
    header, offset = {}, 0
    for name, x in tensors.items():
        if x.dtype not in _DTYPE_NAMES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {x.dtype}")
        header[name] = {
            "dtype": _DTYPE_NAMES[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())

"""TPU chips and topologies to compile for, from a CPU process, through libtpu.

    chip = CHIPS["v6e"]                         # published peak bf16 FLOP/s, HBM, bandwidth
    topo = parse_topology("v5p:4x4x4*2")        # 2 slices of a v5p 4x4x4 (64 chips each)
    devices = topology_devices(topo)            # the chips, as jax devices to compile for
    chip = chip_of(jax.devices()[0].device_kind)  # None: not a chip in these tables

libtpu describes any topology without hardware: with `TPU_SKIP_MDS_QUERY=1` and
`jax_platforms=cpu`, `jax.experimental.topologies.get_topology_desc` gives every chip of
every host and slice as a device; a program lowered with abstract arrays sharded over
them compiles with XLA:TPU (Pallas kernels through Mosaic) and reports its memory and cost.

The chip figures are Google Cloud's published ones per chip (docs/tpu.md names the pages).
"""

from __future__ import annotations

import dataclasses
import os
import re

from jaxrl_llm.errors import UserError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's published figures: peak dense bf16 FLOP/s, HBM bytes and bandwidth."""

    name: str
    device_kind: str  # jax's Device.device_kind for the chip
    bf16_flops: float  # FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s


CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9),
    "v5p": Chip("v5p", "TPU v5", 459e12, 95 * GiB, 2765e9),
    "v6e": Chip("v6e", "TPU v6 lite", 918e12, 32 * GiB, 1640e9),
}


# GPUs, for benchmarks/device_check.py's roofline beside its measured phases: NVIDIA's
# published dense (no sparsity) bf16 tensor-core peak, HBM size and bandwidth (SXM).
GPUS = {
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 989e12, 80 * GiB, 3350e9),
    "h200": Chip("h200", "NVIDIA H200", 989e12, 141 * GiB, 4800e9),
}


def chip_of(device_kind: str) -> Chip | None:
    """The figures of the chip a jax device kind names (None: not in CHIPS or GPUS)."""
    kind = device_kind.lower()
    for chip in (*CHIPS.values(), *GPUS.values()):
        if kind == chip.device_kind.lower() or (chip.name in GPUS and chip.name in kind):
            return chip
    return None


class TopologyError(UserError, ValueError):
    """A --compile_for value that is not a topology libtpu can describe."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice shape of one chip kind, and how many such slices (multi-slice)."""

    chip: Chip
    shape: tuple[int, ...]  # chips per dimension: (2, 4) for a v6e 2x4
    slices: int = 1

    @property
    def name(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def num_chips(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.slices

    def __str__(self) -> str:
        tail = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"{self.name}{tail} ({self.num_chips} chips)"


_TOPOLOGY = re.compile(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})(?:\*(\d+))?")


def parse_topology(text: str) -> Topology:
    """'v6e:2x4', 'v5p:4x4x4', 'v5e:16x16*2' (2 slices) -> a Topology."""
    m = _TOPOLOGY.fullmatch(text.strip())
    if m is None:
        raise TopologyError(
            f"--compile_for={text!r}: expected CHIP:SHAPE[*SLICES], e.g. v6e:2x4, "
            f"v5p:4x4x4 or v5e:16x16*2, with CHIP one of {sorted(CHIPS)}"
        )
    kind, shape, slices = m.group(1), m.group(2), m.group(3)
    if kind not in CHIPS:
        raise TopologyError(f"--compile_for={text!r}: chip {kind!r} is not one of {sorted(CHIPS)}")
    dims = tuple(int(d) for d in shape.split("x"))
    if kind == "v5p" and len(dims) != 3:
        raise TopologyError(f"--compile_for={text!r}: a v5p slice is 3-D, e.g. v5p:2x2x1")
    if kind != "v5p" and len(dims) != 2:
        raise TopologyError(f"--compile_for={text!r}: a {kind} slice is 2-D, e.g. {kind}:2x4")
    if min(dims) < 1 or (slices is not None and int(slices) < 1):
        raise TopologyError(f"--compile_for={text!r}: sizes must be >= 1")
    return Topology(CHIPS[kind], dims, int(slices or 1))


# libtpu's settings for a process that only describes chips: no metadata server query
# (not a TPU VM), no lock file (several such processes may compile at once), this host
# as the only worker (else libtpu logs an error about the missing worker list).
DESCRIBE_ONLY = {
    "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def set_platforms(environ, compile_only: bool = False) -> None:
    """Before jax starts: a compile-only run is a CPU process that libtpu describes chips
    in (no metadata server query: there is no TPU VM; no TPU backend). Otherwise, where
    libtpu is installed on a machine without TPU chips or a CUDA plugin and the user set
    no JAX_PLATFORMS, jax is kept on the CPU: with libtpu present it would try to start a
    TPU backend, print libtpu's errors about the missing TPU environment, and fall back."""
    if compile_only:
        environ.update(DESCRIBE_ONLY)
        environ["JAX_PLATFORMS"] = "cpu"
    elif "JAX_PLATFORMS" not in environ and not _has_accelerator() and _installed("libtpu"):
        environ["JAX_PLATFORMS"] = "cpu"


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _has_accelerator() -> bool:
    """TPU chips (/dev/accel*, /dev/vfio) or a CUDA plugin for jax."""
    import glob

    if glob.glob("/dev/accel*") or os.path.isdir("/dev/vfio"):
        return True
    return any(_installed(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def topology_devices(topo: Topology) -> list:
    """The chips of `topo` (every host's, every slice's) as jax devices to compile for.
    Raises TopologyError when libtpu is not installed or cannot describe the topology."""
    from jax.experimental import topologies

    for key, value in DESCRIBE_ONLY.items():  # read when libtpu first loads
        os.environ.setdefault(key, value)
    # A host holds up to 2 x 2 chips of any kind: what is per host only decides which
    # process a chip belongs to, not what compiles.
    per_host = tuple(min(2, d) for d in topo.shape[:2]) + (1,)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topo.name,
            chip_config_name="default",
            chips_per_host_bounds=per_host,
            num_slices=topo.slices,
        )
    except Exception as err:  # libtpu absent, or a shape it does not know
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        hint = " (is libtpu installed? pip install -e '.[tpu]')" if "tpu" in first.lower() else ""
        raise TopologyError(f"--compile_for={topo.name}: {first}{hint}") from None
    devices = list(desc.devices)
    if len(devices) != topo.num_chips:
        raise TopologyError(
            f"--compile_for={topo.name}: libtpu describes {len(devices)} devices, expected "
            f"{topo.num_chips} chips"
        )
    return devices

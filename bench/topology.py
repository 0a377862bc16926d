"""A TPU slice's devices on this CPU machine, for compiling ahead of time with libtpu's compiler.

    devices = compile_devices(slice_for("v5e-8"), command)  # 8 compile-only TPU v5 lite devices
    mesh = sharding.make_mesh(devices, "fsdp")     # then jit(step).lower(abstract state).compile()

`jax.experimental.topologies.get_topology_desc` asks libtpu for the devices of a slice that is not
attached: they can be placed in a mesh and compiled for, never run on. The compiled program's
`memory_analysis()` is then the TPU compiler's own accounting (its scheduling, fusion and
rematerialisation), not XLA:CPU's; a program that does not fit the chip's HBM fails to compile with
the same out-of-memory message it would give on the chip.

libtpu stays out of the project's environment: installed there, it makes JAX and flaxchat take the
machine for a TPU host (`flaxchat.kernels.runs_on_cpu`). `libtpu_help` says how to install it in a
folder of its own and put that on PYTHONPATH for the one command.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os

from flaxchat.errors import UserError

# The libtpu that jax[tpu]==0.10.2 pins (jax's METADATA: `libtpu==0.0.42.*; extra == "tpu"`); a
# libtpu of another jax release may not load into this jaxlib.
LIBTPU_REQUIREMENT = "libtpu==0.0.42.*"

# HBM per chip (Google's Cloud TPU system architecture pages).
HBM_BYTES = {"v4": 32 * 2**30, "v5litepod": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
# libtpu's name for each generation in a topology name ("v5e:2x4"), and its chip configuration:
# v4 and v5p chips are two TensorCores that JAX sees as one device ("megacore").
_LIBTPU_NAME = {"v4": ("v4", "megacore"), "v5litepod": ("v5e", "default"), "v5p": ("v5", "megacore"),
                "v6e": ("v6e", "default")}


def libtpu_help(command: str) -> str:
    """The one sentence for a machine without libtpu: how to install it, and `command` run with it."""
    return (f"--topology compiles with libtpu, the TPU compiler, which this Python cannot import; install it in "
            f"a folder of its own (in this environment it would make flaxchat take this machine for a TPU host) "
            f"and put that folder on PYTHONPATH for this command only: "
            f"pip install --no-deps --target ~/libtpu '{LIBTPU_REQUIREMENT}' && PYTHONPATH=$PWD:~/libtpu {command}")


def have_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@dataclasses.dataclass(frozen=True)
class Slice:
    """What libtpu needs to describe a slice, and what the bench prints about it."""

    accelerator: str  # as Cloud TPU names it: v4-32, v5litepod-8, v6e-64
    chips: int  # JAX devices
    kind: str  # generation in flaxchat.cloud.topology's terms: v4, v5litepod, v5p, v6e
    topology_name: str  # libtpu's: "v5e:2x4", "v4:2x2x4"
    chip_config_name: str
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]

    @property
    def hbm_bytes(self) -> int:
        return HBM_BYTES[self.kind]


def _grid(chips: int, dims: int) -> tuple[int, ...] | None:
    """The chip grid of a slice: 2D for v5e/v6e (2x2, 2x4, 4x4, ... 16x16), 3D for v4/v5p (2x2x1,
    2x2x2, 2x2x4, 2x4x4, 4x4x4, ...), the shapes Google's pages list for the power-of-two sizes:
    each doubling doubles the smallest side (the last of equal ones)."""
    if chips == 1:
        return (1,) * dims
    shape = [2, 2] if dims == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        i = max(j for j in range(dims) if shape[j] == min(shape))
        shape[i] *= 2
    return tuple(shape) if math.prod(shape) == chips else None


def slice_for(name: str) -> Slice:
    """The slice of an accelerator name (v5e-8 or v5litepod-8, v6e-64, v4-32, v5p-8); a UserError
    names the valid ones."""
    from flaxchat.cloud.topology import TOPOLOGIES, topology_for
    key = name.strip().lower()
    family, _, size = key.rpartition("-")
    if family in ("v5e", "v5lite") and f"v5litepod-{size}" in TOPOLOGIES:  # Google says v5e; the API, v5litepod
        key = f"v5litepod-{size}"
    topo = topology_for(key)
    lib_name, chip_config = _LIBTPU_NAME[topo.generation]
    dims = 3 if topo.generation in ("v4", "v5p") else 2
    grid = _grid(topo.chips, dims)
    if grid is None:
        raise UserError(f"--topology {name}: this bench lays out slices of a power-of-two number of chips, "
                        f"and {name} has {topo.chips}; pick the nearest power-of-two slice.")
    # A host holds all the chips of a one-VM slice (1, 4 or 8 chips), else 4 chips (2x2).
    per_host = topo.chips_per_worker
    bounds = (1, 1, 1) if per_host == 1 else (2, 2, 1) if per_host == 4 else (2, per_host // 2, 1)
    # Torus links: a full v4/v5p cube (4x4x4 and up) wraps on every side; a v5e/v6e side wraps at 16.
    if dims == 3:
        wrap = (min(grid) >= 4,) * 3
    else:
        wrap = (grid[0] >= 16, grid[1] >= 16, False)
    topology_name = f"{lib_name}:{'x'.join(str(g) for g in grid)}"
    return Slice(topo.accelerator, topo.chips, topo.generation, topology_name, chip_config, bounds, wrap)


def compile_devices(s: Slice, command: str, slices: int = 1) -> list:
    """The slice's devices, compile-only, from libtpu (without it, a UserError that shows how to run
    `command` with it). `slices` > 1: that many copies of the slice joined by the data-centre network
    (multislice); each device's `slice_index` says which, and they come slice by slice."""
    if not have_libtpu():
        raise UserError(libtpu_help(command))
    # libtpu takes /tmp/libtpu_lockfile, one process per machine, so that two never drive the same
    # chips; a compile-only slice drives none, and a second bench, or one beside training on a TPU
    # VM, would otherwise stop at "Internal error when accessing libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    with _stderr_kept_unless_failed():
        desc = topologies.get_topology_desc(platform="tpu", topology_name=s.topology_name,
                                            chip_config_name=s.chip_config_name,
                                            chips_per_host_bounds=s.chips_per_host_bounds, num_slices=slices,
                                            wrap=s.wrap)
    return list(desc.devices)


@contextlib.contextmanager
def _stderr_kept_unless_failed():
    """libtpu starting off a TPU VM warns on the process's stderr that it found no TPU metadata (no
    accelerator type, no worker hostnames), which a compile-only slice does not need: those lines
    are held back, and shown only if the call fails."""
    import sys

    from flaxchat.common import native_stderr_to
    held: list[str] = []
    try:
        with native_stderr_to(held):
            yield
    except BaseException:
        sys.stderr.write("".join(held))
        raise


def splash_compiled(q, k, v, window, block):
    """Splash attention lowered for the TPU (Mosaic) although this process's backend is the CPU:
    `flaxchat.kernels.tpu` decides interpret mode by the running backend, which here is not the
    target. The sequence must be a whole number of 128-lane blocks (no padding in a train step)."""
    from flaxchat.kernels.tpu import splash_attention
    return splash_attention(q, k, v, window, interpret=False)


def splash_heads_first_compiled(q, k, v, window, block):
    """`splash_compiled` on (B, heads, T, D) arrays (the TPU record's attention_heads_first)."""
    from flaxchat.kernels.tpu import splash_attention
    return splash_attention(q, k, v, window, interpret=False, heads_first=True)


_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    """XLA's human-readable size ("19.86G", "512.00M": powers of 1024) in bytes."""
    text = text.strip().rstrip("iB") or "0"
    unit = text[-1].upper() if text[-1].isalpha() else "B"
    return int(float(text.rstrip("KMGTkmgt")) * _UNITS.get(unit, 1))


def out_of_memory(message: str) -> dict | None:
    """The sizes in the TPU compiler's out-of-memory error, or None for any other error. libtpu words
    it two ways: the temporaries alone ("the total memory required for HLO temporaries (19.86G)
    exceeds available HBM (15.75G)", d12 at 32 rows on a v5e), or the whole program ("Used 17.6G of
    15.75G hbm")."""
    import re
    m = re.search(r"HLO temporaries \(([\d.]+\s*[KMGT]?i?B?)\) exceeds available HBM \(([\d.]+\s*[KMGT]?i?B?)\)", message)
    if m:
        return dict(temp_b=_bytes(m[1]), hbm_b=_bytes(m[2]))
    m = re.search(r"Used ([\d.]+\s*[KMGT]?i?B?) of ([\d.]+\s*[KMGT]?i?B?) hbm", message)
    if m:
        return dict(peak_b=_bytes(m[1]), hbm_b=_bytes(m[2]))
    return None

"""Compute setup shared by every script: distributed init, the device mesh, dtype, printing.

`compute_init()` is the one place that knows about processes and devices. On a pod (or several
processes on this machine) it joins the job through `jax.distributed.initialize` when the launcher
set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, then builds one mesh over
every device of every process. Batches are sharded over the mesh's 'data' axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxchat.errors import UserError
from flaxchat.kernels import Kernels, PolarExpress, StepPlan, choose
from flaxchat.sharding import BATCH, make_mesh, place_identical


@dataclasses.dataclass(frozen=True)
class Compute:
    mesh: Mesh
    process_index: int
    process_count: int
    backend: str
    compute_dtype: jnp.dtype
    kernels: Kernels  # how the model runs here (flaxchat.kernels): attention, remat, ...
    polar: PolarExpress  # how Muon orthogonalises here: what the optimizer is built with
    plan: StepPlan  # how the train step accumulates micro-batches here: what StepLoop holds

    @property
    def device_count(self) -> int:
        return self.mesh.size

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    @property
    def sharding(self) -> str:
        return "fsdp" if self.mesh.shape["fsdp"] > 1 else "dp"

    def with_sharding(self, sharding: str) -> "Compute":
        """The same devices on a mesh for another layout (dp or fsdp)."""
        return dataclasses.replace(self, mesh=make_mesh(list(self.mesh.devices.flat), sharding))

    def batch_sharding(self, leading: int = 1) -> NamedSharding:
        """Rows split over every device; `leading` unsplit axes before the rows (micro-batches)."""
        return NamedSharding(self.mesh, P(*([None] * leading), BATCH))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


_distributed_initialized = False


def maybe_initialize_distributed(timeout_s: int = 300) -> None:
    """Join a multi-process job when the standard coordinator environment is set."""
    global _distributed_initialized
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not addr or _distributed_initialized:
        return
    try:
        num = int(os.environ["JAX_NUM_PROCESSES"])
        pid = int(os.environ["JAX_PROCESS_ID"])
    except (KeyError, ValueError):
        raise UserError("JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES / JAX_PROCESS_ID are missing or not integers.")
    jax.distributed.initialize(coordinator_address=addr, num_processes=num, process_id=pid,
                               initialization_timeout=timeout_s)
    _distributed_initialized = True
    if jax.process_count() != num:
        raise UserError(f"{jax.process_count()} processes joined but JAX_NUM_PROCESSES says {num}.")


def resolve_dtype(name: str = "auto") -> jnp.dtype:
    if name == "auto":
        # bf16 where the hardware has bf16 matrix units; fp32 on CPU, where XLA's bf16 dot is slower
        # (a 2048^3 matmul: ~440 GFLOP/s fp32 against ~340 bf16 on a 2-core AVX-512 machine).
        return jnp.bfloat16 if jax.default_backend() in ("tpu", "gpu", "cuda", "rocm") else jnp.float32
    return jnp.dtype(name)


def compute_init(dtype: str = "auto", sharding: str = "dp", attention: str = "auto",
                 grad_checkpoint: bool = False, scan_layers: bool = False) -> Compute:
    """Join the job, build the mesh, and make this backend's choices once: the compute dtype and
    the records (`flaxchat.kernels.choose`) every model, optimizer and step of the process is
    built with."""
    maybe_initialize_distributed()
    mesh = make_mesh(jax.devices(), sharding)
    compute_dtype = resolve_dtype(dtype)
    choice = choose(jax.default_backend(), attention, grad_checkpoint, scan_layers)
    auto = " (auto)" if dtype == "auto" or attention == "auto" else ""
    print0(f"compute: {jnp.dtype(compute_dtype).name} on {jax.default_backend()}{auto}; {choice.model.describe()}")
    cache = enable_compilation_cache()
    if cache:
        print0(f"compile cache: {cache}")
    return Compute(mesh=mesh, process_index=jax.process_index(), process_count=jax.process_count(),
                   backend=jax.default_backend(), compute_dtype=compute_dtype, kernels=choice.model,
                   polar=choice.polar, plan=choice.plan)


def compilation_cache_dir() -> str:
    """Where this machine's compiled steps are kept between runs: one folder per topology (backend,
    device kind, devices and processes), under $FLAXCHAT_CACHE_DIR or ~/.cache/flaxchat. The launcher
    sets FLAXCHAT_CACHE_DIR to the run folder's xla-cache/ when that is in a bucket, so a recreated
    VM loads the step that the one before it compiled."""
    dev = jax.devices()[0]
    topology = f"{jax.default_backend()}-{dev.device_kind}-{jax.device_count()}x{jax.process_count()}"
    root = os.environ.get("FLAXCHAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")
    return os.path.join(root, "jax", "".join(c if c.isalnum() or c in "-_." else "_" for c in topology))


def enable_compilation_cache() -> str | None:
    """Turn JAX's persistent compilation cache on (unless the user chose a folder, or none with
    FLAXCHAT_CACHE_DIR=off): a restarted or resumed run, or the next stage on the same machine,
    loads the train step instead of compiling it (d12 at sequence 2048 compiled for 74 s on a
    TPU v5e). Returns the folder, or None when it is the user's own or off."""
    if jax.config.jax_compilation_cache_dir or os.environ.get("FLAXCHAT_CACHE_DIR") == "off":
        return None
    path = compilation_cache_dir()
    try:
        if "://" not in path:  # gs://...: JAX writes it through etils.epath (gcsfs); a bucket has no folders
            os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without a cache
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


def print0(*args, **kwargs) -> None:
    """Print on process 0 only, flushed (logs are tailed by the launcher). Asking for the process
    index starts JAX's backend, after which a multi-process job can no longer be joined, so a print
    before compute_init (SFT's and RL's data line) joins it first: on a pod both crashed here."""
    maybe_initialize_distributed()
    if jax.process_index() == 0:
        print(*args, **kwargs, flush=True)


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def peak_rss_mb() -> float:
    import resource
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def global_batch(compute: Compute, local: np.ndarray, leading: int = 1) -> jax.Array:
    """This process's rows -> one global array, rows split over every device of the mesh."""
    return jax.make_array_from_process_local_data(compute.batch_sharding(leading), local)


def global_from_full(compute: Compute, full: np.ndarray, leading: int = 1) -> jax.Array:
    """The whole batch, identical on every process (RL's rollouts: same seed, same samples) -> one
    global array with rows split over the devices; each process places only its own devices' rows.
    (`global_batch` would take each process's array as that process's rows and count them twice.)"""
    return place_identical(full, compute.batch_sharding(leading))


# bf16 dense peak FLOP/s per chip, from the vendors' spec sheets (for MFU on accelerators).
PEAK_FLOPS_BY_KIND = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "A100": 312e12, "H100": 989e12, "H200": 989e12,
}

_cpu_peak_cache: dict[str, float] = {}
_matmul = jax.jit(lambda x, y: x @ y)
_matmul_compiled: set = set()


def matmul_flops(n: int = 2048, dtype=jnp.float32, reps: int = 5) -> float:
    """FLOP/s of the fastest of `reps` jitted n³ matmuls on the default device, measured now (the
    product compiles once per shape; `measured_matmul_peak` keeps the first reading)."""
    import time
    a = jnp.ones((n, n), dtype)
    if (n, a.dtype) not in _matmul_compiled:
        _matmul(a, a).block_until_ready()  # compile, untimed
        _matmul_compiled.add((n, a.dtype))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def measured_matmul_peak(n: int = 2048, dtype=jnp.float32, reps: int = 5) -> float:
    """FLOP/s of a jitted n³ matmul on the default device: the honest peak for MFU on a CPU."""
    key = f"{n}-{jnp.dtype(dtype).name}"
    if key not in _cpu_peak_cache:
        _cpu_peak_cache[key] = matmul_flops(n, dtype, reps)
    return _cpu_peak_cache[key]


def spec_peak_flops() -> float | None:
    """One device's bf16 peak FLOP/s from its spec sheet, or None where flaxchat knows none (a CPU)."""
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_FLOPS_BY_KIND.items():
        if name.lower() in kind.lower():
            return peak
    return None


def device_peak_flops(compute: "Compute", measure: bool = False) -> float:
    """Peak FLOP/s of one device: the spec sheet on TPU/GPU, a measured matmul on CPU (the first
    reading of this process, or a fresh one with `measure`; see flaxchat.rates.Peak)."""
    spec = spec_peak_flops()
    if spec is not None:
        return spec
    timed = matmul_flops(dtype=compute.compute_dtype) if measure else measured_matmul_peak(dtype=compute.compute_dtype)
    # Devices of a fake multi-device CPU share the same cores: the peak is the machine's, split.
    return timed / max(1, jax.local_device_count())


@contextlib.contextmanager
def native_stderr_to(sink: list):
    """Collect what native code writes to fd 2 into `sink` (one string): the TFLite converter's op
    counts and absl banners, libtpu's warnings off a TPU VM."""
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def mesh_scope():
    """A training stage sets its mesh with `jax.set_mesh` for its whole run; inside this scope that
    mesh is undone on leaving, so whatever runs next in the process (the next stage of run_chat, an
    export, a notebook cell) finds the mesh it had before."""
    before = jax.sharding.get_mesh()
    try:
        yield
    finally:
        jax.set_mesh(None if before.empty else before)


def local_streams(compute: "Compute") -> list[int]:
    """This process's data streams: the positions of its devices on the mesh, in mesh order. One
    stream per device keeps the global batch independent of how devices spread over processes."""
    return [i for i, d in enumerate(compute.mesh.devices.flat) if d.process_index == jax.process_index()]


def gather_streams(local: dict[int, Any], count: int) -> list:
    """Every stream's state (e.g. a data loader's), in stream order, from `{stream: state}` of each
    process: what a checkpoint stores so any process layout can resume."""
    merged: dict[str, Any] = {}
    for part in allgather_json({str(k): v for k, v in local.items()}):
        merged.update(part)
    return [merged[str(i)] for i in range(count)]


def allgather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (one collective, any sizes)."""
    import json
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
    buf = np.zeros(int(np.max(sizes)), np.uint8)
    buf[:data.size] = data
    allbufs = multihost_utils.process_allgather(buf)
    return [json.loads(bytes(allbufs[i][:int(sizes[i][0])]).decode()) for i in range(jax.process_count())]

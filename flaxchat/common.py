"""Compute setup shared by every script: distributed init, the device mesh, dtype, printing.

`compute_init()` is the one place that knows about processes and devices. On a pod (or several
processes on this machine) it joins the job through `jax.distributed.initialize` when the launcher
set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, then builds one mesh over
every device of every process. Batches are sharded over the mesh's 'data' axis.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxchat.errors import UserError

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Compute:
    mesh: Mesh
    process_index: int
    process_count: int
    backend: str
    compute_dtype: jnp.dtype

    @property
    def device_count(self) -> int:
        return self.mesh.size

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA_AXIS))

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
        # bf16 where the hardware has bf16 matrix units; fp32 on CPU, where bf16 is slower (field notes).
        return jnp.bfloat16 if jax.default_backend() in ("tpu", "gpu", "cuda", "rocm") else jnp.float32
    return jnp.dtype(name)


def compute_init(dtype: str = "auto") -> Compute:
    maybe_initialize_distributed()
    devices = np.array(jax.devices())
    mesh = Mesh(devices, (DATA_AXIS,))
    return Compute(mesh=mesh, process_index=jax.process_index(), process_count=jax.process_count(),
                   backend=jax.default_backend(), compute_dtype=resolve_dtype(dtype))


def print0(*args, **kwargs) -> None:
    """Print on process 0 only, flushed (logs are tailed by the launcher)."""
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


def global_batch(compute: Compute, local: np.ndarray) -> jax.Array:
    """This process's rows -> one global array sharded over the data axis of the mesh."""
    return jax.make_array_from_process_local_data(compute.batch_sharding(), local)

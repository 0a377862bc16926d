"""TPU slice shapes: how many chips and how many worker VMs each accelerator type has.

Numbers from Google's Cloud TPU documentation (system architecture pages for v4, v5e, v5p, v6e):
- v4 and v5p names count TensorCores, two per chip ("megacore": JAX sees one device per chip), so
  v4-8 is 4 chips. Every v4/v5p worker VM holds 4 chips.
- v5e (`v5litepod-N`) and v6e (`v6e-N`) names count chips, one TensorCore each. Slices of 1, 4 and 8
  chips are a single VM; larger slices use VMs of 4 chips, so v5litepod-64 and v6e-64 are 16 VMs.
  (An older flaxchat table said 8 workers for those two; Google's docs say 16, and so do we.)

The table is a planning aid (`--dry-run`, cost estimates, the emulator's worker count). At run time
the truth is `describe`'s `networkEndpoints`, one per worker VM; see `check_process_count`.
"""

from __future__ import annotations

import dataclasses

from flaxchat.errors import UserError
from flaxchat.runner.base import RemoteError

CHIPS_PER_MULTIHOST_VM = 4  # every generation here: a multi-VM slice is built from 4-chip hosts

# Default TPU VM software per generation (Google's "TPU software versions" page).
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


@dataclasses.dataclass(frozen=True)
class Topology:
    accelerator: str  # e.g. "v4-32"
    generation: str  # "v4" | "v5litepod" | "v5p" | "v6e"
    chips: int  # JAX devices in the slice (one per chip on every generation here)
    workers: int  # worker VMs = JAX processes

    @property
    def chips_per_worker(self) -> int:
        return self.chips // self.workers


def _build_table() -> dict[str, Topology]:
    table: dict[str, Topology] = {}

    def add(generation: str, suffix: int, chips: int) -> None:
        workers = 1 if chips <= 8 and generation in ("v5litepod", "v6e") else max(1, chips // CHIPS_PER_MULTIHOST_VM)
        name = f"{generation}-{suffix}"
        table[name] = Topology(name, generation, chips, workers)

    # v4: suffix = TensorCores = 2 x chips; v4-8 (4 chips) up to v4-4096 (2048 chips, 512 VMs).
    for cores in (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096):
        add("v4", cores, cores // 2)
    # v5p: same naming as v4; v5p-8 up to the full 8960-chip pod is allowed by Google, we list the
    # power-of-two shapes people actually request.
    for cores in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        add("v5p", cores, cores // 2)
    # v5e and v6e: suffix = chips.
    for chips in (1, 4, 8, 16, 32, 64, 128, 256):
        add("v5litepod", chips, chips)
        add("v6e", chips, chips)
    return table


TOPOLOGIES: dict[str, Topology] = _build_table()


def valid_accelerators() -> list[str]:
    """Every accelerator type in the table, grouped by generation and sorted by size."""
    order = list(RUNTIME_VERSIONS)
    return sorted(TOPOLOGIES, key=lambda n: (order.index(TOPOLOGIES[n].generation), TOPOLOGIES[n].chips))


def topology_for(accelerator: str) -> Topology:
    """The slice shape for an accelerator type such as "v4-8"; a UserError lists the valid ones."""
    topo = TOPOLOGIES.get(accelerator.strip().lower())
    if topo is None:
        raise UserError(f"unknown TPU accelerator type {accelerator!r}; {suggest(accelerator)}")
    return topo


def suggest(accelerator: str) -> str:
    """The families with their size ranges, and the nearest valid name ("did you mean v5litepod-8?")."""
    import difflib

    name = accelerator.strip().lower()
    ranges = []
    for gen in RUNTIME_VERSIONS:
        names = [t for t in valid_accelerators() if TOPOLOGIES[t].generation == gen]
        ranges.append(f"{names[0]} to {names[-1]}")
    near = []
    family, _, size = name.rpartition("-")
    if family in ("v5e", "v5lite", "v5litepod", "v5lp"):  # Google calls it v5e; the API, v5litepod
        near = [f"v5litepod-{size}"] if f"v5litepod-{size}" in TOPOLOGIES else []
    if not near and name[:1] == "v" and name[1:2].isdigit():  # a TPU name, misspelt (not "gpu-8")
        near = difflib.get_close_matches(name, list(TOPOLOGIES), n=1, cutoff=0.6)
    return (f"did you mean {near[0]}? " if near else "") + f"the families are {', '.join(ranges)}."


def num_workers_for(accelerator: str) -> int:
    """Worker VMs (= JAX processes) in a slice, e.g. num_workers_for("v4-32") == 4."""
    return topology_for(accelerator).workers


def default_runtime_version(accelerator: str) -> str:
    return RUNTIME_VERSIONS[topology_for(accelerator).generation]


def check_process_count(expected_workers: int, joined: int, accelerator: str = "") -> None:
    """Fail clearly when the JAX processes that joined differ from the worker VMs of the slice.

    A mismatch means some hosts never ran the program (or ran it without the coordinator env), and
    training on the rest would silently use a fraction of the slice.
    """
    if joined != expected_workers:
        what = f" {accelerator}" if accelerator else ""
        raise RemoteError(
            f"the{what} slice has {expected_workers} worker VMs but {joined} JAX process(es) joined; "
            "check that every worker started the command (see --health)."
        )

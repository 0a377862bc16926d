"""The TPU slice table: chips and worker VMs per accelerator type, as Google's docs give them."""

import pytest

from flaxchat.cloud.topology import (TOPOLOGIES, check_process_count, default_runtime_version, num_workers_for,
                                     topology_for, valid_accelerators)
from flaxchat.errors import UserError
from flaxchat.remote.base import RemoteError


@pytest.mark.parametrize("accel, chips, workers", [
    ("v4-8", 4, 1), ("v4-16", 8, 2), ("v4-32", 16, 4), ("v4-128", 64, 16), ("v4-4096", 2048, 512),
    ("v5p-8", 4, 1), ("v5p-32", 16, 4), ("v5p-1024", 512, 128),
    ("v5litepod-1", 1, 1), ("v5litepod-4", 4, 1), ("v5litepod-8", 8, 1), ("v5litepod-16", 16, 4),
    ("v5litepod-64", 64, 16), ("v5litepod-256", 256, 64),
    ("v6e-8", 8, 1), ("v6e-16", 16, 4), ("v6e-64", 64, 16), ("v6e-256", 256, 64),
])
def test_chips_and_workers_follow_googles_docs(accel, chips, workers):
    topo = topology_for(accel)
    assert (topo.chips, topo.workers) == (chips, workers)
    assert num_workers_for(accel) == workers


def test_v5litepod_64_and_v6e_64_have_16_workers_not_8():
    # The public flaxchat table said 8; Google's docs say 16 VMs of 4 chips (docs/deployment.md).
    assert num_workers_for("v5litepod-64") == 16
    assert num_workers_for("v6e-64") == 16
    assert topology_for("v6e-64").chips_per_worker == 4


def test_every_multihost_worker_has_four_chips():
    for topo in TOPOLOGIES.values():
        assert topo.chips == topo.workers * topo.chips_per_worker
        if topo.workers > 1:
            assert topo.chips_per_worker == 4, topo


def test_names_are_case_and_space_tolerant():
    assert num_workers_for(" V4-32 ") == 4


def test_unknown_accelerator_lists_the_valid_ones():
    with pytest.raises(UserError) as e:
        num_workers_for("v4-7")
    msg = str(e.value)
    assert "'v4-7'" in msg and "v4-8" in msg and "v6e-256" in msg and "v5litepod-64" in msg
    assert msg.count("\n") == 0


def test_valid_accelerators_grouped_and_sorted():
    names = valid_accelerators()
    assert names[0] == "v4-8" and names[-1] == "v6e-256"
    assert names.index("v4-16") < names.index("v4-32") < names.index("v5litepod-1")


def test_runtime_versions_per_generation():
    assert default_runtime_version("v4-8") == "tpu-ubuntu2204-base"
    assert default_runtime_version("v5litepod-16") == "v2-alpha-tpuv5-lite"
    assert default_runtime_version("v5p-8") == "v2-alpha-tpuv5"
    assert default_runtime_version("v6e-64") == "v2-alpha-tpuv6e"


def test_process_count_mismatch_is_one_clear_error():
    check_process_count(4, 4)
    with pytest.raises(RemoteError, match=r"v4-32 slice has 4 worker VMs but 3 JAX process\(es\) joined"):
        check_process_count(4, 3, "v4-32")

"""The TPU slice table: chips and worker VMs per accelerator type, as Google's docs give them."""

import pytest

from flaxchat.cloud.topology import (TOPOLOGIES, check_process_count, default_runtime_version, num_workers_for,
                                     topology_for, valid_accelerators)
from flaxchat.errors import UserError
from flaxchat.runner.base import RemoteError


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


@pytest.mark.parametrize("typo, near", [("v5lite-8", "v5litepod-8"), ("v5e-8", "v5litepod-8"), ("v4-7", "v4-8"),
                                        ("v6-64", "v6e-64"), ("v5p8", "v5p-8")])
def test_unknown_accelerator_names_the_families_and_a_near_match(typo, near):
    with pytest.raises(UserError) as e:
        num_workers_for(typo)
    msg = str(e.value)
    assert f"unknown TPU accelerator type '{typo}'; did you mean {near}? the families are v4-8 to v4-4096, " \
           "v5litepod-1 to v5litepod-256, v5p-8 to v5p-8192, v6e-1 to v6e-256." == msg
    assert len(msg) < 200  # the seed's answer listed all 38 types in a 600-character line


def test_no_near_match_still_names_the_families():
    with pytest.raises(UserError, match=r"^unknown TPU accelerator type 'gpu-8'; the families are v4-8 to v4-4096"):
        num_workers_for("gpu-8")


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

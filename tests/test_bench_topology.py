"""bench.scale --topology: the train step compiled by libtpu for a named TPU slice, on this CPU machine.

The compile itself needs libtpu, which CI does not have: that test skips there with the reason. The
rest runs anywhere: the slice shapes handed to libtpu, and the one sentence a machine without
libtpu gets.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the benchmarks: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU = importlib.util.find_spec("libtpu")


def _env(extra_path=""):
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + extra_path if extra_path else ""), PYTHONUNBUFFERED="1",
               FLAXCHAT_NO_CPU_TUNING="1")
    env.pop("XLA_FLAGS", None)
    # conftest asks for 'highest' matmul precision where libtpu is importable (the suite's fp32
    # comparisons on a chip); training compiles at the default, and Mosaic cannot lower splash's bf16
    # dots at fp32 contract precision.
    env.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
    return env


def test_slices_as_libtpu_names_them():
    """Cloud TPU names to libtpu's topology: v5e/v6e count chips on a 2D grid, v4/v5p count two
    TensorCores per chip (megacore) on a 3D one; full v4 cubes and 16-chip sides wrap around."""
    from bench.topology import slice_for
    s = slice_for("v5e-8")
    assert (s.accelerator, s.chips, s.topology_name, s.chip_config_name, s.chips_per_host_bounds) == (
        "v5litepod-8", 8, "v5e:2x4", "default", (2, 4, 1))
    assert slice_for("v5litepod-1").topology_name == "v5e:1x1" and slice_for("v5e-1").chips_per_host_bounds == (1, 1, 1)
    s = slice_for("v4-32")
    assert (s.chips, s.topology_name, s.chip_config_name, s.wrap) == (16, "v4:2x2x4", "megacore", (False,) * 3)
    assert slice_for("v4-128").topology_name == "v4:4x4x4" and slice_for("v4-128").wrap == (True,) * 3
    assert slice_for("v6e-64").topology_name == "v6e:8x8" and slice_for("v6e-64").hbm_bytes == 32 * 2**30
    assert slice_for("v5e-256").wrap == (True, True, False) and slice_for("v5p-8").topology_name == "v5:2x2x1"


# Lines of real compiled modules: libtpu's for 2 x v5e-8 (a Megascale host transfer: what crosses the
# data-centre network; the all-reduce before it stays within the slice), XLA:CPU's for 2 slices of 2.
_TPU_HLO = """
  %all-reduce.32 = f32[1,1,128]{2,1,0:T(1,128)} all-reduce(%bitcast.950), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_56.58
  %send.2 = (f32[2,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%bitcast.4, %after-all.2), channel_id=8, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.15_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %send.1 = (s32[1,1,128]{2,1,0:T(1,128)}, u32[], token[]) send(%all-reduce.33, %after-all.1), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
"""
_CPU_HLO = """
  %all-reduce.1 = f32[64,128]{1,0} all-reduce(%p), channel_id=1, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add
  %all-gather.2 = bf16[8,128]{1,0} all-gather(%q), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}
  %all-reduce.3 = f32[4]{0} all-reduce(%r), channel_id=3, replica_groups=[2,2]<=[2,2]T(1,0), use_global_device_ids=true, to_apply=%add
"""


def test_what_crosses_slices_is_read_from_the_compiled_module():
    """TPU: the Megascale sends, by transfer type, with their data's bytes; CPU: the collectives whose
    groups span slices ({0,1},{2,3} stay within; [2,2]<=[2,2]T(1,0) is {0,2},{1,3}: across)."""
    from bench.scale import cross_slice_collectives
    assert cross_slice_collectives(_TPU_HLO, 16, 2) == {"all-reduce": [2, 2 * 8 * 128 * 4 + 128 * 4]}
    assert cross_slice_collectives(_CPU_HLO, 4, 2) == {"all-reduce": [2, 64 * 128 * 4 + 4 * 4]}
    assert cross_slice_collectives(_CPU_HLO, 4, 1) == {}


def test_without_libtpu_one_sentence_with_the_install_command():
    """A machine without libtpu (here hidden from the interpreter, as an uninstalled package is) gets
    one line naming the pinned libtpu and how to install it beside the environment, and exit 2."""
    from bench.topology import LIBTPU_REQUIREMENT, libtpu_help
    code = ("import sys; sys.modules['libtpu'] = None\n"  # `import libtpu` fails, find_spec says None
            "from flaxchat.errors import cli_main; from bench.scale import main\n"
            "sys.exit(cli_main(main, ['--topology', 'v5e-8', '--depths', '2']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == f"error: {libtpu_help('python -m bench.scale --topology v5e-8 --depths 2')}"
    assert "\n" not in r.stderr.strip() and "Traceback" not in r.stderr
    assert f"pip install --no-deps --target ~/libtpu '{LIBTPU_REQUIREMENT}'" in r.stderr
    # and a name that is no TPU slice is said before libtpu is looked for
    r = subprocess.run([sys.executable, "-m", "bench.scale", "--topology", "v5e-3"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown TPU accelerator type 'v5e-3'"), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(LIBTPU is None, reason="libtpu is not importable here (CI has none): `pip install --no-deps "
                    "--target DIR 'libtpu==0.0.42.*'` and put DIR on PYTHONPATH to run the TPU compile")
def test_compiles_for_a_v5e_chip_with_splash_and_says_what_does_not_fit():
    """A d1 model compiled by libtpu for one v5e chip: splash attention lowered for the chip (Mosaic),
    the TPU compiler's memory figures, and at 65,536 rows of 256 tokens the compiler's out-of-memory,
    as a row (with the fused head+loss no logits are kept: 1,024 rows now fit, where the plain loss
    ran out of memory). 1-3 min on 2 busy cores."""
    where = os.path.dirname(os.path.dirname(LIBTPU.origin))
    r = subprocess.run([sys.executable, "-m", "bench.scale", "--topology", "v5e-1", "--depths", "1", "--seq", "256",
                        "--vocab", "32768", "--device-batch", "1,65536", "--layouts", "dp"],
                       cwd=ROOT, env=_env(where), capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled by libtpu" in r.stdout and "for v5litepod-1 (1 x TPU v5 lite" in r.stdout, r.stdout
    assert "attention splash" in r.stdout and "compute bfloat16" in r.stdout
    rows = [l.split() for l in r.stdout.splitlines() if re.match(r"\s+d1 dp", l)]
    assert [row[-2] for row in rows] == ["1", "65536"], r.stdout
    fits, oom = rows
    assert fits[-1] == "y" and float(fits[8].replace(",", "")) > 0  # peak/dev, MiB
    assert oom[-1] == "-" and oom[-3] == "(OOM)" and float(oom[6].replace(",", "")) > 15 * 1024, r.stdout
    assert "usable HBM" in r.stdout and "d1 dp: up to 1 rows per device fit one v5e chip" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(LIBTPU is None, reason="libtpu is not importable here (CI has none): `pip install --no-deps "
                    "--target DIR 'libtpu==0.0.42.*'` and put DIR on PYTHONPATH to run the TPU compile")
def test_two_v5e_slices_compile_with_the_gradient_reduce_over_the_data_centre_network():
    """d1 for two v5e-4 slices (libtpu's multislice topology): 8 chips, the layout within a slice, and
    the gradient all-reduce as Megascale transfers between them. ~1 min on 2 busy cores. The mesh
    takes the slice count from the TPU devices' slice_index when it is not given."""
    where = os.path.dirname(os.path.dirname(LIBTPU.origin))
    code = ("from bench.topology import compile_devices, slice_for; from flaxchat.sharding import make_mesh\n"
            "devices = compile_devices(slice_for('v5e-4'), 'x', slices=2)\n"
            "print(dict(make_mesh(devices[::-1], 'fsdp').shape), sorted({d.slice_index for d in devices}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(where), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "{'slice': 2, 'data': 1, 'fsdp': 4, 'tensor': 1} [0, 1]", r.stdout
    r = subprocess.run([sys.executable, "-m", "bench.scale", "--topology", "v5e-4", "--slices", "2", "--depths", "1",
                        "--seq", "256", "--device-batch", "1", "--layouts", "dp"],
                       cwd=ROOT, env=_env(where), capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "for 2 x v5litepod-4 (8 x TPU v5 lite" in r.stdout and "2 slices over the data-centre network" in r.stdout
    across = [l for l in r.stdout.splitlines() if l.strip().startswith("across the 2 slices:")]
    assert len(across) == 1 and re.search(r"all-reduce x\d+ \([\d.,]+ MiB\)", across[0]), r.stdout

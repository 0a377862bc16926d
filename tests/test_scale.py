"""bench.scale: a short run prints dp and fsdp side by side, fsdp's parameter bytes ~1/N of dp's."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow  # runs bench.scale: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scale(*args, timeout=110):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", FLAXCHAT_NO_CPU_TUNING="1")
    env.pop("XLA_FLAGS", None)  # the script sets the fake device count itself
    return subprocess.run([sys.executable, "-m", "bench.scale", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rows(stdout):
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+d(\d+) (dp|fsdp)\s+([\d.]+)M\s+([\d.,]+)\s+([\d.,]+)\s+~?([\d.,]+)\s+~?([\d.,]+)\s+~?([\d.,]+)"
                     r"\s+~?([\d.,]+)\s+([\d.]+)s(\*?)\s+(\S+)", line)
        if m:
            num = [float(x.replace(",", "")) for x in m.groups()[2:10]]
            rows[(int(m[1]), m[2])] = dict(zip(("params", "param", "opt", "args", "temp", "out", "peak", "compile"), num),
                                           cheap=m[11] == "*", step=m[12])
    return rows


@pytest.mark.timeout(120)
def test_short_run_prints_both_layouts():
    """~40 s cold on 2 busy cores: depth 2 on 2 fake devices, compiled and one step run under each layout
    (`--run-steps 2` compiles once; `auto` would compile cheaply first to decide)."""
    r = _scale("--depths", "2", "--devices", "2", "--seq", "64", "--batch", "2", "--run-steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(r.stdout)
    assert set(rows) == {(2, "dp"), (2, "fsdp")}, r.stdout
    dp, fsdp = rows[(2, "dp")], rows[(2, "fsdp")]
    assert dp["params"] == fsdp["params"] > 1
    # fsdp splits parameters and optimizer state over the 2 devices (the scalars stay whole).
    assert fsdp["param"] == pytest.approx(dp["param"] / 2, rel=0.02)
    assert fsdp["opt"] == pytest.approx(dp["opt"] / 2, rel=0.05)
    # XLA's arguments are the state plus the batch: the same halving; the step fits and ran.
    assert fsdp["args"] < 0.6 * dp["args"] and fsdp["peak"] < dp["peak"]
    for row in (dp, fsdp):
        assert not row["cheap"] and re.fullmatch(r"[\d.]+s", row["step"]), r.stdout
    assert "d2: fsdp holds 0.500 of dp's parameter bytes per device (1/2 = 0.500)" in r.stdout


def test_help_and_bad_flags():
    r = _scale("--help", timeout=60)
    assert r.returncode == 0 and "--compile-only" in r.stdout and "--run-steps" in r.stdout
    r = _scale("--devices", "2", "--batch", "3", timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --batch 3 does not split over 2 devices; use a multiple of 2 (every device takes the same "
        "number of rows).")
    r = _scale("--depths", "twelve", timeout=60)
    assert r.returncode == 2 and "--depths takes comma-separated whole numbers" in r.stderr
    assert "Traceback" not in r.stderr
    r = _scale("--batch", "4", "--device-batch", "2", timeout=60)
    assert r.returncode == 2 and "not both" in r.stderr


@pytest.mark.timeout(120)
def test_device_batches_and_what_fits():
    """One row per --device-batch value, each with its rows per device and a fits column per chip."""
    r = _scale("--depths", "2", "--devices", "2", "--seq", "64", "--device-batch", "1,2", "--layouts", "fsdp",
               "--compile-only")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if re.match(r"\s+d2 fsdp", l)]
    assert [l.split()[-6] for l in lines] == ["1", "2"], r.stdout
    assert all(l.split()[-5:] == ["y"] * 5 for l in lines), r.stdout  # ~25 MiB fits every chip
    assert "rows v5e  v4 v6e v5p 80G" in r.stdout
    assert "d2 fsdp: up to 2 rows per device fit a 32 GiB chip (v4, v6e)" in r.stdout


@pytest.mark.timeout(240)
def test_device_check_quick_prints_one_table():
    """bench.device_check --quick on this CPU: the peak line, and for each kernel that runs here the
    gradient, the step and the accumulated step with tok/s, MFU against the matmul measured here
    (no spec sheet for a CPU), compile time and XLA's memory of the program; the JSON holds them."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", FLAXCHAT_NO_CPU_TUNING="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        r = subprocess.run([sys.executable, "-m", "bench.device_check", "--quick", "--json", out], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=230)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = json.load(open(out))["rows"]
    assert "matmul measures" in r.stdout
    printed = re.findall(r"\s+d2\s+(\w+)\s+none\s+(fwd\+bwd|step|step x4)\s+([\d,]+)\s+-\s+([\d.]+)%\s+[\d.]+ms\s+"
                         r"[\d.]+s\s+[\d.]+G", r.stdout)
    assert {(k, what) for k, what, *_ in printed} == {(k, w) for k in ("blockwise", "xla")
                                                      for w in ("fwd+bwd", "step", "step x4")}, r.stdout
    assert all(float(mfu) > 0 for *_, mfu in printed)
    # the accumulated step counts 4 micro-batches' tokens; every row has the one FLOP count
    assert {r["tokens"] for r in rows if r["kind"] == "step x4"} == {4 * 2 * 128}
    assert len({r["flops_per_token"] for r in rows}) == 1


@pytest.mark.timeout(240)
def test_save_stall_times_the_steps_around_a_real_save():
    """bench.save_stall at depth 1: it trains, saves through the Checkpointer mid-run and prints the
    save's call, the steps after it against the median, and how long writing went on after."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "bench.save_stall", "--depth", "1", "--seq", "64", "--rows", "2",
                            "--vocab", "256", "--steps", "6", "--save-at", "3", "--dir", tmp], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=230)
        assert r.returncode == 0, r.stderr[-3000:]
        assert os.path.isdir(os.path.join(tmp, "3"))  # the save really landed, at the step asked for
    assert re.search(r"median step [\d.]+ ms; the save's call \d+ ms; the steps from the save on: "
                     r"([\d.]+ ms \([\d.]+x\)(, )?){3}; writing went on \d+ ms", r.stdout), r.stdout


@pytest.mark.timeout(120)
def test_two_slices_on_fake_devices_reduce_gradients_between_them():
    """--slices 2 on 4 fake devices: two slices of 2, dp within; the collectives whose device groups
    span both slices are printed under the row (the gradient all-reduce), and a slice count that
    does not divide the devices is one sentence."""
    r = _scale("--depths", "2", "--devices", "4", "--slices", "2", "--seq", "64", "--batch", "4", "--layouts", "dp",
               "--compile-only")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 fake CPU devices in 2 slices" in r.stdout, r.stdout
    across = [l for l in r.stdout.splitlines() if l.strip().startswith("across the 2 slices:")]
    assert len(across) == 1 and re.search(r"all-reduce x\d+ \([\d.,]+ MiB\)", across[0]), r.stdout
    r = _scale("--devices", "8", "--slices", "3", timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --slices must be at least 1 and divide the 8 devices (got 3)."

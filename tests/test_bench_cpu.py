"""bench/cpu: the CPU micro-benchmarks behind flaxchat.kernels.cpu, one smoke test for the lot.

Each command-line bench answers --help (it imports against today's flaxchat and says what it
measures), the two library modules import, and the one the others lean on to check a speed change,
`same_losses`, runs for real: two runs of the same steps agree bit for bit, and a changed loss is
caught with exit status 1."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the benchmarks: CI runs it; `-m "not slow"` skips it


REPO = pathlib.Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (REPO / "bench" / "cpu").glob("*.py") if p.stem != "__init__")
LIBRARIES = {"cycles", "profiling"}  # called by bench.train_throughput --cycles / --profile


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", FLAXCHAT_NO_CPU_TUNING="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_cpu_bench_answers_help_and_the_libraries_import():
    assert set(BENCHES) >= {"before_after", "same_losses", "ns_accuracy", "norms", "products"} | LIBRARIES
    script = "\n".join([f"import bench.cpu.{name}" for name in sorted(LIBRARIES)] + [
        "import contextlib, io, runpy, sys",
        "for name in sys.argv[1:]:",
        "    sys.argv, out = [name, '--help'], io.StringIO()",
        "    with contextlib.redirect_stdout(out):",
        "        try:",
        "            runpy.run_module('bench.cpu.' + name, run_name='__main__')",
        "        except SystemExit as e:",
        "            assert e.code in (0, None), (name, e.code)",
        "    assert 'usage:' in out.getvalue(), (name, out.getvalue()[:300])",
        "    print('ok', name)"])
    r = _run("-c", script, *[n for n in BENCHES if n not in LIBRARIES])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [w for n in BENCHES if n not in LIBRARIES for w in ("ok", n)]


def test_same_losses_agree_bit_for_bit_and_catch_a_changed_one(tmp_path):
    first = tmp_path / "first.json"
    r = _run("-m", "bench.cpu.same_losses", "--steps", "2", "--rows", "1", "--out", str(first))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = json.loads(first.read_text())
    assert len(losses) == 2 and all(0 < v < 20 for v in losses)
    r = _run("-m", "bench.cpu.same_losses", "--steps", "2", "--rows", "1", "--compare", str(first), "--rtol", "0")
    assert r.returncode == 0 and "largest relative difference 0.0e+00: same" in r.stdout, r.stdout + r.stderr[-2000:]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps([losses[0], losses[1] * 1.01]))
    r = _run("-m", "bench.cpu.same_losses", "--steps", "2", "--rows", "1", "--compare", str(changed))
    assert r.returncode == 1 and "DIFFERENT" in r.stdout, r.stdout + r.stderr[-2000:]

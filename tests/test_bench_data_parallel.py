"""bench.data_parallel: two processes over 127.0.0.1 against one, at the smoke size."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, timeout=400):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    return subprocess.run([sys.executable, "-m", "bench.data_parallel", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_processes_reduce_once_per_step():
    r = _bench("--config=S", "--accum=2", "--steps=1", "--rounds=1", "--timeout=300")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"^cpu: \S", out, re.M), out
    reduce = re.search(r"all-reduce of ([\d.]+) MB: (\d+) arrays ([\d.]+) ms, one flat buffer ([\d.]+) ms", out)
    assert reduce and float(reduce.group(1)) > 0 and int(reduce.group(2)) > 1, out
    steps = dict(re.findall(r"step, (1 process|2 processes)\s+[\d.]+ ms\s+[\d,]+ tok/s\s+\((\d+) all-reduce", out))
    assert steps == {"1 process": "0", "2 processes": "1"}, out  # one all-reduce per step, after the scan


def test_bad_process_count_is_one_sentence():
    r = _bench("--procs=3", "--rows=4", timeout=60)
    assert r.returncode == 2 and "--procs must be at least 2 and divide --rows (4)" in r.stderr, r.stderr

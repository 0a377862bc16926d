"""Multi-host training, for real on this machine: N JAX processes (fake CPU devices, gloo collectives on
127.0.0.1) run scripts.pretrain as one job, exactly as the launcher starts it on the workers of a pod.

They must print identical losses, and end with the same parameters (rtol 1e-6: a different device
layout changes summation order by ~1 ulp) as one process over the same number of devices.
Slow-marked: each run compiles the train step (15-30 s here), so the three processes take ~1 min.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--depth=1", "--steps=6", "--sequence-len=32", "--vocab-size=300", "--device-batch-size=2",
        "--eval-every=0", "--sample-every=0", "--save-every=3", "--log-every=1", "--max-chars-tokenizer=20000",
        "--num-samples=1", "--seed=3"]
# print0 prints on process 0 only; this driver makes every process print, to compare them.
DRIVER = ("import sys, flaxchat.common as common; "
          "common.print0 = lambda *a, **k: print(*a, **{**k, 'flush': True}); "
          "from scripts import pretrain; sys.exit(pretrain.main(sys.argv[1:]))")
STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+)", re.M)
# Compare the final parameters of two runs (in a fresh process with as many CPU devices as they used).
COMPARE = r'''
import sys, jax, numpy as np, orbax.checkpoint as ocp
def load(run):
    mgr = ocp.CheckpointManager(run + "/checkpoints")
    step = mgr.latest_step()
    meta = ocp.StandardCheckpointer().metadata(f"{run}/checkpoints/{step}/model")
    tree = getattr(meta, "item_metadata", meta)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return step, ocp.PyTreeCheckpointer().restore(f"{run}/checkpoints/{step}/model", restore_args=args)
(sa, a), (sb, b) = load(sys.argv[1]), load(sys.argv[2])
assert sa == sb, (sa, sb)
la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
assert [p for p, _ in la] == [p for p, _ in lb]
for (path, x), (_, y) in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7, err_msg=str(path))
print(f"OK {len(la)} arrays at step {sa}")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **extra}


def train(run_dir, devices: int, extra_env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, f"--run-dir={run_dir}", *TINY], cwd=REPO,
                            env=cpu_env(devices, **(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"training did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def compare_params(run_a, run_b, devices: int) -> str:
    out = subprocess.run([sys.executable, "-c", COMPARE, str(run_a), str(run_b)], cwd=REPO, env=cpu_env(devices),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_processes_train_as_one_job_like_one_process(tmp_path):
    devices_per_process = 2  # sharding inside each process and across the two
    port = free_port()
    multi = tmp_path / "multi"  # shared by both processes, as a gs:// bucket is on a pod
    procs = [train(multi, devices_per_process, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                                "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
             for i in range(2)]
    outs = [finish(p, 300) for p in procs]
    losses = [STEP.findall(o) for o in outs]
    assert len(losses[0]) == 6 and losses[0] == losses[1], outs[0][-2000:]  # identical on every process
    assert f"{2 * devices_per_process} device(s) in 2 process(es)" in outs[0]
    assert (multi / "COMPLETE").exists()  # written once, by process 0

    single = tmp_path / "single"
    out = finish(train(single, 2 * devices_per_process), 300)
    ref = STEP.findall(out)
    assert [s for s, _ in ref] == [s for s, _ in losses[0]]
    for (_, a), (_, b) in zip(ref, losses[0]):
        assert float(a) == pytest.approx(float(b), rel=1e-6, abs=1e-4)  # printed with 4 decimals
    assert "OK" in compare_params(multi, single, 2 * devices_per_process)

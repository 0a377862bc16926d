"""Multi-host training, for real on this machine: N JAX processes (fake CPU devices, gloo collectives on
127.0.0.1) run scripts.pretrain as one job, exactly as the launcher starts it on the workers of a pod.

Every process prints the same losses (bitwise), equal (rtol 1e-6: another device layout changes the
summation order by ~1 ulp) to one process over the same number of devices. Parameters are compared
only within one layout (the pod rehearsal in test_launcher.py): across layouts, Adam turns an ulp of
difference in a near-zero gradient into a visible difference in that parameter.
Slow-marked: each run compiles the train step (~30 s here, cached on disk for the next run).
"""

import os
import re
import subprocess
import sys

import pytest
from support import coordinator_env, cpu_env, finish, free_port, start

pytestmark = pytest.mark.slow  # end to end: several JAX processes: CI runs it; `-m "not slow"` skips it

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 60  # enough for the pod rehearsal to be preempted mid-training, after its first checkpoint
TINY = ["--depth=1", f"--steps={STEPS}", "--sequence-len=32", "--vocab-size=300", "--device-batch-size=2",
        "--total-batch-size=128",  # 2 x 32 tokens per device on 2 devices: one micro-batch (the automatic size, 32K, is 256)
        "--eval-every=0", "--sample-every=0", "--save-every=10", "--log-every=10", "--max-chars-tokenizer=20000",
        "--num-samples=1", "--seed=3"]
# The driver runs scripts.pretrain unchanged, but every process also prints each step's loss at full
# precision (pretrain's own lines come from process 0 only, with 4 decimals).
DRIVER = """
import sys, jax, flaxchat.train as train

step = train.StepLoop.__call__
def logged_step(self, *args):
    loss = step(self, *args)
    print(f"exact loss p{jax.process_index()}: {float(loss)!r}", flush=True)
    return loss
train.StepLoop.__call__ = logged_step
from scripts import pretrain
sys.exit(pretrain.main(sys.argv[1:]))
"""
EXACT = re.compile(r"^exact loss p(\d+): (\S+)$", re.M)
# Compare the final parameters of two runs (in a fresh process with as many CPU devices as they used).
COMPARE = r'''
import sys, jax, numpy as np, orbax.checkpoint as ocp
def load(run):
    step = ocp.CheckpointManager(run + "/checkpoints").latest_step()
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
def compare_params(run_a, run_b, devices: int) -> str:
    out = subprocess.run([sys.executable, "-c", COMPARE, str(run_a), str(run_b)], cwd=REPO, env=cpu_env(devices),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_processes_train_as_one_job_like_one_process(tmp_path):
    port = free_port()
    multi = tmp_path / "multi"  # shared by both processes, as a gs:// bucket is on a pod
    procs = [start(["-c", DRIVER, f"--run-dir={multi}", *TINY], 1, coordinator_env(port, 2, i)) for i in range(2)]
    outs = [finish(p, 360) for p in procs]
    assert "2 device(s) in 2 process(es)" in outs[0]
    losses = [[float(v) for p, v in EXACT.findall(o) if p == str(i)] for i, o in enumerate(outs)]
    assert len(losses[0]) == STEPS and losses[0] == losses[1], outs[0][-2000:]  # bitwise identical on both
    assert (multi / "COMPLETE").exists()  # written once, by process 0

    single = tmp_path / "single"
    out = finish(start(["-c", DRIVER, f"--run-dir={single}", *TINY], 2), 360)
    assert "2 device(s) in 1 process(es)" in out
    reference = [float(v) for _, v in EXACT.findall(out)]
    assert reference == pytest.approx(losses[0], rel=1e-6)


# Two processes that hold the same whole batch (RL: every process samples the same rollouts from the
# same seed) must make one global batch of it, not one with every row twice.
ROWS = r'''
import jax, numpy as np
from flaxchat.common import compute_init, global_batch, global_from_full
from jax.experimental import multihost_utils
compute = compute_init("float32").with_sharding("dp")  # joins the job from JAX_COORDINATOR_ADDRESS etc.
assert jax.process_count() == 2
full = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)  # (prompts, samples, T), the same everywhere
x = global_from_full(compute, full)
back = multihost_utils.process_allgather(x, tiled=True)
assert x.shape == full.shape and np.array_equal(back, full), (x.shape, back)
assert global_batch(compute, full).shape == (2, 8, 3)  # what RL used: each process's copy counted as its own rows
print("OK", jax.process_index(), flush=True)
'''


@pytest.mark.timeout(120)
def test_a_batch_every_process_holds_whole_becomes_one_global_batch():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", ROWS], env=cpu_env(2, **coordinator_env(port, 2, i)), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"OK {i}" in out for i, out in enumerate(outs)), outs


# SFT and RL print their data line (print0) before compute_init joins the job; asking for the process
# index starts JAX's backend, and jax.distributed.initialize then refuses ("must be called before any
# JAX calls"): both stages crashed on every worker of a pod (seen following docs/deployment.md).
PRINT_FIRST = r'''
import jax
from flaxchat.common import compute_init, print0
print0("data: a line before the job is joined")
compute = compute_init("float32")
assert jax.process_count() == 2, jax.process_count()
print("OK", jax.process_index(), flush=True)
'''


@pytest.mark.timeout(120)
def test_a_print_before_compute_init_still_joins_the_job():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PRINT_FIRST], env=cpu_env(1, **coordinator_env(port, 2, i)),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "data: a line before the job is joined" in outs[0] and "data:" not in outs[1], outs  # process 0 prints
    assert all(f"OK {i}" in out for i, out in enumerate(outs)), outs

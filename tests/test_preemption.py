"""Preemption as the clouds do it: SIGTERM (a spot TPU VM's notice, the end of a Kaggle session, the
launcher's stop) finishes the step in flight, saves it and exits 75 (errors.ExitCode.PREEMPTED),
well inside the ~30 s before the kill; Ctrl-C does the same with exit 130. Real processes, real
signals, real Orbax saves.

Before, SIGTERM killed the process at once: everything since the last --save-every was lost (the
main job saves every 250 steps). Now the work lost is the step in flight at most, and the same
command resumes bit for bit where an uninterrupted run would be.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from support import coordinator_env, cpu_env, free_port
from test_multihost import compare_params
from test_sft_rl import base, tokenizer  # noqa: F401 (fixtures)
from test_train import TINY, _env, _final_params, _pretrain

pytestmark = pytest.mark.slow  # end to end: signals to training processes: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12
STEP_LINE = re.compile(r"^step (\d+)/\d+ \|")
STOPPED = re.compile(r"^stopped at step (\d+);", re.M)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer_dir):
    """An uninterrupted run of the same steps: the weights every preempted-then-resumed run must equal."""
    ref = tmp_path_factory.mktemp("reference") / "run"
    r = _pretrain([*TINY, f"--tokenizer-dir={tokenizer_dir}", f"--steps={STEPS}", "--save-every=0", f"--run-dir={ref}"])
    assert r.returncode == 0, r.stderr[-2000:]
    return ref


# scripts.pretrain unchanged, but the first train step says when it starts compiling (inside the loop).
DRIVER = """
import sys, flaxchat.train as train
step = train.StepLoop.__call__
def announced_step(self, *args):
    if not getattr(self, "announced", False):
        self.announced = True
        print("compiling the train step", flush=True)
    return step(self, *args)
train.StepLoop.__call__ = announced_step
from flaxchat.errors import cli_main
from scripts import pretrain
sys.exit(cli_main(pretrain.main, sys.argv[1:]))
"""
# When the notice comes (the line after which it is sent), how often the run saves on its own, the
# signal and the exit code it must give.
MOMENTS = {
    "during-compile": (lambda line: line.startswith("compiling the train step"), "--save-every=0", signal.SIGTERM, 75),
    "mid-step": (lambda line: line.startswith(f"step 00005/{STEPS:05d}"), "--save-every=0", signal.SIGTERM, 75),
    "mid-save": (lambda line: line.startswith("step 00008 | saving checkpoint"), "--save-every=4", signal.SIGTERM, 75),
    # Ctrl-C used to end the run with nothing saved since the last --save-every (the main job's
    # default is 250 steps); now it stops as a notice does, with exit code 130.
    "ctrl-c-mid-step": (lambda line: line.startswith(f"step 00005/{STEPS:05d}"), "--save-every=0", signal.SIGINT, 130),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigterm_or_ctrl_c_saves_the_step_in_flight_and_the_run_resumes_bit_for_bit(moment, tmp_path,
                                                                                    tokenizer_dir, reference):
    when, save_every, signum, exit_code = MOMENTS[moment]
    common = [*TINY, f"--tokenizer-dir={tokenizer_dir}", f"--steps={STEPS}", save_every]
    run = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *common, f"--run-dir={run}"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, trained, t_signal = [], 0, None
    for line in proc.stdout:
        seen.append(line)
        if m := STEP_LINE.match(line):
            trained = int(m.group(1))
        if when(line):
            t_signal = time.time()
            proc.send_signal(signum)
            break
    seen += proc.stdout.readlines()
    code = proc.wait(timeout=60)
    to_exit = time.time() - t_signal
    out = "".join(seen)
    assert t_signal is not None and code == exit_code, out[-3000:]  # before: -15, killed with nothing saved
    assert to_exit < 25, f"{to_exit:.1f} s from the signal to exit"
    saved = int(STOPPED.search(out).group(1))
    # Nothing trained is lost: the saved step is at least the last step reported before the notice,
    # and at most the one in flight after it.
    assert trained <= saved <= trained + 1, (trained, saved, out[-2000:])
    if signum == signal.SIGINT:  # the line says how to go on, and the step was saved as the loop saves
        assert saved >= 5 and f"step {saved:05d} | saving checkpoint\n" in seen, out[-2000:]
        assert f"stopped at step {saved}; run the same command to resume" in out, out[-2000:]
    steps_on_disk = sorted(int(s) for s in os.listdir(run / "checkpoints")) if saved else []
    assert (steps_on_disk[-1] if steps_on_disk else 0) == saved and not (run / "COMPLETE").exists()
    print(f"{moment}: {signal.Signals(signum).name} after step {trained}, saved step {saved}, exit {code} after "
          f"{to_exit:.1f} s")

    r = _pretrain([*common, f"--run-dir={run}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (f"resumed from step {saved} " in r.stdout) == (saved > 0)
    (step_a, a), (step_b, b) = _final_params(reference), _final_params(run)
    assert step_a == step_b == STEPS
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)  # bitwise


# StopOnSignal's own contract in a process of its own: a save that outlasts the grace period is
# reported and the process still exits 75 in time; a second SIGTERM stops at once.
GRACE = textwrap.dedent("""
    import sys, time
    from flaxchat.errors import cli_main
    from flaxchat.stage import StopOnSignal

    class Checkpoints:
        def raise_if_failed(self): pass
        def latest_step(self): return None
        def close(self): pass

    def main(argv):
        with StopOnSignal(lambda s: print(s, flush=True), grace_s=float(sys.argv[1])) as notice:
            step = 0
            while True:
                notice.stop_here(step, Checkpoints(), lambda at: (print("saving", flush=True), time.sleep(30)))
                step += 1
                print(f"step {step}", flush=True)
                time.sleep(0.05)

    sys.exit(cli_main(main))
""")


def _start_loop(grace: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", GRACE, str(grace)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step 3"):
            return proc
    raise AssertionError(f"the loop did not start: {proc.communicate(timeout=10)[0]}")


@pytest.mark.timeout(60)
def test_a_save_past_the_grace_period_is_reported_and_still_exits_75_in_time():
    proc = _start_loop(grace=1.0)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 75, out
    assert 1.0 <= time.time() - t0 < 5, time.time() - t0
    assert "saving" in out and "did not finish within the 1 s grace period" in out, out


@pytest.mark.timeout(60)
def test_a_second_sigterm_stops_at_once():
    proc = _start_loop(grace=20.0)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stdout:
        if line.startswith("saving"):
            break
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGTERM and time.time() - t0 < 5


# --- several processes ----------------------------------------------------------------------------
MULTI = [*TINY, "--steps=30", "--save-every=0", "--max-chars-tokenizer=20000", "--seed=3"]


# scripts.pretrain, each step 0.3 s longer: the notice's round through the coordination service
# (about 0.2 s here) must come before the last step, or the job rightly just finishes (exit 0).
SLOW_STEPS = """
import sys, time, flaxchat.train as train
step = train.StepLoop.__call__
train.StepLoop.__call__ = lambda self, *args: (time.sleep(0.3), step(self, *args))[1]
from flaxchat.errors import cli_main
from scripts import pretrain
sys.exit(cli_main(pretrain.main, sys.argv[1:]))
"""


def _start_job(run, port, slow=False):
    how = ["-c", SLOW_STEPS] if slow else ["-m", "scripts.pretrain"]
    return [subprocess.Popen([sys.executable, *how, f"--run-dir={run}", *MULTI], cwd=ROOT,
                             env=cpu_env(1, **coordinator_env(port, 2, i)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]


def _outputs(procs, timeout):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the job did not end in {timeout} s:\n{p.communicate()[0][-3000:]}")
    return outs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_process_of_two_both_save_the_same_step_and_resume_equal(tmp_path):
    """JAX's preemption sync point: the notice reaches process 1 only; both stop at the same step
    (never one the other has not reached), save it together and exit 75; the job resumes equal to an
    uninterrupted one."""
    ref = tmp_path / "uninterrupted"
    outs = _outputs(_start_job(ref, free_port()), 400)
    assert "2 device(s) in 2 process(es)" in outs[0], outs[0][-2000:]

    run = tmp_path / "preempted"
    procs = _start_job(run, free_port(), slow=True)
    seen, trained = [], 0
    for line in procs[0].stdout:  # process 0 prints the steps
        seen.append(line)
        if m := STEP_LINE.match(line):
            trained = int(m.group(1))
            if trained >= 5:
                t_signal = time.time()
                procs[1].send_signal(signal.SIGTERM)
                break
    outs = _outputs(procs, 120)
    to_exit = time.time() - t_signal
    out0 = "".join(seen) + outs[0]
    assert [p.returncode for p in procs] == [75, 75], (out0[-2000:], outs[1][-2000:])
    agreed = int(re.search(r"every process stops at step (\d+)", out0).group(1))
    # The largest step any process had reached when the notice came round, + 1: the steps trained
    # meanwhile are saved too, so nothing is lost however long the round took (1-3 steps here).
    assert trained <= agreed < 30 and to_exit < 25, (trained, agreed, to_exit)
    assert sorted(os.listdir(run / "checkpoints")) == [str(agreed)]
    print(f"2 processes: SIGTERM to process 1 after step {trained}, both saved step {agreed}, exit 75 after "
          f"{to_exit:.1f} s")

    outs = _outputs(_start_job(run, free_port()), 400)
    assert f"resumed from step {agreed} " in outs[0], outs[0][-2000:]
    assert "OK" in compare_params(ref, run, 2)


# --- where it hung: a supervisor's worker asks a stalled stage for its stacks ----------------------
STALLED = textwrap.dedent("""
    import os, sys, time
    from flaxchat.errors import cli_main
    from flaxchat.progress import Progress

    def stalled_step():
        time.sleep(600)  # a collective that never returns

    def main(argv):
        if argv[0] == "distributed":  # process 1 of 2, waiting for a coordinator that never comes
            import jax
            jax.distributed.initialize(coordinator_address=argv[1], num_processes=2, process_id=1,
                                       initialization_timeout=600)
        Progress("test", steps=10).update(3, force=True)
        print("training", flush=True)
        stalled_step()

    sys.exit(cli_main(main, sys.argv[1:]))
""")


def _worker(*args, state) -> dict:
    from flaxchat.cloud import gcloud as g
    from flaxchat.runner import worker
    out = subprocess.run([sys.executable, worker.__file__, args[0], "--state-dir", str(state), *args[1:]], env=_env(),
                         capture_output=True, text=True, timeout=60)
    return g.parse_worker_lines(out.stdout)[0]


def _start_stalled(tmp_path, *argv) -> str:
    state = tmp_path / "state"
    (tmp_path / "stalled.py").write_text(STALLED)
    assert _worker("start", "--run-id", "r1", "--cwd", str(tmp_path), "--", sys.executable, "stalled.py", *argv,
                   state=state)["started"]
    return state


def _wait_for(state, line: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while line not in ((state / "output.log").read_text() if (state / "output.log").exists() else ""):
        assert time.time() < deadline, (state / "output.log").read_text()
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_a_stalled_step_leaves_its_python_stacks_before_it_is_killed(tmp_path):
    # Started from an ssh session (its own session, as sshd makes one) that then drops: SIGHUP to it.
    from flaxchat.runner import worker
    state = tmp_path / "state"
    (tmp_path / "stalled.py").write_text(STALLED)
    start = [sys.executable, worker.__file__, "start", "--state-dir", str(state), "--run-id", "r1", "--cwd",
             str(tmp_path), "--", sys.executable, "stalled.py", "step"]
    ssh = subprocess.Popen(["bash", "-c", f"{' '.join(start)} && sleep 60"], env=_env(), start_new_session=True,
                           stdout=subprocess.DEVNULL)
    try:
        _wait_for(state, "training")
        os.killpg(ssh.pid, signal.SIGHUP)
        assert ssh.wait(timeout=10) == -signal.SIGHUP
        time.sleep(0.5)
        assert _worker("status", state=state)["alive"]  # the job lives on
        dump = _worker("dump", state=state)
        stacks = open(dump["stacks"]).read()
        assert "in stalled_step" in stacks and "hung in the step after 3" in stacks, stacks
        assert dump["where"] == "the step after 3" and len(dump["processes"]) == 1
        assert _worker("status", state=state)["hang_file"] == dump["stacks"]  # what --health names
    finally:
        _worker("stop", state=state)


@pytest.mark.timeout(120)
def test_a_hang_in_the_distributed_start_is_told_apart_from_a_stuck_step(tmp_path):
    state = _start_stalled(tmp_path, "distributed", f"127.0.0.1:{free_port()}")  # no coordinator there
    try:
        deadline = time.time() + 60
        while not list(state.glob("stacks-*.txt")) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # well inside jax.distributed.initialize
        dump = _worker("dump", state=state)
        stacks = open(dump["stacks"]).read()
        assert dump["where"] == "the distributed start (jax.distributed.initialize)", stacks
        assert "stalled_step" not in stacks and "in initialize" in stacks
    finally:
        _worker("stop", state=state)


# --- SFT and RL: the same notice, the same loop helper --------------------------------------------
STAGES = {
    "sft": ["--mix", "chat,arithmetic", "--steps", "6", "--device-batch-size", "2", "--eval-every", "0",
            "--save-every", "0", "--log-every", "1"],
    "rl": ["--steps", "3", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--eval-every", "0",
           "--save-every", "0", "--log-every", "1"],
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", list(STAGES))
def test_sft_and_rl_save_on_sigterm_and_resume_from_that_step(script, base, tmp_path):  # noqa: F811
    from test_sft_rl import _params
    args = ["--base", str(base), *STAGES[script]]
    run = tmp_path / script
    proc = subprocess.Popen([sys.executable, "-m", f"scripts.{script}", *args, "--run-dir", str(run)], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, trained = [], 0
    for line in proc.stdout:
        seen.append(line)
        if m := STEP_LINE.match(line):
            trained = int(m.group(1))
            proc.send_signal(signal.SIGTERM)
            break
    seen += proc.stdout.readlines()
    out = "".join(seen)
    assert proc.wait(timeout=120) == 75, out[-3000:]
    saved = int(STOPPED.search(out).group(1))
    assert trained <= saved <= trained + 1 and sorted(os.listdir(run / "checkpoints")) == [str(saved)]

    r = _run_stage(script, *args, "--run-dir", str(run))
    assert r.returncode == 0 and f"resumed from step {saved}" in r.stdout, r.stderr[-3000:]
    if script == "sft":  # bit for bit as an uninterrupted run (RL's rollouts are checked for resuming only)
        ref = tmp_path / "uninterrupted"
        r = _run_stage(script, *args, "--run-dir", str(ref))
        assert r.returncode == 0, r.stderr[-3000:]
        for a, b in zip(_params(ref)[1], _params(run)[1]):
            np.testing.assert_array_equal(a, b)


def _run_stage(script, *args):
    return subprocess.run([sys.executable, "-m", f"scripts.{script}", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_workers_stop_saves_the_step_and_its_exit_code_says_preempted(tmp_path, tokenizer_dir):
    """The launcher's --stop (and a restart) goes through worker.py stop: SIGTERM, then SIGKILL after
    30 s. A stage saves its step in that time, and the worker records 75 for recovery to read."""
    state, run = tmp_path / "state", tmp_path / "run"
    cmd = [sys.executable, "-m", "scripts.pretrain", *TINY, f"--tokenizer-dir={tokenizer_dir}", "--steps=100000",
           "--save-every=0", f"--run-dir={run}"]
    assert _worker("start", "--run-id", "r1", "--cwd", ROOT, "--", *cmd, state=state)["started"]
    try:
        deadline = time.time() + 200
        while (_worker("status", state=state).get("step") or 0) < 3:
            assert time.time() < deadline and _worker("status", state=state)["alive"], \
                (state / "output.log").read_text()[-3000:]
            time.sleep(1)
    finally:
        _worker("stop", state=state)
    st = _worker("status", state=state)
    log = (state / "output.log").read_text()
    assert st["exit_code"] == 75 and st["state"] == "exited", log[-3000:]
    saved = int(STOPPED.search(log).group(1))
    assert saved >= 3 and sorted(os.listdir(run / "checkpoints")) == [str(saved)]

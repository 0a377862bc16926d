"""TPULauncher and its CLI against the gcloud emulator (first on PATH; the real gcloud is never run).

The emulated workers are stock TPU VM images (python3 is 3.10, no site-packages), so setup builds a
venv on each; the tests pass --install with a fast equivalent of the default (uv venv with this
machine's 3.11 seeing the test interpreter's packages, then the uploaded repo installed editable
without deps), so no test downloads jax or libtpu; the same holds when the tests run inside a venv. Run folders are gs:// in the rehearsal bucket (a folder beside the
emulated VMs): deleting a VM loses its disk, as on Google's.

A stand-in training script (written into a tiny repo that the tests upload) prints progress lines on
process 0 only (as a real job does), writes the progress file on every process, writes Orbax-on-GCS-
like checkpoints (the step under its final name, commit_success.txt last) to gs:// through fsspec,
resumes from the latest complete one and writes COMPLETE on process 0: enough to drive
run/health/wait/recover without JAX. The slow test at the end rehearses the real thing with
scripts.pretrain on a 2-worker pod.
"""

import json
import re
import os
import pathlib
import shlex
import shutil
import signal
import site
import subprocess
import sys
import threading
import time

import pytest

from flaxchat.cloud import gcloud as g
from flaxchat.cloud import recovery as rec
from flaxchat.cloud.cli import main
from flaxchat.cloud.launcher import TPUConfig, TPULauncher, load_state, save_state
from flaxchat.cloud.rehearsal import emulator
from flaxchat.errors import cli_main

pytestmark = pytest.mark.slow  # an emulated cloud with real processes: CI runs it; `-m "not slow"` skips it

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, Z, NAME = "proj", "us-central2-b", "pod"
UV_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flaxchat-test-uv")  # uv itself, pip --target'ed once
UV_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flaxchat-test-uv-cache")
# What the default install does (a uv venv with Python 3.11, the project in it), minus the downloads:
# this machine's 3.11, the packages of the interpreter that runs the tests (jax etc.; a .pth file
# names its site-packages, which inside a virtual environment are the venv's own, not the base
# interpreter's that --system-site-packages would give), and the uploaded repo editable without deps.
_SEE_OUR_PACKAGES = ("import site, sys; open(site.getsitepackages()[0] + '/_flaxchat_tests.pth', 'w')"
                     ".write(''.join(f'import site; site.addsitedir({d!r})\\n' for d in sys.argv[1:]))")
TEST_INSTALL = (f'"$UV" venv --python {os.path.realpath(sys.executable)} --allow-existing "$FLAXCHAT_VENV" && '
                f'"$FLAXCHAT_VENV/bin/python" -c {shlex.quote(_SEE_OUR_PACKAGES)} '
                f'{shlex.join(site.getsitepackages())} && '
                '"$UV" pip install -q --python "$FLAXCHAT_VENV/bin/python" --no-deps -e .')

STANDIN = r"""
import json, os, sys, time
import fsspec  # gs:// as flaxchat.paths and Orbax reach it (the rehearsal bucket here)

args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
run_dir, steps, every = args["run-dir"], int(args["steps"]), int(args.get("save-every", 5))
pid = int(os.environ.get("JAX_PROCESS_ID", "0"))
fs = fsspec.filesystem("gs")
ckpt = run_dir + "/checkpoints"
fs.pipe(f"{run_dir}/env-{pid}.json", json.dumps(dict(os.environ)).encode())
if pid == 0:
    print("secret seen:", os.environ.get("SECRET_TOKEN", "-"), flush=True)
done = sorted(int(p.rstrip("/").rsplit("/", 2)[-2]) for p in fs.glob(f"{ckpt}/*/commit_success.txt"))
step, w = (done[-1], json.loads(fs.cat(f"{ckpt}/{done[-1]}/w.json"))) if done else (0, 1.0)
if step and pid == 0:
    print(f"resumed from step {step}", flush=True)
crash = args.get("crash-once")
first = bool(crash) and pid == 0 and not os.path.exists(crash)  # worker 0 crashes in its first run only
# Every worker, in its first run only: exits 75 at step 3 as a stage that saved on a notice does, or
# stalls at step 3 in Python (as in a collective that never returns), its stacks asked for by SIGUSR1.
preempt, stall = (args.get(k) and f"{args[k]}-{pid}" for k in ("preempt-once", "stall-once"))  # one per worker
preempt_now = bool(preempt) and not os.path.exists(preempt)
stall_now = bool(stall) and not os.path.exists(stall)
if stall:
    from flaxchat.errors import listen_for_stack_dumps
    listen_for_stack_dumps()
def stalled_collective():
    while True:
        time.sleep(1)
progress = os.environ.get("FLAXCHAT_PROGRESS_FILE")
first_seen = {}  # as flaxchat.progress: the first step this process trained, and when
stop = args.get("stop-file")  # the test says when to finish (its clock is not this one)
while step < steps:
    if stop and os.path.exists(stop):
        steps = step
    step += 1
    w = w * 0.9 + 0.01 * step
    if progress:
        first_seen = first_seen or {"first_step": step, "first_time": time.time()}
        with open(progress + ".tmp", "w") as f:
            json.dump({"schema": 1, "stage": "standin", "step": step, "steps": steps, "time": time.time(),
                       "pid": os.getpid(), "process": pid, "loss": w, "tok_s": 1234.0, **first_seen}, f)
        os.replace(progress + ".tmp", progress)
    if pid == 0:
        print(f"step {step:05d}/{steps:05d} | loss {w:.4f} | tok/s 1,234", flush=True)
    if first and step == 3:
        open(crash, "w").close()
        sys.exit(7)
    if (preempt_now or stall_now) and step == 3:
        open(preempt or stall, "w").close()
        if preempt_now:
            sys.exit(75)
        stalled_collective()
    if pid == 0 and step % every == 0:  # as Orbax on GCS: the final name at once, the marker last
        fs.pipe(f"{ckpt}/{step}/w.json", json.dumps(w).encode())
        fs.pipe(f"{ckpt}/{step}/commit_success.txt", b"")
    time.sleep(float(args.get("sleep", "0")))
if pid == 0:
    hold = args.get("hold-file")  # the final save and the marker can come well after worker 1 is done
    deadline = time.time() + 60
    while hold and not os.path.exists(hold) and time.time() < deadline:
        time.sleep(0.05)
    fs.pipe(f"{run_dir}/COMPLETE", json.dumps({"step": step, "w": w}).encode())
"""


def uv_bin() -> str:
    """A uv for the emulated workers (this machine has none): pip-installed into a folder of its own,
    once; never into the interpreter that runs the tests."""
    if shutil.which("uv"):
        return os.path.dirname(shutil.which("uv"))
    if not os.path.exists(os.path.join(UV_DIR, "bin", "uv")):
        tmp = f"{UV_DIR}.tmp{os.getpid()}"  # then renamed: a concurrent test run never sees half of it
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", tmp, "uv"], check=True,
                       timeout=300, capture_output=True)
        try:
            os.rename(tmp, UV_DIR)
        except OSError:  # another run was first
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(UV_DIR, "bin")


def _make_env(base, mp):
    """The emulator first on PATH, HOME and every state file under base, a tiny repo to upload."""
    mp.setenv("HOME", str(base / "home"))
    mp.setenv(emulator.STATE_ENV, str(base / "emu"))
    mp.setenv(emulator.DELAY_ENV, "0")
    mp.setenv("FLAXCHAT_LAUNCHER_STATE", str(base / "launcher.json"))
    mp.setenv("UV_CACHE_DIR", UV_CACHE)
    shim = emulator.install_shim(str(base / "bin"))
    mp.setenv("PATH", os.path.dirname(shim) + os.pathsep + uv_bin() + os.pathsep + os.environ["PATH"])
    os.makedirs(os.path.join(emulator.buckets_root(), "bk"), exist_ok=True)  # the run folders' bucket
    repo = base / "repo"
    if not repo.exists():
        shutil.copytree(os.path.join(REPO, "flaxchat"), repo / "flaxchat",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy(os.path.join(REPO, "pyproject.toml"), repo / "pyproject.toml")
        shutil.copy(os.path.join(REPO, "README.md"), repo / "README.md")
        for pkg in ("scripts", "tasks"):  # pyproject's package list
            (repo / pkg).mkdir()
            (repo / pkg / "__init__.py").write_text("")
        (repo / "standin.py").write_text(STANDIN)
        (repo / "scripts" / "sft.py").write_text(STANDIN)  # a stage with no --run-dir in its command line
        (repo / ".gitignore").write_text("ignored.txt\n")
        (repo / "ignored.txt").write_text("do not upload")
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(["git", "-C", str(repo), "add", "."], check=True)  # uploads take tracked files
        (repo / ".env").write_text("HF_TOKEN=hf_not_for_the_workers\n")  # untracked, and secret-looking
    return base


def bucket(url: str) -> str:
    """Where the rehearsal keeps gs://... on this machine (to look at it from the test)."""
    return os.path.join(emulator.buckets_root(), url[len("gs://"):])


def _kill_everything():
    """Whatever a test left running on its emulated VMs (a failed assertion mid-run) ends with it."""
    for node in emulator.list_nodes():
        emulator.kill_node_processes(node["project"], node["zone"], node["name"])


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """A fresh emulator for tests that preempt, delete or recreate VMs."""
    yield _make_env(tmp_path, monkeypatch)
    _kill_everything()


@pytest.fixture(scope="module")
def shared_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield _make_env(tmp_path_factory.mktemp("shared"), mp)
        _kill_everything()


@pytest.fixture(scope="module")
def shared_pod(shared_env):
    """One READY, set-up 2-worker VM for the tests that only run commands on it (saves a create+setup each)."""
    ready(shared_env, name="shared")
    return shared_env


@pytest.fixture
def spod(shared_pod, request, monkeypatch):
    """The shared VM, with this test's own gs:// run folder; whatever a test left running is stopped after it."""
    for k, v in [("HOME", shared_pod / "home"), (emulator.STATE_ENV, shared_pod / "emu"),
                 ("FLAXCHAT_LAUNCHER_STATE", shared_pod / "launcher.json")]:
        assert os.environ[k] == str(v)
    lc = launcher(shared_pod, name="shared")
    lc.run_dir = f"gs://bk/{request.node.name}"
    yield lc
    lc.stop()


def launcher(base, name=NAME, accel="v4-16", recorded=None, out=None, **kw) -> TPULauncher:
    sleep, clock = kw.pop("sleep", time.sleep), kw.pop("clock", time.time)
    config = TPUConfig(project=P, zone=kw.pop("zone", Z), tpu_name=name, accelerator_type=accel,
                       startup_check_s=kw.pop("startup_check_s", 0.0), poll_s=0.1,
                       install_command=kw.pop("install_command", TEST_INSTALL), **kw)
    return TPULauncher(config, executor=g.GcloudExecutor(record=recorded.append if recorded is not None else None),
                       out=out or (lambda s: None), sleep=sleep, clock=clock)


def ready(base, **kw) -> TPULauncher:
    lc = launcher(base, **kw)
    lc.create()
    lc.setup(str(base / "repo"))
    return lc


def standin(run_dir, steps=6, **extra) -> str:
    args = " ".join(f"--{k}={v}" for k, v in {"run-dir": run_dir, "steps": steps, **extra}.items())
    return f"python standin.py {args}"


def cli(capsys, *argv):
    code = cli_main(main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def worker_home(w, name=NAME, zone=Z):
    return emulator.worker_dir(P, zone, name, w)


def until(pred, timeout=20.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_the_installed_command_prints_an_error_as_one_line(monkeypatch, capsys):
    """pyproject's console script (`flaxchat-launch`) pointed at `main` itself, so every UserError
    reached the user as a traceback with exit code 1; it goes through cli_main like `python -m`."""
    import importlib
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["flaxchat-launch"]
    module, attr = target.split(":")
    monkeypatch.setattr(sys, "argv", ["flaxchat-launch", "--project", "p"])  # no action given
    assert getattr(importlib.import_module(module), attr)() == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: nothing to do") and err.count("\n") == 0, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,words", [
    (["--recover", "true", "--heartbeat-deadline", "0"], "--heartbeat-deadline must be positive (got 0)"),
    (["--wait", "--poll-interval", "-5"], "--poll-interval must be positive (got -5)"),  # time.sleep(-5) mid-wait
    (["--wait", "--timeout", "-1"], "--timeout must be positive"),
    (["--recover", "true", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    (["--health", "--price-per-chip-hour", "0"], "--price-per-chip-hour must be positive (got 0)"),
    (["--logs", "--lines", "-3"], "--lines must be 0 or more"),  # went to the workers' tail as is
    (["--run", "true", "--coordinator-port", "99999"], "--coordinator-port must be between 1 and 65535"),
])
def test_a_number_that_cannot_mean_what_was_asked_is_one_sentence(argv, words, capsys):
    code, out, err = cli(capsys, "--project", "p", "--tpu-name", "t", "--zone", Z, *argv)
    assert code == 2 and words in err and err.strip().count("\n") == 0, err
    assert out == ""  # refused before a VM was looked at


# --- create / setup / teardown -------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_cli_create_setup_upload_then_later_calls_name_only_the_project(pod, capsys):
    repo = str(pod / "repo")
    code, _, err = cli(capsys, f"--project={P}", f"--zone={Z}", f"--tpu-name={NAME}", "--accelerator=v4-16",
                       "--create", "--setup", f"--upload={repo}", f"--install={TEST_INSTALL}")
    assert code == 0, err
    assert f"acting on TPU VM '{NAME}' (v4-16, zone {Z}, project {P}; from the command line)" in err
    assert "READY with 2 worker(s)" in err
    # Setup ends with one line per worker from its venv: the Python, jax and flaxchat the run will use.
    last = err.strip().splitlines()[-2:]
    assert [x.split(":")[0] for x in last] == ["worker 0", "worker 1"], err
    assert all(re.match(r"worker \d: ready: Python 3\.1[1-9]\.\d+, jax (\d\S*|missing), flaxchat \S+$", x) for x in last), last
    for w in (0, 1):
        home = worker_home(w)
        assert os.path.exists(os.path.join(home, "flaxchat", "standin.py"))
        assert os.path.exists(os.path.join(home, "flaxchat", "flaxchat", "runner", "worker.py"))
        assert not os.path.exists(os.path.join(home, "flaxchat", ".env"))  # never uploaded
        assert not os.path.exists(os.path.join(home, "flaxchat", "ignored.txt"))  # .gitignore honoured
    code, _, err = cli(capsys, f"--project={P}", "--setup", f"--upload={repo}")
    assert code == 0 and "remembered in" in err and "up to date on all 2 worker(s)" in err
    assert err.strip().splitlines()[-1].startswith("worker 1: ready: Python 3.")
    # The create is idempotent, and a PREEMPTED VM is deleted before it is made again.
    recorded = []
    lc = launcher(pod, recorded=recorded)
    lc.create()
    assert [c.split()[4] for c in recorded] == ["describe", "describe"]  # READY: reused
    emulator.preempt(NAME, Z, P)
    lc.create()
    assert [c.split()[4] for c in recorded][2:] == ["describe", "delete", "create", "describe"]
    assert lc.describe()["state"] == "READY"
    code, _, err = cli(capsys, f"--project={P}", "--teardown")
    assert code == 0 and lc.describe() is None
    assert json.load(open(os.environ["FLAXCHAT_LAUNCHER_STATE"]))["vms"] == {}


@pytest.mark.timeout(120)
def test_setup_builds_a_venv_because_the_image_has_python_310(pod):
    """The seed's `python3 -m pip install -e .` fails on Google's images (Python 3.10); setup's venv
    is 3.11, and the run's `python` is the venv's."""
    lc = launcher(pod, install_command='python3 -m pip install -q -e . "jax[tpu]"',  # the seed's install
                  sleep=lambda s: None)
    lc.create()
    with pytest.raises(Exception, match="setup failed on TPU VM pod 3 time") as e:
        lc.setup(str(pod / "repo"))
    assert "no Python >= 3.11 that imports flaxchat" in str(e.value) or "requires a different Python" in str(e.value)
    lc = ready(pod)  # the test's install (a uv venv, this machine's 3.11)
    out = lc._ssh("python3 --version; .flaxchat/venv/bin/python -c 'import sys; print(sys.version_info[:2])'").stdout
    assert out.count("Python 3.10.12") == 2 and out.count("(3, 11)") == 2
    lc.run("python -c 'import sys, flaxchat; print(sys.prefix, flaxchat.__file__)'")
    assert lc.wait(timeout=60).ok
    lines = []
    lc.logs(lines=5, on_line=lines.append)
    assert any(x.startswith(os.path.join(worker_home(0), ".flaxchat", "venv") + " " + worker_home(0)) for x in lines), lines


@pytest.mark.timeout(60)
def test_setup_waits_for_ssh_and_retries(pod):
    logs = []
    lc = launcher(pod, out=logs.append, sleep=lambda s: None)
    lc.create()
    emulator.fail_next("tpu-vm.ssh", "[/usr/bin/ssh] exited with return code [255].", code=255, times=2)
    lc.setup(str(pod / "repo"))
    assert sum("waiting for ssh on TPU VM pod" in x for x in logs) == 2, logs
    emulator.fail_next("tpu-vm.scp", "[/usr/bin/scp] exited with return code [1].", times=1)
    (pod / "repo" / "new.txt").write_text("changed")
    subprocess.run(["git", "-C", str(pod / "repo"), "add", "new.txt"], check=True)
    lc.setup(str(pod / "repo"))
    assert any("setup attempt 1 of 3 failed" in x for x in logs), logs
    assert os.path.exists(os.path.join(worker_home(1), "flaxchat", "new.txt"))


@pytest.mark.timeout(60)
def test_spot_uses_a_queued_resource_and_teardown_deletes_it(shared_env):
    recorded, logs = [], []
    lc = launcher(shared_env, name="spotty", accel="v5litepod-16", zone="us-east5-b", spot=True, recorded=recorded,
                  out=logs.append)
    node = lc.create()
    assert len(node["networkEndpoints"]) == 4 and node["schedulingConfig"] == {"spot": True}
    assert any("queued-resources create spotty-qr" in c for c in recorded)
    assert "queued resource spotty-qr: ACTIVE" in logs
    lc.teardown()
    assert any("queued-resources delete spotty-qr" in c and "--force" in c for c in recorded)
    assert lc.describe() is None


@pytest.mark.timeout(60)
def test_a_failed_queued_resource_exits_with_googles_message(shared_env, capsys):
    message = "The TPU runtime version 'v2-alpha-tpuv5-lite' is not supported for this reservation."
    emulator.fail_next("queued-resources.provision", message)
    code, _, err = cli(capsys, f"--project={P}", "--zone=us-east5-b", "--tpu-name=qf", "--accelerator=v5litepod-16",
                       "--spot", "--create")
    assert code != 0
    assert f"error: queued resource qf-qr FAILED: {message}" in err
    assert "queued resource qf-qr: FAILED" in err


@pytest.mark.timeout(60)
def test_stockouts_retry_with_backoff_and_fall_back_to_the_next_zone(shared_env, capsys):
    emulator.stockout(Z, times=2)  # the first zone is out both times it is tried
    emulator.stockout("us-central2-a", times=1)  # the second is out once
    sleeps = []
    logs = []
    lc = launcher(shared_env, name="capacity", accel="v4-8", zones=(Z, "us-central2-a"), out=logs.append,
                  sleep=sleeps.append)
    node = lc.create()
    assert node["state"] == "READY" and lc.config.zone == "us-central2-a"
    assert lc.remembered()["zone"] == "us-central2-a"  # later calls find it where it is
    code, _, err = cli(capsys, f"--project={P}", "--tpu-name=capacity", f"--zones={Z},us-central2-a", "--stop")
    assert code == 0 and "acting on TPU VM 'capacity' (v4-8, zone us-central2-a," in err, err
    text = "\n".join(logs)
    assert [x.split(":")[0] for x in logs if x.startswith("attempt")] == [
        "attempt 1", "attempt 1", "attempt 2", "attempt 2", "attempt 3", "attempt 3", "attempt 4"]
    assert f'attempt 1: no capacity in {Z}: gcloud said: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: ' \
           f'There is no more capacity in the zone "{Z}"' in text
    assert "no zone had capacity (us-central2-b, us-central2-a); trying again in 60 s" in text
    assert sleeps == [60.0] and "TPU VM capacity is READY with 1 worker(s) in us-central2-a" in text
    lc.teardown()
    # Bounded: with --capacity-retry-hours 0 it stops after one round, with gcloud's words.
    emulator.fail_next("create", "RESOURCE_EXHAUSTED: Quota 'TPUV4sPodPerProjectPerZoneForTPUAPI' exhausted. "
                                 "Limit: 32 in zone us-central2-b.")
    code, _, err = cli(capsys, "--project=other", f"--zone={Z}", "--tpu-name=q", "--accelerator=v4-16", "--create",
                       "--capacity-retry-hours=0")
    assert code != 0 and err.count("error:") == 1
    assert ("error: no capacity for v4-16 in us-central2-b after 1 attempt(s) over 0 s; the last answer was: "
            "gcloud said: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota "
            "'TPUV4sPodPerProjectPerZoneForTPUAPI' exhausted. Limit: 32 in zone us-central2-b.") in err


@pytest.mark.timeout(60)
def test_teardown_of_a_missing_vm_says_not_found(shared_env, capsys):
    code, _, err = cli(capsys, f"--project={P}", f"--zone={Z}", "--tpu-name=ghost", "--teardown")
    assert code != 0
    assert ("error: TPU VM ghost was not found in zone us-central2-b (project proj); nothing was deleted: "
            "check --tpu-name and --zone") in err
    assert "deleting" not in err


@pytest.mark.timeout(60)
def test_recover_refuses_checkpoints_on_the_vm_disk_and_creates_nothing(shared_env, capsys):
    base = [f"--project={P}", f"--zone={Z}", "--tpu-name=local-ckpt", "--accelerator=v4-8"]
    cmd = "python -m scripts.pretrain --depth=4"
    code, _, err = cli(capsys, *base, "--preemptible", "--create", "--run-dir=runs/d4", "--recover", cmd)
    assert code != 0 and err.count("error:") == 1 and err.strip().count("\n") <= 1
    assert ("error: --recover deletes and recreates a preempted or broken VM, but the run folder runs/d4 is on "
            "the VM's own disk, which a preemption or a recreate deletes, so training would silently start again "
            "from step 0: use a gs:// --run-dir (a bucket outlives the VM), or pass --allow-local-checkpoints to "
            "accept that.") in err
    code, _, err = cli(capsys, *base, "--spot", "--create", "--run-dir=runs/d4", "--run", cmd)
    assert code != 0 and "a spot VM is deleted when it is preempted, but the run folder runs/d4" in err
    # Not told at all: the command is never searched for one; the recovery must know it before it starts.
    code, _, err = cli(capsys, *base, "--preemptible", "--create", "--recover", cmd + " --run-dir=gs://bk/d4")
    assert code != 0 and err.count("error:") == 1 and "so it must know the run folder before it starts: pass " \
        "--run-dir gs://BUCKET/RUN" in err, err
    assert not [n for n in emulator.list_nodes() if n["name"] == "local-ckpt"]  # nothing created


# --- run / health / logs / wait (on the shared VM) ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_run_gives_every_worker_the_same_env_and_never_leaks_a_secret(spod, shared_pod):
    recorded = []
    spod.ex.record = recorded.append
    spod.config.coordinator_port = 12345
    secret = "tok-9f8e7d6c5b4a"
    spod.run(standin(spod.run_dir, steps=10, sleep=0.1), env={"MY_FLAG": "on"}, secrets={"SECRET_TOKEN": secret})
    until(lambda: all(os.path.exists(bucket(f"{spod.run_dir}/env-{i}.json")) for i in (0, 1)), what="both workers")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "standin.py" in ps and secret not in ps
    for i in (0, 1):
        env = json.load(open(bucket(f"{spod.run_dir}/env-{i}.json")))
        assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:12345"
        assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_PROCESS_ID"] == str(i)
        assert env["MY_FLAG"] == "on" and env["SECRET_TOKEN"] == secret  # the command does get it
        assert env["VIRTUAL_ENV"].endswith(os.path.join(f"worker-{i}", ".flaxchat", "venv"))
    assert spod.wait(timeout=60).ok
    lines = []
    spod.logs(all_workers=True, lines=100, on_line=lines.append)
    assert "[w0] secret seen: ***" in lines and not any(x.startswith("[w1] step") for x in lines)  # only process 0 prints
    logs = [open(os.path.join(d, f)).read() for d, _, fs in os.walk(shared_pod / "emu") for f in fs
            if f.endswith(".log")]
    assert len(logs) == 2 and all(secret not in t for t in logs) and any("secret seen: ***" in t for t in logs)
    assert recorded and not any(secret in c for c in recorded)
    env_file = os.path.join(worker_home(1, "shared"), g.REMOTE_ENV_FILE)
    assert oct(os.stat(env_file).st_mode & 0o777) == "0o600"


PROGRESS = ("python3 -S -c \"import json, os, time; json.dump(dict(schema=1, step={step}, steps=100, time=time.time(), "
            "loss={loss}, tok_s={toks}), open(os.environ['FLAXCHAT_PROGRESS_FILE'], 'w'))\"")


@pytest.mark.timeout(90)
def test_health_shows_a_crash_on_worker_1_while_worker_0_runs(spod, capsys):
    spod.run('if [ "$JAX_PROCESS_ID" = 1 ]; then ' + PROGRESS.format(step=2, loss=4.0, toks=999) + '; '
             'echo "Traceback: boom"; exit 1; fi; ' + PROGRESS.format(step=2, loss=3.5, toks=1500) + '; sleep 30')
    until(lambda: spod.health()["workers"][1].get("state") == "exited", what="worker 1 to crash")
    until(lambda: spod.health()["workers"][0].get("step") == 2, what="worker 0's progress")
    report = spod.health()
    w0, w1 = report["workers"]
    assert (w0["state"], w0["alive"], w0["step"], w0["loss"], w0["tok_s"]) == ("running", True, 2, 3.5, 1500.0)
    assert (w1["state"], w1["exit_code"], w1["last_line"]) == ("exited", 1, "Traceback: boom")
    assert w0["progress_age"] < 30 and w0["disk_used_pct"] > 0
    assert report["problems"] == ["worker 1 crashed (exit 1): Traceback: boom"]
    code, out, err = cli(capsys, f"--project={P}", "--tpu-name=shared", f"--zone={Z}", "--health")
    assert code == 1
    assert "problem: worker 1 crashed (exit 1): Traceback: boom" in out
    rows = [line.split() for line in out.splitlines()[2:4]]
    assert rows[0][:2] == ["0", "running"] and rows[1][:3] == ["1", "exited", "1"]
    result = spod.wait(timeout=30)
    assert not result.ok and result.exit_codes == {1: 1} and "worker 1 crashed" in result.error_value
    spod.stop()
    assert not spod.health()["workers"][0]["alive"]


@pytest.mark.timeout(90)
def test_wait_trusts_the_completion_marker_and_exit_codes_not_log_text(spod):
    spod.run(standin(spod.run_dir, steps=4, **{"save-every": 2}), run_dir=spod.run_dir)
    result = spod.wait(timeout=60)
    assert result.ok and result.state == "done" and result.exit_codes == {0: 0, 1: 0}
    # download_checkpoint: the latest complete step, never a save cut short (no commit_success.txt).
    os.makedirs(bucket(f"{spod.run_dir}/checkpoints/6"))
    open(bucket(f"{spod.run_dir}/checkpoints/6/w.json"), "w").write("0.5")
    local = os.path.join(os.environ["HOME"], "local")
    path = spod.download_checkpoint(local)
    assert path == os.path.join(local, "4") and os.path.exists(os.path.join(path, "w.json"))
    assert not os.path.exists(os.path.join(local, "6"))
    # Exit 0 everywhere and a log that claims success, but no COMPLETE marker: not done.
    spod.run("echo 'training complete, step 00004/00004 | loss 1.0'; true", run_dir=f"{spod.run_dir}-other")
    result = spod.wait(timeout=60)
    assert not result.ok and "completion marker is missing" in result.error_value


@pytest.mark.timeout(90)
def test_a_worker_that_finished_first_is_not_a_failure_while_worker_0_still_writes_the_marker(spod, tmp_path):
    # Worker 1 exits 0 at once; worker 0 holds its COMPLETE marker until the test lets it go. The marker
    # is only missing while worker 0 runs: wait once called that a failure (CI caught it as a race).
    hold = tmp_path / "hold"
    spod.run(standin(spod.run_dir, steps=2, **{"hold-file": hold}), run_dir=spod.run_dir)
    until(lambda: (spod.health()["workers"][1].get("state") == "exited"), what="worker 1 to finish")
    status = spod.status()
    assert status.state == "running" and status.info["problems"] == [], status  # a worker that finished is no problem
    release = threading.Timer(3.0, hold.touch)  # while wait polls
    release.start()
    try:
        result = spod.wait(timeout=60)
    finally:
        release.cancel()
    assert (result.ok, result.state, result.exit_codes) == (True, "done", {0: 0, 1: 0}), result.error_value


@pytest.mark.timeout(60)
def test_a_command_that_exited_before_its_supervisor_wrote_the_code_is_not_killed(tmp_path):
    # The window `wait` once fell into (under load): the command has exited (a zombie, not yet
    # collected) and its supervisor is alive, about to write exit_code. That is "exiting", alive.
    from flaxchat.runner import worker
    child = subprocess.Popen(["true"])  # never waited for here: a zombie until the test ends
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "_supervise"])
    try:
        deadline = time.time() + 20
        while worker._pid_alive(child.pid) and time.time() < deadline:
            time.sleep(0.01)
        run = {"run_id": "r", "child_pid": child.pid, "supervisor_pid": supervisor.pid, "started_at": time.time()}
        assert worker._state(run, None) == ("exiting", True)
        assert worker._state(run, {"exit_code": 0}) == ("exited", False)
        supervisor.kill()
        supervisor.wait(10)
        assert worker._state(run, None) == ("killed", False)  # nobody left to write the code: killed
        # A pid reused by some other process after a reboot is not our supervisor.
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        assert worker._state({**run, "supervisor_pid": other.pid}, None) == ("killed", False)
        other.kill()
        other.wait(10)
    finally:
        supervisor.kill()
        child.wait(10)


@pytest.mark.timeout(90)
def test_exit_code_is_written_though_a_leftover_process_holds_the_output(tmp_path):
    # `sleep 600 &` inherits the command's stdout: reading it to the end would wait for the sleep.
    from flaxchat.runner import worker
    state = str(tmp_path / "state")
    script = os.path.abspath(worker.__file__)
    out = subprocess.run([sys.executable, script, "start", "--run-id", "r1", "--cwd", str(tmp_path),
                          "--state-dir", state, "--", "sleep 600 & echo $! > sleeper.pid; echo hi; exit 3"],
                         capture_output=True, text=True, timeout=30)
    assert g.parse_worker_lines(out.stdout)[0]["started"], out
    seen, st = [], {}
    try:
        deadline = time.time() + worker.OUTPUT_DRAIN_S + 30
        while time.time() < deadline:
            st = g.parse_worker_lines(subprocess.run([sys.executable, script, "status", "--state-dir", state],
                                                     capture_output=True, text=True, timeout=30).stdout)[0]
            seen.append(st["state"])
            if not st["alive"]:
                break
            time.sleep(0.2)
        sleeper = int((tmp_path / "sleeper.pid").read_text())
        assert st["state"] == "exited" and st["exit_code"] == 3 and "killed" not in seen, seen
        assert worker._pid_alive(sleeper)  # the code came while the leftover still held the pipe
        assert "hi" in (tmp_path / "state" / "output.log").read_text()
    finally:
        try:
            os.kill(int((tmp_path / "sleeper.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.timeout(60)
def test_download_checkpoint_from_the_bucket_needs_no_vm(shared_env):
    run = "gs://bk/after-teardown"
    for step, done in ((10, True), (20, True), (30, False)):
        os.makedirs(bucket(f"{run}/checkpoints/{step}"))
        open(bucket(f"{run}/checkpoints/{step}/w.json"), "w").write(str(step))
        if done:
            open(bucket(f"{run}/checkpoints/{step}/commit_success.txt"), "w").close()
    lc = launcher(shared_env, name="gone-long-ago")  # no such VM
    assert lc.complete_steps(f"{run}/checkpoints") == [10, 20]
    path = lc.download_checkpoint(os.path.join(os.environ["HOME"], "dl"), run_dir=run)
    assert path.endswith(os.path.join("dl", "20")) and open(os.path.join(path, "w.json")).read() == "20"


@pytest.mark.timeout(90)
def test_logs_follow_detaches_on_ctrl_c_and_training_goes_on(spod, capsys):
    spod.run(standin(spod.run_dir, steps=200, sleep=0.05))
    seen = []

    def on_line(line):
        seen.append(line)
        if line.startswith("step 00003"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        spod.logs(follow=True, on_line=on_line)
    assert any(s.startswith("step 00001") for s in seen)
    assert all(w["alive"] for w in spod.health()["workers"])  # detached, not stopped
    code, out, _ = cli(capsys, f"--project={P}", "--tpu-name=shared", f"--zone={Z}", "--logs", "--all-workers",
                       "--no-follow", "--lines=5")
    assert code == 0 and any(x.startswith("[w0] step") for x in out.splitlines())


def test_workers_never_ask_the_bucket_themselves():
    """Completion of a gs:// run is checked once per poll by the launcher (`gcloud storage ls`), not by
    every worker, and never in `logs --follow`'s 0.25 s loop (which used to call gcloud each time)."""
    src = open(os.path.join(REPO, "flaxchat", "runner", "worker.py")).read()
    assert '"gcloud"' not in src and "storage" not in src


@pytest.mark.timeout(120)
def test_recover_of_a_finished_sft_job_stops_at_its_completion_marker(spod, capsys):
    """The launcher is told the run folder (--run-dir) and passes it to the stage; it never reads it
    out of the command, which for SFT or RL names no run folder. --recover of an SFT job that has
    finished, asked from another terminal (the launcher's record of that run is gone), must not
    train it again: its COMPLETE marker, in the bucket, ends the recovery."""
    cmd = "python -m scripts.sft --steps=2"
    spod.run(cmd, run_dir=spod.run_dir)
    assert spod.wait(timeout=60).ok
    assert os.path.exists(bucket(f"{spod.run_dir}/COMPLETE"))
    first = spod.health()["workers"][0]["run_id"]
    state = load_state()
    del state["vms"][P]["run"]
    save_state(state)
    code, _, err = cli(capsys, f"--project={P}", "--tpu-name=shared", f"--zone={Z}", f"--run-dir={spod.run_dir}",
                       "--recover", cmd, "--poll-interval=0.2", "--timeout=60")
    assert code == 0, err
    assert "done: the completion marker is there" in err and "start:" not in err, err
    assert spod.health()["workers"][0]["run_id"] == first  # the finished job was not started again


@pytest.mark.timeout(60)
def test_check_devices_joins_every_worker_into_one_job(spod):
    spod.config.coordinator_port = _free_port()
    assert spod.check_devices() == {"backend": "cpu", "device_count": 8, "process_count": 2}  # v4-16: 2 x 4 chips


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_launcher_tests_pass_when_run_from_a_virtual_environment(tmp_path):
    """As most users run the suite: from a venv whose own site-packages hold the dependencies (here a
    .pth naming this interpreter's), where the base interpreter has none of them. The rehearsal's
    workers must see the venv's packages: a pod is created, set up, and joins one JAX job."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    inner = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                           text=True, check=True, timeout=60).stdout.strip()
    pathlib.Path(inner, "_deps.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                        for d in site.getsitepackages()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=REPO)
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "tests/test_launcher.py", "-k", "test_check_devices_joins_every_worker_into_one_job"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_leftover_holding_the_tpu_is_killed_before_a_run(spod):
    # A leftover (an old probe) on worker 1 holds the TPU's device file open, in a session of its own.
    spod._ssh('if [ "$FLAXCHAT_WORKER_ID" = 1 ]; then setsid python3 -c "import time; f = open(\'_dev/accel0\'); '
              'time.sleep(300)" > /dev/null 2>&1 < /dev/null & echo $! > leftover.pid; fi', worker="all")
    pid = int(until(lambda: open(os.path.join(worker_home(1, "shared"), "leftover.pid")).read().strip() or None))
    until(lambda: any(os.path.realpath(f"/proc/{pid}/fd/{fd}").endswith("accel0")
                      for fd in os.listdir(f"/proc/{pid}/fd")), what="the leftover to open the device")
    spod.run("echo ok")
    until(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
          what="the leftover to be killed")
    log = open(os.path.join(worker_home(1, "shared"), ".flaxchat", "run", "output.log")).read()
    assert f"killed 1 leftover process(es) that held the TPU: [{pid}]" in log


@pytest.mark.timeout(60)
def test_command_that_exits_at_once_and_unreachable_worker(spod, capsys):
    spod.config.startup_check_s = 1.0
    with pytest.raises(Exception, match=r"exited at once on worker \d with code 2: .*no-such-flag"):
        spod.run("python3 -c 'import sys; print(\"unknown flag --no-such-flag\"); sys.exit(2)'")
    emulator.set_unreachable("shared", Z, P, 1)
    try:
        code, out, _ = cli(capsys, f"--project={P}", "--tpu-name=shared", f"--zone={Z}", "--health")
        assert code == 1 and "problem: worker 1 does not answer ssh" in out
    finally:
        emulator.set_unreachable("shared", Z, P, 1, on=False)
    assert spod.describe()["state"] == "READY"  # nothing deleted


# --- recovery ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_recover_brings_back_a_preempted_pod(pod):
    lc = ready(pod)
    run_dir = "gs://bk/run"
    cmd = standin(run_dir, steps=24, sleep=0.1, **{"save-every": 4})
    lc.run(cmd, run_dir=run_dir)
    ckpt = bucket(run_dir + "/checkpoints")
    until(lambda: os.path.exists(os.path.join(ckpt, "8", "commit_success.txt")), what="a checkpoint at step 8")
    emulator.preempt(NAME, Z, P)
    assert not os.path.exists(worker_home(0)) or emulator.load_node(P, Z, NAME)["state"] == "PREEMPTED"
    logs = []
    lc.say = logs.append
    policy = rec.Policy(poll_s=0.2, backoff_s=0.1, max_restarts=3)
    result = lc.recover(cmd, run_dir=run_dir, local_repo_path=str(pod / "repo"), policy=policy, timeout=90)
    text = "\n".join(logs)
    assert result.ok, text
    assert "recreate: the VM is PREEMPTED" in text and "done: the completion marker is there" in text
    assert "installing on 2 worker(s)" in text  # the new VM's disk is new: setup ran again
    complete = json.load(open(bucket(run_dir + "/COMPLETE")))
    assert complete["step"] == 24
    w = 1.0  # the same arithmetic without interruption: resuming from the checkpoint lost nothing
    for s in range(1, 25):
        w = w * 0.9 + 0.01 * s
    assert complete["w"] == pytest.approx(w, rel=1e-12)
    out = []
    lc.logs(lines=400, on_line=out.append)
    assert any(line.startswith("resumed from step") and int(line.split()[-1]) >= 8 for line in out)


@pytest.mark.timeout(150)
def test_a_recreated_pod_takes_its_environment_from_the_bucket_and_goodput_counts_the_loss(pod, capsys):
    """Setup packs the workers' environment into the run folder (keyed by pyproject's pins, the install
    and the Python); after a preemption the new VM unpacks it instead of running the install, and the
    stage's compile cache is beside the run. --recover ends with goodput and cost from the ledger,
    and --health prints the same."""
    run_dir = "gs://bk/env-run"
    lc = launcher(pod, install_command=TEST_INSTALL + ' && touch "$HOME/installed-here"')
    lc.create()
    logs = []
    lc.say = logs.append
    lc.setup(str(pod / "repo"), gcs=True, run_dir=run_dir)
    packs = os.listdir(bucket(run_dir + "/.flaxchat/env"))
    assert len(packs) == 1 and packs[0].endswith(".tar.gz"), packs
    assert any(x.startswith("packed the environment into gs://bk/env-run/.flaxchat/env/") for x in logs), logs
    cmd = standin(run_dir, steps=24, sleep=0.3, **{"save-every": 8})
    lc.run(cmd, run_dir=run_dir)
    progress = os.path.join(worker_home(0), ".flaxchat", "run", "progress.json")
    until(lambda: os.path.exists(progress) and json.load(open(progress))["step"] >= 11, what="step 11")
    lc.health()  # a poll before the preemption, a second before the next save: the ledger sees step 11+
    emulator.preempt(NAME, Z, P)
    logs.clear()
    result = lc.recover(cmd, run_dir=run_dir, local_repo_path=str(pod / "repo"), timeout=90,
                        policy=rec.Policy(poll_s=0.2, backoff_s=0.1, max_restarts=3))
    text = "\n".join(logs)
    assert result.ok and "recreate: the VM is PREEMPTED" in text, text
    assert f"the environment came from gs://bk/env-run/.flaxchat/env/{packs[0]}" in text, text
    for w in range(2):  # the recreated workers never ran the install
        assert os.path.isdir(os.path.join(worker_home(w), ".flaxchat", "venv"))
        assert not os.path.exists(os.path.join(worker_home(w), "installed-here"))
    env = json.load(open(bucket(run_dir + "/env-0.json")))
    assert env["FLAXCHAT_CACHE_DIR"] == "gs://bk/env-run/xla-cache"
    good = [x for x in logs if x.startswith("goodput:")]
    assert good and "2 run(s), 1 restart(s)" in good[-1], text
    m = re.search(r"steps trained again after restarts \d+% \([\d.]+ s, (\d+) steps\)", text)
    assert m and 3 <= int(m.group(1)) <= 15, text  # resumed from step 8 after reaching 11 or more
    assert "cost: about $" in text and "v4-16 on-demand at $3.22 per chip-hour, list price as of 2022-08-11" in text
    code, out, _ = cli(capsys, f"--project={P}", "--health", "--price-per-chip-hour=2")
    assert "goodput:" in out and "chip-hours (8 chips x" in out and "given with --price-per-chip-hour" in out, out


def _recover_once(spod, shared_pod, event: str, *, steps: int, save_every: int, **policy):
    """Recovery of a stand-in run that does `event` (crash, preempt, stall) once: (result, its log lines)."""
    cmd = standin(spod.run_dir, steps=steps, sleep=0.05, **{"save-every": save_every, f"{event}-once": shared_pod / event})
    logs = []
    spod.say = logs.append
    result = spod.recover(cmd, run_dir=spod.run_dir, local_repo_path=str(shared_pod / "repo"),
                          policy=rec.Policy(**policy), timeout=90)
    return result, logs


@pytest.mark.timeout(120)
def test_recover_restarts_a_crash_with_backoff(spod, shared_pod):
    result, logs = _recover_once(spod, shared_pod, "crash", steps=10, save_every=2, poll_s=0.2, backoff_s=0.1)
    text = "\n".join(logs)
    assert result.ok, text
    assert "start: the command is not running" in text and "restart: worker 0 exited 7" in text, text
    assert "recreate" not in text


@pytest.mark.timeout(120)
def test_recover_resumes_a_preemption_without_counting_it_as_a_failure(spod, shared_pod):
    result, logs = _recover_once(spod, shared_pod, "preempt", steps=8, save_every=3, poll_s=0.2, backoff_s=30,
                                 max_restarts=1)
    text = "\n".join(logs)
    assert result.ok and "restart 1 of" not in text, text  # no crash budget spent, no 30 s backoff
    assert "exited 75 (preempted, its step saved): resume now, not counted against --max-restarts" in text, text


@pytest.mark.timeout(120)
def test_recover_writes_a_stalled_runs_stacks_before_it_restarts_it(spod, shared_pod):
    result, logs = _recover_once(spod, shared_pod, "stall", steps=8, save_every=3, poll_s=0.5, backoff_s=0.1,
                                 heartbeat_deadline_s=4)
    text = "\n".join(logs)
    assert result.ok, text
    said = [x for x in logs if "hung in the step after 3: its Python stacks are in" in x]
    assert len(said) == 2, text  # both workers, before the one restart
    assert text.index("hung in the step after 3") < text.index("done:")
    for w in range(2):
        run_state = os.path.join(worker_home(w, "shared"), ".flaxchat", "run")
        hang = sorted(f for f in os.listdir(run_state) if f.startswith("hang-"))
        assert hang and "in stalled_collective" in open(os.path.join(run_state, hang[-1])).read()


class FakeTime:
    """The recovery's clock and sleep: each sleep moves simulated time on by its length, and lets a
    little real time pass so the processes on the workers get on with it."""

    def __init__(self, real_per_sleep=0.2):
        self.now, self.real = 1_000_000.0, real_per_sleep
        self.on_sleep = None

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        time.sleep(self.real)
        if self.on_sleep:
            self.on_sleep(self)


@pytest.mark.timeout(150)
def test_recover_keeps_a_healthy_pod_for_hours_where_only_process_0_prints_then_restarts_one_hang(spod, shared_pod):
    """The seed's heartbeat was "time since the last printed line": worker 1 prints nothing, so a
    healthy pod was restarted every 30 minutes. Now liveness is the step in each process's progress
    file: 2+ simulated hours healthy, no restart; then worker 1 hangs (SIGSTOP): exactly one restart."""
    stop = shared_pod / "stop-hours-test"
    cmd = standin(spod.run_dir, steps=100_000, sleep=0.02, **{"save-every": 20, "stop-file": stop})
    logs = []
    spod.say = logs.append
    fake = FakeTime()
    state = {"hung": None}

    def on_sleep(t):
        if t.now - 1_000_000.0 >= 2.25 * 3600 and state["hung"] is None:
            state["restarts_before"] = sum("restart:" in x for x in logs)
            run = json.load(open(os.path.join(worker_home(1, "shared"), ".flaxchat", "run", "run.json")))
            os.kill(run["child_pid"], signal.SIGSTOP)  # alive, never steps again
            state["hung"] = t.now
        if state["hung"] and t.now - state["hung"] > 3 * 3600:  # 2 more healthy hours after the restart
            stop.touch()
    fake.on_sleep = on_sleep
    # 6 polls without a step: wide enough for a (re)started process to take its first one on a busy machine
    policy = rec.Policy(poll_s=600.0, backoff_s=1.0, heartbeat_deadline_s=3600.0)
    result = spod.recover(cmd, run_dir=spod.run_dir, local_repo_path=str(shared_pod / "repo"), policy=policy,
                          clock=fake.clock,
                          sleep=fake.sleep, timeout=24 * 3600)
    text = "\n".join(logs)
    assert result.ok, text
    assert state["hung"] is not None, "the run ended before 2 simulated hours:\n" + text
    assert state["restarts_before"] == 0, text
    restarts = [x for x in logs if "restart:" in x]
    assert len(restarts) == 1 and "worker(s) [1] alive but no training step for over 3600 s (hung)" in restarts[0]
    assert "recreate" not in text
    w1_log = open(os.path.join(worker_home(1, "shared"), ".flaxchat", "run", "output.log")).read()
    assert "tok/s 1,234" not in w1_log  # worker 1 never printed a progress line (the stand-in's format)


@pytest.mark.timeout(90)
def test_ssh_failing_for_5_polls_on_a_ready_pod_never_deletes_it(spod, shared_pod):
    recorded, logs = [], []
    spod.ex.record = recorded.append
    spod.say = logs.append
    emulator.fail_next("tpu-vm.ssh", "[/usr/bin/ssh] exited with return code [255].", code=255, times=5)
    fake = FakeTime(real_per_sleep=0.0)
    cmd = standin(spod.run_dir, steps=4, sleep=0.05, **{"save-every": 2})
    result = spod.recover(cmd, run_dir=spod.run_dir, local_repo_path=str(shared_pod / "repo"), clock=fake.clock,
                          sleep=fake.sleep, policy=rec.Policy(poll_s=1.0, backoff_s=0.1), timeout=3600)
    text = "\n".join(logs)
    assert result.ok, text
    assert not any(" delete " in c for c in recorded) and "recreate" not in text
    waits = [x for x in logs if "wait: ssh to worker(s) [0, 1] failed" in x]
    assert len(waits) >= 4 and "a READY VM is never deleted for ssh trouble" in waits[0], text
    assert "(5 poll(s) in a row)" in text or "(4 poll(s) in a row)" in text


# --- bad input: one clear sentence, a non-zero exit, nothing deleted ------------------------------------------


@pytest.mark.timeout(60)
def test_bad_input_gets_one_sentence_and_nonzero_exit(shared_env, capsys, monkeypatch):
    base = ["--project=other", f"--zone={Z}", "--tpu-name=x"]
    cases = [
        (base + ["--accelerator=v5lite-8", "--create"], "unknown TPU accelerator type 'v5lite-8'; did you mean "
                                                        "v5litepod-8? the families are v4-8 to v4-4096, "),
        (["--project=other", "--run", "echo"], "no TPU VM is remembered for project other; create one first"),
        (base + ["--accelerator=v5p-8", "--create"], "v5p-8' is not available in zone 'us-central2-b'"),
        (base + ["--run", "echo"], "TPU VM x does not exist in us-central2-b (project other); create it first"),
        (["--project=other", "--env", "NOEQUALS", "--create"], "--env 'NOEQUALS' is not KEY=VALUE"),
        (["--project=other", "--secret", "FLAXCHAT_UNSET_SECRET", "--create"], "is not set in this environment"),
    ]
    for argv, message in cases:
        code, _, err = cli(capsys, *argv)
        assert code != 0 and message in err, err
        assert err.count("error:") == 1
    with pytest.raises(SystemExit) as exit:  # argparse's own refusal: usage, then one error line
        cli(capsys, *base, "--create", "--preemptible", "--spot")
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("error:") == 1
    assert "argument --spot: not allowed with argument --preemptible" in err
    monkeypatch.setenv("FLAXCHAT_LAUNCHER_STATE", str(shared_env / "none.json"))
    code, _, err = cli(capsys, "--run", "echo")
    assert code != 0 and "no --project given and no TPU VM remembered" in err


@pytest.mark.timeout(60)
def test_gcloud_errors_are_shown_in_one_line(shared_env, capsys):
    emulator.fail_next("describe", "PERMISSION_DENIED: Permission 'tpu.nodes.get' denied on 'projects/other'.")
    code, _, err = cli(capsys, "--project=other", f"--zone={Z}", "--tpu-name=q", "--health")
    assert code != 0 and "PERMISSION_DENIED" in err and err.strip().count("\n") <= 1


def test_missing_gcloud_says_how_to_install(shared_env, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(shared_env / "empty"))
    code, _, err = cli(capsys, "--project=other", "--tpu-name=y", "--create")
    assert code != 0 and "install the Google Cloud SDK" in err


@pytest.mark.timeout(60)
def test_run_or_health_before_setup_says_so(shared_env, capsys):
    launcher(shared_env, name="bare", accel="v4-8").create()
    for action in (["--health"], ["--run", "echo hi"]):
        code, _, err = cli(capsys, f"--project={P}", "--tpu-name=bare", f"--zone={Z}", *action)
        assert code != 0 and "flaxchat is not set up on TPU VM bare; run --setup --upload=. first." in err


def test_dry_run_prints_the_commands_and_changes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLAXCHAT_LAUNCHER_STATE", str(tmp_path / "launcher.json"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-gcloud-here"))  # nothing may run
    code, out, err = cli(capsys, f"--project={P}", f"--zone={Z}", f"--tpu-name={NAME}", "--accelerator=v4-32",
                         "--create", "--setup", f"--upload={REPO}", "--run",
                         "python -m scripts.pretrain", "--run-dir=gs://b/d", "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"gcloud compute tpus tpu-vm describe {NAME} --project={P} --zone={Z} --format=json"
    assert (f"gcloud compute tpus tpu-vm create {NAME} --project={P} --zone={Z} --accelerator-type=v4-32 "
            "--version=tpu-ubuntu2204-base") in lines
    assert any(" scp " in x and "--worker=all" in x for x in lines)
    assert any("worker.py start" in x and "scripts.pretrain --run-dir=gs://b/d" in x and "--venv .flaxchat/venv" in x
               and "--marker gs://b/d/COMPLETE" in x for x in lines)  # the stage is told its folder, and waited on
    assert '"$UV" venv --python 3.11' in out and ".[tpu,gcs,hub]" in out  # gs:// run folder: gcsfs too; hf: data
    assert not os.path.exists(tmp_path / "launcher.json")
    code, out, err = cli(capsys, f"--project={P}", "--zone=us-east5-b", "--tpu-name=s", "--accelerator=v5litepod-16",
                         "--spot", "--create", "--dry-run")  # the queued resource is polled, as if ACTIVE
    assert code == 0 and "queued resource s-qr: ACTIVE" in err and "queued-resources create s-qr" in out


def test_the_run_folder_is_told_to_the_stage_and_never_read_out_of_the_command():
    from flaxchat.cloud.launcher import marker_of, with_run_dir
    assert with_run_dir("python -m scripts.sft --base gs://b/d24", "gs://b/d24 sft") == \
        "python -m scripts.sft --base gs://b/d24 --run-dir='gs://b/d24 sft'"
    assert with_run_dir("python -m scripts.pretrain --run-dir=runs/x", None) == "python -m scripts.pretrain --run-dir=runs/x"
    # The marker of every stage is the run folder's own (flaxchat.paths.RunFolder), pretraining or not.
    assert marker_of("gs://b/d24-sft/") == "gs://b/d24-sft/COMPLETE" and marker_of("runs/rl") == "runs/rl/COMPLETE"
    assert marker_of(None) is None


def test_help_lists_every_action(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--create", "--setup", "--upload", "--run", "--logs", "--health", "--recover", "--teardown",
                 "--dry-run", "--backend", "--all-workers", "--secret", "--zones", "--install",
                 "--allow-local-checkpoints", "--capacity-retry-hours"):
        assert flag in out


def test_launcher_imports_no_jax_and_never_asks_for_the_emulator():
    code = ("import sys; from flaxchat.cloud import TPULauncher, TPUConfig; import flaxchat.cloud.launcher; "
            "assert 'jax' not in sys.modules and 'flaxchat.cloud.rehearsal.emulator' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    for name in ("launcher.py", "cli.py", "gcloud.py", "recovery.py", "topology.py", "../runner/worker.py"):
        src = open(os.path.join(REPO, "flaxchat", "cloud", name)).read()
        assert "flaxchat-emulator" not in src and "is_local" not in src, name
    import ast  # the emulator is named in one function only: the one place the backend is chosen
    tree = ast.parse(open(os.path.join(REPO, "flaxchat", "cloud", "launcher.py")).read())
    users = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
             for node in ast.walk(fn) if isinstance(node, ast.Name) and node.id == "emulator"}
    assert users == {"executor_for"}


# --- the pod rehearsal, end to end, with the real training ------------------------------------------------


def _pretrain(run_dir):
    from tests.test_multihost import TINY  # the same model and schedule: the compiled step is cached once
    # No stories at the end: test_multihost samples across processes; here they would only add a compile.
    return f"python -m scripts.pretrain --run-dir={run_dir} {' '.join(TINY)} --num-samples=0"


def _worker_logs(name=NAME) -> str:
    """The tail of every worker's output.log (what a failed rehearsal shows)."""
    out = []
    for w in range(2):
        path = os.path.join(worker_home(w, name), ".flaxchat", "run", "output.log")
        out.append(f"--- worker {w}:\n" + ("".join(open(path).readlines()[-25:]) if os.path.exists(path) else "(no log)"))
    return "\n".join(out)


def _committed(ckpt_dir):
    """Steps Orbax finished in the bucket (commit_success.txt, as on GCS)."""
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    return sorted(int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(ckpt_dir, n, "commit_success.txt")))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pod_rehearsal_preempted_mid_training_resumes_from_the_bucket_to_the_same_parameters(pod):
    """A 2-worker pod whose workers have Python 3.10: create, set up (a venv each), run scripts.pretrain
    on both with a gs:// run folder, preempt mid-training (SIGKILL everywhere, VM PREEMPTED, its disk
    gone with the recreate) with a save cut off in the bucket, recover, resume from the last complete
    step (not 0, not the cut one), finish: the final parameters equal an uninterrupted run's."""
    from tests.test_multihost import STEPS as steps
    from support import cache_env, coordinator_env, finish, free_port, start
    from tests.test_multihost import compare_params

    # The uninterrupted reference: the same 2 processes x 1 device, started directly (and first, so that
    # the pod's runs find the train step compiled in the on-disk cache).
    ref_dir, port = pod / "reference", free_port()
    refs = [start(_pretrain(ref_dir).split()[1:], 1, coordinator_env(port, 2, i)) for i in range(2)]
    for proc in refs:
        finish(proc, 300)

    run_dir = "gs://bk/pod-run"
    lc = launcher(pod, coordinator_port=free_port())
    lc.create()
    lc.setup(REPO, gcs=True)  # the real repo: git ls-files of this checkout
    assert lc._ssh("python3 --version", worker=0).stdout.strip() == "Python 3.10.12"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", **cache_env()}  # 2 workers x 1 CPU device
    cmd = _pretrain(run_dir)
    lc.run(cmd, env=env, run_dir=run_dir)
    health = lc.health()  # while it starts (and compiles): both workers are there and alive
    assert [w["worker"] for w in health["workers"]] == [0, 1] and all(w["alive"] for w in health["workers"]), health
    ckpt = bucket(run_dir + "/checkpoints")
    try:
        until(lambda: _committed(ckpt), timeout=300, what="the first checkpoint in the bucket")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_worker_logs()}") from None
    emulator.preempt(NAME, Z, P)
    last = max(_committed(ckpt))
    assert not os.path.exists(bucket(run_dir + "/COMPLETE")) and last < steps, "training ended before the preemption"
    # The save after it, cut off by the preemption as Orbax on GCS leaves one: the step under its final
    # name, some of its files, no commit_success.txt.
    cut = os.path.join(ckpt, str(last + 10))
    if not os.path.exists(cut):
        shutil.copytree(os.path.join(ckpt, str(last)), cut)
        for d, _, files in os.walk(cut):
            for f in files:
                if f == "commit_success.txt" or f == "_CHECKPOINT_METADATA":
                    os.remove(os.path.join(d, f))
    assert _committed(ckpt) == [s for s in _committed(ckpt) if s <= last]
    logs = []
    lc.say = logs.append
    result = lc.recover(cmd, run_dir=run_dir, env=env, local_repo_path=REPO, timeout=300,
                        policy=rec.Policy(poll_s=3.0, backoff_s=1.0, heartbeat_deadline_s=240))
    text = "\n".join(logs)
    assert result.ok, text
    assert "recreate: the VM is PREEMPTED" in text and "installing on 2 worker(s)" in text
    lines = []
    lc.logs(all_workers=True, lines=400, on_line=lines.append)
    resumed = [x for x in lines if x.startswith("[w0] resumed from step")]
    assert resumed and resumed[0].split()[4] == str(last), lines[-40:]  # the last complete step, not the cut one
    assert not any(x.startswith("[w1] resumed") for x in lines)  # only process 0 prints
    assert json.load(open(bucket(run_dir + "/COMPLETE")))["step"] == steps
    assert _committed(ckpt)[-1] == steps
    # --num-samples=0: no stories, so no samples.txt and no empty Samples section in the report
    assert not os.path.exists(bucket(run_dir + "/samples.txt"))
    assert "## Samples" not in open(bucket(run_dir + "/report.md")).read()
    print(compare_params(ref_dir, bucket(run_dir), 2))  # rtol 1e-6 on every array

"""TPULauncher and its CLI against the gcloud emulator (first on PATH; the real gcloud is never run).

A stand-in training script (written into a tiny repo that the tests upload) prints nanochat-style
step lines, writes Orbax-like checkpoints (a temp folder renamed when complete), resumes from the
latest one and writes COMPLETE on process 0: enough to drive run/health/wait/recover without JAX.
The slow test at the end rehearses the real thing with scripts.pretrain on a 2-worker pod.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from flaxchat.cloud import emulator
from flaxchat.cloud import gcloud as g
from flaxchat.cloud import recovery as rec
from flaxchat.cloud.launcher import TPUConfig, TPULauncher, main
from flaxchat.errors import cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, Z, NAME = "proj", "us-central2-b", "pod"

STANDIN = r'''
import json, os, sys, time
args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
run_dir, steps, every = args["run-dir"], int(args["steps"]), int(args.get("save-every", 5))
pid = int(os.environ.get("JAX_PROCESS_ID", "0"))
ckpt = os.path.join(run_dir, "checkpoints")
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(run_dir, f"env-{pid}.json"), "w") as f:
    json.dump(dict(os.environ), f)
print("secret seen:", os.environ.get("SECRET_TOKEN", "-"), flush=True)
done = [int(d) for d in os.listdir(ckpt) if d.isdigit()]
step, w = (max(done), json.load(open(os.path.join(ckpt, str(max(done)), "w.json")))) if done else (0, 1.0)
if step:
    print(f"resumed from step {step}", flush=True)
crash = args.get("crash-once")
first = bool(crash) and pid == 0 and not os.path.exists(crash)  # worker 0 crashes in its first run only
while step < steps:
    step += 1
    w = w * 0.9 + 0.01 * step
    print(f"step {step:05d}/{steps:05d} | loss {w:.4f} | lr x1.00 | tok/s 1,234 | mfu 1.0% | eta 0m01s", flush=True)
    if first and step == 3:
        open(crash, "w").close()
        sys.exit(7)
    if pid == 0 and step % every == 0:
        tmp = os.path.join(ckpt, f"{step}.orbax-checkpoint-tmp-1")
        os.makedirs(tmp, exist_ok=True)
        json.dump(w, open(os.path.join(tmp, "w.json"), "w"))
        open(os.path.join(tmp, "_CHECKPOINT_METADATA"), "w").close()
        os.rename(tmp, os.path.join(ckpt, str(step)))
    time.sleep(float(args.get("sleep", "0")))
if pid == 0:
    json.dump({"step": step, "w": w}, open(os.path.join(run_dir, "COMPLETE"), "w"))
'''


def _make_env(base, mp):
    """The emulator first on PATH, HOME and every state file under base, a tiny repo to upload."""
    mp.setenv("HOME", str(base / "home"))
    mp.setenv(emulator.STATE_ENV, str(base / "emu"))
    mp.setenv(emulator.DELAY_ENV, "0")
    mp.setenv("FLAXCHAT_LAUNCHER_STATE", str(base / "launcher.json"))
    shim = emulator.install_shim(str(base / "bin"))
    mp.setenv("PATH", os.path.dirname(shim) + os.pathsep + os.environ["PATH"])
    repo = base / "repo"
    if not repo.exists():
        shutil.copytree(os.path.join(REPO, "flaxchat"), repo / "flaxchat",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (repo / "standin.py").write_text(STANDIN)
        (repo / ".gitignore").write_text("ignored.txt\n")
        (repo / "ignored.txt").write_text("do not upload")
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        (base / "bucket").mkdir()  # shared storage, standing in for gs://
    return base


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
    """The shared VM, with this test's own run folder; whatever a test left running is stopped after it."""
    for k, v in [("HOME", shared_pod / "home"), (emulator.STATE_ENV, shared_pod / "emu"),
                 ("FLAXCHAT_LAUNCHER_STATE", shared_pod / "launcher.json")]:
        assert os.environ[k] == str(v)
    lc = launcher(shared_pod, name="shared")
    lc.run_dir = shared_pod / "bucket" / request.node.name
    yield lc
    lc.stop()


def launcher(base, name=NAME, accel="v4-16", recorded=None, **kw) -> TPULauncher:
    config = TPUConfig(project=P, zone=kw.pop("zone", Z), tpu_name=name, accelerator_type=accel,
                       startup_check_s=kw.pop("startup_check_s", 0.0), poll_s=0.1, **kw)
    return TPULauncher(config, executor=g.GcloudExecutor(record=recorded.append if recorded is not None else None),
                       out=lambda s: None)


def ready(base, **kw) -> TPULauncher:
    lc = launcher(base, **kw)
    lc.create()
    lc.setup(str(base / "repo"))
    return lc


def standin(run_dir, steps=6, **extra) -> str:
    args = " ".join(f"--{k}={v}" for k, v in {"run-dir": run_dir, "steps": steps, **extra}.items())
    return f"python3 standin.py {args}"


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


# --- create / setup / teardown -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cli_create_setup_upload_then_later_calls_name_only_the_project(pod, capsys):
    repo = str(pod / "repo")
    code, _, err = cli(capsys, f"--project={P}", f"--zone={Z}", f"--tpu-name={NAME}", "--accelerator=v4-16",
                       "--create", "--setup", f"--upload={repo}")
    assert code == 0, err
    assert f"acting on TPU VM '{NAME}' (v4-16, zone {Z}, project {P}; from the command line)" in err
    assert "READY with 2 worker(s)" in err
    for w in (0, 1):
        home = worker_home(w)
        assert os.path.exists(os.path.join(home, "flaxchat", "standin.py"))
        assert os.path.exists(os.path.join(home, "flaxchat", "flaxchat", "cloud", "worker.py"))
        assert not os.path.exists(os.path.join(home, "flaxchat", "ignored.txt"))  # .gitignore honoured
    code, _, err = cli(capsys, f"--project={P}", "--setup", f"--upload={repo}")
    assert code == 0 and "remembered in" in err and "up to date on all 2 worker(s)" in err
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


@pytest.mark.timeout(60)
def test_spot_uses_a_queued_resource_and_teardown_deletes_it(shared_env):
    recorded = []
    lc = launcher(shared_env, name="spotty", accel="v5litepod-16", zone="us-east5-b", spot=True, recorded=recorded)
    node = lc.create()
    assert len(node["networkEndpoints"]) == 4 and node["schedulingConfig"] == {"spot": True}
    assert any("queued-resources create spotty-qr" in c for c in recorded)
    lc.teardown()
    assert any("queued-resources delete spotty-qr" in c and "--force" in c for c in recorded)
    assert lc.describe() is None


# --- run / health / logs / wait (on the shared VM) ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_run_gives_every_worker_the_same_env_and_never_leaks_a_secret(spod, shared_pod):
    recorded = []
    spod.ex.record = recorded.append
    spod.config.coordinator_port = 12345
    secret = "tok-9f8e7d6c5b4a"
    spod.run(standin(spod.run_dir, steps=10, sleep=0.1), env={"MY_FLAG": "on"}, secrets={"SECRET_TOKEN": secret})
    until(lambda: all((spod.run_dir / f"env-{i}.json").exists() for i in (0, 1)), what="both workers")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "standin.py" in ps and secret not in ps
    for i in (0, 1):
        env = json.load(open(spod.run_dir / f"env-{i}.json"))
        assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:12345"
        assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_PROCESS_ID"] == str(i)
        assert env["MY_FLAG"] == "on" and env["SECRET_TOKEN"] == secret  # the command does get it
    assert spod.wait(timeout=60).ok
    lines = []
    spod.logs(all_workers=True, lines=100, on_line=lines.append)
    assert "[w0] secret seen: ***" in lines and "[w1] secret seen: ***" in lines
    logs = [open(os.path.join(d, f)).read() for d, _, fs in os.walk(shared_pod / "emu") for f in fs
            if f.endswith(".log")]
    assert len(logs) == 2 and all("secret seen: ***" in t and secret not in t for t in logs)
    assert recorded and not any(secret in c for c in recorded)
    env_file = os.path.join(worker_home(1, "shared"), g.REMOTE_ENV_FILE)
    assert oct(os.stat(env_file).st_mode & 0o777) == "0o600"


@pytest.mark.timeout(90)
def test_health_shows_a_crash_on_worker_1_while_worker_0_runs(spod, capsys):
    spod.run('if [ "$JAX_PROCESS_ID" = 1 ]; then echo "step 00002/00100 | loss 4.0000 | tok/s 999"; '
             'echo "Traceback: boom"; exit 1; fi; echo "step 00002/00100 | loss 3.5000 | tok/s 1,500"; sleep 30')
    until(lambda: spod.health()["workers"][1].get("state") == "exited", what="worker 1 to crash")
    report = spod.health()
    w0, w1 = report["workers"]
    assert (w0["state"], w0["alive"], w0["step"], w0["loss"], w0["tok_s"]) == ("running", True, 2, 3.5, 1500.0)
    assert (w1["state"], w1["exit_code"], w1["last_line"]) == ("exited", 1, "Traceback: boom")
    assert w0["heartbeat_age"] < 30 and w0["disk_used_pct"] > 0
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
    spod.run(standin(spod.run_dir, steps=4, **{"save-every": 2}))
    result = spod.wait(timeout=60)
    assert result.ok and result.state == "done" and result.exit_codes == {0: 0, 1: 0}
    # download_checkpoint: the latest complete step, never a save cut short by a preemption.
    (spod.run_dir / "checkpoints" / "6.orbax-checkpoint-tmp-99").mkdir()
    local = spod.run_dir.parent / "local"
    path = spod.download_checkpoint(str(local))
    assert path == str(local / "4") and os.path.exists(os.path.join(path, "w.json"))
    assert not (local / "6.orbax-checkpoint-tmp-99").exists()
    # Exit 0 everywhere and a log that claims success, but no COMPLETE marker: not done.
    spod.run(f"echo 'training complete, step 00004/00004 | loss 1.0'; true --run-dir={spod.run_dir}-other")
    result = spod.wait(timeout=60)
    assert not result.ok and "completion marker is missing" in result.error_value


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
    assert any(x.startswith("[w1] step") for x in out.splitlines())


@pytest.mark.timeout(60)
def test_check_devices_joins_every_worker_into_one_job(spod):
    spod.config.coordinator_port = _free_port()
    assert spod.check_devices() == {"backend": "cpu", "device_count": 8, "process_count": 2}  # v4-16: 2 x 4 chips


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
    run_dir = pod / "bucket" / "run"
    cmd = standin(run_dir, steps=24, sleep=0.1, **{"save-every": 4})
    lc.run(cmd)
    ckpt = run_dir / "checkpoints"  # made by the stand-in once it starts: it may not exist yet
    until(lambda: ckpt.is_dir() and any(d.isdigit() and int(d) >= 8 for d in os.listdir(ckpt)),
          what="a checkpoint at step 8")
    emulator.preempt(NAME, Z, P)
    logs = []
    lc.say = logs.append
    policy = rec.Policy(poll_s=0.2, backoff_s=0.1, max_restarts=3)
    result = lc.recover(cmd, local_repo_path=str(pod / "repo"), policy=policy, timeout=90)
    text = "\n".join(logs)
    assert result.ok, text
    assert "recreate: the VM is PREEMPTED" in text and "done: the completion marker is there" in text
    complete = json.load(open(run_dir / "COMPLETE"))
    assert complete["step"] == 24
    w = 1.0  # the same arithmetic without interruption: resuming from the checkpoint lost nothing
    for s in range(1, 25):
        w = w * 0.9 + 0.01 * s
    assert complete["w"] == pytest.approx(w, rel=1e-12)
    out = []
    lc.logs(lines=400, on_line=out.append)
    assert any(line.startswith("resumed from step") for line in out)


@pytest.mark.timeout(120)
def test_recover_restarts_a_crash_with_backoff(spod, shared_pod):
    cmd = standin(spod.run_dir, steps=10, sleep=0.05, **{"save-every": 2, "crash-once": spod.run_dir.parent / "crashed"})
    logs = []
    spod.say = logs.append
    result = spod.recover(cmd, local_repo_path=str(shared_pod / "repo"),
                          policy=rec.Policy(poll_s=0.2, backoff_s=0.1), timeout=90)
    text = "\n".join(logs)
    assert result.ok, text
    assert "start: the command is not running" in text and "restart: worker 0 exited 7" in text, text
    assert "recreate" not in text


# --- bad input: one clear sentence, a non-zero exit, nothing deleted ------------------------------------------


@pytest.mark.timeout(60)
def test_bad_input_gets_one_sentence_and_nonzero_exit(shared_env, capsys, monkeypatch):
    base = ["--project=other", f"--zone={Z}", "--tpu-name=x"]
    cases = [
        (base + ["--accelerator=v4-7", "--create"], "unknown TPU accelerator type 'v4-7'; valid types are: v4-8"),
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
    monkeypatch.setenv("FLAXCHAT_LAUNCHER_STATE", str(shared_env / "none.json"))
    code, _, err = cli(capsys, "--run", "echo")
    assert code != 0 and "no --project given and no TPU VM remembered" in err


@pytest.mark.timeout(60)
def test_gcloud_errors_are_shown_in_one_line(shared_env, capsys):
    emulator.fail_next("create", "RESOURCE_EXHAUSTED: Quota 'TPUV4sPodPerProjectPerZoneForTPUAPI' exhausted. "
                                 "Limit: 32 in zone us-central2-b.")
    code, _, err = cli(capsys, "--project=other", f"--zone={Z}", "--tpu-name=q", "--accelerator=v4-16", "--create")
    assert code != 0
    assert ("error: gcloud said: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota "
            "'TPUV4sPodPerProjectPerZoneForTPUAPI' exhausted. Limit: 32 in zone us-central2-b.") in err
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
                         "--create", "--setup", f"--upload={REPO}", "--run", "python -m scripts.pretrain", "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"gcloud compute tpus tpu-vm describe {NAME} --project={P} --zone={Z} --format=json"
    assert (f"gcloud compute tpus tpu-vm create {NAME} --project={P} --zone={Z} --accelerator-type=v4-32 "
            "--version=tpu-ubuntu2204-base") in lines
    assert any(" scp " in x and "--worker=all" in x for x in lines)
    assert any("worker.py start" in x and "scripts.pretrain" in x for x in lines)
    assert any('pip install -q -e . "jax[tpu]"' in x for x in lines)
    assert not os.path.exists(tmp_path / "launcher.json")


def test_run_dir_is_read_from_the_training_command():
    from flaxchat.cloud.launcher import run_dir_of
    assert run_dir_of("python -m scripts.pretrain --depth=24 --run-dir=gs://b/d24") == "gs://b/d24"
    assert run_dir_of("python -m scripts.pretrain --run-dir /abs/x --depth=2") == "/abs/x"
    assert run_dir_of("python -m scripts.pretrain --depth=24") == "runs/default"  # pretrain's default
    assert run_dir_of("python my_script.py") is None and run_dir_of("echo 'unbalanced") is None


def test_help_lists_every_action(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--create", "--setup", "--upload", "--run", "--logs", "--health", "--recover", "--teardown",
                 "--dry-run", "--backend", "--all-workers", "--secret"):
        assert flag in out


def test_launcher_imports_no_jax():
    code = ("import sys; from flaxchat.cloud import TPULauncher, TPUConfig; import flaxchat.cloud.launcher; "
            "assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- the pod rehearsal, end to end, with the real training ------------------------------------------------


def _pretrain(run_dir):
    from tests.test_multihost import TINY  # the same model and schedule: the compiled step is cached once
    return f"python -m scripts.pretrain --run-dir={run_dir} {' '.join(TINY)}"


def _complete_steps(ckpt_dir):
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    return sorted(int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(ckpt_dir, n, "_CHECKPOINT_METADATA")))


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_pod_rehearsal_preempted_mid_training_recovers_to_the_same_parameters(pod):
    """Create a 2-worker pod, set up, upload, run scripts.pretrain on both workers, preempt it mid-training
    (SIGKILL everywhere, VM PREEMPTED), recover, finish: the final parameters equal an uninterrupted run's."""
    from tests.test_multihost import cache_env, compare_params, coordinator_env, finish, free_port, start

    from tests.test_multihost import STEPS as steps
    # The uninterrupted reference: the same 2 processes x 1 device, started directly (and first, so that
    # the pod's runs find the train step compiled in the on-disk cache).
    ref_dir, port = pod / "reference", free_port()
    refs = [start(_pretrain(ref_dir).split()[1:], 1, coordinator_env(port, 2, i)) for i in range(2)]
    for proc in refs:
        finish(proc, 300)

    run_dir = pod / "bucket" / "pod-run"
    lc = launcher(pod, coordinator_port=free_port())
    lc.create()
    lc.setup(REPO)  # the real repo: git ls-files of this checkout
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", **cache_env()}  # 2 workers x 1 CPU device
    cmd = _pretrain(run_dir)
    lc.run(cmd, env=env)
    health = lc.health()  # while it starts (and compiles): both workers are there and alive
    assert [w["worker"] for w in health["workers"]] == [0, 1] and all(w["alive"] for w in health["workers"]), health
    ckpt = run_dir / "checkpoints"
    until(lambda: _complete_steps(ckpt), timeout=240, what="the first checkpoint")
    seen = _complete_steps(ckpt)
    assert not (run_dir / "COMPLETE").exists() and max(seen) < steps, "training ended before the preemption"
    emulator.preempt(NAME, Z, P)
    logs = []
    lc.say = logs.append
    result = lc.recover(cmd, env=env, local_repo_path=REPO, timeout=300,
                        policy=rec.Policy(poll_s=1.0, backoff_s=1.0, heartbeat_deadline_s=240))
    assert result.ok, "\n".join(logs)
    assert "recreate: the VM is PREEMPTED" in "\n".join(logs)
    lines = []
    lc.logs(all_workers=True, lines=400, on_line=lines.append)
    assert any(x.startswith("[w0] resumed from step") for x in lines), lines[-40:]
    assert any(x.startswith("[w1] ") for x in lines)
    assert json.load(open(run_dir / "COMPLETE"))["step"] == steps
    final = _complete_steps(ckpt)
    assert final[-1] == steps and not [n for n in os.listdir(ckpt) if "tmp" in n]  # nothing half-written left
    assert "OK" in compare_params(run_dir, ref_dir, 2)

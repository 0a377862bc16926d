"""gcloud command builders (checked on their output), the executor (once, against the emulator), and
the emulator's fidelity to the gcloud commands the launcher uses, including the trouble Google makes
(a Python 3.10 image, stockouts, queued resources that fail, gs:// that outlives a deleted VM)."""

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from flaxchat.cloud.rehearsal import emulator
from flaxchat.cloud import gcloud as g
from flaxchat.runner.worker import _pid_alive  # zombie-aware
from flaxchat.errors import UserError

pytestmark = pytest.mark.slow  # an emulated cloud with real processes: CI runs it; `-m "not slow"` skips it


P, Z = "proj", "us-central2-b"


# --- builders ----------------------------------------------------------------------------------


def test_create_describe_delete():
    assert g.tpu_create(P, Z, "t", "v4-8", "tpu-ubuntu2204-base") == [
        "gcloud", "compute", "tpus", "tpu-vm", "create", "t", "--project=proj", "--zone=us-central2-b",
        "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"]
    assert g.tpu_create(P, Z, "t", "v4-8", "v", preemptible=True)[-1] == "--preemptible"
    assert g.tpu_create(P, Z, "t", "v4-8", "v", preemptible=True, spot=True)[-1] == "--spot"
    assert g.tpu_describe(P, Z, "t") == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "t", "--project=proj",
                                         "--zone=us-central2-b", "--format=json"]
    assert g.tpu_delete(P, Z, "t")[-1] == "--quiet"


def test_ssh_and_scp():
    assert g.tpu_ssh(P, Z, "t", "echo hi; ls", "all") == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "t", "--project=proj", "--zone=us-central2-b",
        "--worker=all", "--quiet", "--command=echo hi; ls"]
    assert g.tpu_ssh(P, Z, "t", "x", 3)[-3] == "--worker=3"
    up = g.tpu_scp_to(P, Z, "t", "/tmp/a.tgz", "a.tgz")
    assert up[5:7] == ["/tmp/a.tgz", "t:a.tgz"] and up[-2:] == ["--worker=all", "--quiet"]
    down = g.tpu_scp_from(P, Z, "t", "flaxchat/runs/x/checkpoints/5", "./ckpt", 0, recurse=True)
    assert down[5:7] == ["t:flaxchat/runs/x/checkpoints/5", "./ckpt"]
    assert down[-3:] == ["--worker=0", "--quiet", "--recurse"]


def test_queued_resources():
    assert g.qr_create(P, Z, "t-qr", "t", "v5litepod-16", "v2-alpha-tpuv5-lite") == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "t-qr", "--project=proj", "--zone=us-central2-b",
        "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite", "--node-id=t", "--spot"]
    assert g.qr_delete(P, Z, "t-qr")[-2:] == ["--force", "--quiet"]
    assert g.qr_describe(P, Z, "t-qr")[-1] == "--format=json"


def test_storage_commands_for_gs_run_folders():
    assert g.storage_ls("gs://b/run/checkpoints/") == ["gcloud", "storage", "ls", "gs://b/run/checkpoints/"]
    assert g.storage_cp("gs://b/run/checkpoints/40", "./ck") == [
        "gcloud", "storage", "cp", "--recursive", "gs://b/run/checkpoints/40", "./ck"]


def test_start_command_quotes_the_user_command_as_one_word():
    cmd = """python -m scripts.pretrain --depth=24 --run-dir='gs://b/run 1' && echo "$HOME" """
    words = shlex.split(g.start_command("r1", cmd, "gs://b/run 1/COMPLETE"))
    assert words[words.index("--") + 1] == cmd
    assert words[words.index("--marker") + 1] == "gs://b/run 1/COMPLETE"
    assert "--replace" in words and g.REMOTE_ENV_FILE in words


def test_worker_env_has_coordinator_counts_and_secret_names_only():
    data = g.worker_env("10.0.0.2", 4, {"A": "1"}, {"TOKEN": "s3cret"}, port=1234)
    assert data["env"]["JAX_COORDINATOR_ADDRESS"] == "10.0.0.2:1234"
    assert data["env"]["JAX_NUM_PROCESSES"] == "4" and "JAX_PROCESS_ID" not in data["env"]  # per worker
    assert data["env"]["A"] == "1" and data["env"]["TOKEN"] == "s3cret"
    assert data["secret_keys"] == ["TOKEN"]


def test_no_secret_reaches_any_command_builder():
    built = [g.start_command("r", "python train.py"), g.status_command("m"), g.logs_command(True, 10, True),
             g.probe_command(), g.stop_command(), g.install_command("abc", "pip install -e ."), g.unpack_command()]
    assert not any("s3cret" in b for b in built)


PYPROJECT = """[project]
name = "flaxchat"
requires-python = ">=3.11"
dependencies = ["jax==0.10.2", "flax==0.12.1"]
[project.optional-dependencies]
tpu = ["jax[tpu]==0.10.2"]
[tool.pytest.ini_options]
timeout = 60
"""


def test_the_environments_key_changes_with_the_pins_and_the_install_only():
    key = g.env_key(PYPROJECT, "pip install -e .")
    assert key == g.env_key(PYPROJECT.replace("timeout = 60", "timeout = 90"), "pip install -e .")  # not a pin
    assert key != g.env_key(PYPROJECT.replace("flax==0.12.1", "flax==0.12.2"), "pip install -e .")
    assert key != g.env_key(PYPROJECT.replace('tpu = ["jax[tpu]==0.10.2"]', 'tpu = []'), "pip install -e .")
    assert key != g.env_key(PYPROJECT, "pip install -e .[tpu]")
    url = g.env_pack_url("gs://b/run/", key)
    assert url == f"gs://b/run/.flaxchat/env/{key}"
    script = g.install_command("abc", "pip install -e .", url)
    # Taken from the bucket only when it unpacks and passes the same check; installed otherwise.
    assert f'PACK="{url}-$(uname -sm | tr " " -).tar.gz"' in script
    assert script.index("gcloud storage cp \"$PACK\"") < script.index('if [ -z "$FROM_BUCKET" ]; then (cd flaxchat')
    assert script.rstrip().endswith("echo abc > .flaxchat/setup.done")
    pack = g.pack_env_command(url)  # one worker packs it, unless it is there
    assert f'PACK="{url}-$(uname -sm | tr " " -).tar.gz"' in pack
    upload = 'gcloud storage cp "$HOME/.flaxchat/env.tar.gz" "$PACK"'
    assert pack.index('gcloud storage ls "$PACK"') < pack.index(upload)
    assert "gcloud" not in g.install_command("abc", "pip install -e .")  # no bucket: as before


def test_one_line_keeps_gclouds_own_message():
    err = ("Create request issued\nERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota\n"
           "  'TPUV4sPodPerProjectPerZone' exhausted.\n")
    assert g.one_line(err) == ("gcloud said: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota "
                               "'TPUV4sPodPerProjectPerZone' exhausted.")
    assert len(g.one_line("x" * 1000)) == 400


def test_dry_run_executor_prints_and_runs_nothing(capsys):
    ex = g.DryRunExecutor(answer=lambda argv: "ANSWER")
    assert ex.run(g.tpu_delete(P, Z, "t")).stdout == "ANSWER"
    assert capsys.readouterr().out.strip() == "gcloud compute tpus tpu-vm delete t --project=proj --zone=us-central2-b --quiet"


# --- the executor, once, against the emulator ---------------------------------------------------------


@pytest.fixture
def emu(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(emulator.STATE_ENV, str(tmp_path / "emu"))
    monkeypatch.setenv(emulator.DELAY_ENV, "0")
    shim = emulator.install_shim(str(tmp_path / "bin"))
    monkeypatch.setenv("PATH", os.path.dirname(shim) + os.pathsep + os.environ["PATH"])
    os.makedirs(os.path.join(emulator.buckets_root(), "bk"), exist_ok=True)  # the tests' bucket
    return tmp_path


def gc(*args, check=False):
    return subprocess.run(["gcloud", *args], capture_output=True, text=True, timeout=60, check=check)


@pytest.mark.timeout(60)
def test_executor_runs_records_streams_and_raises_one_line(emu):
    recorded = []
    ex = g.GcloudExecutor(record=recorded.append)
    ex.run(g.tpu_create(P, Z, "t", "v4-16", "tpu-ubuntu2204-base"))
    node = json.loads(ex.run(g.tpu_describe(P, Z, "t")).stdout)
    assert node["state"] == "READY" and len(node["networkEndpoints"]) == 2
    lines = []
    assert ex.stream(g.tpu_ssh(P, Z, "t", "echo w$FLAXCHAT_WORKER_ID", "all"), lines.append) == 0
    assert sorted(lines) == ["w0", "w1"]
    with pytest.raises(g.GcloudError) as e:
        ex.run(g.tpu_describe(P, Z, "nope"))
    assert "NOT_FOUND" in str(e.value) and "\n" not in str(e.value) and g.is_not_found(e.value)
    assert recorded[0].startswith("gcloud compute tpus tpu-vm create t ")
    assert len(recorded) == 4


def test_missing_gcloud_says_how_to_install(tmp_path):
    ex = g.GcloudExecutor(env={"PATH": str(tmp_path)})
    with pytest.raises(UserError, match="install the Google Cloud SDK"):
        ex.run(g.tpu_describe(P, Z, "t"))


# --- emulator fidelity ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_describe_has_googles_json_shape(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-32",
       "--version=tpu-ubuntu2204-base", "--preemptible", check=True)
    node = json.loads(gc("compute", "tpus", "tpu-vm", "describe", "t", "--project", P, "--zone", Z,
                         "--format=json", check=True).stdout)
    assert node["name"] == f"projects/{P}/locations/{Z}/nodes/t"
    assert node["acceleratorType"] == "v4-32" and node["state"] == "READY"
    assert len(node["networkEndpoints"]) == 4
    assert all(set(ep) >= {"ipAddress", "accessConfig"} and isinstance(ep["accessConfig"], dict)
               and "externalIp" in ep["accessConfig"] for ep in node["networkEndpoints"])
    assert node["schedulingConfig"] == {"preemptible": True}


@pytest.mark.timeout(60)
def test_creating_becomes_ready_after_the_delay(emu, monkeypatch):
    # The emulated cloud's clock is set, not slept through: a loaded machine that takes longer than
    # the delay to start the next gcloud must not see READY early (a 0.6 s window failed that way).
    monkeypatch.setenv(emulator.DELAY_ENV, "60")
    monkeypatch.setenv(emulator.CLOCK_ENV, "1000000")
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-8",
       "--version=v", "--async", check=True)
    describe = ["compute", "tpus", "tpu-vm", "describe", "t", f"--project={P}", f"--zone={Z}", "--format=json"]
    monkeypatch.setenv(emulator.CLOCK_ENV, "1000059.9")
    assert json.loads(gc(*describe).stdout)["state"] == "CREATING"
    monkeypatch.setenv(emulator.CLOCK_ENV, "1000060")
    assert json.loads(gc(*describe).stdout)["state"] == "READY"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, code, message", [
    (["describe", "nope"], 1, "(gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource "
                              "'projects/proj/locations/us-central2-b/nodes/nope' was not found"),
    (["create", "t", "--accelerator-type=v4-8"], 2, "argument --version: Must be specified."),
    (["create", "t", "--accelerator-type=v5p-8", "--version=v"], 1, "is not available in zone 'us-central2-b'"),
    (["create", "t", "--accelerator-type=v9-8", "--version=v"], 1, "INVALID_ARGUMENT"),
    (["ssh", "nope", "--command=true"], 1, "NOT_FOUND"),
    (["describe", "t", "--bogus"], 2, "unrecognized arguments: --bogus"),
])
def test_errors_look_like_gclouds(emu, args, code, message):
    proc = gc("compute", "tpus", "tpu-vm", *args, f"--project={P}", f"--zone={Z}")
    assert proc.returncode == code
    assert proc.stderr.startswith("ERROR: (gcloud.compute.tpus.tpu-vm.")
    assert message in proc.stderr


@pytest.mark.timeout(60)
def test_ssh_runs_on_every_worker_in_its_own_home_and_scp_copies(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-16",
       "--version=v", check=True)
    out = gc("compute", "tpus", "tpu-vm", "ssh", "t", f"--project={P}", f"--zone={Z}", "--worker=all",
             "--command=echo $FLAXCHAT_WORKER_ID $HOME $PWD; exit $FLAXCHAT_WORKER_ID")
    assert out.returncode == 1 and "exited with return code [1]" in out.stderr
    rows = sorted(line.split() for line in out.stdout.splitlines())
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(r[1] == r[2] == emulator.worker_dir(P, Z, "t", int(r[0])) for r in rows)
    src = emu / "env.json"
    src.write_text("{}")
    os.chmod(src, 0o600)
    gc("compute", "tpus", "tpu-vm", "scp", str(src), "t:.flaxchat/run.env", f"--project={P}", f"--zone={Z}",
       "--worker=all", check=True)
    for w in (0, 1):
        copied = os.path.join(emulator.worker_dir(P, Z, "t", w), ".flaxchat", "run.env")
        assert oct(os.stat(copied).st_mode & 0o777) == "0o600"
    back = emu / "back"
    gc("compute", "tpus", "tpu-vm", "scp", "t:.flaxchat", str(back), "--recurse", f"--project={P}", f"--zone={Z}",
       "--worker=1", check=True)
    assert (back / "run.env").exists()


@pytest.mark.timeout(60)
def test_preempt_kills_every_worker_process_and_marks_the_vm(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-16",
       "--version=v", check=True)
    # A detached process on each worker, in its own session, as worker.py starts the training.
    gc("compute", "tpus", "tpu-vm", "ssh", "t", f"--project={P}", f"--zone={Z}", "--worker=all",
       "--command=setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $! > pid", check=True)
    pids = [int(open(os.path.join(emulator.worker_dir(P, Z, "t", w), "pid")).read()) for w in (0, 1)]
    time.sleep(0.2)
    assert emulator.preempt("t", Z, P) >= 2
    deadline = time.time() + 5
    while time.time() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_pid_alive(p) for p in pids)
    node = json.loads(gc("compute", "tpus", "tpu-vm", "describe", "t", f"--project={P}", f"--zone={Z}",
                         "--format=json").stdout)
    assert node["state"] == "PREEMPTED"
    ssh = gc("compute", "tpus", "tpu-vm", "ssh", "t", f"--project={P}", f"--zone={Z}", "--command=true")
    assert ssh.returncode == 1 and "PREEMPTED" in ssh.stderr


@pytest.mark.timeout(60)
def test_preempting_a_vm_leaves_a_same_named_vm_of_another_emulated_cloud_alone(emu, monkeypatch):
    # Two test workers run two emulators side by side, each with a VM of the same name: once, deleting
    # one worker's "shared" VM killed the other's running command, which then read as "killed".
    roots = {"a": str(emu / "emu-a"), "b": str(emu / "emu-b")}
    pids = {}
    for cloud, root in roots.items():
        monkeypatch.setenv(emulator.STATE_ENV, root)
        gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-8",
           "--version=v", check=True)
        gc("compute", "tpus", "tpu-vm", "ssh", "t", f"--project={P}", f"--zone={Z}", "--worker=all",
           "--command=setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $! > pid", check=True)
        pids[cloud] = int(open(os.path.join(emulator.worker_dir(P, Z, "t", 0), "pid")).read())
    try:
        monkeypatch.setenv(emulator.STATE_ENV, roots["a"])
        assert emulator.preempt("t", Z, P) >= 1
        deadline = time.time() + 5
        while time.time() < deadline and _pid_alive(pids["a"]):
            time.sleep(0.05)
        assert not _pid_alive(pids["a"]) and _pid_alive(pids["b"])
        gc("compute", "tpus", "tpu-vm", "delete", "t", f"--project={P}", f"--zone={Z}", "--quiet", check=True)
        time.sleep(0.2)
        assert _pid_alive(pids["b"])
        monkeypatch.setenv(emulator.STATE_ENV, roots["b"])
        gc("compute", "tpus", "tpu-vm", "delete", "t", f"--project={P}", f"--zone={Z}", "--quiet", check=True)
        deadline = time.time() + 5
        while time.time() < deadline and _pid_alive(pids["b"]):
            time.sleep(0.05)
        assert not _pid_alive(pids["b"])  # its own delete still kills it
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, 9)
            except OSError:
                pass


@pytest.mark.timeout(60)
def test_queued_resource_spot_lifecycle(emu):
    z = "us-east5-b"
    gc("compute", "tpus", "queued-resources", "create", "t-qr", f"--project={P}", f"--zone={z}",
       "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite", "--node-id=t", "--spot", check=True)
    qr = json.loads(gc("compute", "tpus", "queued-resources", "describe", "t-qr", f"--project={P}", f"--zone={z}",
                       "--format=json", check=True).stdout)
    assert qr["state"]["state"] == "ACTIVE" and qr["tpu"]["nodeSpec"][0]["nodeId"] == "t"
    node = json.loads(gc("compute", "tpus", "tpu-vm", "describe", "t", f"--project={P}", f"--zone={z}",
                         "--format=json", check=True).stdout)
    assert node["schedulingConfig"] == {"spot": True} and len(node["networkEndpoints"]) == 4
    emulator.preempt("t", z, P)
    qr = json.loads(gc("compute", "tpus", "queued-resources", "describe", "t-qr", f"--project={P}", f"--zone={z}",
                       "--format=json").stdout)
    assert qr["state"]["state"] == "SUSPENDED"
    assert gc("compute", "tpus", "queued-resources", "delete", "t-qr", f"--project={P}", f"--zone={z}",
              "--quiet").returncode == 1  # without --force the node blocks it
    gc("compute", "tpus", "queued-resources", "delete", "t-qr", f"--project={P}", f"--zone={z}", "--force",
       "--quiet", check=True)
    assert gc("compute", "tpus", "tpu-vm", "describe", "t", f"--project={P}", f"--zone={z}").returncode == 1


@pytest.mark.timeout(60)
def test_injected_faults_and_unreachable_workers(emu):
    emulator.fail_next("create", "RESOURCE_EXHAUSTED: Quota 'TPUV4sPodPerProjectPerZone' exhausted.")
    proc = gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}",
              "--accelerator-type=v4-16", "--version=v")
    assert proc.returncode == 1 and "RESOURCE_EXHAUSTED" in proc.stderr
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-16",
       "--version=v", check=True)
    emulator.set_unreachable("t", Z, P, 1)
    proc = gc("compute", "tpus", "tpu-vm", "ssh", "t", f"--project={P}", f"--zone={Z}", "--worker=all",
              "--command=echo ok")
    assert proc.returncode == 255 and proc.stdout.strip() == "ok" and "Connection timed out" in proc.stderr


def test_admin_cli_help_and_list(emu):
    out = subprocess.run([sys.executable, "-m", "flaxchat.cloud.rehearsal.emulator", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "preempt" in out.stdout
    out = subprocess.run([sys.executable, "-m", "flaxchat.cloud.rehearsal.emulator", "list"], capture_output=True, text=True)
    assert out.returncode == 0


# --- the unkind parts: what a real pod does to a launcher ----------------------------------------------


def _ssh(cmd, worker="0", name="t", zone=Z):
    return gc("compute", "tpus", "tpu-vm", "ssh", name, f"--project={P}", f"--zone={zone}", f"--worker={worker}",
              f"--command={cmd}")


@pytest.mark.timeout(60)
def test_a_worker_is_a_stock_image_python_310_no_site_packages_cpu_devices(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-16",
       "--version=v", check=True)
    out = _ssh("python3 --version; python3 -m pip install -q -e . ; echo pip=$?; python3 -c 'import jax' 2>&1 "
               "| tail -1; python -V; echo py=$?; echo $JAX_PLATFORMS $XLA_FLAGS; ls _dev")
    assert "Python 3.10.12" in out.stdout and "pip=1" in out.stdout and "py=127" in out.stdout
    assert "ERROR: Package 'flaxchat' requires a different Python: 3.10.12 not in '>=3.11'" in out.stderr
    assert "No module named 'jax'" in out.stdout  # nothing of this machine's site-packages
    assert "cpu --xla_force_host_platform_device_count=4" in out.stdout and "accel0" in out.stdout


@pytest.mark.timeout(60)
def test_stockout_in_googles_words_per_zone_and_a_failed_queued_resource(emu):
    emulator.stockout(Z, times=2)
    create = ["compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", "--accelerator-type=v4-8", "--version=v"]
    for _ in range(2):
        proc = gc(*create, f"--zone={Z}")
        assert proc.returncode == 1 and f'There is no more capacity in the zone "{Z}"' in proc.stderr
        assert proc.stderr.startswith("ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED")
    assert g.is_capacity_error(g.GcloudError(g.one_line(proc.stderr)))
    assert gc(*create, f"--zone={Z}").returncode == 0  # the third try gets one
    z = "us-east5-b"
    emulator.fail_next("queued-resources.provision", "Insufficient capacity for spot v5litepod-16 in zone us-east5-b.")
    gc("compute", "tpus", "queued-resources", "create", "q", f"--project={P}", f"--zone={z}",
       "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite", "--node-id=n", "--spot", check=True)
    qr = json.loads(gc("compute", "tpus", "queued-resources", "describe", "q", f"--project={P}", f"--zone={z}",
                       "--format=json", check=True).stdout)
    assert g.qr_state(qr) == ("FAILED", "Insufficient capacity for spot v5litepod-16 in zone us-east5-b.")
    assert gc("compute", "tpus", "tpu-vm", "describe", "n", f"--project={P}", f"--zone={z}").returncode == 1


@pytest.mark.timeout(60)
def test_ssh_fails_n_times_while_ready_then_answers(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-8",
       "--version=v", check=True)
    emulator.fail_next("tpu-vm.ssh", "[/usr/bin/ssh] exited with return code [255].", code=255, times=2)
    assert [_ssh("echo ok").returncode for _ in range(3)] == [255, 255, 0]


@pytest.mark.timeout(60)
def test_gs_is_a_folder_beside_the_vms_and_gcloud_storage_lists_it(emu):
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-8",
       "--version=v", check=True)
    # A worker writes through fsspec's gs:// (what flaxchat.paths and Orbax's epath use) ...
    code = ("import fsspec; fs = fsspec.filesystem('gs'); "
            "[fs.pipe(f'gs://bk/run/checkpoints/{s}/{f}', b'x') for s, f in "
            "((10, 'commit_success.txt'), (10, 'meta'), (20, 'meta'))]")
    out = _ssh(f"{sys.executable} -c \"{code}\"")
    assert out.returncode == 0, out.stderr
    missing = "import fsspec; fsspec.filesystem('gs').pipe('gs://no-such-bucket/run/x', b'x')"
    out = _ssh(f"{sys.executable} -c \"{missing}\"")  # a bucket never created: gcsfs's 404
    assert out.returncode != 0 and "FileNotFoundError" in out.stderr and "bucket does not exist" in out.stderr
    # ... into the bucket folder, outside every VM, so deleting the VM keeps it.
    gc("compute", "tpus", "tpu-vm", "delete", "t", f"--project={P}", f"--zone={Z}", "--quiet", check=True)
    root = emulator.buckets_root()
    assert os.path.exists(os.path.join(root, "bk", "run", "checkpoints", "10", "commit_success.txt"))
    ls = gc("storage", "ls", "gs://bk/run/checkpoints/*/commit_success.txt", check=True).stdout.split()
    assert ls == ["gs://bk/run/checkpoints/10/commit_success.txt"]  # step 20 never committed
    assert gc("storage", "ls", "gs://bk/run/checkpoints/", check=True).stdout.split() == [
        "gs://bk/run/checkpoints/10/", "gs://bk/run/checkpoints/20/"]
    miss = gc("storage", "ls", "gs://bk/nothing")
    assert miss.returncode == 1 and "One or more URLs matched no objects." in miss.stderr
    gc("storage", "cp", "--recursive", "gs://bk/run/checkpoints/10", str(emu), check=True)
    assert (emu / "10" / "meta").read_bytes() == b"x"
    # A bucket that was never created is not there, for gcloud and for a writer alike (gcsfs: a 404).
    miss = gc("storage", "ls", "gs://no-such-bucket/run/")
    assert miss.returncode == 1 and "gs://no-such-bucket bucket does not exist." in miss.stderr
    assert not os.path.exists(os.path.join(emulator.buckets_root(), "no-such-bucket"))
    assert gc("storage", "buckets", "create", "gs://new-bucket").returncode == 0
    assert gc("storage", "ls", "gs://new-bucket/").returncode == 1  # there, and empty


@pytest.mark.timeout(120)
def test_orbax_on_the_rehearsal_bucket_writes_steps_as_on_gcs_and_resumes_only_complete_ones(emu):
    """flaxchat.checkpoint on a gs:// folder, from an emulated worker: Orbax sees a GCS path, so it writes
    the step under its final name with commit_success.txt last; a step without it (a save cut off by
    a preemption) is never the one to resume from."""
    gc("compute", "tpus", "tpu-vm", "create", "t", f"--project={P}", f"--zone={Z}", "--accelerator-type=v4-8",
       "--version=v", check=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import os, sys; sys.path.insert(0, %r); from flax import nnx; from flaxchat import checkpoint as ck; "
            "m = nnx.Linear(2, 2, rngs=nnx.Rngs(0)); c = ck.Checkpointer('gs://bk/c'); "
            "[c.save(s, m, None, {}) for s in (5, 10)]; c.close(); "
            "os.remove(os.environ['FLAXCHAT_REHEARSAL_BUCKETS'] + '/bk/c/10/commit_success.txt'); "
            "print('latest', ck.Checkpointer('gs://bk/c').latest_step())") % repo
    out = _ssh(f"{sys.executable} -c {shlex.quote(code)}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "latest 5" in out.stdout
    step5 = os.path.join(emulator.buckets_root(), "bk", "c", "5")
    assert os.path.exists(os.path.join(step5, "commit_success.txt"))
    assert not [n for n in os.listdir(os.path.dirname(step5)) if "tmp" in n]  # no rename, as on GCS

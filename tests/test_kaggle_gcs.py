"""A Kaggle run that outlives its session: the run folder in a bucket, resumed by the next session.

Kaggle ends a session after 9-12 hours and its machine with it (the kernel, the job, the disk); a
d20 run takes longer. Here a session is a real jupyter_server + ipykernel on 127.0.0.1 (the Kaggle
stand-in of test_kaggle.py) with a disk of its own, and gs:// is the rehearsal's bucket (a folder,
flaxchat/cloud/rehearsal/bucket.py), which the kernel's processes reach through fsspec and Orbax as
they would reach Cloud Storage: it knows no bucket that was never made, and without a key (HOME is
the server's own, with no gcloud login) it has no credentials, as gcsfs has none on Kaggle.

Slow-marked: two sessions (a server, a setup and a JAX compile each) and an uninterrupted reference.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from flaxchat.remote import KaggleRunner

sys.path.insert(0, str(Path(__file__).parent))
from jupyter_fixture import JupyterServer, make_kernel_venv, snapshot_repo  # noqa: E402
from support import cache_env, cpu_env  # noqa: E402
from test_multihost import compare_params  # noqa: E402

pytestmark = pytest.mark.slow  # a real jupyter_server and kernels: CI runs it; `-m "not slow"` skips it


REPO = Path(__file__).resolve().parents[1]
TOKEN = "gcs-test-token"
RUN = "d1-across-sessions"
STEPS = 200  # long enough (~2-6 s of steps here) for a session to end between two committed saves
FLAGS = dict(sequence_len=32, vocab_size=300, device_batch_size=2, total_batch_size=128, eval_every=0,
             sample_every=0, save_every=10, log_every=10, max_chars_tokenizer=20000, num_samples=0, seed=3,
             export=False)
quiet = lambda stream, text: None  # noqa: E731


def _argv(run_dir) -> list[str]:
    from flaxchat.remote.kaggle import pipeline_argv
    return pipeline_argv(1, STEPS, str(run_dir), FLAGS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("kaggle-gcs")
    venv = make_kernel_venv(base / "venv")
    repo = snapshot_repo(base / "repo", REPO)
    buckets = base / "buckets"
    (buckets / "bk").mkdir(parents=True)  # `gcloud storage buckets create gs://bk`
    site = base / "site"  # what makes gs:// the bucket stand-in in every process the kernel starts
    site.mkdir()
    shutil.copy(REPO / "flaxchat" / "cloud" / "rehearsal" / "bucket.py", site / "flaxchat_rehearsal_bucket.py")
    (site / "sitecustomize.py").write_text("import flaxchat_rehearsal_bucket as b\nb.install()\n")
    key = base / "laptop" / "sa-key.json"
    key.parent.mkdir()
    secret = f"not-a-real-key-{uuid.uuid4().hex}"  # made here, so that not even this file (uploaded too) holds it
    key.write_text(json.dumps({"type": "service_account", "client_email": "trainer@proj.iam.gserviceaccount.com",
                               "private_key": f"-----BEGIN PRIVATE KEY-----\n{secret}\n-----END PRIVATE KEY-----\n"}))
    env = {"PYTHONPATH": str(site), "FLAXCHAT_REHEARSAL_BUCKETS": str(buckets), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **cache_env()}  # the reference's one device
    return SimpleNamespace(base=base, venv=venv, repo=repo, buckets=buckets, key=key, secret=secret, env=env)


def _session(world, name: str):
    """A new Kaggle session: a server with a disk of its own, flaxchat uploaded and installed again."""
    srv = JupyterServer(world.base / name, token=TOKEN, kernel_python=world.venv[0], env=dict(world.env)).start()
    runner = KaggleRunner(srv.url, TOKEN)
    runner.setup(str(world.repo), install="pip" if world.venv[1] else "path", deps=False,
                 pip_args=["--no-build-isolation"], on_output=quiet)
    return srv, runner


def _end_session(srv: JupyterServer, runner: KaggleRunner, job_state: Path) -> None:
    """What the end of a Kaggle session does: every process of the machine killed at once (the job
    included: SIGKILL, no checkpoint on the way out), the kernel gone, the disk gone."""
    run = json.loads((job_state / "run.json").read_text())
    for pid in (run.get("child_pid"), run.get("supervisor_pid")):
        try:
            os.killpg(pid, signal.SIGKILL) if pid == run.get("child_pid") else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
    runner.close()
    srv.stop()
    shutil.rmtree(srv.root)


def _committed(ckpt: Path) -> list[int]:
    """Steps Orbax finished in the bucket (commit_success.txt, as on GCS)."""
    names = os.listdir(ckpt) if ckpt.is_dir() else []
    return sorted(int(n) for n in names if n.isdigit() and (ckpt / n / "commit_success.txt").exists())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_session_ended_mid_run_is_resumed_from_the_bucket_by_the_next_to_the_same_parameters(world):
    # The uninterrupted reference, run here with the same flags on a local disk.
    ref = world.base / "reference"
    out = subprocess.run([sys.executable, *_argv(ref)], cwd=REPO, env=cpu_env(1, **cache_env()),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    run_dir, folder = f"gs://bk/{RUN}", world.buckets / "bk" / RUN
    srv, runner = _session(world, "session-1")
    # No key: the kernel's machine has no Google credentials, so the job stops at once with one
    # sentence, and nothing is written to the bucket.
    runner.run_pipeline(1, STEPS, run_dir=run_dir, name="no-key", **FLAGS)
    res = runner.wait(timeout=300, on_output=quiet)
    assert not res.ok and "no Google Cloud credentials" in res.stdout and "Traceback" not in res.stdout, res.stdout
    assert not folder.exists()

    runner.run_pipeline(1, STEPS, run_dir=run_dir, gcs_key=str(world.key), **FLAGS)
    ckpt = folder / "checkpoints"
    deadline = time.monotonic() + 300
    while not _committed(ckpt) and time.monotonic() < deadline:
        time.sleep(0.01)
    _end_session(srv, runner, srv.root / "flaxchat_remote" / "runs" / RUN / "job")
    saved = _committed(ckpt)
    assert saved and not (folder / "COMPLETE").exists() and saved[-1] < STEPS, (saved, runner.status().detail)
    print(f"session 1 ended (job killed, kernel and disk gone) with steps {saved} of {STEPS} committed in {run_dir}")

    # The next session: a new server, a new disk, the same call.
    srv2, runner2 = _session(world, "session-2")
    try:
        runner2.run_pipeline(1, STEPS, run_dir=run_dir, gcs_key=str(world.key), **FLAGS)
        res = runner2.wait(timeout=400, on_output=quiet)
        assert res.ok, res.stdout[-3000:]
        assert f"resumed from step {saved[-1]} in {run_dir}/checkpoints" in res.stdout, res.stdout[-3000:]
        assert json.loads((folder / "COMPLETE").read_text())["step"] == STEPS
        # The key reached the job as a file, never as text in its log or on the server's disk.
        assert world.secret not in res.stdout
        assert not [p for p in srv2.root.rglob("*") if p.is_file() and world.secret.encode() in p.read_bytes()]
    finally:
        runner2.close()
        srv2.stop()
    print(compare_params(ref, folder, 1))  # every array equal (rtol 1e-6) to the uninterrupted run's


def test_the_key_reaches_the_job_as_a_private_file_from_the_runner_or_the_notebook(tmp_path, monkeypatch):
    """kernel_side.private_env_file: the key given as a secret (from gcs_key=, or set by the notebook
    from Kaggle's Secrets as FLAXCHAT_GCS_KEY) becomes a 0600 key file outside the server's folder,
    named by GOOGLE_APPLICATION_CREDENTIALS, and stays a secret (*** in the log)."""
    from flaxchat.remote import kernel_side
    key = json.dumps({"type": "service_account", "private_key": "k-1f2e"})
    for given, notebook in (({kernel_side.GCS_KEY_ENV: key}, None), ({}, key)):
        if notebook:
            monkeypatch.setenv(kernel_side.GCS_KEY_ENV, notebook)
        upload = tmp_path / "upload.json"
        upload.write_text(json.dumps({"env": {"A": "1", **given}, "secret_keys": sorted(given)}))
        doc = json.loads(Path(kernel_side.private_env_file(str(upload))).read_text())
        path = doc["env"]["GOOGLE_APPLICATION_CREDENTIALS"]
        assert Path(path).read_text() == key and oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert not str(path).startswith(str(tmp_path)) and not upload.exists()
        assert kernel_side.GCS_KEY_ENV in doc["secret_keys"] and doc["env"]["A"] == "1"


def test_pipeline_flags_from_the_command_line_become_the_stage_s_flags():
    """`--flag KEY=VALUE` of `python -m flaxchat.remote.kaggle --pipeline`: true/false are switches
    (`--flag export=false` once reached the stage as `--export=False`, which it refused)."""
    from flaxchat.remote.__main__ import _flags
    from flaxchat.remote.kaggle import pipeline_argv
    flags = _flags(["save_every=500", "export=false", "fresh=True", "data=gs://b/fineweb/", "lr-batch-scaling=auto"])
    assert pipeline_argv(20, -1, "gs://b/d20", flags)[1:] == [
        "scripts.run_tinystories", "--depth=20", "--steps=-1", "--run-dir=gs://b/d20", "--save-every=500",
        "--no-export", "--fresh", "--data=gs://b/fineweb/", "--lr-batch-scaling=auto"]

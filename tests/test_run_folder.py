"""A run folder on gs:// is a run like any other: every stage and tool reads it, and bad buckets,
missing credentials and unfinished checkpoints are one sentence each.

gs:// is the rehearsal's bucket (flaxchat/cloud/rehearsal/bucket.py: a folder, reached through
fsspec and Orbax's TensorStore as Cloud Storage is), made to fail as Cloud Storage fails: a bucket
that was never created is not there, and without a key (or a gcloud login) there are no
credentials. Every command runs as a user types it, in a process of its own, from an empty folder
with an empty HOME, so that whatever it writes outside the bucket shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flaxchat.paths import RunFolder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from support import cache_env, tiny_flags  # noqa: E402

TINY = tiny_flags(eval_every=0, sample_every=0)


class Gcs:
    """gs:// for processes started through `run`: the stand-in on their path, a service-account key."""

    def __init__(self, base: Path):
        self.base, self.buckets = base, base / "buckets"
        self.site, self.home, self.cwd, self.tmp = base / "site", base / "home", base / "cwd", base / "tmp"
        for d in (self.site, self.home, self.cwd, self.tmp):
            d.mkdir(parents=True)
        (self.buckets / "bk").mkdir(parents=True)  # `gcloud storage buckets create gs://bk`
        shutil.copy(REPO / "flaxchat" / "cloud" / "rehearsal" / "bucket.py", self.site / "flaxchat_rehearsal_bucket.py")
        (self.site / "sitecustomize.py").write_text("import flaxchat_rehearsal_bucket as b\nb.install()\n")
        self.key = base / "key" / "sa.json"
        self.key.parent.mkdir()
        self.key.write_text(json.dumps({"type": "service_account", "client_email": "t@p.iam.gserviceaccount.com"}))

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "GOOGLE_"))}
        return {**env, "PYTHONPATH": f"{self.site}{os.pathsep}{REPO}", "FLAXCHAT_REHEARSAL_BUCKETS": str(self.buckets),
                "HOME": str(self.home), "TMPDIR": str(self.tmp), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                "GOOGLE_APPLICATION_CREDENTIALS": str(self.key), "MPLBACKEND": "Agg", **cache_env(), **extra}

    def run(self, *argv: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *argv], cwd=self.cwd, env=self.env(**env), capture_output=True,
                              text=True, timeout=timeout)

    def local(self, url: str) -> Path:
        return self.buckets / url[len("gs://"):]

    def tree(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.buckets)): p.read_bytes() for p in sorted(self.buckets.rglob("*")) if p.is_file()}


@pytest.fixture
def gcs(tmp_path):
    return Gcs(tmp_path)


def _one_sentence(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr.strip()
    assert "Traceback" not in err and err.count("error:") == 1, err[-2000:]
    for w in words:
        assert w in err, err


def _half_written(gcs: Gcs, run: str, step: int) -> None:
    """A run folder whose one save was cut off, as Orbax on GCS leaves it: the step under its final name,
    its meta and part of its arrays, no commit_success.txt."""
    step_dir = gcs.local(f"{run}/checkpoints/{step}")
    (step_dir / "meta").mkdir(parents=True)
    (step_dir / "meta" / "metadata").write_text("{}")
    (step_dir / "model").mkdir()
    (gcs.local(run) / "tokenizer").mkdir()


@pytest.mark.timeout(300)
def test_a_missing_bucket_no_credentials_and_no_finished_step_are_one_sentence_each_and_write_nothing(gcs):
    before = gcs.tree()
    # A bucket that was never created: read or written, one sentence that names it.
    p = gcs.run("scripts.sft", "--base", "gs://no-such-bucket/d20", "--run-dir", "gs://bk/sft", "--steps", "1")
    _one_sentence(p, "the bucket gs://no-such-bucket does not exist", "check the name")
    p = gcs.run("scripts.export", "--run-dir", "gs://no-such-bucket/d20")
    _one_sentence(p, "the bucket gs://no-such-bucket does not exist")
    p = gcs.run("scripts.pretrain", "--run-dir=gs://no-such-bucket/d20", "--steps=1", *TINY)
    _one_sentence(p, "the bucket gs://no-such-bucket does not exist", "gcloud storage buckets create gs://no-such-bucket")
    # No credentials: no key file where GOOGLE_APPLICATION_CREDENTIALS points, no gcloud login in HOME.
    p = gcs.run("scripts.eval", "--model", "gs://bk/d20", "--tasks", "none", "--bpb",
                GOOGLE_APPLICATION_CREDENTIALS=str(gcs.base / "no-key.json"))
    _one_sentence(p, "found no Google Cloud credentials", "GOOGLE_APPLICATION_CREDENTIALS")
    p = gcs.run("scripts.convert_to_tflite", "--checkpoint", "gs://bk/d20/export/model.pkl",
                GOOGLE_APPLICATION_CREDENTIALS=str(gcs.base / "no-key.json"))
    _one_sentence(p, "found no Google Cloud credentials")
    assert gcs.tree() == before == {}  # nothing was written anywhere in the bucket
    # A run folder with no committed step, and one whose only save was cut off.
    (gcs.local("gs://bk/empty") / "checkpoints").mkdir(parents=True)
    _half_written(gcs, "gs://bk/half", 4)
    before = gcs.tree()
    _one_sentence(gcs.run("scripts.export", "--run-dir", "gs://bk/empty"), "no checkpoint found in gs://bk/empty/checkpoints")
    _one_sentence(gcs.run("scripts.export", "--run-dir", "gs://bk/half"),
                  "gs://bk/half/checkpoints holds only a half-written save (4)")
    _one_sentence(gcs.run("scripts.chat_cli", "--run-dir", "gs://bk/nothing-here", "-p", "hi"),
                  "no run folder or checkpoint at gs://bk/nothing-here")
    _one_sentence(gcs.run("scripts.sft", "--base", "gs://bk/half", "--run-dir", "gs://bk/half/", "--steps", "1"),
                  "--run-dir gs://bk/half/ is the base model's own folder")
    assert gcs.tree() == before  # the cut save is left as it was, for the trainer that resumes
    assert not list(gcs.cwd.iterdir()) and not list(gcs.tmp.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pretrain_sft_rl_eval_export_tflite_all_on_gs_with_nothing_written_outside(gcs):
    """The whole chain with every run folder in the bucket, each stage reading the last one's from
    there (`--base gs://...`), as on a pod or across Kaggle sessions: no download step."""
    base, sft, rl = "gs://bk/d1", "gs://bk/d1-sft", "gs://bk/d1-rl"
    chain = [
        ("pretrain", ["scripts.pretrain", f"--run-dir={base}", "--steps=3", *TINY]),
        ("sft", ["scripts.sft", "--base", base, "--run-dir", sft, "--steps", "2", "--device-batch-size", "2",
                 "--eval-every", "0", "--save-every", "1"]),
        ("rl", ["scripts.rl", "--base", sft, "--run-dir", rl, "--steps", "1", "--prompts", "2", "--samples", "2",
                "--max-new-tokens", "8", "--eval-every", "0", "--eval-examples", "2"]),
        ("chat_cli", ["scripts.chat_cli", "--run-dir", rl, "-p", "What is 2 plus 3?", "--max-tokens", "4"]),
        ("eval", ["scripts.eval", "--model", rl, "--tasks", "arithmetic", "--limit", "2"]),
        ("export", ["scripts.export", "--run-dir", rl]),
        ("tflite", ["scripts.convert_to_tflite", "--checkpoint", f"{rl}/export/model.pkl"]),
    ]
    times = {}
    for name, argv in chain:
        t0 = time.monotonic()
        p = gcs.run(*argv)
        times[name] = time.monotonic() - t0
        assert p.returncode == 0, f"{name}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if name == "sft":
            assert f"starting from {base}'s weights" in p.stdout, p.stdout[-2000:]
            # Only the step a reader needs is read: the arrays of SFT's older step are garbage from here
            # on, and RL (latest step only) must never notice.
            old = gcs.local(f"{sft}/checkpoints/1")
            spoiled = [f for d in ("model", "optimizer") for f in (old / d).rglob("*") if f.is_file()]
            assert spoiled and (gcs.local(f"{sft}/checkpoints/2") / "commit_success.txt").is_file()
            for f in spoiled:
                f.write_bytes(b"not an array")
        if name == "tflite":
            assert "greedy 24 tokens equal JAX's: True" in p.stdout or "equal JAX's: True" in p.stdout, p.stdout
    print("chain on gs://: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()) + f"; total {sum(times.values()):.1f}s")
    for run in (base, sft, rl):
        folder = RunFolder(gcs.local(run))
        assert Path(folder.complete).is_file() and Path(folder.tokenizer, "tokenizer.json").is_file(), run
    rl_folder = RunFolder(gcs.local(rl))
    assert json.loads(Path(rl_folder.eval).read_text())["model"] == rl and "## Evaluation" in Path(rl_folder.report).read_text()
    for name in ("model.pkl", "weights.npz", "model.stablehlo", "model.mlir", "model.tflite", "tokenizer/tokenizer.json"):
        assert Path(rl_folder.export, name).is_file(), name
    # Nothing outside the bucket: the working folder and TMPDIR stay empty; HOME holds only caches.
    assert not list(gcs.cwd.iterdir()) and not list(gcs.tmp.iterdir())
    home = sorted(str(p.relative_to(gcs.home)) for p in gcs.home.rglob("*") if p.is_file())
    assert all(p.startswith(".cache/") for p in home), home
    print(f"written outside the bucket: {home or 'nothing'} (in HOME; the working folder and TMPDIR are empty)")

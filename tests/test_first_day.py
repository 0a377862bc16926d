"""A new user's first day: what the docs promise is what a run prints, and no rerun loses work or
starts over in silence. Starting over after a save cut short says so, a finished run run again
keeps its record, the README's main-job figures are the run's own `batch:` line, the `recipe:` and
`sample:` lines read as text, every MFU in metrics.jsonl names its baseline, and recovery promises
a checkpoint only as the run folder has one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from support import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_flags(eval_every=0)


def _pretrain(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "scripts.pretrain", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_save_cut_short_is_said_in_one_line_and_the_run_starts_at_step_0(tmp_path):
    from flaxchat.stage import open_checkpoints
    run = tmp_path / "run"
    (run / "checkpoints" / "20.orbax-checkpoint-tmp-1733").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 10}\n')
    lines = []
    checkpointer, step, meta = open_checkpoints(str(run), fresh=False, keep=2, is_main=True, log=lines.append,
                                                name="pretrain")
    checkpointer.close()
    assert step is None and meta is None
    assert len(lines) == 1, lines
    assert "no intact step, only 20.orbax-checkpoint-tmp-1733 (a save cut short)" in lines[0], lines
    assert "starting at step 0" in lines[0] and "metrics.jsonl" in lines[0], lines

    logged_only = tmp_path / "logged"
    logged_only.mkdir()
    (logged_only / "metrics.jsonl").write_text('{"kind": "train", "step": 10}\n')
    lines = []
    open_checkpoints(str(logged_only), fresh=False, keep=2, is_main=True, log=lines.append)[0].close()
    assert len(lines) == 1 and "saved no checkpoint" in lines[0] and "starting at step 0" in lines[0], lines

    lines = []  # a new run folder, or --fresh, starts at step 0 as asked: nothing to say
    open_checkpoints(str(tmp_path / "new"), fresh=False, keep=2, is_main=True, log=lines.append)[0].close()
    open_checkpoints(str(logged_only), fresh=True, keep=2, is_main=True, log=lines.append)[0].close()
    assert lines == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_finished_run_run_again_says_complete_and_rewrites_nothing(tmp_path):
    run = tmp_path / "run"
    first = _pretrain([*TINY, "--steps=4", "--sample-every=2", f"--run-dir={run}"])
    assert first.returncode == 0, first.stderr[-2000:]
    out = first.stdout
    # The mid-run sample is text, not a Python repr; the recipe line says the LR rule is off, and why.
    sample = next(line for line in out.splitlines() if line.startswith("sample: "))
    assert not sample.startswith("sample: '") and not sample.startswith('sample: "'), sample
    recipe = next(line for line in out.splitlines() if line.startswith("recipe: "))
    assert "as given" in recipe and " off (--lr-batch-scaling auto: the run reads its text" in recipe, recipe
    # Every train line names the peak its MFU was counted against.
    train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert train and all(e["peak_flops"] > 0 for e in train), train
    record = {f: (run / f).read_bytes() for f in ("report.md", "loss.png", "samples.txt", "COMPLETE", "metrics.jsonl",
                                                   "config.json")}
    again = _pretrain([*TINY, "--steps=4", "--sample-every=2", f"--run-dir={run}"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"complete: {run} finished at step 4 (its COMPLETE); nothing to train, nothing rewritten" in again.stdout, \
        again.stdout[-2000:]
    assert "done:" not in again.stdout and "saving checkpoint" not in again.stdout
    assert {f: (run / f).read_bytes() for f in record} == record
    further = _pretrain([*TINY, "--steps=6", "--sample-every=0", f"--run-dir={run}"])  # asked to train on
    assert further.returncode == 0, further.stderr[-2000:]
    assert "resumed from step 4" in further.stdout and "done: 6 steps" in further.stdout, further.stdout[-2000:]
    assert json.loads((run / "COMPLETE").read_text())["step"] == 6


def test_the_readme_main_job_figures_are_the_runs_own_batch_line():
    from flaxchat.recipe import batch_line
    from scripts.run_tinystories import DEFAULTS
    rows, seq, total, steps = DEFAULTS["device_batch_size"], DEFAULTS["sequence_len"], DEFAULTS["total_batch_size"], \
        DEFAULTS["steps"]
    printed = batch_line(total, total // (rows * seq), rows, seq, steps)  # one CPU device, as on the README's machine
    readme = open(os.path.join(ROOT, "README.md")).read()
    quoted = re.search(r"`(batch: [^`]+)`", readme)
    assert quoted and " ".join(quoted.group(1).split()) == printed, (quoted and quoted.group(1), printed)
    assert "--steps=1000" in readme and steps == 1000
    for m in re.finditer(r"main job[^.]*?([\d,]+) tokens per\s+step", readme):
        assert int(m.group(1).replace(",", "")) == total, m.group(0)
    assert f"{total:,} tokens" in readme
    cpu = open(os.path.join(ROOT, "docs", "cpu.md")).read()
    assert f"`batch: {total:,} tokens/step`" in cpu


@pytest.mark.parametrize("mode,given,applied,passes,words", [
    ("off", 1024, False, None, "LRs x1.0000 as given, nanochat's batch rule sqrt(1,024/2^19) = 0.0442 off "
                               "(--lr-batch-scaling off)"),
    ("auto", 1024, False, 0.4, "off (--lr-batch-scaling auto: the run reads its text 0.4 time(s), under 2)"),
    ("auto", 1024, True, 4.9, "LRs x0.0442, nanochat's batch rule sqrt(1,024/2^19) = 0.0442 on (--lr-batch-scaling "
                              "auto: the run reads its text 4.9 time(s), at least 2)"),
    ("auto", -1, True, 0.1, "on (--lr-batch-scaling auto, at the automatic batch)"),
    ("on", 1024, True, None, "on (--lr-batch-scaling on)"),
])
def test_the_recipe_line_says_whether_the_lr_rule_is_on_and_why(mode, given, applied, passes, words):
    from flaxchat.recipe import lr_rule_text
    assert words in lr_rule_text(mode, given, applied, 1024, (1024 / 2**19) ** 0.5, passes)


def test_a_sample_line_is_the_text_with_later_lines_indented():
    from scripts.pretrain import sample_text
    assert sample_text("Once upon a time.\nThe end.\n") == "sample: Once upon a time.\n        The end."


def test_recovery_promises_a_checkpoint_only_as_the_run_folder_has_one_and_a_first_silence_is_not_ssh():
    from flaxchat.cloud import recovery as rec
    d = rec.decide(rec.Observation("PREEMPTED"), rec.Counters(), rec.Policy())
    assert d.action is rec.Action.RECREATE and "from the last checkpoint" not in d.reason
    assert "starts at step 0 when none was committed" in d.reason, d.reason
    gone = rec.Observation("READY", workers=[rec.WorkerObs(reachable=False), rec.WorkerObs(reachable=False)])
    first = rec.decide(gone, rec.Counters(), rec.Policy())
    assert first.action is rec.Action.WAIT and "ssh key" not in first.reason and "preemption" in first.reason
    lasting = rec.decide(gone, rec.Counters(unreachable_polls=2), rec.Policy())
    assert "check your ssh key, OS Login or firewall" in lasting.reason, lasting.reason


def test_export_has_a_place_of_its_own_and_one_install_hint():
    from flaxchat.export.tflite import INSTALL_HINT
    venv = "python -m venv ~/.venvs/flaxchat-export"
    assert venv in INSTALL_HINT and 'pip install -e ".[export]"' in INSTALL_HINT
    for name in ("scripts/convert_to_tflite.py", "docs/export.md"):
        assert venv in " ".join(open(os.path.join(ROOT, name)).read().split()), name
    if subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in (".venv-export/lib/certifi/cacert.pem", "exports/model.pkl", "runs/tinystories/COMPLETE"):
        ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", "--no-index", path], timeout=30)
        assert ignored.returncode == 0, f"{path} is not ignored by .gitignore"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_save_cut_short_in_a_bucket_is_said_and_the_run_starts_at_step_0(tmp_path):
    """As the rehearsal's pod left it when preempted mid-save: step 20 under its final name with no
    commit_success.txt (Orbax on GCS). The stage says what it found and that it starts at step 0."""
    from test_run_folder import TINY as GS_TINY
    from test_run_folder import Gcs, _half_written
    gcs = Gcs(tmp_path)
    _half_written(gcs, "gs://bk/d2", 20)
    p = gcs.run("scripts.pretrain", "--run-dir=gs://bk/d2", "--steps=1", *GS_TINY)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next((x for x in p.stdout.splitlines() if "no intact step" in x), p.stdout[-2000:])
    assert line == "pretrain: gs://bk/d2/checkpoints holds no intact step, only 20 (a save cut short); starting at " \
                   "step 0", line


def test_a_retimed_mfu_peak_is_said_with_where_metrics_record_it():
    from flaxchat.rates import Peak
    said = []
    peak = Peak(probe=lambda: 149e9, log=said.append, first=46e9)
    assert peak.mfu(59e9) == pytest.approx(100 * 59 / 149)
    assert len(said) == 1 and "re-timed" in said[0] and "peak_flops" in said[0], said

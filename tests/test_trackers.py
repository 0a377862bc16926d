"""W&B and TensorBoard as every stage's trackers, read back with the libraries' own readers (W&B
offline: its transaction log through wandb's DataStore; TensorBoard: its EventAccumulator), a kill -9
and resume included; `--profile-steps`; and neither library imported unless asked."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from flaxchat.errors import UserError
from test_sft_rl import base, tokenizer  # noqa: F401 (fixtures)
from test_train import ROOT, TINY, _env

pytestmark = pytest.mark.slow  # end to end: training runs with trackers: CI runs it; `-m "not slow"` skips it


TRACKER_MODULES = ("wandb", "tensorboardX", "tensorboard")


def _offline_env(tmp_path):
    home = tmp_path / "wandb-home"  # W&B's settings and caches, away from ~
    return dict(_env(), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home),
                WANDB_CACHE_DIR=str(home), WANDB_DATA_DIR=str(home))


def _metrics(run):
    from flaxchat.report import MetricsLog
    return MetricsLog(str(run / "metrics.jsonl")).read()


def _figures(entries):
    """metrics.jsonl as the trackers name it: {kind/key: {step: value}}."""
    out = {}
    for e in entries:
        for k, v in e.items():
            if k not in ("kind", "step", "time") and isinstance(v, (int, float)):
                out.setdefault(f"{e['kind']}/{k}", {})[e["step"]] = float(v)
    return out


def _wandb_sessions(run):
    """Each offline session's history rows, read from its .wandb transaction log, oldest first."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore
    sessions = []
    for path in sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ds = datastore.DataStore()
        ds.open_for_scan(path)
        run_ids, rows, config = set(), [], {}
        while True:
            try:
                data = ds.scan_data()
            except AssertionError:  # the block a kill -9 cut short
                break
            if data is None:
                break
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(rec.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        sessions.append(dict(path=path, run_ids=run_ids, rows=rows, config=config))
    return sessions


def _wandb_figures(rows, want):
    """History rows as {kind/key: {step: value}} for the keys of `want`; a later row of a step wins."""
    got = {}
    for row in rows:
        for key, value in row.items():
            if key in want:
                got.setdefault(key, {})[row["step"]] = value
    return got


def _tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _check_tensorboard(run, want):
    acc = _tensorboard(run)
    for tag, by_step in want.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == sorted(by_step), tag  # each step once, a resume's replay purged
        assert [e.value for e in events] == pytest.approx([by_step[s] for s in sorted(by_step)], rel=1e-6), tag
    return acc


def test_tracker_flags_are_checked_before_any_work(monkeypatch, tmp_path):
    from scripts import pretrain, rl, sft
    run = tmp_path / "run"
    for name, module in (("wandb", "wandb"), ("tensorboard", "tensorboardX")):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
        with pytest.raises(UserError, match=rf'--tracker {name} needs .* pip install "flaxchat\[{name}\]"'):
            pretrain.parse_args(["--tracker", f"none,{name}", "--run-dir", str(run)])
        for stage in (sft, rl):
            with pytest.raises(UserError, match="pip install"):
                stage.parse_args(["--base", str(tmp_path), "--tracker", name, "--run-dir", str(run)])
    with pytest.raises(UserError, match="unknown tracker 'mlflow'"):
        pretrain.parse_args(["--tracker", "mlflow"])
    with pytest.raises(UserError, match="--profile-steps '4:2' must be A:B"):
        pretrain.parse_args(["--profile-steps", "4:2"])
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wandb_offline_history_equals_metrics(tmp_path, tokenizer_dir):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "scripts.pretrain", *TINY, f"--tokenizer-dir={tokenizer_dir}",
                        "--steps=6", "--eval-every=3", "--sample-every=4", "--tracker=wandb", f"--run-dir={run}"],
                       cwd=ROOT, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = _figures(_metrics(run))
    assert {"train/loss", "train/lrm", "train/tok_per_s", "train/mfu", "val/val_bpb"} <= set(want)
    (session,) = _wandb_sessions(run)
    assert _wandb_figures(session["rows"], want) == want
    assert [row["step"] for row in session["rows"] if row.get("sample/samples/_type") == "table-file"] == [4, 6]
    assert session["config"]["train"]["tracker"] == "wandb" and session["config"]["steps"] == 6  # the config, once
    assert not (run / "tensorboard").exists()


# --help, then a plain run with a profile window: no tracker library is imported by either.
PLAIN = f"""
import sys
from scripts import pretrain
try:
    pretrain.main(["--help"])
except SystemExit:
    pass
assert not set({TRACKER_MODULES!r}) & set(sys.modules), "--help imported a tracker"
pretrain.main(sys.argv[1:])
print("tracker modules:", sorted(set({TRACKER_MODULES!r}) & set(sys.modules)))
"""


@pytest.mark.timeout(300)
def test_plain_run_imports_no_tracker_and_profiles_steps(tmp_path, tokenizer_dir):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", PLAIN, *TINY, f"--tokenizer-dir={tokenizer_dir}", "--steps=5",
                        "--profile-steps=2:4", f"--run-dir={run}"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tracker modules: []" in r.stdout
    assert f"profile: steps 2 to 3 traced into {run / 'profile'}" in r.stdout
    assert "ms/step" in r.stdout  # the top operations, as bench.device_check --profile prints them
    assert glob.glob(str(run / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert not (run / "trackers.json").exists() and not (run / "wandb").exists()


# scripts.pretrain unchanged, but the train step after STALL_AFTER never returns: the moment to kill -9
# is known, after the figures of step STALL_AFTER were logged (the same as a kill at any other moment).
STALL_AFTER = 10
STALLING = f"""
import sys, time, flaxchat.train as train
step = train.StepLoop.__call__
def stalling_step(self, *args):
    self.calls = getattr(self, "calls", 0) + 1
    if self.calls > {STALL_AFTER}:
        print("stalled", flush=True)
        time.sleep(600)
    return step(self, *args)
train.StepLoop.__call__ = stalling_step
from flaxchat.errors import cli_main
from scripts import pretrain
sys.exit(cli_main(pretrain.main, sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wandb_and_tensorboard_continue_after_kill9(tmp_path, tokenizer_dir):
    run = tmp_path / "run"
    env = _offline_env(tmp_path)
    args = [*TINY, f"--tokenizer-dir={tokenizer_dir}", "--steps=16", "--save-every=4", "--eval-every=6",
            "--sample-every=8", "--tracker=wandb,tensorboard", "--run-name=resumed", f"--run-dir={run}"]
    proc = subprocess.Popen([sys.executable, "-c", STALLING, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, deadline = [], time.time() + 300
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stalled") or time.time() > deadline:
                break
        assert lines and lines[-1].startswith("stalled"), "".join(lines[-40:])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # W&B's service outlives its killed client and closes the run's transaction log (it writes it in
        # blocks: offline, a machine lost whole loses the rows since the last block; online they were sent)
        for _ in range(600):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
    first = _wandb_sessions(run)
    logged = [r["step"] for r in first[0]["rows"] if "train/loss" in r]
    assert len(first) == 1 and logged == list(range(1, len(logged) + 1))  # 0.29.0 offline: none (see above)

    r = subprocess.run([sys.executable, "-m", "scripts.pretrain", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = int(re.search(r"^resumed from step (\d+)", r.stdout, re.M).group(1))
    assert resumed in (4, 8)  # the last save that was committed before the kill (Orbax saves in the background)

    entries = _metrics(run)
    want = _figures(entries)
    assert sorted(want["train/loss"]) == list(range(1, 17)) and sorted(want["val/val_bpb"]) == [6, 12, 16]
    assert "train/lrm" in want and "train/mfu" in want and "train/tok_per_s" in want

    # W&B: one run id across both sessions; the second's history starts at the step after the resumed one
    ids = json.loads((run / "trackers.json").read_text())
    sessions = _wandb_sessions(run)
    assert len(sessions) == 2 and all(s["path"].endswith(f"-{ids['wandb']['id']}/run-{ids['wandb']['id']}.wandb")
                                      for s in sessions)  # W&B names an offline session's files by its run id
    assert sessions[1]["run_ids"] == {ids["wandb"]["id"]} and sessions[0]["run_ids"] <= {ids["wandb"]["id"]}
    assert ids["wandb"]["name"] == "resumed"
    second = [row["step"] for row in sessions[1]["rows"] if "train/loss" in row]
    assert second == list(range(resumed + 1, 17))  # continues from the step it resumed at
    assert _wandb_figures(sessions[1]["rows"], want) == {k: {s: v for s, v in by_step.items() if s > resumed}
                                                         for k, by_step in want.items()}
    assert [row["step"] for row in sessions[1]["rows"] if row.get("sample/samples/_type") == "table-file"] == [s for s in (8, 16) if s > resumed]

    # TensorBoard: the same folder, two event files; the reader shows each step once, equal to metrics.jsonl
    assert len(glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))) == 2
    acc = _check_tensorboard(run, want)
    assert {"sample/samples/text_summary", "config/text_summary"} <= set(acc.Tags()["tensors"])
    # (its purge spares text: a replayed step can show its samples twice)
    assert sorted({e.step for e in acc.Tensors("sample/samples/text_summary")}) == [8, 16]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_and_rl_log_to_their_trackers(base, tmp_path):  # noqa: F811
    from test_sft_rl import SFT_ARGS
    env = _offline_env(tmp_path)
    sft_run, rl_run = tmp_path / "sft", tmp_path / "rl"
    for script, run, args in (
            ("sft", sft_run, [*SFT_ARGS, "--tracker", "tensorboard"]),
            ("rl", rl_run, ["--steps", "2", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8",
                            "--eval-every", "1", "--eval-examples", "3", "--log-every", "1", "--tracker", "wandb"])):
        p = subprocess.run([sys.executable, "-m", f"scripts.{script}", "--base", str(base), "--run-dir", str(run),
                            *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    want = _figures(_metrics(sft_run))
    assert {"train/loss", "train/lrm", "train/tok_per_s", "val/val_loss"} <= set(want)
    acc = _check_tensorboard(sft_run, want)
    assert "sample/samples/text_summary" in acc.Tags()["tensors"]  # the greedy replies
    want = _figures(_metrics(rl_run))
    assert {"train/loss", "train/reward", "val/pass_at_1"} <= set(want)
    (session,) = _wandb_sessions(rl_run)
    assert _wandb_figures(session["rows"], want) == want
    assert session["config"]["tracker"] == "wandb"

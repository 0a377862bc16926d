"""flaxchat.progress: the liveness file every process of a stage writes for its supervisor."""

import json

from flaxchat.progress import ENV, Progress, read


def test_writes_step_and_time_atomically_and_throttled(tmp_path):
    now = [100.0]
    path = tmp_path / "p" / "progress.json"
    p = Progress("pretrain", steps=10, process=3, path=str(path), clock=lambda: now[0])
    p.update(1, loss=3.5)
    rec = read(str(path))
    assert rec["step"] == 1 and rec["time"] == 100.0 and rec["process"] == 3 and rec["loss"] == 3.5
    now[0] = 100.5
    assert not p.due()
    p.update(2)  # throttled: within a second of the last write
    assert read(str(path))["step"] == 1
    p.update(2, force=True)
    assert read(str(path))["step"] == 2
    now[0] = 102.0
    assert p.due()
    p.update(3)
    assert read(str(path)) == json.loads(path.read_text()) and read(str(path))["step"] == 3
    assert [f.name for f in path.parent.iterdir()] == ["progress.json"]  # no temp file left


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    p = Progress("sft")
    assert not p.due()
    p.update(5, force=True)
    assert list(tmp_path.iterdir()) == []


def test_read_rejects_foreign_or_half_files(tmp_path):
    f = tmp_path / "x.json"
    assert read(str(f)) is None
    f.write_text("{not json")
    assert read(str(f)) is None
    f.write_text('{"step": 1}')
    assert read(str(f)) is None  # no schema: not ours


def test_a_stage_names_its_run_folder_and_marker_so_a_supervisor_never_parses_its_command(tmp_path):
    """A launcher that was not told the run folder learns the completion marker from the stage itself:
    worker.py's status reports it and looks for it, local (here) or, from the launcher, in a bucket."""
    from flaxchat.runner import worker
    path = tmp_path / "state" / "progress.json"
    Progress("sft", steps=4, path=str(path), run_dir="gs://b/d20-sft").update(1)
    assert {k: read(str(path))[k] for k in ("run_dir", "marker")} == {"run_dir": "gs://b/d20-sft",
                                                                       "marker": "gs://b/d20-sft/COMPLETE"}
    run = tmp_path / "runs" / "rl"
    Progress("rl", steps=4, path=str(path), run_dir=str(run)).update(4)
    status = worker.status(str(tmp_path / "state"))
    assert status["marker"] == str(run / "COMPLETE") and status["complete"] is False
    run.mkdir(parents=True)
    (run / "COMPLETE").write_text("{}")
    assert worker.status(str(tmp_path / "state"))["complete"] is True


def test_the_first_trained_step_and_its_time_mark_the_end_of_start_up(tmp_path):
    """A stage announces the step it starts from (a resumed one: its checkpoint's) before it compiles;
    the first step past it, and when, is what the launcher's goodput counts start-up up to."""
    from flaxchat.progress import Progress, read
    now = [100.0]
    p = Progress("pretrain", steps=30, path=str(tmp_path / "p.json"), min_interval_s=0, clock=lambda: now[0])
    p.update(10, force=True)  # resumed from step 10, before the compile
    assert "first_step" not in read(str(tmp_path / "p.json"))
    now[0] = 130.0
    p.update(11)
    now[0] = 131.0
    p.update(12)
    rec = read(str(tmp_path / "p.json"))
    assert (rec["step"], rec["first_step"], rec["first_time"]) == (12, 11, 130.0)

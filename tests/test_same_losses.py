"""bench.same_losses: the before/after loss check and its rounding yardstick."""

import json

import pytest

from bench import same_losses


def test_compare_passes_itself_and_measures_a_nonzero_ulp_yardstick(tmp_path, capsys):
    ref = tmp_path / "ref.json"
    assert same_losses.main(["--steps", "4", "--rows", "1", "--out", str(ref)]) == 0
    assert len(json.loads(ref.read_text())) == 4
    assert same_losses.main(["--steps", "4", "--rows", "1", "--compare", str(ref), "--ulps", "64"]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference 0.0e+00: same" in out, out  # the same code, bit for bit
    moved = float(out.split("logits move its losses by up to ")[1].split()[0])
    assert 0 < moved < 1e-2, out  # the nudge reached the loss, and it is a rounding-sized one


def test_compare_fails_a_changed_loss_and_rejects_bad_flags(tmp_path, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps([9.0, 9.0]))
    assert same_losses.main(["--steps", "2", "--rows", "1", "--compare", str(ref)]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert same_losses.main(["--steps", "3", "--rows", "1", "--compare", str(ref)]) == 2
    (tmp_path / "notes.txt").write_text("not json")
    (tmp_path / "dict.json").write_text('{"loss": 1.0}')
    for bad in (["--ulps", "-1"], ["--ulps", "2"], ["--compare", str(tmp_path / "missing.json")],
                ["--compare", str(tmp_path / "notes.txt")], ["--compare", str(tmp_path / "dict.json")]):
        with pytest.raises(SystemExit) as refused:
            same_losses.main(bad)
        assert refused.value.code == 2, bad
        assert "error:" in capsys.readouterr().err, bad


def test_a_bad_compare_file_fails_before_any_step_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(same_losses, "losses", lambda *a, **k: ran.append(1) or [1.0])
    (tmp_path / "notes.txt").write_text("not json")
    for bad in (tmp_path / "missing.json", tmp_path / "notes.txt"):
        with pytest.raises(SystemExit) as refused:
            same_losses.main(["--steps", "1", "--compare", str(bad)])
        assert refused.value.code == 2
    assert ran == []


def test_runs_on_a_checkout_from_before_the_dtype_choice(monkeypatch):
    """`--out` runs on the old code, and the issue's start commit has no optim.orthogonalisation_dtype:
    the fixed dtypes must not need it."""
    from flaxchat import optim
    monkeypatch.delattr(optim, "orthogonalisation_dtype")
    got = same_losses.losses(1, 1, 1)
    assert len(got) == 1 and 0 < got[0] < 20, got

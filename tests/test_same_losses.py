"""bench.same_losses: the before/after loss check and its rounding yardstick."""

import json

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
    try:
        same_losses.main(["--ulps", "-1"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--ulps -1 was accepted")


def test_runs_on_a_checkout_from_before_the_dtype_choice(monkeypatch):
    """`--out` runs on the old code, and the issue's start commit has no optim.orthogonalisation_dtype:
    the fixed dtypes must not need it."""
    from flaxchat import optim
    monkeypatch.delattr(optim, "orthogonalisation_dtype")
    got = same_losses.losses(1, 1, 1)
    assert len(got) == 1 and 0 < got[0] < 20, got

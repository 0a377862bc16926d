"""bench.before_after: both sides run from their own checkouts, the figures are gathered, failures count.

The base side is a real git worktree of this checkout's HEAD (the suite runs from a clone), so both
sides run the same real benches and main job at smoke sizes."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import before_after

HEAD_ROOT = Path(__file__).resolve().parents[1]


def _is_git_checkout() -> bool:
    r = subprocess.run(["git", "-C", str(HEAD_ROOT), "rev-parse", "--verify", "HEAD"], capture_output=True)
    return r.returncode == 0


needs_git = pytest.mark.skipif(not _is_git_checkout(), reason="not a git checkout: no commit to compare against")


def sides_of(out: str) -> tuple[str, str]:
    """The base's and the head's checkout, as the driver's second line names them."""
    m = re.search(r"^base [0-9a-f]{7} \((.+)\), head .+ \((.+)\); logs in ", out, re.M)
    assert m, out
    return m.group(1), m.group(2)


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(HEAD_ROOT), "worktree", "list"], capture_output=True, text=True).stdout


@needs_git
@pytest.mark.slow
def test_every_section_runs_on_both_sides_and_is_summed_up(tmp_path, capsys):
    before = _worktrees()
    rc = before_after.main(["--base", "HEAD", "--configs", "S", "--modes", "flaxchat", "--phase-steps", "1",
                            "--pairs", "1", "--main-steps", "2", "--muon-runs", "1", "--muon-config", "S",
                            "--muon-steps", "1", "--loss-steps", "1", "--loss-shapes", "1x1", "--logs", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _worktrees() == before  # the base's worktree is gone again, and its folder with it
    assert not Path(sides_of(out)[0]).parent.exists(), out
    summary = out.split("--- before/after\n")[1].splitlines()
    # Each side ran its own checkout's code (checked before the first run, else the exit status is 2):
    # the base from a worktree, the head from here.
    base_root, head_root = sides_of(out)
    assert "/before_after-base-" in base_root and head_root == str(HEAD_ROOT), out
    figures = json.loads((tmp_path / "phases-S.head.json").read_text())
    (row,) = figures["rows"]
    assert f"phases  head S flaxchat: {row['tok_s']:,.0f} tok/s, the step at {row['mfu']:.1f}% of peak, fwd+bwd at " \
        f"{row['phases']['fwd+bwd']['of_peak']:.1f}%, muon-ns {row['phases']['muon-ns']['of_step']:.1f}% of the step" \
        in summary, out
    main_line = [line for line in summary if line.startswith("main    base ")]
    assert main_line and main_line[0].endswith("x"), out
    speeds = {side: before_after.tok_per_s(tmp_path / f"main-1.{side}") for side in ("base", "head")}
    ratio = float(main_line[0].rsplit(": ", 1)[1][:-1])
    assert abs(ratio - speeds["head"] / speeds["base"]) < 1e-3, (ratio, speeds)
    muon = json.loads((tmp_path / "muon-1.head.json").read_text())["rows"][0]["phases"]["muon-ns"]
    assert f"muon    head run 1: muon-ns {muon['ms']:.1f} ms, {muon['of_step']:.1f}% of a" in out, out
    per = muon["share_per_round"]
    assert f"per round {per['median']:.1f}% (95% interval {per['low']:.1f}-{per['high']:.1f}%)" in out, out
    # The same code on both sides: the losses agree bit for bit.
    assert "losses  1 rows x 1: same (largest relative difference 0.0e+00" in out, out
    assert figures["cpu"].startswith("cpu: ") and figures["cpu"] in out
    assert "failed:" not in out


@needs_git
def test_a_run_that_fails_or_hangs_makes_the_exit_status_one(tmp_path, capsys):
    rc = before_after.main(["--base", "HEAD", "--only", "losses", "--loss-steps", "1", "--loss-shapes", "1x1",
                            "--timeout", "1", "--logs", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "failed: losses-1x1 on the base side (exit 124" in out, out
    assert "[killed after 1 s]" in (tmp_path / "losses-1x1.base.log").read_text()


def test_each_side_must_import_its_own_checkout(tmp_path):
    assert before_after.check_imports(before_after.Side("head", HEAD_ROOT)) is None
    problem = before_after.check_imports(before_after.Side("base", tmp_path))  # an empty folder
    assert problem and problem.startswith("the base "), problem


@needs_git
@pytest.mark.parametrize("flags, message", [
    (["--base", "no-such-revision"], "--base no-such-revision: not a commit of this repository."),
    (["--base", "HEAD", "--only", "speed"], "--only: unknown section speed"),
    (["--base", "HEAD", "--loss-shapes", "8"], "--loss-shapes: '8' is not ROWSxMICROBATCHES"),
    (["--base", "HEAD", "--pairs", "0"], "must be at least 1"),
])
def test_bad_flags_are_one_sentence_and_exit_two(flags, message, capsys):
    try:
        rc = before_after.main(flags)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_the_sides_take_turns():
    assert list(before_after.alternating(3)) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]

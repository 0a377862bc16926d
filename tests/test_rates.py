"""The figures a training loop prints: MFU never above its peak, a steady ETA, and the progress file
that `--health` reads (loss and tok/s, not only the step)."""

import math
import re

import pytest

from flaxchat import progress
from flaxchat.errors import cli_main
from flaxchat.rates import Peak, StepRate
from test_train import TINY


def test_a_spec_sheet_peak_is_never_re_timed():
    def probe():
        raise AssertionError("a spec-sheet peak is not measured")
    peak = Peak(spec=197e12, probe=probe)
    assert peak.mfu(98.5e12) == pytest.approx(50.0) and peak.flops == 197e12


def test_a_measured_peak_read_on_a_busy_machine_is_re_timed_and_mfu_stays_at_most_100():
    readings = iter([100e9, 160e9, 150e9])  # the first reading was taken under load
    said = []
    peak = Peak(probe=lambda: next(readings), log=said.append)
    assert peak.mfu(80e9) == pytest.approx(80.0)  # below the first reading: nothing re-timed
    assert peak.mfu(120e9) == pytest.approx(75.0) and peak.flops == 160e9  # re-timed: 160
    assert len(said) == 1 and "re-timed" in said[0]
    # A step faster than every matmul reading is itself the best rate measured on this machine.
    assert peak.mfu(200e9) == pytest.approx(100.0) and peak.flops == 200e9
    assert peak.mfu(150e9) == pytest.approx(75.0)  # the best peak stays


def test_the_eta_holds_steady_through_a_noisy_rate_and_follows_a_lasting_change():
    rate = StepRate()
    assert rate.eta(100) is None and rate.eta_text(100) == "-"
    raw, smoothed = [], []
    # 25-step windows whose speed swings 2.5x (a shared CPU), ~0.3 s per step on average (5 minutes).
    for i in range(40):
        per_step = 0.2 if i % 3 else 0.5
        rate.update(25, 25 * per_step)
        raw.append(1000 * per_step)
        smoothed.append(rate.eta(1000))
    swing = lambda xs: max(xs[20:]) / min(xs[20:])  # over the last 20 lines
    assert swing(raw) == pytest.approx(2.5) and swing(smoothed) < 1.2
    assert 250 < smoothed[-1] < 350  # about the mean rate, 0.3 s per step
    for _ in range(60):  # the machine becomes 3x slower for good (~20 minutes of it)
        rate.update(25, 25 * 0.9)
    assert rate.eta(1000) == pytest.approx(900, rel=0.02)


def test_pretrain_prints_mfu_at_most_100_and_writes_loss_and_tok_s_for_health(tmp_path, monkeypatch, capsys):
    # The machine is busy when the peak is timed: every matmul reading is far below what the steps do.
    import flaxchat.common
    monkeypatch.setattr(flaxchat.common, "matmul_flops", lambda *a, **k: 1e6)
    monkeypatch.setattr(flaxchat.common, "_cpu_peak_cache", {})
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setenv(progress.ENV, str(tmp_path / "progress.json"))
    from scripts import pretrain
    code = cli_main(pretrain.main, [*TINY, "--steps=4", f"--run-dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    mfus = [float(m) for m in re.findall(r"mfu ([\d.]+)%", out)]
    assert len(mfus) == 4 and max(mfus) <= 100.0, mfus
    assert "re-timed" in out
    etas = re.findall(r"eta (\S+)", out)
    assert etas[0] == "-" and all(re.fullmatch(r"\d+m\d\ds", e) for e in etas[1:]), etas
    record = progress.read(str(tmp_path / "progress.json"))
    assert record["step"] == 4 and math.isfinite(record["loss"]) and record["tok_s"] > 0

"""Goodput and cost from a ledger of recorded events (flaxchat/cloud/goodput.py): a pure function."""

import pytest

from flaxchat.cloud import goodput as gp

# A v4-16 (8 chips) as the launcher's ledger recorded one: READY, setup, a run that reached step 30
# (steps 1..30 in 100 s) and was preempted after its checkpoint at step 20; recreated, set up again,
# resumed at step 21 (so 10 steps were trained twice), finished at step 60.
LEDGER = [
    {"t": 0, "event": "up"},
    {"t": 70, "event": "setup", "t0": 10, "t1": 70},
    {"t": 70, "event": "start", "run_id": "a", "run_dir": "gs://b/r"},
    {"t": 150, "event": "progress", "run_id": "a", "step": 20, "step_t": 165.5, "first_step": 1, "first_t": 100},
    {"t": 200, "event": "progress", "run_id": "a", "step": 30, "step_t": 200, "first_step": 1, "first_t": 100},
    {"t": 210, "event": "down"},  # found PREEMPTED
    {"t": 212, "event": "down"},  # the recovery deletes it: not READY twice
    {"t": 300, "event": "up"},
    {"t": 330, "event": "setup", "t0": 300, "t1": 330},
    {"t": 330, "event": "start", "run_id": "b", "run_dir": "gs://b/r"},
    {"t": 340, "event": "progress", "run_id": "b", "step": 20, "step_t": 335},  # resumed at 20: compiling
    {"t": 500, "event": "progress", "run_id": "b", "step": 60, "step_t": 490, "first_step": 21, "first_t": 360},
]


def test_goodput_counts_setup_startup_and_the_steps_a_preemption_made_train_again():
    acc = gp.account(LEDGER, chips=8, now=500)
    assert acc["up_s"] == 210 + 200  # READY time only: charges accrue while READY
    assert acc["chip_hours"] == pytest.approx(410 * 8 / 3600)
    assert acc["setup_s"] == 60 + 30
    assert acc["startup_s"] == (100 - 70) + (360 - 330)  # start to first step: imports, restore, compile
    assert acc["redone_steps"] == 10 and acc["redone_s"] == pytest.approx(10 * 100 / 29)
    trained = (100 + 100 / 29) + (130 + 130 / 39)  # each run's first to last step, plus one step
    assert acc["train_s"] == pytest.approx(trained - 10 * 100 / 29)
    assert acc["goodput"] == pytest.approx(acc["train_s"] / 410)
    assert acc["runs"] == 2 and acc["restarts"] == 1


def test_an_earlier_run_folder_on_the_same_vm_is_not_counted():
    earlier = [{"t": -500, "event": "up"}, {"t": -400, "event": "start", "run_id": "z", "run_dir": "gs://b/old"},
               {"t": -300, "event": "progress", "run_id": "z", "step": 5, "step_t": -300}, {"t": -100, "event": "down"}]
    assert gp.account(earlier + LEDGER, 8, 500) == gp.account(LEDGER, 8, 500)


def test_the_cost_is_an_estimate_with_its_date_and_source_or_says_unknown():
    acc = gp.account(LEDGER, chips=8, now=500)
    text = gp.format_goodput(acc, "v4-16", spot=False, chips=8)
    assert text.startswith("goodput: ") and "0.91 chip-hours (8 chips x 6.8 min READY, 2 run(s), 1 restart(s))" in text
    assert "steps trained again after restarts 8% (34 s, 10 steps)" in text
    assert f"cost: about ${acc['chip_hours'] * 3.22:,.2f} (an estimate: v4-16 on-demand at $3.22 per chip-hour" in text
    assert "as of 2022-08-11" in text and "https://cloud.google.com/tpu/pricing" in text
    for accel, spot in (("v5litepod-8", False), ("v6e-8", True), ("v5p-8", False), ("v4-8", True)):
        line = gp.format_goodput(acc, accel, spot, 8).splitlines()[-1]
        assert line.startswith(f"  cost: unknown: no verified {'spot' if spot else 'on-demand'} price for {accel}")
    given = gp.format_goodput(acc, "v6e-8", True, 8, price_per_chip_hour=1.5).splitlines()[-1]
    assert f"about ${acc['chip_hours'] * 1.5:,.2f} (an estimate at the $1.50 per chip-hour" in given
    assert gp.format_goodput(gp.account([], 8, 0), "v4-8", False, 4).startswith("goodput: nothing recorded yet")

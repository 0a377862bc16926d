"""Goodput and cost of a run on a TPU VM: chip-hours, the share of them spent training, what the rest
went on, and an estimated bill.

The launcher appends events to a ledger beside its state file (`ledger_path`), one JSON line each,
timed by its own clock: `up` (the VM became READY), `down` (deleted, or found preempted or gone),
`setup` (t0, t1), `start` (a run_id started on the workers) and `progress` (worker 0's progress file
as a poll saw it: the step and when it finished, the first step this process trained and when). The
times in `progress` come from the workers' progress files as ages, so they are on the launcher's
clock too. `account` is a pure function of those events; `--health` and the end of `--recover` print
`format_goodput` of it.

What counts as lost: setup (upload, install), start-up (imports, the distributed start, restoring the
checkpoint, compiling the step: from a run's start to its first step), the steps trained again after
a restart (a preemption or a crash loses the steps after the last checkpoint; the resumed run's
first step says how many), and the rest of the VM's READY time (waiting for polls, the stage's own
end). Charges accrue while a node is READY, so chip-hours count `up` to `down`.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

# Per chip-hour, USD, list prices. Only what a stored copy of a public source states; a type that is
# not here is printed as "unknown" (--price-per-chip-hour gives one). Keyed by (generation, spot).
PRICES = {
    ("v4", False): {"usd": 3.22, "as_of": "2022-08-11",
                    "source": "https://cloud.google.com/tpu/pricing (v4 on-demand, as quoted in "
                              "https://www.infer-pub.com/questions/1114)"},
}
PRICE_PAGE = "https://cloud.google.com/tpu/pricing"


def ledger_path(state_file: str, project: str, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{project}.{name}")
    return os.path.join(os.path.dirname(os.path.abspath(state_file)), "ledger", f"{safe}.jsonl")


def append(path: str, event: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _current(events: list[dict]) -> list[dict]:
    """The events of the latest run folder: from the VM's `up` before its first start on."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return events
    run_dir = events[starts[-1]].get("run_dir")
    first = next(i for i in starts if events[i].get("run_dir") == run_dir)
    ups = [i for i, e in enumerate(events[:first]) if e["event"] == "up"]
    return events[ups[-1] if ups else first:]


def account(events: Iterable[dict], chips: int, now: float) -> dict:
    """Seconds by what they went on, for the latest run folder in `events` (see the module's doc).
    Returns {'up_s', 'chip_hours', 'setup_s', 'startup_s', 'train_s', 'redone_s', 'redone_steps',
    'other_s', 'goodput', 'runs', 'restarts'}; goodput is train_s (less what was redone) over up_s."""
    events = _current(sorted(events, key=lambda e: e["t"]))
    up_s, up_since = 0.0, None
    setup_s = 0.0
    runs: dict[str, dict] = {}
    order: list[str] = []
    for e in events:
        kind = e["event"]
        if kind == "up" and up_since is None:
            up_since = e["t"]
        elif kind == "down" and up_since is not None:
            up_s += e["t"] - up_since
            up_since = None
        elif kind == "setup":
            setup_s += e["t1"] - e["t0"]
        elif kind == "start":
            runs[e["run_id"]] = {"start": e["t"]}
            order.append(e["run_id"])
        elif kind == "progress" and e.get("run_id") in runs and e.get("step") is not None:
            r = runs[e["run_id"]]
            if e.get("first_step") is not None and not r.get("told"):  # the first step the stage trained
                r["first_step"], r["first_t"], r["told"] = e["first_step"], e["first_t"], True
            if "first_t" not in r:  # until it says (or a stage that never does): the first step seen
                r["first_step"], r["first_t"] = e["step"], e["step_t"]
            if e["step"] >= r.get("last_step", -1):
                r["last_step"], r["last_t"] = e["step"], e["step_t"]
    if up_since is not None:
        up_s += max(0.0, now - up_since)
    startup_s = train_s = redone_s = 0.0
    redone_steps, reached, prev_step_s = 0, None, None
    for rid in order:
        r = runs[rid]
        if "first_t" not in r:
            continue
        startup_s += max(0.0, r["first_t"] - r["start"])
        n = r["last_step"] - r["first_step"]
        step_s = (r["last_t"] - r["first_t"]) / n if n > 0 else prev_step_s or 0.0
        train_s += r["last_t"] - r["first_t"] + step_s  # the first step's own time as well
        if reached is not None and r["first_step"] <= reached:  # steps the run before had trained
            again = reached - r["first_step"] + 1
            redone_steps += again
            redone_s += again * (prev_step_s if prev_step_s else step_s)
        reached = max(reached or 0, r["last_step"])
        prev_step_s = step_s or prev_step_s
    good = max(0.0, train_s - redone_s)
    other = max(0.0, up_s - setup_s - startup_s - train_s)
    return {"up_s": up_s, "chip_hours": up_s * chips / 3600.0, "setup_s": setup_s, "startup_s": startup_s,
            "train_s": good, "redone_s": redone_s, "redone_steps": redone_steps, "other_s": other,
            "goodput": good / up_s if up_s > 0 else None, "runs": len(order), "restarts": max(0, len(order) - 1)}


def price_for(accelerator: str, spot: bool) -> dict | None:
    return PRICES.get((accelerator.split("-")[0].replace("litepod", "e"), spot))


def _fmt(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def format_goodput(acc: dict, accelerator: str, spot: bool, chips: int,
                   price_per_chip_hour: float | None = None) -> str:
    """The lines --health and --recover print: chip-hours, goodput and what the rest went on, cost."""
    up = acc["up_s"]
    if up <= 0:
        return "goodput: nothing recorded yet (the launcher records from the next --create, --setup or --run on)"

    def share(s, extra=""):
        return f"{100 * s / up:.0f}% ({_fmt(s)}{extra})"

    redone = f", {acc['redone_steps']} steps"
    lines = [f"goodput: {100 * acc['goodput']:.0f}% of {acc['chip_hours']:.2f} chip-hours ({chips} chips x "
             f"{_fmt(up)} READY, {acc['runs']} run(s), {acc['restarts']} restart(s))",
             f"  training {share(acc['train_s'])}; lost: setup {share(acc['setup_s'])}, start-up and compile "
             f"{share(acc['startup_s'])}, steps trained again after restarts {share(acc['redone_s'], redone)}, "
             f"other {share(acc['other_s'])}: polls, saves, the end"]
    kind = "spot" if spot else "on-demand"
    known = price_for(accelerator, spot)
    if price_per_chip_hour:
        lines.append(f"  cost: about ${acc['chip_hours'] * price_per_chip_hour:,.2f} (an estimate at the "
                     f"${price_per_chip_hour:.2f} per chip-hour given with --price-per-chip-hour)")
    elif known:
        lines.append(f"  cost: about ${acc['chip_hours'] * known['usd']:,.2f} (an estimate: {accelerator} {kind} at "
                     f"${known['usd']:.2f} per chip-hour, list price as of {known['as_of']}, {known['source']}; "
                     f"today's is on {PRICE_PAGE})")
    else:
        lines.append(f"  cost: unknown: no verified {kind} price for {accelerator} here; see {PRICE_PAGE} "
                     "and pass --price-per-chip-hour")
    return "\n".join(lines)

"""The two figures a training loop derives from its clock: MFU and the time left (ETA).

MFU divides the model's FLOP/s by a peak that cannot be exceeded. On a TPU or GPU that is the spec
sheet's bf16 peak (`flaxchat.common.PEAK_FLOPS_BY_KIND`). A CPU has no such figure that flaxchat
knows, so its peak is a jitted matmul timed on the machine, and a reading taken while other work
held the cores is too low: the main job printed `mfu 101.5%` and a pod rehearsal (several
processes on one 2-core machine) `mfu 347.2%` against one reading taken at the start. `Peak` keeps
the best of the run's readings instead: when a step's rate passes it, the matmul is timed again,
and a step that still passes it is itself the best rate this machine was measured at. So a printed
MFU is never above 100%.

The ETA divides the steps left by a smoothed step rate (`StepRate`), wall time included: a rate
from the last 25 steps alone swung the main job's ETA 12m24s -> 4m55s -> 10m31s on a shared 2-core
machine, and it left out the evaluations and saves that the remaining steps will pay for too.
"""

from __future__ import annotations

import math
from typing import Callable


class Peak:
    """The job's peak FLOP/s for MFU: `spec` (a spec sheet's, never changed) or, without one, the
    best of the readings of `probe` (a timed matmul) and of the rates the run itself reached."""

    def __init__(self, spec: float | None = None, probe: Callable[[], float] | None = None,
                 log: Callable[[str], None] | None = None):
        if spec is None and probe is None:
            raise ValueError("Peak needs a spec-sheet figure or a probe to time")
        self.spec, self.probe, self.log = spec, probe, log
        self.flops = spec if spec is not None else probe()
        self.first = self.flops

    @property
    def measured(self) -> bool:
        return self.spec is None

    def mfu(self, flops_per_s: float) -> float:
        """Percent of the peak; with a measured peak, re-timed when `flops_per_s` passes it."""
        if flops_per_s <= 0:
            return 0.0
        if self.measured and flops_per_s > self.flops:
            before = self.flops
            self.flops = max(self.flops, self.probe(), flops_per_s)
            if self.log:
                self.log(f"mfu: a step ran at {flops_per_s / 1e9:,.0f} GFLOP/s, above the measured matmul peak of "
                         f"{before / 1e9:,.0f}; re-timed, the peak is now the best rate of this run, "
                         f"{self.flops / 1e9:,.0f} GFLOP/s (a busy machine reads a low peak)")
        return 100.0 * flops_per_s / self.flops


class StepRate:
    """Seconds per step, smoothed exponentially in time: a window of `seconds` weighs
    1 - exp(-seconds / tau_s), so a short burst or stall moves the estimate little and a lasting
    change of speed takes over within a few tau. The first window sets it."""

    # The main job logs every 25 steps (~5-15 s on a shared 2-core CPU); with 180 s, one window
    # moves the estimate by 3-8% of its difference, and a change of speed that lasts shows within
    # a few minutes.
    TAU_S = 180.0

    def __init__(self, tau_s: float = TAU_S):
        self.tau_s = tau_s
        self.seconds_per_step: float | None = None

    def update(self, steps: int, seconds: float) -> None:
        if steps <= 0 or seconds <= 0:
            return
        window = seconds / steps
        if self.seconds_per_step is None:
            self.seconds_per_step = window
            return
        weight = 1.0 - math.exp(-seconds / self.tau_s)
        self.seconds_per_step += weight * (window - self.seconds_per_step)

    def eta(self, steps_left: int) -> float | None:
        """Seconds until `steps_left` more steps are done, or None before the first window."""
        if self.seconds_per_step is None:
            return None
        return max(0, steps_left) * self.seconds_per_step

    def eta_text(self, steps_left: int) -> str:
        """The ETA as the progress line prints it ('-' before the first window)."""
        from flaxchat.common import fmt_duration
        seconds = self.eta(steps_left)
        return "-" if seconds is None else fmt_duration(seconds)

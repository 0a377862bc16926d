"""The two figures a training loop derives from its clock: MFU and the time left (ETA).

MFU divides the model's FLOP/s by a peak that cannot be exceeded. On a TPU or GPU that is the spec
sheet's bf16 peak (`flaxchat.common.PEAK_FLOPS_BY_KIND`). A CPU has no such figure that flaxchat
knows, so its peak is a jitted matmul timed on the machine, and a reading taken while other work
held the cores is too low: the main job printed `mfu 101.5%` and a pod rehearsal (several
processes on one 2-core machine) `mfu 347.2%` against one reading taken at the start. `Peak` keeps
the best of the run's readings instead: when a step's rate passes it, the matmul is timed again,
and a step that still passes it is itself the best rate this machine was measured at. So a printed
MFU is never above 100%. A change of the peak is never silent: the log says so, and each train line
of metrics.jsonl records the `peak_flops` its MFU was counted against (scripts/pretrain.py).

The ETA divides the steps left by a smoothed step rate (`StepRate`), wall time included: the rate
of the last 25 steps alone swung the main job's ETA 12m24s -> 4m55s -> 10m31s on a shared 2-core
machine, and it left out the evaluations and saves that the remaining steps will pay for too.
"""

from __future__ import annotations

import math
from typing import Callable


class Peak:
    """The job's peak FLOP/s for MFU: `spec` (a spec sheet's, never changed) or, without one, the
    best of the readings of `probe` (a timed matmul) and of the rates the run itself reached."""

    def __init__(self, spec: float | None = None, probe: Callable[[], float] | None = None,
                 log: Callable[[str], None] | None = None, first: float | None = None):
        """`first`: a reading of `probe` already taken (else it is timed now)."""
        if spec is None and probe is None:
            raise ValueError("Peak needs a spec-sheet figure or a probe to time")
        self.spec, self.probe, self.log = spec, probe, log
        self.flops = spec if spec is not None else first if first is not None else probe()
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
                         f"{self.flops / 1e9:,.0f} GFLOP/s (a busy machine reads a low peak); MFU from here is "
                         "against it, and each line of metrics.jsonl records its peak_flops")
        return 100.0 * flops_per_s / self.flops


class StepRate:
    """Seconds per step over an exponentially fading window of time: the seconds and the steps of
    each new stretch are added to totals that first decay by exp(-seconds / tau), with tau a
    quarter of the time trained so far (10 s to 10 min), and the rate is their ratio. A short
    burst or stall moves it little, and a lasting change of speed takes over in a time that grows
    with the run.

    Why a time constant that grows: on two 400-step main-job runs on the shared 2-core machine, the
    ETA of the last 25 steps alone was off by 13% on average where the speed only jittered, and a
    fixed 180 s kept the first minutes' slow rate long after other work left the machine (the run
    became 5x faster; off by 200%). With a quarter of the elapsed time: off by 8% and 84%
    (the last 25 steps alone: 13% and 67%), and in the first run no ETA rose by more than 2 s from
    one line to the next (the last 25 steps alone: 13 s)."""

    FRACTION, MIN_TAU_S, MAX_TAU_S = 0.25, 10.0, 600.0

    def __init__(self, fraction: float = FRACTION, min_tau_s: float = MIN_TAU_S, max_tau_s: float = MAX_TAU_S):
        self.fraction, self.min_tau_s, self.max_tau_s = fraction, min_tau_s, max_tau_s
        self.seconds = self.steps = self.elapsed = 0.0

    @property
    def seconds_per_step(self) -> float | None:
        return self.seconds / self.steps if self.steps else None

    def update(self, steps: int, seconds: float) -> None:
        if steps <= 0 or seconds <= 0:
            return
        self.elapsed += seconds
        tau = min(self.max_tau_s, max(self.min_tau_s, self.fraction * self.elapsed))
        fade = math.exp(-seconds / tau)
        self.seconds = fade * self.seconds + seconds
        self.steps = fade * self.steps + steps

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


def job_peak(compute, log: Callable[[str], None]) -> Peak:
    """The `Peak` of a job's devices: the spec sheet's (its line also gives a timed bf16 matmul, so an
    MFU can be read against either), else the best of the run's own measured ones."""
    import jax.numpy as jnp

    from flaxchat.common import device_peak_flops, matmul_flops, spec_peak_flops
    spec = spec_peak_flops()
    peak = Peak(spec=spec * compute.device_count if spec else None,
                probe=lambda: device_peak_flops(compute, measure=True) * compute.device_count, log=log)
    if spec:
        measured = matmul_flops(8192, jnp.bfloat16)
        log(f"mfu: counted against the spec sheet's {spec / 1e12:.0f} TFLOP/s per device; a bf16 8192³ matmul "
            f"measures {measured / 1e12:.1f} here ({100 * measured / spec:.0f}% of it)")
    else:
        log(f"mfu: counted against a {jnp.dtype(compute.compute_dtype).name} matmul timed here, "
            f"{peak.flops / compute.device_count / 1e9:,.0f} GFLOP/s per device (no spec sheet for this device)")
    return peak

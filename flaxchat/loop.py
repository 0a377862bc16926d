"""The loop every training stage runs (pretraining, SFT, RL): a step, then hooks every N steps.

    loop = Loop("pretrain", steps, start=step, trainer=trainer, save=save, checkpointer=checkpointer,
                progress=progress, meter=Meter(steps, tokens_per_step=total), log=print0)
    loop.every(tc.log_every, log_line)               # hook(step), after the step and after the last
    loop.every(tc.eval_every, evaluate, last=tc.eval_every > 0)
    loop.every(tc.save_every, loop.save)             # the last step is always saved
    step = loop.run(train_one)                        # train_one(step) -> that step's loss (on device)

What the loop owns is what every stage did alike: the preemption and Ctrl-C notice (the step in
flight finishes and is saved, `flaxchat.stage.StopOnSignal`), the first step timed apart (it
compiles), the progress file, the `--profile-steps` window, and the `Meter` its log hooks read:
tokens per second over the time since the last reading, hooks left out; MFU against a peak that
cannot be exceeded (`flaxchat.rates.Peak`); the time left from a smoothed step rate, hooks
included (`flaxchat.rates.StepRate`); and the smoothed loss, which must stay finite. Before any
hook and before a save the trainer's arrays are put back into the model and optimizer
(`train.StepLoop.sync`), so a hook reads the model as it is. The loop is Levanter's trainer hooks in a
page; what a stage does every N steps stays in its own script.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

from flaxchat.errors import UserError


@dataclasses.dataclass
class Hook:
    """`fn(step)` after every `every`-th step (<= 0: never), after the last step when `last`, and
    after step 1 when `first`."""
    every: int
    fn: Callable[[int], Any]
    last: bool = True
    first: bool = False

    def due(self, step: int, steps: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.last and step == steps) or (self.first and step == 1)


@dataclasses.dataclass
class Reading:
    """What a log line shows: tokens/s since the last reading, MFU (None without a peak) and the ETA."""
    tok_s: float
    mfu: float | None
    eta: str


class Meter:
    """The figures a loop derives from its clock and its losses.

    tok/s counts the tokens trained since the last reading over the time spent training them: the
    first step (compile) and the hooks (evaluations, samples, saves) are left out. The ETA's rate
    counts wall time, hooks included, since the remaining steps pay for them too."""

    def __init__(self, steps: int, *, tokens_per_step: int = 0, flops_per_token: float | None = None,
                 peak=None, smoothing: float = 0.9, clock: Callable[[], float] = time.time):
        from flaxchat.rates import StepRate
        self.steps, self.tokens_per_step, self.flops_per_token, self.peak = steps, tokens_per_step, flops_per_token, peak
        self.smoothing, self.clock = smoothing, clock
        self.rate = StepRate()
        self.compile_s: float | None = None
        self.smooth: float | None = None  # the loss, smoothed over the log lines
        self.tok_s: float | None = None  # the last reading's
        self.trained_s = 0.0  # training time after the first step, hooks included
        self._window_s = self._tokens = 0.0
        self._rate_from = self._rate_at = self._started = None

    def first_step(self, step: int, seconds: float) -> None:
        """The first step of this process (compile included) took `seconds`."""
        self.compile_s = seconds
        self._rate_from, self._rate_at = step, self.clock()
        self._started = self.clock()

    def stepped(self, seconds: float) -> None:
        """A later step took `seconds` (dispatch to dispatch) and trained `tokens_per_step`."""
        self._window_s += seconds
        self._tokens += self.tokens_per_step

    def loss(self, step: int, value, hint: str) -> float:
        """The step's loss as a float, smoothed into `smooth`; a non-finite one ends the run with `hint`."""
        lossf = float(value)
        if not math.isfinite(lossf):
            raise UserError(f"the loss became {lossf} at step {step}; {hint}")
        self.smooth = lossf if self.smooth is None else self.smoothing * self.smooth + (1 - self.smoothing) * lossf
        return lossf

    def read(self, step: int) -> Reading:
        """tok/s and MFU since the last reading, and the time left; starts the next window."""
        self.tok_s = self._tokens / self._window_s if self._tokens and self._window_s > 0 else 0.0
        mfu = None
        if self.peak is not None and self.flops_per_token is not None:
            mfu = self.peak.mfu(self.tok_s * self.flops_per_token)
        if self._rate_at is not None:
            now = self.clock()
            self.rate.update(step - self._rate_from, now - self._rate_at)
            self._rate_from, self._rate_at = step, now
        self._window_s = self._tokens = 0.0
        return Reading(self.tok_s, mfu, self.rate.eta_text(self.steps - step))

    def ended(self) -> None:
        if self._started is not None:
            self.trained_s = self.clock() - self._started


class Loop:
    """Runs `train_one(step)` from `start` to `steps` with hooks (see the module docstring).

    `trainer`: what holds the model's and optimizer's arrays between steps (`flaxchat.train.StepLoop`;
    anything with `sync()`), synced before the hooks and the save. `save(step)` writes a checkpoint;
    the notice to stop calls it too. `profile`: a `flaxchat.profiling.StepProfiler` (or None)."""

    def __init__(self, name: str, steps: int, *, start: int, trainer, save: Callable[[int], None], checkpointer,
                 progress, meter: Meter, log: Callable[[str], None], processes: int = 1, grace_s: float = 25.0,
                 profile=None, announce_compile: bool = True, clock: Callable[[], float] = time.time):
        self.name, self.steps, self.start = name, steps, start
        self.trainer, self._save, self.checkpointer = trainer, save, checkpointer
        self.progress, self.meter, self.log, self.profile = progress, meter, log, profile
        self.processes, self.grace_s, self.announce_compile, self.clock = processes, grace_s, announce_compile, clock
        self.hooks: list[Hook] = []
        self.step = start
        self.loss = None  # the last step's loss, as the step returned it

    def every(self, n: int, fn: Callable[[int], Any], *, last: bool = True, first: bool = False) -> None:
        """Call `fn(step)` after every n-th step (n <= 0: never), after the last step when `last`
        (whatever n is), and after step 1 when `first`. Hooks run in the order they were added."""
        self.hooks.append(Hook(n, fn, last, first))

    def save(self, step: int) -> None:
        self.trainer.sync()
        self._save(step)

    def run(self, train_one: Callable[[int], Any]) -> int:
        """Train until `steps`; returns the step reached. `train_one(step)` trains step+1."""
        from flaxchat.stage import StopOnSignal
        # SIGTERM (a preemption's notice) or Ctrl-C: the step in flight is saved, then the run stops
        with StopOnSignal(self.log, processes=self.processes, grace_s=self.grace_s) as notice:
            while self.step < self.steps:
                notice.stop_here(self.step, self.checkpointer, self.save)
                self._one(train_one)
        if self.profile is not None:
            self.profile.close(self.loss)
        self.trainer.sync()
        self.meter.ended()
        return self.step

    def _one(self, train_one) -> None:
        import jax
        t0 = self.clock()
        loss = train_one(self.step)
        self.step, self.loss = self.step + 1, loss
        first = self.meter.compile_s is None
        due = [h for h in self.hooks if h.due(self.step, self.steps)]
        # The step is waited for where something reads it: the first (it allocates everything, so out
        # of memory shows here), before hooks, and for the progress file (a finished step, not a
        # dispatched one). That wait is training time; the hooks' own time is not.
        report = self.progress.due()
        if first or due or report:
            jax.block_until_ready(loss)
        seconds = self.clock() - t0
        if self.profile is not None:
            self.profile.at(self.step, loss)
        if first:
            self.meter.first_step(self.step, seconds)
            if self.announce_compile:
                self.log(f"compiled the train step in {seconds:.1f}s")
        else:
            self.meter.stepped(seconds)
        if report:
            self.progress.update(self.step, loss=None if loss is None else float(loss), tok_s=self.meter.tok_s)
        if due:
            self.trainer.sync()
            for hook in due:
                hook.fn(self.step)

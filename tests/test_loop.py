"""flaxchat.loop: the loop every stage runs, with a stand-in step (the stages' own runs are pinned
bit for bit by the end-to-end tests; here the hooks, the meter and the stop are checked alone)."""

import json
import signal

import pytest

from flaxchat.errors import Preempted, UserError
from flaxchat.loop import Hook, Loop, Meter
from flaxchat.progress import Progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Trainer:
    """Counts syncs, and what the model 'is' at each one (the steps trained so far)."""

    def __init__(self):
        self.trained, self.synced_at = 0, []

    def sync(self):
        self.synced_at.append(self.trained)


class Checkpointer:
    """What the loop and the stop notice ask of flaxchat.checkpoint.Checkpointer."""

    def __init__(self, saved):
        self.saved, self.closed = saved, False

    def raise_if_failed(self):
        pass

    def latest_step(self):
        return self.saved[-1] if self.saved else None

    def close(self):
        self.closed = True


def make_loop(steps, clock, trainer, saved, start=0, progress=None, **kw):
    meter = Meter(steps, tokens_per_step=100, clock=clock)
    return Loop("test", steps, start=start, trainer=trainer, save=saved.append, checkpointer=Checkpointer(saved),
                progress=progress or Progress("test", path=""), meter=meter, log=lambda s: None, clock=clock, **kw)


@pytest.mark.parametrize("hook, fired", [
    (Hook(3, None), [3, 6, 7]),  # every 3rd, and the last (7)
    (Hook(3, None, last=False), [3, 6]),
    (Hook(0, None), [7]),  # never by count; the last step still (a final save)
    (Hook(0, None, last=False), []),
    (Hook(5, None, first=True), [1, 5, 7]),
])
def test_a_hook_fires_every_n_steps_at_the_last_and_at_step_1(hook, fired):
    assert [s for s in range(1, 8) if hook.due(s, 7)] == fired


def test_hooks_run_in_order_after_a_sync_and_see_the_step_they_follow():
    clock, trainer, saved, calls = Clock(), Trainer(), [], []
    loop = make_loop(6, clock, trainer, saved)
    loop.every(2, lambda s: calls.append(("log", s, trainer.synced_at[-1])))
    loop.every(3, lambda s: calls.append(("eval", s, trainer.synced_at[-1])), last=False)
    loop.every(4, loop.save)

    def train_one(at):
        trainer.trained = at + 1
        clock.now += 1.0
        return float(at)

    assert loop.run(train_one) == 6
    assert calls == [("log", 2, 2), ("eval", 3, 3), ("log", 4, 4), ("log", 6, 6), ("eval", 6, 6)]
    assert saved == [4, 6]  # every 4th and the last
    assert trainer.synced_at[-1] == 6  # synced once more when the loop ends


def test_the_meter_leaves_the_compile_and_the_hooks_out_of_tok_s_but_not_out_of_the_eta():
    clock, trainer, saved, seen = Clock(), Trainer(), [], []
    loop = make_loop(5, clock, trainer, saved)

    def slow_hook(at):
        clock.now += 10.0  # an evaluation: not training time
        seen.append(loop.meter.read(at))

    loop.every(2, slow_hook, last=False)

    def train_one(at):
        clock.now += 30.0 if at == 0 else 2.0  # the first step compiles
        return 1.0

    loop.run(train_one)
    assert loop.meter.compile_s == 30.0
    # step 2: one step (2 s, 100 tokens) since the compiled one; step 4: two steps since step 2
    assert [r.tok_s for r in seen] == [50.0, 50.0]
    # the ETA's rate counts wall time, the hook's 10 s included: (2 + 10) s for the one step to step 2
    assert loop.meter.rate.seconds_per_step > 2.0


def test_a_non_finite_loss_ends_the_run_in_one_sentence_and_the_loss_is_smoothed():
    meter = Meter(10, smoothing=0.5)
    assert meter.loss(1, 4.0, "lower it.") == 4.0 and meter.loss(2, 2.0, "lower it.") == 2.0
    assert meter.smooth == 3.0
    with pytest.raises(UserError, match=r"the loss became nan at step 3; lower it\."):
        meter.loss(3, float("nan"), "lower it.")


def test_ctrl_c_in_a_step_saves_that_step_and_stops(tmp_path):
    clock, trainer, saved = Clock(), Trainer(), []
    progress = Progress("test", steps=10, path=str(tmp_path / "progress.json"), min_interval_s=0.0)
    loop = make_loop(10, clock, trainer, saved, start=2, progress=progress)

    def train_one(at):
        trainer.trained = at + 1
        if at == 4:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while step 5 runs: it finishes, then stops
        return float(at)

    with pytest.raises(KeyboardInterrupt):
        loop.run(train_one)
    assert saved == [5] and trainer.synced_at[-1] == 5  # the arrays were put back before the save
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 5


def test_sigterm_saves_the_step_and_says_preempted():
    clock, trainer, saved = Clock(), Trainer(), []
    loop = make_loop(10, clock, trainer, saved)

    def train_one(at):
        if at == 1:
            signal.raise_signal(signal.SIGTERM)
        return 0.0

    with pytest.raises(Preempted):
        loop.run(train_one)
    assert saved == [2]
    assert loop.checkpointer.closed  # the write landed before the process ends


def test_a_stop_right_after_a_save_does_not_save_the_step_again():
    clock, trainer, saved = Clock(), Trainer(), []
    loop = make_loop(10, clock, trainer, saved)
    loop.every(3, loop.save)

    def train_one(at):
        if at == 2:
            signal.raise_signal(signal.SIGINT)  # during step 3, which its hook saves
        return 0.0

    with pytest.raises(KeyboardInterrupt):
        loop.run(train_one)
    assert saved == [3]

"""What every training stage (pretraining, SFT, RL) does around its own recipe, in one place.

    checkpointer, step, meta = open_checkpoints(run_dir, fresh=..., keep=..., is_main=..., log=print0)
    ...the stage's recipe: model, optimizer (sharding.create_sharded), data, loop (Progress)...
    finish(run_dir, is_main, checkpointer, progress, step, summary, report)

`open_checkpoints` is resume-or-start: `--fresh` sets the old checkpoints aside (never deletes
them; process 0 only, then every process waits), and the newest intact step (its files match the
checksums it was written with; a damaged newer one is moved aside with one line) with its meta is
what the stage resumes from. `finish` is the tail: the last save is flushed, the progress file
records the final step on every process, process 0 writes the report and then `COMPLETE` (what
launchers wait for), so a `COMPLETE` never stands beside a half-written report. Both go through
`flaxchat.paths` and Orbax, so the run folder may be local or `gs://`. `flaxchat.finetune` builds
the later stages' model/optimizer opening on top of these; `scripts.pretrain` uses them directly.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable


class StopOnSignal:
    """A notice to stop during a stage's loop: SIGTERM (a spot/preemptible TPU VM's preemption, the end
    of a Kaggle session, the launcher's stop) or SIGINT (Ctrl-C). The step in flight finishes; at the
    next loop top `stop_here` saves that step, waits for the write, and raises `Preempted` (exit 75)
    for SIGTERM or KeyboardInterrupt (exit 130) for Ctrl-C, so the same command resumes having lost
    at most the step in flight. A second signal stops at once (SIGTERM's default action, Ctrl-C's
    KeyboardInterrupt).

    Several processes: JAX's preemption notifier owns SIGTERM (`jax.distributed.initialize`
    installs it; it tells the other processes through the coordination service) and every process
    asks `reached_preemption_sync_point(step)` at each loop top (a local flag until a notice comes:
    6-8 µs a step on CPU): they stop at the same step, the one after the largest any of them had
    reached, so none saves a step another has not trained. Ctrl-C
    stays the default there (one terminal does not reach every host).

    `grace_s` counts from the notice (from the agreed step on several processes): when the save has
    not landed by then, one line says so and the process exits 75 on its own, before the cloud's
    kill (about 30 s after the notice); the previous checkpoint is then what a resume starts from.
    `sync_point` is injectable for tests; by default JAX's."""

    def __init__(self, log: Callable[[str], None], *, processes: int = 1, grace_s: float = 25.0,
                 sync_point: Callable[[int], bool] | None = None):
        self.log, self.processes, self.grace_s = log, processes, grace_s
        self.requested: int | None = None  # the signal that asked to stop
        self._sync_point, self._previous, self._timer, self._step = sync_point, {}, None, None

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread (a stage run from a notebook's worker)
        ours = (signal.SIGINT, signal.SIGTERM) if self.processes == 1 else ()
        for sig in ours:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.processes > 1 and self._sync_point is None:
            from jax.experimental import multihost_utils
            self._sync_point = multihost_utils.reached_preemption_sync_point
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            return
        self._notice(signum)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.log(f"\n{what}: stopping after this step and saving a checkpoint "
                 f"({what} again to stop at once; {self.grace_s:g} s to save)")

    def _notice(self, signum: int) -> None:
        """Stop requested: the next signal stops at once, and the grace clock starts."""
        self.requested = signum
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # on several processes this replaces JAX's notifier
        self._timer = threading.Timer(self.grace_s, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        from flaxchat.errors import ExitCode
        at = f"the save of step {self._step}" if self._step is not None else \
            "the step in flight (with an evaluation or sampling after it, if one was due)"
        self.log(f"{at} did not finish within the {self.grace_s:g} s grace period (--preempt-grace); exiting "
                 "unsaved: the run resumes from its previous checkpoint.")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ExitCode.PREEMPTED if self.requested == signal.SIGTERM else ExitCode.STOPPED)

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def stop_here(self, step: int, checkpointer, save: Callable[[int], None]) -> None:
        """Called at the top of each iteration (on several processes by every process, at every step):
        when a stop was asked for, save `step` (unless it is saved already or nothing was trained),
        wait for the write, and raise Preempted or KeyboardInterrupt. Also where a background save
        that failed (a full disk) stops the loop, as one UserError."""
        from flaxchat.errors import Preempted
        checkpointer.raise_if_failed()
        if self.requested is None and self._sync_point is not None and self._sync_point(step):
            self._notice(signal.SIGTERM)
            self.log(f"preemption notice: every process stops at step {step} and saves it")
        if self.requested is None:
            return
        self._step = step
        if step > 0 and checkpointer.latest_step() != step:
            save(step)
        checkpointer.close()  # the asynchronous write lands before the process ends
        self._timer.cancel()
        self.log(f"stopped at step {step}; " + ("run the same command to resume from it." if step > 0 else
                                                "nothing was trained yet."))
        if self.requested == signal.SIGTERM:
            raise Preempted(f"preempted at step {step}")
        raise KeyboardInterrupt


def barrier(name: str) -> None:
    """Every process of the job reaches this point before any goes on (a no-op in one process)."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def open_checkpoints(run_dir: str, *, fresh: bool, keep: int, is_main: bool, log: Callable[[str], None],
                     name: str = "stage"):
    """(checkpointer, resume step or None, its meta or None) for `run_dir/checkpoints`. Process 0
    first takes the run folder's lock (`flaxchat.run_lock`: a second writer is refused in one
    sentence naming the first), which `checkpointer.close()` gives back."""
    from flaxchat import checkpoint as ckpt
    from flaxchat import paths
    from flaxchat.run_lock import RunLock
    lock = RunLock.acquire(run_dir, log=log) if is_main else None
    try:
        ckpt_dir = paths.RunFolder(run_dir).checkpoints
        if fresh and is_main:
            moved = ckpt.set_aside(ckpt_dir)
            if moved:
                log(f"--fresh: moved the existing checkpoints to {moved}")
        barrier(f"{name}-fresh")
        found = paths.listdirs(ckpt_dir)  # before opening: the owner's opening removes a cut-short save
        checkpointer = ckpt.Checkpointer(ckpt_dir, max_to_keep=keep)
        step = meta = None
        if checkpointer.all_steps():
            # A damaged latest step (checksums) is moved aside by process 0 and the newest intact one
            # resumed; every process checks, so all of them agree on the step.
            step, meta = checkpointer.newest_intact(log=log, move_damaged=is_main)
        elif not fresh:
            started = starting_over(run_dir, found)
            if started:
                log(f"{name}: {started}")
        barrier(f"{name}-intact")
        checkpointer.reload()
        checkpointer.run_lock = lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return checkpointer, step, meta


def open_run(run_dir: str, *, name: str, fresh: bool, keep: int, compute, model_cfg, tokenizer,
             log: Callable[[str], None], fix: str):
    """`open_checkpoints`, then the resumed checkpoint checked against the model and tokenizer this
    run builds: one sentence ending in `fix` when they differ. What every stage opens its run with."""
    from flaxchat.config import GPTConfig
    from flaxchat.errors import UserError
    checkpointer, step, meta = open_checkpoints(run_dir, fresh=fresh, keep=keep, is_main=compute.is_main, log=log,
                                                name=name)
    if meta is not None:
        saved = GPTConfig.from_dict(meta["model_config"])
        if saved != model_cfg:
            checkpointer.close()
            raise UserError(f"{run_dir} holds a checkpoint of a different model (depth {saved.n_layer}, width "
                            f"{saved.n_embd}, seq {saved.sequence_len}); {fix}")
        tokenizer.check_matches(meta.get("tokenizer"), f"the checkpoint in {run_dir}", fix)
    return checkpointer, step, meta


def place(compute, sharding: str, make_model, make_optimizer, n_params: int):
    """(model, optimizer, compute on its mesh, layout): dp or fsdp (`auto`: what fits), the mesh set
    for the run (activation constraints resolve on it), and every array born on it. Even on one
    device: arrays left uncommitted would come back from the first step committed to the mesh, and
    the changed input types would compile the step twice."""
    import jax

    from flaxchat import sharding as shard
    layout = shard.choose(sharding, 4 * n_params, 2.0, shard.device_memory_bytes())
    compute = compute.with_sharding(layout)
    jax.set_mesh(compute.mesh)
    model, optimizer = shard.create_sharded(make_model, make_optimizer, compute.mesh)
    return model, optimizer, compute, layout


def starting_over(run_dir: str, found: list[str]) -> str | None:
    """The line a stage prints when `run_dir` shows an earlier run but no intact step to resume
    (`found`: the folder names in its checkpoints folder before it was opened): a save cut short
    (Orbax's `<step>.orbax-checkpoint-tmp*` on a disk, a `<step>` without `commit_success.txt` on a
    bucket), or metrics logged before the first save. None for a new run folder."""
    from flaxchat import paths
    run = paths.RunFolder(run_dir)
    cut = [n for n in found if n.split(".", 1)[0].isdigit()]
    if cut:
        what = f"{run.checkpoints} holds no intact step, only {', '.join(cut)} (a save cut short)"
    elif paths.exists(run.metrics):
        what = f"{run.metrics} shows an earlier run, but it saved no checkpoint"
    else:
        return None
    kept = f" (the earlier run's lines stay in {run.METRICS})" if cut and paths.exists(run.metrics) else ""
    return f"{what}; starting at step 0{kept}"


def finish(run_dir: str, is_main: bool, checkpointer, progress, step: int, summary: dict,
           report: Callable[[], None] | None = None) -> dict:
    """Flush the checkpointer, record the last step, then (process 0) the report and `COMPLETE`."""
    from flaxchat import paths
    from flaxchat.report import write_json
    checkpointer.close()
    progress.update(step, force=True)
    if is_main:
        if report is not None:
            report()
        write_json(paths.RunFolder(run_dir).complete, summary)
    return summary


def already_complete(run_dir: str, step: int | None, steps: int) -> dict | None:
    """The record of a finished run (its `COMPLETE`, as `finish` wrote it) when this stage would
    resume at its last step with nothing left to train: then the stage says so and writes nothing,
    so a rerun keeps the report, plot and samples of the run that trained. None otherwise (a larger
    --steps trains further; a run killed after its last save but before `COMPLETE` finishes its record)."""
    import json

    from flaxchat import paths
    marker = paths.RunFolder(run_dir).complete
    if step is None or step < steps or not paths.exists(marker):
        return None
    try:
        record = json.loads(paths.read_text(marker))
    except (OSError, ValueError):
        return None  # a marker that does not read: finish the record again
    return record if isinstance(record, dict) and record.get("step") == step else None


def complete_line(run_dir: str, step: int) -> str:
    """What a rerun of a finished run says (`already_complete`), the same for every stage."""
    return (f"complete: {run_dir} finished at step {step:,} (its COMPLETE); nothing to train, nothing rewritten. "
            "A larger --steps trains further; --fresh starts over.")

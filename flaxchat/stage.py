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

import signal
import threading
from typing import Callable


def check_bookkeeping(keep_checkpoints: int, **every: int) -> None:
    """One sentence for the checkpoint and cadence flags every stage has, before anything is written:
    Orbax told to keep 0 checkpoints deletes each one as it is saved, the last one too."""
    from flaxchat.errors import UserError
    if keep_checkpoints < 1:
        raise UserError(f"--keep-checkpoints must be at least 1 (got {keep_checkpoints}): the last checkpoint is "
                        "what a run resumes from and what the next stage loads.")
    for name, n in every.items():
        if n < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 (never) or more (got {n}).")


class StopOnCtrlC:
    """Ctrl-C during a stage's loop: the step in flight finishes, the loop saves a checkpoint at that
    step boundary and stops (`stop_here`), so the same command resumes instead of starting over. A
    second Ctrl-C stops at once, as before. One process only: a save is collective, and on a pod the
    launcher stops the run; there the default KeyboardInterrupt stays."""

    def __init__(self, enabled: bool, log: Callable[[str], None]):
        self.enabled, self.log, self.requested, self._previous = enabled, log, False, None

    def __enter__(self) -> "StopOnCtrlC":
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt now
        self.log("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)")

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def stop_here(self, step: int, checkpointer, save: Callable[[int], None]) -> None:
        """Called at the top of each iteration: when Ctrl-C was pressed, save `step` (unless it is
        saved already or nothing was trained), wait for the write, and raise KeyboardInterrupt.
        Also where a background save that failed (a full disk) stops the loop, as one UserError."""
        checkpointer.raise_if_failed()
        if not self.requested:
            return
        if step > 0 and checkpointer.latest_step() != step:
            save(step)
        checkpointer.close()  # the asynchronous write lands before the process ends
        self.log(f"stopped at step {step}; " + ("run the same command to resume from it." if step > 0 else
                                                "nothing was trained yet."))
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
        checkpointer = ckpt.Checkpointer(ckpt_dir, max_to_keep=keep)
        step = meta = None
        if checkpointer.all_steps():
            # A damaged latest step (checksums) is moved aside by process 0 and the newest intact one
            # resumed; every process checks, so all of them agree on the step.
            step, meta = checkpointer.newest_intact(log=log, move_damaged=is_main)
        barrier(f"{name}-intact")
        checkpointer.reload()
        checkpointer.run_lock = lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return checkpointer, step, meta


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

"""The progress file: how a running stage tells a supervisor that it is alive, on every process.

A supervisor (the pod worker `flaxchat/runner/worker.py`, the Kaggle job wrapper) sets
`FLAXCHAT_PROGRESS_FILE` to a local path before it starts a stage; every process of the stage then
rewrites that file, atomically, after each optimizer step:

    {"schema": 1, "step": 120, "steps": 1000, "time": 1764579000.5, "pid": 4242, "process": 3,
     "loss": 3.21, "tok_s": 12345.0, "stage": "pretrain", "first_step": 101, "first_time": 1764578990.1,
     "run_dir": "gs://b/d24", "marker": "gs://b/d24/COMPLETE"}

`time` is the wall clock of the last step, so "how long since this process made progress" is
`now - time`: the liveness a supervisor needs. `first_step` and `first_time` are the first step
this process trained and when: the end of its start-up (imports, restore, compile), which the
launcher's goodput counts as lost time. `run_dir` and `marker` say where the stage writes and
which file it writes last when it has finished (`flaxchat.paths.RunFolder`), so a supervisor that
was not told the run folder learns it from the stage instead of parsing its command. Only process 0 prints, so output is no heartbeat on
a pod; this file is, and it is never parsed out of a human-readable line. Without the variable the
stage writes nothing (a laptop run has no supervisor). Writes are throttled to one a second: a
step of a few milliseconds must not spend its time in the filesystem.
"""

from __future__ import annotations

import json
import os
import time

from flaxchat.paths import write_json

ENV = "FLAXCHAT_PROGRESS_FILE"
SCHEMA = 1
MIN_INTERVAL_S = 1.0  # the throttle: one write a second at most


class Progress:
    """Writes the progress file named by $FLAXCHAT_PROGRESS_FILE (a no-op when it is unset)."""

    def __init__(self, stage: str, steps: int | None = None, process: int = 0, path: str | None = None,
                 min_interval_s: float | None = None, clock=time.time, run_dir: str | None = None):
        self.path = path if path is not None else os.environ.get(ENV, "")
        self.stage, self.steps, self.process = stage, steps, process
        self.where = {}
        if run_dir:
            from flaxchat.paths import RunFolder
            self.where = {"run_dir": str(run_dir), "marker": RunFolder(run_dir).complete}
        self.min_interval_s = MIN_INTERVAL_S if min_interval_s is None else min_interval_s
        self.clock = clock
        self._last_write = None
        self._fields: dict = {}  # the last loss, tok_s, ... given: kept by updates that name none
        self._first: dict = {}  # the first step this process trained, and when: start-up ends there (goodput)
        self._start: int | None = None

    def due(self) -> bool:
        """True when the next `update` would write (the caller may first wait for the step to finish,
        so that a device stuck in a collective shows as no progress rather than dispatched work)."""
        return bool(self.path) and (self._last_write is None or self.clock() - self._last_write >= self.min_interval_s)

    def update(self, step: int, force: bool = False, **fields) -> None:
        """Record that `step` is done (now). `fields` may add loss, tok_s, ... (numbers or None); a
        field not given keeps its last value, so the closing update still shows the last loss."""
        if not self.path:
            return
        self._fields.update({k: v for k, v in fields.items() if v is None or isinstance(v, (int, float, str))})
        now = self.clock()
        # The first update announces the step the stage starts from (before its first compile); the
        # first step past it is the first one trained.
        if self._start is None:
            self._start = int(step)
        elif not self._first and step > self._start:
            self._first = {"first_step": int(step), "first_time": now}
        if not force and self._last_write is not None and now - self._last_write < self.min_interval_s:
            return
        record = dict(schema=SCHEMA, stage=self.stage, step=int(step), steps=self.steps, time=now,
                      pid=os.getpid(), process=self.process, **self.where)
        record.update(self._fields, **self._first)
        try:
            write_json(self.path, record)
            self._last_write = now
        except OSError:
            pass  # liveness is advisory: a full disk must not end a training run


def read(path: str) -> dict | None:
    """The last record in a progress file, or None if there is none (yet) or it is not ours."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("schema") == SCHEMA else None

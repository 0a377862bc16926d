"""Experiment trackers: what a stage writes to metrics.jsonl, also sent to Weights & Biases and/or TensorBoard.

A stage opens its trackers once (`open_trackers`, `--tracker wandb,tensorboard`) and hands them to its
`flaxchat.report.MetricsLog`, which forwards every line it appends (and every `note`, e.g. sampled
text) to each of them: one sink, so the trackers show exactly the figures of metrics.jsonl. A
tracker's contract is two methods, `log(entry)` (a metrics line: `kind`, `step` and figures) and
`close()`. Only the main process opens any (the others get none).

A resumed run (after a preemption, on another VM, in the next Kaggle session) continues the same
W&B run and the same TensorBoard folder: `<run>/trackers.json` records the W&B run id, and the
TensorBoard writer purges the steps after the one the run resumed at (a step logged before the kill
but not checkpointed is logged again). W&B history rows carry the step as their `step` key (every
figure is plotted against it), so repeated steps after a resume are kept rather than refused.

Neither library is imported unless asked: `check_trackers` answers a missing one with the install
line before any work, without importing it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import tempfile
import time
from typing import Any, Callable, Protocol

from flaxchat import paths
from flaxchat.errors import UserError

# name -> (module it needs, the pinned install line of pyproject.toml's extra)
TRACKERS = {
    "wandb": ("wandb", 'pip install "flaxchat[wandb]" (wandb==0.29.0)'),
    "tensorboard": ("tensorboardX", 'pip install "flaxchat[tensorboard]" (tensorboardX==2.6.5)'),
}
IDS_FILE = "trackers.json"
SKIP = ("kind", "step", "time")  # keys of a metrics line that are not figures


class Tracker(Protocol):
    def log(self, entry: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def parse_trackers(text: str) -> tuple[str, ...]:
    """`--tracker`: 'none', a name, or a comma list of names -> the names, in order, without 'none'."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n != "none" and n not in TRACKERS]
    if bad:
        raise UserError(f"--tracker {text!r}: unknown tracker {bad[0]!r}; use wandb, tensorboard, none, "
                        "or a comma list such as wandb,tensorboard.")
    return tuple(n for n in names if n != "none")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (blocked)
        return False


def check_trackers(text: str) -> tuple[str, ...]:
    """The names of `--tracker`, each checked to be installed (found, not imported)."""
    names = parse_trackers(text)
    for name in names:
        module, install = TRACKERS[name]
        if not _installed(module):
            raise UserError(f"--tracker {name} needs the {module} package, which is not installed: {install}.")
    return names


def open_trackers(text: str, run_dir: str, *, stage: str, run_name: str = "", config: dict | None = None,
                  start_step: int = 0, fresh: bool = False, is_main: bool = True) -> list[Tracker]:
    """The trackers `--tracker` names for the run in `run_dir` (none off the main process), resuming
    the W&B run recorded in `<run_dir>/trackers.json` unless `fresh`. `config` is logged once;
    `start_step` is the step the stage continues from (0 when it starts)."""
    names = check_trackers(text)
    if not names or not is_main:
        return []
    ids_path = paths.join(run_dir, IDS_FILE)
    ids = {} if fresh or not paths.exists(ids_path) else json.loads(paths.read_text(ids_path))
    name = run_name or paths.basename(paths.absolute(run_dir).rstrip("/"))
    out: list[Tracker] = []
    if "wandb" in names:
        out.append(WandbTracker(run_dir, ids, name=name, stage=stage, config=config or {}))
    if "tensorboard" in names:
        out.append(TensorBoardTracker(paths.join(run_dir, "tensorboard"), start_step=start_step,
                                      config=config or {}))
        ids["tensorboard"] = dict(logdir=paths.absolute(paths.join(run_dir, "tensorboard")))
    paths.write_json(ids_path, ids, indent=2, sort_keys=True)
    return out


def figures(entry: dict) -> tuple[dict[str, float], dict[str, list[str]]]:
    """A metrics line's numbers as `kind/key` -> value, and its texts (a string or a list of them)."""
    kind = entry.get("kind", "train")
    nums, texts = {}, {}
    for key, value in entry.items():
        if key in SKIP or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, str, list, tuple)):
            continue
        if isinstance(value, (int, float)):
            nums[f"{kind}/{key}"] = float(value)
        else:
            texts[f"{kind}/{key}"] = [value] if isinstance(value, str) else [str(v) for v in value]
    return nums, texts


class WandbTracker:
    """One W&B run per stage's run folder, its id kept in trackers.json (resume="allow" continues it).
    Offline (WANDB_MODE=offline) its files are written under the run folder's `wandb/` when that is
    local; `wandb sync` uploads them later."""

    def __init__(self, run_dir: str, ids: dict, *, name: str, stage: str, config: dict):
        import wandb
        self._wandb = wandb
        rec = ids.get("wandb") or {}
        run_id = rec.get("id") or secrets.token_hex(4)  # W&B ids: [a-z0-9], unique per project
        project = rec.get("project") or os.environ.get("WANDB_PROJECT", "flaxchat")
        folder = paths.absolute(run_dir) if not paths.is_remote(run_dir) else tempfile.mkdtemp(prefix="flaxchat-wandb-")
        self.run = wandb.init(project=project, id=run_id, name=rec.get("name") or name, job_type=stage,
                              config=config, dir=folder, resume="allow", reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # a resume's repeated steps are kept, not refused
        ids["wandb"] = dict(id=run_id, project=project, name=rec.get("name") or name,
                            entity=getattr(self.run, "entity", None) or None)

    def log(self, entry: dict) -> None:
        nums, texts = figures(entry)
        row: dict[str, Any] = dict(nums, step=entry["step"])
        for key, lines in texts.items():
            row[key] = self._wandb.Table(columns=["text"], data=[[t] for t in lines])
        self.run.log(row)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """TensorBoard event files in `<run>/tensorboard/` (tensorboardX's writer). A new session writes
    a new file beside the old ones, starting with a purge of the steps after `start_step`, so a
    reader shows each step once. For a gs:// run folder the files are written to a local folder and
    uploaded whole through `flaxchat.paths` at most every `upload_every_s` seconds and on close (an
    object store cannot append)."""

    def __init__(self, logdir: str, *, start_step: int = 0, config: dict | None = None,
                 upload_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        from tensorboardX import SummaryWriter
        self.logdir, self._clock, self.upload_every_s = logdir, clock, upload_every_s
        self._remote = paths.is_remote(logdir)
        local = tempfile.mkdtemp(prefix="flaxchat-tb-") if self._remote else logdir
        self._local = local
        self.writer = SummaryWriter(local, purge_step=start_step + 1, flush_secs=30)
        if config and start_step == 0:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)
        self._uploaded_at = clock()

    def log(self, entry: dict) -> None:
        nums, texts = figures(entry)
        step = int(entry["step"])
        for key, value in nums.items():
            self.writer.add_scalar(key, value, step, walltime=entry.get("time"))
        for key, lines in texts.items():
            self.writer.add_text(key, "\n\n".join("    " + t.replace("\n", "\n    ") for t in lines), step)
        self.writer.flush()  # a kill -9 loses no logged step (the writer's own flush is every 30 s)
        if self._remote and self._clock() - self._uploaded_at >= self.upload_every_s:
            self._upload()

    def _upload(self) -> None:
        for name in sorted(os.listdir(self._local)):
            with open(os.path.join(self._local, name), "rb") as f:
                paths.write_bytes(paths.join(self.logdir, name), f.read())
        self._uploaded_at = self._clock()

    def close(self) -> None:
        self.writer.close()
        if self._remote:
            self._upload()

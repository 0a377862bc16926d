"""Orbax checkpoints of {model, optimizer, meta} with exact resume, checksums, and read-only readers.

Layout: <run_dir>/checkpoints/<step>/{model,optimizer,meta,flaxchat_checksums.json}. `meta` is
JSON: the resolved model and training configs, the step, the data loader's position and anything
else a resumed run needs to continue exactly where it stopped.

Two ways to open a checkpoints folder:
  Checkpointer(dir)        the run that owns the folder: saves (asynchronously: training goes on
                           while the bytes are written), and on opening removes the
                           `<step>.orbax-checkpoint-tmp*` folders its own killed saves left
                           (checked with a SIGKILL mid-save: the previous step restores)
  open_reader(dir)         anyone else (chat, eval, export, a later stage's --base): Orbax's
                           read_only mode, which never creates, cleans or deletes anything, so
                           reading a run that is still training cannot remove its save in flight

Every step records the size and SHA-256 of each file it wrote (`flaxchat_checksums.json`, written
into the step folder before Orbax renames it into place, so a step never appears without it).
`newest_intact` checks them before a step is used: a truncated file, an emptied `meta`, a removed
folder or flipped bytes make that step "damaged", and the newest intact step is used instead, with
one line that says which step was skipped and why. The owner moves a damaged step aside to
`<checkpoints>.damaged/` (never deleted); a reader leaves it where it is. Steps written before
checksums existed have no record and are trusted as Orbax reads them.

A save that fails (a full disk, a lost bucket) is abandoned: the half-written step never becomes
the latest, its temporary folder is removed to give the space back, and the next call on the
Checkpointer raises one UserError naming what failed, where, and how much space a step needs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import nnx

from flaxchat import paths
from flaxchat.errors import UserError

CHECKSUMS = "flaxchat_checksums.json"
# A run that is still training deletes old steps as it saves new ones (--keep-checkpoints): the step
# a reader chose can vanish while it is read. Then the reader looks again, this many times in all.
READ_ATTEMPTS = 8
_CHUNK = 8 << 20  # bytes hashed at a time: SHA-256 runs at ~1.1 GB/s on one core of this project's CPUs
_TMP = ".orbax-checkpoint-tmp"
# How long the other writes of a failed save may take to end before its folder is removed anyway.
WRITE_WAIT_S = 600


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _pure(state: nnx.State):
    return nnx.to_pure_dict(state)


def _first_line(e: BaseException) -> str:
    """An exception's first line without reprs of bound C++ methods and other <...> noise."""
    text = re.sub(r"<[^<>]*>", "", (str(e).splitlines() or [""])[0]).strip()
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class _DropOrbaxTracebacks(logging.Filter):
    """Orbax logs every failure of a background save with its traceback, 3-5 times per failed save
    (each thread that saw it); the Checkpointer raises that failure itself as one sentence. Orbax's
    errors without a traceback still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info
                    and "/orbax/" in record.pathname.replace(os.sep, "/"))


_ABSL = logging.getLogger("absl")
_FILTER = _DropOrbaxTracebacks()


def _quiet_failed_writes() -> None:
    """When a save fails, the first write error ends Orbax's event loop for that save, and the
    writes still in flight (one per array) then fail into it one by one, each printing a traceback
    ("Future exception was never retrieved", "Event loop is closed": 9-37 on a depth-1 model, and
    before the Checkpointer can know of the failure). The failure itself is raised as one sentence,
    so these two kinds of leftover are dropped, in a process that saves checkpoints."""
    if getattr(sys.unraisablehook, "_flaxchat", False):
        return
    logging.getLogger("asyncio").addFilter(
        lambda r: not (r.levelno >= logging.ERROR and "exception was never retrieved" in r.getMessage()))
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)):
            previous(unraisable)

    hook._flaxchat = True
    sys.unraisablehook = hook


# --- checksums -------------------------------------------------------------------------------------


def _digest(path: str) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with paths.open_file(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _relative(step_dir: str, path: str) -> str:
    return path[len(step_dir.rstrip("/")):].lstrip("/").replace(os.sep, "/")


def record_checksums(step_dir: str) -> dict:
    """Write size and SHA-256 of every file of the step's items (model/, optimizer/, meta/) into
    its CHECKSUMS file. The step's own top-level files are left out: Orbax rewrites
    _CHECKPOINT_METADATA (its commit time) and writes commit_success.txt after this runs."""
    files = {}
    for path in paths.listdir(step_dir, recursive=True):
        rel = _relative(step_dir, path)
        if "/" in rel:
            files[rel] = list(_digest(path))
    record = {"version": 1, "algorithm": "sha256", "files": files}
    paths.write_text(paths.join(step_dir, CHECKSUMS), json.dumps(record, indent=0, sort_keys=True))
    return record


def step_problem(step_dir: str, items: tuple[str, ...] | None = None) -> str | None:
    """Why the step in `step_dir` cannot be trusted, or None when its files match their checksums
    (or it has no checksums: written before they existed). `items`: only check the files of these
    items (a reader of the model need not read the optimizer), plus the step's own metadata."""
    if not paths.isdir(step_dir):
        return "its folder is gone"
    record_path = paths.join(step_dir, CHECKSUMS)
    if not paths.exists(record_path):
        return None
    try:
        files = json.loads(paths.read_text(record_path))["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"its {CHECKSUMS} is unreadable"
    checked: set[str] = set()
    for rel, (size, digest) in sorted(files.items()):
        item = rel.split("/", 1)[0]
        if items is not None and item not in items:
            continue
        if item not in checked and not paths.isdir(paths.join(step_dir, item)):
            return f"its {item} folder is missing"
        checked.add(item)
        path = paths.join(step_dir, rel)
        try:
            got_size, got = _digest(path)
        except FileNotFoundError:
            return f"{rel} is missing"
        if got_size != size:
            return f"{rel} is {got_size:,} bytes, {size:,} were written"
        if got != digest:
            return f"{rel} does not match the checksum it was written with"
    return None


# --- the checkpointer ------------------------------------------------------------------------------


class Checkpointer:
    """Save/restore of a model + optimizer pair under one directory, one step folder each.

    `read_only=True` (what `open_reader` returns) opens someone else's folder: nothing is created,
    cleaned, moved or deleted there, and `save` is refused."""

    def __init__(self, directory: str, max_to_keep: int | None = 2, async_save: bool = True, *,
                 read_only: bool = False):
        self.directory = directory if "://" in directory else os.path.abspath(directory)  # gs:// stays as is
        self.read_only, self.async_save, self.max_to_keep = read_only, async_save, max_to_keep
        self._saving: int | None = None  # the step whose write is in flight (or not yet confirmed)
        self._step_bytes = 0  # array bytes of the last save: what a step needs on disk, about
        self.run_lock = None  # the run folder's lock (flaxchat.run_lock), given back by close()
        if read_only:
            # Set to what read_only forces anyway, so Orbax does not warn about each one.
            # lightweight_initialize: step metadata is not read on opening, so a step the owner
            # deletes meanwhile does not fail the opening.
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                                   save_interval_steps=0, enable_async_checkpointing=False,
                                                   lightweight_initialize=True)
        else:
            # Always the asynchronous checkpointer: its post-finalization callback writes the
            # checksums into the step folder before Orbax renames it into place. `async_save=False`
            # waits for each write instead.
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, cleanup_tmp_directories=True, create=True,
                enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums))
            _quiet_failed_writes()
        if _FILTER not in _ABSL.filters:
            _ABSL.addFilter(_FILTER)
        level = _ABSL.level
        _ABSL.setLevel(logging.ERROR)  # "Given directory is read only" and the like: not for users
        try:
            self._mgr = self._retried(lambda: ocp.CheckpointManager(self.directory, options=options))
        except Exception as e:  # an unreadable folder: say so, touch nothing
            raise UserError(f"the checkpoint folder {self.directory} cannot be opened ({_first_line(e)}).") from None
        finally:
            _ABSL.setLevel(level)

    def _retried(self, fn):
        """fn(), again when a reader lost a race with the owner deleting an old step (FileNotFoundError)."""
        for attempt in range(READ_ATTEMPTS if self.read_only else 1):
            try:
                return fn()
            except FileNotFoundError:
                if attempt == READ_ATTEMPTS - 1 or not self.read_only:
                    raise
                time.sleep(0.05)

    def step_dir(self, step: int) -> str:
        return paths.join(self.directory, str(step))

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def reload(self) -> None:
        """See steps another process wrote, moved or deleted since this one opened the folder."""
        self._retried(self._mgr.reload)

    # --- saving (the owner) ---------------------------------------------------------------------
    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None, meta: dict[str, Any]) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only; only the run that owns it saves there")
        self._confirm()  # the previous write landed, or its failure is raised now
        model_state = _pure(nnx.state(model, nnx.Param))
        items = dict(model=ocp.args.StandardSave(model_state),
                     meta=ocp.args.JsonSave(dict(meta, step=step, saved_at=time.time())))
        trees = [model_state]
        if optimizer is not None:
            opt_state = _pure(nnx.state(optimizer, nnx.optimizer.OptState))
            items["optimizer"] = ocp.args.StandardSave(opt_state)
            trees.append(opt_state)
        self._step_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(trees))
        self._saving = step
        try:
            self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._failed(step, e) from None
        if not self.async_save:
            self._confirm()

    def _record_checksums(self) -> None:
        """Orbax's post-finalization callback (process 0, after every process has written): the
        step is complete but still under its temporary name (on GCS, where there is no rename,
        under its final name without commit_success.txt)."""
        step = self._saving
        pending = [p for p in paths.glob(paths.join(self.directory, f"{step}{_TMP}*")) if paths.isdir(p)]
        record_checksums(pending[0] if pending else self.step_dir(step))

    def _confirm(self) -> None:
        """Wait for the write in flight; a failed one becomes one UserError."""
        if self._saving is None:
            return
        step = self._saving
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            raise self._failed(step, e) from None
        self._saving = None

    def raise_if_failed(self) -> None:
        """Cheap, for every training step: raise the UserError of a background save that failed,
        so the loop stops at once instead of training on to the next save."""
        if self._saving is not None and not self._mgr.is_saving_in_progress():
            self._confirm()

    def _failed(self, step: int, e: BaseException) -> UserError:
        """Abandon the save of `step` (its temporary folder is removed: a killed or failed write
        is never resumed from) and say why, with the space a step needs when the disk is full."""
        self._saving = None
        self._let_writes_finish()
        for tmp in (paths.glob(paths.join(self.directory, f"{step}{_TMP}*")) if not paths.is_remote(self.directory)
                    else []):
            shutil.rmtree(tmp, ignore_errors=True)
        kept = [s for s in self.all_steps() if s != step and s < step]
        resume = (f"the same command resumes from step {max(kept)}" if kept else "nothing was saved before it")
        text = str(e)
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in text \
            or "RESOURCE_EXHAUSTED" in text
        if full:
            free, size = "", self._step_bytes  # the arrays' bytes: Orbax compresses, so at most this
            if not paths.is_remote(self.directory):
                free = f"{_mb(shutil.disk_usage(self.directory).free)} free; "
                if kept:  # what a step of this run really takes on this disk
                    folder = self.step_dir(max(kept))
                    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
            on_disk = (self.max_to_keep or 1) + 1
            return UserError(f"saving checkpoint step {step} to {self.directory} failed: no space left on the "
                             f"device ({free}a step takes about {_mb(size)} and up to {on_disk} are on disk "
                             f"during a save: {_mb(size * on_disk)}); free space or pass another --run-dir, "
                             f"and {resume}.")
        return UserError(f"saving checkpoint step {step} to {self.directory} failed ({_first_line(e)}); "
                         f"the step was abandoned, and {resume}.")

    def _let_writes_finish(self) -> None:
        """Wait for every write of a failed save before its folder is removed. Orbax (0.12.8) waits
        for the items' writes in turn and raises the first that failed, leaving the others running:
        removed at once, the folder came back when the optimizer's write landed in the space the
        removal gave back (2 of 37 full-disk saves on a 3 MB tmpfs, and once in CI). The writes are
        Orbax's commit futures, reached through its private attributes (none are public); where a
        release moves them this waits for nothing and tests/test_checkpoint_integrity.py says so."""
        manager = getattr(getattr(self._mgr, "_checkpointer", None), "_async_manager", None)
        for write in getattr(manager, "_commit_futures", None) or []:
            try:
                write.result(timeout=WRITE_WAIT_S)
            except Exception:  # the failure being reported, or another like it
                pass

    # --- reading --------------------------------------------------------------------------------
    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint found in {self.directory}.")
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            fix = ("start over with --fresh (it is kept, not deleted) or use another --run-dir" if not self.read_only
                   else "pass another --step, or train the run again")
            raise UserError(f"the checkpoint at {self.step_dir(step)} is unreadable ({_first_line(e)}); "
                            f"{fix}.") from None
        return dict(out["meta"])

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, step: int | None = None,
                device: jax.Device | None = None) -> dict[str, Any]:
        """Restore into `model` (and `optimizer`) in place; returns the meta dict. `device`: put the
        model's arrays there (export reads onto the CPU whatever accelerator the run trained on)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint found in {self.directory}.")
        model_state = nnx.state(model, nnx.Param)
        target = _abstract(_pure(model_state))
        if device is not None:
            on = jax.sharding.SingleDeviceSharding(device)
            target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on), target)
        items = dict(model=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        if optimizer is not None:
            opt_state = nnx.state(optimizer, nnx.optimizer.OptState)
            items["optimizer"] = ocp.args.StandardRestore(_abstract(_pure(opt_state)))
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            fix = ("start over with --fresh (the old checkpoint is kept) or use another --run-dir" if not self.read_only
                   else "pass another --step")
            raise UserError(f"the checkpoint at {self.step_dir(step)} cannot be restored into this model "
                            f"({_first_line(e)}); {fix}.") from None
        nnx.replace_by_pure_dict(model_state, out["model"])
        nnx.update(model, model_state)
        if optimizer is not None:
            nnx.replace_by_pure_dict(opt_state, out["optimizer"])
            nnx.update(optimizer, opt_state)
        return dict(out["meta"])

    def newest_intact(self, step: int | None = None, items: tuple[str, ...] | None = None,
                      log: Callable[[str], None] = print, move_damaged: bool = False,
                      known: dict[int, str] | None = None) -> tuple[int, dict[str, Any]]:
        """(step, meta) of `step`, or of the newest step whose files match their checksums and whose
        meta reads. Each damaged step above it is named in one line (and moved aside when
        `move_damaged`, which only the owner may ask). `known`: steps already found damaged (a
        restore that failed), with why. A UserError when none is intact, or when the asked `step`
        is damaged; then nothing is moved."""
        known = known or {}
        for _ in range(READ_ATTEMPTS):
            found = self._search(step, items, known)
            if found is not None:
                break
            self.reload()  # every step it looked at was deleted meanwhile by the run that writes them
        else:
            raise UserError(f"the steps of {self.directory} were deleted by the run that writes them faster than "
                            f"they could be read ({READ_ATTEMPTS} tries); try again, or let that run keep more "
                            "(--keep-checkpoints).")
        s, meta, damaged = found
        for bad, why in damaged:
            where = ""
            if move_damaged and not self.read_only:
                where = f"; moved to {self._move_aside(bad)}"
            log(f"warning: checkpoint step {bad} in {self.directory} is damaged ({why}){where}; "
                f"using step {s}")
        if damaged and move_damaged:
            self.reload()
        return s, meta

    def _search(self, step, items, known):
        """(step, meta, [(damaged step, why)]) of the newest intact step; None when the steps looked
        at vanished while they were read (a reader of a run that is training)."""
        steps = sorted(self.all_steps(), reverse=True)
        if step is not None:
            steps = [step] if step in steps else []
        if not steps:
            raise UserError(f"no checkpoint found in {self.directory}." if step is None else
                            f"step {step} is not in {self.directory} (steps there: "
                            f"{', '.join(map(str, sorted(self.all_steps()))) or 'none'}).")
        damaged: list[tuple[int, str]] = []
        for s in steps:
            why = known.get(s) or step_problem(self.step_dir(s), items)
            meta = None
            if why is None:
                try:
                    meta = self.read_meta(s)
                except UserError:
                    why = "its meta cannot be read"
            if why is None:
                return s, meta, damaged
            if not paths.isdir(self.step_dir(s)):
                continue  # deleted while it was read (the run that owns it keeps its newest steps): not damage
            damaged.append((s, why))
        if not damaged:
            return None
        listed = "; ".join(f"step {s}: {why}" for s, why in damaged)
        if step is not None:
            raise UserError(f"checkpoint step {step} in {self.directory} is damaged ({listed}); "
                            "pass another --step or leave it out for the newest intact one.")
        fix = ("start over with --fresh (they are moved aside, not deleted)" if not self.read_only
               else "train the run again or copy an intact checkpoint there")
        raise UserError(f"every checkpoint in {self.directory} is damaged or incomplete ({listed}); {fix}.")

    def use_newest_intact(self, use: Callable[[int, dict], Any], step: int | None = None,
                          items: tuple[str, ...] | None = None, log: Callable[[str], None] = print) -> tuple[int, Any]:
        """(step, use(step, meta)) for the newest intact step (or `step`). A reader of a run that is
        still training can see the step it chose deleted mid-read (--keep-checkpoints): then it
        looks again. A step that verifies but does not restore counts as damaged (older saves have
        no checksums) and the next one is tried."""
        failed: dict[int, str] = {}
        for attempt in range(READ_ATTEMPTS):
            at, meta = self.newest_intact(step, items, log, known=failed)
            try:
                return at, use(at, meta)
            except UserError as e:
                if paths.isdir(self.step_dir(at)):
                    if step is not None:
                        raise
                    failed[at] = f"it does not restore: {str(e).partition('(')[2].rpartition(')')[0]}"
                    self.reload()  # a live run may have saved newer steps (and be deleting this one) meanwhile
                elif step is not None:
                    raise UserError(f"step {step} was deleted from {self.directory} while it was read (the run "
                                    "that writes it keeps only its newest steps); pass a newer --step.") from None
                else:
                    self.reload()
        raise UserError(f"the steps of {self.directory} were deleted by the run that writes them faster than they "
                        f"could be read ({READ_ATTEMPTS} tries); try again, or let that run keep more "
                        "(--keep-checkpoints).")

    def _move_aside(self, step: int) -> str:
        dest_dir = self.directory.rstrip("/") + ".damaged"
        paths.makedirs(dest_dir)
        dest = paths.join(dest_dir, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        paths.move(self.step_dir(step), dest)
        return dest

    def wait(self) -> None:
        self._confirm()

    def close(self) -> None:
        try:
            self._confirm()
        finally:
            self._saving = None
            self._mgr.close()
            if self.run_lock is not None:
                self.run_lock.release()


def open_reader(directory: str) -> Checkpointer:
    """Open another run's checkpoints folder to read: the one way chat, eval, export and a later
    stage's --base open checkpoints. Nothing there is created, cleaned, moved or deleted, so a run
    that is still training keeps its save in flight."""
    return Checkpointer(directory, max_to_keep=None, read_only=True)


def set_aside(directory: str) -> str | None:
    """Move an existing checkpoint folder out of the way (for --fresh); nothing is deleted.
    Local or `gs://` (through `flaxchat.paths`; on an object store the move copies every object)."""
    remote = paths.is_remote(directory)
    directory = directory.rstrip("/") if remote else directory
    # A remote 'folder' exists only while objects live under it, so isdir means non-empty there.
    if not paths.isdir(directory) or (not remote and not os.listdir(directory)):
        return None
    dest = f"{directory}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    paths.move(directory, dest)
    return dest

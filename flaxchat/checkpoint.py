"""Orbax checkpoints of {model, optimizer, meta} with exact resume.

Layout: <run_dir>/checkpoints/<step>/{model,optimizer,meta}. `meta` is JSON: the resolved model and
training configs, the step, the data loader's position and anything else a resumed run needs to
continue exactly where it stopped. Saves are asynchronous (training goes on while the bytes are
written); a save killed half-way leaves `<step>.orbax-checkpoint-tmp*`, which `latest_step()` never
picks and `cleanup_tmp_directories` removes on the next start (checked with a SIGKILL mid-save:
the previous step restores; without the cleanup option the temp folder stays for good).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from flaxchat import paths
from flaxchat.errors import UserError


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _pure(state: nnx.State):
    return nnx.to_pure_dict(state)


class Checkpointer:
    """Save/restore of a model + optimizer pair under one directory, one step folder each."""

    def __init__(self, directory: str, max_to_keep: int | None = 2, async_save: bool = True):
        self.directory = directory if "://" in directory else os.path.abspath(directory)  # gs:// stays as is
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, cleanup_tmp_directories=True, create=True,
            enable_async_checkpointing=async_save)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # an unreadable folder: say so, touch nothing
            raise UserError(f"the checkpoint folder {self.directory} cannot be opened ({type(e).__name__}: {e}).")

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None, meta: dict[str, Any]) -> None:
        items = dict(model=ocp.args.StandardSave(_pure(nnx.state(model, nnx.Param))),
                     meta=ocp.args.JsonSave(dict(meta, step=step, saved_at=time.time())))
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(_pure(nnx.state(optimizer, nnx.optimizer.OptState)))
        self._mgr.save(step, args=ocp.args.Composite(**items), force=True)

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint found in {self.directory}.")
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise UserError(f"the checkpoint at {self.directory}/{step} is unreadable ({type(e).__name__}); "
                            "start over with --fresh (it is kept, not deleted) or use another --run-dir.") from None
        return dict(out["meta"])

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, step: int | None = None) -> dict[str, Any]:
        """Restore into `model` (and `optimizer`) in place; returns the meta dict."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint found in {self.directory}.")
        model_state = nnx.state(model, nnx.Param)
        items = dict(model=ocp.args.StandardRestore(_abstract(_pure(model_state))), meta=ocp.args.JsonRestore())
        if optimizer is not None:
            opt_state = nnx.state(optimizer, nnx.optimizer.OptState)
            items["optimizer"] = ocp.args.StandardRestore(_abstract(_pure(opt_state)))
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            raise UserError(f"the checkpoint at {self.directory}/{step} cannot be restored into this model "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); start over with --fresh "
                            "(the old checkpoint is kept) or use another --run-dir.") from None
        nnx.replace_by_pure_dict(model_state, out["model"])
        nnx.update(model, model_state)
        if optimizer is not None:
            nnx.replace_by_pure_dict(opt_state, out["optimizer"])
            nnx.update(optimizer, opt_state)
        return dict(out["meta"])

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


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

"""Where exported weights come from: a training run's Orbax checkpoint, a model.pkl or a weights.npz.

The checkpoint is opened read-only. `flaxchat.checkpoint.Checkpointer` cleans up half-written
`<step>.orbax-checkpoint-tmp*` folders when it opens a folder, which is right for a resuming
trainer and wrong for an exporter: exporting while training runs would delete the save in flight.
"""

from __future__ import annotations

import os

import numpy as np

from flaxchat import paths
from flaxchat.config import GPTConfig
from flaxchat.paths import RunFolder
from flaxchat.errors import UserError
from flaxchat.export import formats


def checkpoint_dir(path: str) -> str:
    """A run folder (holding checkpoints/), the checkpoints folder itself, or one step of it, local
    or gs:// -> the checkpoints folder."""
    return _located(path)[0]


def _located(path: str) -> tuple[str, int | None]:
    """(checkpoints folder, step named by the path or None); a missing run folder is one sentence."""
    where = path.rstrip("/") if paths.is_remote(path) else os.path.abspath(path)
    if not paths.isdir(where):
        raise paths.missing_bucket(where) or UserError(f"{where} does not exist; pass a training run folder (the --run-dir of scripts.pretrain).")
    sub = RunFolder(where).checkpoints
    if paths.isdir(sub):
        return sub, None
    if RunFolder.is_step(where):  # checkpoints/<step>: that step
        return paths.parent(where), int(paths.basename(where))
    return where, None  # a checkpoints folder (or not): _read says what it holds


def read_checkpoint(path: str, step: int | None = None) -> tuple[GPTConfig, dict, int]:
    """(config, params, step) of the latest (or given) finished save under a run folder."""
    from absl import logging as absl_logging

    ckpt, named = _located(path)
    if named is not None:
        if step is not None and step != named:
            raise UserError(f"{path} is step {named} but --step {step} was asked for; pass one or the other.")
        step = named
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns that a read-only manager is read-only
    try:
        return _read(ckpt, step)
    finally:
        absl_logging.set_verbosity(verbosity)


def _read(ckpt: str, step: int | None) -> tuple[GPTConfig, dict, int]:
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from flaxchat.gpt import GPT

    options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                           enable_async_checkpointing=False)
    try:
        mgr = ocp.CheckpointManager(ckpt, options=options)
        steps = list(mgr.all_steps())
    except Exception as e:
        raise UserError(f"{ckpt} cannot be read as a checkpoint folder ({type(e).__name__}).") from None
    if not steps:
        # A save cut short: locally Orbax's `<step>.orbax-checkpoint-tmp*` folder; on GCS the step under
        # its final name without the commit_success.txt that Orbax writes last.
        half = [n for n in paths.listdirs(ckpt) if ".orbax-checkpoint-tmp" in n or
                (paths.is_remote(ckpt) and n.isdigit())]
        if half:
            raise UserError(f"{ckpt} holds only a half-written save ({half[0]}), no finished "
                            "checkpoint; let training reach its next save (or resume it) and export again.")
        raise UserError(f"no checkpoint found in {ckpt}; train first (python -m scripts.pretrain --run-dir=...).")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise UserError(f"{ckpt} has no checkpoint at step {step}; it has steps {sorted(steps)}.")
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        cfg = GPTConfig.from_dict(meta["model_config"])
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param))
        device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract)
        out = mgr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
    except UserError:
        raise
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise UserError(f"the checkpoint {ckpt}/{step} is damaged or incomplete ({type(e).__name__}: {first}); "
                        "export an earlier step with --step, or let training write a new one.") from None
    finally:
        mgr.close()
    params = formats.unflatten({k: np.asarray(v) for k, v in formats.flatten(out["model"]).items()})
    formats.check_params(formats.flatten(params), cfg, f"{ckpt}/{step}")
    return cfg, params, step


def read_any(path: str, step: int | None = None) -> tuple[GPTConfig, dict, int | None]:
    """(config, params, step) from a run folder, a checkpoints folder, a model.pkl or a weights.npz
    (local or gs://)."""
    if path.endswith(".pkl"):
        return formats.read_pkl(path)
    if path.endswith(".npz"):
        return (*formats.read_npz(path), None)
    if paths.isdir(path):
        return read_checkpoint(path, step)
    if not paths.exists(path):
        raise paths.missing_bucket(path) or UserError(f"{path} does not exist; pass a run folder, a model.pkl or a weights.npz.")
    raise UserError(f"{path} is neither a run folder nor a .pkl/.npz file; pass one of those.")


def load_params_into(model, path: str) -> int | None:
    """Overwrite `model`'s parameters with those in a model.pkl / weights.npz / run folder.

    For starting a training run from exported weights (`scripts.pretrain --init-from=model.pkl`).
    The file must hold a model of exactly this shape; returns the step it was exported at.
    """
    from flax import nnx

    cfg, params, step = read_any(path)
    mine = model.config
    try:
        formats.check_params(formats.flatten(params), mine, path)
    except UserError:
        raise UserError(f"{path} holds a model with {formats.describe(cfg)}, but this run builds one with "
                        f"{formats.describe(mine)}; pass matching --depth/--vocab-size/--sequence-len.") from None
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, formats.to_jax(params))
    nnx.update(model, state)
    return step


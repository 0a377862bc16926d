"""Where exported weights come from: a training run's Orbax checkpoint, a model.pkl or a weights.npz.

The checkpoint is opened read-only (`flaxchat.checkpoint.open_reader`): exporting while training
runs never touches the save in flight, and a damaged latest step gives way to the newest intact one.
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
    import sys

    import jax
    from flax import nnx

    from flaxchat.checkpoint import open_reader
    from flaxchat.gpt import GPT

    try:
        reader = open_reader(ckpt)  # read-only: a save in flight is neither used nor touched
        steps = reader.all_steps()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{ckpt} cannot be read as a checkpoint folder ({type(e).__name__}).") from None
    if not steps:
        reader.close()
        # A save cut short: locally Orbax's `<step>.orbax-checkpoint-tmp*` folder; on GCS the step under
        # its final name without the commit_success.txt that Orbax writes last.
        half = [n for n in paths.listdirs(ckpt) if ".orbax-checkpoint-tmp" in n or
                (paths.is_remote(ckpt) and n.isdigit())]
        if half:
            raise UserError(f"{ckpt} holds only a half-written save ({half[0]}), no finished "
                            "checkpoint; let training reach its next save (or resume it) and export again.")
        raise UserError(f"no checkpoint found in {ckpt}; train first (python -m scripts.pretrain --run-dir=...).")

    def params_of(at: int, meta: dict) -> tuple[GPTConfig, dict]:
        cfg = GPTConfig.from_dict(meta["model_config"])
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        with jax.set_mesh(None):
            reader.restore(model, step=at, device=jax.devices("cpu")[0])
        return cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param))

    try:
        step, (cfg, out) = reader.use_newest_intact(params_of, step, items=("model", "meta"),
                                                    log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        reader.close()
    params = formats.unflatten({k: np.asarray(v) for k, v in formats.flatten(out).items()})
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


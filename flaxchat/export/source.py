"""Where exported weights come from: a training run's Orbax checkpoint, a model.pkl or a weights.npz.

The checkpoint is opened read-only (`flaxchat.checkpoint.open_reader`): exporting while training
runs never touches the save in flight, and a damaged latest step gives way to the newest intact one.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from flaxchat.config import GPTConfig
from flaxchat.errors import UserError
from flaxchat.export import formats


def checkpoint_dir(path: str) -> str:
    """A run folder (holding checkpoints/) or the checkpoints folder itself -> the checkpoints folder."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserError(f"{path} does not exist; pass a training run folder (the --run-dir of scripts.pretrain).")
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def read_checkpoint(path: str, step: int | None = None) -> tuple[GPTConfig, dict, int]:
    """(config, params, step) of the latest (or given) finished save under a run folder."""
    from absl import logging as absl_logging

    ckpt = checkpoint_dir(path)
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

    reader = open_reader(ckpt)  # read-only: a save in flight is neither used nor touched
    if not reader.all_steps():
        reader.close()
        half = sorted(glob.glob(os.path.join(ckpt, "*.orbax-checkpoint-tmp*")))
        if half:
            raise UserError(f"{ckpt} holds only a half-written save ({os.path.basename(half[0])}), no finished "
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
    """(config, params, step) from a run folder, a checkpoints folder, a model.pkl or a weights.npz."""
    if os.path.isdir(path):
        return read_checkpoint(path, step)
    if path.endswith(".pkl"):
        return formats.read_pkl(path)
    if path.endswith(".npz"):
        return (*formats.read_npz(path), None)
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist; pass a run folder, a model.pkl or a weights.npz.")
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


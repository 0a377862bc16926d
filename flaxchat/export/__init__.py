"""Export a trained flaxchat GPT: model.pkl, weights.npz, model.stablehlo (+ .mlir), and .tflite.

    from flaxchat.export import export_run, load_pkl
    paths = export_run("runs/tinystories")          # -> runs/tinystories/export/{model.pkl, ...}
    model = load_pkl(paths["pkl"])                   # a flaxchat GPT again

| file            | what                                              | read it with                       |
|-----------------|---------------------------------------------------|------------------------------------|
| model.pkl       | config + params, plain dicts of numpy arrays      | `load_pkl`, or pickle + numpy      |
| weights.npz     | dotted parameter names + `__config__` JSON        | `np.load`, anywhere                |
| model.stablehlo | `jax.export` forward pass, weights inside         | `jax.export.deserialize(...).call` |
| model.tflite    | forward / prefill / decode signatures (LiteRT)    | `TFLiteModel`, any LiteRT runtime  |

The .tflite comes from `scripts.convert_to_tflite` (optional extra, from the checkout into a venv of
its own outside it: `pip install -e ".[export]"`; docs/export.md, "Installing the converter").
Importing this package imports neither JAX nor the converter; each function imports what it needs.
"""

from __future__ import annotations

import os
import shutil

from flaxchat import paths
from flaxchat.paths import RunFolder
from flaxchat.export.formats import (build_model, load_npz, load_pkl, model_params, read_npz, read_pkl,
                                     read_weights, save_npz, save_pkl)
from flaxchat.export.source import load_params_into, read_any, read_checkpoint

FILES = dict(pkl="model.pkl", npz="weights.npz", stablehlo="model.stablehlo", mlir="model.mlir")


def export_model(model_or_cfg, out_dir: str, params: dict | None = None, step: int | None = None,
                 seq_len: int | None = None, platforms: tuple[str, ...] = ("cpu",)) -> dict[str, str]:
    """Write model.pkl, weights.npz, model.stablehlo and model.mlir into out_dir; returns their paths.

    Pass a live GPT, or a GPTConfig with its params (nested dict of numpy arrays). `platforms`:
    what the StableHLO is lowered for; CPU alone by default, because a multi-platform module takes
    an extra platform-index argument that converters such as litert-converter do not expect.
    """
    from flaxchat.export.stablehlo import check_seq_len, save_stablehlo
    from flaxchat.kernels import portable

    if params is None:
        cfg, params = model_or_cfg.config, model_params(model_or_cfg)
    else:
        cfg = model_or_cfg
    check_seq_len(cfg, seq_len)  # bad input is refused before any file is written
    out = {k: paths.join(out_dir, v) for k, v in FILES.items()}
    save_pkl(out["pkl"], cfg, params, step)
    save_npz(out["npz"], cfg, params)
    # The float32 twin of the model: a bf16-compute training model exports as float32.
    save_stablehlo(build_model(cfg, params, kernels=portable()), out["stablehlo"], seq_len, tuple(platforms))
    return out


def export_run(run_dir: str, out_dir: str | None = None, step: int | None = None,
               seq_len: int | None = None, platforms: tuple[str, ...] = ("cpu",),
               tokenizer_dir: str | None = None) -> dict[str, str]:
    """Export a training run's latest finished checkpoint (default into <run_dir>/export).

    Also copies the tokenizer folder (default <run_dir>/tokenizer) beside the files: an app needs
    it to encode prompts. Returns {"pkl", "npz", "stablehlo", "mlir"[, "tokenizer"]} -> path.
    `run_dir` and `out_dir` may be local or gs:// (a run folder, its checkpoints or one step).
    """
    from flaxchat.loading import resolve
    cfg, params, step = read_checkpoint(run_dir, step)
    run = RunFolder(resolve(run_dir).run_dir)
    out_dir = out_dir or run.export
    files = export_model(cfg, out_dir, params=params, step=step, seq_len=seq_len, platforms=platforms)
    tok = tokenizer_dir or run.tokenizer
    if paths.isdir(tok):
        dest = paths.join(out_dir, RunFolder.TOKENIZER)
        if paths.is_remote(dest) or paths.is_remote(tok):
            for src in paths.listdir(tok, recursive=True):  # a few small files, one object each
                target = paths.join(dest, src[len(tok.rstrip("/")):].lstrip("/" + os.sep))
                if not paths.is_remote(target):  # from a bucket into a local folder, which may not exist yet
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                paths.write_bytes(target, paths.read_bytes(src))
        else:
            tmp = f"{dest}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(tok, tmp)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        files[RunFolder.TOKENIZER] = dest
    return files


__all__ = ["export_model", "export_run", "load_pkl", "load_npz", "read_pkl", "read_npz", "read_weights",
           "save_pkl", "save_npz", "load_params_into", "read_any", "read_checkpoint", "build_model",
           "model_params", "FILES"]

"""Weights out of flaxchat: model.pkl and weights.npz, and the way back in.

model.pkl   {"format": "flaxchat-pkl", "version": 1, "config": {...GPTConfig...}, "step": int | None,
             "params": nested dict of numpy arrays (the `nnx.to_pure_dict` tree: list indices are
             ints)}. Only dicts, lists, str/int/float and numpy arrays: `pickle.load` with numpy
             installed reads it, no flaxchat class inside. Our own loader unpickles with an allow-list
             (numpy's array reconstructors and builtins), so a pickle from elsewhere is refused
             rather than executed.
weights.npz one array per parameter under its dotted path (`blocks.0.attn.c_q.kernel`), plus
             `__config__` (the GPTConfig as JSON) and `__format__`, both plain unicode arrays, so
             `np.load(path)` works without allow_pickle and without flaxchat.

Every file is written to a temporary name in the same folder and renamed at the end: a crash or a
bad input never leaves a half-written model.pkl behind.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from typing import Any

import numpy as np

from flaxchat import paths
from flaxchat.config import GPTConfig
from flaxchat.errors import UserError

PKL_FORMAT, PKL_VERSION = "flaxchat-pkl", 1
NPZ_FORMAT = "flaxchat-npz/1"
CONFIG_KEY, FORMAT_KEY = "__config__", "__format__"


# Every file is written whole through `paths.atomic_write` (a temp file renamed, or one upload).
atomic_write = paths.atomic_write


# --- trees of parameters --------------------------------------------------------------------------


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dict -> {"blocks.0.attn.c_q.kernel": array}, in sorted key order."""
    out = {}
    for k in sorted(tree, key=str):
        name = f"{prefix}{k}"
        if isinstance(tree[k], dict):
            out.update(flatten(tree[k], name + "."))
        else:
            out[name] = tree[k]
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    """The inverse of `flatten`; all-digit path parts become int keys (nnx.List indices)."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        parts = [int(p) if p.isdigit() else p for p in name.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return tree


def model_params(model) -> dict:
    """The model's parameters as a nested dict of numpy arrays (host copies)."""
    from flax import nnx

    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return unflatten({k: np.asarray(v) for k, v in flatten(pure).items()})


def describe(cfg: GPTConfig) -> str:
    return (f"depth {cfg.n_layer}, width {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}, "
            f"sequence {cfg.sequence_len}")


def check_params(flat: dict[str, np.ndarray], cfg: GPTConfig, source: str) -> None:
    """UserError unless `flat` has exactly the names, shapes and dtypes of a GPT with `cfg`."""
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(flat))
    extra = sorted(set(flat) - set(expected))
    wrong = [f"{k} {tuple(flat[k].shape)} (wants {expected[k][0]})" for k in sorted(set(expected) & set(flat))
             if tuple(flat[k].shape) != expected[k][0] or np.dtype(flat[k].dtype) != expected[k][1]]
    if missing or extra or wrong:
        detail = "; ".join(filter(None, [
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unexpected {', '.join(extra[:3])}" if extra else "",
            f"wrong shape {', '.join(wrong[:3])}" if wrong else ""]))
        raise UserError(f"{source} does not hold the weights of a flaxchat GPT with {describe(cfg)} ({detail}).")


def _expected_shapes(cfg: GPTConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    import jax
    from flax import nnx

    from flaxchat.gpt import GPT

    abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))  # shapes only, no memory
    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flatten(pure).items()
            if isinstance(v, jax.ShapeDtypeStruct)}


def build_model(cfg: GPTConfig, params: dict, dtype=None, kernels=None):
    """A GPT with exactly these parameters (no random init is materialised), running on `kernels`
    (default: this backend's; an export passes `flaxchat.kernels.portable()`)."""
    import jax.numpy as jnp
    from flax import nnx

    from flaxchat.gpt import GPT

    dtype = dtype or jnp.float32
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels)))
    nnx.replace_by_pure_dict(state, to_jax(params))
    return nnx.merge(graphdef, state)


def to_jax(tree):
    import jax.numpy as jnp
    return {k: to_jax(v) if isinstance(v, dict) else jnp.asarray(v) for k, v in tree.items()}


# --- model.pkl ------------------------------------------------------------------------------------


def save_pkl(path: str, cfg: GPTConfig, params: dict, step: int | None = None) -> str:
    blob = {"format": PKL_FORMAT, "version": PKL_VERSION, "config": cfg.to_dict(), "step": step,
            "params": unflatten({k: np.ascontiguousarray(v) for k, v in flatten(params).items()})}
    return atomic_write(path, lambda f: pickle.dump(blob, f, protocol=pickle.HIGHEST_PROTOCOL))


class _ForeignClass(Exception):
    pass


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays; any other class is refused, never imported."""

    # What numpy 2 writes for arrays, dtypes and scalars (pickle protocol 5 uses _frombuffer).
    ALLOWED = {("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("builtins", "slice")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "numpy.dtypes" and name.endswith("DType")):
            return super().find_class(module, name)
        raise _ForeignClass(f"{module}.{name}")


def read_pkl(path: str) -> tuple[GPTConfig, dict, int | None]:
    """(config, params, step) from a model.pkl, checked against the config; UserError otherwise."""
    if not paths.exists(path) or paths.isdir(path):
        raise UserError(f"{path} does not exist; export one with `python -m scripts.export --run-dir=RUN`.")
    try:
        with paths.open_file(path, "rb") as f:  # from a bucket: streamed, never a local copy
            blob = _NumpyOnlyUnpickler(f).load()
    except _ForeignClass as e:
        raise UserError(f"{path} is not a flaxchat model.pkl (it contains a {e} object, which a flaxchat "
                        "export never does); export the model with `python -m scripts.export`.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, ImportError, MemoryError) as e:
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}); it may be truncated, "
                        "export it again.") from None
    if not isinstance(blob, dict) or blob.get("format") != PKL_FORMAT:
        raise UserError(f"{path} is a pickle but not a flaxchat model.pkl (no format '{PKL_FORMAT}'); "
                        "export the model with `python -m scripts.export`.")
    if blob.get("version") != PKL_VERSION:
        raise UserError(f"{path} is model.pkl version {blob.get('version')}; this flaxchat reads version "
                        f"{PKL_VERSION}, so export it again with this version.")
    cfg = GPTConfig.from_dict(blob["config"])
    flat = flatten(blob["params"])
    check_params(flat, cfg, path)
    return cfg, unflatten(flat), blob.get("step")


def load_pkl(path: str, dtype=None):
    """model.pkl -> a flaxchat GPT with its weights."""
    cfg, params, _ = read_pkl(path)
    return build_model(cfg, params, dtype)


# --- weights.npz ----------------------------------------------------------------------------------


def save_npz(path: str, cfg: GPTConfig, params: dict) -> str:
    arrays = dict(flatten(params))
    arrays[CONFIG_KEY] = np.array(json.dumps(cfg.to_dict(), sort_keys=True))
    arrays[FORMAT_KEY] = np.array(NPZ_FORMAT)
    # Uncompressed: trained float weights hardly compress, and saving stays as fast as a copy.
    return atomic_write(path, lambda f: np.savez(f, **arrays))


def read_npz(path: str) -> tuple[GPTConfig, dict]:
    if not paths.exists(path) or paths.isdir(path):
        raise UserError(f"{path} does not exist; export one with `python -m scripts.export --run-dir=RUN`.")
    try:
        with paths.open_file(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            if CONFIG_KEY not in z.files:
                raise UserError(f"{path} has no {CONFIG_KEY} entry, so it is not a flaxchat weights.npz; "
                                "export the model with `python -m scripts.export`.")
            cfg = GPTConfig.from_dict(json.loads(str(z[CONFIG_KEY])))
            flat = {k: z[k] for k in z.files if not k.startswith("__")}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable .npz archive ({type(e).__name__}); export it again.") from None
    check_params(flat, cfg, path)
    return cfg, unflatten(flat)


def load_npz(path: str, dtype=None):
    cfg, params = read_npz(path)
    return build_model(cfg, params, dtype)


def read_weights(path: str) -> tuple[GPTConfig, dict]:
    """(config, params) from a model.pkl or a weights.npz, by extension."""
    if path.endswith(".npz"):
        return read_npz(path)
    if path.endswith(".pkl"):
        return read_pkl(path)[:2]
    raise UserError(f"{path}: expected a model.pkl or weights.npz file (by extension).")


def pkl_bytes_equal(a: dict, b: dict) -> bool:
    """True when two param trees hold the same names, dtypes and bits (a test helper)."""
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(
        np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype and np.asarray(fa[k]).tobytes() == np.asarray(fb[k]).tobytes()
        for k in fa)


__all__ = ["atomic_write", "flatten", "unflatten", "model_params", "check_params", "build_model", "save_pkl",
           "read_pkl", "load_pkl", "save_npz", "read_npz", "load_npz", "read_weights", "pkl_bytes_equal"]

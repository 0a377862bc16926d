"""model.stablehlo: the forward pass as a serialized `jax.export` artifact, weights inside.

    exp = jax.export.deserialize(open("model.stablehlo", "rb").read())
    logits = exp.call(tokens)          # tokens (any batch, seq_len) int32 -> (batch, seq_len, vocab) f32

The batch size is symbolic; the sequence length is fixed at export (the model's context by
default): attention is the dense causal form of `decode.dense_attend` (plain ops every runtime
reads, no loops), and a symbolic length does not convert to TFLite anyway. The model is causal, so a shorter input
padded at the end gives exact logits at its real positions. The weights are constants of the
module, which keeps the file self-contained (the form LiteRT wants); a flatbuffer caps that at
2 GB of weights. `model.mlir` beside it is the same module as StableHLO text, for reading and for
tools that take MLIR.
"""

from __future__ import annotations

import os

from flaxchat.errors import UserError
from flaxchat.export.formats import atomic_write


def check_seq_len(cfg, seq_len: int | None) -> int:
    T = cfg.sequence_len if seq_len is None else int(seq_len)
    if T < 1:
        raise UserError(f"the sequence length must be at least 1 (got {T}).")
    if T > cfg.sequence_len:
        raise UserError(f"a sequence length of {T} is longer than the model's context of {cfg.sequence_len} "
                        "tokens it was trained with; pass --seq-len of at most that.")
    return T


def export_forward(model, seq_len: int | None = None, platforms: tuple[str, ...] | None = None):
    """jax.export.Exported of tokens (b, seq_len) int32 -> logits (b, seq_len, vocab) f32."""
    import jax
    import jax.numpy as jnp
    from flaxchat.export.decode import dense_attend

    T = check_seq_len(model.config, seq_len)
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, T), jnp.int32)
    # A single-device program whatever mesh the caller has set: under a mesh the module carries
    # Shardy mesh ops that other tools (TFLite) cannot read.
    with jax.set_mesh(None):
        forward = lambda tokens: model(tokens, attend=dense_attend)
        return jax.export.export(jax.jit(forward), platforms=platforms)(spec)


def save_stablehlo(model, path: str, seq_len: int | None = None, platforms: tuple[str, ...] | None = None) -> tuple[str, str]:
    """Write `path` (serialized) and the .mlir text beside it; returns both paths."""
    exported = export_forward(model, seq_len, platforms)
    try:
        blob = exported.serialize()
    except ImportError as e:  # jax.export serializes with flatbuffers, which jax does not install
        raise UserError(f"writing {os.path.basename(path)} needs the '{e.name or 'flatbuffers'}' package: "
                        "pip install flatbuffers (a dependency of flaxchat: pip install -e . in its checkout "
                        "installs it).") from None
    mlir_path = os.path.splitext(path)[0] + ".mlir"
    atomic_write(mlir_path, lambda f: f.write(exported.mlir_module()), mode="w")
    return atomic_write(path, lambda f: f.write(blob)), mlir_path


def load_stablehlo(path: str):
    """The jax.export.Exported in a model.stablehlo file (call it with `.call(tokens)`)."""
    import jax

    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist; export one with `python -m scripts.export`.")
    with open(path, "rb") as f:
        blob = f.read()
    try:
        return jax.export.deserialize(bytearray(blob))
    except ImportError as e:
        raise UserError(f"reading {path} needs the '{e.name or 'flatbuffers'}' package: pip install flatbuffers.") from None
    except Exception as e:
        raise UserError(f"{path} is not a serialized jax.export module ({type(e).__name__}); export it again.") from None

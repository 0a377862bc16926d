"""A .tflite with three signatures, so an app can generate with the LiteRT interpreter alone.

  forward  tokens (1, T) int32                               -> logits (1, T, vocab)
  prefill  tokens (1, P) int32, length (1,) int32            -> logits (1, vocab) of token length-1,
                                                                k_cache, v_cache, prev_embedding
  decode   token (1, 1) int32, position (1,) int32,          -> logits (1, vocab), k_cache, v_cache,
           k_cache, v_cache, prev_embedding                     prev_embedding
  caches (n_layer, 1, n_kv_head, T, head_dim) f32, prev_embedding (1, 1, n_embd) f32.

An app puts the prompt in tokens[0, :n] (n <= P, the rest anything), calls prefill with length n,
picks a token from the logits, then calls decode with that token at position n, n+1, ... < T,
feeding each call's caches and prev_embedding into the next (see `TFLiteModel.generate`).

Conversion: each signature is a jitted function with the weights closed over, exported with
`jax.export` to StableHLO and converted by Google's TensorFlow-free `litert-converter` (low-level
MLIR API, pinned at 0.5.0). The three modules are merged into one before conversion, and the
flatbuffer exporter shares identical weight buffers, so the file holds the weights once.
`quantize=True` then applies int8 dynamic-range quantization (`flaxchat.export.quantize`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from flaxchat.errors import UserError
from flaxchat.export.formats import atomic_write
from flaxchat.export.stablehlo import check_seq_len

CONVERTER_VERSION = "0.5.0"
# flaxchat is installed from its checkout, not from PyPI: `pip install 'flaxchat[export]'` answered
# "No matching distribution found for flaxchat".
# The one install hint: the same words in scripts/convert_to_tflite.py, flaxchat/export/__init__.py and
# docs/export.md ("Installing the converter"), which says why a venv of its own and what it costs.
INSTALL_HINT = ('from the flaxchat checkout, into a virtual environment of its own outside it: '
                'python -m venv ~/.venvs/flaxchat-export && . ~/.venvs/flaxchat-export/bin/activate && '
                'pip install -e ".[export]" (docs/export.md, "Installing the converter"; where the test extra is '
                'installed, pip install --no-deps "litert-converter==0.5.0" there instead)')


def require_converter():
    try:
        import litert_converter
        from litert_converter.mlir import ir, passmanager
        from litert_converter.mlir._mlir_libs import converter_api_ext
    except ImportError:
        raise UserError(f"converting to .tflite needs the optional litert-converter package: {INSTALL_HINT}.") from None
    if litert_converter.__version__ != CONVERTER_VERSION:
        raise UserError(f"flaxchat was tested with litert-converter {CONVERTER_VERSION}, whose low-level API "
                        f"changes between versions, but {litert_converter.__version__} is installed: "
                        f"pip install litert-converter=={CONVERTER_VERSION}.")
    return ir, passmanager, converter_api_ext


def require_interpreter():
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise UserError(f"running a .tflite needs the optional ai-edge-litert package: {INSTALL_HINT}.") from None
    return Interpreter


# --- the functions behind the signatures ------------------------------------------------------------


def signatures(model, seq_len: int | None = None, prefill_len: int | None = None) -> dict:
    """name -> (function, input specs, input names, output names), every shape fixed, batch 1."""
    import jax
    import jax.numpy as jnp

    from flaxchat.export import decode

    cfg = model.config
    T = check_seq_len(cfg, seq_len)
    P = T if prefill_len is None else int(prefill_len)
    if not 1 <= P <= T:
        raise UserError(f"--prefill-len must lie between 1 and the sequence length {T} (got {P}).")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    cache = f32(*decode.cache_shape(model, 1, T))
    state_out = ["logits", "k_cache", "v_cache", "prev_embedding"]
    return {
        "forward": (lambda tokens: model(tokens, attend=decode.dense_attend), [i32(1, T)], ["tokens"], ["logits"]),
        "prefill": (lambda tokens, length: decode.prefill(model, tokens, length, T),
                    [i32(1, P), i32(1)], ["tokens", "length"], state_out),
        "decode": (lambda token, position, k, v, prev: decode.decode_step(model, token, position, k, v, prev),
                   [i32(1, 1), i32(1), cache, cache, f32(1, 1, cfg.n_embd)],
                   ["token", "position", "k_cache", "v_cache", "prev_embedding"], state_out),
    }


def _stablehlo_texts(model, seq_len, prefill_len) -> dict[str, tuple[str, list[str], list[str]]]:
    import jax

    out = {}
    with jax.set_mesh(None):  # no Shardy mesh ops from a mesh the caller has set
        for name, (fn, specs, ins, outs) in signatures(model, seq_len, prefill_len).items():
            exported = jax.export.export(jax.jit(fn), platforms=("cpu",))(*specs)
            out[name] = (exported.mlir_module(), ins, outs)
    return out


def _convert(texts: dict) -> bytes:
    """StableHLO text per signature -> one float .tflite flatbuffer."""
    ir, passmanager, api = require_converter()
    ctx = ir.Context()
    api.prepare_mlir_context(ctx)
    with ctx:
        modules = []
        for name, (text, ins, outs) in texts.items():
            module = ir.Module.parse(text)
            for op in module.body.operations:
                # Every jax.export module calls its entry point @main; merge_modules needs unique
                # public names, and the signature is attached to the entry function.
                if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                    op.attributes["sym_name"] = ir.StringAttr.get(name)
                    api.set_signature(op.operation, name, ins, outs)
            modules.append(module)
        merged = api.merge_modules(modules)
        api.run_convert_to_tfl_passes(merged, passmanager.PassManager(), api.ConvertToTFLConfig())
        return bytes(api.export_flatbuffer_to_bytes(merged.operation))


def convert(model, *, seq_len: int | None = None, prefill_len: int | None = None, quantize: bool = False) -> tuple[bytes, dict]:
    """The .tflite bytes for a float32 GPT, and what happened (timings, quantization summary)."""
    from flaxchat.common import native_stderr_to
    require_converter()
    t0 = time.time()
    texts = _stablehlo_texts(model, seq_len, prefill_len)
    t1 = time.time()
    log: list[str] = []
    try:
        with native_stderr_to(log):
            blob = _convert(texts)
    except Exception as e:  # the MLIR bindings raise plain exceptions; the diagnostics went to fd 2
        raise RuntimeError(f"litert-converter failed: {str(e)[:2000]}\n{''.join(log)[-4000:]}") from e
    info = dict(export_s=t1 - t0, convert_s=time.time() - t1, float_bytes=len(blob))
    if quantize:
        from flaxchat.export.quantize import quantize_dynamic_range

        t2 = time.time()
        blob, summary = quantize_dynamic_range(blob)
        info.update(quantize_s=time.time() - t2, quantization=summary)
    return blob, info


def save_tflite(model, path: str, **kw) -> tuple[str, dict]:
    blob, info = convert(model, **kw)
    return atomic_write(path, lambda f: f.write(blob)), dict(info, bytes=len(blob))


# --- running it ----------------------------------------------------------------------------------------


class TFLiteModel:
    """The LiteRT interpreter over a flaxchat .tflite: forward, prefill, decode, greedy generate."""

    def __init__(self, path_or_bytes: str | bytes, num_threads: int | None = None):
        Interpreter = require_interpreter()
        if isinstance(path_or_bytes, str) and not os.path.isfile(path_or_bytes):
            raise UserError(f"{path_or_bytes} does not exist; convert one with `python -m scripts.convert_to_tflite`.")
        kw = dict(model_path=path_or_bytes) if isinstance(path_or_bytes, str) else dict(model_content=path_or_bytes)
        self.interpreter = Interpreter(**kw, num_threads=num_threads)
        sigs = self.interpreter.get_signature_list()
        if not {"forward", "prefill", "decode"} <= set(sigs):
            raise UserError(f"{path_or_bytes} has signatures {sorted(sigs)}, not flaxchat's forward/prefill/decode.")
        self._forward = self.interpreter.get_signature_runner("forward")
        self._prefill = self.interpreter.get_signature_runner("prefill")
        self._decode = self.interpreter.get_signature_runner("decode")
        self.seq_len = int(self._forward.get_input_details()["tokens"]["shape"][1])
        self.prefill_len = int(self._prefill.get_input_details()["tokens"]["shape"][1])
        self.vocab_size = int(self._prefill.get_output_details()["logits"]["shape"][-1])

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        return self._forward(tokens=np.asarray(tokens, np.int32))["logits"]

    def prefill(self, prompt: list[int]) -> dict:
        n = len(prompt)
        if not 1 <= n <= self.prefill_len:
            raise UserError(f"a prompt of {n} tokens does not fit the prefill length {self.prefill_len} of this model.")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise UserError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size}).")
        tokens = np.zeros((1, self.prefill_len), np.int32)
        tokens[0, :n] = prompt
        return self._prefill(tokens=tokens, length=np.array([n], np.int32))

    def decode(self, token: int, position: int, state: dict) -> dict:
        return self._decode(token=np.array([[token]], np.int32), position=np.array([position], np.int32),
                            k_cache=state["k_cache"], v_cache=state["v_cache"], prev_embedding=state["prev_embedding"])

    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        """Greedy continuation (at most up to the context); returns (tokens, decode tokens/second)."""
        if len(prompt) >= self.seq_len:
            raise UserError(f"a prompt of {len(prompt)} tokens leaves no room in the {self.seq_len}-token cache.")
        state = self.prefill(prompt)
        out, t0 = [], time.perf_counter()
        for pos in range(len(prompt), min(self.seq_len, len(prompt) + max_new)):
            out.append(int(np.argmax(state["logits"][0])))
            if len(out) == max_new or pos == self.seq_len - 1:
                break
            state = self.decode(out[-1], pos, state)
        dt = time.perf_counter() - t0
        return out, (len(out) - 1) / dt if len(out) > 1 and dt > 0 else 0.0

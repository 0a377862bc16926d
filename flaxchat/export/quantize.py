"""int8 dynamic-range quantization of a float .tflite, done on the flatbuffer itself.

What TFLiteConverter's `Optimize.DEFAULT` does without a representative dataset, and what the
TensorFlow-free `litert-converter` does not expose (its dynamic-range passes are not registered
with the pass manager, and ai-edge-litert's own Converter answers "not implemented"):

* A float constant of at least MIN_ELEMENTS read only as the weights of FULLY_CONNECTED ops becomes
  int8, symmetric, one scale per output row. The runtime then runs those ops "hybrid": it
  quantizes the activations on the fly (asymmetric, which suits the non-negative ReLU² outputs)
  and multiplies in int8 with int32 accumulation.
* Any other big float constant (the token and value embedding tables, read by GATHER_ND) is
  stored as int8 with one scale per row, followed by a DEQUANTIZE op; LiteRT evaluates a
  DEQUANTIZE of a constant once, when the model is prepared.
* Small tensors (per-layer scalars, gates) stay float: they cost nothing and are sensitive.

The three signatures share their weight buffers, so each buffer is quantized once.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

MIN_ELEMENTS = 1024  # TFLite's default threshold for weight quantization


def _schema():
    try:
        from litert_converter import schema_py_generated as s
    except ImportError:
        from ai_edge_litert import schema_py_generated as s
    return s


def _int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row (axis 0) int8: w ≈ q * scale[:, None]."""
    flat = w.reshape(w.shape[0], -1).astype(np.float32)
    amax = np.abs(flat).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(flat / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(w.shape), scale


def _opcode_index(model, s, builtin: int) -> int:
    for i, oc in enumerate(model.operatorCodes):
        if max(oc.builtinCode, oc.deprecatedBuiltinCode) == builtin:
            return i
    model.operatorCodes.append(s.OperatorCodeT(deprecatedBuiltinCode=min(builtin, 127), builtinCode=builtin, version=1))
    return len(model.operatorCodes) - 1


def _uses(model) -> dict[int, list[tuple[int, int, int, int]]]:
    """buffer -> [(subgraph, op index, input slot, tensor index)] over every subgraph."""
    uses = defaultdict(list)
    for g, sg in enumerate(model.subgraphs):
        for o, op in enumerate(sg.operators):
            for slot, t in enumerate(op.inputs if op.inputs is not None else []):
                if t >= 0:
                    uses[sg.tensors[t].buffer].append((g, o, slot, t))
    return uses


def quantize_dynamic_range(tflite: bytes, min_elements: int = MIN_ELEMENTS) -> tuple[bytes, dict]:
    """Returns (quantized flatbuffer, summary counts)."""
    import flatbuffers

    s = _schema()
    model = s.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    fc = s.BuiltinOperator.FULLY_CONNECTED
    gathers = {s.BuiltinOperator.GATHER, s.BuiltinOperator.GATHER_ND, s.BuiltinOperator.EMBEDDING_LOOKUP}
    summary = dict(hybrid_fc_weights=0, dequantized_constants=0, float_bytes=0, int8_bytes=0)
    dequant_ops = defaultdict(list)  # subgraph -> DEQUANTIZE ops to put first
    for b, uses in sorted(_uses(model).items()):
        buf = model.buffers[b]
        first = model.subgraphs[uses[0][0]].tensors[uses[0][3]]
        if b == 0 or buf.data is None or first.type != s.TensorType.FLOAT32:
            continue
        shape = tuple(int(d) for d in first.shape)
        if int(np.prod(shape)) < min_elements or len(shape) < 2:
            continue
        if any(tuple(int(d) for d in model.subgraphs[g].tensors[t].shape) != shape for g, _, _, t in uses):
            continue  # identical bytes under two shapes (e.g. all-zero matrices): per-row scales would not fit both
        ops = [(_builtin(model, model.subgraphs[g].operators[o]), slot) for g, o, slot, _ in uses]
        hybrid = all(op == fc and slot == 1 for op, slot in ops)
        if not hybrid and not all(op in gathers and slot == 0 for op, slot in ops):
            continue  # e.g. rotary tables folded into constants: their error matters, their size does not
        w = np.frombuffer(bytes(buf.data), np.float32).reshape(shape)
        q, scale = _int8_rows(w)
        summary["float_bytes"] += w.nbytes
        summary["int8_bytes"] += q.nbytes + scale.nbytes

        def qparams():
            return s.QuantizationParametersT(scale=scale.tolist(), zeroPoint=[0] * len(scale), quantizedDimension=0)

        if hybrid:
            buf.data = q.reshape(-1).view(np.uint8)
            for g, o, _, t in uses:
                tensor = model.subgraphs[g].tensors[t]
                tensor.type, tensor.quantization = s.TensorType.INT8, qparams()
                opts = model.subgraphs[g].operators[o].builtinOptions
                if isinstance(opts, s.FullyConnectedOptionsT):
                    opts.asymmetricQuantizeInputs = True
            summary["hybrid_fc_weights"] += 1
            continue
        model.buffers.append(s.BufferT(data=q.reshape(-1).view(np.uint8)))
        qbuf = len(model.buffers) - 1
        model.buffers[b] = s.BufferT()  # the float tensor is now computed, not stored
        for g in sorted({u[0] for u in uses}):
            sg = model.subgraphs[g]
            for t in sorted({u[3] for u in uses if u[0] == g}):
                old = sg.tensors[t]
                sg.tensors.append(s.TensorT(shape=old.shape, type=s.TensorType.INT8, buffer=qbuf,
                                            name=(old.name or b"w") + b"_int8", quantization=qparams()))
                dequant_ops[g].append(s.OperatorT(opcodeIndex=_opcode_index(model, s, s.BuiltinOperator.DEQUANTIZE),
                                                  inputs=[len(sg.tensors) - 1], outputs=[t]))
        summary["dequantized_constants"] += 1
    for g, first_ops in dequant_ops.items():
        model.subgraphs[g].operators = first_ops + model.subgraphs[g].operators
    builder = flatbuffers.Builder(len(tflite))
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), summary


def _builtin(model, op) -> int:
    oc = model.operatorCodes[op.opcodeIndex]
    return max(oc.builtinCode, oc.deprecatedBuiltinCode)

"""Convert a flaxchat model to a .tflite that generates with the LiteRT interpreter alone.

    python -m scripts.convert_to_tflite --checkpoint=exports/model.pkl --output=exports/model.tflite
    python -m scripts.convert_to_tflite --checkpoint=runs/tinystories --quantize      # int8 weights
    python -m scripts.convert_to_tflite --checkpoint=gs://my-bucket/d20/export/model.pkl

--checkpoint takes a model.pkl, a weights.npz or a training run folder, local or gs:// (from a
bucket only that file, or the run's latest step, is read). The file has three
signatures: `forward` (fixed length), `prefill` and `decode` (one token, explicit KV cache); see
flaxchat/export/tflite.py and docs/export.md. After writing it, the script checks it against JAX
(max logit error, top-1 agreement, a greedy generation token for token) unless --no-verify.
Needs the optional converter: from the flaxchat checkout, into a virtual environment of its own
outside it: python -m venv ~/.venvs/flaxchat-export && . ~/.venvs/flaxchat-export/bin/activate &&
pip install -e ".[export]" (docs/export.md, "Installing the converter").
"""

from __future__ import annotations

import sys
import time

from flaxchat.config import ArgumentParser
from flaxchat.errors import UserError, cli_main


def parse_args(argv):
    p = ArgumentParser(prog="python -m scripts.convert_to_tflite", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="model.pkl, weights.npz or a run folder (local or gs://)")
    p.add_argument("--output", default=None,
                   help="the .tflite to write, local or gs:// (default: model.tflite or model_int8.tflite beside the "
                        "checkpoint: in the run folder for a run folder, beside the file for a .pkl/.npz)")
    p.add_argument("--quantize", action="store_true", help="int8 dynamic-range weights (about 4x smaller)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="forward length and KV-cache length (default: the model's context)")
    p.add_argument("--prefill-len", type=int, default=None, help="longest prompt prefill takes (default: --seq-len)")
    p.add_argument("--verify", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="compare the .tflite with JAX after writing it (default: on)")
    return p.parse_args(argv)


def default_output(checkpoint: str, quantize: bool) -> str:
    from flaxchat import paths
    base = checkpoint if paths.isdir(checkpoint) else paths.parent(checkpoint)
    return paths.join(base, "model_int8.tflite" if quantize else "model.tflite")


def main(argv=None) -> int:
    args = parse_args(argv)
    from flaxchat import paths
    from flaxchat.export import build_model, read_any
    from flaxchat.kernels import portable
    from flaxchat.export.tflite import require_converter, require_interpreter, save_tflite

    require_converter()  # say so before anything else: nothing runs without it
    if args.verify:
        require_interpreter()
    if not paths.exists(args.checkpoint):
        raise paths.missing_bucket(args.checkpoint) or UserError(
            f"{args.checkpoint} does not exist; pass a run folder, a model.pkl or a weights.npz.")
    output = args.output or default_output(args.checkpoint, args.quantize)
    paths.check_destination(output, "--output", file=True)  # before the minutes of conversion
    cfg, params, _ = read_any(args.checkpoint)
    model = build_model(cfg, params, kernels=portable())  # plain XLA ops, which LiteRT converts
    path, info = save_tflite(model, output, seq_len=args.seq_len, prefill_len=args.prefill_len, quantize=args.quantize)
    print(f"wrote {path} ({info['bytes'] / 1e6:.2f} MB; float {info['float_bytes'] / 1e6:.2f} MB): "
          f"StableHLO export {info['export_s']:.1f}s, conversion {info['convert_s']:.1f}s"
          + (f", quantization {info['quantize_s']:.1f}s {info['quantization']}" if args.quantize else ""))
    if args.verify:
        lite = path if not paths.is_remote(path) else paths.read_bytes(path)  # the interpreter takes bytes too
        for key, value in verify(model, lite).items():
            print(f"verify {key}: {value}")
    return 0


def verify(model, path: str | bytes, max_new: int = 32) -> dict:
    """Compare the .tflite with the JAX model on a random sequence and a greedy generation."""
    import jax.numpy as jnp
    import numpy as np

    from flaxchat.export.decode import greedy_generate
    from flaxchat.export.tflite import TFLiteModel

    lite = TFLiteModel(path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (1, lite.seq_len), dtype=np.int32)
    ref = np.asarray(model(jnp.asarray(tokens)))
    got = lite.forward(tokens)
    prompt = tokens[0, :min(8, lite.prefill_len)].tolist()
    t0 = time.time()
    lite_tokens, tok_s = lite.generate(prompt, max_new)
    jax_tokens = greedy_generate(model, prompt, max_new, lite.seq_len)
    return {"max |logit - JAX|": f"{np.abs(got - ref).max():.3g}",
            "top-1 agreement with JAX": f"{(got.argmax(-1) == ref.argmax(-1)).mean():.4f}",
            f"greedy {len(lite_tokens)} tokens equal JAX's": lite_tokens == jax_tokens,
            "decode tokens/s": f"{tok_s:.0f}", "check took": f"{time.time() - t0:.1f}s"}


if __name__ == "__main__":
    sys.exit(cli_main(main))

"""Export a training run: model.pkl, weights.npz, model.stablehlo (+ model.mlir), and its tokenizer.

    python -m scripts.export --run-dir=runs/tinystories                  # -> runs/tinystories/export/
    python -m scripts.export --run-dir=runs/d4 --out-dir=exports --step=500
    python -m scripts.export --run-dir=gs://my-bucket/d20               # -> gs://my-bucket/d20/export/
    python -m scripts.convert_to_tflite --checkpoint=exports/model.pkl --output=exports/model.tflite

Reads the latest finished checkpoint read-only (a save still in flight is neither used nor touched);
from a bucket only that step's arrays and the tokenizer are read. Every file is written under a
temporary name and renamed when complete (in a bucket: one upload per file, atomic there).
"""

from __future__ import annotations

import sys
import time

from flaxchat.config import ArgumentParser
from flaxchat.errors import UserError, cli_main


def parse_args(argv):
    p = ArgumentParser(prog="python -m scripts.export", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="training run folder, local or gs:// (holds checkpoints/), or one checkpoints/<step>")
    p.add_argument("--out-dir", default=None, help="where to write, local or gs:// (default: <run-dir>/export)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest finished one)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length of the StableHLO forward (default: the model's context)")
    p.add_argument("--platforms", default="cpu",
                   help="comma-separated platforms the StableHLO is lowered for, e.g. cpu,cuda,tpu (default: cpu)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from flaxchat.export import export_run

    t0 = time.time()
    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    if not platforms or set(platforms) - {"cpu", "cuda", "rocm", "tpu"}:
        raise UserError(f"--platforms takes a comma-separated list of cpu, cuda, rocm, tpu (got {args.platforms!r}).")
    from flaxchat import paths as fs
    from flaxchat.export.source import checkpoint_dir
    checkpoint_dir(args.run_dir)  # a missing run folder is said first (and no export/ is made for it)
    fs.check_destination(args.out_dir or fs.RunFolder(args.run_dir).export, "--out-dir")
    files = export_run(args.run_dir, args.out_dir, step=args.step, seq_len=args.seq_len, platforms=platforms)
    for name, path in files.items():
        size = fs.size(path) if not fs.isdir(path) else sum(fs.size(p) for p in fs.listdir(path, recursive=True))
        print(f"{name:10s} {path}  ({size / 1e6:.2f} MB)")
    print(f"exported in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

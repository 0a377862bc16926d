"""The main job: train a small story-telling GPT on this machine, offline, in minutes.

    python -m scripts.run_tinystories --depth=4 --steps=1000

Trains a tokenizer on the built-in procedural children's stories (or --data), pretrains a depth-4
GPT with Muon + AdamW, evaluates validation bits-per-byte, prints a few sampled stories and writes
a run folder: checkpoints, report.md, loss.png, samples.txt, metrics.jsonl. Every flag of
`scripts.pretrain` works here; only the defaults differ (small batches that suit a 2-core CPU).
Run it again with the same --run-dir and it resumes where it stopped.
"""

from __future__ import annotations

import functools
import os
import sys

from flaxchat.errors import cli_main
from flaxchat.kernels import tune_process
from scripts import pretrain

DEFAULTS = dict(
    run_dir="runs/tinystories",
    data="stories",
    depth=4,
    steps=1000,
    sequence_len=256,
    vocab_size=4096,
    device_batch_size=4,
    # 1,024 tokens per step (one micro-batch of 4 x 256): 1,000 steps = 1M tokens, ~10 minutes on a
    # 2-core machine whose fp32 matmul peak is ~130 GFLOP/s (Muon's orthogonalisation is a fixed
    # ~20 GFLOP per step at depth 4, so smaller steps would buy little).
    total_batch_size=1024,
    # nanochat scales every LR by sqrt(B / 2^19); at 1,024 tokens per step that is x0.044, and it
    # made val bpb clearly worse at equal tokens here (docs/recipe.md). The CPU preset keeps the
    # LRs as given; the rest of nanochat's recipe (schedules, weight decay rule, Muon) applies.
    lr_batch_scaling="off",
    eval_every=250,
    eval_tokens=32_768,
    sample_every=500,
    save_every=250,
    log_every=25,
)


def main(argv=None, tune=False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    export = "--no-export" not in argv  # export model.pkl / weights.npz / model.stablehlo by default
    argv = [a for a in argv if a not in ("--export", "--no-export")]
    cfg = pretrain.parse_args(argv, DEFAULTS, description=__doc__ + EXPORT_HELP, prog="python -m scripts.run_tinystories")
    if tune:  # after the flags, so that --help and a bad flag answer without JAX
        tune_process()
    summary = pretrain.run(cfg)
    from flaxchat.paths import RunFolder, exists
    # A rerun of a finished run that was exported leaves its export as it is, as the rest of its record.
    if summary.get("already_complete") and exists(RunFolder(cfg.run_dir).export):
        export = False
    if export and summary.get("is_main", True):
        from flaxchat.export import export_run
        files = export_run(cfg.run_dir, tokenizer_dir=cfg.tokenizer_dir or None)
        out = RunFolder(cfg.run_dir).export
        print(f"exported: {', '.join(p[len(out):].lstrip('/' + os.sep) for p in files.values())} in {out}",
              flush=True)
    return 0


EXPORT_HELP = """
At the end the run is exported into <run-dir>/export (model.pkl, weights.npz, model.stablehlo,
model.mlir, tokenizer/); --no-export skips that.
"""


if __name__ == "__main__":
    sys.exit(cli_main(functools.partial(main, tune=True)))

"""The main job: train a small story-telling GPT on this machine, offline, in minutes.

    python -m scripts.run_tinystories --depth=4 --steps=1000

Trains a tokenizer on the built-in procedural children's stories (or --data), pretrains a depth-4
GPT with Muon + AdamW, evaluates validation bits-per-byte, prints a few sampled stories and writes
a run folder: checkpoints, report.md, loss.png, samples.txt, metrics.jsonl. Every flag of
`scripts.pretrain` works here; only the defaults differ (small batches that suit a 2-core CPU).
Run it again with the same --run-dir and it resumes where it stopped.
"""

from __future__ import annotations

import sys

from flaxchat.errors import cli_main, reexec_with_hugepages
from scripts import pretrain

DEFAULTS = dict(
    run_dir="runs/tinystories",
    data="stories",
    depth=4,
    steps=1000,
    sequence_len=256,
    vocab_size=4096,
    device_batch_size=4,
    total_batch_size=2048,  # 2 micro-batches of 4 x 256: small micro-batches run fastest on CPU
    eval_every=250,
    eval_tokens=32_768,
    sample_every=500,
    save_every=250,
    log_every=25,
)


def main(argv=None) -> int:
    cfg = pretrain.parse_args(argv, DEFAULTS, description=__doc__)
    pretrain.run(cfg)
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(cli_main(main))

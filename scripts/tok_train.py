"""Train the BPE tokenizer and report its compression on held-out text.

    python -m scripts.tok_train --vocab-size=4096 --data=stories --max-chars=10_000_000 --out DIR

`--data` is anything `flaxchat.data.sources.resolve_source` accepts: `stories` (built-in, offline),
a local file/folder/glob of .txt/.jsonl/.parquet, or `hf:owner/name`. Training reads the train split;
the compression ratio (UTF-8 bytes per token, higher is better) is measured on the val split.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Iterable, Iterator

from flaxchat.errors import UserError, cli_main
from flaxchat.tokenizer import FILENAME, SPECIAL_TOKENS, Tokenizer, get_default_tokenizer_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.tok_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=4096, help="vocab size including the 9 special tokens")
    p.add_argument("--data", default="stories", help="stories | path/glob of .txt/.jsonl/.parquet | hf:owner/name")
    p.add_argument("--field", default="text", help="JSON field / parquet column holding the text")
    p.add_argument("--max-chars", type=int, default=10_000_000, help="characters of training text to read")
    p.add_argument("--doc-cap", type=int, default=10_000, help="characters kept from each document")
    p.add_argument("--eval-docs", type=int, default=500, help="held-out documents for the compression ratio")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in stories")
    p.add_argument("--out", default=None, help=f"output folder (default {get_default_tokenizer_dir()})")
    p.add_argument("--force", action="store_true", help="overwrite an existing tokenizer in --out")
    return p.parse_args(argv)


def _progress(texts: Iterable[str], total_chars: int) -> Iterator[str]:
    """Pass texts through while showing how much of the character budget has been read."""
    from tqdm import tqdm

    with tqdm(total=total_chars, unit="char", unit_scale=True, desc="reading", file=sys.stdout,
              mininterval=0.5) as bar:
        for text in texts:
            bar.update(min(len(text), bar.total - bar.n))
            yield text


def main(argv=None) -> int:
    args = parse_args(argv)
    # Imported here so `--help` answers instantly.
    from pathlib import Path

    from flaxchat.data.sources import resolve_source

    # --- checks
    from flaxchat import paths

    out = Path(args.out) if args.out else get_default_tokenizer_dir()
    paths.check_destination(str(out), "--out")  # a file or a read-only place fails now, not after training
    if (out / FILENAME).exists() and not args.force:
        raise UserError(f"{out} already has a tokenizer; pass --force to overwrite it or --out for another folder")
    if min(args.max_chars, args.doc_cap, args.eval_docs) < 1:  # --doc-cap 0 read the whole corpus into nothing
        raise UserError("--max-chars, --doc-cap and --eval-docs must be positive")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UserError(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + "
                        f"{len(SPECIAL_TOKENS)} special tokens)")

    # --- data
    train = resolve_source(args.data, "train", seed=args.seed, field=args.field)
    val = resolve_source(args.data, "val", seed=args.seed, field=args.field)
    print(f"training on {train.name}; evaluating on {val.name}")

    # --- train
    t0 = time.perf_counter()
    texts = _progress((text for _, text in train.iter_docs()), args.max_chars)
    try:
        tok = Tokenizer.train(texts, args.vocab_size, max_chars=args.max_chars, doc_cap=args.doc_cap)
    finally:
        texts.close()  # closes the progress bar before the next line prints
    seconds = time.perf_counter() - t0
    tok.meta.update({"data": train.name, "vocab_size": tok.vocab_size})
    path = tok.save(out)
    print(f"trained vocab {tok.vocab_size} on {tok.meta['train_chars']:,} characters in {seconds:.2f} s "
          f"(reading + BPE); saved {path}")

    # --- evaluate
    n_eval = min(args.eval_docs, len(val))
    docs = [val.doc(i) for i in range(n_eval)]
    t0 = time.perf_counter()
    ids = tok.encode(docs)
    seconds = time.perf_counter() - t0
    n_tokens, n_bytes = sum(map(len, ids)), sum(len(d.encode("utf-8")) for d in docs)
    ratio = n_bytes / max(n_tokens, 1)
    print(f"held-out compression: {ratio:.3f} bytes/token ({n_bytes:,} bytes -> {n_tokens:,} tokens, "
          f"{n_eval} docs); encode {n_tokens / max(seconds, 1e-9):,.0f} tokens/s")
    sample = docs[0][:80]
    pieces = [tok.id_to_token(i) for i in tok.encode(sample)]
    print(f"sample: {'|'.join(pieces)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

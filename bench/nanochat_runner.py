"""Runs nanochat's own `scripts/base_train.py` on a text bench.quality prepared; run by nanochat's python.

    <nanochat python> bench/nanochat_runner.py --nanochat DIR --base-dir DIR --tokenizer FILE \
        --val-rows FILE --seed N --out FILE -- <base_train flags>

Nothing of nanochat is copied: its training script runs unchanged from DIR (its recipe, its data
loader over the parquet shards bench.quality wrote, its optimizer, its evaluate_bpb). Four things
are set from outside, each the same for flaxchat's side of the bench:
- the tokenizer: flaxchat's tokenizer.json, written as the tiktoken pickle and token_bytes.pt
  nanochat's tok_train would write (same ranks, pattern and special tokens; token bytes 0 for the
  special tokens, as both count them);
- the validation rows: the bench's fixed rows (flaxchat's val loader's first rows) replace
  nanochat's val loader, so both systems are scored on the same tokens;
- the seed of the initialisation (nanochat always seeds 42);
- torch.compile is the identity (an inductor compile costs minutes on a CPU, for the same program).
Each val bpb nanochat measures is appended to --out as JSON.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import sys


def encoding_from_flaxchat(tokenizer_json: str):
    """The tiktoken Encoding of a flaxchat tokenizer.json (ranks = list order, specials after them)."""
    import tiktoken
    with open(tokenizer_json) as f:
        payload = json.load(f)
    ranks = {base64.b64decode(t): i for i, t in enumerate(payload["tokens"])}
    specials = {name: len(ranks) + i for i, name in enumerate(payload["special_tokens"])}
    return tiktoken.Encoding(name="rustbpe", pat_str=payload["pattern"], mergeable_ranks=ranks,
                             special_tokens=specials)


def token_byte_lengths(enc) -> list[int]:
    """nanochat tok_train's token_bytes: UTF-8 bytes per token, 0 for special tokens."""
    special = set(enc.special_tokens_set)
    return [0 if enc.decode([i]) in special else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", required=True, help="nanochat's repository (the folder with nanochat/ and scripts/)")
    p.add_argument("--base-dir", required=True, help="NANOCHAT_BASE_DIR: holds base_data_climbmix/*.parquet")
    p.add_argument("--tokenizer", required=True, help="flaxchat's tokenizer.json")
    p.add_argument("--val-rows", required=True, help=".npz with x, y (batches, rows, seq) int32")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the initialisation")
    p.add_argument("--out", required=True, help="JSON file the val bpb figures are written to")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    args, train_args = p.parse_known_args(argv)
    train_args = [a for a in train_args if a != "--"]

    import numpy as np
    import torch
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    os.environ["NANOCHAT_BASE_DIR"] = args.base_dir
    sys.path.insert(0, os.path.abspath(args.nanochat))
    os.chdir(args.nanochat)

    tok_dir = os.path.join(args.base_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    enc = encoding_from_flaxchat(args.tokenizer)
    with open(os.path.join(tok_dir, "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f)
    torch.save(torch.tensor(token_byte_lengths(enc), dtype=torch.int32), os.path.join(tok_dir, "token_bytes.pt"))

    try:
        import wandb  # noqa: F401  (base_train imports it; with --run dummy it is never called)
    except ImportError:
        import types
        sys.modules["wandb"] = types.ModuleType("wandb")

    import nanochat.common as common
    import nanochat.dataloader as dataloader
    import nanochat.loss_eval as loss_eval

    compute_init = common.compute_init

    def seeded_compute_init(*a, **k):
        out = compute_init(*a, **k)
        torch.manual_seed(args.seed)
        return out

    common.compute_init = seeded_compute_init

    rows = np.load(args.val_rows)
    vx, vy = rows["x"], rows["y"]

    def val_loader(tokenizer, B, T, split, device="cpu", **kw):
        if split != "val" or vx.shape[1:] != (B, T):
            raise SystemExit(f"nanochat_runner: the val rows are {vx.shape[1:]}, nanochat asked for {split} ({B}, {T})")
        i = 0
        while True:
            yield torch.from_numpy(vx[i % len(vx)]).long().to(device), torch.from_numpy(vy[i % len(vy)]).long().to(device)
            i += 1

    dataloader.tokenizing_distributed_data_loader_bos_bestfit = val_loader
    evaluate_bpb, results = loss_eval.evaluate_bpb, []

    def recorded_evaluate_bpb(model, batches, steps, token_bytes):
        if steps > len(vx):
            raise SystemExit(f"nanochat_runner: nanochat evaluates {steps} batches, the bench gave {len(vx)}")
        bpb = evaluate_bpb(model, batches, steps, token_bytes)
        results.append(bpb)
        with open(args.out, "w") as f:
            json.dump({"val_bpb": results, "seed": args.seed, "train_args": train_args}, f)
        return bpb

    loss_eval.evaluate_bpb = recorded_evaluate_bpb
    torch.compile = lambda model=None, **k: model if model is not None else (lambda fn: fn)

    import runpy
    sys.argv = ["scripts/base_train.py", *train_args]
    runpy.run_module("scripts.base_train", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quality at equal tokens: flaxchat and nanochat side by side on the same text, tokenizer, model and data.

    python -m bench.quality --nanochat ~/nanochat --nanochat-python ~/nanochat-env/bin/python \\
        --text comedies=texts/comedies --text kjv=texts/kjv --seeds 0,1
    python -m bench.quality ... --systems flaxchat --label wd-off --flaxchat-args="--weight-decay=0"
    python -m bench.quality ... --total-batch-size -1          # each system's automatic batch

For each text (`NAME=SPEC`, SPEC anything `scripts.pretrain --data` reads; a folder with train.* and
val.* files keeps its split) the bench trains one vocab-4096 tokenizer on the text's train split with
flaxchat and gives it to both systems, writes the same train and val documents as parquet shards
for nanochat, and fixes the validation rows: flaxchat's val loader's first --eval-tokens tokens,
which nanochat's run reads instead of its own val loader. Then, per seed, each system trains with
its own recipe (flaxchat: `scripts.pretrain`; nanochat: its unchanged `scripts/base_train.py`, run
by bench/nanochat_runner.py in nanochat's own Python) at the same depth, width, context, window
pattern and tokens per step, and is scored at every --eval-every steps. Both compute bpb the same
way: summed nats over the targets that carry bytes, over ln 2 x their summed UTF-8 bytes, with
the same token byte lengths (the bench checks nanochat's against flaxchat's).

Runs are kept under --out (NAME/LABEL/SYSTEM-sSEED.json and .log): a run already there is read,
not rerun, so a table grows one run at a time. Each table prints, per step, each system's val bpb
per seed, their means and sample standard deviations, and flaxchat - nanochat with its standard
error (sqrt(sd_f^2/n_f + sd_n^2/n_n)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flaxchat.errors import UserError, cli_main

RUNNER = Path(__file__).with_name("nanochat_runner.py")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", action="append", default=[], metavar="NAME=SPEC", required=True,
                   help="a text to train on: a name for the table, '=', and a --data spec (repeatable)")
    p.add_argument("--nanochat", default="", help="nanochat's repository: the folder holding scripts/base_train.py")
    p.add_argument("--nanochat-python", default="", help="the Python of nanochat's environment (with torch)")
    p.add_argument("--systems", default="flaxchat,nanochat", help="which systems to run (default: %(default)s)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds of the initialisation (default: %(default)s)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=200, help="steps between val bpb figures (default: %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens (default: %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="layers; width 64 x depth, heads of 64 (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256, help="context length (default: %(default)s)")
    p.add_argument("--window-pattern", default="SSSL", help="attention windows (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary (default: %(default)s)")
    p.add_argument("--device-batch-size", type=int, default=8, help="rows per micro-batch (default: %(default)s)")
    p.add_argument("--total-batch-size", type=int, default=2048,
                   help="tokens per step; -1: each system's automatic batch (default: %(default)s)")
    p.add_argument("--label", default="default", help="name of flaxchat's variant in the table (default: %(default)s)")
    p.add_argument("--flaxchat-args", default="", help="extra flags for scripts.pretrain, e.g. '--weight-decay=0'")
    p.add_argument("--nanochat-args", default="", help="extra flags for nanochat's base_train")
    p.add_argument("--nanochat-threads", type=int, default=1,
                   help="torch's CPU threads for nanochat; on a shared 2-core machine torch's two spinning threads "
                        "took 2-8 s a step at depth 4, one thread ~1 s (0: torch's default) (default: %(default)s)")
    p.add_argument("--out", default="runs/quality", help="folder for the prepared texts and runs (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one training run may take (default: %(default)s)")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if set(args.systems) - {"flaxchat", "nanochat"} or not args.systems:
        raise UserError(f"--systems takes flaxchat and/or nanochat (got {','.join(args.systems) or 'none'}).")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise UserError(f"--seeds takes comma-separated integers (got {args.seeds!r}).") from None
    texts = {}
    for t in args.text:
        name, _, spec = t.partition("=")
        if not name or not spec or "/" in name:
            raise UserError(f"--text takes NAME=SPEC, a name without '/' and a --data spec (got {t!r}).")
        texts[name] = spec
    args.texts = texts
    if args.eval_tokens % (args.device_batch_size * args.seq):
        raise UserError(f"--eval-tokens {args.eval_tokens} is not a multiple of a micro-batch "
                        f"({args.device_batch_size} x {args.seq}).")
    return args


def check_nanochat(directory: str, python: str) -> tuple[Path, str]:
    """nanochat's repository and Python, or one sentence on what is missing."""
    if not directory or not python:
        raise UserError("nanochat's side needs --nanochat DIR (its repository) and --nanochat-python PATH (the "
                        "Python of an environment with torch), or run --systems flaxchat.")
    root = Path(directory).expanduser().resolve()
    if not (root / "scripts" / "base_train.py").is_file() or not (root / "nanochat" / "gpt.py").is_file():
        raise UserError(f"no nanochat repository at {root} (scripts/base_train.py and nanochat/gpt.py are not "
                        "there); pass the folder of a nanochat checkout to --nanochat.")
    exe = shutil.which(str(Path(python).expanduser()))
    if exe is None:
        raise UserError(f"no Python at {python}; pass nanochat's environment's interpreter to --nanochat-python.")
    probe = subprocess.run([exe, "-c", "import torch, tiktoken, pyarrow; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:
        missing = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "it failed"
        raise UserError(f"{exe} cannot run nanochat ({missing}); install torch, tiktoken, rustbpe and pyarrow there.")
    print(f"nanochat: {root} (commit {_commit(root)}), python {exe} (torch {probe.stdout.strip()})")
    return root, exe


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip() or "unknown: not a git checkout"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- the shared inputs: tokenizer, documents, validation rows -------------------------------------


def prepare(name: str, spec: str, args) -> Path:
    """Write NAME/ under --out: tokenizer/, nanochat/base_data_climbmix/*.parquet, val_rows.npz."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flaxchat.data.loader import PackingLoader
    from flaxchat.data.sources import resolve_source
    from flaxchat.tokenizer import texts_of, train_or_load

    root = Path(args.out) / name
    stamp = root / "prepared.json"
    want = dict(spec=spec, vocab=args.vocab, seq=args.seq, batch=args.device_batch_size, eval_tokens=args.eval_tokens)
    if stamp.is_file() and json.loads(stamp.read_text()).get("inputs") == want:
        return root
    root.mkdir(parents=True, exist_ok=True)
    train, val = resolve_source(spec, split="train"), resolve_source(spec, split="val")
    print(f"{name}: train {train.name}; val {val.name}")
    tok = train_or_load(root / "tokenizer", lambda: texts_of(train), args.vocab, max_chars=20_000_000, log=print)
    shards = root / "nanochat" / "base_data_climbmix"
    shards.mkdir(parents=True, exist_ok=True)
    counts = {}
    # nanochat reads every shard but the last for training and the last for validation.
    for i, (split, src) in enumerate((("train", train), ("val", val))):
        docs = list(texts_of(src))
        pq.write_table(pa.table({"text": docs}), shards / f"shard_{i:05d}.parquet", row_group_size=1024)
        counts[split] = dict(docs=len(docs), chars=sum(map(len, docs)))
    loader = PackingLoader(val, tok, args.device_batch_size, args.seq, process_index=0, process_count=1)
    xs, ys = zip(*(loader.next_batch() for _ in range(args.eval_tokens // (args.device_batch_size * args.seq))))
    np.savez(root / "val_rows.npz", x=np.stack(xs).astype(np.int32), y=np.stack(ys).astype(np.int32))
    tokens = sum(len(t) for t in tok.encode(list(texts_of(train)), prepend=tok.bos_token_id))
    stamp.write_text(json.dumps(dict(inputs=want, train_tokens=tokens, **counts), indent=1))
    return root


# --- the runs -------------------------------------------------------------------------------------


def runs_dir(root: Path, args) -> Path:
    """Where a text's runs at this batch live: runs at another batch never share a table."""
    return root / f"batch-{args.total_batch_size if args.total_batch_size > 0 else 'auto'}"


def _flags(args) -> list[str]:
    return [f"--depth={args.depth}", f"--device-batch-size={args.device_batch_size}",
            f"--total-batch-size={args.total_batch_size}", f"--eval-every={args.eval_every}",
            f"--eval-tokens={args.eval_tokens}"]


def _run(cmd, log: Path, env, cwd, timeout) -> None:
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise UserError(f"a run took over {timeout:.0f} s and was stopped; its log is {log}.") from None
    if rc:
        tail = log.read_text().strip().splitlines()[-1:] or ["(empty log)"]
        raise UserError(f"a run failed (exit {rc}: {tail[0]}); its log is {log}.")
    print(f"    done in {time.time() - t0:.0f} s")


def run_flaxchat(root: Path, spec: str, seed: int, args) -> dict:
    out = runs_dir(root, args) / args.label / f"flaxchat-s{seed}.json"
    if out.is_file():
        return json.loads(out.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = out.with_suffix("")
    cmd = [sys.executable, "-m", "scripts.pretrain", f"--data={spec}", f"--tokenizer-dir={root / 'tokenizer'}",
           f"--run-dir={run_dir}", "--fresh", f"--steps={args.steps}", f"--seed={seed}",
           f"--sequence-len={args.seq}", f"--window-pattern={args.window_pattern}", f"--vocab-size={args.vocab}",
           "--sample-every=0", "--num-samples=0", f"--save-every={args.steps}", "--keep-checkpoints=1",
           *_flags(args), *args.flaxchat_args.split()]
    print(f"  flaxchat [{args.label}] seed {seed}: {' '.join(cmd[3:])}")
    _run(cmd, out.with_suffix(".log"), os.environ.copy(), os.getcwd(), args.timeout)
    entries = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {e["step"]: e["val_bpb"] for e in entries if e.get("kind") == "val"}
    config = json.loads((run_dir / "config.json").read_text())
    result = dict(system="flaxchat", seed=seed, val_bpb={str(k): v for k, v in sorted(val.items())},
                  total_batch_size=config["total_batch_size"], flags=cmd[3:])
    out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the figures are what the bench keeps
    return result


def run_nanochat(root: Path, seed: int, args, nanochat: Path, python: str) -> dict:
    out = runs_dir(root, args) / "nanochat" / f"nanochat-s{seed}.json"
    if out.is_file():
        return json.loads(out.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".raw.json")
    cmd = [python, str(RUNNER), f"--nanochat={nanochat}", f"--base-dir={(root / 'nanochat').resolve()}",
           f"--tokenizer={(root / 'tokenizer' / 'tokenizer.json').resolve()}",
           f"--val-rows={(root / 'val_rows.npz').resolve()}", f"--seed={seed}", f"--threads={args.nanochat_threads}", f"--out={raw.resolve()}", "--",
           "--device-type=cpu", "--run=dummy", f"--depth={args.depth}", "--head-dim=64",
           f"--max-seq-len={args.seq}", f"--window-pattern={args.window_pattern}", f"--num-iterations={args.steps}",
           "--core-metric-every=-1", "--sample-every=-1", f"--model-tag=bench-s{seed}", *_flags(args),
           *args.nanochat_args.split()]
    steps = sorted({*range(0, args.steps, args.eval_every), args.steps})
    done = raw.is_file() and len(json.loads(raw.read_text())["val_bpb"]) == len(steps)
    if done:  # the runner finished (its figures are all there) but this bench was stopped before reading them
        print(f"  nanochat seed {seed}: read from {raw}")
    else:
        print(f"  nanochat seed {seed}: {' '.join(cmd[cmd.index('--') + 1:])}")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # flaxchat's `scripts` is not nanochat's
        _run(cmd, out.with_suffix(".log"), env, str(nanochat), args.timeout)
    figures = json.loads(raw.read_text())["val_bpb"]
    log = out.with_suffix(".log").read_text()
    batch = next((int(line.split("Total batch size ")[1].split()[0].replace(",", ""))
                  for line in log.splitlines() if line.startswith("Total batch size ")), args.total_batch_size)
    result = dict(system="nanochat", seed=seed, val_bpb={str(s): b for s, b in zip(steps, figures)},
                  total_batch_size=batch, flags=cmd[cmd.index("--") + 1:])
    out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(root / "nanochat" / "base_checkpoints", ignore_errors=True)
    return result


def check_token_bytes(root: Path, python: str) -> None:
    """nanochat's token_bytes.pt (written by the runner) equals flaxchat's token byte lengths."""
    from flaxchat.tokenizer import Tokenizer
    mine = Tokenizer.load(root / "tokenizer").token_bytes().tolist()
    code = ("import sys, torch, json; print(json.dumps(torch.load(sys.argv[1]).tolist()))")
    out = subprocess.run([python, "-c", code, str(root / "nanochat" / "tokenizer" / "token_bytes.pt")],
                         capture_output=True, text=True, timeout=300)
    theirs = json.loads(out.stdout) if out.returncode == 0 else None
    if theirs != mine:
        raise UserError(f"nanochat's token byte lengths in {root / 'nanochat' / 'tokenizer'} differ from flaxchat's; "
                        "the two bpb figures would not be comparable.")


# --- the table ------------------------------------------------------------------------------------


def mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def table(name: str, rows: dict[str, list[dict]]) -> str:
    """Markdown: per system and seed the val bpb at each step, means, and the differences to nanochat."""
    steps = sorted({int(s) for runs in rows.values() for r in runs for s in r["val_bpb"] if int(s) > 0})
    head = f"| {name} | seed | " + " | ".join(str(s) for s in steps) + " |"
    lines = [head, "|" + "---|" * (len(steps) + 2)]
    stats = {}
    for label, runs in rows.items():
        for r in runs:
            lines.append(f"| {label} | {r['seed']} | " + " | ".join(
                f"{r['val_bpb'][str(s)]:.4f}" if str(s) in r["val_bpb"] else "-" for s in steps) + " |")
        per_step = {s: [r["val_bpb"][str(s)] for r in runs if str(s) in r["val_bpb"]] for s in steps}
        stats[label] = {s: (mean_sd(v), len(v)) for s, v in per_step.items() if v}
        lines.append(f"| {label} | mean ± sd | " + " | ".join(
            f"{stats[label][s][0][0]:.4f} ± {stats[label][s][0][1]:.4f}" if s in stats[label] else "-"
            for s in steps) + " |")
    if "nanochat" in stats:
        ref = stats["nanochat"]
        for label in stats:
            if label == "nanochat":
                continue
            cells = []
            for s in steps:
                if s in stats[label] and s in ref:
                    (m, sd), n = stats[label][s]
                    (m0, sd0), n0 = ref[s]
                    cells.append(f"{round(m - m0, 4) + 0.0:+.4f} ± {math.sqrt(sd * sd / n + sd0 * sd0 / n0):.4f}")
                else:
                    cells.append("-")
            lines.append(f"| {label} - nanochat | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    nanochat = python = None
    if "nanochat" in args.systems:
        nanochat, python = check_nanochat(args.nanochat, args.nanochat_python)
    results = {}
    for name, spec in args.texts.items():
        root = prepare(name, spec, args)
        info = json.loads((root / "prepared.json").read_text())
        tokens = args.steps * (args.total_batch_size if args.total_batch_size > 0 else 0)
        seen = f", {tokens / info['train_tokens']:.1f} passes in {args.steps} steps" if tokens else ""
        print(f"{name}: {info['train']['docs']:,} train documents, {info['train_tokens']:,} tokens{seen}; "
              f"{info['val']['docs']:,} val documents")
        rows: dict[str, list[dict]] = {}
        for seed in args.seeds:
            if "nanochat" in args.systems:
                rows.setdefault("nanochat", []).append(run_nanochat(root, seed, args, nanochat, python))
                check_token_bytes(root, python)
            if "flaxchat" in args.systems:
                rows.setdefault(f"flaxchat {args.label}", []).append(run_flaxchat(root, spec, seed, args))
        # Runs of this text made earlier (other labels, other seeds) join the table.
        for f in sorted(runs_dir(root, args).glob("*/*-s*.json")):
            if f.name.endswith(".raw.json"):
                continue
            r = json.loads(f.read_text())
            label = "nanochat" if r["system"] == "nanochat" else f"flaxchat {f.parent.name}"
            if r["seed"] not in [x["seed"] for x in rows.get(label, [])]:
                rows.setdefault(label, []).append(r)
        for runs in rows.values():
            runs.sort(key=lambda r: r["seed"])
        batches = sorted({f"{label}: {r['total_batch_size']:,}" for label, runs in rows.items() for r in runs})
        print(f"\ntokens per step: {'; '.join(batches)}")
        print(table(name, rows) + "\n")
        results[name] = rows
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

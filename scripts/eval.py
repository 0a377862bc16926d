"""Evaluate a trained model: chat tasks, CORE-style likelihood sets, validation bits per byte.

    python -m scripts.eval --model runs/d4                            # every built-in task + stories_cloze
    python -m scripts.eval --model runs/d4 --tasks spelling,arithmetic --limit 100
    python -m scripts.eval --model runs/d4 --tasks mmlu:data/mmlu --core hellaswag:data/hellaswag.jsonl
    python -m scripts.eval --model runs/d4 --tasks none --bpb        # only bits per byte

`all` means the built-in chat tasks (chat, spelling, spell, arithmetic) and the built-in CORE set
stories_cloze; dataset tasks read files and are named `name:PATH`. Prints a table, writes
<run>/eval.json and appends an "Evaluation" section to <run>/report.md, or into --out-dir (`--model`
and --out-dir may be gs://).
"""

from __future__ import annotations

import json
import sys
import time

from flaxchat import paths
from flaxchat.config import ArgumentParser
from flaxchat.errors import UserError, cli_main
from tasks import split_spec

BUILTIN_TASKS = ("chat", "spelling", "spell", "arithmetic")
FILE_TASKS = ("smoltalk", "mmlu", "arc", "gsm8k", "humaneval")  # need name:PATH


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m scripts.eval", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--model", "-i", required=True, help="run folder (local or gs://), its checkpoints/ folder, or a checkpoints/<step> folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tasks", default="all", help="'all', 'none', or a comma list of tasks: name or name:PATH (default: all)")
    p.add_argument("--core", default="", help="comma list of CORE sets: stories_cloze or name:PATH (added to the tasks)")
    p.add_argument("--bpb", action="store_true", help="also measure bits per byte on the val split of --bpb-data")
    p.add_argument("--bpb-data", default="stories", help="corpus for --bpb (default: the built-in stories)")
    p.add_argument("--bpb-tokens", type=int, default=65_536, help="tokens for --bpb (default: 65536)")
    p.add_argument("--split", default="val", help="task split (default: val)")
    p.add_argument("--limit", type=int, default=None, help="at most N examples per task and CORE set")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward for likelihood scoring (default: 16)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt for generative tasks: pass@k (default: 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest generated reply (default: 256)")
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None,
                   help="where eval.json and the report's Evaluation section go (default: the model's run folder)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


def _split_list(spec: str) -> list[str]:
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def plan(args) -> tuple[list[str], list[str]]:
    """(task specs, CORE specs) the flags ask for, checked without loading anything."""
    from tasks import KNOWN
    from tasks.core import BUILT_IN as BUILTIN_CORE
    from tasks.core import CORE_TASKS

    for name, value, low in (("--limit", args.limit, 1), ("--batch-size", args.batch_size, 1),
                             ("--num-samples", args.num_samples, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--bpb-tokens", args.bpb_tokens, 1)):
        if value is not None and value < low:
            raise UserError(f"{name} must be at least {low} (got {value}).")
    if not 0 <= args.temperature < float("inf"):  # nan fails this too
        raise UserError(f"-t/--temperature must be 0 (greedy) or a positive number (got {args.temperature}).")
    tasks, core = [], []
    for spec in _split_list(args.tasks):
        if spec == "all":
            tasks += BUILTIN_TASKS
            core += BUILTIN_CORE
        elif spec != "none":
            tasks.append(spec)
    core += _split_list(args.core)
    for spec in tasks:
        name, path = split_spec(spec)
        if name not in KNOWN:
            hint = " (it is a CORE set: pass it with --core)" if name in BUILTIN_CORE else ""
            raise UserError(f"unknown task {name!r}{hint}; known tasks: {', '.join(sorted(KNOWN))}.")
        if name in FILE_TASKS and not path:
            raise UserError(f"task {name} reads a dataset; name its file or folder as {name}:PATH.")
    for spec in core:
        name, path = split_spec(spec)
        if name not in CORE_TASKS:
            raise UserError(f"unknown CORE set {name!r}; known: {', '.join(CORE_TASKS)} "
                            f"(built in: {', '.join(BUILTIN_CORE)}; the others are written name:PATH).")
        if not path and name not in BUILTIN_CORE:
            raise UserError(f"the CORE set {name} reads a dataset; name its file or folder as {name}:PATH.")
    tasks, core = list(dict.fromkeys(tasks)), list(dict.fromkeys(core))
    if not tasks and not core and not args.bpb:
        raise UserError("nothing to evaluate: name tasks with --tasks, CORE sets with --core, or pass --bpb.")
    return tasks, core


def run(args) -> dict:
    tasks, core = plan(args)
    from flaxchat.loading import resolve
    run_dir = resolve(args.model, args.step).run_dir  # a missing folder fails here, before any import
    out_dir = args.out_dir or str(run_dir)
    from flaxchat import paths
    paths.check_destination(out_dir, "--out-dir")  # results are written after the evaluation: check now

    # Heavy imports here so that --help and bad flags answer at once.
    from flaxchat import evaluation as E
    from flaxchat.engine import Engine
    from flaxchat.loading import load_model
    from flaxchat.report import write_report

    # --- data: every task and CORE set loads before the model, so a bad path fails fast ------------
    loaded = [(spec, E.load_task(spec, args.split)) for spec in tasks]
    core_sets = []
    if core:
        from tasks.core import load_core
        for spec in core:
            name, path = split_spec(spec)
            core_sets.append((name, load_core(name, path=path or None, limit=args.limit)))

    # --- model --------------------------------------------------------------------------------
    t_start = time.time()
    model, tokenizer, meta = load_model(args.model, args.step)
    engine = Engine(model, tokenizer, tools=True)
    print(f"evaluating {args.model} (step {meta.get('step')}, {model.config.n_layer} layers, "
          f"context {model.config.sequence_len})", flush=True)

    tty = sys.stderr.isatty()

    def progress(label):
        shown = [0]

        def show(done, total):
            if tty:  # one line, rewritten in place
                print(f"\r{label}: {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)
            elif done == total or done - shown[0] >= max(1, total // 4):  # logs: a line per quarter
                shown[0] = done
                print(f"{label}: {done}/{total}", file=sys.stderr, flush=True)
        return show

    # --- evaluate -------------------------------------------------------------------------------
    rows: list[dict] = []
    generation = dict(num_samples=args.num_samples, max_tokens=args.max_tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed)
    for spec, task in loaded:
        rows.append(E.run_task(spec, model, tokenizer, engine, args.split, args.limit, task=task,
                               progress=progress(spec), **generation))
    for name, examples in core_sets:
        rows += E.run_core(name, model, tokenizer, examples, args.batch_size, progress=progress(name))
    if (summary := E.core_metric(rows)) is not None and len(core_sets) > 1:
        rows.append(summary)
    if args.bpb:
        t0 = time.time()
        seed = (meta.get("train_config") or {}).get("seed", 0)
        res = E.validation_bpb(model, tokenizer, args.bpb_data, args.bpb_tokens, seed=seed)
        rows.append(dict(task=f"{args.bpb_data} val", metric="bits/byte", value=res["bpb"], n=res["tokens"],
                         seconds=time.time() - t0))

    # --- results: table, eval.json, report section -------------------------------------------------
    print(E.format_table(rows))
    for r in rows:
        if r.get("too_long"):
            print(f"note: {r['too_long']} of the {r['n']} {r['task']} prompts leave no room in the model's "
                  f"context of {model.config.sequence_len} tokens; they count as wrong.")
    results = dict(model=paths.absolute(args.model), step=meta.get("step"), split=args.split, limit=args.limit,
                   generation=generation, results=rows, core=summary["value"] if summary else None,
                   seconds=time.time() - t_start, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    from flaxchat.report import write_json
    out = paths.RunFolder(out_dir)  # local or gs://: the model's own folder, as the stages write theirs
    try:
        write_json(out.eval, results)
        append_report(out.report, results, E.markdown_table(rows), write_report)
    except (OSError, UserError) as e:  # the folder was writable at the start; the results are not lost with it
        print(json.dumps(results, indent=1, default=str))
        reason = getattr(e, "strerror", None) or e
        raise UserError(f"could not write the results to {out_dir} ({reason}); they are printed above as JSON.") from None
    return results


def append_report(path: str, results: dict, table: str, write_report) -> None:
    """Add an Evaluation section at the end of the report (a new report if there is none)."""
    heading = f"Evaluation (step {results['step']}, {results['time']})"
    body = (f"split {results['split']}, limit {results['limit'] or 'none'}, "
            f"generation {json.dumps(results['generation'])}\n\n{table}")
    if not paths.exists(path):
        write_report(path, title="flaxchat report", sections=[(heading, body)])
        return
    # rewritten whole, not appended: an object store has no append, and a report is a few KB
    paths.write_text(path, paths.read_text(path) + f"\n## {heading}\n\n{body}\n")


if __name__ == "__main__":
    sys.exit(cli_main(main))

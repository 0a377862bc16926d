"""The whole chain, offline, on the built-in data: tokenizer -> pretrain -> SFT -> RL -> eval.

    python -m scripts.run_chat --run-dir runs/chat
    python -m scripts.chat_cli -i runs/chat/rl -p "Who are you?"

Each stage writes its own folder under --run-dir (base/, sft/, rl/) and resumes when run again, so
an interrupted chain is continued by the same command. SFT trains on the built-in conversations
(greetings and identity, spelling, letter counting and arithmetic word problems with calculator
calls); RL then improves the arithmetic answers; the evaluation of the SFT and RL models on
held-out examples ends up in each stage's report.md, and a summary in <run-dir>/report.md.
The defaults take about an hour on a 2-core CPU; --quick runs every stage in a few minutes.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from flaxchat.errors import cli_main
from flaxchat.kernels import tune_process


def parse_args(argv):
    from flaxchat.config import ArgumentParser
    p = ArgumentParser(prog="python -m scripts.run_chat", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/chat", help="folder for the stages' run folders")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--base-steps", type=int, default=1000, help="pretraining steps")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--rl-steps", type=int, default=150)
    p.add_argument("--eval-limit", type=int, default=100, help="held-out examples per task")
    p.add_argument("--quick", action="store_true", help="a few steps per stage: check the chain works")
    return p.parse_args(argv)


def main(argv=None, tune=False) -> int:
    args = parse_args(argv)
    if tune:  # after the flags, so that --help and a bad flag answer without JAX
        tune_process()
    from flaxchat.report import write_json
    from flaxchat.paths import RunFolder
    from flaxchat.report import write_report
    from scripts import eval as evaluate
    from scripts import pretrain, rl, run_tinystories, sft

    if args.quick:
        args.base_steps, args.sft_steps, args.rl_steps, args.eval_limit = 30, 20, 4, 10
    base, sft_dir, rl_dir = (os.path.join(args.run_dir, n) for n in ("base", "sft", "rl"))
    # Every stage's flags are parsed (and so checked) here, before the first stage runs: a bad
    # --sft-steps or --eval-limit is one sentence now, not after the pretraining's minutes.
    pre_args = pretrain.parse_args([f"--run-dir={base}", f"--depth={args.depth}", f"--steps={args.base_steps}"],
                                   run_tinystories.DEFAULTS)
    sft_args = sft.parse_args(["--base", base, "--run-dir", sft_dir, "--steps", str(args.sft_steps),
                               "--device-batch-size", "4", "--grad-accum", "2",
                               "--eval-every", str(max(1, args.sft_steps // 5))])
    rl_args = rl.parse_args(["--base", sft_dir, "--run-dir", rl_dir, "--steps", str(args.rl_steps),
                             "--eval-every", str(max(1, args.rl_steps // 3)), "--eval-examples", str(args.eval_limit)])
    eval_args = [evaluate.parse_args(["--model", d, "--tasks", "all", "--limit", str(args.eval_limit)])
                 for d in (sft_dir, rl_dir)]
    for a in eval_args:
        evaluate.plan(a)

    print(f"--- 1/4 tokenizer and pretraining -> {base}", flush=True)
    pre = pretrain.run(pre_args)
    print(f"--- 2/4 SFT -> {sft_dir}", flush=True)
    s = sft.run(sft_args)
    ev_sft = evaluate.run(eval_args[0])
    print(f"--- 3/4 RL -> {rl_dir}", flush=True)
    r = rl.run(rl_args)
    print("--- 4/4 evaluation of the RL model", flush=True)
    ev_rl = evaluate.run(eval_args[1])

    def table(results):
        return {f"{row['task']} {row['metric']}": f"{row['value']:.3f} (n={row['n']})" for row in results["results"]}

    summary = dict(val_bpb=pre.get("val_bpb"), sft_val_loss=s.get("val_loss"), replies=s.get("replies"),
                   rl_pass_at_1=[r["pass_at_1_before"], r["pass_at_1_after"]],
                   eval_sft=ev_sft["results"], eval_rl=ev_rl["results"])
    write_json(os.path.join(args.run_dir, "summary.json"), summary)
    report = RunFolder(args.run_dir).report
    write_report(report, title="flaxchat: the offline chat chain", sections=[
        ("Stages", {"pretraining val bpb": f"{pre.get('val_bpb') or 0:.4f}",
                    "SFT val loss": f"{s.get('val_loss') or 0:.4f}",
                    "RL pass@1 (held-out arithmetic)": f"{100 * r['pass_at_1_before']:.1f}% -> "
                                                      f"{100 * r['pass_at_1_after']:.1f}%"}),
        ("SFT model", table(ev_sft)),
        ("RL model", table(ev_rl)),
        ("SFT replies (greedy)", [f"{p} -> {t!r}" for p, t in (s.get("replies") or {}).items()]),
    ])
    print(f"done: report {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(functools.partial(main, tune=True)))

"""A speed change's figures beside those of the commit it started from, on this machine, interleaved.

    python -m bench.cpu.before_after --base 3d5006e          # every section below (~50 min on 2 cores)
    python -m bench.cpu.before_after --base HEAD~2 --only main,losses --pairs 3

The head side is this checkout as it stands (uncommitted edits included); the base side is --base,
checked out into a temporary git worktree that is removed at the end. Each side runs its own bench/
and scripts/ with PYTHONPATH at its own checkout (checked before the first run); both use this
environment's packages. A shared host drifts, so the sides take turns. Sections (--only picks some):
  phases  `bench.train_throughput --phases` for configs A and B at 2,048 and 16,384 tokens per step
          (modes flaxchat, flaxchat16k), config by config, each side's own table
  main    the main job, `scripts.run_tinystories --depth=4` at 2,048 tokens per step, --pairs runs a
          side (base, head, then head, base, ...); a run's tok/s is the mean of the last five windows
          it logged (metrics.jsonl), and the ratio is the head's mean over the base's
  muon    the head only, --muon-runs times: `--configs A --modes flaxchat --phases` with --muon-steps
          rounds, i.e. Polar Express's share of the main job's step (muon-ns)
  losses  this checkout's bench/same_losses.py: the losses of --loss-steps steps on the base (--out),
          then on the head (--compare within 2 ulps), for each --loss-shapes rows x micro-batches
Closing lines gather the figures. Every run's whole output stays in --logs. Exit status 1 when a run
failed or the losses differ, 2 for a bad flag or --base.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HEAD_ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("phases", "main", "muon", "losses")


@dataclasses.dataclass(frozen=True)
class Side:
    name: str  # "base" or "head"
    root: Path

    def run(self, args: list[str], log: Path, timeout: float, echo: bool = False) -> int:
        """`python args` in this side's checkout, its output into `log` (and on stdout with `echo`);
        killed after `timeout` seconds (exit status 124)."""
        env = dict(os.environ, PYTHONPATH=str(self.root))
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, *args], cwd=self.root, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)

            def copy():
                for line in proc.stdout:
                    out.write(line)
                    if echo:
                        print(f"  {self.name} | {line}", end="", flush=True)

            reader = threading.Thread(target=copy, daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = 124
            reader.join(timeout=30)
            if rc == 124:
                out.write(f"\n[killed after {timeout:g} s]\n")
        return rc


def check_imports(side: Side) -> str | None:
    """None when `bench`, `flaxchat` and `scripts` import from the side's own checkout, else why not
    (an installed copy that wins over PYTHONPATH would time one side's code twice)."""
    code = "import bench, flaxchat, scripts; print('\\n'.join(m.__file__ for m in (bench, flaxchat, scripts)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=side.root, env=dict(os.environ, PYTHONPATH=str(side.root)),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"the {side.name} checkout's packages do not import: {r.stderr.strip().splitlines()[-1:]}"
    outside = [f for f in r.stdout.split() if not Path(f).resolve().is_relative_to(side.root.resolve())]
    return f"the {side.name} side imports {outside[0]}, outside its checkout {side.root}" if outside else None


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(HEAD_ROOT), *args], capture_output=True, text=True, timeout=120)


def describe_head() -> str:
    sha = git("rev-parse", "--short", "HEAD").stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return f"{sha}{' with uncommitted edits' if dirty else ''}"


def tok_per_s(run_dir: Path, windows: int = 5) -> float | None:
    """The mean tok/s of the last `windows` progress windows a main-job run logged."""
    from flaxchat.paths import RunFolder
    from flaxchat.report import MetricsLog
    rows = MetricsLog(RunFolder(run_dir).metrics).read()
    speeds = [r["tok_per_s"] for r in rows if r.get("kind") == "train" and "tok_per_s" in r]
    return float(np.mean(speeds[-windows:])) if speeds else None


def alternating(pairs: int):
    """(pair, side index) in the order base, head, head, base, base, head, ...: neither side always
    runs first after the other. A pair is one main-job run a side, or one config's phases."""
    for i in range(pairs):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            yield i, j


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        rows, _, accum = item.partition("x")
        if not (rows.isdigit() and accum.isdigit() and int(rows) > 0 and int(accum) > 0):
            raise ValueError(item)
        shapes.append((int(rows), int(accum)))
    return shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu.before_after", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit (any git revision) to compare against")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections (default: all)")
    p.add_argument("--configs", default="A,B", help="phases: train_throughput's --configs (default: %(default)s)")
    p.add_argument("--modes", default="flaxchat,flaxchat16k", help="phases: its --modes (default: %(default)s)")
    p.add_argument("--phase-steps", type=int, default=4, help="phases: its --steps (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=5, help="main: runs per side (default: %(default)s)")
    p.add_argument("--main-steps", type=int, default=150, help="main: steps per run (default: %(default)s)")
    p.add_argument("--muon-runs", type=int, default=2, help="muon: runs on the head (default: %(default)s)")
    p.add_argument("--muon-steps", type=int, default=30, help="muon: rounds per run (default: %(default)s)")
    p.add_argument("--muon-config", default="A", help="muon: the config (default: %(default)s, the main job's)")
    p.add_argument("--loss-steps", type=int, default=20, help="losses: steps (default: %(default)s)")
    p.add_argument("--loss-shapes", default="8x1,4x4",
                   help="losses: rows x micro-batches per step, comma-separated (default: %(default)s)")
    p.add_argument("--logs", help="keep every run's output here (default: a temporary folder, printed)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default: %(default)s)")
    args = p.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        p.error(f"--only: unknown section {unknown[0] if unknown else '(none given)'}; choose from {', '.join(SECTIONS)}.")
    counts = ("--phase-steps", "--pairs", "--main-steps", "--muon-steps", "--loss-steps")
    if any(getattr(args, c[2:].replace("-", "_")) < 1 for c in counts) or args.muon_runs < 0 or args.timeout <= 0:
        p.error(f"{', '.join(counts)} must be at least 1, --muon-runs 0 or more and --timeout positive.")
    try:
        shapes = parse_shapes(args.loss_shapes)
    except ValueError as e:
        p.error(f"--loss-shapes: {e.args[0]!r} is not ROWSxMICROBATCHES, e.g. 8x1.")
    if git("rev-parse", "--show-toplevel").returncode != 0:
        print(f"{HEAD_ROOT} is not a git checkout, so there is no --base to check out.", file=sys.stderr)
        return 2
    sha = git("rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}").stdout.strip()
    if not sha:
        print(f"--base {args.base}: not a commit of this repository.", file=sys.stderr)
        return 2

    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="before_after-"))
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="before_after-base-"))
    base_root = work / "base"
    added = git("worktree", "add", "--detach", str(base_root), sha)
    if added.returncode != 0:
        print(f"git worktree add failed: {added.stderr.strip()}", file=sys.stderr)
        return 2
    try:
        return compare(args, sections, shapes, Side("base", base_root), Side("head", HEAD_ROOT), sha, logs)
    finally:
        git("worktree", "remove", "--force", str(base_root))
        git("worktree", "prune")
        shutil.rmtree(work, ignore_errors=True)


def compare(args, sections, shapes, base: Side, head: Side, sha: str, logs: Path) -> int:
    from bench.train_throughput import cpu_line
    for side in (base, head):
        problem = check_imports(side)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    print(cpu_line())
    print(f"base {sha[:7]} ({base.root}), head {describe_head()} ({head.root}); logs in {logs}", flush=True)
    failed, summary = [], []
    sides = (base, head)

    def run(side: Side, what: str, cmd: list[str], echo: bool = False) -> bool:
        log = logs / f"{what}.{side.name}.log"
        print(f"[{time.strftime('%H:%M:%S')}] {what}, {side.name}", flush=True)
        rc = side.run(cmd, log, args.timeout, echo=echo)
        if rc != 0:
            failed.append(f"{what} on the {side.name} side (exit {rc}; {log})")
        return rc == 0

    if "phases" in sections:
        configs = args.configs.split(",")
        for i, j in alternating(len(configs)):
            config, side = configs[i], sides[j]
            cmd = ["-m", "bench.train_throughput", "--configs", config, "--modes", args.modes, "--phases",
                   "--steps", str(args.phase_steps)]
            if side is head:
                cmd += ["--json", str(logs / f"phases-{config}.head.json")]
            run(side, f"phases-{config}", cmd, echo=True)
        for config in configs:
            figures = logs / f"phases-{config}.head.json"
            if figures.exists():
                for row in json.loads(figures.read_text())["rows"]:
                    fb = row.get("phases", {}).get("fwd+bwd", {}).get("of_peak")
                    muon = row.get("phases", {}).get("muon-ns", {}).get("of_step")
                    if fb is not None and muon is not None:
                        summary.append(f"phases  head {row['config']} {row['mode']}: {row['tok_s']:,.0f} tok/s, "
                                       f"the step at {row['mfu']:.1f}% of peak, fwd+bwd at {fb:.1f}%, muon-ns "
                                       f"{muon:.1f}% of the step")

    if "main" in sections:
        speeds = {side.name: [] for side in sides}
        for i, j in alternating(args.pairs):
            side = sides[j]
            run_dir = logs / f"main-{i + 1}.{side.name}"
            ok = run(side, f"main-{i + 1}", ["-m", "scripts.run_tinystories", "--depth=4", f"--steps={args.main_steps}",
                                             "--total-batch-size=2048", "--device-batch-size=8", "--eval-every=0",
                                             "--sample-every=0", "--no-export", "--run-dir", str(run_dir)])
            speed = tok_per_s(run_dir) if ok else None
            if ok and speed is None:
                failed.append(f"main-{i + 1} on the {side.name} side logged no tok/s ({run_dir})")
            if speed is not None:
                speeds[side.name].append(speed)
                print(f"  {side.name} | {speed:,.0f} tok/s", flush=True)
        if speeds["base"] and speeds["head"]:
            b, h = np.mean(speeds["base"]), np.mean(speeds["head"])
            each = lambda v: " ".join(f"{s:,.0f}" for s in v)  # noqa: E731
            summary.append(f"main    base {b:,.0f} tok/s ({each(speeds['base'])}), head {h:,.0f} "
                           f"({each(speeds['head'])}): {h / b:.3f}x")

    if "muon" in sections:
        for k in range(args.muon_runs):
            figures = logs / f"muon-{k + 1}.head.json"
            if run(head, f"muon-{k + 1}", ["-m", "bench.train_throughput", "--configs", args.muon_config, "--modes",
                                           "flaxchat", "--phases", "--steps", str(args.muon_steps), "--json",
                                           str(figures)], echo=True):
                ph = json.loads(figures.read_text())["rows"][0]["phases"]
                per = ph["muon-ns"]["share_per_round"]
                summary.append(f"muon    head run {k + 1}: muon-ns {ph['muon-ns']['ms']:.1f} ms, "
                               f"{ph['muon-ns']['of_step']:.1f}% of a {ph['step']['ms']:.1f} ms step; per round "
                               f"{per['median']:.1f}% (95% interval {per['low']:.1f}-{per['high']:.1f}%)")

    if "losses" in sections:
        script = str(HEAD_ROOT / "bench" / "cpu" / "same_losses.py")
        for rows, accum in shapes:
            shape = ["--steps", str(args.loss_steps), "--rows", str(rows), "--accum", str(accum)]
            ref = logs / f"losses-{rows}x{accum}.base.json"
            what = f"losses-{rows}x{accum}"
            if run(base, what, [script, *shape, "--out", str(ref)]):
                same = run(head, what, [script, *shape, "--compare", str(ref), "--ulps", "2"], echo=True)
                verdict = (logs / f"{what}.head.log").read_text().strip().splitlines()[-1:]
                summary.append(f"losses  {rows} rows x {accum}: {'same' if same else 'DIFFERENT'} ({''.join(verdict)})")

    print("--- before/after")
    for line in summary:
        print(line)
    for what in failed:
        print(f"failed: {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Recreate-to-first-step in the rehearsal: what a preempted pod spends before it trains again.

    python -m bench.recreate                   # a 2-worker v4-16 of this machine, depth 2, sequence 256
    python -m bench.recreate --steps 30 --save-every 10

Creates a pod in the rehearsal (`--backend=local`, a fresh emulator folder, a gs:// run folder in its
bucket), sets it up with the rehearsal's fast install (a uv venv over this machine's Python and
packages, as docs/deployment.md's rehearsal does), runs scripts.pretrain under `recover()`,
preempts the pod once the first checkpoint is committed, and stamps the launcher's lines and worker
0's log lines as they appear while the recovery recreates it. Prints the time from the recreate's
decision to the first trained step after it, split into create, upload, install, start-up (imports,
the distributed start, restore) and compile, then the goodput lines that --health prints. Needs uv
on PATH. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time

from flaxchat.errors import UserError, cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The lines shown after the recreate: where the environment and the compile cache came from.
SHOWN = r"compile cache|environment|[Pp]ersistent compilation cache|XLA compilation of jit\(step\)"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.recreate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint interval (default: %(default)s)")
    p.add_argument("--log-compiles", action="store_true",
                   help="JAX_LOG_COMPILES=1 on the workers: print worker 0's persistent-cache hits and misses")
    p.add_argument("--keep", default="", help="keep the emulator's state in this folder (default: a temporary one)")
    args = p.parse_args(argv)
    if not shutil.which("uv"):
        raise UserError("uv is not on PATH; `pip install uv` into another folder and put its bin on PATH.")
    return args


def install_script(path: str) -> str:
    """The rehearsal's install: a uv venv over this interpreter and its site-packages (no downloads)."""
    import shlex
    import site
    see = ("import site, sys; open(site.getsitepackages()[0] + '/here.pth', 'w')"
           ".write(''.join(f'import site; site.addsitedir({d!r})\\n' for d in sys.argv[1:]))")
    with open(path, "w") as f:
        f.write("set -e\n"
                f'"$UV" venv --python {os.path.realpath(sys.executable)} --allow-existing "$FLAXCHAT_VENV"\n'
                f'"$FLAXCHAT_VENV/bin/python" -c {shlex.quote(see)} {shlex.join(site.getsitepackages())}\n'
                '"$UV" pip install -q --python "$FLAXCHAT_VENV/bin/python" --no-deps -e .\n')
    return f"sh {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    base = args.keep or tempfile.mkdtemp(prefix="flaxchat-recreate-")
    os.environ.update({"FLAXCHAT_GCLOUD_EMULATOR_DIR": os.path.join(base, "emu"),
                       "FLAXCHAT_GCLOUD_EMULATOR_CREATE_SECONDS": "0",
                       "FLAXCHAT_LAUNCHER_STATE": os.path.join(base, "launcher.json")})
    from flaxchat.cloud import recovery as rec
    from flaxchat.cloud.launcher import TPUConfig, TPULauncher
    from flaxchat.cloud.rehearsal import emulator

    os.makedirs(os.path.join(emulator.buckets_root(), "rehearsal"), exist_ok=True)
    stamps: list[tuple[float, str, str]] = []  # (time, source, line)
    config = TPUConfig(project="rehearsal", tpu_name="pod", accelerator_type="v4-16", backend="local",
                       emulator_dir=os.path.join(base, "emu"), startup_check_s=0, poll_s=1.0,
                       install_command=install_script(os.path.join(base, "install.sh")))
    lc = TPULauncher(config, out=lambda s: stamps.append((time.time(), "launcher", s)))
    run_dir = "gs://rehearsal/d2"
    cmd = (f"python -m scripts.pretrain --depth=2 --sequence-len=256 --vocab-size=512 --device-batch-size=1 "
           f"--total-batch-size=2048 --steps={args.steps} --save-every={args.save_every} --eval-every=0 "
           f"--sample-every=0 --num-samples=0 --max-chars-tokenizer=2000000 --log-every=1")
    lc.create()
    lc.setup(REPO, gcs=True, run_dir=run_dir)
    commit = os.path.join(emulator.buckets_root(), "rehearsal", "d2", "checkpoints", str(args.save_every),
                          "commit_success.txt")
    log = os.path.join(emulator.worker_dir("rehearsal", config.zone, "pod", 0), ".flaxchat", "run", "output.log")
    done = threading.Event()

    def watch():  # preempt once the first step is committed, then stamp worker 0's new lines
        while not os.path.exists(commit) and not done.is_set():
            time.sleep(0.2)
        emulator.preempt("pod", config.zone, "rehearsal")
        stamps.append((time.time(), "preempt", "preempted"))
        seen, inode = 0, None
        while not done.is_set():
            try:
                with open(log) as f:
                    if os.fstat(f.fileno()).st_ino != inode:  # the recreated VM's log is a new file
                        seen, inode = 0, os.fstat(f.fileno()).st_ino
                    lines = f.read().splitlines()
            except OSError:
                lines = []
            for line in lines[seen:]:
                stamps.append((time.time(), "worker0", line))
            seen = max(seen, len(lines))
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        result = lc.recover(cmd, run_dir=run_dir, local_repo_path=REPO, timeout=1800,
                            env={"JAX_LOG_COMPILES": "1"} if args.log_compiles else None,
                            policy=rec.Policy(poll_s=1.0, backoff_s=1.0, heartbeat_deadline_s=600))
        lc.wait(timeout=120)  # the marker comes before the processes' exit codes
        health = rec.format_health(lc.health()) + "\n" + lc.goodput()  # what --health prints
    finally:
        done.set()
        t.join(5)
        for node in emulator.list_nodes():
            emulator.kill_node_processes(node["project"], node["zone"], node["name"])
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"recovery: {result.state}")

    def first(source, pattern, after=0.0):
        return next((ts for ts, src, s in stamps if src == source and ts >= after and re.search(pattern, s)), None)

    t0 = first("launcher", r"recreate:")
    marks = {"created": first("launcher", r"is READY with", t0), "uploaded": first("launcher", r"^installing on", t0),
             "installed": first("launcher", r"^worker 0: ready", t0), "started": first("launcher", r"^started on", t0),
             "restored": first("worker0", r"resumed from step", t0), "first step": first("worker0", r"^step \d+", t0)}
    compile_s = next((float(m.group(1)) for ts, src, s in stamps if src == "worker0" and ts >= t0
                      for m in [re.search(r"compiled the train step in ([\d.]+)s", s)] if m), None)
    before = [s for ts, src, s in stamps if src == "worker0" and ts < t0 and "compiled the train step" in s]
    print(f"the first run (before the preemption): {before[-1] if before else '-'}")
    prev = t0
    print(f"recreate-to-first-step: {marks['first step'] - t0:.1f} s")
    for name, ts in marks.items():
        print(f"  {name:<11} +{ts - t0:6.1f} s  ({ts - prev:5.1f} s)")
        prev = ts
    print(f"  of which the train step's compile (pretrain's own figure): {compile_s} s")
    for ts, src, s in stamps:
        if ts >= t0 and re.search(SHOWN, s):
            print(f"  {src}: {s}")
    print(health)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

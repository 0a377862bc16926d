"""Command line of KaggleRunner: `python -m flaxchat.remote.kaggle URL --run CODE` (or `-m flaxchat.remote`).

    python -m flaxchat.remote.kaggle URL --check-devices
    python -m flaxchat.remote.kaggle URL --run "import sys; print(sys.version)"
    python -m flaxchat.remote.kaggle URL --file train_snippet.py --timeout 600
    python -m flaxchat.remote.kaggle URL --setup .        # upload this repo's tracked files, install them
    python -m flaxchat.remote.kaggle URL --status | --wait | --stop [--restart | --shutdown]
    python -m flaxchat.remote.kaggle URL --reattach REQUEST_ID   # a run whose connection was lost

A long run, with no Python to write (docs/kaggle.md):

    python -m flaxchat.remote.kaggle URL --pipeline --depth 20 --steps 40000 \\
        --run-dir gs://my-bucket/d20 --gcs-key key.json --flag save_every=500
    python -m flaxchat.remote.kaggle URL --wait          # follow it; Ctrl-C stops following only
    python -m flaxchat.remote.kaggle URL --download --to runs/d20   # the job's folder (a local run's all)

In the next session (a new URL), the same --pipeline line resumes from the bucket's last step.

The token comes from --token or $KAGGLE_JUPYTER_TOKEN and is never printed; neither is the URL's
path (Kaggle signs it). Exit status: 0 ok, 1 the remote code or job failed, 2 anything else wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from flaxchat.errors import UserError, cli_main
from flaxchat.runner.base import RemoteError, RunResult


class RemoteFailed(RemoteError):
    """The code or job ran and failed: exit status 1, unlike a usage or connection problem (2)."""

    exit_code = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse repeats unrecognised arguments verbatim, and one of them may be a token.
        if message.startswith("unrecognized arguments"):
            message = "unrecognized arguments (not shown: they may hold a secret)"
        raise UserError(f"{message}; see --help.")


def build_parser() -> argparse.ArgumentParser:
    from flaxchat.remote.kaggle import TOKEN_ENV
    p = _Parser(prog="python -m flaxchat.remote.kaggle",
                description="Run Python, or a training job that outlives the session (--pipeline with a gs:// "
                            "--run-dir), on a Kaggle notebook's kernel (or any Jupyter server) from here.")
    p.add_argument("url", help="the server's URL; on Kaggle the Jupyter proxy URL ending in /proxy")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", metavar="CODE", help="execute this Python code on the kernel")
    what.add_argument("--file", metavar="F", help="execute the Python code in file F on the kernel")
    what.add_argument("--check-devices", action="store_true", help="print what JAX sees on the kernel's machine")
    what.add_argument("--status", action="store_true", help="print the state of the last job (or the kernel's)")
    what.add_argument("--stop", action="store_true",
                      help="end the training job (its process group); other cells on the kernel are left alone")
    what.add_argument("--reattach", metavar="ID", help="follow a run whose connection was lost, by its request id")
    what.add_argument("--setup", metavar="REPO", nargs="?", const=".", help="upload REPO (default .) and install it")
    what.add_argument("--wait", action="store_true", help="follow the training job's log until it exits")
    what.add_argument("--pipeline", action="store_true",
                      help="start the training (scripts.run_tinystories) as a detached job; see --depth, --steps, "
                           "--run-dir, --gcs-key, --flag")
    what.add_argument("--download", metavar="REMOTE", nargs="?", const="",
                      help="fetch REMOTE (a path under the server's root; default: the last job's folder) into --to")
    p.add_argument("--token", help=f"the server's token (default: ${TOKEN_ENV}); never printed")
    run = p.add_argument_group("--pipeline")
    run.add_argument("--depth", type=int, default=8, help="model depth (default 8)")
    run.add_argument("--steps", type=int, default=5000, help="optimizer steps (default 5000)")
    run.add_argument("--run-dir", help="the run folder in a bucket (gs://...), which outlives the session: the same "
                                       "command in the next session resumes from its last committed step")
    run.add_argument("--gcs-key", metavar="FILE",
                     help="a service-account key (JSON) here; sent as a secret, never as code or on a command line")
    run.add_argument("--name", help="the job's name (default: the --run-dir's last part, else the time and depth)")
    run.add_argument("--resume", action="store_true", help="continue the run of --name on the kernel's disk")
    run.add_argument("--flag", action="append", default=[], metavar="KEY=VALUE",
                     help="a flag of scripts.pretrain, e.g. save_every=500 or data=hf:...; repeatable")
    p.add_argument("--to", default=".", metavar="DIR", help="with --download: the local folder (default .)")
    p.add_argument("--timeout", type=float, help="seconds to allow for --run/--file/--wait (default: none)")
    p.add_argument("--restart", action="store_true", help="with --stop: also restart the kernel")
    p.add_argument("--shutdown", action="store_true", help="with --stop: also shut the kernel down")
    p.add_argument("--no-deps", action="store_true", help="with --setup: do not install dependencies")
    p.add_argument("--verbose", action="store_true", help="with --setup: show all of pip's output (default: -q, "
                                                          "errors only)")
    p.add_argument("--untracked", action="store_true",
                   help="with --setup: also upload files git does not track (never secret-looking ones)")
    p.add_argument("--protocol", choices=["auto", "v1", "legacy"], default="auto",
                   help="kernel WebSocket framing (default: auto)")
    return p


def _raise_if_failed(res: RunResult, what: str) -> None:
    if not res.ok:
        detail = f"{res.error_name}: {res.error_value}" if res.error_value else (res.error_name or res.state)
        raise RemoteFailed(f"{what} failed ({detail.rstrip('.')}).")


def _flags(items: list[str]) -> dict[str, str | bool]:
    """--flag KEY=VALUE items -> run_pipeline's keywords; true/false are a switch (export=false: --no-export)."""
    flags: dict[str, str | bool] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--flag {item!r} is not KEY=VALUE (e.g. save_every=500).")
        switch = {"true": True, "false": False}.get(value.strip().lower())
        flags[key.strip().lstrip("-").replace("-", "_")] = value if switch is None else switch
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Flags that would otherwise be ignored, or fail only once the kernel is reached: one sentence here.
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout must be a positive number of seconds (got {args.timeout:g}).")
    for flag, needs in (("restart", "stop"), ("shutdown", "stop"), ("no_deps", "setup"), ("untracked", "setup"),
                        ("verbose", "setup"),
                        ("run_dir", "pipeline"), ("gcs_key", "pipeline"), ("name", "pipeline"), ("resume", "pipeline"),
                        ("flag", "pipeline")):
        if getattr(args, flag) and getattr(args, needs) in (None, False):
            raise UserError(f"--{flag.replace('_', '-')} goes with --{needs}.")
    from flaxchat.remote.kaggle import KaggleRunner
    code = args.run
    if args.file is not None:
        try:
            code = Path(args.file).read_text()
        except OSError as e:
            raise UserError(f"cannot read {args.file} ({e.strerror}); pass a readable Python file.") from None
    runner = KaggleRunner(args.url, args.token, protocol=args.protocol)
    try:
        if code is not None:
            _raise_if_failed(runner.run(code, timeout=args.timeout), "the remote code")
        elif args.check_devices:
            print(json.dumps(runner.check_devices()))
        elif args.status:
            st = runner.status()
            print(f"{st.state}: {st.detail}")
        elif args.stop:
            runner.stop(restart=args.restart, shutdown=args.shutdown)
            print("stopped" + (f"; kernel {runner.kernel_id} restarted" if args.restart else "")
                  + (f"; kernel {runner.kernel_id} shut down" if args.shutdown else ""))
        elif args.reattach:
            _raise_if_failed(runner.reattach(args.reattach, timeout=args.timeout), "the remote code")
        elif args.setup is not None:
            info = runner.setup(args.setup, deps=not args.no_deps, untracked=args.untracked, verbose=args.verbose)
            print(f"setup: {'installed' if info['changed'] else 'up to date'} ({info['files']} files)")
            if info.get("missing"):
                raise RemoteFailed(f"setup could not install {', '.join(info['missing'])}: {info['hint']}.")
        elif args.wait:
            _raise_if_failed(runner.wait(timeout=args.timeout), "the job")
        elif args.pipeline:
            runner.run_pipeline(args.depth, args.steps, run_dir=args.run_dir, gcs_key=args.gcs_key, name=args.name,
                                resume=args.resume, hint="follow its log with --wait (the same URL)",
                                **_flags(args.flag))
        elif args.download is not None:
            files = runner.download(args.download or None, args.to)
            print(f"downloaded {len(files)} file(s) into {args.to}")
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

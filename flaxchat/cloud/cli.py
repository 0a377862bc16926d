"""The launcher's command line: flags -> a TPUConfig (remembered per project) -> TPULauncher calls.

`python -m flaxchat.cloud.launcher --help` shows it; flaxchat/cloud/launcher.py holds what the flags
do, and its docstring is the help's description.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from flaxchat.cloud import gcloud as g
from flaxchat.cloud import launcher as _launcher
from flaxchat.cloud import recovery as rec
from flaxchat.cloud.launcher import TPUConfig, TPULauncher, check_run_folder, load_state, state_path
from flaxchat.cloud.topology import topology_for
from flaxchat.errors import UserError, cli_main

# --- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flaxchat.cloud.launcher", description=_launcher.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    vm = ap.add_argument_group("which TPU VM (later calls may give only --project: the VM is remembered)")
    vm.add_argument("--project", help="Google Cloud project")
    vm.add_argument("--zone", help=f"zone (default {TPUConfig.zone})")
    vm.add_argument("--zones", help="zones to try in order when one has no capacity, e.g. "
                                    "us-central2-b,us-central1-a (the first is --zone's default)")
    vm.add_argument("--tpu-name", help=f"VM name (default {TPUConfig.tpu_name})")
    vm.add_argument("--accelerator", "--accelerator-type", dest="accelerator",
                    help=f"e.g. v4-8, v5litepod-16, v5p-32, v6e-64 (default {TPUConfig.accelerator_type})")
    vm.add_argument("--runtime-version", help="TPU VM image (default: Google's for the generation)")
    capacity = vm.add_mutually_exclusive_group()  # a spot VM comes through a queued resource, a preemptible one not
    capacity.add_argument("--preemptible", action="store_true", default=None, help="a preemptible VM (cheaper)")
    capacity.add_argument("--spot", action="store_true", default=None, help="spot capacity via a queued resource")
    vm.add_argument("--backend", choices=["gcloud", "local"], help="local: rehearse with the emulator here")
    vm.add_argument("--emulator-dir", help="state folder of the local emulator (default ~/.flaxchat/emulator)")
    vm.add_argument("--coordinator-port", type=int, help=f"JAX coordinator port (default {g.COORDINATOR_PORT})")
    act = ap.add_argument_group("actions (several may be given; they run in this order)")
    act.add_argument("--create", action="store_true", help="create the VM (reuses a READY one)")
    act.add_argument("--setup", action="store_true", help="upload the repo and install it on every worker")
    act.add_argument("--upload", metavar="PATH", help="the repo to upload with --setup (default .)")
    act.add_argument("--check-devices", action="store_true", help="print what JAX sees across the workers")
    act.add_argument("--run", metavar="CMD", help="start CMD detached on every worker")
    act.add_argument("--logs", action="store_true", help="stream worker 0's log (Ctrl-C detaches)")
    act.add_argument("--health", action="store_true", help="VM state and every worker's process, step, loss")
    act.add_argument("--wait", action="store_true", help="block until the run is done or failed")
    act.add_argument("--download-checkpoint", metavar="DIR", help="copy the latest complete checkpoint here")
    act.add_argument("--recover", metavar="CMD", help="run CMD to completion through crashes and preemptions")
    act.add_argument("--stop", action="store_true", help="stop the run on every worker")
    act.add_argument("--teardown", action="store_true", help="delete the VM (and its queued resource)")
    opt = ap.add_argument_group("options")
    opt.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the run")
    opt.add_argument("--secret", action="append", default=[], metavar="NAME",
                     help="pass $NAME from this environment to the run, never on a command line or in a log")
    opt.add_argument("--run-dir", metavar="DIR",
                     help="the stage's run folder, local or gs:// (a bucket survives the VM): added to CMD as its "
                          "--run-dir; --wait and --recover stop at its COMPLETE marker (pretraining, SFT and RL "
                          "alike); --download-checkpoint copies its latest complete step")
    opt.add_argument("--all-workers", action="store_true", help="--logs: every worker, lines prefixed [wN]")
    opt.add_argument("--no-follow", action="store_true", help="--logs: print the last lines and return")
    opt.add_argument("--lines", type=int, default=50, help="--logs: lines of history (default 50)")
    opt.add_argument("--poll-interval", type=float, help="--wait/--recover poll interval, s (default 10/60)")
    opt.add_argument("--startup-check", type=float, default=TPUConfig.startup_check_s,
                     help="--run: seconds to watch for a command that exits at once (default 5)")
    opt.add_argument("--heartbeat-deadline", type=float, default=rec.Policy.heartbeat_deadline_s,
                     help="--recover: a worker alive whose training step has not moved this long is hung (s)")
    opt.add_argument("--max-restarts", type=int, default=rec.Policy.max_restarts,
                     help="--recover: restarts of a crashed or hung run before it gives up (default %(default)s)")
    opt.add_argument("--timeout", type=float, help="--wait/--recover: give up after this many seconds")
    opt.add_argument("--install", metavar="CMD",
                     help="--setup: the install command, run in the repo on every worker with $UV and "
                          "$FLAXCHAT_VENV set; it must leave a Python >= 3.11 that imports flaxchat at "
                          "$FLAXCHAT_VENV/bin/python (default: uv venv --python 3.11, then -e .[tpu,hub], "
                          "plus gcs for a gs:// run folder)")
    opt.add_argument("--allow-local-checkpoints", action="store_true", default=None,
                     help="--recover / a preemptible --create: accept a run folder on the VM's disk "
                          "(a recreate loses it and training starts again from step 0)")
    opt.add_argument("--capacity-retry-hours", type=float,
                     help=f"--create: keep retrying 'no capacity' this long (default {TPUConfig.capacity_retry_s / 3600:g})")
    opt.add_argument("--price-per-chip-hour", type=float,
                     help="--health / --recover: USD per chip-hour for the cost estimate (the built-in table "
                          "knows few TPU types; see docs/deployment.md)")
    opt.add_argument("--dry-run", action="store_true", help="print the gcloud commands instead of running them")
    return ap


def resolve_config(args) -> tuple[TPUConfig, str]:
    """The config from the flags, filled in from the remembered VM; and a line saying where it came from."""
    state = load_state()
    project = args.project or state.get("last")
    if not project:
        raise UserError("no --project given and no TPU VM remembered; pass --project=YOUR_GCP_PROJECT.")
    saved = state.get("vms", {}).get(project) or {}
    if args.tpu_name and saved.get("tpu_name") != args.tpu_name:
        saved = {}
    names = {f.name for f in dataclasses.fields(TPUConfig)}
    config = TPUConfig(**{k: v for k, v in saved.items() if k in names})
    config.project = project
    for flag, field in [("zone", "zone"), ("tpu_name", "tpu_name"), ("accelerator", "accelerator_type"),
                        ("runtime_version", "runtime_version"), ("preemptible", "preemptible"), ("spot", "spot"),
                        ("backend", "backend"), ("emulator_dir", "emulator_dir"),
                        ("coordinator_port", "coordinator_port"), ("install", "install_command"),
                        ("allow_local_checkpoints", "allow_local_checkpoints")]:
        if getattr(args, flag) is not None:
            setattr(config, field, getattr(args, flag))
    config.zones = tuple(config.zones or ())
    if args.zones:
        config.zones = tuple(z.strip() for z in args.zones.split(",") if z.strip())
        if not args.zone and config.zones and not saved:  # a remembered VM is where it was made
            config.zone = config.zones[0]
    if args.capacity_retry_hours is not None:
        config.capacity_retry_s = args.capacity_retry_hours * 3600.0
    if args.price_per_chip_hour is not None:
        config.price_per_chip_hour = args.price_per_chip_hour
    named = bool(args.tpu_name and args.zone)
    if not saved and not args.create and not named:
        raise UserError(f"no TPU VM is remembered for project {project}; create one first with --create "
                        "(or name an existing one with --tpu-name and --zone).")
    if config.backend == "local" and config.emulator_dir:
        config.emulator_dir = os.path.abspath(os.path.expanduser(config.emulator_dir))
    source = f"remembered in {state_path()}" if saved else "from the command line"
    where = "local emulator" if config.backend == "local" else f"project {project}"
    return config, (f"TPU VM {config.tpu_name!r} ({config.accelerator_type}, zone {config.zone}, {where}; "
                    f"{source})")


def _dry_run_executor(config: TPUConfig, exists: bool) -> g.DryRunExecutor:
    n = topology_for(config.accelerator_type).workers
    seen = {"exists": exists}

    def answer(argv):
        verb = argv[4] if len(argv) > 4 else ""
        if verb == "create":
            seen["exists"] = True
        if verb == "describe":
            if not seen["exists"]:
                raise g.GcloudError("NOT_FOUND (dry run: assuming the VM does not exist yet)")
            if argv[3] == "queued-resources":
                return json.dumps({"state": {"state": "ACTIVE"}})
            return json.dumps({"state": "READY", "acceleratorType": config.accelerator_type,
                               "networkEndpoints": [{"ipAddress": f"10.128.0.{i + 2}"} for i in range(n)]})
        if verb == "ssh" and argv[-1].endswith(" versions"):
            return "\n".join("FLAXCHAT " + json.dumps({"worker": i, "python": "(dry run)", "jax": "(dry run)",
                                                        "flaxchat": "(dry run)"}) for i in range(n))
        if verb == "ssh" and "status" in argv[-1]:
            return "\n".join("FLAXCHAT " + json.dumps({"worker": i, "state": "none", "alive": False}) for i in range(n))
        return ""
    return g.DryRunExecutor(answer)


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UserError(f"--env {item!r} is not KEY=VALUE.")
        env[key] = value
    return env


def _secrets(names: list[str]) -> dict[str, str]:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise UserError(f"--secret {missing[0]} is not set in this environment; export it first "
                        "(its value is read from here so it never appears on a command line).")
    return {n: os.environ[n] for n in names}


def _check_numbers(args) -> None:
    """One sentence for a number that cannot mean what was asked, before any VM is touched: a
    --heartbeat-deadline of 0 would call every healthy worker hung and restart the run for ever."""
    for flag, value, ok, what in (
            ("--poll-interval", args.poll_interval, lambda v: v > 0, "positive"),
            ("--timeout", args.timeout, lambda v: v > 0, "positive"),
            ("--heartbeat-deadline", args.heartbeat_deadline, lambda v: v > 0, "positive"),
            ("--startup-check", args.startup_check, lambda v: v >= 0, "0 or more"),
            ("--max-restarts", args.max_restarts, lambda v: v >= 0, "0 or more"),
            ("--lines", args.lines, lambda v: v >= 0, "0 or more"),
            ("--price-per-chip-hour", args.price_per_chip_hour, lambda v: v > 0, "positive"),
            ("--coordinator-port", args.coordinator_port, lambda v: 0 < v < 65536, "between 1 and 65535")):
        if value is not None and not ok(value):
            raise UserError(f"{flag} must be {what} (got {value:g}).")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    actions = [a for a in ("create", "setup", "upload", "check_devices", "run", "logs", "health", "wait",
                           "download_checkpoint", "recover", "stop", "teardown") if getattr(args, a)]
    if not actions:
        raise UserError("nothing to do; give an action such as --create, --run CMD, --logs, --health or --teardown "
                        "(see --help).")
    _check_numbers(args)
    if args.dry_run and (args.wait or args.recover or (args.logs and not args.no_follow)):
        raise UserError("--wait, --recover and a following --logs poll the VM, so they cannot be dry-run.")
    config, where = resolve_config(args)
    config.validate()
    env, secrets = _parse_env(args.env), _secrets(args.secret)
    executor = None
    config.startup_check_s = args.startup_check
    config.poll_s = args.poll_interval or config.poll_s
    if args.dry_run:
        executor = _dry_run_executor(config, exists=not args.create)
        config.startup_check_s = 0
    command = args.recover or args.run
    run_dir = args.run_dir
    # Before anything is created: checkpoints that a preemption would delete are refused here.
    if args.recover:
        check_run_folder(config, run_dir, "--recover deletes and recreates a preempted or broken VM", required=True)
    elif args.create and (config.preemptible or config.spot) and command:
        check_run_folder(config, run_dir, f"a {'spot' if config.spot else 'preemptible'} VM is deleted when "
                                          "it is preempted")
    launcher = TPULauncher(config, executor=executor, sleep=(lambda s: None) if args.dry_run else time.sleep)
    launcher.say(f"flaxchat: acting on {where}")
    code = 0
    if args.create:
        launcher.create()
    if args.setup or args.upload:
        launcher.setup(args.upload or ".", gcs=(run_dir or "").startswith("gs://") if run_dir else None,
                       run_dir=run_dir)
    if args.check_devices:
        print(json.dumps(launcher.check_devices()))
    if args.run:
        launcher.run(args.run, env=env, secrets=secrets, run_dir=run_dir)
    if args.logs:
        try:
            launcher.logs(follow=not args.no_follow, all_workers=args.all_workers, lines=args.lines)
        except KeyboardInterrupt:
            launcher.say("detached from the log; the training goes on (--logs to follow again)")
    if args.health:
        report = launcher.health()
        print(rec.format_health(report), flush=True)
        print(launcher.goodput(), flush=True)
        code = code or (1 if report["problems"] else 0)
    if args.wait:
        result = launcher.wait(timeout=args.timeout)
        launcher.say(f"run {result.state}" + (f": {result.error_value}" if result.error_value else ""))
        code = code or (0 if result.ok else 1)
    if args.download_checkpoint:
        launcher.download_checkpoint(args.download_checkpoint, run_dir=args.run_dir)
    if args.recover:
        policy = rec.Policy(poll_s=args.poll_interval or 60.0, heartbeat_deadline_s=args.heartbeat_deadline,
                            max_restarts=args.max_restarts)
        result = launcher.recover(args.recover, run_dir=run_dir, env=env or None, secrets=secrets or None,
                                  local_repo_path=args.upload or ".", policy=policy, timeout=args.timeout)
        launcher.say(f"recovery {result.state}" + (f": {result.error_value}" if result.error_value else ""))
        code = code or (0 if result.ok else 1)
    if args.stop:
        launcher.stop()
    if args.teardown:
        launcher.teardown()
    return code


def console() -> int:
    """`python -m flaxchat.cloud.launcher` and the installed `flaxchat-launch`: a UserError is one
    line on stderr and exit code 2, not a traceback."""
    return cli_main(main)


if __name__ == "__main__":
    sys.exit(console())

"""A SkyPilot managed-job task for a flaxchat stage: a second road onto TPU slices, with no laptop.

    python -m flaxchat.cloud.skypilot --accelerator=v5litepod-8 --spot --zone=us-west4-a \\
        --run-dir=gs://my-flaxchat/d20 --run "python -m scripts.pretrain --depth=20" > d20.yaml
    sky jobs launch d20.yaml            # a controller in the cloud runs it and relaunches it
    sky jobs queue; sky jobs logs       # status and recoveries; process 0's output

The launcher's --recover keeps a run going through preemptions only while the machine that runs it
keeps polling. A managed job is watched by SkyPilot's controller, a small VM in the cloud: when the
spot slice is preempted it provisions another (in this zone or the next region, by the strategy) and
runs the task again, and the stage resumes from the last checkpoint in the gs:// run folder.

`task_for(spec)` is a pure function: a JobSpec in, the task as plain data (what SkyPilot's YAML holds)
out; nothing here imports SkyPilot or looks at the network. The command line writes that data as YAML
(to stdout or --out). The task:
- `resources`: the TPU (`tpu-v5litepod-8`, `tpu-v6e-64`, `tpu-v4-32`, ...), spot or not, zone or
  region, and `job_recovery`: the strategy, `max_restarts_on_errors` (a crash is retried that many
  times), and `recover_on_exit_codes: [75]`, flaxchat's ExitCode.PREEMPTED (the stage saved its step
  on a preemption notice and asks to be run again): such an exit is relaunched without counting as
  an error;
- `workdir: .`: the checkout, synced to every host; `setup`: a uv venv with Python 3.11 (the TPU
  images have 3.10) and `-e .[tpu,gcs,hub]`, as the launcher's --setup installs it;
- `run`: on every host of the slice (SkyPilot runs a pod slice's hosts as its nodes), the JAX
  coordinator environment flaxchat reads (`flaxchat.common.maybe_initialize_distributed`) made from
  SkyPilot's own: JAX_COORDINATOR_ADDRESS from the first of SKYPILOT_NODE_IPS, JAX_NUM_PROCESSES
  from their count, JAX_PROCESS_ID from SKYPILOT_NODE_RANK; then the stage with `--run-dir` added.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import Mapping

from flaxchat.cloud import gcloud as g
from flaxchat.cloud.topology import default_runtime_version, topology_for
from flaxchat.errors import ExitCode, UserError, cli_main

# SkyPilot's recovery strategies for managed jobs (sky/jobs/recovery_strategy.py): EAGER_NEXT_REGION
# tries another region at once after a preemption; FAILOVER first retries the same region.
STRATEGIES = ("EAGER_NEXT_REGION", "FAILOVER")
EXTRAS = ("tpu", "gcs", "hub")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What a managed job needs to know. `run` is the stage's command; `run_dir` its gs:// run folder."""

    run: str
    run_dir: str
    accelerator: str = "v5litepod-8"
    spot: bool = False
    zone: str | None = None
    region: str | None = None
    name: str = "flaxchat"
    runtime_version: str = ""  # "" = Google's default image for the generation
    strategy: str = "EAGER_NEXT_REGION"
    max_restarts_on_errors: int = 3
    coordinator_port: int = g.COORDINATOR_PORT
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secrets: tuple[str, ...] = ()  # names: `sky jobs launch --secret NAME` passes each value

    def validate(self) -> "JobSpec":
        topology_for(self.accelerator)  # unknown type: one sentence listing the valid ones
        if not self.run.strip():
            raise UserError("--run needs the stage's command, e.g. --run \"python -m scripts.pretrain --depth=20\".")
        if not self.run_dir:
            raise UserError("--run-dir is required: the gs:// folder the stage keeps its checkpoints in, e.g. "
                            "--run-dir gs://my-bucket/d20.")
        if not self.run_dir.startswith("gs://") or len(self.run_dir.rstrip("/")) <= len("gs://"):
            raise UserError(f"--run-dir must be a gs:// folder (got {self.run_dir!r}): a managed job is relaunched on "
                            "new VMs, whose disks start empty, so checkpoints on a VM's disk would be lost and "
                            "training would start again from step 0.")
        if self.zone and self.region and not self.zone.startswith(self.region + "-"):
            raise UserError(f"--zone {self.zone} is not in --region {self.region}; give one of them, or a zone of "
                            "that region.")
        if self.strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)} (got {self.strategy!r}).")
        if self.max_restarts_on_errors < 0:
            raise UserError(f"--max-restarts must be 0 or more (got {self.max_restarts_on_errors}).")
        clash = sorted(set(self.env) & set(self.secrets))
        if clash:
            raise UserError(f"{clash[0]} is given as both --env and --secret; give it once.")
        return self


def accelerator_name(accelerator: str) -> str:
    """SkyPilot's name for a Cloud TPU type: 'tpu-' + Google's (v5litepod-8 -> tpu-v5litepod-8)."""
    return "tpu-" + topology_for(accelerator).accelerator


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def setup_script() -> str:
    """Every host: uv (pip-installed into ~/.flaxchat/bootstrap if the image has none), a Python 3.11
    venv, the checkout (SkyPilot's workdir) installed into it, and a check that it imports flaxchat."""
    check = "import sys, flaxchat; sys.exit(0 if sys.version_info >= (3, 11) else 3)"
    return "\n".join([
        "set -e",
        f'export FLAXCHAT_VENV="$HOME/{g.REMOTE_VENV}"',
        'UV="$(command -v uv || true)"',
        'if [ -z "$UV" ]; then',
        f'  python3 -m pip install -q --target "$HOME/{g.REMOTE_BOOTSTRAP}" uv',
        f'  UV="$HOME/{g.REMOTE_BOOTSTRAP}/bin/uv"',
        "fi",
        "export UV",
        g.default_install(EXTRAS),
        f'(cd / && "$FLAXCHAT_VENV/bin/python" -c {shlex.quote(check)})',
    ])


def run_script(spec: JobSpec) -> str:
    """Every host: the coordinator environment from SkyPilot's, then the stage with its --run-dir.
    On a one-host slice no coordinator is set (flaxchat then starts JAX on its own). SkyPilot runs a
    TPU pod slice's task on each of its hosts, each with its SKYPILOT_NODE_RANK, and lists all of
    their IPs in SKYPILOT_NODE_IPS (sky/backends/cloud_vm_ray_backend.py, `num_ips_per_node`)."""
    lines = ["set -e"]
    if topology_for(spec.accelerator).workers > 1:
        lines += [
            f'export JAX_COORDINATOR_ADDRESS="$(echo "$SKYPILOT_NODE_IPS" | head -n1):{spec.coordinator_port}"',
            'export JAX_NUM_PROCESSES="$(echo "$SKYPILOT_NODE_IPS" | wc -l)"',
            'export JAX_PROCESS_ID="$SKYPILOT_NODE_RANK"',
        ]
    lines.append(f'export PATH="$HOME/{g.REMOTE_VENV}/bin:$PATH"')
    lines.append(f"{spec.run.strip()} --run-dir={shlex.quote(spec.run_dir)}")
    return "\n".join(lines)


def task_for(spec: JobSpec) -> dict:
    """The SkyPilot task for `spec` as plain data (dicts, lists, strings, numbers): what
    `sky jobs launch` reads from YAML."""
    spec.validate()
    resources: dict = {
        "cloud": "gcp",
        "accelerators": accelerator_name(spec.accelerator),
        "accelerator_args": {"runtime_version": spec.runtime_version or default_runtime_version(spec.accelerator)},
        "use_spot": spec.spot,
    }
    if spec.zone:
        resources["zone"] = spec.zone
    if spec.region or spec.zone:
        resources["region"] = spec.region or region_of(spec.zone)
    resources["job_recovery"] = {
        "strategy": spec.strategy,
        "max_restarts_on_errors": spec.max_restarts_on_errors,
        "recover_on_exit_codes": [int(ExitCode.PREEMPTED)],
    }
    task: dict = {"name": spec.name, "resources": resources, "workdir": "."}
    if spec.env:
        task["envs"] = dict(spec.env)
    if spec.secrets:
        # A name with no value: SkyPilot takes it as a reference resolved at launch (`sky jobs launch
        # --secret NAME` reads NAME from that shell), so the value is never in the YAML.
        task["secrets"] = {name: None for name in spec.secrets}
    task["setup"] = setup_script()
    task["run"] = run_script(spec)
    return task


def to_yaml(task: dict) -> str:
    """The task as YAML: multi-line strings as literal blocks (the scripts read as written)."""
    import yaml  # PyYAML: a dependency of flax

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, s):
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)

    Dumper.add_representer(str, text)
    return yaml.dump(task, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000)


# --- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flaxchat.cloud.skypilot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", "--accelerator-type", dest="accelerator", default=JobSpec.accelerator,
                    help="Cloud TPU type, as the launcher takes it: v5litepod-8, v6e-64, v4-32, ... "
                         "(default %(default)s)")
    ap.add_argument("--zone", help="zone to run in, and to relaunch in after a preemption (default: any zone "
                                   "SkyPilot finds capacity in)")
    ap.add_argument("--region", help="region to run and relaunch in, any of its zones (default: any)")
    ap.add_argument("--spot", action="store_true", help="spot capacity (cheaper; preemptions are recovered)")
    ap.add_argument("--runtime-version", default="", help="TPU VM image (default: Google's for the generation)")
    ap.add_argument("--run", metavar="CMD", default="", help="the stage's command, run on every host (required)")
    ap.add_argument("--run-dir", metavar="gs://BUCKET/RUN", default="",
                    help="the stage's run folder in a bucket, added to CMD as its --run-dir: a relaunch resumes "
                         "from its last checkpoint (required)")
    ap.add_argument("--name", default=JobSpec.name, help="the managed job's name (default %(default)s)")
    ap.add_argument("--strategy", default=JobSpec.strategy, choices=STRATEGIES,
                    help="where SkyPilot looks for a new slice after a preemption (default %(default)s)")
    ap.add_argument("--max-restarts", type=int, default=JobSpec.max_restarts_on_errors,
                    help="relaunches after a failing exit (a crash) before the job fails; a preempted exit "
                         f"({int(ExitCode.PREEMPTED)}) does not count (default %(default)s)")
    ap.add_argument("--coordinator-port", type=int, default=g.COORDINATOR_PORT,
                    help="JAX coordinator port on the first host (default %(default)s)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the run")
    ap.add_argument("--secret", action="append", default=[], metavar="NAME",
                    help="a secret's name in the task; its value is given at launch (sky jobs launch --secret "
                         "NAME), never written into the YAML")
    ap.add_argument("--out", metavar="FILE", help="write the YAML here (default: stdout)")
    return ap


def spec_from_args(args) -> JobSpec:
    env = {}
    for item in args.env:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UserError(f"--env takes KEY=VALUE (got {item!r}).")
        env[key] = value
    return JobSpec(run=args.run, run_dir=args.run_dir, accelerator=args.accelerator, spot=args.spot,
                   zone=args.zone, region=args.region, name=args.name, runtime_version=args.runtime_version,
                   strategy=args.strategy, max_restarts_on_errors=args.max_restarts,
                   coordinator_port=args.coordinator_port, env=env, secrets=tuple(args.secret)).validate()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    text = to_yaml(task_for(spec_from_args(args)))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}; launch it with: sky jobs launch {shlex.quote(args.out)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))

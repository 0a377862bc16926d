"""A local stand-in for the `gcloud` commands the launcher uses: rehearse a whole pod on this machine.

Google's servers cannot be reached from a laptop rehearsal or from CI, so this answers the same
command lines with real work here, and is as unkind as Google where a pod's trouble comes from:

    gcloud compute tpus tpu-vm create|describe|delete|ssh|scp ...
    gcloud compute tpus queued-resources create|describe|delete ...
    gcloud storage ls|cp|buckets create ...   (gs://BUCKET/PATH is a folder beside the VMs: bucket.py)

State lives under $FLAXCHAT_GCLOUD_EMULATOR_DIR (default ~/.flaxchat/emulator): one JSON file per
TPU VM and one folder per worker (`worker-<i>/`), that worker's HOME and its disk (deleting the VM
deletes it, so whatever a run kept there is lost, as on Google's). Commands really run, as local
processes, concurrently on every worker for `--worker=all`. `describe --format=json` answers in
Google's JSON shape; errors are printed like gcloud's (`ERROR: (gcloud.compute.tpus.tpu-vm.describe)
NOT_FOUND: ...`) with its exit codes. A new VM goes CREATING -> READY after
$FLAXCHAT_GCLOUD_EMULATOR_CREATE_SECONDS (2 s); a queued resource ACCEPTED -> PROVISIONING -> ACTIVE.

Each worker is a stock TPU VM image: `python3` is Python 3.10 with nothing installed (a shim that
says 3.10, refuses `pip install -e .` as pip does for a package that requires >= 3.11, and runs
without this machine's site-packages), there is no `python`, JAX sees CPU devices (one per chip of
the slice), `/dev/accel0` is a file in the worker's folder, and gs:// reaches the rehearsal bucket.
Only what the job itself prints is printed: on a real pod that is process 0.

Admin verbs (for tests and for rehearsing trouble):

    python -m flaxchat.cloud.rehearsal.emulator preempt NAME --zone Z [--project P]   # SIGKILL, PREEMPTED
    python -m flaxchat.cloud.rehearsal.emulator set-state NAME STATE --zone Z [--project P]
    python -m flaxchat.cloud.rehearsal.emulator set-health NAME HEALTH --zone Z [--project P]
    python -m flaxchat.cloud.rehearsal.emulator unreachable NAME --worker I --zone Z [--off]
    python -m flaxchat.cloud.rehearsal.emulator fail-next VERB "MESSAGE" [--times N] [--in-zone Z]
    python -m flaxchat.cloud.rehearsal.emulator stockout ZONE [--times N]     # "no more capacity"
    python -m flaxchat.cloud.rehearsal.emulator list
    python -m flaxchat.cloud.rehearsal.emulator install-shim DIR           # write DIR/gcloud

`fail-next queued-resources.provision "MESSAGE"` makes the next queued resource go FAILED with that
message (Google accepts the request, then fails it); `set-state` on a spot VM makes its queued
resource SUSPENDED, as a preemption does.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from flaxchat.cloud.topology import TOPOLOGIES

STATE_ENV = "FLAXCHAT_GCLOUD_EMULATOR_DIR"
DELAY_ENV = "FLAXCHAT_GCLOUD_EMULATOR_CREATE_SECONDS"
# The emulated cloud's clock, in seconds since the epoch (default: the real one). A test sets it
# so that "CREATING until the delay has passed" holds however slowly a loaded machine starts the
# next `gcloud` process: a 0.6 s delay checked against the real clock failed under load.
CLOCK_ENV = "FLAXCHAT_GCLOUD_EMULATOR_NOW"
# Every process of a worker carries it, so preempt and delete find them all. Its value starts with the
# VM's folder, which lies under this emulator's state root: two emulated clouds (two test workers,
# each with its own root) may both have a VM called "pod", and a preemption of one must not kill the other.
TAG_ENV = "FLAXCHAT_EMULATOR_VM"
ORIG_PYTHONPATH_ENV = "FLAXCHAT_EMULATOR_ORIG_PYTHONPATH"
BUCKETS_ENV = "FLAXCHAT_REHEARSAL_BUCKETS"  # see bucket.py
DEVICES_ENV = "FLAXCHAT_TPU_DEVICES"  # worker.py: where the TPU's device files are (real VM: /dev/accel*)
WORKER_IP = "127.0.0.1"  # all workers share this machine's loopback, described as internal IPs

# Which TPU generations each zone offers (Google's "TPU regions and zones" page, abridged).
# A zone not listed here accepts every generation, so a rehearsal never blocks on this table.
ZONES = {
    "us-central2-b": {"v4"},
    "us-central1-a": {"v5litepod", "v5p"},
    "us-central1-b": {"v5litepod"},
    "us-west4-a": {"v5litepod"},
    "us-east1-d": {"v6e"},
    "us-east5-a": {"v5p", "v6e"},
    "us-east5-b": {"v5litepod", "v6e"},
    "europe-west4-a": {"v5litepod", "v6e"},
    "europe-west4-b": {"v5litepod", "v5p"},
    "asia-northeast1-b": {"v6e"},
}
VALUE_FLAGS = {"zone", "project", "accelerator-type", "version", "runtime-version", "node-id", "worker",
               "command", "format", "verbosity"}
# What Google says when a zone has no TPUs of the type to give (the create fails; nothing is made).
STOCKOUT = ('RESOURCE_EXHAUSTED: There is no more capacity in the zone "{zone}"; you can try in another '
            "zone where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
            "[EID: 0x5f3a9c2e1b7d4086]")
BOOL_FLAGS = {"preemptible", "spot", "quiet", "recurse", "force", "async"}


class GcloudFail(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def state_root() -> str:
    return os.path.expanduser(os.environ.get(STATE_ENV) or os.path.join("~", ".flaxchat", "emulator"))


def _now() -> float:
    return float(os.environ.get(CLOCK_ENV) or time.time())


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.contextmanager
def _locked():
    """One lock for every read-modify-write: concurrent gcloud calls must not lose a state change."""
    os.makedirs(state_root(), exist_ok=True)
    with open(os.path.join(state_root(), ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _zone_dir(project: str, zone: str) -> str:
    return os.path.join(state_root(), project, zone)


def node_dir(project: str, zone: str, name: str) -> str:
    return os.path.join(_zone_dir(project, zone), "tpus", name)


def worker_dir(project: str, zone: str, name: str, worker: int) -> str:
    return os.path.join(node_dir(project, zone, name), f"worker-{worker}")


def _node_file(project, zone, name):
    return node_dir(project, zone, name) + ".json"


def _qr_file(project, zone, qr):
    return os.path.join(_zone_dir(project, zone), "queued", qr + ".json")


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def load_node(project, zone, name, verb="describe"):
    node = _read(_node_file(project, zone, name))
    if node is None:
        raise GcloudFail(f"NOT_FOUND: Resource 'projects/{project}/locations/{zone}/nodes/{name}' was not found")
    if node["state"] == "CREATING" and _now() >= node["readyAt"]:
        node["state"] = "READY"
        _write(_node_file(project, zone, name), node)
    return node


def describe_json(node: dict) -> dict:
    """The node in Google's `describe --format=json` shape."""
    out = {k: node[k] for k in ("name", "acceleratorType", "state", "runtimeVersion", "createTime", "health",
                                "networkEndpoints", "apiVersion", "id")}
    sched = {k: True for k in ("preemptible", "spot") if node["scheduling"].get(k)}
    if sched:  # Google omits schedulingConfig fields that are false
        out["schedulingConfig"] = sched
    if node.get("queuedResource"):
        out["queuedResource"] = node["queuedResource"]
    return out


# --- processes ------------------------------------------------------------------------------


def _tagged_pids(tag_prefix: str) -> list[int]:
    pids = []
    if not os.path.isdir("/proc"):
        return pids
    needle = f"{TAG_ENV}={tag_prefix}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if any(v.startswith(needle) for v in f.read().split(b"\0")):
                        pids.append(int(entry))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def _vm_tag(project, zone, name) -> str:
    return os.path.realpath(node_dir(project, zone, name)) + os.sep


def kill_node_processes(project, zone, name) -> int:
    """SIGKILL every process of the VM, as a preemption does: no handler runs, no file is finished."""
    tag = _vm_tag(project, zone, name)
    killed = 0
    for _ in range(5):  # repeat: a process may fork while we scan
        pids = _tagged_pids(tag)
        for wdir in _worker_dirs(project, zone, name):  # without /proc: the runs worker.py recorded
            run = _read(os.path.join(wdir, ".flaxchat", "run", "run.json")) or {}
            pids += [p for p in (run.get("child_pid"), run.get("supervisor_pid")) if p and not os.path.isdir("/proc")]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.05)
    return killed


def _worker_dirs(project, zone, name):
    d = node_dir(project, zone, name)
    return [os.path.join(d, w) for w in sorted(os.listdir(d))] if os.path.isdir(d) else []


def buckets_root() -> str:
    # A worker's own `gcloud storage` (the recipe's copy of a run folder on the VM) runs without the
    # emulator's state folder in its env, but with the bucket root its processes use for gs://.
    return os.environ.get(BUCKETS_ENV) or os.path.join(state_root(), "buckets")


PYTHON310 = """#!/bin/sh
# python3 of a stock Cloud TPU VM image (Ubuntu 22.04): Python 3.10, nothing of flaxchat's installed.
REAL="{real}"
case "$1" in --version|-V) echo "Python 3.10.12"; exit 0;; esac
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  for a in "$@"; do
    case "$a" in
      -e|.|-e.|./*|".["*)
        echo "ERROR: Package 'flaxchat' requires a different Python: 3.10.12 not in '>=3.11'" >&2
        exit 1;;
    esac
  done
  exec "$REAL" "$@"
fi
exec "$REAL" -S "$@"  # no site-packages: the image has none of this machine's
"""


def _image() -> dict:
    """The stock image every emulated worker boots: python3 (3.10), no python, gs:// to the bucket."""
    base = os.path.join(state_root(), "image")
    bin_dir, site = os.path.join(base, "bin"), os.path.join(base, "site")
    os.makedirs(bin_dir, exist_ok=True)
    os.makedirs(site, exist_ok=True)
    files = {os.path.join(bin_dir, "python3"): PYTHON310.format(real=sys.executable),
             os.path.join(bin_dir, "python"): '#!/bin/sh\necho "bash: python: command not found" >&2\nexit 127\n',
             os.path.join(site, "sitecustomize.py"): "import flaxchat_rehearsal_bucket as b\nb.install()\n"}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bucket.py")) as f:
        files[os.path.join(site, "flaxchat_rehearsal_bucket.py")] = f.read()
    for path, text in files.items():
        try:
            with open(path) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    return {"bin": bin_dir, "site": site}


def _worker_env(project, zone, name, worker, node=None) -> dict:
    env = dict(os.environ)
    home = worker_dir(project, zone, name, worker)
    image = _image()
    env.update({"HOME": home, "FLAXCHAT_WORKER_ID": str(worker), TAG_ENV: _vm_tag(project, zone, name) + str(worker)})
    env["PATH"] = image["bin"] + os.pathsep + env.get("PATH", "")
    original = env.pop(ORIG_PYTHONPATH_ENV, None)  # the shim's own PYTHONPATH is not the worker's
    if original is None:
        original = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = image["site"] + (os.pathsep + original if original else "")
    env.pop(STATE_ENV, None)
    env.pop("VIRTUAL_ENV", None)
    env[BUCKETS_ENV] = buckets_root()
    # The VM's machine environment: no TPU here, so JAX uses as many CPU devices as the slice has
    # chips per worker (a job's own env file may say otherwise, and wins).
    accel = (node or {}).get("acceleratorType")
    chips = TOPOLOGIES[accel].chips_per_worker if accel in TOPOLOGIES else 1
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={chips}"})
    dev = os.path.join(home, "_dev")
    os.makedirs(dev, exist_ok=True)
    if not os.path.exists(os.path.join(dev, "accel0")):
        open(os.path.join(dev, "accel0"), "w").close()
    env[DEVICES_ENV] = os.path.join(dev, "accel*")
    return env


def _pump(stream, out, lock):
    for line in iter(stream.readline, b""):
        with lock:
            out.buffer.write(line)
            out.flush()
    stream.close()


def run_on_workers(project, zone, name, node, workers, command) -> int:
    """Run `command` with bash on each worker at once, interleaving their output line by line."""
    lock = threading.Lock()
    procs, codes = [], {}
    for w in workers:
        if w in node.get("unreachable", []):
            with lock:
                sys.stderr.write(f"ssh: connect to host {WORKER_IP} port 22: Connection timed out\n")
            codes[w] = 255
            continue
        home = worker_dir(project, zone, name, w)
        os.makedirs(home, exist_ok=True)
        p = subprocess.Popen(["bash", "-c", command], cwd=home, env=_worker_env(project, zone, name, w, node),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        threads = [threading.Thread(target=_pump, args=(s, o, lock), daemon=True)
                   for s, o in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
        for t in threads:
            t.start()
        procs.append((w, p, threads))

    def hang_up(signum, frame):  # the local end went away (Ctrl-C on `--logs`): ssh hangs up the remote
        for _, p, _ in procs:    # commands; what they started detached (the training) goes on
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGHUP)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, hang_up)
    signal.signal(signal.SIGINT, hang_up)
    for w, p, threads in procs:
        codes[w] = p.wait()
        for t in threads:
            t.join()
    bad = [codes[w] for w in sorted(codes) if codes[w] != 0]
    if bad:
        print(f"ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [{bad[0]}].",
              file=sys.stderr)
    return bad[0] if bad else 0


# --- the gcloud verbs -------------------------------------------------------------------------


def _parse(args: list[str], group: str) -> tuple[list[str], dict]:
    pos, flags = [], {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            if key in BOOL_FLAGS and not eq:
                flags[key] = True
            elif key in VALUE_FLAGS:
                if not eq:
                    if i + 1 >= len(args):
                        raise GcloudFail(f"argument --{key}: expected one argument", 2)
                    i += 1
                    value = args[i]
                flags[key] = value
            else:
                raise GcloudFail(f"unrecognized arguments: {a}", 2)
        else:
            pos.append(a)
        i += 1
    if "project" not in flags:
        raise GcloudFail("The required property [project] is not currently set.", 1)
    if "zone" not in flags:
        raise GcloudFail("argument --zone: Must be specified.", 2)
    return pos, flags


def _one(pos, what):
    if len(pos) != 1:
        raise GcloudFail(f"argument {what}: Must be specified.", 2)
    return pos[0]


def _check_accelerator(zone: str, accel: str | None):
    if not accel:
        raise GcloudFail("argument --accelerator-type: Must be specified.", 2)
    topo = TOPOLOGIES.get(accel)
    if topo is None:
        raise GcloudFail(f"INVALID_ARGUMENT: Accelerator type '{accel}' is not valid.")
    if zone in ZONES and topo.generation not in ZONES[zone]:
        raise GcloudFail(f"NOT_FOUND: Accelerator type '{accel}' is not available in zone '{zone}'. "
                         "Check the TPU regions and zones page for where it is offered.")
    return topo


def _new_node(project, zone, name, accel, version, scheduling, qr=None) -> dict:
    topo = _check_accelerator(zone, accel)
    if _read(_node_file(project, zone, name)) is not None:
        raise GcloudFail(f"ALREADY_EXISTS: Resource 'projects/{project}/locations/{zone}/nodes/{name}' already exists")
    delay = float(os.environ.get(DELAY_ENV, "2"))
    node = {"name": f"projects/{project}/locations/{zone}/nodes/{name}", "acceleratorType": accel,
            "state": "CREATING", "runtimeVersion": version, "createTime": _now_iso(), "health": "HEALTHY",
            "apiVersion": "V2_ALPHA1", "id": str(abs(hash((project, zone, name, time.time()))) % 10**18),
            "networkEndpoints": [{"ipAddress": WORKER_IP, "port": 8470, "accessConfig": {"externalIp": WORKER_IP}}
                                 for _ in range(topo.workers)],
            "scheduling": scheduling, "readyAt": _now() + delay, "queuedResource": qr, "unreachable": []}
    shutil.rmtree(node_dir(project, zone, name), ignore_errors=True)  # a new VM has a fresh disk
    for w in range(topo.workers):
        os.makedirs(worker_dir(project, zone, name, w))
    _write(_node_file(project, zone, name), node)
    return node


def _wait_ready(project, zone, name):
    while True:
        with _locked():
            node = load_node(project, zone, name)
        if node["state"] != "CREATING":
            return node
        time.sleep(0.1)


def _delete_node(project, zone, name):
    kill_node_processes(project, zone, name)
    os.remove(_node_file(project, zone, name))
    shutil.rmtree(node_dir(project, zone, name), ignore_errors=True)


def _workers(spec: str, node: dict) -> list[int]:
    n = len(node["networkEndpoints"])
    if spec == "all":
        return list(range(n))
    try:
        ids = [int(x) for x in spec.split(",")]
    except ValueError:
        raise GcloudFail(f"argument --worker: invalid worker {spec!r}", 2) from None
    if any(not 0 <= i < n for i in ids):
        raise GcloudFail(f"INVALID_ARGUMENT: worker {spec} is out of range; the TPU has {n} worker(s) (0-{n - 1}).")
    return ids


def _remote(path: str, home: str) -> str:
    if path.startswith("~/") or path == "~":
        path = path[2:]
    return path if os.path.isabs(path) else os.path.join(home, path)


def _copy(src: str, dest: str, recurse: bool):
    if not os.path.exists(src):
        raise GcloudFail(f"scp: {src}: No such file or directory", 1)
    if os.path.isdir(dest):
        dest = os.path.join(dest, os.path.basename(src.rstrip("/")))
    if os.path.isdir(src):
        if not recurse:
            raise GcloudFail(f"scp: {src}: not a regular file", 1)
        shutil.copytree(src, dest, dirs_exist_ok=True)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        shutil.copy2(src, dest)  # keeps the mode, as scp does for a new file (the env file stays 600)


def tpu_vm(verb: str, args: list[str]) -> int:
    pos, f = _parse(args, "tpu-vm")
    project, zone = f["project"], f["zone"]
    if verb == "create":
        name = _one(pos, "TPU")
        if not f.get("version"):
            raise GcloudFail("argument --version: Must be specified.", 2)
        with _locked():
            _new_node(project, zone, name, f.get("accelerator-type"), f["version"],
                      {"preemptible": bool(f.get("preemptible")), "spot": bool(f.get("spot"))})
        print(f"Create request issued for: [{name}]", file=sys.stderr)
        if not f.get("async"):
            _wait_ready(project, zone, name)
            print(f"Created tpu [{name}].", file=sys.stderr)
        return 0
    if verb == "scp":
        return _scp(pos, f)
    name = _one(pos, "TPU")
    with _locked():
        node = load_node(project, zone, name)
        if verb == "describe":
            print(json.dumps(describe_json(node), indent=2))
            return 0
        if verb == "delete":
            if node.get("queuedResource"):
                raise GcloudFail(f"FAILED_PRECONDITION: node {name} is managed by queued resource "
                                 f"{node['queuedResource']}; delete the queued resource instead.")
            _delete_node(project, zone, name)
            print(f"Deleted tpu [{name}].", file=sys.stderr)
            return 0
    if verb == "ssh":
        if node["state"] != "READY":
            raise GcloudFail(f"FAILED_PRECONDITION: TPU {name} is in state {node['state']}, not READY.")
        if not f.get("command"):
            raise GcloudFail("an interactive ssh session is not emulated; pass --command.", 2)
        return run_on_workers(project, zone, name, node, _workers(str(f.get("worker", "0")), node), f["command"])
    raise GcloudFail(f"Invalid choice: '{verb}'.", 2)


def _scp(pos, f) -> int:
    project, zone = f["project"], f["zone"]
    if len(pos) < 2:
        raise GcloudFail("argument [[USER@]INSTANCE:]SRC: Must be specified.", 2)
    *srcs, dest = pos

    def split(p):  # "[user@]name:path" -> (name, path); a local path -> (None, path)
        head, colon, tail = p.partition(":")
        return (head.split("@")[-1], tail) if colon and "/" not in head else (None, p)
    remote_dest = split(dest)
    remote_srcs = [split(s) for s in srcs]
    name = remote_dest[0] or next((n for n, _ in remote_srcs if n), None)
    if name is None:
        raise GcloudFail("Source(s) must be remote when destination is local.", 2)
    with _locked():
        node = load_node(project, zone, name)
    if node["state"] != "READY":
        raise GcloudFail(f"FAILED_PRECONDITION: TPU {name} is in state {node['state']}, not READY.")
    workers = _workers(str(f.get("worker", "0")), node)
    for w in workers:
        if w in node.get("unreachable", []):
            raise GcloudFail(f"[/usr/bin/scp] exited with return code [255] (worker {w} unreachable).", 255)
    for w in workers if remote_dest[0] else workers[:1]:
        home = worker_dir(project, zone, name, w)
        for src_name, src in remote_srcs:
            if remote_dest[0]:
                _copy(os.path.abspath(src), _remote(remote_dest[1], home), bool(f.get("recurse")))
            else:
                _copy(_remote(src, home), os.path.abspath(dest), bool(f.get("recurse")))
    return 0


def queued_resources(verb: str, args: list[str]) -> int:
    pos, f = _parse(args, "queued-resources")
    project, zone = f["project"], f["zone"]
    qr = _one(pos, "QUEUED_RESOURCE")
    path = _qr_file(project, zone, qr)
    with _locked():
        spec = _read(path)
        if verb == "create":
            if spec is not None:
                raise GcloudFail(f"ALREADY_EXISTS: Resource 'projects/{project}/locations/{zone}/queuedResources/{qr}' already exists")
            node = f.get("node-id") or qr
            failed = _take_fault_unlocked("queued-resources.provision", zone)
            if failed is None:  # Google accepts the request; a FAILED one never gets its node
                _new_node(project, zone, node, f.get("accelerator-type"), f.get("runtime-version") or "",
                          {"spot": bool(f.get("spot"))}, qr=qr)
            else:
                _check_accelerator(zone, f.get("accelerator-type"))
            _write(path, {"name": qr, "node": node, "accelerator": f.get("accelerator-type"),
                          "runtimeVersion": f.get("runtime-version"), "spot": bool(f.get("spot")),
                          "createTime": _now_iso(), "created": _now(),
                          "failed": failed and {"code": 9, "message": failed["message"]}})
            print(f"Create request issued for: [{qr}]", file=sys.stderr)
            return 0
        if spec is None:
            raise GcloudFail(f"NOT_FOUND: Resource 'projects/{project}/locations/{zone}/queuedResources/{qr}' was not found")
        node = _read(_node_file(project, zone, spec["node"]))
        if verb == "describe":
            print(json.dumps(_qr_json(project, zone, spec, node), indent=2))
            return 0
        if verb == "delete":
            if node is not None:
                if not f.get("force"):
                    raise GcloudFail(f"FAILED_PRECONDITION: queued resource {qr} still has node {spec['node']}; "
                                     "pass --force to delete both.")
                _delete_node(project, zone, spec["node"])
            os.remove(path)
            print(f"Deleted queued resource [{qr}].", file=sys.stderr)
            return 0
    raise GcloudFail(f"Invalid choice: '{verb}'.", 2)


def _qr_json(project, zone, spec, node) -> dict:
    extra = {}
    delay = float(os.environ.get(DELAY_ENV, "2"))
    if spec.get("failed"):
        state = "FAILED"
        extra["failedData"] = {"error": spec["failed"]}
    elif node is None:
        state = "SUSPENDED"  # its node went away (a preemption, or a delete behind its back)
    else:
        node_state = load_node(project, zone, spec["node"])["state"]
        state = {"READY": "ACTIVE", "CREATING": "PROVISIONING", "PREEMPTED": "SUSPENDED",
                 "TERMINATED": "SUSPENDED"}.get(node_state, "ACTIVE")
        if state == "PROVISIONING" and _now() < spec.get("created", 0) + delay / 2:
            state = "ACCEPTED"
    out = {"name": f"projects/{project}/locations/{zone}/queuedResources/{spec['name']}",
           "createTime": spec["createTime"], "state": {"state": state, **extra},
           "tpu": {"nodeSpec": [{"nodeId": spec["node"], "parent": f"projects/{project}/locations/{zone}",
                                 "node": {"acceleratorType": spec["accelerator"],
                                          "runtimeVersion": spec["runtimeVersion"]}}]}}
    if spec["spot"]:
        out["spot"] = {}
    return out


# --- gcloud storage over the rehearsal bucket -------------------------------------------------


def _bucket_path(url: str) -> str:
    if not url.startswith("gs://"):
        raise GcloudFail(f"Invalid URL: {url} (the rehearsal bucket has gs:// URLs only).", 1)
    return os.path.join(buckets_root(), url[len("gs://"):])


def storage(verb: str, args: list[str]) -> int:
    """`gcloud storage ls URL...` (wildcards allowed), `gcloud storage cp [--recursive] SRC DEST` and
    `gcloud storage buckets create gs://B`. A URL in a bucket that was never created fails as on GCS."""
    import glob as globmod

    flags = [a for a in args if a.startswith("-")]
    pos = [a for a in args if not a.startswith("-")]
    if verb == "buckets" and pos[:1] == ["create"] and len(pos) == 2:
        name = pos[1][len("gs://"):].strip("/") if pos[1].startswith("gs://") else ""
        if not name or "/" in name:
            raise GcloudFail(f"Invalid bucket URL: {pos[1]}", 1)
        if os.path.isdir(_bucket_path(pos[1])):
            raise GcloudFail(f"HTTPError 409: The requested bucket name is not available: {name}", 1)
        os.makedirs(_bucket_path(pos[1]))
        print(f"Creating gs://{name}/...")
        return 0
    for url in pos:
        if url.startswith("gs://") and not os.path.isdir(os.path.join(buckets_root(), url[5:].split("/", 1)[0])):
            raise GcloudFail(f"gs://{url[5:].split('/', 1)[0]} bucket does not exist.", 1)
    if verb == "ls":
        lines = []
        for url in pos:
            local = _bucket_path(url)
            if any(c in url for c in "*?["):
                matches = sorted(globmod.glob(local))
            elif url.endswith("/") or os.path.isdir(local):
                matches = sorted(os.path.join(local, n) for n in os.listdir(local)) if os.path.isdir(local) else []
            else:
                matches = [local] if os.path.isfile(local) else []
            for m in matches:
                rel = os.path.relpath(m, buckets_root()).replace(os.sep, "/")
                lines.append(f"gs://{rel}/" if os.path.isdir(m) else f"gs://{rel}")
        if not lines:
            raise GcloudFail("One or more URLs matched no objects.", 1)
        print("\n".join(lines))
        return 0
    if verb == "cp":
        if len(pos) != 2:
            raise GcloudFail("cp needs a source and a destination.", 2)
        src, dest = pos
        if dest.startswith("gs://") and not src.startswith("gs://"):  # an upload: one file, one object
            if not os.path.isfile(src):
                raise GcloudFail(f"The following URLs matched no objects or files:\n-{src}", 1)
            target = _bucket_path(dest)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.uploading{os.getpid()}"  # an object appears whole or not at all, as on GCS
            shutil.copyfile(src, tmp)
            os.replace(tmp, target)
            return 0
        local_src = _bucket_path(src.rstrip("/"))
        if not os.path.exists(local_src):
            raise GcloudFail(f"The following URLs matched no objects or files:\n-{src}", 1)
        if dest.startswith("gs://"):
            raise GcloudFail("bucket-to-bucket copies are not emulated.", 2)
        target = os.path.join(dest, os.path.basename(local_src)) if os.path.isdir(dest) else dest
        if os.path.isdir(local_src):
            if not {"-r", "--recursive", "-R"} & set(flags):
                raise GcloudFail(f"Source URL {src} is a folder; pass --recursive.", 1)
            shutil.copytree(local_src, target, dirs_exist_ok=True)
        else:
            shutil.copy2(local_src, target)
        return 0
    raise GcloudFail(f"Invalid choice: '{verb}'.", 2)


# --- admin verbs (not gcloud's: for tests and rehearsals) --------------------------------------


def preempt(name: str, zone: str, project: str, state: str = "PREEMPTED") -> int:
    """What Google does to a spot VM: every process dies at once (SIGKILL), the VM is PREEMPTED."""
    with _locked():
        node = load_node(project, zone, name)
        killed = kill_node_processes(project, zone, name)
        node["state"] = state
        _write(_node_file(project, zone, name), node)
    return killed


def _update_node(name: str, zone: str, project: str, change) -> None:
    """Read a node, let `change(node)` edit it, write it back, all under the state lock."""
    with _locked():
        node = load_node(project, zone, name)
        change(node)
        _write(_node_file(project, zone, name), node)


def set_state(name: str, zone: str, project: str, state: str) -> None:
    _update_node(name, zone, project, lambda node: node.update(state=state))


def set_unreachable(name: str, zone: str, project: str, worker: int, on: bool = True) -> None:
    def change(node):
        ids = set(node.get("unreachable", []))
        node["unreachable"] = sorted(ids | {worker} if on else ids - {worker})
    _update_node(name, zone, project, change)


def fail_next(verb: str, message: str, code: int = 1, times: int = 1, zone: str | None = None) -> None:
    """Make the next `times` gcloud `verb`s (e.g. "create", "tpu-vm.ssh"; in `zone` only, if given)
    fail with `message`, as gcloud would."""
    path = os.path.join(state_root(), "faults.json")
    with _locked():
        faults = _read(path) or []
        faults += [{"verb": verb, "message": message, "code": code, "zone": zone}] * times
        _write(path, faults)


def stockout(zone: str, times: int = 1) -> None:
    """The next `times` creates in `zone` (VM or queued resource) fail as Google's do in a stockout."""
    for verb in ("tpu-vm.create", "queued-resources.create"):
        fail_next(verb, STOCKOUT.format(zone=zone), 1, times, zone)


def _arg_zone(args: list[str]):
    for i, a in enumerate(args):
        if a.startswith("--zone="):
            return a.split("=", 1)[1]
        if a == "--zone" and i + 1 < len(args):
            return args[i + 1]
    return None


def _take_fault(group: str, verb: str, zone: str | None = None):
    with _locked():
        return _take_fault_unlocked(f"{group}.{verb}", zone)


def _take_fault_unlocked(verb: str, zone: str | None = None):
    path = os.path.join(state_root(), "faults.json")
    faults = _read(path) or []
    for i, fault in enumerate(faults):
        if fault["verb"] in (verb, verb.split(".")[-1]) and fault.get("zone") in (None, zone):
            _write(path, faults[:i] + faults[i + 1:])
            return fault
    return None


def set_health(name: str, zone: str, project: str, health: str) -> None:
    """Google's `health` field of a READY node (HEALTHY, TIMEOUT, UNHEALTHY_MAINTENANCE, ...)."""
    _update_node(name, zone, project, lambda node: node.update(health=health))


def list_nodes() -> list[dict]:
    out = []
    root = state_root()
    for project in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for zone in sorted(os.listdir(os.path.join(root, project))) if os.path.isdir(os.path.join(root, project)) else []:
            tdir = os.path.join(root, project, zone, "tpus")
            for fname in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
                if fname.endswith(".json"):
                    node = load_node(project, zone, fname[:-5])
                    out.append({"project": project, "zone": zone, "name": fname[:-5],
                                "state": node["state"], "acceleratorType": node["acceleratorType"]})
    return out


def install_shim(bin_dir: str) -> str:
    """Write an executable `gcloud` into bin_dir that runs this emulator; put bin_dir first on PATH.

    It uses this exact Python, and makes this copy of flaxchat importable even when it is not
    installed; the worker commands get the original PYTHONPATH back (see _worker_env).
    """
    os.makedirs(bin_dir, exist_ok=True)
    pkg_parent = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    path = os.path.join(bin_dir, "gcloud")
    script = (
        "#!/bin/sh\n"
        "# flaxchat's local emulation of the gcloud TPU commands (python -m flaxchat.cloud.rehearsal.emulator)\n"
        f'export {ORIG_PYTHONPATH_ENV}="${{{ORIG_PYTHONPATH_ENV}-${{PYTHONPATH-}}}}"\n'
        f'export PYTHONPATH="{pkg_parent}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        # -S: the emulator needs only the standard library and flaxchat; skipping site saves time per call
        f'exec "{sys.executable}" -S -m flaxchat.cloud.rehearsal.emulator "$@"\n'
    )
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(script)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def _admin(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flaxchat.cloud.rehearsal.emulator",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=["preempt", "set-state", "set-health", "unreachable", "fail-next", "stockout",
                                     "list", "install-shim"])
    ap.add_argument("args", nargs="*", help="NAME [STATE] | VERB MESSAGE | DIR")
    ap.add_argument("--zone")
    ap.add_argument("--project", default=None)
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--off", action="store_true")
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--times", type=int, default=1)
    ap.add_argument("--in-zone", default=None, help="fail-next: only for commands in this zone")
    a = ap.parse_args(argv)
    if a.verb == "list":
        for n in list_nodes():
            print(f"{n['project']}/{n['zone']}/{n['name']}: {n['state']} ({n['acceleratorType']})")
        return 0
    if a.verb == "install-shim":
        print(install_shim(a.args[0] if a.args else os.path.join(state_root(), "bin")))
        return 0
    if a.verb == "fail-next":
        fail_next(a.args[0], " ".join(a.args[1:]), a.code, a.times, a.in_zone)
        return 0
    if a.verb == "stockout":
        stockout(a.args[0], a.times)
        return 0
    if not a.args or not a.zone:
        ap.error(f"{a.verb} needs NAME and --zone")
    project = a.project or _only_project(a.args[0], a.zone)
    if a.verb == "preempt":
        print(f"preempted {a.args[0]}: killed {preempt(a.args[0], a.zone, project)} process(es)")
    elif a.verb == "set-state":
        set_state(a.args[0], a.zone, project, a.args[1].upper())
    elif a.verb == "set-health":
        set_health(a.args[0], a.zone, project, a.args[1].upper())
    else:
        set_unreachable(a.args[0], a.zone, project, a.worker, not a.off)
    return 0


def _only_project(name: str, zone: str) -> str:
    projects = {n["project"] for n in list_nodes() if n["name"] == name and n["zone"] == zone}
    if len(projects) != 1:
        raise SystemExit(f"error: give --project: {len(projects)} emulated projects have a TPU {name} in {zone}.")
    return projects.pop()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["storage"] and len(argv) >= 2:
        try:
            return storage(argv[1], argv[2:])
        except GcloudFail as e:
            print(f"ERROR: (gcloud.storage.{argv[1]}) {e}", file=sys.stderr)
            return e.code
    if argv[:2] != ["compute", "tpus"] or len(argv) < 4:
        if argv and argv[0] in ("compute", "storage", "config", "auth"):
            print(f"ERROR: (gcloud) the flaxchat emulator does not emulate `gcloud {' '.join(argv[:3])}`.",
                  file=sys.stderr)
            return 2
        return _admin(argv)
    group, verb, rest = argv[2], argv[3], argv[4:]
    label = f"gcloud.compute.tpus.{group}.{verb}"
    try:
        fault = _take_fault(group, verb, _arg_zone(rest))
        if fault:
            raise GcloudFail(fault["message"], fault["code"])
        if group == "tpu-vm":
            return tpu_vm(verb, rest)
        if group == "queued-resources":
            return queued_resources(verb, rest)
        raise GcloudFail(f"Invalid choice: '{group}'.", 2)
    except GcloudFail as e:
        print(f"ERROR: ({label}) {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())

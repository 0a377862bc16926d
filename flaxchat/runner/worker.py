"""What runs on each worker: start a command detached, and answer status / logs / stop for it.

    python3 flaxchat/runner/worker.py start --run-id ID --env-file F --cwd DIR [--venv V] [--replace] -- CMD
    python3 flaxchat/runner/worker.py status [--marker PATH]      # one JSON line
    python3 flaxchat/runner/worker.py logs [--follow] [--prefix] [--lines N]
    python3 flaxchat/runner/worker.py stop
    python3 flaxchat/runner/worker.py dump                        # every thread's Python stack: hang-<time>.txt
    python3 flaxchat/runner/worker.py probe --env-file F --cwd DIR   # JAX devices, one JSON line
    python3 flaxchat/runner/worker.py checkpoints --dir D --cwd DIR  # complete / partial Orbax steps
    VENV/bin/python flaxchat/runner/worker.py versions             # Python, jax, flaxchat of that venv

Standard library only and run by path with the image's own python3 (3.10 on Google's TPU images),
so it works on a fresh VM before anything is installed. `start` hands the command to a supervisor in
its own session (so an ssh disconnect or Ctrl-C never reaches it), which reads the env file
(coordinator address, process count, user env and secrets: never on a command line), adds this
worker's process id, puts the setup's venv first on PATH (so `python` is the venv's 3.11+), runs
the command in its own process group, and writes into the state folder (default ~/.flaxchat/run):

    run.json       run id, command, pids, start time
    output.log     stdout+stderr, secrets replaced by *** (on a pod only process 0 prints)
    progress.json  the child's FLAXCHAT_PROGRESS_FILE: step and time of the last finished step,
                   written by every process (flaxchat.progress, schema 1). This is the liveness:
                   a process alive whose step stops moving is hung; printed lines are never parsed.
    exit_code      written when the command ends (state "exiting" until then, while its supervisor
                   is alive); absent after a SIGKILL (preemption, OOM killer)
    stacks-PID.txt where a flaxchat stage (errors.cli_main, FLAXCHAT_STACKS_DIR) writes every thread's
                   Python stack on SIGUSR1; `dump` signals it and gathers what it wrote into
    hang-TIME.txt  (also copied into the stage's run folder when that is on this disk), named by
                   `status` and `--health`: where a stalled step or distributed start was stuck

Before a new run, whatever still holds the TPU (a leftover probe, an older run: any process with
/dev/accel* or /dev/vfio/* open) is killed, then libtpu's lockfile is removed (as maxtext's runner
does): a held TPU makes every restart fail.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

DEFAULT_STATE = os.path.join("~", ".flaxchat", "run")
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"  # a stale one makes the TPU look busy to the next run
TPU_DEVICES = "/dev/accel*:/dev/vfio/*"  # v4/v5p expose /dev/accelN, v5e/v6e /dev/vfio/N
DEVICES_ENV = "FLAXCHAT_TPU_DEVICES"  # another list (a rehearsal's stand-in device files)
PROGRESS_ENV = "FLAXCHAT_PROGRESS_FILE"  # flaxchat.progress.ENV (this file imports nothing of flaxchat)
PROGRESS_SCHEMA = 1
STACKS_ENV = "FLAXCHAT_STACKS_DIR"  # flaxchat.errors.STACKS_ENV
STACKS_WAIT_S = 5.0  # how long `dump` waits for a signalled process to write its stacks
STARTUP_GRACE_S = 10.0  # a supervisor that has not started its child by then is gone
OUTPUT_DRAIN_S = 10.0  # after the command exits, how long its output pipe may stay open (a leftover child holds it)
METADATA_WORKER_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
                       "agent-worker-number")


@functools.lru_cache(maxsize=None)
def worker_id() -> int:
    """This worker's index in the slice: the emulator (or LocalRunner) sets FLAXCHAT_WORKER_ID; on a
    real TPU VM, Google's metadata server has it as `agent-worker-number`."""
    if os.environ.get("FLAXCHAT_WORKER_ID", "").isdigit():
        return int(os.environ["FLAXCHAT_WORKER_ID"])
    try:  # only a Google Compute Engine VM has the metadata server; elsewhere do not wait for it
        with open("/sys/class/dmi/id/product_name") as f:
            if "Google" not in f.read():
                return 0
    except OSError:
        return 0
    try:
        req = urllib.request.Request(METADATA_WORKER_URL, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=2) as resp:
            return int(resp.read().decode().strip())
    except Exception:
        return 0


def _paths(state_dir: str) -> dict:
    d = os.path.expanduser(state_dir)
    return {k: os.path.join(d, f) for k, f in
            [("dir", ""), ("run", "run.json"), ("log", "output.log"), ("progress", "progress.json"),
             ("exit", "exit_code")]}


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _pid_alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent has not collected it yet
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def load_env_file(path: str) -> tuple[dict, list]:
    data = _read_json(os.path.expanduser(path)) if path else None
    if not data:
        return {}, []
    return {str(k): str(v) for k, v in data.get("env", {}).items()}, list(data.get("secret_keys", []))


def make_redactor(secrets):
    values = sorted({v for v in secrets if v}, key=len, reverse=True)  # longest first: no partial leaks

    def redact(text: str) -> str:
        for v in values:
            text = text.replace(v, "***")
        return text
    return redact


# --- start / supervise / stop ----------------------------------------------------------------


def tpu_holders(patterns: str | None = None) -> list[int]:
    """Pids (not this one) with a TPU device file open, found through /proc/*/fd."""
    patterns = patterns or os.environ.get(DEVICES_ENV) or TPU_DEVICES
    devices = {os.path.realpath(d) for pat in patterns.split(":") if pat for d in glob.glob(os.path.expanduser(pat))}
    holders = []
    if not devices or not os.path.isdir("/proc"):
        return holders
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.path.realpath(f"/proc/{entry}/fd/{fd}") in devices:
                    holders.append(int(entry))
                    break
            except OSError:
                pass
    return holders


def free_tpu(grace: float = 5.0) -> list[int]:
    """Kill whatever holds the TPU (TERM, then KILL), then remove libtpu's lockfile; the pids killed."""
    holders = tpu_holders()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in holders:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_pid_alive(p) for p in holders):
            time.sleep(0.05)
        if not any(_pid_alive(p) for p in holders):
            break
    if os.path.exists(LIBTPU_LOCKFILE):
        os.remove(LIBTPU_LOCKFILE)
    return holders


def start(state_dir: str, run_id: str, command: str, env_file: str = "", cwd: str = ".",
          marker: str = "", replace: bool = False, venv: str = "") -> dict:
    p = _paths(state_dir)
    current = status(state_dir)
    if current["alive"]:
        if not replace:
            return {"worker": worker_id(), "started": False,
                    "error": f"a run is already going (run {current['run_id']}, pid {current['pid']})"}
        stop(state_dir)
    freed = free_tpu() if replace else []
    os.makedirs(p["dir"], exist_ok=True)
    for key in ("exit", "progress"):
        if os.path.exists(p[key]):
            os.remove(p[key])
    for old in glob.glob(os.path.join(p["dir"], "stacks-*.txt")):  # the last run's listeners
        os.remove(old)
    with open(p["log"], "a") as f:
        f.write(f"=== flaxchat run {run_id} started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        if freed:
            f.write(f"flaxchat: killed {len(freed)} leftover process(es) that held the TPU: {freed}\n")
    _write_json(p["run"], {"run_id": run_id, "command": command,
                           "env_file": os.path.abspath(os.path.expanduser(env_file)) if env_file else "",
                           "cwd": os.path.abspath(os.path.expanduser(cwd)), "marker": marker,
                           "venv": os.path.abspath(os.path.expanduser(venv)) if venv else "",
                           "started_at": time.time(), "child_pid": None})
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "_supervise", "--state-dir", state_dir],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)
    deadline = time.time() + STARTUP_GRACE_S
    while time.time() < deadline:
        run = _read_json(p["run"]) or {}
        if run.get("child_pid") or os.path.exists(p["exit"]):
            return {"worker": worker_id(), "started": True, "run_id": run_id, "pid": run.get("child_pid")}
        time.sleep(0.02)
    return {"worker": worker_id(), "started": False, "error": "the supervisor did not start within 10 s"}


def supervise(state_dir: str) -> int:
    p = _paths(state_dir)
    run = _read_json(p["run"])
    env_vars, secret_keys = load_env_file(run.get("env_file", ""))
    redact = make_redactor([env_vars.get(k, "") for k in secret_keys])
    wid = worker_id()
    env = {**os.environ, **env_vars, "FLAXCHAT_WORKER_ID": str(wid), "JAX_PROCESS_ID": str(wid),
           "PYTHONUNBUFFERED": "1", PROGRESS_ENV: p["progress"], STACKS_ENV: p["dir"]}
    if "JAX_COORDINATOR_ADDRESS" not in env_vars:
        env.pop("JAX_PROCESS_ID")
    if run.get("venv"):  # what `source venv/bin/activate` does: `python` is the venv's
        env["VIRTUAL_ENV"] = run["venv"]
        env["PATH"] = os.path.join(run["venv"], "bin") + os.pathsep + env.get("PATH", "")
        env.pop("PYTHONHOME", None)
    log = open(p["log"], "a", buffering=1)
    try:
        child = subprocess.Popen(["bash", "-c", run["command"]], cwd=run["cwd"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 process_group=0, bufsize=1, text=True, errors="replace")
    except OSError as e:
        log.write(f"flaxchat: could not start the command: {e}\n")
        _write_json(p["exit"], {"exit_code": 127, "ended_at": time.time()})
        return 127
    run["child_pid"] = child.pid
    run["supervisor_pid"] = os.getpid()
    _write_json(p["run"], run)
    # The output is pumped beside the wait: a background process the command left behind can hold
    # the pipe open for ever, and the exit code must not wait for it longer than OUTPUT_DRAIN_S.
    pump = threading.Thread(target=lambda: [log.write(redact(line)) for line in child.stdout], daemon=True)
    pump.start()
    code = child.wait()
    code = code if code >= 0 else 128 - code  # killed by signal N -> 128+N, as a shell reports it
    pump.join(OUTPUT_DRAIN_S)
    _write_json(p["exit"], {"exit_code": code, "ended_at": time.time()})
    log.write(f"=== flaxchat run {run['run_id']} exited with code {code} ===\n")
    return code  # the log is left open: a pump still draining a leftover's output writes to it until exit


# SIGTERM first, then this long before SIGKILL: a flaxchat stage saves the step in flight on SIGTERM
# and exits 75 within its --preempt-grace (25 s), as it would on a cloud's preemption notice.
STOP_GRACE_S = 30.0


def stop(state_dir: str, grace: float = STOP_GRACE_S) -> dict:
    run = _read_json(_paths(state_dir)["run"]) or {}
    pid = run.get("child_pid")
    if not _pid_alive(pid):
        return {"worker": worker_id(), "stopped": False, "detail": "no run is going"}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(int(pid), sig)
            if sig == signal.SIGTERM:  # a stopped (SIGSTOP) process acts on TERM only once continued
                os.killpg(int(pid), signal.SIGCONT)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and _pid_alive(pid):
            time.sleep(0.05)
        if not _pid_alive(pid):
            break
    # The supervisor writes the exit code right after the command ends; until then status reads
    # "exiting" (still running to a caller). Give it a moment, so a stop is seen as done.
    deadline = time.time() + 5.0
    while (time.time() < deadline and _read_json(_paths(state_dir)["exit"]) is None
           and _supervising(run.get("supervisor_pid"))):
        time.sleep(0.05)
    return {"worker": worker_id(), "stopped": True, "pid": pid}


def where_stuck(stacks: str, step) -> str:
    """What a hang's stacks say it was doing: joining the job (jax.distributed.initialize, waiting
    for the coordinator or another process), starting up (before its first step: data, compile), or
    a training step."""
    if re.search(r'jax/_src/distributed\.py", line \d+ in initialize', stacks):
        return "the distributed start (jax.distributed.initialize)"
    return "start-up, before the first step" if step is None else f"the step after {step}"


def dump_stacks(state_dir: str, wait_s: float = STACKS_WAIT_S) -> dict:
    """Ask every stage process of the run for its Python stacks (SIGUSR1 to those listening) and
    write them, with where they were stuck, into hang-<time>.txt in the state folder (and into the
    stage's run folder when it is local). Before a hung run is killed: the stacks say where."""
    p = _paths(state_dir)
    run = _read_json(p["run"]) or {}
    progress = read_progress(p["progress"]) or {}
    listening = {}
    for path in glob.glob(os.path.join(p["dir"], "stacks-*.txt")):
        pid = int(os.path.basename(path)[len("stacks-"):-len(".txt")])
        if _pid_alive(pid) and _in_group(pid, run.get("child_pid")):  # never a reused pid
            listening[pid] = (path, os.path.getsize(path))
            os.kill(pid, signal.SIGUSR1)
    deadline = time.time() + wait_s
    while time.time() < deadline and any(os.path.getsize(path) == size for path, size in listening.values()):
        time.sleep(0.1)
    time.sleep(0.2)  # faulthandler writes a dump in one go from its signal handler: let the last one end
    texts = {}
    for pid, (path, size) in listening.items():
        with open(path, errors="replace") as f:
            f.seek(size)
            texts[pid] = f.read()
    stacks = "\n".join(f"--- process {pid} ---\n{t}" for pid, t in sorted(texts.items()) if t)
    where = where_stuck(stacks, progress.get("step"))
    when = time.strftime("%Y%m%d-%H%M%S")
    text = (f"flaxchat: run {run.get('run_id')} on worker {worker_id()} hung in {where}; last finished step "
            f"{progress.get('step')}; stacks taken {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n"
            + (stacks or "no process answered (none listening: not a flaxchat stage, or stuck outside Python)\n"))
    out = os.path.join(p["dir"], f"hang-{when}.txt")
    with open(out, "w") as f:
        f.write(text)
    copied = None
    run_dir = progress.get("run_dir") or ""
    if run_dir and "://" not in run_dir:
        run_dir = os.path.join(run.get("cwd", "."), os.path.expanduser(run_dir))
        if os.path.isdir(run_dir):
            copied = os.path.join(run_dir, f"hang-{when}-w{worker_id()}.txt")
            shutil.copyfile(out, copied)
    return {"worker": worker_id(), "stacks": out, "copied_to": copied, "where": where,
            "processes": sorted(pid for pid, t in texts.items() if t)}


def _in_group(pid: int, leader) -> bool:
    try:
        return leader is not None and os.getpgid(pid) == int(leader)
    except OSError:
        return False


def last_hang(state_dir: str):
    """The newest hang-<time>.txt of this state folder (a path), or None."""
    found = sorted(glob.glob(os.path.join(_paths(state_dir)["dir"], "hang-*.txt")))
    return found[-1] if found else None


# --- status / logs ---------------------------------------------------------------------------


def _tail(path: str, n: int, max_bytes: int = 256 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return []


def read_progress(path: str) -> dict | None:
    """The last record of a progress file (flaxchat.progress, schema 1), or None."""
    record = _read_json(path)
    return record if isinstance(record, dict) and record.get("schema") == PROGRESS_SCHEMA else None


def marker_exists(marker: str, cwd: str):
    """The completion marker on this worker's disk; None for a gs:// one (the launcher looks there,
    once, from outside: every worker asking the bucket on each poll would be N calls for one answer)."""
    if not marker or "://" in marker:
        return None
    return os.path.exists(os.path.join(cwd, os.path.expanduser(marker)))


def _supervising(pid) -> bool:
    """Is `pid` still a supervisor of ours? (A pid can be reused after a reboot, which keeps the disk.)"""
    if not _pid_alive(pid):
        return False
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return b"_supervise" in f.read()
    except OSError:
        return True  # no /proc to ask: alive is all we know


def _state(run: dict, ended) -> tuple[str, bool]:
    alive = _pid_alive(run.get("child_pid")) and ended is None
    if not alive and ended is None and run.get("child_pid") and _supervising(run.get("supervisor_pid")):
        # The command has exited and its supervisor is about to write the exit code: not killed.
        return "exiting", True
    state = "none" if not run else "running" if alive else "exited" if ended else "killed"
    if run and not alive and not ended and not run.get("child_pid"):
        state = "starting" if time.time() - run.get("started_at", 0) < STARTUP_GRACE_S else "killed"
        alive = state == "starting"
    return state, alive


def status(state_dir: str, marker: str = "") -> dict:
    p = _paths(state_dir)
    run = _read_json(p["run"]) or {}
    ended = _read_json(p["exit"])
    state, alive = _state(run, ended)
    lines = _tail(p["log"], 200)
    header = f"=== flaxchat run {run.get('run_id')} started"
    starts = [i for i, ln in enumerate(lines) if ln.startswith(header)]
    lines = [ln for ln in lines[starts[-1] + 1 if starts else 0:] if not ln.startswith("=== flaxchat run")]
    progress = read_progress(p["progress"]) or {}
    now = time.time()
    # Seconds since this process last finished a step (by this VM's clock); before its first step,
    # since the run started (start-up and the first compile count against the same deadline).
    since = progress.get("time") or run.get("started_at")
    where = p["dir"]
    while not os.path.exists(where):  # the disk the run writes to: the state folder's, or its parent's
        where = os.path.dirname(where)
    disk = shutil.disk_usage(where)
    cwd = run.get("cwd", os.getcwd())
    # The launcher's marker, else the one the stage itself named in its progress file (flaxchat.progress).
    marker = marker or run.get("marker", "") or progress.get("marker") or ""
    return {"worker": worker_id(), "run_id": run.get("run_id"), "state": state, "alive": alive,
            "pid": run.get("child_pid"), "exit_code": ended["exit_code"] if ended else None,
            "command": run.get("command"), "last_line": lines[-1] if lines else "",
            "step": progress.get("step"), "steps": progress.get("steps"), "loss": progress.get("loss"),
            "tok_s": progress.get("tok_s"), "stage": progress.get("stage"),
            "progress_age": max(0.0, now - since) if since else None,
            "first_step": progress.get("first_step"),
            "first_age": max(0.0, now - progress["first_time"]) if progress.get("first_time") else None,
            "disk_used_pct": round(100.0 * disk.used / disk.total, 1), "disk_free_gb": round(disk.free / 1e9, 1),
            "marker": marker or None, "complete": marker_exists(marker, cwd), "hang_file": last_hang(state_dir)}


def logs(state_dir: str, lines: int = 50, follow: bool = False, prefix: bool = False, poll: float = 0.25) -> None:
    p = _paths(state_dir)
    tag = f"[w{worker_id()}] " if prefix else ""
    for line in _tail(p["log"], lines):
        print(tag + line, flush=True)
    if not follow:
        return
    pos = os.path.getsize(p["log"]) if os.path.exists(p["log"]) else 0
    partial = ""
    while True:
        ended = os.path.exists(p["exit"]) or not _state(_read_json(p["run"]) or {}, _read_json(p["exit"]))[1]
        try:
            with open(p["log"], "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except OSError:
            chunk = b""
        pos += len(chunk)
        text = partial + chunk.decode("utf-8", "replace")
        *full, partial = text.split("\n")
        for line in full:
            print(tag + line, flush=True)
        if ended and not chunk:
            return
        time.sleep(poll)


# --- probe / checkpoints ---------------------------------------------------------------------


def probe(env_file: str, cwd: str) -> dict:
    """Which JAX devices this worker sees, after joining the job the env file describes."""
    env_vars, _ = load_env_file(env_file)
    os.environ.update(env_vars)
    os.chdir(os.path.expanduser(cwd))
    sys.path.insert(0, os.getcwd())
    import jax  # only here: status/logs/stop must work before JAX is installed

    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                                   worker_id(), initialization_timeout=120)
    return {"worker": worker_id(), "backend": jax.default_backend(), "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(), "process_count": jax.process_count(),
            "process_index": jax.process_index()}


def versions() -> dict:
    """What a finished setup left on this worker, run by its venv's python: the line `--setup`
    ends with. Read from the installed packages' metadata, so nothing heavy is imported."""
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return {"worker": worker_id(), "python": ".".join(map(str, sys.version_info[:3])), "jax": version("jax"),
            "jaxlib": version("jaxlib"), "flaxchat": version("flaxchat")}


def checkpoints(directory: str, cwd: str = ".") -> dict:
    """Orbax steps in a folder on this worker's disk: `complete` and `partial` (a save cut short).
    (A gs:// folder is listed by the launcher itself: it needs no VM.) On a local disk Orbax writes
    `<step>.orbax-checkpoint-tmp-*` and renames it; on GCS it writes `<step>` and marks it with
    commit_success.txt last; a step counts only with its marker."""
    root = os.path.join(os.path.expanduser(cwd), os.path.expanduser(directory))
    names = os.listdir(root) if os.path.isdir(root) else []
    complete, partial = [], []
    for name in names:
        if name.isdigit() and any(os.path.exists(os.path.join(root, name, f))
                                  for f in ("_CHECKPOINT_METADATA", "commit_success.txt")):
            complete.append(int(name))
        elif name.split(".")[0].isdigit():
            partial.append(name)
    return {"worker": worker_id(), "complete": sorted(complete), "partial": sorted(partial)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="worker.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=["start", "_supervise", "status", "stop", "dump", "logs", "probe", "checkpoints",
                                     "versions"])
    ap.add_argument("--dir", default="", help="checkpoints: the checkpoint folder")
    ap.add_argument("--state-dir", default=os.environ.get("FLAXCHAT_WORKER_STATE", DEFAULT_STATE))
    ap.add_argument("--run-id", default="run")
    ap.add_argument("--env-file", default="")
    ap.add_argument("--cwd", default=".")
    ap.add_argument("--marker", default="")
    ap.add_argument("--venv", default="", help="start: the setup's venv, first on the command's PATH")
    ap.add_argument("--replace", action="store_true", help="stop a run that is still going first")
    ap.add_argument("--lines", type=int, default=50)
    ap.add_argument("--follow", action="store_true")
    ap.add_argument("--prefix", action="store_true", help="prefix each line with [wN]")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # everything after "--" is the command
    args = ap.parse_args(argv[:split])
    words = argv[split + 1:]
    command = words[0] if len(words) == 1 else shlex.join(words)
    if args.verb == "_supervise":
        return supervise(args.state_dir)
    if args.verb == "logs":
        logs(args.state_dir, args.lines, args.follow, args.prefix)
        return 0
    if args.verb == "start":
        out = start(args.state_dir, args.run_id, command, args.env_file, args.cwd, args.marker, args.replace,
                    args.venv)
    elif args.verb == "status":
        out = status(args.state_dir, args.marker)
    elif args.verb == "stop":
        out = stop(args.state_dir)
    elif args.verb == "dump":
        out = dump_stacks(args.state_dir)
    elif args.verb == "probe":
        out = probe(args.env_file, args.cwd)
    elif args.verb == "versions":
        out = versions()
    else:
        out = checkpoints(args.dir, args.cwd)
    print("FLAXCHAT " + json.dumps(out), flush=True)
    return 0 if out.get("started", True) else 3


if __name__ == "__main__":
    sys.exit(main())

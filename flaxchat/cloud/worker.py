"""What runs on each worker: start a command detached, and answer status / logs / stop for it.

    python3 flaxchat/cloud/worker.py start --run-id ID --env-file F --cwd DIR [--replace] -- CMD
    python3 flaxchat/cloud/worker.py status [--marker PATH]      # one JSON line
    python3 flaxchat/cloud/worker.py logs [--follow] [--prefix] [--lines N]
    python3 flaxchat/cloud/worker.py stop
    python3 flaxchat/cloud/worker.py probe --env-file F --cwd DIR   # JAX devices, one JSON line
    python3 flaxchat/cloud/worker.py checkpoints --dir D --cwd DIR  # complete / partial Orbax steps

Standard library only and run by path, so it works on a fresh VM before anything is installed, and
by the LocalRunner on this machine. `start` hands the command to a supervisor in its own session
(so an ssh disconnect or Ctrl-C never reaches it), which reads the env file (coordinator address,
process count, user env and secrets: never on a command line), adds this worker's process id, runs
the command in its own process group, and writes into the state folder (default ~/.flaxchat/run):

    run.json     run id, command, pids, start time
    output.log   stdout+stderr, secrets replaced by ***
    heartbeat    its mtime is the time of the last output line (a silent worker is a hung one)
    exit_code    written when the command ends; absent after a SIGKILL (preemption, OOM killer)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

DEFAULT_STATE = os.path.join("~", ".flaxchat", "run")
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"  # a stale one makes the TPU look busy to the next run
METADATA_WORKER_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
                       "agent-worker-number")

# nanochat-style progress line: "step 00010/00100 | loss 3.2104 | ... | tok/s 12,345 | ..."
STEP_RE = re.compile(r"step\s+(\d+)(?:\s*/\s*(\d+))?.*?\bloss\s+([-+0-9.eE]+|nan|inf)", re.IGNORECASE)
TOKS_RE = re.compile(r"tok/s\s+([\d,]+(?:\.\d+)?)")


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
            [("dir", ""), ("run", "run.json"), ("log", "output.log"), ("hb", "heartbeat"), ("exit", "exit_code")]}


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


def start(state_dir: str, run_id: str, command: str, env_file: str = "", cwd: str = ".",
          marker: str = "", replace: bool = False) -> dict:
    p = _paths(state_dir)
    current = status(state_dir)
    if current["alive"]:
        if not replace:
            return {"worker": worker_id(), "started": False,
                    "error": f"a run is already going (run {current['run_id']}, pid {current['pid']})"}
        stop(state_dir)
    if replace and os.path.exists(LIBTPU_LOCKFILE):
        os.remove(LIBTPU_LOCKFILE)
    os.makedirs(p["dir"], exist_ok=True)
    for key in ("exit", "hb"):
        if os.path.exists(p[key]):
            os.remove(p[key])
    with open(p["log"], "a") as f:
        f.write(f"=== flaxchat run {run_id} started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
    _write_json(p["run"], {"run_id": run_id, "command": command, "env_file": os.path.abspath(os.path.expanduser(env_file)) if env_file else "",
                           "cwd": os.path.abspath(os.path.expanduser(cwd)), "marker": marker,
                           "started_at": time.time(), "child_pid": None})
    open(p["hb"], "w").close()
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "_supervise", "--state-dir", state_dir],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)
    deadline = time.time() + 10
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
           "PYTHONUNBUFFERED": "1"}
    if "JAX_COORDINATOR_ADDRESS" not in env_vars:
        env.pop("JAX_PROCESS_ID")
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
    for line in child.stdout:
        log.write(redact(line))
        os.utime(p["hb"])
    code = child.wait()
    code = code if code >= 0 else 128 - code  # killed by signal N -> 128+N, as a shell reports it
    _write_json(p["exit"], {"exit_code": code, "ended_at": time.time()})
    log.write(f"=== flaxchat run {run['run_id']} exited with code {code} ===\n")
    log.close()
    return code


def stop(state_dir: str, grace: float = 10.0) -> dict:
    run = _read_json(_paths(state_dir)["run"]) or {}
    pid = run.get("child_pid")
    if not _pid_alive(pid):
        return {"worker": worker_id(), "stopped": False, "detail": "no run is going"}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(int(pid), sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and _pid_alive(pid):
            time.sleep(0.05)
        if not _pid_alive(pid):
            break
    return {"worker": worker_id(), "stopped": True, "pid": pid}


# --- status / logs ---------------------------------------------------------------------------


def _tail(path: str, n: int, max_bytes: int = 256 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return []


def parse_progress(lines) -> dict:
    """step / steps / loss / tok/s from the last progress line among `lines`."""
    for line in reversed(list(lines)):
        m = STEP_RE.search(line)
        if m:
            toks = TOKS_RE.search(line)
            return {"step": int(m.group(1)), "steps": int(m.group(2)) if m.group(2) else None,
                    "loss": float(m.group(3)), "tok_s": float(toks.group(1).replace(",", "")) if toks else None}
    return {"step": None, "steps": None, "loss": None, "tok_s": None}


def marker_exists(marker: str, cwd: str):
    if not marker:
        return None
    if marker.startswith("gs://"):
        try:
            return subprocess.run(["gcloud", "storage", "ls", marker], capture_output=True, timeout=60).returncode == 0
        except Exception:
            return None
    return os.path.exists(os.path.join(cwd, os.path.expanduser(marker)))


def status(state_dir: str, marker: str = "") -> dict:
    p = _paths(state_dir)
    run = _read_json(p["run"]) or {}
    ended = _read_json(p["exit"])
    alive = _pid_alive(run.get("child_pid")) and ended is None
    state = "none" if not run else "running" if alive else "exited" if ended else "killed"
    if run and not alive and not ended and not run.get("child_pid"):
        state = "starting" if time.time() - run.get("started_at", 0) < 10 else "killed"
        alive = state == "starting"
    lines = _tail(p["log"], 200)
    header = f"=== flaxchat run {run.get('run_id')} started"
    starts = [i for i, ln in enumerate(lines) if ln.startswith(header)]
    lines = [ln for ln in lines[starts[-1] + 1 if starts else 0:] if not ln.startswith("=== flaxchat run")]
    try:
        hb_age = max(0.0, time.time() - os.path.getmtime(p["hb"]))
    except OSError:
        hb_age = None
    where = p["dir"]
    while not os.path.exists(where):  # the disk the run writes to: the state folder's, or its parent's
        where = os.path.dirname(where)
    disk = shutil.disk_usage(where)
    cwd = run.get("cwd", os.getcwd())
    return {"worker": worker_id(), "run_id": run.get("run_id"), "state": state, "alive": alive,
            "pid": run.get("child_pid"), "exit_code": ended["exit_code"] if ended else None,
            "command": run.get("command"), "last_line": lines[-1] if lines else "",
            **parse_progress(lines), "heartbeat_age": hb_age,
            "disk_used_pct": round(100.0 * disk.used / disk.total, 1), "disk_free_gb": round(disk.free / 1e9, 1),
            "complete": marker_exists(marker or run.get("marker", ""), cwd)}


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
        ended = os.path.exists(p["exit"]) or not status(state_dir)["alive"]
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


def checkpoints(directory: str, cwd: str = ".") -> dict:
    """Orbax steps under `directory`: `complete` (finalized) and `partial` (a save cut short)."""
    complete, partial = [], []
    if directory.startswith("gs://"):
        out = subprocess.run(["gcloud", "storage", "ls", directory.rstrip("/") + "/"], capture_output=True, text=True)
        names = [ln.rstrip("/").rsplit("/", 1)[-1] for ln in out.stdout.splitlines()]
        is_final = lambda name: True  # on GCS Orbax only writes the final name after commit
    else:
        root = os.path.join(os.path.expanduser(cwd), os.path.expanduser(directory))
        names = os.listdir(root) if os.path.isdir(root) else []
        is_final = lambda name: any(os.path.exists(os.path.join(root, name, f))
                                    for f in ("_CHECKPOINT_METADATA", "commit_success.txt"))
    for name in names:
        if name.isdigit() and is_final(name):
            complete.append(int(name))
        elif name.split(".")[0].isdigit():  # "<step>.orbax-checkpoint-tmp-*", or a step never committed
            partial.append(name)
    return {"worker": worker_id(), "complete": sorted(complete), "partial": sorted(partial)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="worker.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=["start", "_supervise", "status", "stop", "logs", "probe", "checkpoints"])
    ap.add_argument("--dir", default="", help="checkpoints: the checkpoint folder")
    ap.add_argument("--state-dir", default=os.environ.get("FLAXCHAT_WORKER_STATE", DEFAULT_STATE))
    ap.add_argument("--run-id", default="run")
    ap.add_argument("--env-file", default="")
    ap.add_argument("--cwd", default=".")
    ap.add_argument("--marker", default="")
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
        out = start(args.state_dir, args.run_id, command, args.env_file, args.cwd, args.marker, args.replace)
    elif args.verb == "status":
        out = status(args.state_dir, args.marker)
    elif args.verb == "stop":
        out = stop(args.state_dir)
    elif args.verb == "probe":
        out = probe(args.env_file, args.cwd)
    else:
        out = checkpoints(args.dir, args.cwd)
    print("FLAXCHAT " + json.dumps(out), flush=True)
    return 0 if out.get("started", True) else 3


if __name__ == "__main__":
    sys.exit(main())

"""The gcloud commands the launcher uses, built as plain data, and the one executor that runs them.

Every builder is a pure function that returns an argv list (`["gcloud", "compute", ...]`) or, for
what runs on the workers, one shell string. Nothing here looks at the network or the clock, so the
tests check the builders on their output, and the executor against the local emulator
(`flaxchat.cloud.rehearsal.emulator`), which answers the same commands with real processes.

Secrets never go into any of these: they travel in an env file (see `worker_env`) that is copied
with `scp` and read by `flaxchat/runner/worker.py` on each worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
from typing import Callable, Mapping, Sequence

from flaxchat.errors import UserError
from flaxchat.runner.base import RemoteError, RemoteTimeout

INSTALL_HINT = (
    "the gcloud CLI was not found on PATH; install the Google Cloud SDK "
    "(https://cloud.google.com/sdk/docs/install), run `gcloud auth login`, "
    "or rehearse on this machine with --backend=local."
)

# Where things live on a worker VM, relative to the ssh login folder (the user's home there).
REMOTE_REPO = "flaxchat"
REMOTE_STATE = ".flaxchat"
REMOTE_ENV_FILE = f"{REMOTE_STATE}/run.env"
REMOTE_TARBALL = "flaxchat-src.tar.gz"
# Google's TPU images ship Python 3.10 (v4 tpu-ubuntu2204-base, v5e/v6e v2-alpha-*); flaxchat needs
# >= 3.11, so setup makes a venv of its own (uv, a pinned Python) and every run goes through it.
REMOTE_VENV = f"{REMOTE_STATE}/venv"
REMOTE_BOOTSTRAP = f"{REMOTE_STATE}/bootstrap"  # where uv is pip-installed when the image has none
REMOTE_PYTHON = f"{REMOTE_STATE}/python"  # where uv puts the Python it fetches (packed with the venv)
PYTHON_VERSION = "3.11"
WORKER_PY = f"{REMOTE_REPO}/flaxchat/runner/worker.py"
COORDINATOR_PORT = 8476  # the port JAX's own TPU examples use for the coordinator


# --- gcloud argv builders --------------------------------------------------------------------


def _where(project: str, zone: str) -> list[str]:
    return [f"--project={project}", f"--zone={zone}"]


def tpu_create(project: str, zone: str, name: str, accelerator: str, version: str,
               preemptible: bool = False, spot: bool = False) -> list[str]:
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "create", name, *_where(project, zone),
            f"--accelerator-type={accelerator}", f"--version={version}"]
    if spot:
        argv.append("--spot")
    elif preemptible:
        argv.append("--preemptible")
    return argv


def tpu_describe(project: str, zone: str, name: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", name, *_where(project, zone), "--format=json"]


def tpu_delete(project: str, zone: str, name: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "delete", name, *_where(project, zone), "--quiet"]


# --quiet on ssh/scp: gcloud would otherwise stop to ask for an ssh key passphrase on first use.
def tpu_ssh(project: str, zone: str, name: str, command: str, worker: int | str = "all") -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, *_where(project, zone),
            f"--worker={worker}", "--quiet", f"--command={command}"]


def tpu_scp_to(project: str, zone: str, name: str, local: str, remote: str,
               worker: int | str = "all", recurse: bool = False) -> list[str]:
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{name}:{remote}",
            *_where(project, zone), f"--worker={worker}", "--quiet"]
    return argv + (["--recurse"] if recurse else [])


def tpu_scp_from(project: str, zone: str, name: str, remote: str, local: str,
                 worker: int = 0, recurse: bool = False) -> list[str]:
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "scp", f"{name}:{remote}", local,
            *_where(project, zone), f"--worker={worker}", "--quiet"]
    return argv + (["--recurse"] if recurse else [])


def qr_create(project: str, zone: str, qr_name: str, node_name: str, accelerator: str,
              version: str, spot: bool = True) -> list[str]:
    """A queued resource: Google's way to ask for spot capacity and get it when it frees up."""
    argv = ["gcloud", "compute", "tpus", "queued-resources", "create", qr_name, *_where(project, zone),
            f"--accelerator-type={accelerator}", f"--runtime-version={version}", f"--node-id={node_name}"]
    return argv + (["--spot"] if spot else [])


def qr_describe(project: str, zone: str, qr_name: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", qr_name,
            *_where(project, zone), "--format=json"]


def qr_delete(project: str, zone: str, qr_name: str) -> list[str]:
    # --force also deletes the TPU VM the queued resource holds; --quiet skips the prompt.
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", qr_name,
            *_where(project, zone), "--force", "--quiet"]


def storage_ls(*urls: str) -> list[str]:
    return ["gcloud", "storage", "ls", *urls]


def storage_cp(src: str, dest: str) -> list[str]:
    return ["gcloud", "storage", "cp", "--recursive", src, dest]


def format_command(argv: Sequence[str]) -> str:
    """The argv as a copy-pasteable shell line (what --dry-run prints)."""
    return shlex.join(argv)


# --- shell commands that run on the workers (passed as ssh --command) ----------------------------


def _worker_py(*args: str) -> str:
    # The image's python3 (3.10 is fine: worker.py is standard library only); -S skips site-packages.
    return shlex.join(["python3", "-S", WORKER_PY, *args])


def ssh_check_command() -> str:
    """Answers at once on every worker that accepts ssh (a new VM is READY before its sshd is)."""
    return "true"


def unpack_command() -> str:
    """Unpack the uploaded tarball over ~/flaxchat (run outputs elsewhere are never touched)."""
    return (f"mkdir -p {REMOTE_REPO} {REMOTE_STATE} && tar -xzf {REMOTE_TARBALL} -C {REMOTE_REPO} "
            f"&& rm -f {REMOTE_TARBALL}")


def setup_marker_command() -> str:
    """Print each worker's setup marker (the content hash of its last completed setup), or nothing."""
    return f"cat {REMOTE_STATE}/setup.done 2>/dev/null; true"


def default_install(extras: Sequence[str] = ("tpu",)) -> str:
    """A venv with a pinned Python (uv fetches one if the image has none) and the project in it,
    with its extras (`tpu`: jax[tpu] at the pinned jax; `gcs`: gcsfs, for a gs:// run folder)."""
    spec = f".[{','.join(extras)}]" if extras else "."
    return (f'"$UV" venv --python {PYTHON_VERSION} --allow-existing "$FLAXCHAT_VENV" && '
            f'"$UV" pip install --python "$FLAXCHAT_VENV/bin/python" -e {shlex.quote(spec)}')


def env_key(pyproject_text: str, install: str) -> str:
    """What a worker's environment is built from: pyproject.toml's pins (dependencies, extras,
    requires-python), the install command and the pinned Python, hashed. The same key on a new VM means
    the packed environment in the bucket is the one its install would build again."""
    import tomllib
    project = tomllib.loads(pyproject_text).get("project", {})
    pins = {k: project.get(k) for k in ("requires-python", "dependencies", "optional-dependencies")}
    blob = json.dumps({"pins": pins, "install": install, "python": PYTHON_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def env_pack_url(run_dir: str, key: str) -> str:
    """Where a run keeps its workers' packed environment (the worker adds its platform and .tar.gz)."""
    return f"{run_dir.rstrip('/')}/.flaxchat/env/{key}"


def _pack_path(pack_url: str) -> str:
    return f'PACK="{pack_url}-$(uname -sm | tr " " -).tar.gz"'


def _env_from_bucket(pack_url: str, check: str) -> list[str]:
    """The shell that unpacks the environment from the bucket into $HOME/.flaxchat (venv and, when uv
    fetched one, the Python under it) and reinstalls the uploaded project over it (seconds: no deps);
    it sets FROM_BUCKET only when the result passes the same check as a fresh install."""
    tmp = f"$HOME/{REMOTE_STATE}/env.tar.gz"
    return [
        _pack_path(pack_url),
        "FROM_BUCKET=",
        f'if gcloud storage cp "$PACK" "{tmp}" >/dev/null 2>&1 && rm -rf "$FLAXCHAT_VENV" '
        f'&& tar -xzf "{tmp}" -C "$HOME" '
        f'&& (cd {REMOTE_REPO} && "$UV" pip install -q --python "$FLAXCHAT_VENV/bin/python" --no-deps -e .) '
        f'&& (cd / && "$FLAXCHAT_VENV/bin/python" -c {shlex.quote(check)}); then',
        '  FROM_BUCKET=1',
        '  echo "flaxchat: the environment came from $PACK (built from the same pins)"',
        "fi",
        f'rm -f "{tmp}"',
    ]


def pack_env_command(pack_url: str) -> str:
    """Run on one worker after setup: pack its environment into the bucket unless it is there already
    (one upload per run folder and lock, not one per worker)."""
    tmp = f"$HOME/{REMOTE_STATE}/env.tar.gz"
    return "\n".join([
        _pack_path(pack_url),
        'if gcloud storage ls "$PACK" >/dev/null 2>&1; then exit 0; fi',
        f'PARTS="{REMOTE_VENV}"; if [ -d "$HOME/{REMOTE_PYTHON}" ]; then PARTS="$PARTS {REMOTE_PYTHON}"; fi',
        f'if tar -czf "{tmp}" -C "$HOME" $PARTS && gcloud storage cp "{tmp}" "$PACK" >/dev/null; then',
        '  echo "flaxchat: packed the environment into $PACK for the next VM"',
        "else",
        '  echo "flaxchat: could not pack the environment into $PACK; a recreated VM will install again"',
        "fi",
        f'rm -f "{tmp}"',
    ])


def install_command(content_hash: str, install: str, env_url: str = "") -> str:
    """Set up one worker: uv (pip-installed into ~/.flaxchat/bootstrap if the image has none), then
    `install` in the repo folder with $UV and $FLAXCHAT_VENV set, then a check that the venv's python
    is >= 3.11 and imports flaxchat; only then the hash is recorded (a later setup of the same tree
    is skipped; a half-finished one is not recorded, so it runs again). `env_url` (env_pack_url): the
    environment is unpacked from there when it is there and passes the check, instead of installed
    (pack_env_command puts it there)."""
    # Run from / so that ~/flaxchat (the repo folder) is not taken for the package.
    check = "import sys, flaxchat; sys.exit(0 if sys.version_info >= (3, 11) and flaxchat.__file__ else 3)"
    install_line = f"(cd {REMOTE_REPO} && {install})"
    if env_url:
        install_line = f'if [ -z "$FROM_BUCKET" ]; then {install_line}; fi'
    return "\n".join([
        "set -e",
        f"mkdir -p {REMOTE_STATE}",
        f"rm -f {REMOTE_STATE}/setup.done",
        f'export FLAXCHAT_VENV="$HOME/{REMOTE_VENV}"',
        # A Python that uv fetches lies under ~/.flaxchat, so that it is packed with the venv that uses it.
        f'export UV_PYTHON_INSTALL_DIR="$HOME/{REMOTE_PYTHON}"',
        'UV="$(command -v uv || true)"',
        'if [ -z "$UV" ]; then',
        f'  UV="$HOME/{REMOTE_BOOTSTRAP}/bin/uv"',
        '  if [ ! -x "$UV" ]; then',
        f'    echo "flaxchat: this image has no uv; installing it into ~/{REMOTE_BOOTSTRAP}"',
        f'    python3 -m pip install -q --target "$HOME/{REMOTE_BOOTSTRAP}" uv',
        "  fi",
        "fi",
        "export UV",
        *(_env_from_bucket(env_url, check) if env_url else []),
        install_line,
        f'if ! (cd / && "$FLAXCHAT_VENV/bin/python" -c {shlex.quote(check)}); then',
        f'  echo "flaxchat: the install left no Python >= {PYTHON_VERSION} that imports flaxchat in '
        f'~/{REMOTE_VENV}" >&2',
        "  exit 3",
        "fi",
        f"echo {shlex.quote(content_hash)} > {REMOTE_STATE}/setup.done",
    ])


def start_command(run_id: str, command: str, marker: str | None = None) -> str:
    """Start `command` detached under worker.py (pid, log, progress, exit code; env from the file),
    with the setup's venv first on its PATH."""
    args = ["start", "--run-id", run_id, "--env-file", REMOTE_ENV_FILE, "--cwd", REMOTE_REPO, "--replace",
            "--venv", REMOTE_VENV]
    if marker:
        args += ["--marker", marker]
    return f"chmod 600 {REMOTE_ENV_FILE} && " + _worker_py(*args, "--", command)


def status_command(marker: str | None = None) -> str:
    return _worker_py("status", *(["--marker", marker] if marker else []))


def stop_command() -> str:
    return _worker_py("stop")


def dump_stacks_command() -> str:
    return _worker_py("dump")


def logs_command(follow: bool = False, lines: int = 50, prefix: bool = False) -> str:
    return _worker_py("logs", "--lines", str(lines), *(["--follow"] if follow else []),
                      *(["--prefix"] if prefix else []))


def probe_command() -> str:
    """What JAX sees: through the venv's python (the image's own has no JAX)."""
    return shlex.join([f"{REMOTE_VENV}/bin/python", WORKER_PY, "probe", "--env-file", REMOTE_ENV_FILE,
                       "--cwd", REMOTE_REPO])


def versions_command() -> str:
    """Python, jax and flaxchat as the setup's venv sees them, one JSON line per worker."""
    return shlex.join([f"{REMOTE_VENV}/bin/python", WORKER_PY, "versions"])


def checkpoints_command(checkpoint_dir: str) -> str:
    return _worker_py("checkpoints", "--dir", checkpoint_dir, "--cwd", REMOTE_REPO)


def worker_env(coordinator_ip: str, num_processes: int, env: Mapping[str, str] | None = None,
               secrets: Mapping[str, str] | None = None, port: int = COORDINATOR_PORT) -> dict:
    """The env file every worker gets: the same on each; worker.py adds that worker's process id.

    Secret names are listed so that worker.py redacts their values from the log.
    """
    merged = {**(env or {}), **(secrets or {})}
    merged.update({
        "JAX_COORDINATOR_ADDRESS": f"{coordinator_ip}:{port}",
        "JAX_NUM_PROCESSES": str(num_processes),
    })
    return {"env": merged, "secret_keys": sorted(secrets or {})}


# --- the upload and what the workers print ------------------------------------------------------------


def make_tarball(root: str, dest: str, files: list[str], extra: str = "") -> str:
    """Pack `files` of the repo into dest; return a hash of the contents (+ extra) that ignores mtimes."""
    h = hashlib.sha256(extra.encode())
    with tarfile.open(dest, "w:gz") as tar:
        for rel in files:
            path = os.path.join(root, rel)
            with open(path, "rb") as f:
                h.update(rel.encode() + b"\0" + f.read())
            tar.add(path, arcname=rel)
    return h.hexdigest()[:16]


def parse_worker_lines(stdout: str) -> dict[int, dict]:
    """worker.py's `FLAXCHAT {json}` lines from a --worker=all ssh, by worker id."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("FLAXCHAT {"):
            try:
                obj = json.loads(line[len("FLAXCHAT "):])
            except ValueError:
                continue
            found[int(obj.get("worker", 0))] = obj
    return found



# --- the executor ---------------------------------------------------------------------------------


@dataclasses.dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str = ""
    stderr: str = ""


class GcloudError(RemoteError):
    """gcloud said no (quota, permission, zone, not found); the message is gcloud's own, in one line."""

    def __init__(self, message: str, returncode: int = 1, stderr: str = ""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


def one_line(stderr: str, limit: int = 400) -> str:
    """gcloud's own error message on one line: from its first `ERROR:` line on, whitespace collapsed."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("ERROR:")), max(0, len(lines) - 3))
    text = " ".join(" ".join(lines[start:]).split())
    if text.startswith("ERROR: "):  # callers print "error: ..." already
        text = "gcloud said: " + text[len("ERROR: "):]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_not_found(err: GcloudError) -> bool:
    return "NOT_FOUND" in str(err) or "was not found" in str(err)


# How Google words "no TPUs to give right now": a stockout (code 8 / RESOURCE_EXHAUSTED), a quota
# that is used up, or a spot request it cannot place. Worth retrying, later or in another zone.
CAPACITY_PATTERNS = ("no more capacity", "resource_exhausted", "quota limit", "quota exceeded",
                     "insufficient capacity", "does not have enough resources", "stockout",
                     "currently unavailable", "not enough resources")


def is_capacity_error(err: Exception) -> bool:
    text = str(err).lower() + " " + str(getattr(err, "stderr", "")).lower()
    return any(p in text for p in CAPACITY_PATTERNS)


def is_unavailable_in_zone(err: Exception) -> bool:
    """The zone does not offer this accelerator at all (not a stockout: retrying there is pointless)."""
    text = str(err)
    return "not available in zone" in text or ("NOT_FOUND" in text and "ccelerator" in text)


def qr_state(desc: dict) -> tuple[str, str]:
    """A queued resource's state (ACCEPTED, PROVISIONING, ACTIVE, FAILED, SUSPENDED, ...) and Google's
    message for a FAILED one (`state.failedData.error.message`)."""
    st = desc.get("state") or {}
    if isinstance(st, str):
        return st, ""
    error = ((st.get("failedData") or {}).get("error") or {})
    return st.get("state", "STATE_UNSPECIFIED"), error.get("message", "")


Redactor = Callable[[str], str]


class GcloudExecutor:
    """Runs gcloud argv lists. The only place in the launcher that starts a process.

    `env` replaces the environment (the local backend puts the emulator first on PATH), `record`
    gets every command line as run (tests check it for secrets), `redact` cleans what is printed.
    """

    def __init__(self, env: Mapping[str, str] | None = None, record: Callable[[str], None] | None = None,
                 redact: Redactor | None = None, echo: Callable[[str], None] | None = None):
        self.env = dict(env) if env is not None else None
        self.record = record
        self.redact = redact or (lambda s: s)
        self.echo = echo

    def _start(self, argv: Sequence[str]) -> None:
        line = self.redact(format_command(argv))
        if self.record:
            self.record(line)
        if self.echo:
            self.echo(line)

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float | None = None) -> CommandResult:
        self._start(argv)
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                  env=self.env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise UserError(INSTALL_HINT) from None
        except subprocess.TimeoutExpired:
            raise RemoteTimeout(f"`{' '.join(argv[:5])} ...` did not answer within {timeout:.0f} s.") from None
        result = CommandResult(list(argv), proc.returncode, self.redact(proc.stdout), self.redact(proc.stderr))
        if check and proc.returncode != 0:
            raise GcloudError(one_line(result.stderr) or f"gcloud exited with code {proc.returncode}.",
                              proc.returncode, result.stderr)
        return result

    def stream(self, argv: Sequence[str], on_line: Callable[[str], None]) -> int:
        """Run and hand each output line to `on_line` as it comes; Ctrl-C stops only this command."""
        self._start(argv)
        try:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=self.env, stdin=subprocess.DEVNULL, bufsize=1)
        except FileNotFoundError:
            raise UserError(INSTALL_HINT) from None
        try:
            for line in proc.stdout:
                on_line(self.redact(line.rstrip("\n")))
            return proc.wait()
        finally:
            if proc.poll() is None:  # KeyboardInterrupt: end the local ssh, the remote run goes on
                proc.terminate()
                proc.wait()


class DryRunExecutor(GcloudExecutor):
    """Prints each command instead of running it; `answer(argv)` supplies plausible output."""

    def __init__(self, answer: Callable[[Sequence[str]], str] = lambda argv: "",
                 out: Callable[[str], None] | None = None):
        super().__init__(echo=out or (lambda s: print(s, file=sys.stdout, flush=True)))
        self.answer = answer

    def run(self, argv, *, check=True, timeout=None) -> CommandResult:
        self._start(argv)
        return CommandResult(list(argv), 0, self.answer(argv), "")

    def stream(self, argv, on_line) -> int:
        self._start(argv)
        return 0


def default_env_with_path(prefix_dir: str, extra: Mapping[str, str] | None = None) -> dict:
    """This process's environment with `prefix_dir` first on PATH (used to point at the emulator)."""
    env = dict(os.environ)
    env["PATH"] = prefix_dir + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env

"""KaggleRunner: train flaxchat on a Kaggle notebook's accelerators from your own machine.

    from flaxchat.remote import KaggleRunner
    runner = KaggleRunner("https://kkb-production.jupyter-proxy.kaggle.net/k/.../proxy")
    runner.setup()                             # upload this repo, install it next to the notebook's GPU JAX
    runner.check_devices()                     # {'backend': 'gpu', 'device_count': 2, ...}
    runner.run("print(1 + 1)")                 # Python on the kernel, output streamed back
    runner.run_pipeline(depth=8, steps=5000)   # training starts detached on the kernel's machine
    runner.wait()                              # follow its log until it exits (no kernel needed)
    runner.download(local_path="run")          # fetch the run folder (checkpoint, log)

    # A run longer than a session: the run folder in a bucket, the key as a secret; the same call
    # in the next session resumes from the last committed step.
    runner.run_pipeline(depth=20, steps=40000, run_dir="gs://my-bucket/d20", gcs_key="key.json")

Any Jupyter server works (the tests use a local one, with a second client playing the notebook's
tab). The kernel is shared with that tab, so the runner uses it as little as possible: to install,
to probe the devices, to start a job and to run your code. A job runs under the pods' supervisor
(`flaxchat/runner/worker.py`, run by path) with a watcher next to it (`kernel_side.py`); its log, exit
code and progress are followed, and a stop is requested, through the server's file API, so a busy
notebook cell never delays them and is never interrupted by them. Files live under `flaxchat_remote/`
in the server's root folder (`/kaggle/working` on Kaggle): `src/` (the uploaded repo), `setup.json`,
`bin/` (the two scripts), `cells/` (each run's output and outcome, see cells.py),
`runs/<name>/` (the run folder; `job/` in it holds the supervisor's files; with a gs:// run folder
only `job/` is there, the run itself is in the bucket).

Command line: `python -m flaxchat.remote.kaggle URL --run CODE | --pipeline | --wait | --download`
(see --help and docs/kaggle.md).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from flaxchat import uploads
from flaxchat.runner import worker as worker_module
from flaxchat.errors import UserError
from flaxchat.remote import kernel_side
from flaxchat.runner.base import OutputCallback, RemoteError, RemoteRunner, RunResult, RunStatus
from flaxchat.remote.cells import CellFiles, Follow, execute, kernel_call, print_output, reattach
from flaxchat.remote.jupyter import JupyterREST, KernelConnection, parse_server_url
from flaxchat.remote.kaggle_jobs import Job, JobFollower

TOKEN_ENV = "KAGGLE_JUPYTER_TOKEN"

# --------------------------------------------------------------------------------------------
# Pure helpers: what to upload, what to run


def upload_selection(path: str | os.PathLike, untracked: bool = False) -> tuple[list[str], list[str]]:
    """(files to upload, secret-looking files left behind): the one selection of flaxchat.uploads."""
    return uploads.repo_files(path, untracked=untracked), uploads.skipped_secrets(path, untracked=True)


def build_archive(root: str | os.PathLike, files: Sequence[str]) -> tuple[bytes, str]:
    """A .tar.gz of `files` and a digest of their names and contents (not their times), so an
    unchanged repo is recognised. Real mtimes go in the archive: Python's .pyc cache trusts them."""
    root, digest, buf = Path(root), hashlib.sha256(), io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name in files:
            path = root / name
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), digest.hexdigest()


def pipeline_argv(depth: int, steps: int, run_dir: str, flags: Mapping[str, Any]) -> list[str]:
    """Arguments for the kernel's Python: `-m scripts.run_tinystories --depth=.. --steps=.. ...`.
    Flags are written --kebab-case=value; True gives --flag, False --no-flag, None is left out."""
    argv = ["-m", "scripts.run_tinystories", f"--depth={depth}", f"--steps={steps}", f"--run-dir={run_dir}"]
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if value is True:
            argv.append(f"--{flag}")
        elif value is False:
            argv.append(f"--no-{flag}")
        elif value is not None:
            argv.append(f"--{flag}={value}")
    return argv


def _discard(stream: str, text: str) -> None:
    pass


# --------------------------------------------------------------------------------------------
# The runner


class KaggleRunner(RemoteRunner):
    """Runs flaxchat on the kernel of a Jupyter server (a Kaggle notebook, or any other).

    url: the server base (Kaggle's proxy URL ending in /proxy), http(s) or ws(s), or a copied
      `…/api/kernels/<id>/channels` URL; token: optional (else `?token=` in the URL, else the
      KAGGLE_JUPYTER_TOKEN variable). The kernel is the URL's, `kernel_id`'s, a new one
      (`new_kernel=True`), or else the most recently active one, started if none runs.
    protocol: 'auto' (v1 binary framing when the server offers it, else legacy JSON), 'v1', 'legacy'.
    reconnect_window: seconds to keep reconnecting a dropped socket when a call has no timeout of its
      own; ping_after / pong_timeout: a silent socket is pinged, one that does not answer is replaced.
    Nothing touches the network until the first call.
    """

    def __init__(self, url: str, token: str | None = None, *, kernel_id: str | None = None,
                 kernel_name: str | None = None, new_kernel: bool = False, protocol: str = "auto",
                 workdir: str = "flaxchat_remote", request_timeout: float = 30.0, reconnect_window: float = 300.0,
                 ping_after: float = 20.0, pong_timeout: float = 15.0):
        self.address = parse_server_url(url, token or os.environ.get(TOKEN_ENV) or None)
        self.rest = JupyterREST(self.address, timeout=request_timeout)
        self.jobs = JobFollower(self.rest)
        self.follow = Follow(window=reconnect_window, quiet_s=ping_after, pong_timeout_s=pong_timeout)
        self._kernel_id = kernel_id or self.address.kernel_id
        self._chosen = False
        self.kernel_name, self.new_kernel, self.protocol = kernel_name, new_kernel, protocol
        self.workdir = workdir.strip("/")
        self.connection: KernelConnection | None = None
        self.job: Job | None = None
        self.last_result: RunResult | None = None  # the last run()'s, while it is the current work
        self._running: str | None = None  # "the code is running": set while run() executes
        self._root: str | None = None  # the server's root folder as the kernel sees it
        self._cells: CellFiles | None = None
        self._bin_sent = False
        self._lock = threading.Lock()  # one request on the socket at a time; stop() may come from another thread

    # kernel and connection --------------------------------------------------------------------
    @property
    def kernel_id(self) -> str:
        """The kernel's id; the first use checks the server and token and picks (or starts) the kernel."""
        if not self._chosen:
            self._kernel_id = self._choose_kernel()
            self._chosen = True
        return self._kernel_id

    def _choose_kernel(self) -> str:
        self.rest.check_server()
        if self._kernel_id:
            model = self.rest.kernel(self._kernel_id)
        elif self.new_kernel:
            model = self.rest.start_kernel(self.kernel_name)
        else:
            kernels = self.rest.kernels()
            live = [k for k in kernels if k.get("execution_state") != "dead"]
            if kernels and not live:
                raise RemoteError(f"the only kernel on {self.address.shown} is dead; restart it from the notebook.")
            model = max(live, key=lambda k: k.get("last_activity") or "") if live else \
                self.rest.start_kernel(self.kernel_name)
        if model.get("execution_state") == "dead":
            raise RemoteError(f"kernel {model['id']} is dead; restart it from the notebook "
                              "(or runner.stop(restart=True), --stop --restart).")
        return model["id"]

    def _connect(self, now: bool = True) -> KernelConnection:
        """The kernel's connection; opened here unless `now` is False (the caller reconnects within its
        own deadline)."""
        if self.connection is None:
            self.connection = KernelConnection(self.address, self.kernel_id, protocol=self.protocol)
        if now and self.connection.ws is None:
            self.connection.connect()
        return self.connection

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()

    def __enter__(self) -> "KaggleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cell_files(self) -> CellFiles:
        """Where each run's output and outcome are kept on the server (see cells.py); the marker file by
        which the kernel finds the server's root stays, so a restarted kernel finds it again."""
        if self._cells is None:
            nonce = uuid.uuid4().hex
            cells = CellFiles(f"{self.workdir}/cells", f"{self.workdir}/cells/root-{nonce}.txt", nonce)
            self.rest.upload(cells.marker, nonce.encode(), timeout=30)
            self._cells = cells
        return self._cells

    # running code ----------------------------------------------------------------------------
    def run(self, what: str, *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            on_output: OutputCallback | None = None) -> RunResult:
        """Execute Python code on the kernel; output is streamed to `on_output(stream, text)` (default:
        printed here). Returns the finished RunResult: 'done', or 'failed' with the error. A timeout is
        a failure: the cell is interrupted when the kernel is running it, and cancelled (state 'queued')
        when it is still waiting behind another client's cell. A connection gone for longer than the
        deadline (or `reconnect_window`) gives state 'unknown' with `request_id`: reattach() follows it.
        `env` is set in the kernel's os.environ first (it stays); it travels as a file, never as code.
        The code runs inside the kernel process: JAX imported there holds the accelerator until the
        kernel restarts, which is why check_devices() and run_pipeline() use child processes."""
        with self._lock:
            self.job, self.last_result, self._running = None, None, "the code is running on the kernel"
            try:
                conn, files = self._connect(), self._cell_files()
                env_rel = None
                if env:
                    env_rel = f"{files.folder}/env-{uuid.uuid4().hex}.json"
                    self.rest.upload(env_rel, json.dumps({str(k): str(v) for k, v in env.items()}).encode())
                res = execute(conn, self.rest, what, timeout=timeout, on_output=on_output, files=files,
                              env_file=env_rel, follow=self.follow)
            finally:
                self._running = None
            self.last_result = res
            return res

    def reattach(self, request_id: str | None = None, *, timeout: float | None = None,
                 on_output: OutputCallback | None = None) -> RunResult:
        """Follow a run() whose connection was lost (or that was queued) until it ends; its full output
        and outcome come from the files on the server. Default: the last run()."""
        request_id = request_id or (self.last_result.request_id if self.last_result else None)
        if request_id is None:
            raise UserError("there is no run to reattach to; pass the request_id of run()'s result.")
        with self._lock:
            res = reattach(self._connect(now=False), self.rest, request_id, self._cell_files(), timeout=timeout,
                           on_output=on_output, follow=self.follow)
        if self.last_result is None or self.last_result.request_id == request_id:
            self.last_result = res
        return res

    def _call(self, function: str, what: str, *, timeout: float, on_output: OutputCallback = _discard,
              interrupt_on_timeout: bool = True, **params) -> Any:
        """Run `flaxchat.remote.on_kernel.<function>(params)` on the kernel and return its JSON result; a
        failure is one RemoteError sentence."""
        with self._lock:
            res = execute(self._connect(), self.rest, kernel_call(function, params), timeout=timeout,
                          on_output=on_output, interrupt_on_timeout=interrupt_on_timeout, store_history=False,
                          echo_result=False, follow=self.follow)
        if not res.ok:
            raise RemoteError(f"{what} failed on the kernel: {res.error_value or res.error_name}.")
        return json.loads(res.result)

    def _kernel_root(self) -> str:
        if self._root is None:
            nonce = uuid.uuid4().hex
            marker = f"{self.workdir}/where-{nonce}.txt"
            self.rest.upload(marker, nonce.encode())
            self._root = self._call("find_root", "finding the server's folder", timeout=60, marker=marker,
                                    nonce=nonce)["root"]
        return self._root

    def _send_bin(self) -> dict[str, str]:
        """worker.py and kernel_side.py on the server (relative paths): jobs need no setup() to start."""
        paths = {"worker": f"{self.workdir}/bin/worker.py", "kernel_side": f"{self.workdir}/bin/kernel_side.py"}
        if not self._bin_sent:
            for key, module in (("worker", worker_module), ("kernel_side", kernel_side)):
                self.rest.upload(paths[key], Path(module.__file__).read_bytes())
            self._bin_sent = True
        return paths

    # RemoteRunner verbs -----------------------------------------------------------------------
    def setup(self, local_repo_path: str = ".", *, install: str = "pip", deps: bool = True,
              pip_args: Sequence[str] = (), untracked: bool = False, offline: str = "auto",
              chunk_size: int = 4 << 20, timeout: float = 1800, on_output: OutputCallback | None = None,
              verbose: bool = False) -> dict[str, Any]:
        """Upload the repo's tracked files (never secret-looking ones; `untracked=True` adds work in
        progress) and install flaxchat on the kernel next to what the notebook image has for its
        accelerator: jax, jaxlib and the CUDA/TPU plugin stay as they are (a pip constraints file), the
        rest of flaxchat's dependencies are installed only where missing. Without Internet
        (offline='auto' finds out; 'yes'/'no' to say) nothing is downloaded and the report names what is
        missing and what to switch on. install='path' only puts the source on sys.path.
        pip runs with -q (its errors still show) unless verbose=True.
        Idempotent: when the same content is installed already, nothing happens. Returns the report:
        kept, installed, missing, offline, hint, uploaded (file list), skipped (secret-looking files)."""
        if install not in ("pip", "path"):
            raise UserError(f"install must be 'pip' or 'path' (got {install!r}).")
        if offline not in ("auto", "yes", "no"):
            raise UserError(f"offline must be 'auto', 'yes' or 'no' (got {offline!r}).")
        files, skipped = upload_selection(local_repo_path, untracked)
        data, digest = build_archive(local_repo_path, files)
        out = on_output or print_output
        tops: dict[str, int] = {}
        for f in files:
            top = f.split("/", 1)[0] + ("/" if "/" in f else "")
            tops[top] = tops.get(top, 0) + 1
        out("stdout", f"[flaxchat] uploading {len(files)} tracked files ({len(data) / 1024:.0f} KB compressed): "
            + ", ".join(f"{t} ({n})" if t.endswith("/") else t for t, n in sorted(tops.items()))
            + (f"; left out as secret-looking: {', '.join(skipped)}" if skipped else "") + "\n")
        want = {"hash": digest, "install": install, "deps": deps, "pip_args": list(pip_args)}
        base = {"files": len(files), "uploaded": files, "skipped": skipped, "hash": digest, "install": install}
        marker_rel = f"{self.workdir}/setup.json"
        marker = _json_or_none(self.rest.read_bytes(marker_rel))
        if marker and all(marker.get(k) == v for k, v in want.items()) and \
                self._call("import_check", "checking the installed flaxchat", timeout=180, src=marker["src"])["ok"]:
            out("stdout", "[flaxchat] setup: up to date\n")
            return {"changed": False, **base, "src": marker["src"]}
        root = self._kernel_root()
        bins = self._send_bin()
        tar_rel = f"{self.workdir}/upload-{digest[:12]}.tar.gz"
        self.rest.upload(tar_rel, data, chunk_size=chunk_size)
        info = self._call("setup", "setup", timeout=timeout, on_output=out, root=root, tar=tar_rel,
                          sha256=hashlib.sha256(data).hexdigest(), src=f"{self.workdir}/src", install=install,
                          deps=deps, pip_args=[*([] if verbose else ["-q"]), *pip_args], marker=marker_rel,
                          want=want, offline=offline, kernel_side=bins["kernel_side"],
                          report=f"{self.workdir}/setup-report.json")
        kept = ", ".join(f"{n} {v}" for n, v in info["kept"].items()) or "nothing (no jax there yet)"
        out("stdout", f"[flaxchat] setup: kept {kept}; installed {', '.join(info['installed']) or 'nothing'}"
            + (f"; MISSING {', '.join(info['missing'])}: {info['hint']}" if info["missing"] else "")
            + (f"; {info['hint']}" if info["hint"] and not info["missing"] else "") + "\n")
        return {"changed": True, **base, "bytes": len(data), **info}

    def check_devices(self, timeout: float = 300) -> dict[str, Any]:
        """What JAX sees on the kernel's machine, probed in a child process."""
        return self._call("probe", "the device check", timeout=timeout + 30, probe_timeout=timeout)

    def _latest_job(self) -> Job | None:
        info = _json_or_none(self.rest.read_bytes(f"{self.workdir}/runs/latest.json"))
        return None if not isinstance(info, dict) or "remote_dir" not in info else Job.from_record(info)

    def _current_job(self) -> Job | None:
        if self.job is None and self.last_result is None:
            self.job = self._latest_job()  # a fresh runner (another laptop) finds the last job
        return self.job

    def status(self) -> RunStatus:
        """The current work: a run() in progress or just finished, else the job (this runner's, or the
        last one started on this server), read through the file API; 'idle' when there is none."""
        if self._running:
            return RunStatus("running", self._running, {"kernel_id": self._kernel_id})
        if self.last_result is not None:
            res = self.last_result
            return RunStatus(res.state, f"the last run() is {res.state}" +
                             (f" ({res.error_name}: {res.error_value})" if res.error_name else ""),
                             {"request_id": res.request_id, "kernel_id": self._kernel_id})
        job = self._current_job()
        if job is not None:
            return self.jobs.status(job)
        model = self.rest.kernel(self.kernel_id)
        return RunStatus("idle", f"nothing started; kernel {self.kernel_id} is {model.get('execution_state')}", model)

    def wait(self, timeout: float | None = None, on_output: OutputCallback | None = None,
             poll_interval: float = 2.0) -> RunResult:
        """Block until the current work ends and return its RunResult: the last run() (reattached when
        its connection was lost), or the job, followed through the file API ('done' only for exit
        code 0). Raises RemoteTimeout after `timeout` s (the job keeps running; wait again)."""
        if self.last_result is not None:
            res = self.last_result
            if res.state == "unknown" and res.request_id:  # the connection was lost while it ran: follow it
                return self.reattach(res.request_id, timeout=timeout, on_output=on_output)
            return res  # finished, or cancelled in the queue (it will not run)
        job = self._current_job()
        if job is None:
            raise RemoteError("there is no work to wait for: start some with run() or run_pipeline().")
        return self.jobs.wait(job, timeout=timeout, on_output=on_output or print_output, poll_interval=poll_interval,
                              alive=self._job_alive)

    def _job_alive(self, job: Job) -> bool | None:
        """Asked only after a long silence: the supervisor's liveness, if the kernel is free to say."""
        try:
            if self.rest.kernel(self.kernel_id).get("execution_state") != "idle":
                return None
            bins = self._send_bin()
            return self._call("job_alive", "checking the job", timeout=30, interrupt_on_timeout=False,
                              worker=f"{self._kernel_root()}/{bins['worker']}",
                              state=f"{self._kernel_root()}/{job.state}")["alive"]
        except RemoteError:
            return None

    def stop(self, *, restart: bool = False, shutdown: bool = False) -> None:
        """End the current work without touching anything else on the kernel: the job (its whole
        process group, through a stop request its watcher acts on), or a run() of ours that the
        kernel is executing (interrupted; another client's cell is never interrupted). Raises only if
        the job is still alive afterwards. Then restart the kernel (its memory is lost) or shut it
        down, when asked."""
        job = self._current_job()
        current = getattr(self.connection, "current", None)
        if self._running and current is not None and current.idle_at is None:
            if current.started:
                current.interrupted_by_us = True
                self.rest.interrupt(self.kernel_id)  # our own cell is what the kernel runs: nobody else's
            elif self._cells is not None:  # still queued behind another cell: it shall not run at all
                self.rest.upload(self._cells.path(current.msg_id, "cancel"), b"", timeout=30)
        if job is not None and self.jobs.exit_code(job) is None:
            self.jobs.request_stop(job)
            self.jobs.wait_stopped(job)
        if shutdown:
            self.rest.shutdown(self.kernel_id)
            self.close()
        elif restart:
            self.rest.restart(self.kernel_id)
            self.close()  # a fresh socket next time, without the restart notices of this one
            if self.connection is not None:
                self.connection.restarted = True  # and the next request first waits until it is ready

    # background training -------------------------------------------------------------------
    def run_pipeline(self, depth: int = 8, steps: int = 5000, *, command: Sequence[str] | None = None,
                     env: Mapping[str, str] | None = None, secrets: Mapping[str, str] | None = None,
                     name: str | None = None, resume: bool = False, follow: bool = False,
                     run_dir: str | None = None, gcs_key: str | os.PathLike | None = None,
                     hint: str = "runner.wait() follows its log", **flags) -> RunResult:
        """Start `python -m scripts.run_tinystories --depth=.. --steps=.. --run-dir=.. [--flags]` on the
        kernel's machine as a detached job (a dropped connection, an interrupted cell or a kernel
        restart does not stop it) and return at once (state 'running'); wait() follows it. `command`
        replaces the arguments given to the kernel's Python ('{run_dir}' in them is filled in);
        FLAXCHAT_RUN_DIR is set. env and secrets travel as a file (0600, outside /kaggle/working once
        on the machine), never as code; secret values are *** in the log. resume=True starts again in
        the run folder of `name` (default: the last job's), where the training resumes from its checkpoint.

        run_dir="gs://bucket/run": the run folder is the bucket, which outlives the session (Kaggle
        ends one after 9-12 hours, and its disk with it). The same call in a new session, on a new
        server, resumes from the last step committed there, to the same parameters as one
        uninterrupted run; `name` (default: the folder's last part) names only the job's log folder
        on the server. gcs_key: a service-account key file on this machine; its text travels as the
        secret FLAXCHAT_GCS_KEY and becomes a 0600 key file outside /kaggle/working on the kernel's
        machine (GOOGLE_APPLICATION_CREDENTIALS). Without it the kernel's own credentials are used
        (the notebook may set FLAXCHAT_GCS_KEY from Kaggle's Secrets, see docs/kaggle.md).
        `hint`: how to follow the job, in the caller's words (the command line names its --wait)."""
        remote_run = run_dir is not None
        if remote_run and "://" not in str(run_dir):
            raise UserError(f"run_dir must be a bucket URL such as gs://my-bucket/d20 (got {run_dir!r}); without "
                            "run_dir the run folder is on the kernel's disk, which ends with the session.")
        secrets = dict(secrets or {})
        if gcs_key is not None:
            try:
                key = Path(gcs_key).expanduser().read_text()
                kind = json.loads(key).get("type")
            except (OSError, ValueError, AttributeError) as e:
                raise UserError(f"cannot read the service-account key {gcs_key} ({type(e).__name__}); pass the JSON "
                                "key file Google Cloud gave you (IAM -> Service accounts -> Keys).") from None
            if kind != "service_account":
                raise UserError(f"{gcs_key} is not a service-account key (its type is {kind!r}); create a key for a "
                                "service account that may write to the bucket.")
            secrets[kernel_side.GCS_KEY_ENV] = key
        latest = self._latest_job()
        if resume:
            name = name or (latest.name if latest else None)
            if name is None:
                raise UserError("there is no run to resume; pass name= of a run folder under runs/.")
        root = self._kernel_root()
        bins = self._send_bin()
        if remote_run:
            name = name or str(run_dir).rstrip("/").rsplit("/", 1)[-1]
        name = name or time.strftime("%Y%m%d-%H%M%S") + f"-d{depth}"
        remote_dir = f"{self.workdir}/runs/{name}"
        exists = self.rest.model(remote_dir) is not None
        # A bucket's run resumes by itself (the training continues from its last committed step); only
        # a run on the kernel's disk can be overwritten by mistake.
        if exists and not resume and not remote_run:
            raise UserError(f"a run named {name} exists already on the kernel; pick another name, or resume=True.")
        if resume and not exists and not remote_run:
            raise UserError(f"there is no run named {name} to resume on the kernel.")
        path = str(run_dir).rstrip("/") if remote_run else f"{root}/{remote_dir}"
        argv = pipeline_argv(depth, steps, path, flags) if command is None else \
            [str(a).replace("{run_dir}", path) for a in command]
        job = Job(name, remote_dir, path, argv)
        if exists:
            log = self.rest.model(f"{job.state}/output.log")
            job.offset = (log or {}).get("size") or 0
        # worker.py points FLAXCHAT_PROGRESS_FILE at <state>/progress.json, which status() reads
        variables = {"PYTHONUNBUFFERED": "1", "FLAXCHAT_RUN_DIR": path, **dict(env or {}), **secrets}
        env_rel = f"{self.workdir}/tmp/env-{uuid.uuid4().hex}.json"
        self.rest.upload(env_rel, json.dumps({"env": variables, "secret_keys": sorted(secrets or {})}).encode())
        t0 = time.monotonic()
        info = self._call("launch", "starting the job", timeout=120, root=root, name=name, argv=argv,
                          state=f"{root}/{job.state}", cwd=f"{root}/{self.workdir}/src", need_src=command is None,
                          worker=f"{root}/{bins['worker']}", kernel_side=f"{root}/{bins['kernel_side']}",
                          env_upload=f"{root}/{env_rel}", previous=f"{root}/{latest.state}" if latest else "")
        job.pid = info.get("pid")
        self.rest.upload(f"{self.workdir}/runs/latest.json", json.dumps(job.record()).encode())
        self.job, self.last_result = job, None
        print(f"started job {name} on the kernel's machine (pid {job.pid}), run folder {path if remote_run else remote_dir}"
              f"; {hint}", flush=True)
        started = RunResult(state="running", ok=True, elapsed=time.monotonic() - t0)
        return self.wait() if follow else started

    def download(self, remote_path: str | None = None, local_path: str | os.PathLike = ".", *,
                 overwrite: bool = False, progress: bool | None = None) -> list[str]:
        """Fetch a file or a folder (recursively; its contents go into `local_path`) from the server.
        `remote_path` is relative to the server's root; None means the current job's run folder.
        Existing local files are kept unless overwrite=True; a download cut short leaves `<file>.part`,
        which the next download resumes (a Range request). Returns the local paths written.
        `progress`: a bar of the bytes fetched on stderr (tqdm; None: when stderr is a terminal), as a
        d20 checkpoint is 9.2 GB."""
        if remote_path is None:
            job = self._current_job() or self._latest_job()
            if job is None:
                raise UserError("there is no job whose folder to download; pass remote_path.")
            remote_path = job.remote_dir
        model = self.rest.model(remote_path.strip("/"))
        if model is None:
            raise RemoteError(f"{remote_path} does not exist on the server.")
        local = Path(local_path)
        if model["type"] != "directory":
            todo = [(model, local / model["name"] if local.is_dir() else local)]
        else:
            todo, stack = [], [(model["path"], local, 0)]
            while stack:
                rpath, lpath, depth = stack.pop()
                if depth > 64:
                    raise RemoteError(f"{remote_path} is nested more than 64 folders deep; download a subfolder.")
                for entry in self.rest.model(rpath, content=True)["content"]:
                    if entry["type"] == "directory":
                        stack.append((entry["path"], lpath / entry["name"], depth + 1))
                    else:
                        todo.append((entry, lpath / entry["name"]))
        from tqdm import tqdm
        total = sum(m.get("size") or 0 for m, _ in todo)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                  desc=f"downloading {len(todo)} file(s)", disable=None if progress is None else not progress) as bar:
            written = [self._fetch(m, target, overwrite, bar) for m, target in todo]
        return sorted(written)

    def _fetch(self, model: dict, target: Path, overwrite: bool, bar=None) -> str:
        if target.exists() and not overwrite:
            raise UserError(f"{target} exists already; move it away or pass overwrite=True.")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        start = tmp.stat().st_size if tmp.exists() else 0
        if model.get("size") is not None and start > model["size"]:
            start = 0  # the remote file changed (shorter now): start over
        if bar is not None:
            bar.update(start)  # resumed from a .part: those bytes are here already
        try:  # streamed through /files/; a proxy that passes only /api/ gets the Contents API's base64
            with open(tmp, "r+b" if start else "wb") as f:
                f.seek(start)
                self.rest.download_file(model["path"], f if bar is None else _Counted(f, bar), model.get("size"),
                                        start=start)
        except RemoteError:
            if model.get("size") is not None and model["size"] > (64 << 20):
                raise  # too big for one base64 answer; the .part stays for the next try
            data = self.rest.read_bytes(model["path"])
            if data is None:
                raise RemoteError(f"{model['path']} vanished from the server during the download.") from None
            tmp.write_bytes(data)
            if bar is not None:
                bar.update(len(data))
        os.replace(tmp, target)  # no half-written file under the real name
        return str(target)


class _Counted:
    """A file being written that moves a progress bar by each block written to it."""

    def __init__(self, f, bar):
        self.f, self.bar = f, bar

    def write(self, block: bytes) -> int:
        self.bar.update(len(block))
        return self.f.write(block)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _json_or_none(data: bytes | None) -> Any:
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


if __name__ == "__main__":  # python -m flaxchat.remote.kaggle URL ...: the CLI is flaxchat/remote/__main__.py
    import runpy
    runpy.run_module("flaxchat.remote", run_name="__main__", alter_sys=True)

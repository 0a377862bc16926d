"""Train on a Cloud TPU VM or pod slice: create, set up, run on every worker, watch, recover, tear down.

    python -m flaxchat.cloud.launcher --project=my-project --zone=us-central2-b \\
        --tpu-name=flaxchat-d24 --accelerator=v4-8 --create --setup --upload=.
    python -m flaxchat.cloud.launcher --project=my-project --run-dir=gs://my-bucket/d24 \\
        --run "python -m scripts.pretrain --depth=24"
    python -m flaxchat.cloud.launcher --project=my-project --logs        # Ctrl-C detaches
    python -m flaxchat.cloud.launcher --project=my-project --health
    python -m flaxchat.cloud.launcher --project=my-project --run-dir=gs://my-bucket/d24 \\
        --recover "python -m scripts.pretrain --depth=24"
    python -m flaxchat.cloud.launcher --project=my-project --teardown

Add --backend=local to rehearse all of it on this machine (flaxchat.cloud.rehearsal plays gcloud
and Cloud Storage), and --dry-run to print the exact gcloud commands without running them. The VM
that --create made is remembered per project (~/.flaxchat/launcher.json), so later calls need only
--project. The run folder is told to the launcher (`--run-dir`, `run_dir=`): it is passed to the
stage as its own --run-dir flag, and its COMPLETE marker (`flaxchat.paths.RunFolder`) is what --wait
and --recover stop at, for every stage (pretraining, SFT, RL) alike; the command is never parsed.
Without it, --wait takes the marker the stage names in its progress file (--recover needs it).
What each kind of trouble looks like, and what the launcher does about it, is in docs/deployment.md
("What happens when...").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Mapping

from flaxchat import uploads
from flaxchat.paths import RunFolder
from flaxchat.cloud import gcloud as g
from flaxchat.cloud import goodput as gp
from flaxchat.cloud import recovery as rec
from flaxchat.cloud.topology import check_process_count, default_runtime_version, topology_for
from flaxchat.errors import UserError
from flaxchat.runner.base import RemoteError, RemoteRunner, RemoteTimeout, RunResult, RunStatus

STATE_ENV = "FLAXCHAT_LAUNCHER_STATE"
QR_WAIT_STATES = ("ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "CREATING", "STATE_UNSPECIFIED")
QR_GONE_STATES = ("FAILED", "SUSPENDED", "SUSPENDING")


@dataclasses.dataclass
class TPUConfig:
    project: str = ""
    zone: str = "us-central2-b"
    tpu_name: str = "flaxchat"
    accelerator_type: str = "v4-8"
    preemptible: bool = False  # old-style preemptible VM (`create --preemptible`)
    spot: bool = False  # spot capacity through a queued resource (Google's way for v5e/v5p/v6e)
    runtime_version: str = ""  # "" = Google's default image for the generation
    backend: str = "gcloud"  # "gcloud", or "local": the emulator on this machine (a rehearsal)
    emulator_dir: str = ""  # local backend state; default ~/.flaxchat/emulator
    coordinator_port: int = g.COORDINATOR_PORT
    zones: tuple = ()  # more zones to try, in order, when `zone` has no capacity
    install_command: str = ""  # default: a uv venv (Python 3.11) with `-e .[tpu]` (+ gcs for gs://)
    allow_local_checkpoints: bool = False  # accept a run folder that dies with the VM
    startup_check_s: float = 5.0  # how long `run` watches for a command that exits at once
    poll_s: float = 10.0  # wait()'s poll interval
    capacity_retry_s: float = 6 * 3600.0  # how long create retries "no capacity" (over all zones)
    capacity_backoff_s: float = 60.0  # first wait after every zone said no; doubles up to 15 min
    ready_timeout_s: float = 3 * 3600.0  # a created VM (or queued resource) not READY by then is an error
    ssh_wait_s: float = 900.0  # a READY VM whose workers do not take ssh by then is an error
    setup_attempts: int = 3
    price_per_chip_hour: float = 0.0  # for the cost estimate, where goodput.PRICES has none (or to override it)

    def validate(self) -> "TPUConfig":
        if not self.project:
            raise UserError("no --project given and no TPU VM remembered; pass --project=YOUR_GCP_PROJECT.")
        topology_for(self.accelerator_type)  # unknown type: one sentence listing the valid ones
        if self.backend not in ("gcloud", "local"):
            raise UserError(f"unknown --backend {self.backend!r}; use 'gcloud' or 'local'.")
        return self

    @property
    def version(self) -> str:
        return self.runtime_version or default_runtime_version(self.accelerator_type)

    @property
    def queued_resource(self) -> str:
        return f"{self.tpu_name}-qr"

    @property
    def all_zones(self) -> list[str]:
        return [self.zone] + [z for z in self.zones if z != self.zone]

    def install_for(self, gcs: bool) -> str:
        # hub: huggingface_hub, so that `--data=hf:...` works on the workers as it does here.
        return self.install_command or g.default_install(("tpu", "gcs", "hub") if gcs else ("tpu", "hub"))


def executor_for(config: TPUConfig) -> g.GcloudExecutor:
    """The one place the backend is chosen: gcloud itself, or the rehearsal's stand-in for it (first
    on PATH, same commands). Nothing after this asks which one it got."""
    if config.backend != "local":
        return g.GcloudExecutor()
    from flaxchat.cloud.rehearsal import emulator
    edir = os.path.expanduser(config.emulator_dir or os.environ.get(emulator.STATE_ENV)
                              or os.path.join("~", ".flaxchat", "emulator"))
    bin_dir = os.path.dirname(emulator.install_shim(os.path.join(edir, "bin")))
    return g.GcloudExecutor(env=g.default_env_with_path(bin_dir, {emulator.STATE_ENV: edir}))


def survives_the_vm(run_dir: str | None) -> bool:
    """A run folder a deleted VM does not take with it: a bucket (gs://). None: not known."""
    return run_dir is None or run_dir.startswith("gs://")


def check_run_folder(config: TPUConfig, run_dir: str | None, why: str, required: bool = False) -> None:
    """Refuse, in one sentence, checkpoints that a preemption or a recreate would silently delete.
    `required`: the run folder must be told (recovery recreates the VM, and the new one must be set up
    to reach the bucket before the stage has said where it writes)."""
    if required and run_dir is None and not config.allow_local_checkpoints:
        raise UserError(f"{why}, so it must know the run folder before it starts: pass --run-dir gs://BUCKET/RUN "
                        "(run_dir= from Python); it is given to the stage as its own --run-dir, and its COMPLETE "
                        "marker ends the recovery.")
    if survives_the_vm(run_dir) or config.allow_local_checkpoints:
        return
    raise UserError(f"{why}, but the run folder {run_dir} is on the VM's own disk, which a preemption or "
                    "a recreate deletes, so training would silently start again from step 0: use a gs:// "
                    "--run-dir (a bucket outlives the VM), or pass --allow-local-checkpoints to accept that.")


def env_url_for(root: str, run_dir: str, install: str) -> str:
    """The bucket object that holds the workers' packed environment for this repo's pins and install,
    or "" (a run folder on the VM's disk dies with it, so nothing is packed there)."""
    pyproject = os.path.join(root, "pyproject.toml")
    if not run_dir.startswith("gs://") or not os.path.isfile(pyproject):
        return ""
    with open(pyproject) as f:
        return g.env_pack_url(run_dir, g.env_key(f.read(), install))


def run_env(env: Mapping[str, str] | None, run_dir: str | None) -> dict:
    """The stage's env on the workers: with a run folder in a bucket, JAX's compilation cache lives
    beside it (FLAXCHAT_CACHE_DIR, unless the user set one), so a recreated VM loads the train step
    the one before it compiled instead of compiling it again."""
    env = dict(env or {})
    if run_dir and run_dir.startswith("gs://"):
        env.setdefault("FLAXCHAT_CACHE_DIR", f"{run_dir.rstrip('/')}/xla-cache")
    return env


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def state_path() -> str:
    return os.path.expanduser(os.environ.get(STATE_ENV) or os.path.join("~", ".flaxchat", "launcher.json"))


def load_state() -> dict:
    try:
        with open(state_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_state(state: dict) -> None:
    from flaxchat.paths import write_json
    write_json(state_path(), state, indent=2)


def with_run_dir(command: str, run_dir: str | None) -> str:
    """The command the workers run: the stage's own `--run-dir` flag added when the launcher was told
    the run folder (the last flag wins in argparse, so it is the one the stage uses); nothing is read
    out of the command."""
    return command if not run_dir else f"{command} --run-dir={shlex.quote(run_dir)}"


def marker_of(run_dir: str | None) -> str | None:
    """The completion marker of the stage that writes `run_dir` (None: not known)."""
    return RunFolder(run_dir).complete if run_dir else None


def _crashed(w: dict) -> bool:
    """A worker whose command died: exited non-zero, or killed (no exit code was ever written)."""
    return w.get("state") == "killed" or (w.get("state") == "exited" and w.get("exit_code") != 0)


class TPULauncher(RemoteRunner):
    """A TPU VM (one worker) or pod slice (many), driven through gcloud. See the module docstring."""

    def __init__(self, config: TPUConfig, *, executor: g.GcloudExecutor | None = None,
                 out: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time):
        self.config = config.validate()
        self.say = out or (lambda s: print(s, file=sys.stderr, flush=True))
        self.sleep, self.clock = sleep, clock
        self._secrets: dict[str, str] = {}
        self.ex = executor or executor_for(self.config)
        self.ex.redact = self._redact

    # --- plumbing ------------------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        for v in sorted((v for v in self._secrets.values() if v), key=len, reverse=True):
            text = text.replace(v, "***")
        return text

    def _where(self):
        c = self.config
        return c.project, c.zone, c.tpu_name

    def _ssh(self, command: str, worker="all", check=True, timeout=600.0) -> g.CommandResult:
        return self.ex.run(g.tpu_ssh(*self._where(), command, worker), check=check, timeout=timeout)

    def _ledger(self, event: str, **fields) -> None:
        """One event of the goodput ledger (flaxchat/cloud/goodput.py), timed by the launcher's clock."""
        if not isinstance(self.ex, g.DryRunExecutor):
            gp.append(gp.ledger_path(state_path(), self.config.project, self.config.tpu_name),
                      {"t": self.clock(), "event": event, **fields})

    def goodput(self) -> str:
        """Chip-hours, goodput and the estimated cost of the latest run folder, from the ledger."""
        c = self.config
        chips = topology_for(c.accelerator_type).chips
        acc = gp.account(gp.read(gp.ledger_path(state_path(), c.project, c.tpu_name)), chips, self.clock())
        return gp.format_goodput(acc, c.accelerator_type, c.spot or c.preemptible, chips,
                                 c.price_per_chip_hour or None)

    def _record(self, **fields) -> dict:
        """Remember this VM (and the latest run) for later calls that name only --project."""
        if isinstance(self.ex, g.DryRunExecutor):  # a dry run changes nothing, not even this file
            return {}
        state = load_state()
        vms = state.setdefault("vms", {})
        entry = vms.get(self.config.project, {})
        if entry.get("tpu_name") != self.config.tpu_name:
            entry = {}
        entry.update(dataclasses.asdict(self.config), **fields)
        vms[self.config.project] = entry
        state["last"] = self.config.project
        save_state(state)
        return entry

    def remembered(self) -> dict:
        entry = load_state().get("vms", {}).get(self.config.project, {})
        return entry if entry.get("tpu_name") == self.config.tpu_name else {}

    def describe(self) -> dict | None:
        """`describe --format=json`, or None when the VM does not exist."""
        try:
            return json.loads(self.ex.run(g.tpu_describe(*self._where()), timeout=120).stdout or "{}")
        except g.GcloudError as e:
            if g.is_not_found(e):
                return None
            raise

    def describe_qr(self) -> dict | None:
        """The queued resource behind a spot VM, or None (not spot, or it does not exist)."""
        c = self.config
        if not c.spot:
            return None
        try:
            return json.loads(self.ex.run(g.qr_describe(c.project, c.zone, c.queued_resource), timeout=120).stdout
                              or "{}")
        except g.GcloudError as e:
            if g.is_not_found(e):
                return None
            raise

    def _ready_node(self) -> dict:
        node = self.describe()
        c = self.config
        if node is None:
            raise UserError(f"TPU VM {c.tpu_name} does not exist in {c.zone} (project {c.project}); "
                            "create it first with --create.")
        if node.get("state") != "READY":
            raise RemoteError(f"TPU VM {c.tpu_name} is {node.get('state')}, not READY; "
                              "use --recover to bring it back, or --health to look.")
        return node

    # --- create / setup / teardown ----------------------------------------------------------------

    def create(self) -> dict:
        """Create the VM, or reuse a READY one; a PREEMPTED/TERMINATED one (or a FAILED/SUSPENDED
        queued resource) is deleted and made again. No capacity: retried over --zones with backoff."""
        c = self.config
        node = self.describe()
        qr_state = g.qr_state(self.describe_qr() or {})[0] if c.spot else None
        gone = node is not None and node.get("state") in ("PREEMPTED", "TERMINATED")
        if gone or qr_state in QR_GONE_STATES:
            self.say(f"TPU VM {c.tpu_name} is {node['state'] if gone else 'gone'}"
                     + (f" (queued resource {qr_state})" if qr_state in QR_GONE_STATES else "")
                     + ": deleting it to create it again")
            self._delete()
            node = None
        if node is not None:
            if node.get("acceleratorType") not in (None, c.accelerator_type):
                raise UserError(f"TPU VM {c.tpu_name} already exists as a {node['acceleratorType']}, not a "
                                f"{c.accelerator_type}; choose another --tpu-name or --teardown it first.")
            self.say(f"reusing TPU VM {c.tpu_name} ({node.get('state')})")
            node = self._wait_until_ready()
        else:
            node = self._create_with_retries()
        n, table = len(node.get("networkEndpoints", [])), topology_for(c.accelerator_type).workers
        if n != table:
            self.say(f"note: the VM has {n} worker(s); the topology table says {table}; using {n}")
        self._record(created=node.get("createTime"))
        self._ledger("up")
        self.say(f"TPU VM {c.tpu_name} is READY with {n} worker(s) in {c.zone}")
        return node

    def _create_once(self) -> dict:
        c = self.config
        if c.spot:
            self.ex.run(g.qr_create(c.project, c.zone, c.queued_resource, c.tpu_name, c.accelerator_type, c.version),
                        timeout=600)
        else:
            self.ex.run(g.tpu_create(*self._where(), c.accelerator_type, c.version, c.preemptible), timeout=3600)
        return self._wait_until_ready()

    def _create_with_retries(self) -> dict:
        """Try each zone in turn; when all say "no capacity", wait (doubling, at most 15 min) and go round
        again, for up to capacity_retry_s. Every attempt is printed. Other errors end it at once."""
        c = self.config
        zones, t0, attempt, delay = c.all_zones, self.clock(), 0, c.capacity_backoff_s
        what = f"{'spot ' if c.spot else ''}{c.accelerator_type} {c.tpu_name}"
        while True:
            last = None
            for zone in list(zones):
                attempt += 1
                c.zone = zone
                self.say(f"attempt {attempt}: creating {what} in {zone}"
                         + (f" (queued resource {c.queued_resource})" if c.spot else ""))
                try:
                    return self._create_once()
                except g.GcloudError as e:
                    if g.is_unavailable_in_zone(e) and len(zones) > 1:
                        self.say(f"attempt {attempt}: {zone} does not offer {c.accelerator_type}; not trying it again")
                        zones.remove(zone)
                        continue
                    if not g.is_capacity_error(e):
                        raise
                    last = e
                    self.say(f"attempt {attempt}: no capacity in {zone}: {e}")
                    if c.spot:  # a FAILED queued resource stays until deleted; its name is needed again
                        self._delete()
            waited = self.clock() - t0
            if waited + delay > c.capacity_retry_s:
                raise RemoteError(f"no capacity for {c.accelerator_type} in {', '.join(zones)} after {attempt} "
                                  f"attempt(s) over {_fmt_s(waited)}; the last answer was: {str(last).rstrip('.')}. Try other "
                                  "--zones, --spot, a smaller slice, or a longer --capacity-retry-hours.")
            self.say(f"no zone had capacity ({', '.join(zones)}); trying again in {_fmt_s(delay)} "
                     f"(giving up after {_fmt_s(c.capacity_retry_s)} in all)")
            self.sleep(delay)
            delay = min(900.0, delay * 2)

    def _wait_until_ready(self) -> dict:
        """Poll until READY (a spot VM: its queued resource ACTIVE first), within ready_timeout_s.
        A FAILED queued resource is an error with Google's own message."""
        c = self.config
        t0, seen = self.clock(), None
        while True:
            if c.spot:
                qr = self.describe_qr()
                state, message = g.qr_state(qr) if qr is not None else ("absent", "")
                if state != seen:
                    self.say(f"queued resource {c.queued_resource}: {state}")
                    seen = state
                if state == "FAILED":
                    raise g.GcloudError(f"queued resource {c.queued_resource} FAILED: "
                                        f"{message or 'Google gave no reason'}")
                if state in ("SUSPENDED", "SUSPENDING", "absent"):
                    raise RemoteError(f"queued resource {c.queued_resource} is {state} (its capacity was taken "
                                      "back) while waiting for it; --recover makes it again.")
            node = None if c.spot and seen != "ACTIVE" else self.describe()
            state = node.get("state") if node else None
            if state == "READY":
                return node
            if state in ("PREEMPTED", "TERMINATED") or (node is None and not c.spot):
                raise RemoteError(f"TPU VM {c.tpu_name} became {state or 'absent'} while waiting "
                                  "for it to be READY.")
            if self.clock() - t0 > c.ready_timeout_s:
                raise RemoteTimeout(f"TPU VM {c.tpu_name} was not READY after {_fmt_s(c.ready_timeout_s)}.")
            self.sleep(min(30.0, c.poll_s))

    def _delete(self) -> None:
        c = self.config
        self._ledger("down")
        try:
            if c.spot:
                self.ex.run(g.qr_delete(c.project, c.zone, c.queued_resource), timeout=3600)
            else:
                self.ex.run(g.tpu_delete(*self._where()), timeout=3600)
        except g.GcloudError as e:
            if not g.is_not_found(e):
                raise

    def teardown(self) -> None:
        """Delete the VM (and its queued resource), and forget it. A VM that is not there is an error:
        a typo in --tpu-name or --zone must not leave the real one running unnoticed."""
        c = self.config
        node, qr = self.describe(), self.describe_qr()
        if node is None and qr is None:  # (and remember it still: it may exist in the zone it was made in)
            raise UserError(f"TPU VM {c.tpu_name} was not found in zone {c.zone} (project {c.project}); nothing "
                            f"was deleted: check --tpu-name and --zone (`gcloud compute tpus tpu-vm list "
                            f"--zone={c.zone}` lists what is there).")
        self.say(f"deleting TPU VM {c.tpu_name} in {c.zone}" + (f" and queued resource {c.queued_resource}"
                                                              if c.spot else ""))
        self._delete()
        self._forget()

    def _forget(self) -> None:
        state = load_state()
        if state.get("vms", {}).get(self.config.project, {}).get("tpu_name") == self.config.tpu_name \
                and not isinstance(self.ex, g.DryRunExecutor):
            del state["vms"][self.config.project]
            save_state(state)

    def _wait_for_ssh(self, n: int) -> None:
        """A VM is READY before its workers take ssh (keys are still being pushed): wait for all of them."""
        t0, delay, attempt = self.clock(), 2.0, 0
        while True:
            attempt += 1
            res = self._ssh(g.ssh_check_command(), check=False, timeout=120)
            if res.returncode == 0:
                return
            waited = self.clock() - t0
            if waited + delay > self.config.ssh_wait_s:
                raise RemoteError(f"the {n} worker(s) of TPU VM {self.config.tpu_name} did not all take ssh within "
                                  f"{_fmt_s(self.config.ssh_wait_s)}: {g.one_line(res.stderr + res.stdout)}")
            self.say(f"waiting for ssh on TPU VM {self.config.tpu_name} (try {attempt}): "
                     f"{g.one_line(res.stderr + res.stdout, 160)}")
            self.sleep(delay)
            delay = min(60.0, delay * 2)

    def setup(self, local_repo_path: str = ".", gcs: bool | None = None, run_dir: str | None = None) -> None:
        """Upload the repo (git ls-files) to every worker and build its venv, unless that exact tree and
        install are there already. Waits for ssh first; a failed setup is tried again (setup_attempts).
        `run_dir` (default: the last run's): when it is in a bucket, the workers take their environment
        from it if it was built from the same pins (`g.env_key`), and pack a fresh one into it."""
        node = self._ready_node()
        n = len(node["networkEndpoints"])
        root = os.path.abspath(local_repo_path)
        if not os.path.isdir(root):
            raise UserError(f"--upload path {local_repo_path} is not a folder.")
        run_dir = run_dir or (self.remembered().get("run") or {}).get("run_dir") or ""
        if gcs is None:
            gcs = run_dir.startswith("gs://")
        install = self.config.install_for(gcs)
        env_url = env_url_for(root, run_dir, install)
        self._wait_for_ssh(n)
        attempts = max(1, self.config.setup_attempts)
        t0 = self.clock()
        for attempt in range(1, attempts + 1):
            try:
                self._setup_once(root, n, install, env_url)
                return self._ledger("setup", t0=t0, t1=self.clock())
            except (g.GcloudError, RemoteTimeout) as e:
                if attempt == attempts:
                    raise RemoteError(f"setup failed on TPU VM {self.config.tpu_name} {attempts} time(s); the last "
                                      f"error: {e}") from None
                self.say(f"setup attempt {attempt} of {attempts} failed ({e}); trying again")
                self.sleep(min(60.0, 5.0 * attempt))

    def _setup_once(self, root: str, n: int, install: str, env_url: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            tarball = os.path.join(tmp, g.REMOTE_TARBALL)
            # The same selection as the Kaggle runner's: tracked files, never secret-looking names.
            files = uploads.repo_files(root)
            digest = g.make_tarball(root, tarball, files, extra=install + env_url)
            have = self._ssh(g.setup_marker_command(), check=False, timeout=300).stdout.split()
            if have.count(digest) >= n:
                self.say(f"setup is up to date on all {n} worker(s) ({digest})")
                return self._report_ready(n)
            skipped = uploads.skipped_secrets(root)
            self.say(f"uploading {len(files)} tracked files to {n} worker(s)"
                     + (f"; left behind as secrets: {', '.join(skipped)}" if skipped else ""))
            self.ex.run(g.tpu_scp_to(*self._where(), tarball, g.REMOTE_TARBALL, "all"), timeout=1800)
        self._ssh(g.unpack_command(), timeout=600)
        self.say(f"installing on {n} worker(s) into ~/{g.REMOTE_VENV}: {install}")
        said = self._ssh(g.install_command(digest, install, env_url), timeout=3600).stdout  # markers: the truth
        if env_url:  # worker 0 packs what it installed, once per lock (a no-op when the pack is there)
            said += self._ssh(g.pack_env_command(env_url), worker=0, check=False, timeout=3600).stdout
        for line in dict.fromkeys(x for x in said.splitlines() if x.startswith("flaxchat: ")):
            self.say(line[len("flaxchat: "):])
        self._report_ready(n)

    def _report_ready(self, n: int) -> None:
        """One line per worker, from its venv: what the run will use. A worker that cannot say is a
        failed setup (retried), not a silent success."""
        res = self._ssh(g.versions_command(), check=False, timeout=300)
        found = g.parse_worker_lines(res.stdout)
        for i in range(n):
            w = found.get(i)
            if w:
                self.say(f"worker {i}: ready: Python {w.get('python')}, jax {w.get('jax') or 'missing'}, "
                          f"flaxchat {w.get('flaxchat') or 'missing'}")
            else:
                self.say(f"worker {i}: not ready: its venv did not answer")
        missing = [i for i in range(n) if i not in found]
        if missing:
            raise g.GcloudError(f"worker(s) {missing} of TPU VM {self.config.tpu_name} did not report their "
                                f"Python, jax and flaxchat after setup: {g.one_line(res.stderr + res.stdout)}")

    # --- run / stop / status ----------------------------------------------------------------------

    def _write_env(self, node: dict, env: Mapping[str, str] | None, secrets: Mapping[str, str] | None) -> None:
        """Copy the env file (0600) to every worker: the only way env and secrets reach them."""
        eps = node["networkEndpoints"]
        env = dict(env or {})
        if len(eps) > 1:
            data = g.worker_env(eps[0]["ipAddress"], len(eps), env, secrets, self.config.coordinator_port)
        else:
            data = {"env": {**env, **(secrets or {})}, "secret_keys": sorted(secrets or {})}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.env")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            self.ex.run(g.tpu_scp_to(*self._where(), path, g.REMOTE_ENV_FILE, "all"), timeout=600)

    def run(self, what: str, *, env: Mapping[str, str] | None = None, secrets: Mapping[str, str] | None = None,
            timeout: float | None = None, on_output=None, run_dir: str | None = None,
            replace: bool = False) -> RunResult:
        """Start `what` detached on every worker with the same env; return once it is running.
        `run_dir`: the stage's run folder (local or gs://), added to `what` as its --run-dir flag; its
        completion marker is what wait() and recover() look for."""
        self._secrets.update(secrets or {})
        node = self._ready_node()
        if not replace:
            alive = [w for w in self._worker_status(len(node["networkEndpoints"])) if w and w.get("alive")]
            if alive:
                raise UserError(f"a run is already going on TPU VM {self.config.tpu_name} ({alive[0]['command']!r}); "
                                "stop it with --stop, or follow it with --logs.")
        marker = marker_of(run_dir)
        n = len(node["networkEndpoints"])
        if n > 1 and run_dir and not (run_dir.startswith("gs://") or os.path.isabs(run_dir)):
            self.say(f"warning: {n} workers write checkpoints to {run_dir!r} on their own disks; use a gs:// "
                     "--run-dir so they share one checkpoint that survives a recreated VM")
        self._write_env(node, run_env(env, run_dir), secrets)
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        res = self._ssh(g.start_command(run_id, with_run_dir(what, run_dir), marker), check=False, timeout=600)
        if "can't open file" in res.stderr + res.stdout:
            raise UserError(f"flaxchat is not set up on TPU VM {self.config.tpu_name}; run --setup --upload=. first.")
        if res.returncode != 0:
            raise RemoteError(f"starting the command failed on TPU VM {self.config.tpu_name}: "
                              f"{g.one_line(res.stderr + res.stdout)}")
        self._ledger("start", run_id=run_id, run_dir=run_dir)
        self._record(run={"run_id": run_id, "command": what, "run_dir": run_dir, "marker": marker,
                          "env": dict(env or {}), "secret_names": sorted(secrets or {}), "started": time.time()})
        self.say(f"started on {n} worker(s) (run {run_id}): {what}")
        self._check_startup(n)
        return RunResult(state="running", ok=True, stdout=res.stdout)

    def _check_startup(self, n: int) -> None:
        """A command that dies within seconds (a typo, a bad flag) is an error now, not a silent failure."""
        if self.config.startup_check_s <= 0:
            return
        self.sleep(self.config.startup_check_s)
        for w in self._worker_status(n):
            if w and _crashed(w):
                raise RemoteError(f"the command exited at once on worker {w['worker']} with code "
                                  f"{w.get('exit_code')}: {w.get('last_line') or '(no output)'}")

    def _worker_status(self, n: int, marker: str | None = None) -> list[dict | None]:
        marker = marker or (self.remembered().get("run") or {}).get("marker")
        res = self._ssh(g.status_command(marker), check=False, timeout=300)
        if "can't open file" in res.stderr + res.stdout:
            raise RemoteError(f"flaxchat is not set up on TPU VM {self.config.tpu_name}; run --setup --upload=. first.")
        found = g.parse_worker_lines(res.stdout)
        workers = [found.get(i) for i in range(n)]
        marker = marker or (workers[0] or {}).get("marker")  # not told: the one the stage named (its progress file)
        if marker and marker.startswith("gs://") and workers[0] is not None:
            workers[0]["complete"] = self.bucket_has(marker)  # once, from here: no VM asks the bucket
        return workers

    def bucket_has(self, url: str) -> bool:
        """Whether an object exists in Cloud Storage (`gcloud storage ls`; no VM involved)."""
        try:
            return bool(self.ex.run(g.storage_ls(url), timeout=120).stdout.strip())
        except g.GcloudError as e:
            if "matched no objects" in str(e) or g.is_not_found(e):
                return False
            raise

    def stop(self) -> None:
        self._ready_node()
        self._ssh(g.stop_command(), check=False, timeout=300)
        self.say(f"stopped the run on TPU VM {self.config.tpu_name}")

    def dump_stacks(self) -> None:
        """Every worker's stage processes write their Python stacks (worker.py dump) into
        hang-<time>.txt on the worker and, when the run folder is on the worker's disk, into it."""
        self._ready_node()
        res = self._ssh(g.dump_stacks_command(), check=False, timeout=300)
        for i, w in sorted(g.parse_worker_lines(res.stdout).items()):
            self.say(f"worker {i} hung in {w.get('where')}: its Python stacks are in {w.get('stacks')}")

    def health(self, marker: str | None = None) -> dict:
        """VM state and, per worker: process, exit code, step/loss/tok/s and the age of its last step (its
        progress file), disk, last line. `marker`: the completion marker to look for (default: the last run's)."""
        c = self.config
        node = self.describe()
        state = node.get("state", "UNKNOWN") if node else "NOT_FOUND"
        workers = []
        if state == "READY":
            for i, w in enumerate(self._worker_status(len(node["networkEndpoints"]), marker)):
                workers.append({**w, "reachable": True} if w else {"worker": i, "reachable": False})
        deadline = rec.Policy().heartbeat_deadline_s
        self._note_progress(state, workers)
        qr = self.describe_qr()
        return {"vm": c.tpu_name, "zone": c.zone, "accelerator": c.accelerator_type, "state": state,
                "health": (node or {}).get("health"), "qr_state": g.qr_state(qr)[0] if qr else None,
                "workers": workers, "problems": rec.health_problems(state, workers, deadline)}

    def _note_progress(self, state: str, workers: list[dict]) -> None:
        """What goodput needs from a poll: a VM found gone, worker 0's step and first step (the progress
        file's times, as ages, on this clock)."""
        if state in ("PREEMPTED", "TERMINATED", "NOT_FOUND"):
            return self._ledger("down")
        w = workers[0] if workers else {}
        if w.get("step") is None or w.get("progress_age") is None or not w.get("run_id"):
            return
        now = self.clock()
        first = {}
        if w.get("first_age") is not None:
            first = {"first_step": w["first_step"], "first_t": now - w["first_age"]}
        self._ledger("progress", run_id=w["run_id"], step=w["step"], step_t=now - w["progress_age"], **first)

    def status(self) -> RunStatus:
        h = self.health()
        workers = h["workers"]
        if h["state"] != "READY":
            return RunStatus("failed" if h["state"] in ("PREEMPTED", "TERMINATED") else "unknown",
                             f"the VM is {h['state']}", h)
        if any(w.get("alive") for w in workers):
            return RunStatus("running", "; ".join(h["problems"]), h)
        return RunStatus(self._final(workers)[0], "; ".join(h["problems"]), h)

    def _final(self, workers: list[dict]) -> tuple[str, str]:
        if not workers or all(w.get("state") == "none" for w in workers):
            return "idle", "nothing has run yet"
        bad = [w for w in workers if not w.get("reachable", True) or _crashed(w)]
        if bad:
            return "failed", rec.health_problems("READY", bad, float("inf"))[0]
        if ((self.remembered().get("run") or {}).get("marker") or workers[0].get("marker")) \
                and not workers[0].get("complete"):
            return "failed", "every worker exited 0 but the training's completion marker is missing"
        return "done", "finished"

    def wait(self, timeout: float | None = None, on_output=None) -> RunResult:
        """Block until the run ends on every worker: done needs exit 0 everywhere (and the marker)."""
        t0 = self.clock()
        last_line = None
        while True:
            h = self.health()
            if h["state"] != "READY":
                return RunResult(state="failed", ok=False, error_name="VMState", elapsed=self.clock() - t0,
                                 error_value=f"TPU VM {self.config.tpu_name} is {h['state']}; use --recover")
            ws = h["workers"]
            line = ws[0].get("last_line") if ws else None
            if on_output and line and line != last_line:
                on_output("stdout", line + "\n")
            last_line = line
            state, why = self._final(ws)
            # A crash anywhere ends the wait at once; a missing marker only counts once nobody runs (worker 0
            # writes it last, and the others often exit 0 before it does).
            if not any(w.get("alive") for w in ws) or (state == "failed" and any(map(_crashed, ws))):
                codes = {w["worker"]: w.get("exit_code") for w in ws if w.get("exit_code") is not None}
                ok = state == "done"
                return RunResult(state="done" if ok else "failed", ok=ok, stdout=line or "", exit_codes=codes,
                                 error_name=None if ok else "RunFailed", error_value=None if ok else why,
                                 elapsed=self.clock() - t0)
            if timeout is not None and self.clock() - t0 > timeout:
                raise RemoteTimeout(f"the run on TPU VM {self.config.tpu_name} did not finish within {timeout:.0f} s.")
            self.sleep(self.config.poll_s)

    def logs(self, follow: bool = False, all_workers: bool = False, lines: int = 50,
             on_line: Callable[[str], None] | None = None) -> int:
        """Print worker 0's log (every worker's, prefixed, with all_workers); Ctrl-C only detaches."""
        self._ready_node()
        cmd = g.logs_command(follow=follow, lines=lines, prefix=all_workers)
        return self.ex.stream(g.tpu_ssh(*self._where(), cmd, "all" if all_workers else 0), on_line or print)

    def check_devices(self) -> dict[str, Any]:
        """JAX's view from every worker after joining the job: {'backend', 'device_count', 'process_count'}."""
        node = self._ready_node()
        n = len(node["networkEndpoints"])
        if any(w and w.get("alive") for w in self._worker_status(n)):
            raise UserError("a run is going; checking devices now would compete with it for the TPU.")
        self._write_env(node, (self.remembered().get("run") or {}).get("env"), None)
        res = self._ssh(g.probe_command(), check=False, timeout=600)
        found = g.parse_worker_lines(res.stdout)
        if 0 not in found:
            raise RemoteError(f"worker 0 did not report its devices: {g.one_line(res.stderr + res.stdout)}")
        check_process_count(n, found[0]["process_count"], self.config.accelerator_type)
        return {k: found[0][k] for k in ("backend", "device_count", "process_count")}

    # --- checkpoints and recovery -----------------------------------------------------------------

    def complete_steps(self, ckpt: str) -> list[int]:
        """Orbax steps that finished saving. In a bucket: those with commit_success.txt (Orbax on GCS
        writes the step under its final name and that file last), read with `gcloud storage ls`, so
        it works after a teardown or a preemption. On a worker's disk: worker.py lists them."""
        if ckpt.startswith("gs://"):
            try:
                out = self.ex.run(g.storage_ls(f"{ckpt.rstrip('/')}/*/commit_success.txt"), timeout=300).stdout
            except g.GcloudError as e:
                if "matched no objects" in str(e) or g.is_not_found(e):
                    return []
                raise
            steps = [line.rstrip("/").rsplit("/", 2)[-2] for line in out.splitlines() if line.strip()]
            return sorted(int(x) for x in steps if x.isdigit())
        self._ready_node()
        found = g.parse_worker_lines(self._ssh(g.checkpoints_command(ckpt), worker=0, timeout=300).stdout).get(0, {})
        return found.get("complete", [])

    def download_checkpoint(self, local_dir: str, run_dir: str | None = None, step: int | None = None) -> str:
        """Copy the latest complete Orbax step (never a half-written one) into local_dir/<step>.
        A gs:// run folder is read from the bucket (`gcloud storage`), with no VM; a local one from
        worker 0's disk. Only that step is copied, not the run folder."""
        run_dir = run_dir or (self.remembered().get("run") or {}).get("run_dir")
        if not run_dir:
            raise UserError("no run folder is known; pass --run-dir (the --run-dir of the training).")
        ckpt = RunFolder(run_dir).checkpoints
        complete = self.complete_steps(ckpt)
        if not complete or (step is not None and step not in complete):
            raise UserError(f"no complete checkpoint{f' at step {step}' if step is not None else ''} in {ckpt} "
                            f"(complete steps: {complete or 'none'}).")
        step = step if step is not None else max(complete)
        os.makedirs(local_dir, exist_ok=True)
        if ckpt.startswith("gs://"):
            self.ex.run(g.storage_cp(f"{ckpt}/{step}", local_dir), timeout=7200)
        else:
            remote = ckpt if os.path.isabs(ckpt) else f"{g.REMOTE_REPO}/{ckpt}"
            self.ex.run(g.tpu_scp_from(*self._where(), f"{remote}/{step}", local_dir, 0, recurse=True), timeout=7200)
        self.say(f"downloaded step {step} to {os.path.join(local_dir, str(step))}")
        return os.path.join(local_dir, str(step))

    def observe(self, run_id: str | None, marker: str | None, now: float | None = None) -> rec.Observation:
        """What recovery decides on; `marker` is the completion marker of the command it recovers."""
        h = self.health(marker)
        expects_marker = marker is not None or bool(h["workers"] and h["workers"][0].get("marker"))
        state = None if h["state"] == "NOT_FOUND" else h["state"]
        workers = [rec.WorkerObs(reachable=w.get("reachable", True), state=w.get("state", "none"),
                                 exit_code=w.get("exit_code"), progress_age=w.get("progress_age"),
                                 step=w.get("step"), run_id=w.get("run_id")) for w in h["workers"]]
        complete = bool(h["workers"] and h["workers"][0].get("complete"))
        return rec.Observation(state, workers, complete, run_id, expects_marker, health=h.get("health"),
                               qr_state=h.get("qr_state"), now=self.clock() if now is None else now)

    def recover(self, command: str, *, run_dir: str | None = None, env: Mapping[str, str] | None = None,
                secrets: Mapping[str, str] | None = None, local_repo_path: str = ".",
                policy: rec.Policy | None = None, clock=None, sleep=None, timeout: float | None = None) -> RunResult:
        """Keep `command` running to completion through crashes, hangs and preemptions (see recovery.py).
        `run_dir`: the stage's run folder, passed to it as --run-dir; its completion marker ends the
        recovery for pretraining, SFT and RL alike (a finished stage is never started again).
        Refuses a run folder on the VM's disk (a recreate would lose it) unless allow_local_checkpoints."""
        policy = policy or rec.Policy()
        check_run_folder(self.config, run_dir, "--recover deletes and recreates a preempted or broken VM", required=True)
        clock, sleep = clock or self.clock, sleep or self.sleep
        prev = self.remembered().get("run") or {}
        # Attach to the same command if it is already going; "" = none of the workers runs it yet.
        same = prev.get("command") == command and prev.get("run_dir") == run_dir
        current = {"run_id": prev.get("run_id") if same else ""}
        if not current["run_id"] and any(w.get("alive") for w in self.health()["workers"]):
            raise UserError(f"TPU VM {self.config.tpu_name} is running another command; stop it with --stop "
                            "first, or recover that command.")
        secrets = dict(secrets) if secrets is not None else {
            k: os.environ[k] for k in prev.get("secret_names", []) if k in os.environ}

        def start():
            self.run(command, env=env, secrets=secrets, run_dir=run_dir, replace=True)
            current["run_id"] = self.remembered()["run"]["run_id"]

        def restart():
            self.stop()
            start()

        def recreate():  # a new VM has a new disk: setup (with its retries) runs again before the command
            self._delete()
            self.create()
            self.setup(local_repo_path, gcs=bool(run_dir and run_dir.startswith("gs://")), run_dir=run_dir)
            start()

        actions = type("RecoveryActions", (), {"start": staticmethod(start), "restart": staticmethod(restart),
                                               "recreate": staticmethod(recreate),
                                               "dump_stacks": staticmethod(self.dump_stacks)})()
        marker = marker_of(run_dir)
        decision = rec.recover_loop(lambda: self.observe(current["run_id"], marker, clock()), actions,
                                    policy, clock=clock, sleep=sleep, log=self.say, timeout=timeout)
        ok = decision.action is rec.Action.DONE
        self.say(self.goodput())
        return RunResult(state="done" if ok else "failed", ok=ok, error_name=None if ok else "GaveUp",
                         error_value=None if ok else decision.reason)


if __name__ == "__main__":  # python -m flaxchat.cloud.launcher: the command line is flaxchat/cloud/cli.py
    import runpy
    runpy.run_module("flaxchat.cloud.cli", run_name="__main__", alter_sys=True)

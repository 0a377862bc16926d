"""What KaggleRunner runs on the kernel's machine, by path: install flaxchat, launch and watch a job.

    python kernel_side.py install --src DIR --report FILE [--no-deps] [--offline auto|yes|no] [-- PIP_ARGS]
    python kernel_side.py launch --worker worker.py --state-dir D --run-id N --cwd C [--env-upload F] -- ARGV
    python kernel_side.py watch --worker worker.py --state-dir D

Standard library only (it runs before flaxchat is installed, in whatever Python the notebook has).

`install` keeps what the notebook image brought for its accelerator: Kaggle's GPU images ship a
CUDA build of jax/jaxlib and the CUDA plugin, its TPU VMs libtpu. Installing flaxchat with its
dependencies would replace them with PyPI's CPU jax pinned in pyproject.toml (and check_devices()
would then say 'cpu'). So those distributions are written into a pip constraints file, flaxchat
itself goes in with --no-deps, and only its other dependencies that are not satisfied already are
installed, under the constraints. Without Internet (the notebook's setting is off) nothing can be
downloaded: the install runs with --no-index and the report names what is missing.

`launch` starts the job under `flaxchat/runner/worker.py` (the pods' supervisor: pid, exit code,
redacted log) and a watcher next to it; the runner follows the job through the server's file API
and stops it by writing `stop_request` into its state folder, which the watcher acts on, so neither
needs the kernel (which may be busy with the notebook's own cell).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# What the image brought for its accelerator and must survive setup() (names as pip normalises them).
KEEP = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
        "jax-rocm60-plugin", "jax-rocm60-pjrt", "libtpu", "libtpu-nightly")
# jax's own dtype library: kept beside the image's jax (which was built against it), not without it.
WITH_JAX = ("ml-dtypes",)
DEFAULT_INDEX = "https://pypi.org/simple/"


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_versions() -> dict[str, str]:
    """{normalised name: version} of the distributions this Python sees, the first on sys.path winning."""
    from importlib import metadata
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name and _norm(name) not in found:
            found[_norm(name)] = dist.version
    return found


def kept(versions: dict[str, str]) -> dict[str, str]:
    names = KEEP + (WITH_JAX if "jax" in versions else ())
    return {name: versions[name] for name in names if name in versions}


def _requirement_cls():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it; a Python that can pip install has one of the two
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def unsatisfied(requirements: list[str], versions: dict[str, str], keep: dict[str, str]) -> list[str]:
    """The requirements (pyproject strings) that are neither kept nor met by what is installed."""
    Requirement = _requirement_cls()
    out = []
    for spec in requirements:
        req = Requirement(spec)
        name = _norm(req.name)
        if name in keep or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        have = versions.get(name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(spec)
    return out


def project_requirements(src: str) -> list[str]:
    import tomllib
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        return list(tomllib.load(f).get("project", {}).get("dependencies", []))


def index_reachable(timeout: float = 5.0) -> bool:
    """Can pip reach its package index? Any HTTP answer counts; no route, DNS failure or a timeout do not."""
    if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes"):
        return False
    url = os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True
    except Exception:
        return False


OFFLINE_HINT = ("the notebook has no Internet: turn it on (notebook Settings -> Internet -> On; Kaggle asks for a "
                "verified phone number once) and run setup() again, or add the missing wheels as a Kaggle dataset "
                "and point PIP_FIND_LINKS at it")


def _pip(args: list[str]) -> int:
    cmd = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", *args]
    print("$ pip install " + shlex.join(args), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
    return proc.wait()


def install(src: str, report: str, deps: bool = True, offline: str = "auto", mode: str = "pip",
            pip_args: list[str] | None = None) -> dict:
    before = installed_versions()
    keep = kept(before)
    no_net = {"yes": True, "no": False}.get(offline)
    if no_net is None:
        no_net = not index_reachable()
    extra = list(pip_args or [])
    if no_net:
        extra += [a for a in ("--no-index", "--no-build-isolation") if a not in extra]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="flaxchat-keep-", delete=False) as f:
        f.write("".join(f"{name}=={version}\n" for name, version in keep.items()))
        constraints = f.name
    print("[flaxchat] keeping the notebook's " + (", ".join(f"{n} {v}" for n, v in keep.items()) or "(no jax yet)"),
          flush=True)
    if mode == "pip":
        if _pip(["-c", constraints, "--no-deps", "-e", src, *extra]) != 0:
            raise SystemExit("pip could not install flaxchat itself (its output is above)")
    else:  # "path": what an editable install amounts to, for a Python that must not run pip
        import site
        import sysconfig
        site_dir = sysconfig.get_paths()["purelib"]
        if not os.access(site_dir, os.W_OK):
            site_dir = site.getusersitepackages()
            os.makedirs(site_dir, exist_ok=True)
        with open(os.path.join(site_dir, "flaxchat-src.pth"), "w") as f:
            f.write(src + "\n")
    todo = unsatisfied(project_requirements(src), before, keep) if deps else []
    pip_failed = None
    if todo:
        if _pip(["-c", constraints, *todo, *extra]) != 0:
            pip_failed = "pip could not install " + ", ".join(todo) + " alongside the kept " + \
                         (", ".join(f"{n}=={v}" for n, v in keep.items()) or "packages")
    after = installed_versions()
    still = unsatisfied(todo, after, keep)
    changed = {n: (v, after.get(n)) for n, v in keep.items() if after.get(n) != v}
    if changed:  # the constraints make pip refuse this; say so loudly if it ever happens anyway
        print(f"[flaxchat] WARNING: {changed} changed during setup", flush=True)
    out = {"kept": keep, "installed": [s for s in todo if s not in still], "missing": still, "offline": no_net,
           "kept_changed": {n: list(v) for n, v in changed.items()}, "python": sys.executable,
           "hint": OFFLINE_HINT if no_net and still else (pip_failed or "")}
    _write_json(report, out)
    os.remove(constraints)
    return out


# --- jobs ------------------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("flaxchat_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GCS_KEY_ENV = "FLAXCHAT_GCS_KEY"  # a service-account key's JSON, given as a secret (never as code)


def _private(folder: str, name: str, data: bytes) -> str:
    target = os.path.join(folder, name)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return target


def private_env_file(upload: str) -> str:
    """Move the env file the runner uploaded (it lands in the server's root, which Kaggle keeps as the
    notebook's output) into a 0700 folder outside it, as a 0600 file; delete the upload.

    A service-account key among the variables (FLAXCHAT_GCS_KEY, from the runner's `gcs_key=` or the
    notebook's own environment, e.g. read from Kaggle's Secrets) becomes a 0600 key file in the same
    folder, and GOOGLE_APPLICATION_CREDENTIALS points at it: what gcsfs and Orbax's TensorStore read
    to reach a gs:// run folder. The key's text stays a secret, so the log shows it as ***."""
    folder = tempfile.mkdtemp(prefix="flaxchat-env-")  # mkdtemp makes it 0700
    with open(upload, "rb") as src:
        data = src.read()
    os.remove(upload)
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    env = doc.get("env") if isinstance(doc, dict) else None
    if isinstance(env, dict):
        key = env.get(GCS_KEY_ENV) or os.environ.get(GCS_KEY_ENV)
        if key and not env.get("GOOGLE_APPLICATION_CREDENTIALS"):
            env["GOOGLE_APPLICATION_CREDENTIALS"] = _private(folder, "gcs-key.json", str(key).encode())
            env[GCS_KEY_ENV] = str(key)
            doc["secret_keys"] = sorted(set(doc.get("secret_keys") or []) | {GCS_KEY_ENV})
            data = json.dumps(doc).encode()
    return _private(folder, "env.json", data)


def launch(worker_path: str, state_dir: str, run_id: str, cwd: str, argv: list[str], env_upload: str = "",
           previous: str = "") -> dict:
    worker = _load(worker_path)
    if previous and os.path.abspath(previous) != os.path.abspath(state_dir) and worker.status(previous)["alive"]:
        if env_upload and os.path.exists(env_upload):
            os.remove(env_upload)
        prev = worker.status(previous)
        return {"started": False, "error": f"job {prev['run_id']} (pid {prev['pid']}) is still running on the kernel's "
                                           "machine; wait() for it or stop() it first"}
    env_file = private_env_file(env_upload) if env_upload else ""
    if os.path.exists(os.path.join(state_dir, "stop_request")):
        os.remove(os.path.join(state_dir, "stop_request"))
    os.environ.setdefault("FLAXCHAT_WORKER_ID", "0")  # one machine; skips the GCE metadata lookup
    command = shlex.join([sys.executable, *argv])
    out = worker.start(state_dir, run_id, command, env_file=env_file, cwd=cwd)
    if out.get("started"):
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "watch", "--worker", worker_path,
                          "--state-dir", state_dir], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    return out


def watch(worker_path: str, state_dir: str, poll: float = 0.25) -> int:
    """Until the job has an exit code: when `stop_request` appears, stop the job (its process group).
    The request file stays (launch() removes it): the Jupyter server reads a file back after its PUT,
    and a request deleted in between made that PUT answer 404 although it was delivered."""
    worker = _load(worker_path)
    request, done = os.path.join(state_dir, "stop_request"), os.path.join(state_dir, "exit_code")
    stopped = False
    while not os.path.exists(done):
        if not stopped and os.path.exists(request):
            worker.stop(state_dir)
            stopped = True
        elif not worker.status(state_dir)["alive"]:  # the supervisor itself is gone (killed)
            return 1
        time.sleep(poll)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kernel_side.py")
    ap.add_argument("verb", choices=["install", "launch", "watch"])
    ap.add_argument("--src", default="")
    ap.add_argument("--report", default="")
    ap.add_argument("--no-deps", action="store_true")
    ap.add_argument("--offline", choices=["auto", "yes", "no"], default="auto")
    ap.add_argument("--mode", choices=["pip", "path"], default="pip")
    ap.add_argument("--worker", default="")
    ap.add_argument("--state-dir", default="")
    ap.add_argument("--run-id", default="run")
    ap.add_argument("--cwd", default=".")
    ap.add_argument("--env-upload", default="")
    ap.add_argument("--previous", default="", help="launch: the last job's state folder (one job at a time)")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = ap.parse_args(argv[:split]), argv[split + 1:]
    if args.verb == "install":
        install(args.src, args.report, deps=not args.no_deps, offline=args.offline, mode=args.mode, pip_args=rest)
        return 0
    if args.verb == "watch":
        return watch(args.worker, args.state_dir)
    out = launch(args.worker, args.state_dir, args.run_id, args.cwd, rest, args.env_upload, args.previous)
    print("FLAXCHAT " + json.dumps(out), flush=True)
    return 0 if out.get("started") else 3


if __name__ == "__main__":
    sys.exit(main())

"""The code that runs inside the Jupyter kernel (a Kaggle notebook's, or any server's), as functions.

`flaxchat.remote` sends this file's source in a cell, which makes it the module `flaxchat_on_kernel`
there and calls one function; the value it returns comes back as JSON in a display_data bundle of
its own type (`RESULT_MIME`), so the runner never parses printed text. Nothing is uploaded first:
`find_root` is what finds where uploads land. Standard library (and IPython, in the kernel) only:
it runs before flaxchat is installed, in whatever Python the notebook has. Tests import it like any
module.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

MODULE = "flaxchat_on_kernel"  # its name in the kernel's sys.modules
RESULT_MIME = "text/x-flaxchat-result"
CANCELLED_MIME = "text/x-flaxchat-cancelled"  # what a cell cancelled in the queue shows instead of running


def find_root(p: dict) -> dict:
    """The server's root folder as this kernel sees it: the folder above the cwd that holds the
    file `marker` with `nonce` in it (the runner uploaded it; it is removed here)."""
    d = os.getcwd()
    for _ in range(16):
        f = os.path.join(d, p["marker"])
        if os.path.isfile(f) and open(f).read().strip() == p["nonce"]:
            os.remove(f)
            return {"root": d}
        if os.path.dirname(d) == d:
            break
        d = os.path.dirname(d)
    raise RuntimeError(f"the kernel does not see its server's files from its folder {os.getcwd()} (it may run "
                       "on another machine), so setup() and run_pipeline() cannot work with this kernel")


def setup(p: dict) -> dict:
    """Unpack the upload, then kernel_side.py installs it in a child process (its output streamed
    here); this kernel is pointed at the new source too, so `import flaxchat` works in it at once."""
    tar, src = os.path.join(p["root"], p["tar"]), os.path.join(p["root"], p["src"])
    with open(tar, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != p["sha256"]:
            raise RuntimeError("the uploaded archive arrived damaged (checksum mismatch); run setup() again")
    os.makedirs(src, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    os.remove(tar)
    report = os.path.join(p["root"], p["report"])
    cmd = [sys.executable, os.path.join(p["root"], p["kernel_side"]), "install", "--src", src, "--report", report,
           "--offline", p["offline"], "--mode", p["install"], *([] if p["deps"] else ["--no-deps"]), "--", *p["pip_args"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"the install failed with exit code {proc.returncode} (its output is above)")
    with open(report) as f:
        info = json.load(f)
    if src not in sys.path:
        sys.path.insert(0, src)
    for name in [m for m in sys.modules if m == "flaxchat" or m.startswith("flaxchat.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    marker = dict(p["want"], src=src, python=sys.executable)
    with open(os.path.join(p["root"], p["marker"]) + ".tmp", "w") as f:
        json.dump(marker, f)
    os.replace(os.path.join(p["root"], p["marker"]) + ".tmp", os.path.join(p["root"], p["marker"]))
    return dict(info, src=src)


def import_check(p: dict) -> dict:
    """Whether flaxchat imports from `src` in a fresh process here (then this kernel imports it too)."""
    if not os.path.isdir(p["src"]):
        return {"ok": False}
    code = "import os, flaxchat; print(os.path.realpath(flaxchat.__file__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    ok = r.returncode == 0 and r.stdout.strip().startswith(os.path.realpath(p["src"]))
    if ok and p["src"] not in sys.path:
        sys.path.insert(0, p["src"])
    return {"ok": ok}


def probe(p: dict) -> dict:
    """What JAX sees on this machine, asked in a child process: imported in the kernel itself JAX
    would keep the accelerator (and 75% of GPU memory) for the kernel's lifetime."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps({'backend': jax.default_backend(), "
            "'device_count': jax.device_count(), 'process_count': jax.process_count(), "
            "'device_kind': d[0].device_kind}))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=p["probe_timeout"])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the JAX probe did not finish within {p['probe_timeout']} s") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the JAX probe failed ({last}); is JAX installed there (runner.setup(), or --setup)?")
    return json.loads(r.stdout.strip().splitlines()[-1])


def launch(p: dict) -> dict:
    """Start a job: kernel_side.py launches it under worker.py (in a session of its own) and a watcher."""
    if p["need_src"] and not os.path.isdir(p["cwd"]):
        raise RuntimeError("flaxchat is not set up on this kernel; run runner.setup() (or --setup) first")
    cwd = p["cwd"] if os.path.isdir(p["cwd"]) else p["root"]
    cmd = [sys.executable, p["kernel_side"], "launch", "--worker", p["worker"], "--state-dir", p["state"],
           "--run-id", p["name"], "--cwd", cwd, "--env-upload", p["env_upload"], "--previous", p["previous"],
           "--", *p["argv"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("FLAXCHAT ")]
    if not lines:
        raise RuntimeError("the job did not start: " + (r.stderr.strip().splitlines() or ["no output"])[-1])
    out = json.loads(lines[-1][len("FLAXCHAT "):])
    if not out.get("started"):
        raise RuntimeError(out.get("error") or "the job did not start")
    return out


def job_alive(p: dict) -> dict:
    """Is the supervisor still there? (Asked only when a job has been silent for long.)"""
    spec = importlib.util.spec_from_file_location("flaxchat_worker", p["worker"])
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    return {"alive": w.status(p["state"])["alive"]}


def install_helper(marker: str, nonce: str, rel: str) -> None:
    """Install `begin(rid, env_rel)` in this kernel (as builtins._flaxchat_begin), once: it tees the
    cell's stdout/stderr into `<rel>/<rid>.stdout|stderr` under the server's root and writes the
    outcome to `<rid>.json` when the cell ends; a cell whose `<rid>.cancel` exists becomes a no-op."""
    from IPython import get_ipython
    root = getattr(builtins, "_flaxchat_root", None)
    if root is None:  # the server's root folder as the kernel sees it: where the runner put `marker`
        d = os.getcwd()
        for _ in range(32):
            try:
                with open(os.path.join(d, marker)) as f:
                    if f.read().strip() == nonce:
                        root = d
                        break
            except OSError:
                pass
            if os.path.dirname(d) == d:
                return
            d = os.path.dirname(d)
        if root is None:
            return
        builtins._flaxchat_root = root
    if getattr(builtins, "_flaxchat_begin", None) is not None:
        return
    folder = os.path.join(root, rel)
    os.makedirs(folder, exist_ok=True)
    ip = get_ipython()

    def cancel_if_asked(lines):
        # A request that timed out in the queue: its cell becomes `pass` (an exception would make the
        # kernel abort the requests queued after it, the notebook's included).
        # IPython may transform one cell more than once: remember the verdict.
        head = lines[0] if lines else ""
        if head.startswith("__import__('builtins').__dict__.get('_flaxchat_begin'"):
            rid = head.split("(", 3)[-1][1:33]
            if rid in cancelled or os.path.exists(os.path.join(folder, rid + ".cancel")):
                cancelled.add(rid)
                return [f"__import__('IPython.display').display.display({{{CANCELLED_MIME!r}: {rid!r}}}, raw=True)\n"]
        return lines
    cancelled = set()
    ip.input_transformers_post.append(cancel_if_asked)

    def begin(rid, env_rel=""):
        if env_rel:  # variables for this kernel, sent as a file (never as code other clients receive)
            with open(os.path.join(root, env_rel)) as f:
                os.environ.update(json.load(f))
            os.remove(os.path.join(root, env_rel))
        now = time.time()
        for name in os.listdir(folder):  # older requests' files
            try:
                if now - os.path.getmtime(os.path.join(folder, name)) > 6 * 3600:
                    os.remove(os.path.join(folder, name))
            except OSError:
                pass
        streams = [(n, getattr(sys, n)) for n in ("stdout", "stderr")]
        files = {n: open(os.path.join(folder, f"{rid}.{n}"), "w", encoding="utf-8", errors="replace")
                 for n, _ in streams}
        for n, stream in streams:
            def write(text, _orig=stream.write, _f=files[n]):
                try:
                    _f.write(text)
                    _f.flush()
                except Exception:
                    pass
                return _orig(text)
            stream.write = write

        def end(result):
            ip.events.unregister("post_run_cell", end)
            for n, stream in streams:
                stream.__dict__.pop("write", None)
                files[n].close()
            err = result.error_in_exec if result.error_in_exec is not None else result.error_before_exec
            value = None
            if result.result is not None:
                try:
                    value = ip.display_formatter.format(result.result)[0].get("text/plain")
                except Exception:
                    value = repr(result.result)
            out = {"status": "ok" if err is None else "error", "ename": None if err is None else type(err).__name__,
                   "evalue": None if err is None else str(err), "result": value, "pid": os.getpid()}
            with open(os.path.join(folder, rid + ".json.tmp"), "w") as f:
                json.dump(out, f)
            os.replace(os.path.join(folder, rid + ".json.tmp"), os.path.join(folder, rid + ".json"))
        ip.events.register("post_run_cell", end)
    builtins._flaxchat_begin = begin

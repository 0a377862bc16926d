"""One filesystem layer for every file flaxchat reads or writes: local paths and `gs://` (any fsspec URL).

    open_file(path, mode)     a file object (context manager), local or remote
    exists / isdir            True or False; a remote error other than "not found" is a UserError
    listdir(path, recursive)  sorted full paths of the files in a folder
    glob(pattern)             sorted full paths matching a pattern (`**` crosses folders)
    makedirs(path)            a folder (a no-op on object stores, which have no folders)
    read_bytes / read_text    a whole file
    atomic_write(path, fn)    a whole file, atomically (a reader never sees half of it): fn(f) writes it
    write_bytes / _text / _json   the same for bytes, text, JSON
    remove(path), move(a, b)  a file; a file or folder (`--fresh` sets checkpoints aside)
    check_writable(folder)    a probe file written and removed: bad credentials fail here, early
    local_copy(folder)        a local folder mirroring a remote one, uploaded back on exit
    join(base, *parts)        `os.path.join` for local paths, `/`-joined for URLs
    absolute(path)            `os.path.abspath` for local paths, URLs as they are
    is_remote(path)           True for `scheme://...` other than `file://`
    listdirs(path)            sorted names of the folders directly in a folder
    RunFolder(root)           the run folder's layout: the one place its names are spelled


Local paths go straight to the OS (the fast path and the one the tests use); URLs go through fsspec,
which finds the implementation by scheme: `gs://` needs the `gcsfs` package. Remote listing and
connecting run under a time limit, because a machine without network or credentials can otherwise
wait for minutes (google-auth probes the GCE metadata server, gcsfs retries with back-off) before it
says anything. A missing package, missing credentials, or no answer all become one-sentence
`UserError`s. Orbax writes checkpoints to `gs://` natively; this module is for everything else
(config JSON, metrics, reports, samples, the tokenizer, data shards). Tests prove the writers
use this layer with fsspec's in-memory filesystem (`memory://`), which needs no network.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import io
import json
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Callable, TypeVar

from flaxchat.errors import UserError

T = TypeVar("T")

# Seconds a remote connect or listing may take before we give up with a message. google-auth alone
# can spend 3 x 3 s probing a metadata server that is not there; 60 s leaves room for a slow bucket.
REMOTE_TIMEOUT_S = 60.0

_INSTALL = {"gs": "pip install gcsfs", "gcs": "pip install gcsfs", "s3": "pip install s3fs",
            "hf": "pip install huggingface_hub"}
_GCS_AUTH = ("run `gcloud auth application-default login` or point GOOGLE_APPLICATION_CREDENTIALS "
             "at a service-account key")
_filesystems: dict[str, object] = {}  # protocol -> connected fsspec filesystem, one per process
_lock = threading.Lock()


def scheme(path: str) -> str:
    """'gs' for 'gs://bucket/x', '' for a local path (and for 'file://...')."""
    head, sep, _ = str(path).partition("://")
    if not sep or "/" in head or head == "file":
        return ""
    return head.lower()


def is_remote(path: str) -> bool:
    return scheme(path) != ""


def _local(path: str) -> str:
    path = str(path)
    return os.path.expanduser(path[len("file://"):] if path.startswith("file://") else path)


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts])
    return os.path.join(base, *parts)


def absolute(path: str) -> str:
    return str(path) if is_remote(path) else os.path.abspath(_local(path))


# --- remote filesystems ----------------------------------------------------------------------------


def bounded(fn: Callable[[], T], what: str, timeout: float | None = None) -> T:
    """`fn()` on a daemon thread; a UserError if it has not returned after `timeout` seconds.
    The thread is abandoned, not killed (Python cannot); it holds no lock of ours."""
    timeout = REMOTE_TIMEOUT_S if timeout is None else timeout
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name=f"flaxchat-remote {what[:40]}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise UserError(f"{what} got no answer within {timeout:g} s; check the network and the credentials")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _connect(protocol: str):
    """Instantiate the fsspec filesystem for `protocol` and check that it has credentials."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        hint = _INSTALL.get(protocol, "install the fsspec implementation for it")
        raise UserError(f"reading or writing {protocol}:// paths needs an extra package ({hint})"
                        + (f" and Google Cloud credentials ({_GCS_AUTH})" if protocol in ("gs", "gcs") else "")
                        ) from None
    except ValueError:
        raise UserError(f"'{protocol}://' is not a storage scheme fsspec knows; use a local path or gs://") from None
    fs = cls()
    # gcsfs tries default credentials, a token cache and the metadata server, then silently falls
    # back to anonymous access, which fails later with an opaque 401 on the first private read.
    creds = getattr(fs, "credentials", None)
    if protocol in ("gs", "gcs") and getattr(creds, "method", None) == "anon":
        raise UserError(f"gcsfs found no Google Cloud credentials for {protocol}:// paths; {_GCS_AUTH}")
    return fs


def filesystem(path: str):
    """(fsspec filesystem, path inside it) for a URL; connects once per scheme, under the time limit."""
    protocol = scheme(path)
    if not protocol:
        raise ValueError(f"{path} is a local path")
    with _lock:
        fs = _filesystems.get(protocol)
    if fs is None:
        fs = bounded(lambda: _connect(protocol), f"connecting to {protocol}://")
        with _lock:
            fs = _filesystems.setdefault(protocol, fs)
    return fs, str(path).split("://", 1)[1]


def bucket_of(path: str) -> str:
    """'gs://bucket' for 'gs://bucket/a/b': the part of a URL that must exist before anything is written."""
    return f"{scheme(path)}://{str(path).split('://', 1)[1].lstrip('/').split('/', 1)[0]}"


def missing_bucket(path: str) -> UserError | None:
    """For a URL that was not found: the sentence to raise when its bucket is what is missing, else None."""
    if not is_remote(path) or exists(bucket_of(path)):
        return None
    return UserError(f"the bucket {bucket_of(path)} does not exist (or these credentials may not see it); "
                     f"check the name in {path}.")


def _url(protocol: str, inner: str) -> str:
    # fsspec returns paths without the scheme (gcsfs: 'bucket/x'; the memory fs: '/bucket/x').
    return f"{protocol}://{inner.lstrip('/')}"


_WRITES = ("write", "remove", "move")


def _remote(path: str, what: str, fn: Callable, timeout: float | None = None):
    """Run `fn(fs, inner_path)` under the time limit, turning storage errors into one sentence."""
    fs, inner = filesystem(path)
    may = "write there" if what in _WRITES else "read it"

    def call():
        try:
            return fn(fs, inner)
        except FileNotFoundError:
            # gcsfs answers a write into a bucket that is not there with a 404, i.e. this error.
            if what == "write":
                raise UserError(f"cannot {what} {path}: the bucket {bucket_of(path)} does not exist (or these "
                                "credentials may not see it); create it (`gcloud storage buckets create "
                                f"{bucket_of(path)}`) or check the name") from None
            raise
        except UserError:
            raise
        except Exception as e:  # permission, auth and transport errors read the same to a user
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise UserError(f"cannot {what} {path} ({type(e).__name__}: {first}); check the path and "
                            f"that your credentials may {may}") from None

    return bounded(call, f"{what} {path}", timeout)


# --- the operations --------------------------------------------------------------------------------


def open_file(path: str, mode: str = "rb", **kwargs):
    """A file object for `path`; use it as a context manager. Remote writes appear on close."""
    if not is_remote(path):
        return open(_local(path), mode, **kwargs)
    fs, inner = filesystem(path)
    return fs.open(inner, mode, **kwargs)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(_local(path))
    return _remote(path, "check", lambda fs, p: fs.exists(p))


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(_local(path))
    return _remote(path, "check", lambda fs, p: fs.isdir(p))


def listdirs(path: str) -> list[str]:
    """Sorted names (not paths) of the folders directly in folder `path`; [] when it does not exist.
    On an object store a folder is a name prefix: one listing call, nothing below it is read."""
    if not is_remote(path):
        root = _local(path)
        return sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))) if os.path.isdir(root) else []

    def ls(fs, p):
        try:
            return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=True)
                    if e.get("type") == "directory"]
        except FileNotFoundError:
            return []

    return sorted(_remote(path, "list", ls))


def listdir(path: str, recursive: bool = False) -> list[str]:
    """Sorted full paths of the files directly in folder `path` (all below it if `recursive`)."""
    if not is_remote(path):
        root = _local(path)
        if recursive:
            found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
        else:
            found = [os.path.join(root, f) for f in os.listdir(root)]
        return sorted(p for p in found if os.path.isfile(p))
    protocol = scheme(path)

    def ls(fs, p):
        if recursive:
            return fs.find(p)
        return [e["name"] for e in fs.ls(p, detail=True) if e.get("type") == "file"]

    return sorted(_url(protocol, p) for p in _remote(path, "list", ls))


def glob(pattern: str) -> list[str]:
    """Sorted full paths matching `pattern`; `**` matches any number of folders."""
    if not is_remote(pattern):
        return sorted(_glob.glob(_local(pattern), recursive=True))
    protocol = scheme(pattern)
    return sorted(_url(protocol, p) for p in _remote(pattern, "list", lambda fs, p: fs.glob(p)))


def makedirs(path: str) -> None:
    """Create folder `path` and its parents. Object stores have no folders (a 'folder' is a name
    prefix that exists once a file is written under it), so for URLs there is nothing to do."""
    if not is_remote(path):
        os.makedirs(_local(path), exist_ok=True)
    else:
        filesystem(path)  # still connect, so that missing credentials show before any work is done


def size(path: str) -> int:
    """Bytes in the file at `path`."""
    if not is_remote(path):
        return os.path.getsize(_local(path))
    return int(_remote(path, "check", lambda fs, p: fs.size(p)))


def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        with open(_local(path), "rb") as f:
            return f.read()
    return _remote(path, "read", lambda fs, p: fs.cat_file(p))


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> str:
    """Call write(f) on a temp file beside `path` (its folder made if missing), then rename it onto
    `path`: a reader never sees half a file, and a write that fails leaves the old file and no temp
    file behind. On an object store (gs://) the bytes are gathered in memory and uploaded as one
    object, which is atomic there (the old object stays readable until the new one is whole).
    Every file flaxchat writes whole goes through here. Returns `path`."""
    if is_remote(path):
        buf = io.StringIO() if "b" not in mode else io.BytesIO()
        write(buf)
        data = buf.getvalue()
        data = data.encode("utf-8") if isinstance(data, str) else data
        _remote(path, "write", lambda fs, p: fs.pipe_file(p, data))
        return path
    path = os.path.abspath(_local(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return path


def write_bytes(path: str, data: bytes) -> None:
    """Replace the file at `path` with `data` (`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj, **dump_kwargs) -> None:
    """`obj` as JSON at `path` (`atomic_write`)."""
    write_text(path, json.dumps(obj, **dump_kwargs))


def remove(path: str) -> None:
    """Delete the file at `path`; a missing one is not an error."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(_local(path))
        return
    with contextlib.suppress(FileNotFoundError):
        _remote(path, "remove", lambda fs, p: fs.rm_file(p))


# An object store moves a folder object by object (a server-side copy, then a delete): a checkpoint
# of a d24 model is ~10 GB, so this gets far longer than a listing.
MOVE_TIMEOUT_S = 1800.0


def move(src: str, dst: str) -> None:
    """Rename a file or folder (same filesystem)."""
    if is_remote(src) != is_remote(dst) or scheme(src) != scheme(dst):
        raise ValueError(f"cannot move {src} to {dst}: not on one filesystem")
    if not is_remote(src):
        os.rename(_local(src), _local(dst))
        return
    _, dst_inner = filesystem(dst)
    _remote(src, "move", lambda fs, p: fs.mv(p, dst_inner, recursive=True), timeout=MOVE_TIMEOUT_S)


def check_writable(folder: str) -> None:
    """Create `folder` and write and delete a small probe file in it, so that a missing package,
    missing credentials or a read-only bucket stop a run with one sentence before any work is done
    (rather than at the first checkpoint, an hour in)."""
    _probe(folder, "pick a folder you may write to", "the run folder ")


def _dangling(path: str) -> str | None:
    """The first link on the way to `path` that resolves to nothing (a loop or a missing target)."""
    path = os.path.abspath(_local(path))
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i])
        if os.path.islink(head) and not os.path.exists(head):
            return head
    return None


def _probe(folder: str, advice: str, what: str = "") -> None:
    """Make `folder`, write and delete a probe file there; a failure is one sentence with `advice`."""
    probe = join(folder, f".flaxchat-probe-{uuid.uuid4().hex[:12]}")
    try:
        makedirs(folder)
        write_bytes(probe, b"ok")
        remove(probe)
    except UserError:
        raise
    except OSError as e:  # local: permission, read-only file system, a file where the folder should be
        reason = e.strerror or (str(e).splitlines() or [""])[0][:200] or type(e).__name__
        if not is_remote(folder) and _dangling(folder):
            reason = f"{_dangling(folder)} is a symbolic link that leads nowhere: a loop, or its target is missing"
        raise UserError(f"cannot write to {what}{folder} ({reason}); {advice}") from None


@contextlib.contextmanager
def local_copy(folder: str, upload: bool = True):
    """A local folder holding what `folder` holds, for code that only speaks to the OS (the
    tokenizer's save/load). Local folders are used as they are; a remote one is downloaded into a
    temporary folder and, when `upload` and the block ends without an error, the files that are new
    or changed are uploaded back."""
    if not is_remote(folder):
        yield _local(folder)
        return
    base = folder.rstrip("/")
    tmp = tempfile.mkdtemp(prefix="flaxchat-")
    try:
        before: dict[str, bytes] = {}
        for url in listdir(base, recursive=True):
            rel = url[len(base):].lstrip("/")
            before[rel] = read_bytes(url)
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)) or tmp, exist_ok=True)
            with open(os.path.join(tmp, rel), "wb") as f:
                f.write(before[rel])
        yield tmp
        if upload:
            for local in listdir(tmp, recursive=True):
                rel = os.path.relpath(local, tmp).replace(os.sep, "/")
                with open(local, "rb") as f:
                    data = f.read()
                if before.get(rel) != data:
                    write_bytes(join(base, rel), data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the run folder ----------------------------------------------------------------------------------


class RunFolder:
    """The layout of a run folder, local or `gs://`: every module asks here for the path of what a
    stage writes and the next stage, the launchers and the exporters read, so that the names below
    are spelled nowhere else.

        <root>/checkpoints/<step>/   Orbax steps of {model, optimizer, meta} (flaxchat.checkpoint)
        <root>/tokenizer/            the tokenizer the model was trained with
        <root>/config.json           the resolved configs of the run
        <root>/metrics.jsonl         one JSON line per logged step (flaxchat.report.MetricsLog)
        <root>/report.md, loss.png, samples.txt, eval.json
        <root>/export/               model.pkl, weights.npz, model.stablehlo, tokenizer/ (scripts.export)
        <root>/COMPLETE              written last, by process 0: the stage finished (what launchers wait for)
        <root>/run.lock              who is writing here now (flaxchat.run_lock; only while a stage runs)
    """

    CHECKPOINTS = "checkpoints"
    TOKENIZER = "tokenizer"
    COMPLETE = "COMPLETE"
    CONFIG = "config.json"
    METRICS = "metrics.jsonl"
    REPORT = "report.md"
    LOSS_PLOT = "loss.png"
    SAMPLES = "samples.txt"
    EVAL = "eval.json"
    EXPORT = "export"
    LOCK = "run.lock"
    # Orbax writes one sub-folder per item of a step; `meta` is the one every flaxchat step has.
    STEP_META = "meta"

    def __init__(self, root: str | os.PathLike):
        root = str(root)
        self.root = root.rstrip("/") if is_remote(root) else root

    def __repr__(self) -> str:
        return f"RunFolder({self.root!r})"

    def __fspath__(self) -> str:
        return self.root

    def path(self, *parts: str) -> str:
        return join(self.root, *parts)

    def step(self, step: int) -> str:
        return self.path(self.CHECKPOINTS, str(step))

    checkpoints = property(lambda self: self.path(self.CHECKPOINTS))
    tokenizer = property(lambda self: self.path(self.TOKENIZER))
    complete = property(lambda self: self.path(self.COMPLETE))
    config = property(lambda self: self.path(self.CONFIG))
    metrics = property(lambda self: self.path(self.METRICS))
    report = property(lambda self: self.path(self.REPORT))
    loss_plot = property(lambda self: self.path(self.LOSS_PLOT))
    samples = property(lambda self: self.path(self.SAMPLES))
    eval = property(lambda self: self.path(self.EVAL))
    export = property(lambda self: self.path(self.EXPORT))
    lock = property(lambda self: self.path(self.LOCK))

    @classmethod
    def is_step(cls, folder: str) -> bool:
        """Is `folder` one Orbax step of a flaxchat checkpoint (`checkpoints/<step>`, with its meta)?"""
        name = str(folder).rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]
        return name.isdigit() and isdir(join(str(folder), cls.STEP_META))


def parent(path: str) -> str:
    """The folder holding `path` (`gs://b/run/x` -> `gs://b/run`)."""
    path = str(path)
    if is_remote(path):
        head, _, _ = path.rstrip("/").rpartition("/")
        return head if "://" in head and not head.endswith(":/") else path
    return os.path.dirname(os.path.abspath(_local(path)))


def basename(path: str) -> str:
    return str(path).rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]


def check_destination(path: str, flag: str, file: bool = False) -> None:
    """Before any long work: `path` (a folder, or a file when `file`) can be written where the
    user pointed `flag`. A file where a folder should be, a folder where a file should be, or a
    read-only place is one sentence now, not a traceback after the work is done."""
    if file and isdir(path):
        raise UserError(f"{flag} {path} is a folder; give the path of the file to write.")
    if not file and exists(path) and not isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder; pick a folder (it is created if missing).")
    folder = (os.path.dirname(_local(path)) or ".") if file and not is_remote(path) else \
        (path.rsplit("/", 1)[0] if file else path)
    _probe(folder, f"give {flag} a place you may write to.")

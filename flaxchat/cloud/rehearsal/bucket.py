"""The rehearsal's Cloud Storage: `gs://BUCKET/PATH` kept in `$FLAXCHAT_REHEARSAL_BUCKETS/BUCKET/PATH`.

A pod's checkpoints survive a preemption only in a bucket, so a rehearsal must keep them where an
emulated VM's deletion cannot reach (a folder beside the emulated VMs, never inside one) and must
reach them by the code path a real pod uses: the run folder stays `gs://...` everywhere, and

- `flaxchat.paths` and Orbax's own file operations (etils.epath) go through fsspec's `gs` protocol:
  here an fsspec filesystem over that folder stands in for gcsfs;
- Orbax's array data goes through TensorStore, whose `gcs` driver speaks HTTP to Google: its
  kvstore spec for a gs:// path (`gcs_utils.get_kvstore_for_gcs`, one function) is pointed at the
  same folder with TensorStore's `file` driver, and the bucket is said to have no hierarchical
  namespace (a flat bucket, the default; asking would need Google's API).

Everything else Orbax decides from the `gs://` prefix stays as on GCS: a step is written under its
final name and marked complete with `commit_success.txt` (no rename), so a save cut off by a
preemption looks exactly as it does in a real bucket. `gcloud storage ls/cp` on the same folder is
the emulator's (see emulator.py).

It fails where Cloud Storage fails, so that what a user sees there is what the tests see:

- a bucket exists only once it is made (`gcloud storage buckets create gs://B`, or its folder under
  the root); anything under a bucket that is not there is not found, and a write into it fails as
  gcsfs's 404 does (FileNotFoundError);
- credentials are looked for as google-auth and gcsfs look for them: the key file named by
  GOOGLE_APPLICATION_CREDENTIALS (it must be a readable JSON key), then gcloud's application-default
  login in ~/.config/gcloud, then a VM's metadata server (an emulated VM has one); with none of
  them gcsfs falls back to anonymous access, and so does this (`credentials.method == "anon"`).

Nothing in flaxchat imports this module: the emulator copies it, with a `sitecustomize.py` that
calls `install()`, into a folder on the emulated workers' PYTHONPATH (a VM "that can reach GCS").
Standard library and fsspec only, so it works as a lone file in that folder.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

ROOT_ENV = "FLAXCHAT_REHEARSAL_BUCKETS"
VM_ENV = "FLAXCHAT_EMULATOR_VM"  # set on every process of an emulated VM (emulator.TAG_ENV)
ADC = os.path.join("~", ".config", "gcloud", "application_default_credentials.json")
_ORBAX_GCS = "orbax.checkpoint._src.path.gcs_utils"


def root() -> str:
    return os.environ[ROOT_ENV]


def local_path(url: str) -> str:
    """Where `gs://bucket/x` lives on this machine."""
    inner = url.split("://", 1)[1] if "://" in url else url
    return os.path.join(root(), inner.lstrip("/"))


def credentials_method() -> str:
    """How gcsfs would authenticate here: 'google_default', 'cloud' (a VM's metadata server) or 'anon'."""
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        try:
            with open(key) as f:
                if json.load(f).get("type") in ("service_account", "authorized_user", "external_account"):
                    return "google_default"
        except (OSError, ValueError, AttributeError):
            pass  # google-auth refuses the file; gcsfs goes on to its other ways
    if os.path.isfile(os.path.expanduser(ADC)):
        return "google_default"
    if os.environ.get(VM_ENV):
        return "cloud"
    return "anon"


def bucket_exists(name: str) -> bool:
    return bool(name) and os.path.isdir(os.path.join(root(), name))


def _filesystem_class():
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    class RehearsalBucketFileSystem(DirFileSystem):
        """gcsfs's place in fsspec: paths come and go as 'bucket/x' (gcsfs's form), scheme stripped."""

        protocol = ("gs", "gcs")

        def __init__(self, *args, **kwargs):
            os.makedirs(root(), exist_ok=True)
            super().__init__(path=root(), fs=LocalFileSystem(auto_mkdir=True))  # objects need no folders
            self.credentials = type("Credentials", (), {"method": credentials_method()})()

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, (list, tuple)):
                return type(path)(cls._strip_protocol(p) for p in path)
            path = str(path)
            for prefix in ("gs://", "gcs://"):
                if path.startswith(prefix):
                    path = path[len(prefix):]
            return path.rstrip("/")

        def _join(self, path):
            if isinstance(path, (list, tuple)):
                return type(path)(self._join(p) for p in path)
            inner = self._strip_protocol(path).lstrip("/")
            if not bucket_exists(inner.split("/", 1)[0]):
                raise FileNotFoundError(f"{inner}: The specified bucket does not exist.")
            return super()._join(inner)

        def exists(self, path, **kwargs):
            try:
                return super().exists(path, **kwargs)
            except FileNotFoundError:
                return False

        def isdir(self, path):
            try:
                return super().isdir(path)
            except FileNotFoundError:
                return False

        def isfile(self, path):
            try:
                return super().isfile(path)
            except FileNotFoundError:
                return False

    return RehearsalBucketFileSystem


def _patch_orbax(module) -> None:
    def get_kvstore_for_gcs(ckpt_path: str) -> dict:
        return {"driver": "file", "path": local_path(str(ckpt_path))}

    module.get_kvstore_for_gcs = get_kvstore_for_gcs
    module.is_hierarchical_namespace_enabled = lambda path: False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hook(module)` right after `name` is imported (so nothing heavy is imported at start-up)."""

    def __init__(self, name, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hook

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook(module)
        spec.loader = Loader()
        return spec


def install() -> None:
    """Make gs:// mean the rehearsal folder in this process (a no-op without $FLAXCHAT_REHEARSAL_BUCKETS)."""
    if not os.environ.get(ROOT_ENV):
        return

    def register(fsspec_module):
        from fsspec.registry import register_implementation
        cls = _filesystem_class()
        register_implementation("gs", cls, clobber=True)
        register_implementation("gcs", cls, clobber=True)
    for name, hook in (("fsspec", register), (_ORBAX_GCS, _patch_orbax)):
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            sys.meta_path.insert(0, _AfterImport(name, hook))

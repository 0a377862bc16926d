"""The Kaggle runner speaks to whoever called it: the command line's hints name its flags, pip is
quiet unless asked, and a download shows its progress. Against a real Jupyter server on 127.0.0.1
(no kernel is started: the file API alone serves a download)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jupyter_fixture import JupyterServer  # noqa: E402

from flaxchat.errors import cli_main  # noqa: E402
from flaxchat.remote import __main__ as cli_module  # noqa: E402
from flaxchat.remote.kaggle import KaggleRunner  # noqa: E402

pytestmark = pytest.mark.slow  # a real jupyter_server and kernels: CI runs it; `-m "not slow"` skips it


TOKEN = "test-token-cli"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = JupyterServer(tmp_path_factory.mktemp("jupyter-cli"), token=TOKEN).start()
    yield srv
    srv.stop()


class _Recorder:
    """KaggleRunner as the command line sees it: records what each verb was asked."""

    calls: list = []

    def __init__(self, url, token=None, **kw):
        self.kernel_id = "k"

    def run_pipeline(self, *args, **kwargs):
        _Recorder.calls.append(("run_pipeline", kwargs))

    def setup(self, *args, **kwargs):
        _Recorder.calls.append(("setup", kwargs))
        return {"changed": True, "files": 1}

    def close(self):
        pass


@pytest.mark.timeout(60)
def test_the_command_line_names_its_own_flags_and_keeps_pip_quiet_unless_asked(monkeypatch, capsys):
    import flaxchat.remote.kaggle as kaggle
    monkeypatch.setattr(kaggle, "KaggleRunner", _Recorder)
    _Recorder.calls = []
    assert cli_main(cli_module.main, ["http://127.0.0.1:1", "--pipeline", "--depth", "2"]) == 0
    assert cli_main(cli_module.main, ["http://127.0.0.1:1", "--setup", "."]) == 0
    assert cli_main(cli_module.main, ["http://127.0.0.1:1", "--setup", ".", "--verbose"]) == 0
    (_, pipeline), (_, quiet), (_, loud) = _Recorder.calls
    assert "--wait" in pipeline["hint"] and "runner." not in pipeline["hint"], pipeline
    assert quiet["verbose"] is False and loud["verbose"] is True
    assert cli_main(cli_module.main, ["http://127.0.0.1:1", "--run", "1", "--verbose"]) == 2
    assert "--verbose goes with --setup" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_setup_passes_pip_minus_q_to_the_kernel_unless_verbose(server, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = \"flaxchat\"\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    asked = []
    with KaggleRunner(server.url, TOKEN) as runner:
        runner._kernel_root = lambda: str(server.root)
        runner._send_bin = lambda: {"kernel_side": "bin/kernel_side.py", "worker": "bin/worker.py"}
        runner._call = lambda snippet, what, **p: asked.append(p) or {"kept": {}, "installed": [], "missing": [],
                                                                       "hint": ""}
        runner.setup(str(tmp_path), untracked=True, on_output=lambda s, t: None)
        runner.setup(str(tmp_path), untracked=True, on_output=lambda s, t: None, verbose=True)
    assert asked[0]["pip_args"] == ["-q"] and asked[1]["pip_args"] == []
    assert asked[0]["want"]["pip_args"] == [] == asked[1]["want"]["pip_args"]  # -q does not force a reinstall


@pytest.mark.timeout(60)
def test_a_download_shows_its_progress_in_bytes(server, tmp_path, capsys):
    blob = os.urandom(3 << 20)
    with KaggleRunner(server.url, TOKEN) as runner:
        runner.rest.upload("run/checkpoints/5/model.bin", blob, chunk_size=1 << 20)
        runner.rest.upload("run/report.md", b"# report\n")
        capsys.readouterr()
        files = runner.download("run", tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert len(files) == 2 and Path(files[0]).read_bytes() == blob
    assert "downloading 2 file(s)" in err and "100%" in err and "3.00M" in err, err[-500:]

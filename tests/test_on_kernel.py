"""flaxchat/remote/on_kernel.py: the functions that run inside the Jupyter kernel, called here as a
plain module (tests/test_kaggle.py runs them in a real kernel through a local jupyter_server)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from flaxchat.remote import cells, on_kernel

ROOT = Path(__file__).resolve().parent.parent


def test_it_imports_only_the_standard_library_and_ipython():
    """It runs before flaxchat is installed, in whatever Python the notebook has."""
    tree = ast.parse(Path(on_kernel.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__", "IPython"} <= set(sys.stdlib_module_names), names


def test_find_root_walks_up_to_the_marker_and_removes_it(tmp_path, monkeypatch):
    (tmp_path / "marker.txt").write_text("n0nce\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    assert on_kernel.find_root({"marker": "marker.txt", "nonce": "n0nce"}) == {"root": str(tmp_path)}
    assert not (tmp_path / "marker.txt").exists()
    with pytest.raises(RuntimeError, match="does not see its server's files"):
        on_kernel.find_root({"marker": "marker.txt", "nonce": "n0nce"})


def test_import_check_says_no_for_a_missing_source(tmp_path):
    assert on_kernel.import_check({"src": str(tmp_path / "nowhere")}) == {"ok": False}


def test_job_alive_asks_the_supervisor_by_path(tmp_path):
    from flaxchat.runner import worker
    assert on_kernel.job_alive({"worker": worker.__file__, "state": str(tmp_path)}) == {"alive": False}


def test_a_call_cell_carries_the_module_and_is_valid_python():
    code = cells.kernel_call("probe", {"probe_timeout": 5})
    ast.parse(code)
    assert on_kernel.RESULT_MIME in code and ".probe(" in code
    namespace: dict = {}
    exec(cells.kernel_module_code(), namespace)  # what the kernel does first: the module, by that name
    try:
        module = sys.modules[on_kernel.MODULE]
        assert module.find_root is not on_kernel.find_root and module.RESULT_MIME == on_kernel.RESULT_MIME
    finally:
        sys.modules.pop(on_kernel.MODULE, None)
    ast.parse(cells.helper_code(cells.CellFiles("f", "m", "n")))

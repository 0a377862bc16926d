"""KaggleRunner on a kernel it shares with the notebook's tab, as on Kaggle, and a stand-in made unkind.

A real jupyter_server on loopback under a Kaggle-shaped base URL; the kernel's venv holds a jax of
another version than flaxchat's pin and a CUDA plugin (dist-info stand-ins), and no package index
answers (Internet off). `NotebookTab` is a second client that runs its own long cell during the
tests and keeps every message it receives; `Proxy` cuts or freezes the runner's connections.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from flaxchat.remote import KaggleRunner
from flaxchat.remote import kernel_side
from flaxchat.remote.cells import execute

sys.path.insert(0, str(Path(__file__).parent))
from jupyter_fixture import (FAKE_JAX, KAGGLE_BASE, STAND_IN, JupyterServer, NotebookTab, Proxy,  # noqa: E402
                             fake_accelerator_dists, make_kernel_venv, snapshot_repo)

pytestmark = pytest.mark.slow  # a real jupyter_server and kernels: CI runs it; `-m "not slow"` skips it


REPO = Path(__file__).resolve().parents[1]

TOKEN = "kaggle-tab-7c2e"
SECRET = "hf_s3cr3t-value-never-shown"
quiet = lambda stream, text: None  # noqa: E731
TAB_CELL = "import time\nfor i in range({n}):\n    print('tab', i, flush=True)\n    time.sleep(0.25)\n'tab done'"
# The same cell, then busy until the test releases it (a file appears; 90 s at most): a cell of fixed
# length left a window that a loaded machine closed before the runner's request arrived behind it.
HELD_CELL = ("import os, time\nfor i in range({n}):\n    print('tab', i, flush=True)\n    time.sleep(0.25)\n"
             "deadline = time.time() + 90\nwhile not os.path.exists({release!r}) and time.time() < deadline:\n"
             "    time.sleep(0.05)\n'tab done'")


_HELD: list[Path] = []  # release files of cells still held: a failed test releases them (next fixture)


@pytest.fixture(autouse=True)
def _release_held_cells():
    """A test that fails while the tab's cell is held would leave the shared kernel busy for the
    cell's whole length, and the next tests would time out behind it."""
    yield
    while _HELD:
        _HELD.pop().touch()


def held(tab, tmp_path, n, name):
    """Start HELD_CELL in the tab and wait until it runs; returns (its msg id, the release file)."""
    release = tmp_path / f"release-{name}"
    _HELD.append(release)
    cell = tab.execute(HELD_CELL.format(n=n, release=str(release)))
    until(lambda: "tab 0" in tab.outputs(cell), 30, "the tab's cell to start")
    return cell, release


def until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return make_kernel_venv(tmp_path_factory.mktemp("venv") / "v")


@pytest.fixture(scope="module")
def server(tmp_path_factory, venv):
    srv = JupyterServer(tmp_path_factory.mktemp("kaggle"), token=TOKEN, kernel_python=venv[0],
                        base_url=KAGGLE_BASE).start()
    yield srv
    assert srv.stop() == [], "kernels survived the server's SIGTERM"


@pytest.fixture(scope="module")
def seeded(server, venv, tmp_path_factory):
    """The seed's sequence, as a user types it: KaggleRunner(url), setup(), check_devices(),
    run(code), wait(); from inside a repository with an untracked .env and kaggle.json."""
    repo = snapshot_repo(tmp_path_factory.mktemp("repo"), REPO)
    before = fake_accelerator_dists(venv[0])
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        runner = KaggleRunner(f"{server.url}/?token={TOKEN}")
        info = runner.setup(**({} if venv[1] else {"install": "path"}), on_output=quiet)
        devices = runner.check_devices(timeout=120)
        ran = runner.run("import flaxchat, os; print(os.path.realpath(flaxchat.__file__))", on_output=quiet)
        waited = runner.wait()
    finally:
        os.chdir(cwd)
    yield dict(runner=runner, info=info, devices=devices, ran=ran, waited=waited, repo=repo, before=before)
    runner.close()


@pytest.fixture
def tab(server, seeded):
    with NotebookTab(server, seeded["runner"].kernel_id) as t:
        yield t


# --------------------------------------------------------------------------------------------
# setup keeps the notebook's accelerator stack; the seed's sequence runs as written


@pytest.mark.timeout(240)
def test_seed_sequence_keeps_the_kernels_jax_and_plugin(seeded, server, venv):
    info, runner = seeded["info"], seeded["runner"]
    assert fake_accelerator_dists(venv[0]) == seeded["before"]  # jax, the CUDA plugin and pjrt: untouched
    assert info["kept"]["jax"] == FAKE_JAX and info["kept"]["jax-cuda12-plugin"] == FAKE_JAX
    assert info["offline"] is True and info["missing"] == [] and info["kept_changed"] == {}
    assert seeded["devices"]["backend"] == "cpu" and seeded["devices"]["device_count"] >= 1
    ran = seeded["ran"]
    assert ran.ok and ran.stdout.strip().startswith(os.path.realpath(info["src"]))  # flaxchat imports there
    assert seeded["waited"] is ran  # wait() after run(code) returns that run's result
    assert runner.status().state == "done"
    # the untracked secrets stayed home; the tracked files went
    assert ".env" in info["skipped"] and "kaggle.json" in info["skipped"]
    assert ".env" not in info["uploaded"] and not (Path(info["src"]) / ".env").exists()
    assert not (Path(info["src"]) / "kaggle.json").exists() and "pyproject.toml" in info["uploaded"]


@pytest.mark.timeout(30)
def test_setup_report_names_what_is_missing_offline():
    versions = {"jax": "0.5.2", "jaxlib": "0.5.2", "ml-dtypes": "0.5.1", "flax": "0.12.8", "tqdm": "4.60.0"}
    keep = kernel_side.kept(versions)
    assert keep == {"jax": "0.5.2", "jaxlib": "0.5.2", "ml-dtypes": "0.5.1"}  # the image's jax with its dtypes
    reqs = ["jax==0.10.2", "jaxlib==0.10.2", "ml_dtypes==0.6.0", "flax==0.12.8", "tqdm>=4.66,<5", "rustbpe==0.1.0",
            "pywin32; sys_platform == 'win32'"]
    assert kernel_side.unsatisfied(reqs, versions, keep) == ["tqdm>=4.66,<5", "rustbpe==0.1.0"]
    # Without a jax of its own the image's ml_dtypes (TensorFlow's, say) is not kept: ours comes with our jax.
    no_jax = {"ml-dtypes": "0.4.1", "tqdm": "4.67.0"}
    assert kernel_side.kept(no_jax) == {}
    assert kernel_side.unsatisfied(reqs, no_jax, {}) == ["jax==0.10.2", "jaxlib==0.10.2", "ml_dtypes==0.6.0",
                                                         "flax==0.12.8", "rustbpe==0.1.0"]
    assert "Internet" in kernel_side.OFFLINE_HINT and "Settings" in kernel_side.OFFLINE_HINT


@pytest.mark.timeout(30)
def test_index_reachability(monkeypatch):
    import http.server
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501s: an answer
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{httpd.server_port}/simple/")
        assert kernel_side.index_reachable(timeout=5)
    finally:
        httpd.shutdown()
        httpd.server_close()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{httpd.server_port}/simple/")  # closed now
    assert not kernel_side.index_reachable(timeout=5)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert not kernel_side.index_reachable(timeout=5)


# --------------------------------------------------------------------------------------------
# The notebook's own cell is left alone, and the runner tells the truth about its own work


@pytest.mark.timeout(90)
def test_run_timeout_behind_the_tabs_cell_is_queued_not_an_interrupt(seeded, tab, tmp_path):
    runner = seeded["runner"]
    side = tmp_path / "ran.txt"
    cell, release = held(tab, tmp_path, 12, "a")
    res = runner.run(f"open({str(side)!r}, 'w').write('ran')", timeout=1.0, on_output=quiet, env={"K": "v"})
    assert not res.ok and res.state == "queued" and "cancelled" in res.error_value and res.request_id
    assert not list((Path(seeded["info"]["src"]).parent / "cells").glob("env-*"))  # its env file is gone too
    assert runner.status().state == "queued"
    release.touch()
    assert tab.wait_idle(cell, 30)
    assert tab.reply(cell)["status"] == "ok" and tab.outputs(cell).count("tab ") == 12  # never interrupted
    after = runner.run("print('next')", timeout=30, on_output=quiet)
    assert after.ok and after.stdout == "next\n"
    assert not side.exists()  # the cancelled request never ran

    # stop() from another thread while our run() waits behind the tab's cell: cancelled, not an interrupt
    cell, release = held(tab, tmp_path, 12, "b")
    box = {}
    worker = threading.Thread(target=lambda: box.update(res=runner.run(
        f"open({str(side)!r}, 'w').write('ran')", timeout=30, on_output=quiet)))
    worker.start()
    until(lambda: runner.status().state == "running", 30, "the run to be submitted")
    runner.stop()  # while the tab's cell still runs; the cancelled run() returns once that cell ends
    release.touch()
    worker.join(30)
    assert box["res"].state == "queued" and not box["res"].ok and "did not run" in box["res"].error_value
    assert tab.wait_idle(cell, 30) and tab.reply(cell)["status"] == "ok" and tab.outputs(cell).count("tab ") == 12
    assert not side.exists()
    assert runner.wait() is box["res"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_job_wait_status_stop_with_the_tab_busy_and_the_secret_unseen(seeded, tab, tmp_path):
    runner = seeded["runner"]
    script = tmp_path / "stand_in.py"
    script.write_text("import os\nprint('token', os.environ['HF_TOKEN'], flush=True)\n" + STAND_IN)
    runner.run_pipeline(command=[str(script), "--steps=3", "--sleep=0.5", "--run-dir={run_dir}"], name="busy-tab",
                        secrets={"HF_TOKEN": SECRET}, env={"MODE": "x"})
    cell = tab.execute(TAB_CELL.format(n=240))  # a minute of the kernel busy with the notebook's cell
    time.sleep(0.3)
    assert runner.status().state == "running"
    res = runner.wait(timeout=50, on_output=quiet, poll_interval=0.2)  # followed without the kernel
    assert tab.reply(cell) is None  # the tab's cell was running all along
    assert res.ok and res.exit_codes == {0: 0}
    assert "token ***" in res.stdout and SECRET not in res.stdout and "step 2 loss" in res.stdout
    assert runner.status().state == "done"
    seeded["runner"].rest.interrupt(seeded["runner"].kernel_id)  # the notebook's user ends their cell
    assert tab.wait_idle(cell, 30)

    runner.run_pipeline(command=[str(script), "--steps=400", "--sleep=0.05", "--run-dir={run_dir}"], name="to-stop",
                        secrets={"HF_TOKEN": SECRET})
    cell, release = held(tab, tmp_path, 40, "c")
    t0 = time.monotonic()
    runner.stop()  # the tab's cell runs: the job goes, that cell stays
    assert time.monotonic() - t0 < 20
    res = runner.wait(timeout=20, on_output=quiet, poll_interval=0.2)
    assert not res.ok and res.exit_codes == {0: 143} and runner.status().state == "failed"
    assert server_kernel_state(seeded) == "busy"  # still the tab's cell
    release.touch()
    assert tab.wait_idle(cell, 40) and tab.reply(cell)["status"] == "ok" and tab.outputs(cell).count("tab ") == 40
    assert not any(SECRET in frame for frame in tab.raw), "the secret reached another client"


def server_kernel_state(seeded) -> str:
    r = seeded["runner"]
    return r.rest.kernel(r.kernel_id)["execution_state"]


@pytest.mark.timeout(60)
def test_run_env_travels_as_a_file_not_as_code(seeded, tab):
    res = seeded["runner"].run("import os; print(os.environ['FC_TOKEN'] == 'tok-' + 'abc123')",
                               env={"FC_TOKEN": "tok-abc123"}, on_output=quiet)
    assert res.ok and res.stdout == "True\n"
    time.sleep(0.3)
    assert not any("tok-abc123" in frame for frame in tab.raw)


# --------------------------------------------------------------------------------------------
# Lost output is never ok: the rate limit, drops with and without the tab, a frozen socket


@pytest.mark.timeout(90)
def test_big_print_dropped_by_the_rate_limit_is_recovered_or_incomplete(seeded):
    runner = seeded["runner"]
    code = "print('x' * 5_500_000); 'big'"
    res = runner.run(code, on_output=quiet)
    assert res.ok and len(res.stdout) == 5_500_001 and res.result == "'big'" and not res.incomplete
    assert res.output_file  # the bulk output sits in a file on the server: fetched for this result
    plain = execute(runner._connect(), runner.rest, code, on_output=quiet)  # no helper files: cannot recover
    assert not plain.ok and plain.incomplete and "never arrived" in plain.error_value


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_tab", [False, True], ids=["alone", "tab-attached"])
def test_cut_connection_mid_cell_loses_nothing(server, seeded, tmp_path, with_tab):
    side = tmp_path / "effects.txt"
    cell = (f"import time\nopen({str(side)!r}, 'a').write('start\\n')\nprint('line 0', flush=True)\n"
            "time.sleep(0.5)\nfor i in range(1, 8):\n    print(f'line {i}', flush=True)\n    time.sleep(0.1)\n"
            f"open({str(side)!r}, 'a').write('end\\n')\n'result'")
    proxy = Proxy(server.port)
    tab = NotebookTab(server, seeded["runner"].kernel_id) if with_tab else None
    try:
        with KaggleRunner(proxy.url(server), TOKEN, kernel_id=seeded["runner"].kernel_id) as r:
            r.run("pass", on_output=quiet)

            def on_output(stream, text):
                if "line 0" in text:
                    proxy.cut()
                    threading.Timer(0.8, proxy.restore).start()
            res = r.run(cell, on_output=on_output, timeout=60)
            assert r.connection.connects >= 2
    finally:
        proxy.close()
        if tab:
            tab.close()
    assert res.ok and res.stdout == "".join(f"line {i}\n" for i in range(8)) and res.result == "'result'", res
    assert side.read_text() == "start\nend\n"


@pytest.mark.timeout(120)
def test_reattach_after_the_reconnect_window(server, seeded, tab):
    proxy = Proxy(server.port)
    try:
        with KaggleRunner(proxy.url(server), TOKEN, kernel_id=seeded["runner"].kernel_id, reconnect_window=2) as r:
            r.run("pass", on_output=quiet)

            def on_output(stream, text):
                if "a" in text:
                    proxy.cut()
            res = r.run("import time\nprint('a', flush=True)\ntime.sleep(3)\nprint('b', flush=True)\n'end'",
                        on_output=on_output)
            assert not res.ok and res.state == "unknown" and res.error_name == "ConnectionLost"
            assert res.request_id and f"reattach({res.request_id!r})" in res.error_value
            assert r.status().state == "unknown"
            proxy.restore()
            back = r.reattach(res.request_id, timeout=30, on_output=quiet)
            assert back.ok and back.stdout == "a\nb\n" and back.result == "'end'"
            assert r.wait() is back
    finally:
        proxy.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_frozen_connection_is_detected_and_replaced(server, seeded):
    proxy = Proxy(server.port)
    try:
        with KaggleRunner(proxy.url(server), TOKEN, kernel_id=seeded["runner"].kernel_id, ping_after=1,
                          pong_timeout=1.5) as r:
            r.run("pass", on_output=quiet)

            def on_output(stream, text):
                if "a" in text:
                    proxy.freeze()
                    threading.Timer(3.0, proxy.thaw).start()
            t0 = time.monotonic()
            res = r.run("import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b', flush=True)\n'end'",
                        on_output=on_output, timeout=40)
            assert res.ok and res.stdout == "a\nb\n" and res.result == "'end'" and r.connection.connects == 2
            assert time.monotonic() - t0 < 20
    finally:
        proxy.close()


@pytest.mark.timeout(120)
def test_restart_mid_cell_is_reported_as_a_restart(server, venv, tmp_path):
    with KaggleRunner(server.url, TOKEN, new_kernel=True) as r:
        try:
            r.run("pass", on_output=quiet)
            headers = {"Authorization": f"token {TOKEN}"}
            threading.Timer(1.0, lambda: requests.post(f"{server.url}/api/kernels/{r.kernel_id}/restart",
                                                       headers=headers, timeout=60)).start()
            t0 = time.monotonic()
            res = r.run("import time; time.sleep(30)", timeout=60, on_output=quiet)
            assert not res.ok and res.error_name == "KernelRestarted" and "memory" in res.error_value
            assert time.monotonic() - t0 < 20
            assert r.run("print('x' in globals())", timeout=30, on_output=quiet).stdout == "False\n"
        finally:
            server.shutdown_kernel(r.kernel_id)


# --------------------------------------------------------------------------------------------
# resume a stopped run, resume a broken download


@pytest.mark.timeout(120)
def test_resume_into_the_same_run_folder_and_resume_a_download(seeded, tmp_path):
    runner = seeded["runner"]
    script = tmp_path / "count.py"
    script.write_text("import os, sys\nd = os.environ['FLAXCHAT_RUN_DIR']\nn = len(os.listdir(d))\n"
                      "open(os.path.join(d, f'start-{n}'), 'w').write('x' * 100_000)\nprint('starts', n, flush=True)\n")
    runner.run_pipeline(command=[str(script)], name="resumable")
    assert runner.wait(timeout=30, on_output=quiet, poll_interval=0.2).ok
    with pytest.raises(Exception, match="exists already"):
        runner.run_pipeline(command=[str(script)], name="resumable")
    runner.run_pipeline(command=[str(script)], resume=True)  # the last job's folder, by default
    res = runner.wait(timeout=30, on_output=quiet, poll_interval=0.2)
    assert res.ok and "starts 2" in res.stdout and "starts 1" not in res.stdout  # only the new part of the log

    remote = f"{runner.job.remote_dir}/start-1"
    target = tmp_path / "dl" / "start-1"
    target.parent.mkdir()
    (target.parent / "start-1.part").write_bytes(b"x" * 40_000)  # a download cut short earlier
    seen = []
    real = runner.rest.download_file
    runner.rest.download_file = lambda path, f, size, start=0: seen.append(start) or real(path, f, size, start=start)
    try:
        assert runner.download(remote, target.parent) == [str(target)]
    finally:
        runner.rest.download_file = real
    assert seen == [40_000] and target.read_bytes() == b"x" * 100_000 and not (target.parent / "start-1.part").exists()

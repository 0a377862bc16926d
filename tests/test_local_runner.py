"""LocalRunner: the RemoteRunner verbs on this machine, the work in a detached process."""

import os
import subprocess
import sys
import time

import pytest

from flaxchat.remote import LocalRunner, RemoteRunner, RemoteTimeout, RunResult, RunStatus
from flaxchat.errors import UserError

pytestmark = pytest.mark.slow  # real supervised processes: CI runs it; `-m "not slow"` skips it


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = LocalRunner(workdir=str(tmp_path), state_dir=str(tmp_path / "state"), poll_s=0.05)
    yield r
    r.stop()


def test_is_a_remote_runner_and_idle_at_first(runner):
    assert isinstance(runner, RemoteRunner)
    assert runner.status().state == "idle"


@pytest.mark.timeout(30)
def test_run_returns_at_once_and_wait_streams_output(runner, tmp_path):
    t0 = time.monotonic()
    started = runner.run("echo one; sleep 0.5; echo two >&2; echo $MODE", env={"MODE": "fast"})
    assert isinstance(started, RunResult) and started.state == "running" and started.ok
    assert time.monotonic() - t0 < 5
    chunks = []
    result = runner.wait(timeout=20, on_output=lambda stream, text: chunks.append((stream, text)))
    text = "".join(t for _, t in chunks)
    assert "one\n" in text and "two\n" in text and "fast\n" in text
    assert result.state == "done" and result.ok and result.exit_codes == {0: 0} and "fast" in result.stdout
    assert runner.status().state == "done"


@pytest.mark.timeout(30)
def test_failure_has_the_exit_code_and_last_line(runner):
    runner.run("echo 'ValueError: bad'; exit 3")
    result = runner.wait(timeout=20)
    assert not result.ok and result.state == "failed" and result.exit_codes == {0: 3}
    assert "exited with code 3: ValueError: bad" in result.error_value
    with pytest.raises(Exception, match="state failed|exited with code 3"):
        result.raise_for_error()


@pytest.mark.timeout(30)
def test_detached_process_survives_the_python_that_started_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    state = str(tmp_path / "state")
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from flaxchat.remote import LocalRunner; "
            f"LocalRunner(workdir={str(tmp_path)!r}, state_dir={state!r}).run('sleep 1; echo survived')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    runner = LocalRunner(workdir=str(tmp_path), state_dir=state, poll_s=0.05)
    assert runner.status().state == "running"
    assert "survived" in runner.wait(timeout=20).stdout


@pytest.mark.timeout(30)
def test_stop_wait_timeout_and_one_run_at_a_time(runner):
    runner.run("sleep 30")
    with pytest.raises(UserError, match="already going"):
        runner.run("echo second")
    with pytest.raises(RemoteTimeout):
        runner.wait(timeout=0.2)
    assert runner.status().state == "running"  # a timeout never kills the work
    runner.stop()
    status = runner.status()
    assert isinstance(status, RunStatus) and status.state == "failed" and "143" in status.detail


@pytest.mark.timeout(30)
def test_secrets_stay_out_of_the_process_list_and_the_log(runner, tmp_path):
    secret = "sk-local-5e5e5e5e"
    runner.run("echo key=$API_KEY; sleep 1", secrets={"API_KEY": secret})
    time.sleep(0.3)
    assert secret not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    result = runner.wait(timeout=20)
    assert "key=***" in result.stdout and secret not in result.stdout
    assert secret not in open(tmp_path / "state" / "output.log").read()
    assert oct(os.stat(tmp_path / "state" / "run.env").st_mode & 0o777) == "0o600"


@pytest.mark.timeout(30)
def test_completion_marker_decides_done(runner, tmp_path):
    runner.run("true", marker="COMPLETE")
    assert runner.wait(timeout=20).state == "failed"
    runner.run("echo '{}' > COMPLETE", marker="COMPLETE")
    assert runner.wait(timeout=20).ok


@pytest.mark.timeout(60)
def test_setup_and_check_devices(runner):
    runner.setup(REPO)
    runner.setup(REPO)  # idempotent
    assert runner.check_devices() == {"backend": "cpu", "device_count": 1, "process_count": 1}

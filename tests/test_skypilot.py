"""flaxchat.cloud.skypilot: the managed-job task, checked by SkyPilot's own parser and schema.

SkyPilot cannot share flaxchat's environment (skypilot 0.14.1 pins uvicorn<0.36, flaxchat 0.54.0),
so it lives in a venv of its own, as it would on a user's machine, and the parser runs there in a
subprocess: FLAXCHAT_SKYPILOT_PYTHON names that venv's python (or this interpreter, if it imports
sky); without one the test makes that venv under .pytest_cache/ (pip, ~60 s and ~460 MB once) and
skips with the reason only where pip cannot install it. The rest runs anywhere.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from flaxchat.cloud.skypilot import JobSpec, task_for, to_yaml
from flaxchat.cloud.topology import topology_for
from flaxchat.errors import ExitCode

pytestmark = pytest.mark.slow  # an emulated cloud with real processes: CI runs it; `-m "not slow"` skips it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKY_PYTHON = os.environ.get("FLAXCHAT_SKYPILOT_PYTHON") or (
    sys.executable if importlib.util.find_spec("sky") else None)
NO_SKY = ("SkyPilot is not installed here (it cannot share flaxchat's environment): "
          "python -m venv ~/sky && ~/sky/bin/pip install 'skypilot==0.14.1', then set "
          "FLAXCHAT_SKYPILOT_PYTHON=~/sky/bin/python to run SkyPilot's parser on the tasks")

RUN = "python -m scripts.pretrain --depth=20"
CASES = {  # the three shapes the issue names: one chip, one 8-chip VM, a 16-host pod slice
    "v5litepod-1": JobSpec(run=RUN, run_dir="gs://b/one", accelerator="v5litepod-1"),
    "v5litepod-8": JobSpec(run=RUN, run_dir="gs://b/d20", accelerator="v5litepod-8", spot=True, zone="us-west4-a"),
    "v6e-64": JobSpec(run=RUN, run_dir="gs://b/d32", accelerator="v6e-64", spot=True, region="us-east5",
                      strategy="FAILOVER", max_restarts_on_errors=5, env={"FLAXCHAT_CACHE_DIR": "off"},
                      secrets=("WANDB_API_KEY",)),
}

# Run in SkyPilot's venv: for each task file, its own schema check and its Task parser; a parsed
# resource's fields come back as JSON. A bad exit code and a misspelt key must be refused by the same
# parser. (Offline, it does not check the accelerator against a cloud's catalog: `sky jobs launch` does.)
_PARSE = r"""
import json, sys, yaml
import sky
from sky.utils import common_utils, schemas

out = {}
for path in sys.argv[1:]:
    config = yaml.safe_load(open(path))
    common_utils.validate_schema(config, schemas.get_task_schema(), "task schema: ")
    common_utils.validate_schema(config["resources"], schemas.get_resources_schema(), "resources schema: ")
    task = sky.Task.from_yaml(path)  # validates both again, and builds the Task and its Resources
    (r,) = task.resources
    out[path] = dict(accelerators=r.accelerators, use_spot=r.use_spot, zone=r.zone, region=r.region,
                     job_recovery=r.job_recovery, accelerator_args=r.accelerator_args, cloud=str(r.cloud),
                     num_nodes=task.num_nodes, envs=task.envs, secrets=sorted(ref.name for ref in task.managed_secret_refs),
                     workdir=task.workdir, setup=task.setup, run=task.run)
out["refused"] = []
for key, value in (("recover_on_exit_codes", [256]), ("use_spots", True)):  # an exit code > 255; a misspelt key
    bad = yaml.safe_load(open(sys.argv[1]))
    where = bad["resources"]["job_recovery"] if key.startswith("recover") else bad["resources"]
    where[key] = value
    try:
        sky.Task.from_yaml_config(bad)
    except sky.exceptions.InvalidSkyPilotConfigError as e:
        out["refused"].append(str(e))
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def sky_python():
    """A python that imports SkyPilot: the one named, or a venv of its own made once here."""
    if SKY_PYTHON:
        return SKY_PYTHON
    venv = os.path.join(ROOT, ".pytest_cache", "skypilot-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "ok")):
        made = subprocess.run([sys.executable, "-m", "venv", "--clear", venv], capture_output=True, text=True)
        pip = made.returncode == 0 and subprocess.run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "skypilot==0.14.1"],
            capture_output=True, text=True, timeout=600)
        if not pip or pip.returncode != 0:
            pytest.skip(f"{NO_SKY} (pip could not install it here: "
                        f"{((pip.stderr if pip else made.stderr) or '').strip()[-200:]})")
        open(os.path.join(venv, "ok"), "w").close()
    return python


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_skypilots_parser_accepts_one_chip_a_v5litepod_8_and_a_v6e_64(tmp_path, sky_python):
    paths = {}
    for name, spec in CASES.items():
        paths[name] = str(tmp_path / f"{name}.yaml")
        with open(paths[name], "w") as f:
            f.write(to_yaml(task_for(spec)))
    r = subprocess.run([sky_python, "-c", _PARSE, *paths.values()], cwd=tmp_path, capture_output=True, text=True,
                       timeout=280, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    refused = out.pop("refused")  # the schema is really checked: both bad variants are refused
    assert len(refused) == 2 and "256" in refused[0] and "use_spots" in refused[1], refused
    one, v5e, v6e = (out[paths[n]] for n in CASES)
    assert one["accelerators"] == {"tpu-v5litepod-1": 1} and one["use_spot"] is False
    assert one["zone"] is None and one["region"] is None and one["cloud"] == "GCP"
    assert v5e["accelerators"] == {"tpu-v5litepod-8": 1} and v5e["use_spot"] is True
    assert (v5e["zone"], v5e["region"]) == ("us-west4-a", "us-west4")
    assert v5e["accelerator_args"] == {"runtime_version": "v2-alpha-tpuv5-lite"}
    assert v5e["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3,
                                   "recover_on_exit_codes": [int(ExitCode.PREEMPTED)]}
    assert v6e["accelerators"] == {"tpu-v6e-64": 1} and v6e["region"] == "us-east5"
    assert v6e["job_recovery"] == {"strategy": "FAILOVER", "max_restarts_on_errors": 5, "recover_on_exit_codes": [75]}
    assert v6e["envs"] == {"FLAXCHAT_CACHE_DIR": "off"} and v6e["secrets"] == ["WANDB_API_KEY"]
    for t in (one, v5e, v6e):
        # one task node: SkyPilot itself runs it on every host of a pod slice
        assert t["num_nodes"] == 1 and t["workdir"] == "." and "-e '.[tpu,gcs,hub]'" in t["setup"]
        assert t["run"].rstrip().endswith(f"{RUN} --run-dir=gs://b/" + ("one" if t is one else "d20" if t is v5e else "d32"))
    assert "JAX_COORDINATOR_ADDRESS" in v6e["run"] and "JAX_COORDINATOR_ADDRESS" not in v5e["run"]


def test_every_host_of_a_pod_slice_joins_one_jax_job(tmp_path):
    """The run script, executed by bash as SkyPilot runs it on each of a v6e-64's 16 hosts: each gets
    the same coordinator (the first host, port 8476), 16 processes, and its own rank as process id."""
    hosts = topology_for("v6e-64").workers
    assert hosts == 16
    ips = "\n".join(f"10.0.0.{i + 1}" for i in range(hosts))
    probe = (f"{sys.executable} -c \"import os, sys; print(os.environ['JAX_COORDINATOR_ADDRESS'], "
             "os.environ['JAX_NUM_PROCESSES'].strip(), os.environ['JAX_PROCESS_ID'], sys.argv[1:])\"")
    script = task_for(JobSpec(run=probe, run_dir="gs://b/r", accelerator="v6e-64"))["run"]
    seen = []
    for rank in (0, 7, 15):
        r = subprocess.run(["bash", "-c", script], env=dict(os.environ, SKYPILOT_NODE_IPS=ips,
                           SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NUM_NODES="16"),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        seen.append(r.stdout.strip())
    assert seen == [f"10.0.0.1:8476 16 {rank} ['--run-dir=gs://b/r']" for rank in (0, 7, 15)]


def test_the_task_is_plain_data_and_skypilot_is_never_imported(tmp_path):
    task = task_for(CASES["v5litepod-8"])
    assert yaml.safe_load(to_yaml(task)) == task
    assert json.loads(json.dumps(task)) == task  # dicts, lists, strings, numbers
    out = tmp_path / "t.yaml"
    code = ("import sys; from flaxchat.cloud.skypilot import main; main(['--accelerator', 'v6e-64', '--run', 'true', "
            f"'--run-dir', 'gs://b/r', '--out', {str(out)!r}]); assert 'sky' not in sys.modules, 'sky imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sky jobs launch" in r.stderr and yaml.safe_load(out.read_text())["resources"]["accelerators"] == "tpu-v6e-64"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flaxchat.cloud.skypilot", *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)


def test_help_and_bad_input_is_one_sentence():
    r = _cli("--help")
    assert r.returncode == 0
    for flag in ("--accelerator", "--zone", "--region", "--spot", "--run ", "--run-dir", "--max-restarts",
                 "--strategy", "--secret", "--out"):
        assert flag in r.stdout, flag
    ok = ("--run", RUN, "--run-dir", "gs://b/r")
    for args, says in [(("--accelerator", "v5e-3", *ok), "unknown TPU accelerator type 'v5e-3'"),
                       (("--run-dir", "gs://b/r"), "--run needs the stage's command"),
                       (("--run", RUN), "--run-dir is required"),
                       (("--run", RUN, "--run-dir", "runs/d20"), "--run-dir must be a gs:// folder"),
                       (("--zone", "us-west4-a", "--region", "us-east5", *ok), "is not in --region"),
                       (("--max-restarts", "-1", *ok), "--max-restarts must be 0 or more"),
                       (("--env", "NOEQUALS", *ok), "--env takes KEY=VALUE")]:
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and says in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr

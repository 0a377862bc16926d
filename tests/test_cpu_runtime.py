"""flaxchat.kernels.tune_process: a training process whose step runs on a CPU restarts once with
glibc's malloc tunables (kernels.cpu.tune_runtime) and runs its jitted calls on the main thread, so
the large block XLA:CPU takes for a step's temporaries is kept between steps instead of being
mapped, faulted in and unmapped every step. Where the step runs on an accelerator nothing happens."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # end to end: processes that restart themselves: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A step-like call: a 256 MiB product as a temporary (larger than a thread's malloc heap can hold),
# reduced to one number. Page faults per call, after two warm-up calls.
PROBE = textwrap.dedent("""
    import json, os, resource
    from flaxchat.kernels import tune_process
    tune_process()
    import jax, jax.numpy as jnp
    f = jax.jit(lambda a, b: ((a @ b) @ b.T).sum())
    a, b = jnp.ones((8192, 64)), jnp.ones((64, 8192))
    for _ in range(2):
        f(a, b).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        f(a, b).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    print(json.dumps(dict(tunables=os.environ.get("GLIBC_TUNABLES"), faults=faults,
                          async_dispatch=bool(jax.config.read("jax_cpu_enable_async_dispatch")))))
""")


def _probe(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "FLAXCHAT_NO_CPU_TUNING")}
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=dict(base, **{"JAX_PLATFORMS": "cpu", **env}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux only")
def test_a_tuned_process_keeps_the_step_temporaries_between_calls():
    from flaxchat.kernels.cpu import MALLOC_TUNABLES
    plain = _probe(FLAXCHAT_NO_CPU_TUNING="1")
    tuned = _probe()
    assert plain["tunables"] is None and plain["async_dispatch"]
    assert tuned["tunables"] == MALLOC_TUNABLES and not tuned["async_dispatch"]
    # Untuned, the 256 MiB temporary is faulted in afresh every call (4 KiB pages: 65,537 faults);
    # tuned, it stays mapped from one call to the next (0 measured). The same tunables with the
    # call on a dispatch thread read 333 (2 MiB pages, mapped afresh), huge pages alone 355.
    assert plain["faults"] > 1000, plain
    assert tuned["faults"] < 20, (tuned, plain)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux only")
def test_the_users_own_glibc_tunables_are_kept_with_async_dispatch():
    mine = "glibc.malloc.hugetlb=1"
    r = _probe(GLIBC_TUNABLES=mine)
    assert r["tunables"] == mine and r["async_dispatch"]


ACCELERATOR_HOST = textwrap.dedent("""
    import os, sys
    from flaxchat.kernels import runs_on_cpu, tune_process
    print("start", os.environ.get("GLIBC_TUNABLES"), runs_on_cpu(), flush=True)
    tune_process()
    print("after", os.environ.get("GLIBC_TUNABLES"), flush=True)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux only")
@pytest.mark.parametrize("platforms", ["tpu", "cuda,cpu"])
def test_a_process_whose_step_runs_on_an_accelerator_is_not_restarted(platforms):
    """JAX_PLATFORMS naming an accelerator first (a TPU VM, a Kaggle GPU kernel): no restart, no
    tunables; the accelerator is not started to ask (it is decided from the environment)."""
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "FLAXCHAT_NO_CPU_TUNING")}
    r = subprocess.run([sys.executable, "-c", ACCELERATOR_HOST], cwd=ROOT, env=dict(base, JAX_PLATFORMS=platforms),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["start None False", "after None"]  # printed once: no second start
    cpu = subprocess.run([sys.executable, "-c", ACCELERATOR_HOST], cwd=ROOT, env=dict(base, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=60)
    assert cpu.stdout.splitlines()[0] == "start None True"  # the first start; then restarted with the tunables
    assert cpu.stdout.splitlines()[1].startswith("start glibc.malloc.hugetlb=1"), cpu.stdout


def test_runs_on_cpu_reads_the_installed_plugins(monkeypatch):
    """Without JAX_PLATFORMS, an installed accelerator plugin (libtpu on a TPU VM, jax's CUDA plugin)
    means the step runs there; with none, on the CPU."""
    import importlib.util

    from flaxchat import kernels
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert kernels.runs_on_cpu()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "libtpu" else None)
    assert not kernels.runs_on_cpu()

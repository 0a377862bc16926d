"""compute_init turns JAX's persistent compilation cache on, one folder per topology, so a
resumed run or the next stage loads its train step instead of compiling it; a folder the user
chose (JAX_COMPILATION_CACHE_DIR) wins, and FLAXCHAT_CACHE_DIR=off turns it off."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # end to end: fresh processes compiling: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flaxchat.common import compute_init
    compute_init("float32")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # keep even this small program
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
    print("DIR", jax.config.jax_compilation_cache_dir)
""")


def _run(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "FLAXCHAT_CACHE"))}
    base.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu", FLAXCHAT_NO_CPU_TUNING="1", **env)
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_cache_is_on_by_default_in_a_folder_per_topology(tmp_path):
    out = _run(tmp_path)
    folder = tmp_path / ".cache" / "flaxchat" / "jax" / "cpu-cpu-1x1"
    assert f"compile cache: {folder}" in out and f"DIR {folder}" in out, out
    assert any(folder.iterdir()), "nothing was written to the cache"


def test_the_users_folder_wins_and_off_turns_it_off(tmp_path):
    mine = tmp_path / "mine"
    out = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine))
    assert "compile cache:" not in out and f"DIR {mine}" in out and any(mine.iterdir())
    out = _run(tmp_path, FLAXCHAT_CACHE_DIR="off")
    assert "compile cache:" not in out and "DIR None" in out
    assert not (tmp_path / ".cache" / "flaxchat").exists()


def test_a_cache_in_a_bucket_is_written_there_and_makes_no_local_folder(tmp_path):
    """The launcher sets FLAXCHAT_CACHE_DIR=gs://.../xla-cache for a run folder in a bucket, so that a
    recreated VM loads the step; JAX writes gs:// itself (etils.epath, here over the rehearsal's bucket),
    and nothing named gs: appears in the working folder."""
    buckets = tmp_path / "buckets"
    (buckets / "bk").mkdir(parents=True)
    probe = "from flaxchat.cloud.rehearsal import bucket; bucket.install()\n" + PROBE
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "FLAXCHAT_CACHE"))}
    env.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu", FLAXCHAT_NO_CPU_TUNING="1",
               FLAXCHAT_REHEARSAL_BUCKETS=str(buckets), FLAXCHAT_CACHE_DIR="gs://bk/run/xla-cache",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compile cache: gs://bk/run/xla-cache/jax/cpu-cpu-1x1" in r.stdout, r.stdout
    folder = buckets / "bk" / "run" / "xla-cache" / "jax" / "cpu-cpu-1x1"
    assert folder.is_dir() and any(folder.iterdir()), "nothing was written to the bucket"
    assert not (tmp_path / "gs:").exists()

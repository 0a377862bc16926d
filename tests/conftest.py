"""Shared test setup.

JAX's persistent compilation cache is pointed at one folder for the whole session and inherited by
every subprocess the tests start: the tiny training runs compile the same train step again and
again (resume tests start the same script three times), and on 2 cores compiling is most of their
time. The cache lives under .pytest_cache/ (git-ignored) and never changes results.
"""

import os

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# On an accelerator the suite compares fp32 results at full matmul precision: a TPU's default runs
# fp32 matmuls through bf16 passes, and agrees with a CPU to about 3 digits where "highest" agrees
# to about 7 (measured on a v5e), which is what the fp32 tolerances of these tests state. The
# tests of bf16 kernels keep their own bf16 tolerances. `python -m pytest -n 0` on a TPU VM runs the
# suite there (docs/accelerators.md); CI runs on CPU, where this changes nothing.
if os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() not in ("", "cpu"):
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
else:
    import importlib.util
    if any(importlib.util.find_spec(p) for p in ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin")):
        os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def pytest_report_header(config):
    import jax
    return f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); " \
           f"matmul precision {jax.config.jax_default_matmul_precision or 'default'}"


import pytest  # noqa: E402

# The two workers take whole files (--dist loadfile), each the next one in collection order when it runs
# dry. xdist's default order, most tests first, left the heavy end-to-end files of few tests (run_folder,
# multihost, preemption, sharding) to the end, where one of them can run alone while the other worker
# idles. The heaviest files (by their summed test time in a full run, 2026-12-06) start first
# instead; every other file follows in its usual place. pyproject's --no-loadscope-reorder keeps it.
HEAVY_FIRST = ["test_nothing_lost.py", "test_sft_rl.py", "test_preemption.py", "test_sharding.py", "test_bf16.py",
               "test_launcher.py", "test_scale.py", "test_bench_throughput.py", "test_attention.py", "test_train.py",
               "test_optim.py", "test_gpt.py", "test_trackers.py", "test_kaggle.py", "test_evaluation.py",
               "test_run_folder.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: a file's own order stays


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: a real `No space left on device` for a 1.1 MB step (keep 2: 3 on disk in a save).
    Skips where it cannot be mounted (not root, no tmpfs); tests/test_checkpoint_integrity.py has a
    stand-in that fails a write the way a full disk does."""
    import subprocess
    import uuid
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root; the stand-in test covers the same path")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", f"flaxchat-{uuid.uuid4().hex[:6]}", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:120]})")
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="session")
def tokenizer():
    """A 512-token BPE tokenizer of the built-in stories (tests/support.py), trained once per worker;
    a module that needs another defines its own `tokenizer`."""
    from support import stories_tokenizer
    return stories_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The tokenizer of the tiny pretraining runs (support.TINY_RUN), made by a 1-step run of
    scripts.pretrain, which also puts its train step in the compile cache; once per worker (four files
    made one each)."""
    import subprocess
    import sys
    from support import REPO, tiny_flags
    d = tmp_path_factory.mktemp("tok")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "scripts.pretrain", *tiny_flags(eval_every=0, sample_every=0),
                        f"--run-dir={d / 'warm'}", f"--tokenizer-dir={d / 'tokenizer'}", "--steps=1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return str(d / "tokenizer")

"""The users' path on the CPU: bf16, as TPUs and GPUs train, with everything but the Pallas kernels.

CI runs on a CPU in fp32 by default while users train in bf16 on TPUs, so the bf16 path could change
unseen (a state array whose dtype drifted compiled every bf16 run's step twice). These tests run the
model, the step, the optimizer, device_check --quick, a short pretrain and SFT in bf16 and count the
step's compiles. `python -m pytest tests/test_bf16.py` is the bf16 lane.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_init
from flaxchat.config import config_for_depth
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, make_optimizer
from flaxchat.train import StepLoop, check_same_types
from support import COMPILED, CompileLog

pytestmark = pytest.mark.slow  # end to end: bf16 training runs: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def compiles():
    handler, logger = CompileLog(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield handler.names
    finally:
        logger.removeHandler(handler)


def _bf16_state(depth=2, total_steps=20, seq=32):
    compute = compute_init("bfloat16").with_sharding("dp")
    cfg = config_for_depth(depth, vocab_size=256, sequence_len=seq)
    opt_cfg = OptimConfig(n_embd=cfg.n_embd, ns_dtype=compute.polar.ns_dtype)
    with jax.set_mesh(compute.mesh):
        model, optimizer = sharding.create_sharded(
            lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=compute.compute_dtype, kernels=compute.kernels),
            lambda m: make_optimizer(m, opt_cfg, Schedule(total_steps), compute.polar), compute.mesh)
    return compute, cfg, model, optimizer


def _types(arrays):
    return [(a.dtype, a.shape, a.weak_type) for a in arrays]


@pytest.mark.timeout(300)
def test_a_bf16_step_keeps_every_state_type_and_compiles_once(compiles):
    compute, cfg, model, optimizer = _bf16_state()
    assert model.wte.embedding[...].dtype == jnp.bfloat16  # the tables the drift came from
    loop = StepLoop(model, optimizer)
    before, shardings = _types(loop.arrays), [a.sharding for a in loop.arrays]
    x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 2, cfg.sequence_len), np.int32))
    with jax.set_mesh(compute.mesh):
        losses = [float(loop(x, x)) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert _types(loop.arrays) == before
    assert all(a.sharding.is_equivalent_to(b, a.ndim) for a, b in zip(loop.arrays, shardings))
    assert compiles.count("step") == 1, compiles


def test_a_step_that_changes_a_state_type_is_refused_when_traced():
    arrays = [jnp.zeros((3,), jnp.bfloat16), jnp.zeros((2,), jnp.float32)]
    treedef = jax.tree.structure({"mu": {"wte": 0}, "nu": {"wte": 0}})

    def drifting(arrays):
        out = [arrays[0].astype(jnp.float32), arrays[1]]
        check_same_types(arrays, out, treedef)
        return out

    with pytest.raises(TypeError, match=r"1 state array.*\['mu'\]\['wte'\]: bfloat16\[3\] -> float32\[3\]"):
        jax.jit(drifting)(arrays)
    jax.jit(lambda a: (check_same_types(a, list(a), treedef), a)[1])(arrays)  # unchanged types pass


@pytest.mark.parametrize("total", [1, 7, 30, 1000, 4321])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.65])
@pytest.mark.parametrize("kind", ["pretrain", "finetune"])
def test_the_run_time_horizon_gives_the_constant_schedule(total, ratio, kind):
    """The LR and weight decay bit for bit; Muon's momentum within 2 ulp in the warmdown, where XLA
    folds a constant horizon into the products around it (0.90 * (s - start) / w became
    (s - start) * 0.0018), which a run-time one cannot reproduce."""
    s = Schedule(total, warmup_steps=3, warmdown_ratio=ratio, momentum=kind,
                 weight_decay="cosine" if kind == "pretrain" else "constant")
    steps = jnp.arange(total + 3)
    for f in (s.lr_multiplier, s.weight_decay_multiplier, s.muon_momentum):
        constant = np.asarray(jax.jit(f)(steps))
        at_run_time = np.asarray(jax.jit(f)(steps, s.horizon()))
        if f.__name__ == "muon_momentum":
            np.testing.assert_allclose(at_run_time, constant, rtol=2.5e-7, atol=0)  # 2 ulp at ~0.96
        else:
            np.testing.assert_array_equal(at_run_time, constant)


@pytest.mark.timeout(300)
def test_the_step_of_another_horizon_is_the_same_program():
    """--steps 20 and --steps 5000 lower to one program, so the compile cache serves both."""
    texts = []
    for total in (20, 5000):
        compute, cfg, model, optimizer = _bf16_state(depth=1, total_steps=total)
        x = jnp.zeros((1, 2, cfg.sequence_len), jnp.int32)
        with jax.set_mesh(compute.mesh):
            texts.append(StepLoop(model, optimizer).lower(x, x).as_text())
        np.testing.assert_array_equal(np.asarray(optimizer.horizon[...]), Schedule(total).horizon())
    assert texts[0] == texts[1]


def _run(module, *args, timeout=600):
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, JAX_LOG_COMPILES="1")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p, COMPILED.findall(p.stdout + p.stderr)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pretrain_then_sft_in_bf16_compile_each_step_once(tmp_path):
    run = tmp_path / "base"
    p, names = _run("scripts.pretrain", "--depth=1", "--sequence-len=64", "--vocab-size=300", "--device-batch-size=2",
                    "--total-batch-size=256", "--steps=4", "--dtype=bfloat16", f"--run-dir={run}", "--eval-every=2",
                    "--eval-tokens=256", "--save-every=2", "--log-every=1", "--num-samples=1", "--sample-every=2")
    assert "dtype bfloat16" in p.stdout and "done: 4 steps" in p.stdout
    assert names.count("step") == 1, names
    assert names.count("eval_step") == 1, names
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert len(losses) == 4 and all(np.isfinite(losses))

    p, names = _run("scripts.sft", "--base", str(run), "--run-dir", str(tmp_path / "sft"), "--dtype", "bfloat16",
                    "--mix", "chat,arithmetic", "--steps", "3", "--device-batch-size", "2", "--eval-every", "0",
                    "--save-every", "0", "--log-every", "1")
    assert "dtype bfloat16" in p.stdout or "bfloat16" in p.stdout
    assert names.count("step") == 1, names


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_device_check_quick_runs_in_bf16(tmp_path):
    # One attention kernel, the CPU's own: the bf16 rows are what is checked here, and each kernel
    # costs three more compiles (half this test). xla's kernel in bf16 is test_attention.py's
    # test_xla_equals_reference (its bf16 cases); device_check's rows of both kernels, tests/test_scale.py.
    out = tmp_path / "rows.json"
    p, names = _run("bench.device_check", "--quick", "--dtype", "bfloat16", "--kernels", "blockwise", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "failed" in r], rows  # the chip's TypeError was such a row
    assert {r["kind"] for r in rows} >= {"fwd+bwd", "step", "step x4"}, rows
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert "compute bfloat16" in p.stdout

"""--scan-layers: the blocks that repeat run under one lax.scan and compute what the unrolled model
computes (forward, loss, gradients, a few optimizer steps), with remat too, and a bf16 step with it
compiles once. The parameters are the same arrays either way (no checkpoint format of its own)."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_init
from flaxchat.config import GPTConfig, config_for_depth
from flaxchat.gpt import GPT, scan_plan
from flaxchat.kernels import choose
from flaxchat.kernels.remat import remat_blocks
from flaxchat.optim import OptimConfig, Schedule, make_optimizer
from flaxchat.train import StepLoop, loss_sum_for_gradients
from support import CompileLog

# 8 layers of "SSSL" with value embeddings on odd layers: two periods of 4, backout (layer 4) inside
# the scan; grouped-query attention, short windows of one 16-token block.
CFG = GPTConfig(sequence_len=64, vocab_size=256, n_layer=8, n_head=4, n_kv_head=2, n_embd=64, attn_block=16)


def _model(kernels, dtype=jnp.float32, cfg=CFG):
    model = GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels)
    # the output projections start at zero, which would leave the blocks' inner maths untested
    for i, block in enumerate(model.blocks):
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            lin.kernel[...] = 0.05 * jax.random.normal(jax.random.key(i), lin.kernel.shape)
    return model


def _pair(dtype=jnp.float32, **choices):
    return (_model(choose("cpu", **choices).model, dtype),
            _model(choose("cpu", scan_layers=True, **choices).model, dtype))


def _tokens(shape=(2, 64), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape, np.int32))


def test_the_plan_scans_whole_periods_and_leaves_the_rest_unrolled():
    """SSSL with value embeddings on alternate layers repeats every 4 layers; the last layer's
    forced full window ends the repetition early where the pattern would not put an L there."""
    plan = {d: scan_plan(config_for_depth(d)) for d in (4, 8, 10, 12, 20, 26)}
    assert plan == {4: (1, 0), 8: (4, 2), 10: (4, 2), 12: (4, 3), 20: (4, 5), 26: (4, 6)}
    assert scan_plan(config_for_depth(6, window_pattern="L")) == (2, 3)
    assert scan_plan(config_for_depth(6, window_pattern="L", value_embeds=False)) == (1, 6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_scanned_forward_and_loss_equal_the_unrolled(dtype, tol):
    plain, scanned = _pair(dtype)
    idx = _tokens()
    forward = nnx.jit(lambda m, i: m(i))
    a, b = forward(plain, idx), forward(scanned, idx)
    assert float(jnp.max(jnp.abs(a - b))) <= tol * float(jnp.max(jnp.abs(a)))
    loss = nnx.jit(lambda m, i: loss_sum_for_gradients(m, i[:, :-1], i[:, 1:]))
    la, lb = float(loss(plain, idx)), float(loss(scanned, idx))
    assert abs(la - lb) <= tol * abs(la)


@pytest.mark.parametrize("remat", [None, "cpu", "nnx"])
def test_scanned_gradients_equal_the_unrolled(remat):
    """Every parameter's gradient, with no remat, the CPU's remat form and nnx.remat (TPU/GPU's)."""
    plain, scanned = _pair(grad_checkpoint=remat is not None)
    if remat == "nnx":
        plain.kernels = dataclasses.replace(plain.kernels, remat=remat_blocks["full"])
        scanned.kernels = dataclasses.replace(scanned.kernels, remat=remat_blocks["full"])
    idx = _tokens()
    grad = nnx.jit(nnx.grad(lambda m, i: loss_sum_for_gradients(m, i[:, :-1], i[:, 1:])))
    ga = nnx.to_flat_state(grad(plain, idx))
    gb = dict(nnx.to_flat_state(grad(scanned, idx)))
    assert len(ga) == len(gb)
    for path, g in ga:
        a, b = np.asarray(g.get_value()), np.asarray(gb[path].get_value())
        scale = max(float(np.abs(a).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= 1e-5 * scale, path


def test_with_splash_its_named_residuals_give_the_same_gradients():
    """Splash (Pallas interpret mode here) under SCAN_POLICY, which keeps the output and log-sum-exp
    it names "attention": the gradients are the unrolled model's."""
    cfg = dataclasses.replace(CFG, sequence_len=128)
    plain, scanned = (_model(choose("cpu", "splash", scan_layers=s).model, cfg=cfg) for s in (False, True))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 129), np.int32))
    grad = nnx.jit(nnx.value_and_grad(lambda m, i: loss_sum_for_gradients(m, i[:, :-1], i[:, 1:])))
    (la, ga), (lb, gb) = grad(plain, idx), grad(scanned, idx)
    assert abs(float(la) - float(lb)) <= 1e-5 * abs(float(la))
    gb = dict(nnx.to_flat_state(gb))
    for path, g in nnx.to_flat_state(ga):
        a, b = np.asarray(g.get_value()), np.asarray(gb[path].get_value())
        assert float(np.abs(a - b).max()) <= 1e-4 * max(float(np.abs(a).max()), 1e-6), path


def _losses(choice, dtype, steps=4):
    compute = compute_init(jnp.dtype(dtype).name).with_sharding("dp")
    with jax.set_mesh(compute.mesh):
        model, optimizer = sharding.create_sharded(
            lambda: _model(choice.model, dtype),
            lambda m: make_optimizer(m, OptimConfig(n_embd=CFG.n_embd, ns_dtype="float32"), Schedule(20), choice.polar),
            compute.mesh)
        loop = StepLoop(model, optimizer, plan=choice.plan)
        return [float(loop(_tokens((2, 2, 64), s), _tokens((2, 2, 64), s + 100))) for s in range(steps)]


def test_step_loop_losses_with_and_without_scanned_layers():
    plain = _losses(choose("cpu"), jnp.float32)
    scanned = _losses(choose("cpu", scan_layers=True), jnp.float32)
    np.testing.assert_allclose(scanned, plain, rtol=1e-5)




def test_a_bf16_step_with_scanned_layers_compiles_once():
    handler, logger = CompileLog(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            losses = _losses(choose("cpu", scan_layers=True), jnp.bfloat16, steps=3)
    finally:
        logger.removeHandler(handler)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert handler.names.count("step") == 1, handler.names

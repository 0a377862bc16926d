"""Optimizer: parameter groups, schedules inside jit, Muon's orthogonalisation, a falling loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, build_optimizer, labels_for, param_label, polar_express

CFG = GPTConfig(sequence_len=32, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, attn_block=16)


def test_every_parameter_has_the_nanochat_group():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    labels = nnx.to_pure_dict(labels_for(nnx.state(model, nnx.Param)))
    assert labels["wte"]["embedding"] == "embed"
    assert labels["lm_head"]["kernel"] == "lm_head"
    assert labels["resid_lambdas"] == "resid" and labels["x0_lambdas"] == "x0"
    assert labels["smear_gate"]["kernel"] == "smear" and labels["backout_lambda"] == "smear"
    assert labels["blocks"][1]["attn"]["ve"]["embedding"] == "value_embed"
    assert labels["blocks"][0]["attn"]["c_q"]["kernel"] == "matrix"
    assert labels["blocks"][0]["mlp"]["c_proj"]["kernel"] == "matrix"
    with pytest.raises(ValueError):
        param_label("mystery.weight")


def test_schedule_shape_and_values_inside_jit():
    s = Schedule(total_steps=100, warmup_ratio=0.1, warmdown_ratio=0.5, final_lr_frac=0.1)
    steps = jnp.arange(100)
    lr = jax.jit(jax.vmap(s.lr_multiplier))(steps)
    assert float(lr[0]) == pytest.approx(0.1)  # warmup: (0+1)/10
    assert float(lr[9]) == pytest.approx(1.0)
    assert float(lr[30]) == pytest.approx(1.0)  # constant
    assert float(lr[75]) == pytest.approx(0.5 + 0.5 * 0.1)  # halfway down the warmdown
    assert np.all(np.diff(np.asarray(lr[50:])) <= 1e-7)  # monotone warmdown
    mom = jax.jit(jax.vmap(s.muon_momentum))(jnp.array([0, 150, 300, 1000]))
    np.testing.assert_allclose(mom, [0.85, 0.90, 0.95, 0.95], rtol=1e-6)
    wd = jax.jit(jax.vmap(s.weight_decay_multiplier))(jnp.array([0, 50, 100]))
    np.testing.assert_allclose(wd, [1.0, 0.5, 0.0], atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32)])
def test_polar_express_orthogonalises(shape):
    g = jax.random.normal(jax.random.key(0), shape)
    o = polar_express(g)
    s = jnp.linalg.svd(o, compute_uv=False)
    # Polar Express deliberately lands singular values in a band around 1, not exactly on it.
    assert float(s.min()) > 0.5 and float(s.max()) < 1.3


def test_lr_schedule_reaches_every_group():
    """At lr multiplier 0 (end of warmdown to 0) no group may move its parameters."""
    model = GPT(CFG, rngs=nnx.Rngs(0))
    sched = Schedule(total_steps=1, warmup_ratio=0.0, warmdown_ratio=1.0, final_lr_frac=0.0)
    # step 0 of a 1-step run with full warmdown: multiplier = (1 - 0)/1 = 1; advance the count first.
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=32, depth=2), sched), wrt=nnx.Param)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(jnp.ones_like, params)
    opt.update(model, grads)  # step 0: moves
    before = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    opt.update(model, grads)  # step 1 >= total: multiplier 0 for every group, Muon included
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), before, after)


@pytest.mark.parametrize("which", ["muon", "adamw"])
def test_a_few_steps_lower_the_loss(which):
    from flaxchat.train import train_step
    model = GPT(CFG, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig(optimizer=which, n_embd=32, depth=2), Schedule(30)),
                        wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 2, 32)), jnp.int32)
    y = jnp.roll(x, -1, -1)
    losses = [float(train_step(model, opt, x, y)) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses

"""The fused, chunked LM head + loss (the TPU's and GPU's head_loss) against the plain ops."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import ops
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.kernels import choose, fused_loss
from flaxchat.train import loss_sum_for_gradients

CAP = 15.0


def plain(x, w, labels, weights):
    z = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jnp.sum(ops.softcap_cross_entropy(z, labels, CAP) * weights)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_fused_loss_and_its_gradients_equal_the_plain_ones(monkeypatch, dtype, tol):
    # 3 chunks of 8 tokens and 5 padded ones: the scan, its padding and the masked tokens all run.
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 8 * 96)
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    n, d, V = 19, 32, 96
    x = (jax.random.normal(kx, (n, d)) * 2).astype(dtype)
    w = (jax.random.normal(kw, (d, V)) * 0.5).astype(dtype)
    labels = jax.random.randint(ky, (n,), 0, V)
    weights = jnp.where(jnp.arange(n) % 4 == 0, 0.0, jnp.linspace(-1.0, 2.0, n))  # RL's signed weights, masks
    with jax.default_matmul_precision("highest"):
        want, (gx, gw) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w, labels, weights)
        got, (fx, fw) = jax.jit(jax.value_and_grad(fused_loss.softcap_loss_sum, argnums=(0, 1)),
                                static_argnums=4)(x, w, labels, weights, CAP)
    assert fx.dtype == x.dtype and fw.dtype == w.dtype
    np.testing.assert_allclose(float(got), float(want), rtol=tol)
    for a, b in ((fx, gx), (fw, gw)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)


def test_a_model_with_the_fused_head_gets_the_plain_models_loss_and_gradients():
    cfg = GPTConfig(sequence_len=32, vocab_size=203, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, window_pattern="L")
    fused = dataclasses.replace(choose("cpu", "xla").model, head_loss=fused_loss.softcap_loss_sum)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 203)
    x, y = tokens[:, :-1], tokens[:, 1:].at[0, :5].set(-1)  # masked targets, as SFT's

    def loss_and_grads(kernels, tied):
        model = GPT(dataclasses.replace(cfg, tie_embeddings=tied), rngs=nnx.Rngs(0), kernels=kernels)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        # zero-initialised projections would make most gradients 0: perturb every parameter
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(2), len(leaves))
        params = treedef.unflatten([p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
        f = lambda p: loss_sum_for_gradients(nnx.merge(graphdef, p, rest), x, y)
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(f))(params)

    for tied in (False, True):
        (want, gw), (got, gf) = loss_and_grads(choose("cpu", "xla").model, tied), loss_and_grads(fused, tied)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        scale = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(gw)))
        for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gw)):
            # fp32 rounding: relative to the leaf, and for leaves whose gradient nearly cancels
            # (backout's, the lambdas'), to the whole gradient
            assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-6 * scale

"""The LM head and its soft-capped cross-entropy in one pass over chunks of tokens (TPU, GPU).

The plain loss makes the logits of the whole micro-batch in fp32 and keeps them for the backward:
8 rows x 2048 tokens x 32,768 words is 2 GiB at d12, and the same again for their gradient. Here the
head's matmul, the loss and the loss's gradient run one chunk of tokens at a time inside a scan, and
the forward pass already makes the gradients of the head's input and weight (the loss is summed
into one scalar, so its cotangent is a number the backward only multiplies in). No logits outlive
their chunk; the FLOPs are the plain head's (one forward matmul, two backward), none recomputed.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from flaxchat import ops

CHUNK_ELEMENTS = 2**26  # fp32 logits of one chunk: 256 MiB (2,048 tokens of a 32,768-word vocabulary)


def softcap_loss_sum(x: jax.Array, w: jax.Array, labels: jax.Array, weights: jax.Array, cap: float) -> jax.Array:
    """sum_t weights[t] · cross-entropy(softcap(x[t] @ w, cap), labels[t]) in fp32.

    x (..., d) in the compute dtype, w (d, V), labels (...) in [0, V), weights (...) fp32 (0 drops
    a token). The same value and gradients as the plain ops, a chunk of tokens at a time."""
    d, V = w.shape
    x, labels, weights = x.reshape(-1, d), labels.reshape(-1), weights.reshape(-1).astype(jnp.float32)
    n = x.shape[0]
    chunk = max(8, min(n, CHUNK_ELEMENTS // V) // 8 * 8)
    pad = -n % chunk
    if pad:  # padded tokens weigh 0
        x = jnp.pad(x, [(0, pad), (0, 0)])
        labels, weights = jnp.pad(labels, [(0, pad)]), jnp.pad(weights, [(0, pad)])
    return _loss_sum(cap, chunk, x, w, labels, weights)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _loss_sum(cap, chunk, x, w, labels, weights):
    return _forward(cap, chunk, x, w, labels, weights)[0]


def _forward(cap, chunk, x, w, labels, weights):
    n, d = x.shape
    split = lambda a: a.reshape(n // chunk, chunk, *a.shape[1:])

    def one(dw, part):
        xc, yc, wc = part
        z = jnp.dot(xc, w, preferred_element_type=jnp.float32)
        loss, (t, e, se) = ops.capped_cross_entropy_terms(z, yc, cap)
        # d loss / d z = (softmax(s) - onehot(y)) · ds/dz, with s = cap·tanh(z/cap): ds/dz = 1 - tanh²
        hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == yc[:, None]
        dz = ((e / se[:, None] - hit) * (1 - t * t) * wc[:, None]).astype(x.dtype)
        dx = jnp.dot(dz, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = dw + jnp.dot(xc.T, dz, preferred_element_type=jnp.float32)
        return dw, (jnp.sum(loss * wc), dx)

    dw, (sums, dx) = jax.lax.scan(one, jnp.zeros((d, w.shape[1]), jnp.float32), (split(x), split(labels),
                                                                              split(weights)))
    return jnp.sum(sums), (dx.reshape(n, d), dw.astype(w.dtype))


def _backward(cap, chunk, grads, g):
    dx, dw = grads
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


_loss_sum.defvjp(_forward, _backward)  # _forward returns (value, residuals): the gradients

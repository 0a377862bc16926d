"""Polar Express (Muon's orthogonalisation) in the forms that run fast on a CPU.

`polar_express(g, steps, dtype)` takes the dtypes of `flaxchat.optim.polar_express` (float32,
bfloat16) and two CPU forms, BF16_PRODUCTS and BF16_OPERANDS, which keep an fp32 iterate and take
some products from bf16 operands; rectangular matrices take the Gram form (`_gram_form`). The
CPU's record picks the form by the CPU's bf16 dot instructions (`cpu.orthogonalisation_dtype`);
`--ns-dtype` overrides it. Why: a CPU's bf16 product is fast only from bf16 operands into fp32
(measurements: docs/cpu.md, "Polar Express's CPU forms").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxchat.kernels.cpu_layout import stored_transpose
from flaxchat.ops import POLAR_EXPRESS, normalised, polar_iterations

# fp32 iterates and Gram matrix, and the other two products of each iteration (the polynomial's A·A
# and its product with x) from bf16 operands accumulated in fp32; rectangular matrices (one side at
# least GRAM_FORM_ASPECT times the other) in the Gram form, fp32.
BF16_PRODUCTS = "bf16-products"
# The same, with the products that read x from bf16 operands too: the Gram matrix of every
# iteration (square or wide x), and the Gram form's first Gram matrix and final product. The Gram
# form's chain of m³ products stays fp32 (it does not correct its own rounding).
BF16_OPERANDS = "bf16-operands"
FORMS = (BF16_PRODUCTS, BF16_OPERANDS)
GRAM_FORM_ASPECT = 2


def polar_express(g: jax.Array, steps: int = 5, dtype=jnp.float32) -> jax.Array:
    """`flaxchat.optim.polar_express` for a CPU: `dtype` float32, bfloat16, BF16_PRODUCTS or
    BF16_OPERANDS; the Gram matrices of tall matrices through stored transposes (`_gram`)."""
    mixed = _mixed(dtype)
    bf16_gram = isinstance(dtype, str) and dtype == BF16_OPERANDS
    x = normalised(g, jnp.float32 if mixed else jnp.dtype(dtype))
    if uses_gram_form(x.shape, dtype):
        return _gram_form(x, steps, bf16_x=bf16_gram).astype(g.dtype)
    mm = _bf16_operands if mixed else jnp.matmul  # a product the iteration tolerates from bf16
    return polar_iterations(x, steps, lambda x: _gram(x, bf16=bf16_gram), mm).astype(g.dtype)


def _mixed(dtype) -> bool:
    """Whether `dtype` names one of the CPU forms with an fp32 iterate and bf16 products."""
    return isinstance(dtype, str) and dtype in FORMS


def uses_gram_form(shape, dtype) -> bool:
    """Whether `polar_express` takes the Gram form for a matrix of `shape` in `dtype`."""
    m, n = sorted(shape[-2:])
    return _mixed(dtype) and n >= GRAM_FORM_ASPECT * m


def _bf16_operands(p: jax.Array, q: jax.Array) -> jax.Array:
    """p·q from bf16 operands, accumulated and returned in fp32."""
    return jnp.matmul(p.astype(jnp.bfloat16), q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _gram(x: jax.Array, bf16: bool = False) -> jax.Array:
    """The small Gram matrix: xᵀ·x (n x n) for a tall x (xᵀ stored first: a plain product for
    XLA:CPU's fast library), x·xᵀ (m x m) for a wide one. `bf16` (square or wide x): from bf16
    operands into fp32, as one dot_general (XLA:CPU upcasts x @ x.T back to fp32)."""
    if bf16 and x.shape[0] <= x.shape[1]:
        xb = x.astype(jnp.bfloat16)
        return jax.lax.dot_general(xb, xb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return stored_transpose(x, (1, 0)) @ x if x.shape[0] > x.shape[1] else x @ x.T


def _gram_form(x: jax.Array, steps: int, bf16_x: bool = False) -> jax.Array:
    """Polar Express's iterations on the small Gram matrix alone, then one product with x.

    Each iteration is x <- q(A)·x with A = x·xᵀ and q(A) = a + b·A + c·A² (x·q(A) and A = xᵀ·x for
    a tall x). Every q is a polynomial in the first A, so they commute: the next Gram matrix is
    A·q(A)², and the result is q_4·...·q_0 times the first x. For an m x n matrix (m < n) an
    iteration costs four m x m x m products instead of two m x m x n and one m x m x m, so it pays
    from n = 2m on. The Gram matrix squares x's condition number, so this runs in fp32 only.

    `bf16_x` (BF16_OPERANDS): the two products that read x, the first Gram matrix (of a wide x; see
    `_gram`) and the final product, from bf16 operands; the chain stays fp32. Faster, and still
    closer to float64 than bf16 (docs/cpu.md).
    """
    tall = x.shape[0] > x.shape[1]
    A = _gram(x, bf16=bf16_x)
    eye = jnp.eye(A.shape[0], dtype=A.dtype)
    product = None
    for k, (a, b, c) in enumerate(POLAR_EXPRESS[:steps]):
        q = a * eye + b * A + c * (A @ A)
        product = q if product is None else product @ q
        if k < steps - 1:
            A = A @ (q @ q)
    if product is None:
        return x
    mm = _bf16_operands if bf16_x else jnp.matmul
    return mm(x, product) if tall else mm(product, x)


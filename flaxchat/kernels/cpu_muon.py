"""Polar Express (Muon's orthogonalisation) in the forms that run fast on a CPU.

`polar_express(g, steps, dtype)` takes the dtypes of `flaxchat.optim.polar_express` (float32,
bfloat16) and two CPU forms, BF16_PRODUCTS and BF16_OPERANDS, which keep an fp32 iterate and take
some products from bf16 operands; rectangular matrices take the Gram form (`_gram_form`). The
CPU's record picks the form by the CPU's bf16 dot instructions (`cpu.orthogonalisation_dtype`);
`--ns-dtype` overrides it.

Why these forms. On a 2-core AMD EPYC (Zen 5, AVX-512 BF16), a bf16 product is fast only when it
accumulates into fp32 and its right side is not transposed: a 2048³ product ran at 961 GFLOP/s
from bf16 operands into fp32 against 488 in fp32, while a bf16-out product ran at 353, and a Gram
product x·xᵀ in bf16 gained nothing. So Polar Express all in bf16 is slower than fp32 there (57.7
against 50.3 ms at depth 4), and it moves the orthogonalised gradients by 5.6e-2 (median relative
Frobenius difference). BF16_PRODUCTS keeps the iterate and the Gram matrix in fp32 and takes the
other two products from bf16 operands: 45 against 50 ms at depth 4, 590 against 767 ms for config
B's 48 matrices (bench.train_throughput), and it moves the update by 1.3-2e-2, less than the bf16
nanochat runs on GPU. At depth 4 and 2,048 tokens per step the main job's val bpb after 300 steps
was 0.1452 against fp32's 0.1451. Its rectangular matrices take the Gram form in fp32, faster than
the bf16 products and closer to float64: inside the step, Polar Express went from 44 to 33 ms at
depth 4 and from 424 to 360 ms at config B. CPUs without bf16 dots keep the standard fp32
iteration. On a 2-core Intel Xeon with AMX (bf16 operands into fp32 at 1,498 GFLOP/s against 352
in fp32 at 2048³, but 204 against 186 at 256³), Polar Express alone on config A's gradients took
49.0 ms with BF16_PRODUCTS, 67.1 in fp32 and 77.1 in bf16.

BF16_OPERANDS takes the Gram products from bf16 operands too, written as one dot_general (see
`_gram`): on a 2-core AMD EPYC (Zen 4) Polar Express alone went from 77.7 to 66.9 ms on config A's
24 matrices (25 interleaved rounds) and from 959.5 to 805.0 ms on config B's 48, and from
16.2-17.1% to 14.5-15.2% of the main job's step. Against float64 the update moves by 1.6e-2 on the
square matrices, where it was 1.4e-2 (bf16: 5-7e-2); on text-trained gradients the tall matrices
move by 1.2e-1 after 5 steps and 1.4e-2 after 60, still less than bf16's 1.7e-1 and 5.1e-2
(`bench.cpu.ns_accuracy`). Over 600 steps of the main job and four seeds, the validation bpb per
form was float32 0.14407, bf16-operands 0.14362, bfloat16 0.14390 (seed-to-seed sd 0.0019): at this
size the trained model does not notice the form. Not yet measured on an Intel CPU, so Intel keeps
BF16_PRODUCTS. `python -m bench.train_throughput --phases` prints every form's time on any machine.
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
    """The small Gram matrix: xᵀ·x (n x n) for a tall x, x·xᵀ (m x m) for a wide one. xᵀ·x
    contracts the rows, which XLA:CPU runs as a slow generic dot; with xᵀ stored first it is a
    plain product for its fast library (`cpu.stored_transpose`).

    `bf16` (square or wide x): from bf16 operands into fp32, written as one dot_general of x with
    itself contracting the columns. XLA:CPU upcasts the same product written as x @ x.T back to
    fp32 before the dot: sixteen 256 x 256 Gram products took 3.67 ms that way, 2.32 as one
    dot_general, 3.65 in fp32 (2-core AMD EPYC, Zen 4). It upcast every form of a tall x's xᵀ·x
    tried (contracting the rows, a stored or a plain transpose first), so that one stays fp32."""
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

    On a 2-core AMD EPYC (Zen 5), against the standard iteration with bf16 products: 256 x 1024 in
    2.2 against 3.1 ms, 1024 x 256 2.3 against 3.6, 512 x 2048 17 against 21; relative difference
    to the float64 standard iteration on a GPT's gradients 1.2e-5-1.2e-3 against 6.6e-3-2.3e-2
    (fp32's standard iteration: 4-5e-6).

    `bf16_x` (BF16_OPERANDS): the two products that read x, the first Gram matrix (of a wide x; see
    `_gram`) and the final product, from bf16 operands; the chain stays fp32. Polar Express on
    config A's 24 matrices went from 64.8 to 59.9 ms (2-core AMD EPYC, Zen 4; medians of 25
    interleaved rounds, faster in every one). On gradients of random tokens that moved the
    rectangular matrices' result from 7.9e-6 to 3.1e-3 (wide) and 4.0e-3 (tall) of float64's; on
    what Muon hands it while the main job learns the stories (`bench.cpu.ns_accuracy`), to 1.8e-2 and
    1.2e-1 after 5 steps, 8.4e-3 and 3.3e-2 after 20, 8e-3 and 1.4e-2 after 60 (all bf16: 5.0e-2 and
    1.7e-1, 4.9e-2 and 5.5e-2, 5.3e-2 and 5.1e-2). The tall one's loss is its final product: on
    Muon's inputs from Zipf-distributed tokens, x·P from fp32 operands was 2.3e-3 from float64
    after 5 steps where bf16 operands were 1.5e-1, for 0.55 ms more a matrix.
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


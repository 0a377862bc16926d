"""bench/profiling.py: what a kernel is grouped under, read from the compiled module's text."""

import jax
import jax.numpy as jnp

from bench import profiling


def test_products_are_told_from_reductions_and_elementwise_work():
    def f(x, w, v):
        h = jnp.tanh(x @ w)  # a product, then elementwise work
        lowp = jnp.matmul(h.astype(jnp.bfloat16), v.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return jnp.sum(jnp.exp(lowp - 1.0), axis=-1)  # a reduction (a YNNPACK fusion on XLA:CPU)

    x, w, v = jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((48, 16))
    text = jax.jit(f).lower(x, w, v).compile().as_text()
    kinds = set(profiling.kernel_kinds(text).values())
    assert "dot f32[64,48]" in kinds, sorted(kinds)
    assert "dot f32[64,16] (bf16 operands)" in kinds, sorted(kinds)
    # The reduction is not a product, whatever fusion it runs in, and names what it computes.
    reductions = [k for k in kinds if not k.startswith("dot ") and "reduce" in k and "exponential" in k]
    assert reductions and all("f32[64]" in k for k in reductions), sorted(kinds)


def test_an_unfused_products_operands_are_read_from_its_own_computation():
    text = """ENTRY %main (a: bf16[4,8], b: bf16[8,2]) -> f32[4,2] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,2]{1,0} parameter(1)
  ROOT %dot.3 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
    assert profiling.kernel_kinds(text)["dot.3"] == "dot f32[4,2] (bf16 operands)"

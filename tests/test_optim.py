"""Optimizer: parameter groups, schedules inside jit, Muon's orthogonalisation, a falling loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench import relative_difference
from bench.cpu.ns_accuracy import polar_express_f64  # the float64 reference the dtypes are measured against
from flaxchat import kernels
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.kernels.cpu_muon import polar_express  # the CPU's forms; plain float32/bfloat16 the same
from flaxchat.optim import OptimConfig, Schedule, build_optimizer, labels_for, param_label

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


# --- nanochat's published schedules (scripts/base_train.py, scripts/chat_sft.py), written out here --

def nanochat_lr(it, n, warmup=40, warmdown_ratio=0.65, final=0.05):
    warmdown = round(warmdown_ratio * n)
    if it < warmup:
        return (it + 1) / warmup
    if it <= n - warmdown:
        return 1.0
    progress = (n - it) / warmdown
    return progress * 1.0 + (1 - progress) * final


def nanochat_momentum(it, n, warmdown_ratio=0.65):
    warmdown = round(warmdown_ratio * n)
    start = n - warmdown
    if it < 400:
        frac = it / 400
        return (1 - frac) * 0.85 + frac * 0.97
    if it >= start:
        progress = (it - start) / warmdown
        return 0.97 * (1 - progress) + 0.90 * progress
    return 0.97


def nanochat_weight_decay(it, n):
    return 0.5 * (1 + math.cos(math.pi * it / n))


@pytest.mark.parametrize("n", [30, 600, 1000, 5000])
def test_schedules_equal_nanochats_formulas_inside_jit(n):
    s = Schedule(total_steps=n)  # the defaults are nanochat's: warmup 40, warmdown 0.65, final 0.05
    steps = sorted({0, 1, 20, 39, 40, 41, n // 3, n // 2, 399, 400, 401, n - round(0.65 * n), n - 1, n} & set(range(n + 1)))
    at = jnp.asarray(steps)
    lr = np.asarray(jax.jit(jax.vmap(s.lr_multiplier))(at))
    mom = np.asarray(jax.jit(jax.vmap(s.muon_momentum))(at))
    wd = np.asarray(jax.jit(jax.vmap(s.weight_decay_multiplier))(at))
    np.testing.assert_allclose(lr, [nanochat_lr(i, n) for i in steps], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mom, [nanochat_momentum(i, n) for i in steps], rtol=1e-6)
    np.testing.assert_allclose(wd, [nanochat_weight_decay(i, n) for i in steps], rtol=1e-5, atol=1e-6)


def test_finetune_schedule_is_chat_sfts():
    """chat_sft: LR constant for the first half, linear to 0 over the second; momentum 0.85 -> 0.95
    over 300 steps; no weight decay schedule."""
    s = Schedule(total_steps=200, warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0, momentum="finetune",
                 weight_decay="constant")
    lr = np.asarray(jax.vmap(s.lr_multiplier)(jnp.array([0, 100, 150, 199])))
    np.testing.assert_allclose(lr, [1.0, 1.0, 0.5, 0.01], atol=1e-6)
    mom = np.asarray(jax.vmap(s.muon_momentum)(jnp.array([0, 150, 300, 1000])))
    np.testing.assert_allclose(mom, [0.85, 0.90, 0.95, 0.95], rtol=1e-6)
    assert float(s.weight_decay_multiplier(150)) == 1.0


# --- Muon: one and two steps against nanochat's muon_step_fused, written in numpy (torch layout) --

POLAR = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def nanochat_muon_step(G, P, M, V, momentum, lr, wd, beta2):
    """nanochat/optim.py muon_step_fused for one matrix in torch's (out, in) layout, float64."""
    M = M + (1 - momentum) * (G - M)  # momentum_buffer.lerp_(grads, 1 - momentum)
    X = G + momentum * (M - G)  # grads.lerp_(momentum_buffer, momentum)
    m, n = X.shape
    target = np.linalg.norm(X) / m ** 0.5  # MuonEq
    X = X * (target / np.maximum(np.linalg.norm(X, axis=-1, keepdims=True), 1e-6))
    X = X / (np.linalg.norm(X) * 1.01 + 1e-6)
    for a, b, c in POLAR:
        if m > n:
            A = X.T @ X
            X = a * X + X @ (b * A + c * (A @ A))
        else:
            A = X @ X.T
            X = a * X + (b * A + c * (A @ A)) @ X
    g = X * (min(m, n) ** 0.5 / max(np.linalg.norm(X), 1e-6))  # Muon+
    red = -1 if m >= n else -2
    v_mean = np.mean(g * g, axis=red, keepdims=True)
    size = g.shape[red]
    v_norm = np.sqrt(np.sum(v_mean) * size)
    V = V + (1 - beta2) * (v_mean - V)
    step = 1 / np.sqrt(np.maximum(V, 1e-10))
    v_norm_new = np.sqrt(np.sum(v_mean * size * step * step))
    g = g * step * (v_norm / max(v_norm_new, 1e-10))
    lr = lr * max(1.0, m / n) ** 0.5
    mask = (g * P) >= 0
    return P - (lr * g + lr * wd * P * mask), M, V


def _low_rank_uneven(rng, m, n):
    """A nearly rank-2 (out, in) gradient whose rows' norms span five orders of magnitude. (Exactly
    rank-deficient inputs are left out: the iteration's slope at 0, ~990, turns float32 rounding in
    the null space into 1e-4-sized differences that no float64 reference can match.)"""
    G = rng.normal(size=(m, 2)) @ rng.normal(size=(2, n)) + 0.05 * rng.normal(size=(m, n))
    return G * np.exp(rng.uniform(np.log(1e-3), np.log(1e2), size=(m, 1)))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("shape,kind", [((64, 16), "full"), ((16, 64), "full"), ((32, 32), "full"),
                                        ((48, 96), "low-rank"), ((96, 40), "low-rank"), ((32, 32), "low-rank")])
def test_muon_update_equals_nanochats_algorithm(shape, kind, batched):
    from flaxchat.optim import muon
    rng = np.random.default_rng(sum(shape))
    m, n = shape  # torch (out, in); our kernel is its transpose (in, out)
    sched = Schedule(total_steps=100, warmup_steps=0)
    lr, wd = 0.5, 0.3  # an O(1) update, so that 1e-5 is a tight bound on it
    tx = muon(lr, sched, weight_decay=wd, batched=batched)
    update = jax.jit(tx.update)  # one compile for the three steps; eagerly every op compiles on its own
    P = rng.normal(size=(m, n)) * 0.05
    params = {"w": jnp.asarray(P.T, jnp.float32)}
    state = tx.init(params)
    M, V = np.zeros((m, n)), np.zeros((m, 1) if m >= n else (1, n))
    for step in range(3):  # the momentum and second-moment buffers take part from step 1 on
        G = _low_rank_uneven(rng, m, n) if kind == "low-rank" else rng.normal(size=(m, n))
        updates, state = update({"w": jnp.asarray(G.T, jnp.float32)}, state, params)
        P_new, M, V = nanochat_muon_step(G, P, M, V, nanochat_momentum(step, 100),
                                         lr * nanochat_lr(step, 100, warmup=0), wd * nanochat_weight_decay(step, 100), 0.9)
        np.testing.assert_allclose(np.asarray(updates["w"]).T, P_new - P, atol=1e-5, rtol=0)
        assert np.abs(P_new - P).max() > 0.05
        params, P = {"w": jnp.asarray(P_new.T, jnp.float32)}, P_new


def _block_matrices(rng, layers=3):
    """A tree shaped like the Muon group's: per layer two square matrices of different roles (c_q,
    c_proj), a wide and a tall one, and a small gate on alternate layers."""
    shapes = {"c_q": (32, 32), "c_proj": (32, 32), "c_fc": (32, 96), "mlp_proj": (96, 32)}
    tree = {str(i): {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()} for i in range(layers)}
    for i in range(1, layers, 2):
        tree[str(i)]["gate"] = jnp.asarray(rng.normal(size=(12, 2)), jnp.float32)
    return {"blocks": tree}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bf16-operands"])
def test_batched_muon_equals_the_per_matrix_muon(dtype):
    """Polar Express and NorMuon over stacks of same-shape matrices (what TPU/GPU and fsdp run) give
    the per-matrix update, momentum and second moments, over steps where all three take part."""
    from flaxchat.optim import muon
    rng = np.random.default_rng(7)
    params = _block_matrices(rng)
    # Cautious weight decay's mask flips where the update is ~0, a jump of lr*wd*p that bf16's
    # rounding differences can trigger: the bf16 forms compare without the decay.
    wd = 0.3 if dtype == "float32" else 0.0
    txs = {b: muon(0.5, Schedule(total_steps=100, warmup_steps=0), weight_decay=wd, ns_dtype=dtype,
                   orthogonalise=polar_express, batched=b) for b in (False, True)}
    states = {b: tx.init(params) for b, tx in txs.items()}
    updates = {b: jax.jit(tx.update) for b, tx in txs.items()}
    # On an O(1) update: fp32 and bf16 agreed to 8e-7 and 4e-7 here; bf16-operands, whose batched
    # products accumulate in another order before their fp32 results are rounded to bf16, to 5e-3.
    # A TPU's batched bf16 products round at other points than its single ones: 16 of 1024 elements
    # differed by up to 0.018 on a v5e, one bf16 step (2^-6) at |x| of 1-2.
    tol = {"float32": 1e-5, "bfloat16": 2e-2}.get(dtype, 1e-2)
    for step in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        out = {b: updates[b](grads, states[b], params) for b in (False, True)}
        for b in out:
            states[b] = out[b][1]
        for got, want in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)
        assert max(float(np.abs(u).max()) for u in jax.tree.leaves(out[True][0])) > 0.05
        params = jax.tree.map(lambda p, u: p + u, params, out[False][0])


def test_the_record_batches_muon_on_accelerators_and_not_on_a_cpu():
    """TPU and GPU run Muon batched (the MXU's big batched products); the CPU's single-device step
    keeps its tuned per-matrix forms."""
    assert kernels.choose("tpu").polar.batched and kernels.choose("gpu").polar.batched
    assert not kernels.choose("cpu").polar.batched


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (jit, cond, ...)."""
    from jax.extend.core import jaxprs_in_params
    for e in jaxpr.eqns:
        yield e
        for sub in jaxprs_in_params(e.params):
            yield from _eqns(sub)


def test_build_optimizer_batches_muon_as_the_polar_record_says():
    """The PolarExpress record's batched reaches Muon: batched products (dot_generals with a batch
    dimension) where it is set, none where not (test_batched_muon_equals_the_per_matrix_muon holds
    the two to the same update)."""
    import dataclasses
    params = nnx.state(GPT(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    for batched in (False, True):
        record = dataclasses.replace(kernels.choose("cpu").polar, batched=batched)
        tx = build_optimizer(OptimConfig(n_embd=32, ns_dtype="float32"), Schedule(30), record)
        jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
        dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
        assert dots and any(e.params["dimension_numbers"][1][0] for e in dots) == batched


def test_scaling_follows_nanochats_rules():
    from flaxchat.recipe import B_REF, scaling
    ref = scaling(100_000_000, 100_000_000, 12, 0.28)  # the reference itself: nothing moves
    assert (ref.total_batch_size, ref.batch_lr_scale, ref.weight_decay) == (B_REF, 1.0, pytest.approx(0.28))
    small = scaling(4_000_000, 100_000_000, 12, 0.28)
    # B_opt = 2^19 (D/D_ref)^0.383, rounded to a power of two: (0.04)^0.383 = 0.291 -> 2^17.
    assert small.total_batch_size == 2 ** round(math.log2(B_REF * 0.04 ** 0.383)) == 2 ** 17
    assert small.batch_lr_scale == pytest.approx(0.5)
    assert small.weight_decay == pytest.approx(0.28 * 0.5 * 25)
    fixed = scaling(4_000_000, 100_000_000, 12, 0.28, total_batch_size=2048)
    assert fixed.total_batch_size == 2048 and fixed.batch_lr_scale == pytest.approx((2048 / 2 ** 19) ** 0.5)


# The two tests below step the whole optimizer with all-ones gradients through one jitted update.
# Eagerly every op of Muon and AdamW compiles on its own (~15 s from a cold compile cache); jitted,
# the update compiles once (~7 s) for both, as they share one optimizer: the stage LR fraction 0.01
# and a one-step schedule warmed down to 0, whose LR multiplier is 1 at step 0 and 0 at step 1.
ONES_TX = build_optimizer(OptimConfig(n_embd=32, lr_frac=0.01),
                          Schedule(total_steps=1, warmup_steps=0, warmdown_ratio=1.0, final_lr_frac=0.0))


@nnx.jit
def step_with_ones(opt, model):
    opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))


def params_now(model):
    """The model's parameters as host copies (numpy)."""
    return jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_every_group_follows_the_stage_lr_fraction():
    """The smear/backout group was fixed at LR 0.2 whatever the stage's fraction: with lr_frac 0.01
    its first step (Adam: lr x sign) moved smear_lambda by 0.2."""
    model = GPT(CFG, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, ONES_TX, wrt=nnx.Param)
    before = params_now(model)
    step_with_ones(opt, model)  # step 0: LR multiplier 1
    after = params_now(model)
    moved = float(np.abs(after["smear_lambda"] - before["smear_lambda"]).max())
    assert moved == pytest.approx(0.2 * 0.01, rel=1e-3)
    x0 = float(np.abs(after["x0_lambdas"] - before["x0_lambdas"]).max())
    assert x0 == pytest.approx(0.5 * 0.01, rel=1e-3)


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
    # step 0 of a 1-step run with full warmdown: multiplier = (1 - 0)/1 = 1; advance the count first.
    opt = nnx.Optimizer(model, ONES_TX, wrt=nnx.Param)
    step_with_ones(opt, model)  # step 0: moves
    before = params_now(model)
    step_with_ones(opt, model)  # step 1 >= total: multiplier 0 for every group, Muon included
    after = params_now(model)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), before, after)


@pytest.mark.parametrize("which", ["muon", "adamw"])
def test_a_few_steps_lower_the_loss(which):
    from flaxchat.train import train_step
    model = GPT(CFG, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig(optimizer=which, n_embd=32, depth=2), Schedule(30)),
                        wrt=nnx.Param)
    # test_ns_dtype_reaches_the_optimizer_and_a_bad_one_is_one_sentence's batch: with the same Muon,
    # it takes this train step's compiled program from the cache (~10 s to compile from a cold one).
    x = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 2, 32)), jnp.int32)
    y = jnp.roll(x, -1, -1)
    losses = [float(train_step(model, opt, x, y)) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_orthogonalisation_dtype_is_chosen_by_what_the_machine_is():
    from flaxchat import kernels
    from flaxchat.kernels.cpu import cpu_has_bf16_dots, orthogonalisation_dtype
    from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS
    assert kernels.choose("tpu").polar.ns_dtype == kernels.choose("gpu").polar.ns_dtype == "bfloat16"
    assert kernels.choose("cpu").polar.ns_dtype == orthogonalisation_dtype()
    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire_rapids = "vendor_id\t: GenuineIntel\nflags\t\t: avx512f amx_bf16 amx_tile\n"
    skylake = "vendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f avx512bw avx512_vnni\n"
    assert cpu_has_bf16_dots(zen5) and cpu_has_bf16_dots(sapphire_rapids)
    assert not cpu_has_bf16_dots(skylake) and not cpu_has_bf16_dots("")
    # bf16-operands where it was measured (AMD); Intel keeps bf16-products until measured there
    assert orthogonalisation_dtype(cpuinfo=zen5) == BF16_OPERANDS
    assert orthogonalisation_dtype(cpuinfo=sapphire_rapids) == BF16_PRODUCTS
    assert orthogonalisation_dtype(cpuinfo=skylake) == "float32"
    assert orthogonalisation_dtype(cpu_bf16=True, cpuinfo=sapphire_rapids) == BF16_PRODUCTS
    assert orthogonalisation_dtype(cpu_bf16=False, cpuinfo=zen5) == "float32"


def test_the_plain_polar_express_equals_the_cpu_forms_in_fp32_and_refuses_a_cpu_form():
    """TPU and GPU run optim.polar_express; the CPU's fp32 form (stored transposes) is the same
    iteration, so the two agree to fp32 rounding on tall, wide and square matrices."""
    from flaxchat.errors import UserError
    from flaxchat.kernels.cpu_muon import BF16_PRODUCTS
    from flaxchat.optim import polar_express as plain
    for shape in ((96, 64), (64, 96), (64, 64)):
        g = jax.random.normal(jax.random.key(4), shape)
        assert relative_difference(plain(g), np.asarray(polar_express(g), np.float64)) < 1e-5
        assert relative_difference(plain(g, 5, "bfloat16"), np.asarray(polar_express(g, 5, "bfloat16"), np.float64)) < 1e-2
    with pytest.raises(UserError, match="CPU form"):
        plain(g, 5, BF16_PRODUCTS)


def test_the_bf16_gram_product_is_a_bf16_dot_on_cpu():
    """XLA:CPU upcasts x @ x.T from bf16 back to fp32 before the dot (no faster than fp32); the
    Gram product of bf16-operands must reach the dot with its bf16 operands. A tall x's stays fp32."""
    import re
    from flaxchat.kernels.cpu import cpu_has_bf16_dots
    from flaxchat.kernels.cpu_muon import _gram
    if jax.default_backend() != "cpu" or not cpu_has_bf16_dots():
        pytest.skip("a CPU with bf16 dot instructions, where bf16-operands is chosen")
    for shape in ((64, 64), (64, 160)):
        x = jax.random.normal(jax.random.key(0), shape)
        text = jax.jit(lambda x: _gram(x, bf16=True)).lower(x).compile().as_text()
        dots = [c for c in text.split("\n\n") if " dot(" in c]
        assert dots and all(re.search(r"bf16\[\d+,\d+\]\{[^}]*\} parameter", c) for c in dots), text
        assert not re.search(r"f32\[\d+,\d+\]\{[^}]*\} convert\(", text), text  # no upcast before the dot
        got, want = np.asarray(_gram(x, bf16=True)), np.asarray(_gram(x))
        assert 0 < np.abs(got - want).max() < 0.05 * shape[1] ** 0.5  # bf16's rounding, and only that
    tall = jax.random.normal(jax.random.key(0), (160, 64))
    np.testing.assert_array_equal(np.asarray(_gram(tall, bf16=True)), np.asarray(_gram(tall)))


def test_ns_steps_zero_leaves_only_the_normalisations():
    import jax
    import jax.numpy as jnp
    g = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    o0, o5 = polar_express(g, 0), polar_express(g, 5)
    s0, s5 = jnp.linalg.svd(o0, compute_uv=False), jnp.linalg.svd(o5, compute_uv=False)
    assert float(s0.max() / s0.min()) > 3 * float(s5.max() / s5.min())  # the iterations flatten the spectrum


@pytest.mark.parametrize("shape", [(256, 256), (192, 256)])
def test_bf16_products_sit_between_fp32_and_bf16(shape):
    from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS
    g = jax.random.normal(jax.random.key(1), shape) * jnp.linspace(0.1, 3.0, shape[1])  # an uneven spectrum
    ref = polar_express_f64(np.asarray(g))
    err = {name: relative_difference(polar_express(g, 5, dt), ref)
           for name, dt in (("fp32", jnp.float32), ("bf16p", BF16_PRODUCTS), ("bf16o", BF16_OPERANDS),
                            ("bf16", jnp.bfloat16))}
    # fp32 is float64's iteration to rounding; bf16 operands cost accuracy, bf16 iterates more.
    assert err["fp32"] < 1e-4 < err["bf16p"] < err["bf16"] < 0.2, err
    assert 1e-4 < err["bf16o"] < err["bf16"], err
    for dt in (BF16_PRODUCTS, BF16_OPERANDS):
        o = polar_express(g, 5, dt)
        assert o.dtype == g.dtype
        s, s32 = (jnp.linalg.svd(v, compute_uv=False) for v in (o, polar_express(g, 5, jnp.float32)))
        assert float(jnp.abs(s - s32).max()) < 0.05, dt  # the same spectrum as fp32's


@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256), (128, 256)])
def test_rectangular_matrices_take_the_gram_form_and_stay_close_to_float64(shape):
    from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS, GRAM_FORM_ASPECT, _gram_form
    assert max(shape) >= GRAM_FORM_ASPECT * min(shape)
    g = jax.random.normal(jax.random.key(2), shape) * jnp.linspace(0.1, 3.0, shape[1])
    ref = polar_express_f64(np.asarray(g))
    rel = lambda o: relative_difference(o, ref)  # noqa: E731
    o = polar_express(g, 5, BF16_PRODUCTS)
    # The bf16 products of the standard iteration land ~1e-2 away (the square test above); the Gram
    # form in fp32 stays within rounding of the float64 iteration, its condition number squared.
    assert rel(o) < 1e-3 and rel(polar_express(g, 5, jnp.float32)) < 1e-4, (rel(o), rel(polar_express(g, 5)))
    assert o.dtype == g.dtype and o.shape == g.shape
    # bf16-operands rounds x to bf16 for the first Gram matrix and the final product: a few 1e-3
    # (bf16 keeps 8 bits, 2^-8 = 3.9e-3), the fp32 chain between them adding nothing of its own.
    o = polar_express(g, 5, BF16_OPERANDS)
    assert 1e-4 < rel(o) < 1e-2 and o.dtype == g.dtype and o.shape == g.shape, rel(o)
    x = jax.random.normal(jax.random.key(3), shape)
    assert np.array_equal(np.asarray(_gram_form(x, 0)), np.asarray(x))  # no iterations: x as it came


def test_ns_dtype_reaches_the_optimizer_and_a_bad_one_is_one_sentence():
    from flaxchat.config import TrainConfig
    from flaxchat.errors import UserError
    from flaxchat.train import train_step
    x = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 2, 32)), jnp.int32)
    losses = {}
    cpu = kernels.choose("cpu")  # the CPU's Polar Express forms (bf16-products is one), on any backend
    for dt in ("float32", "bf16-products"):
        model = GPT(CFG, rngs=nnx.Rngs(0), kernels=cpu.model)
        opt = nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=32, ns_dtype=dt), Schedule(30), cpu.polar),
                            wrt=nnx.Param)
        losses[dt] = [float(train_step(model, opt, x, jnp.roll(x, -1, -1), plan=cpu.plan)) for _ in range(5)]
    assert losses["float32"][0] == losses["bf16-products"][0]  # the same model before any update
    assert losses["float32"][4] != losses["bf16-products"][4]  # the dtype did reach Muon
    assert abs(losses["float32"][4] - losses["bf16-products"][4]) < 1e-3 * losses["float32"][4]
    with pytest.raises(UserError, match="--ns-dtype must be one of auto, float32, bfloat16, bf16-products, bf16-operands"):
        TrainConfig(ns_dtype="fp8").validate()
    TrainConfig(ns_dtype="bf16-operands").validate()


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
def test_one_pass_normalisation_equals_the_three_norms(shape):
    """MuonEq and the Frobenius pre-normalisation from one pass of column sums of squares (fp32)
    equal the three-norm form in float64, and leave the matrix at norm 1/1.01 with equal columns."""
    from flaxchat.optim import normalised as _normalised
    rng = np.random.default_rng(5)
    g = rng.normal(size=shape) * np.exp(rng.uniform(np.log(1e-3), np.log(1e2), size=(1, shape[1])))
    x = g * (np.linalg.norm(g) / math.sqrt(shape[1]) / np.maximum(np.linalg.norm(g, axis=0, keepdims=True), 1e-6))
    ref = x / (np.linalg.norm(x) * 1.01 + 1e-6)
    out = np.asarray(_normalised(jnp.asarray(g, jnp.float32), jnp.float32), np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-9)
    assert abs(np.linalg.norm(out) - 1 / 1.01) < 1e-5
    cols = np.linalg.norm(out, axis=0)
    assert cols.max() / cols.min() < 1 + 1e-5

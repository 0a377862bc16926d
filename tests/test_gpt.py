"""The model: shapes, causality, sliding windows against a dense reference, GQA, determinism."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import kernels, ops
from flaxchat.config import GPTConfig, config_for_depth
from flaxchat.errors import UserError
from flaxchat.gpt import GPT, estimate_flops, matmul_param_count, mean_keys_seen, param_count
from flaxchat.kernels import cpu, cpu_attention

TINY = GPTConfig(sequence_len=48, vocab_size=203, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                 window_pattern="SL", attn_block=16)


# The tests run the model and the kernels under jit: eagerly every op compiles as its own program,
# minutes in all on a cold compilation cache (CI). A jitted function is made inside the test that
# calls it, so it is traced there, under whatever that test has monkeypatched.

def _normal(seed, *shapes):
    """Standard-normal float32 arrays from numpy: jax.random compiles a program per shape (~2 s cold)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, np.float32) for shape in shapes]


def _nonzero_model(cfg, seed=0, kernels=None):
    """Zero-initialised output projections hide bugs (a layer that does nothing): randomise all."""
    model = GPT(cfg, rngs=nnx.Rngs(seed), kernels=kernels)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    noise = _normal(seed + 1, *(x.shape for x in leaves))
    leaves = [jnp.asarray(np.asarray(x) + 0.05 * n) for x, n in zip(leaves, noise)]  # numpy: nothing to compile
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def _forward():
    """model(idx) as a jitted function: one compile per model config and input shape."""
    return nnx.jit(lambda model, idx: model(idx))


def _vjp(f, primals, ct):
    """f(*primals) and the pullback of `ct` through f, as one program."""
    def run(primals, ct):
        out, pull = jax.vjp(f, *primals)
        return out, pull(ct)
    return jax.jit(run)(primals, ct)


def test_shapes_and_padding():
    model = GPT(TINY, rngs=nnx.Rngs(0))
    logits = _forward()(model, jnp.zeros((2, 48), jnp.int32))
    assert logits.shape == (2, 48, 203) and logits.dtype == jnp.float32
    assert model.wte.embedding.shape == (256, 64)  # vocab padded to a multiple of 64
    assert float(np.max(np.abs(logits))) <= 15.0  # soft-cap


def test_causality_future_tokens_never_change_the_past():
    model, forward = _nonzero_model(TINY), _forward()  # one compile for all four inputs
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, 203, (1, 48)), jnp.int32)
    base = np.asarray(forward(model, idx))  # sliced in numpy: a jax slice of each size compiles
    for t in (5, 17, 40):
        changed = idx.at[0, t].set((idx[0, t] + 7) % 203)
        out = np.asarray(forward(model, changed))
        np.testing.assert_array_equal(out[0, :t], base[0, :t])
        assert not np.allclose(out[0, t:], base[0, t:])


@pytest.mark.parametrize("window,T,block", [(16, 48, 16), (32, 48, 16), (48, 48, 16), (20, 40, 8), (64, 50, 16)])
def test_blockwise_attention_equals_dense_reference(window, T, block):
    q, k, v = _normal(0, (2, T, 4, 8), (2, T, 2, 8), (2, T, 2, 8))  # GQA: 2 kv heads for 4 query heads

    def out_and_grad(f):  # f(q, k, v) and the gradient of its sum in q, as one program
        return jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(lambda q: f(q, k, v).sum())(q)))(q, k, v)

    got, g_got = out_and_grad(lambda q, k, v: cpu_attention.causal_attention(q, k, v, window, block))
    want, g_want = out_and_grad(lambda q, k, v: ops.reference_attention(q, k, v, window))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # and the gradients agree too
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-4)


def test_sliding_window_limits_what_a_layer_sees():
    """Run the model and watch its short-window layer: a token more than a window back cannot
    change that layer's output; one just inside the window does."""
    cfg = dataclasses.replace(TINY, n_layer=2, window_pattern="SL")
    assert cfg.window_sizes() == [16, 48]
    assert dataclasses.replace(TINY, n_layer=1).window_sizes() == [48]  # the last layer is always full context
    model = _nonzero_model(cfg)
    seen = {}

    def attend(layer, q, k, v, window):  # the model's own kernel; only records layer 0's output
        y = cpu_attention.causal_attention(q, k, v, window=window, block=cfg.attn_block)
        if layer == 0:
            seen["window"], seen["y"] = window, y
        return y

    @nnx.jit
    def layer0(model, idx):  # layer 0's output; its window is recorded while tracing (the first call)
        model(idx, attend=attend)
        return seen["y"]

    idx = jnp.asarray(np.random.default_rng(2).integers(0, 203, (1, 48)), jnp.int32)
    base, W = np.asarray(layer0(model, idx)), seen["window"]
    assert W == 16
    p = 5  # smear mixes token p into position p+1, so keys p and p+1 carry the change
    changed = np.asarray(layer0(model, idx.at[0, p].set((idx[0, p] + 11) % 203)))
    np.testing.assert_array_equal(changed[0, p + 1 + W:], base[0, p + 1 + W:])
    assert not np.allclose(changed[0, p + W - 1], base[0, p + W - 1])  # key p is just inside the window
    np.testing.assert_array_equal(changed[0, :p], base[0, :p])


# --- gradients: the hand-written VJPs against autodiff of the plain ops -------------------------

def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("window,T,block", [(16, 48, 16), (48, 48, 16), (20, 40, 8)])
def test_attention_vjp_dq_dk_dv_equal_autodiff_fp32_and_bf16(window, T, block):
    q, k, v, ct = _normal(3, (2, T, 4, 8), (2, T, 2, 8), (2, T, 2, 8), (2, T, 4, 8))  # ct: not all ones

    def vjp(f, dtype):
        return _vjp(f, [a.astype(dtype) for a in (q, k, v)], ct.astype(dtype))[1]

    custom = lambda q, k, v: cpu_attention.causal_attention(q, k, v, window=window, block=block)
    plain = lambda q, k, v: ops.reference_attention(q, k, v, window=window)
    exact = [np.asarray(g, np.float64) for g in vjp(plain, jnp.float32)]
    for got, want, name in zip(vjp(custom, jnp.float32), exact, "qkv"):
        assert _rel_err(got, want) < 2e-6, name
    # bf16: at least about as close to the fp32 gradient as autodiff of the plain ops in bf16.
    for got, ad, want, name in zip(vjp(custom, jnp.bfloat16), vjp(plain, jnp.bfloat16), exact, "qkv"):
        assert got.dtype == jnp.bfloat16
        assert _rel_err(got, want) <= 1.25 * _rel_err(ad, want) + 1e-3, name


@pytest.mark.parametrize("n_in,n_out", [(64, 96), (96, 64), (64, 64)])  # widens, narrows (g transposed), square
def test_matmul_vjp_equals_autodiff_fp32_and_bf16(n_in, n_out):
    x, w, ct = _normal(4, (2, 24, n_in), (n_in, n_out), (2, 24, n_out))
    w = w * 0.1

    def vjp(f, dtype):
        return _vjp(f, (x.astype(dtype), w.astype(dtype)), ct.astype(dtype))[1]

    exact = vjp(lambda a, b: a @ b, jnp.float32)
    for got, want in zip(vjp(cpu.matmul, jnp.float32), exact):
        assert _rel_err(got, want) < 1e-6
    for got, ad, want in zip(vjp(cpu.matmul, jnp.bfloat16), vjp(lambda a, b: a @ b, jnp.bfloat16), exact):
        assert _rel_err(got, want) <= 1.25 * _rel_err(ad, want) + 1e-3


@pytest.mark.parametrize("cap", [15.0, 60.0])
def test_softcap_cross_entropy_equals_optax_on_capped_logits_value_and_gradient(cap):
    """The fused loss (the CPU's with its own backward from the raw logits, and the plain one under
    autodiff, what TPU and GPU run) against autodiff of optax's cross-entropy on cap·tanh(z/cap),
    with logits big enough that the cap bends them. One row has every logit far below zero: with a
    cap above ops.FIXED_SHIFT_CAP, exp(s - cap) would underflow to 0 there and the loss be -inf, so
    the row maximum is taken."""
    import optax
    rng = np.random.default_rng(7)
    z = rng.standard_normal((3, 7, 50), np.float32) * 20
    z[1, 2] = -1000.0 - rng.random(50, np.float32)
    labels = rng.integers(0, 50, (3, 7), np.int32)
    w = rng.random((3, 7), np.float32)  # a weighted sum, so each row's cotangent differs
    fused = lambda z: jnp.sum(w * cpu.softcap_cross_entropy(z, labels, cap))
    plain = lambda z: jnp.sum(w * optax.softmax_cross_entropy_with_integer_labels(cap * jnp.tanh(z / cap), labels))

    def value_and_grad(f):  # f(z) and its gradient as one program, traced under what is patched now
        return jax.jit(jax.value_and_grad(f))(z)

    want, want_grad = value_and_grad(plain)
    got, got_grad = value_and_grad(fused)
    assert _rel_err(got, want) < 1e-6
    assert _rel_err(got_grad, want_grad) < 1e-5
    assert jax.jit(lambda z: ops.softcap_cross_entropy(z, labels, cap))(z).shape == labels.shape
    got, got_grad = value_and_grad(lambda z: jnp.sum(w * ops.softcap_cross_entropy(z, labels, cap)))
    assert _rel_err(got, want) < 1e-6
    assert _rel_err(got_grad, want_grad) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotary_rms_norm_with_its_own_backward_equals_autodiff(dtype):
    """q and k's rotary + QK-norm with the CPU's hand-written backward (from the output and one RMS
    per row) against autodiff of rms_norm(rotary(x)) * scale: fp32 to float rounding; bf16 no
    further from the fp32 result than autodiff in bf16 is."""
    x, g = _normal(3, (2, 24, 3, 16), (2, 24, 3, 16))  # g: a cotangent that differs per element
    x, g = (x * 3).astype(dtype), g.astype(dtype)
    table = ops.rotary_table(np.arange(24), 16, 100.0, dtype)
    ours = lambda x: cpu.rotary_rms_norm(x, table, 1.2)
    plain = lambda x: ops.rms_norm(ops.rotary(x, table)) * 1.2
    (y, (dx,)), (y_plain, (dx_plain,)) = _vjp(ours, (x,), g), _vjp(plain, (x,), g)
    table32 = ops.rotary_table(np.arange(24), 16, 100.0, jnp.float32)
    y_exact, (exact,) = _vjp(lambda x: ops.rms_norm(ops.rotary(x, table32)) * 1.2, (x.astype(jnp.float32),),
                             g.astype(jnp.float32))
    if dtype == jnp.float32:
        assert _rel_err(y, y_plain) < 1e-6 and _rel_err(dx, dx_plain) < 1e-6
    else:
        assert _rel_err(y, y_exact) <= 1.25 * _rel_err(y_plain, y_exact) + 1e-3
        assert _rel_err(dx, exact) <= 1.25 * _rel_err(dx_plain, exact) + 1e-3
    assert _rel_err(dx, exact) > 0  # the two backwards are different programs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_whole_model_gradient_equals_the_plain_ops(dtype):
    """The model's gradient with this backend's kernels (on CPU the custom attention, matmul,
    rotary and loss VJPs) against the same model run on the portable kernels (plain ops, dense
    attention through the `attend` hook), differentiated by autodiff."""
    from flaxchat.train import token_losses
    model = _nonzero_model(TINY)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(0, 203, (2, 48)), jnp.int32)
    y = jnp.asarray(rng.integers(0, 203, (2, 48)), jnp.int32)
    graphdef, params = nnx.split(model, nnx.Param)

    def grads(dtype, plain):
        def loss(p):
            m = nnx.merge(graphdef, p)
            m.dtype = dtype
            if plain:
                m.kernels = kernels.portable()
                return jnp.mean(_plain_losses(m, x, y))
            return jnp.mean(token_losses(m, x, y))
        return jax.jit(jax.grad(loss))(params)  # traced here: under the patches where they are on

    def _plain_losses(m, x, y):
        import optax
        logits = m(x, attend=lambda i, q, k, v, w: ops.reference_attention(q, k, v, w))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    assert model.kernels is kernels.choose().model  # this backend's: on a CPU the hand-written backwards
    # bf16 programs at the default matmul precision (an accelerator's suite runs at "highest", at
    # which Pallas cannot lower a TPU kernel's bf16 dots); the fp32 reference at the suite's own
    bf16 = jax.default_matmul_precision("default") if dtype == jnp.bfloat16 else contextlib.nullcontext()
    with bf16:
        custom = grads(dtype, False)
        plain = grads(dtype, True)
    exact = grads(jnp.float32, True)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(t)])
    if dtype == jnp.float32:
        assert _rel_err(flat(custom), flat(exact)) < 1e-5
    else:
        assert _rel_err(flat(custom), flat(exact)) <= 1.25 * _rel_err(flat(plain), flat(exact)) + 1e-3


def test_heads_first_attention_gives_the_same_loss_and_gradients():
    """The TPU record computes attention heads-first (projections straight to (B, H, T, D) for
    splash, no transposes); the same model with splash on (B, T, H, D) arrays gives the same loss
    and gradient of every parameter (fp32, splash in Pallas interpret mode; value embeddings, GQA
    and a window included)."""
    from flaxchat.train import _micro_loss
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, vocab_size=203, sequence_len=128, window_pattern="SL")
    record = kernels.choose("tpu", "splash").model
    assert record.attention_heads_first is not None
    graphdef, params, rest = nnx.split(_nonzero_model(cfg), nnx.Param, ...)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(0, 203, (2, 128)), jnp.int32)

    def value_and_grad(record):
        m = nnx.merge(graphdef, params, rest)
        m.kernels = record
        gd, p, r = nnx.split(m, nnx.Param, ...)
        return jax.jit(jax.value_and_grad(lambda p: _micro_loss(p, gd, r, x, jnp.roll(x, -1, 1))[0]))(p)

    first, first_g = value_and_grad(dataclasses.replace(record, head_loss=None))
    plain, plain_g = value_and_grad(dataclasses.replace(record, head_loss=None, attention_heads_first=None))
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(t)])
    assert abs(float(first) - float(plain)) <= 1e-6 * abs(float(plain))
    assert _rel_err(flat(first_g), flat(plain_g)) < 1e-5


def test_gates_start_as_nanochats():
    """Value-embedding gate: 12 input channels, 3·sigmoid, kernel U(0, 0.02); smear gate U(0, 0.02)."""
    from flaxchat.gpt import scaling_param_count
    cfg = config_for_depth(4, vocab_size=512, sequence_len=64)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    gate = np.asarray(model.blocks[cfg.n_layer - 1].attn.ve_gate.kernel[...])
    assert (cfg.ve_gate_channels, cfg.ve_gate_scale) == (12, 3.0) and gate.shape == (12, cfg.n_kv_head)
    # a checkpoint written before the gate fields existed had 32 channels and 2·sigmoid: it still loads
    old = {k: v for k, v in cfg.to_dict().items() if not k.startswith("ve_gate")}
    assert (GPTConfig.from_dict(old).ve_gate_channels, GPTConfig.from_dict(old).ve_gate_scale) == (32, 2.0)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    smear = np.asarray(model.smear_gate.kernel[...])
    for w in (gate, smear):
        assert float(w.min()) >= 0.0 and float(w.max()) <= 0.02 and float(w.std()) > 0.002
    # the horizon counts the blocks (matrices and gates) and the LM head, as nanochat
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size
    gates = sum(12 * cfg.n_kv_head for i in range(L) if cfg.has_value_embed(i))
    assert scaling_param_count(model) == L * 12 * d * d + gates + d * V


def test_gqa_matches_repeated_kv_heads():
    q, k, v = _normal(1, (1, 32, 6, 8), (1, 32, 2, 8), (1, 32, 2, 8))
    attend = jax.jit(lambda q, k, v: cpu_attention.causal_attention(q, k, v, window=32, block=16))
    gqa = attend(q, k, v)
    mha = attend(q, np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2))
    np.testing.assert_allclose(gqa, mha, rtol=1e-5, atol=1e-6)


def test_forward_is_deterministic_and_remat_is_exact():
    model, forward = _nonzero_model(TINY), _forward()
    idx = jnp.asarray(np.random.default_rng(1).integers(0, 203, (2, 48)), jnp.int32)
    a, b = forward(model, idx), forward(model, idx)
    np.testing.assert_array_equal(a, b)
    for backend in ("cpu", "tpu"):  # the CPU's remat, and nnx.remat (what TPU and GPU run)
        remat = _nonzero_model(TINY, kernels=kernels.choose(backend, "blockwise", grad_checkpoint=True).model)
        np.testing.assert_allclose(forward(remat, idx), a, rtol=1e-6, atol=1e-6)


def test_tied_embeddings_have_no_head():
    model = GPT(dataclasses.replace(TINY, tie_embeddings=True), rngs=nnx.Rngs(0))
    assert model.lm_head is None
    assert _forward()(model, jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 203)


def test_depth_preset_and_flops():
    cfg = config_for_depth(4)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_dim) == (4, 256, 4, 64)
    cfg = config_for_depth(12, vocab_size=32768, sequence_len=2048)
    assert (cfg.n_embd, cfg.n_head, cfg.head_dim) == (768, 6, 128)
    model = GPT(TINY, rngs=nnx.Rngs(0))
    L, d = TINY.n_layer, TINY.n_embd
    blocks = L * (4 * d * d + 8 * d * d) - 2 * L * d * d // 2  # q,o: d*d; k,v: d*d/2 (GQA); mlp: 8d^2
    assert matmul_param_count(model) == blocks + d * TINY.padded_vocab_size
    T = TINY.sequence_len
    # Keys each query sees, counted on the mask: key j is seen by query i when i - w < j <= i.
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = [float(((j <= i) & (j > i - w)).sum()) / T for w in TINY.window_sizes()]
    assert min(TINY.window_sizes()) < T  # a short-window layer, so the window's cap is tested
    assert estimate_flops(model) == pytest.approx(6 * matmul_param_count(model) + 12 * d * sum(seen), rel=1e-12)
    # A full causal layer sees (T + 1) / 2 keys on average: half the 12·L·d·T of the plain formula.
    assert mean_keys_seen(T, T) == (T + 1) / 2 and mean_keys_seen(4 * T, T) == (T + 1) / 2
    assert param_count(model) > matmul_param_count(model)


@pytest.mark.parametrize("kwargs,words", [
    (dict(n_embd=65, n_head=4), "divisible"),
    (dict(window_pattern="SXL"), "window pattern"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_head=4, n_kv_head=3), "multiple"),
])
def test_impossible_configs_say_what_is_wrong(kwargs, words):
    with pytest.raises(UserError, match=words):
        dataclasses.replace(TINY, **kwargs)


def test_depth_zero_is_refused():
    with pytest.raises(UserError, match="depth"):
        config_for_depth(0)


def test_a_bf16_model_stores_its_embedding_tables_in_bf16_and_its_checkpoints_load_into_fp32(tmp_path):
    """nanochat keeps the token and value embeddings in the compute dtype; the matrices and scalars
    stay fp32. A checkpoint written by either loads into the other (export reads a TPU run in fp32)."""
    from flaxchat.checkpoint import Checkpointer
    bf16 = GPT(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    tables = [bf16.wte.embedding] + [b.attn.ve.embedding for b in bf16.blocks if b.attn.ve is not None]
    assert len(tables) > 1 and {t.dtype for t in tables} == {jnp.dtype(jnp.bfloat16)}
    assert bf16.lm_head.kernel.dtype == bf16.blocks[0].attn.c_q.kernel.dtype == bf16.resid_lambdas.dtype == jnp.float32
    assert GPT(TINY, rngs=nnx.Rngs(0)).wte.embedding.dtype == jnp.float32
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, bf16, None, {})
    fp32 = GPT(TINY, rngs=nnx.Rngs(1))
    ckpt.restore(fp32, step=1)
    ckpt.close()
    assert fp32.wte.embedding.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(fp32.wte.embedding[...]), np.asarray(bf16.wte.embedding[...], np.float32))

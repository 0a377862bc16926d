"""Every attention kernel that runs on CPU equals `reference_attention`, in values and in dq, dk, dv
under a random cotangent: fp32 and bf16, causal and sliding-window, grouped-query. And the
blockwise kernel's training memory is O(T): the compiled train step at T=2048 needs what T=1024
needs for the same tokens, and --grad-checkpoint lowers the peak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import kernels, ops
from flaxchat.config import GPTConfig, TrainConfig
from flaxchat.errors import UserError
from flaxchat.kernels import cpu_attention, gpu, tpu


def _inputs(B, T, H, Hkv, D, dtype, seed=0):
    rng = np.random.default_rng(seed)  # not jax.random: a compile for each shape, ~2 s each on a cold cache
    q, k, v, ct = (rng.standard_normal((B, T, h, D), np.float32) for h in (H, Hkv, Hkv, H))
    # Rounded to `dtype` first, so the fp32 reference sees the very numbers the kernel sees.
    return [x.astype(dtype) for x in (q, k, v)], ct


def _check(attend, B, T, H, Hkv, D, window, dtype):
    (q, k, v), ct = _inputs(B, T, H, Hkv, D, dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

    want, want_g = jax.jit(lambda *a: (ops.reference_attention(*a, window),
                                       jax.grad(lambda *b: loss(lambda *c: ops.reference_attention(*c, window), *b),
                                                (0, 1, 2))(*a)))(*f32)
    got, got_g = jax.jit(lambda *a: (attend(*a, window),
                                     jax.grad(lambda *b: loss(lambda *c: attend(*c, window), *b), (0, 1, 2))(*a)))(q, k, v)
    assert got.dtype == dtype and [g.dtype for g in got_g] == [dtype] * 3
    # fp32: summation order only (on a TPU at full matmul precision, whose exp and accumulation
    # order differ more: dq within 5.6e-5 on a v5e). bf16: the inputs are exact, the kernel rounds
    # its products and outputs to bf16 (8 bits of mantissa), so a few percent of each array's scale.
    tol = (2e-5 if jax.default_backend() == "cpu" else 1e-4) if dtype == jnp.float32 else 3e-2
    for name, a, b in [("out", got, want), *zip(("dq", "dk", "dv"), got_g, want_g)]:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < tol, f"{name}: max error {err:.2e} of the reference's scale"


DTYPES = [jnp.float32, jnp.bfloat16]


def _refuse(name):
    return lambda *a: (_ for _ in ()).throw(AssertionError(f"{name} ran"))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [40, 20, 7], ids=["causal", "window20", "window7"])
def test_blockwise_loops_equal_reference(dtype, window, monkeypatch):
    """The loops (what sequences longer than SHORT_TOKENS run), here at T=40 in blocks of 16 (a
    short last block); windows that end inside a block; 4 heads on 2."""
    monkeypatch.setattr(cpu_attention, "SHORT_TOKENS", 16)
    monkeypatch.setattr(cpu_attention, "_short_attention", _refuse("the unrolled kernel"))
    _check(lambda q, k, v, w: cpu_attention.causal_attention(q, k, v, w, block=16), 2, 40, 4, 2, 16, window, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, window", [(40, 40), (40, 20), (40, 7), (32, 12), (20, 20), (16, 5)],
                         ids=["causal", "window20", "window7", "window12", "padded", "one-tile-window5"])
def test_short_sequences_take_the_unrolled_kernel_and_equal_reference(dtype, T, window, monkeypatch):
    """Up to SHORT_TOKENS tokens the kernel is unrolled with its probabilities kept; the loops
    must not run there (they raise if called), and the numbers are the reference's."""
    assert T <= cpu_attention.SHORT_TOKENS
    monkeypatch.setattr(cpu_attention, "_attention", _refuse("the loops"))
    _check(lambda q, k, v, w: cpu_attention.causal_attention(q, k, v, w, block=16), 2, T, 4, 2, 16, window, dtype)


def test_short_sequences_tile_by_at_most_short_tile(monkeypatch):
    """The model's 128-key blocks become 64-query tiles on a short sequence (what measured faster),
    a smaller block stays as it is, and a sequence over SHORT_TOKENS runs the loops in its blocks."""
    seen = []
    short = cpu_attention._short_attention
    monkeypatch.setattr(cpu_attention, "_short_attention",
                        lambda q, k, v, w, b: seen.append(("short", b)) or short(q, k, v, w, b))
    loops = cpu_attention._attention
    monkeypatch.setattr(cpu_attention, "_attention", lambda q, k, v, w, b: seen.append(("loops", b)) or loops(q, k, v, w, b))
    q = jnp.ones((1, 256, 2, 8))
    # jitted (eagerly every op compiles on its own); a new function each call, so it is traced, and
    # dispatches, under the patches of the moment
    attend = lambda block: jax.jit(lambda q: cpu_attention.causal_attention(q, q, q, 128, block=block))(q)
    attend(128)
    attend(32)
    monkeypatch.setattr(cpu_attention, "SHORT_TOKENS", 128)
    attend(128)
    assert seen == [("short", cpu_attention.SHORT_TILE), ("short", 32), ("loops", 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [40, 20], ids=["causal", "window20"])
def test_xla_equals_reference(dtype, window):
    _check(ops.xla_attention, 2, 40, 4, 2, 16, window, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [256, 100], ids=["causal", "window100"])
def test_splash_interpret_equals_reference(dtype, window):
    """The TPU kernel itself (jax.experimental.pallas.ops.tpu.splash_attention) in Pallas interpret
    mode: T=256 (its blocks are multiples of 128), 4 query heads on 2 kv heads. ~10 s each here."""
    _check(lambda q, k, v, w: tpu.splash_attention(q, k, v, w, block=128, interpret=True), 1, 256, 4, 2, 32, window, dtype)


def _heads_first(attend):
    """`attend` on (B, heads, T, D) arrays, called on and returning the reference's (B, T, heads, D)."""
    swap = lambda a: jnp.swapaxes(a, 1, 2)
    return lambda q, k, v, w: swap(attend(swap(q), swap(k), swap(v), w))


@pytest.mark.parametrize("T, window", [(256, 100), (200, 200)], ids=["window100", "padded"])
def test_splash_heads_first_equals_reference(T, window):
    """The TPU record's attention_heads_first, splash on (B, heads, T, D) with no transposes around
    the kernel: the reference's output and gradients, on whole tiles and on a padded sequence."""
    record = kernels.choose("tpu", "splash").model
    _check(_heads_first(lambda q, k, v, w: record.attention_heads_first(q, k, v, w, 128)), 1, T, 4, 2, 32, window,
           jnp.float32)


def test_splash_pads_a_sequence_that_is_not_whole_tiles():
    """--attention splash (and a TPU's prefill of any prompt length) pads to whole 128-lane tiles:
    T=200 runs as 256, the padded keys after every real query, so the numbers are the reference's."""
    _check(lambda q, k, v, w: kernels.choose("cpu", "splash").model.attention(q, k, v, w, 128), 1, 200, 4, 2, 32, 200,
           jnp.float32)


def test_cudnn_falls_back_to_xla_off_gpu(capsys):
    """No GPU here: cuDNN refuses at trace time and the XLA form runs, said once."""
    _check(gpu.cudnn_attention, 1, 24, 2, 1, 16, 10, jnp.bfloat16)
    assert "attention: cudnn unavailable here" in capsys.readouterr().out


def test_the_kernels_record_picks_by_backend(capsys):
    """One choice per backend, made in one place: auto is splash on TPU, cuDNN on GPU (cuda and
    rocm too), blockwise on CPU; a named kernel runs on any backend; the record is cached (one jit
    per record) and says what it is; compute_init makes it once and prints it."""
    assert kernels.choose("tpu").model.attention_name == "splash"
    assert kernels.choose("gpu").model.attention_name == kernels.choose("cuda").model.attention_name == "cudnn"
    assert kernels.choose("cpu").model.attention_name == "blockwise"
    assert kernels.choose("tpu", "xla").model.attention_name == "xla"
    assert kernels.choose("cpu") is kernels.choose("cpu")
    assert kernels.choose("cpu", grad_checkpoint=True).model.remat is not None
    assert kernels.choose("cpu").model.remat is None
    assert kernels.choose("tpu").polar.ns_dtype == "bfloat16" and kernels.choose("tpu").plan.scan_unroll == 1
    assert kernels.attention_names() == ("auto", "blockwise", "cudnn", "splash", "xla")
    with pytest.raises(UserError, match="--attention must be one of auto, blockwise, cudnn, splash, xla"):
        kernels.choose("cpu", "flash")
    with pytest.raises(UserError, match="--attention must be one of"):
        TrainConfig(attention="flash").validate()
    from flaxchat.common import compute_init
    compute = compute_init("auto", attention="xla", grad_checkpoint=True)
    backend = jax.default_backend()
    chosen = kernels.choose(backend, "xla", True)
    assert (compute.kernels, compute.polar, compute.plan) == (chosen.model, chosen.polar, chosen.plan)
    dtype = "float32" if backend == "cpu" else "bfloat16"
    assert capsys.readouterr().out == (f"compute: {dtype} on {backend} (auto); kernels: {backend}, attention xla, "
                                       "remat (--grad-checkpoint)\n")


def test_the_attention_registry_takes_a_backend_files_kernel(monkeypatch):
    """Adding a kernel is one entry in a backend file's ATTENTION: --attention then knows it, and the
    model runs it."""
    from flaxchat.gpt import GPT
    calls = []

    def mine(q, k, v, window, block):
        calls.append(q.shape)
        return ops.xla_attention(q, k, v, window)

    monkeypatch.setitem(tpu.ATTENTION, "mine", mine)
    assert "mine" in kernels.attention_names()
    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT(cfg, rngs=nnx.Rngs(0), kernels=kernels.choose("cpu", "mine").model)
    model(jnp.zeros((1, 16), jnp.int32))
    assert calls == [(1, 16, 2, 16)]


def test_model_kernels_agree():
    """The record switches the kernel inside the model: same logits and gradients, blockwise vs xla."""
    from flaxchat.gpt import GPT
    cfg = GPTConfig(sequence_len=32, vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                    window_pattern="SL", attn_block=8)
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 32)), jnp.int32)
    out = {}
    for name in ("blockwise", "xla"):
        model = GPT(cfg, rngs=nnx.Rngs(0), kernels=kernels.choose(attention=name).model)
        # jitted: eagerly every op compiles as its own program (45 s on a cold compilation cache)
        out[name] = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(m(idx) ** 2)))(model)
    np.testing.assert_allclose(out["blockwise"][0], out["xla"][0], rtol=1e-5)
    ga, gb = (jax.tree.leaves(nnx.state(g[1], nnx.Param)) for g in (out["blockwise"], out["xla"]))
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


# --- memory -------------------------------------------------------------------------------------


def _train_step_memory(T, rows, grad_checkpoint=False, n_layer=2):
    """XLA's memory analysis of the compiled train step (abstract state: nothing allocated)."""
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import train_step

    cfg = GPTConfig(sequence_len=T, vocab_size=256, n_layer=n_layer, n_head=2, n_kv_head=2, n_embd=64,
                    window_pattern="L")
    tx = build_optimizer(OptimConfig(optimizer="adamw", n_embd=64), Schedule(10))
    record = kernels.choose("cpu", "blockwise", grad_checkpoint).model

    def make():
        model = GPT(cfg, rngs=nnx.Rngs(0), kernels=record)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(make))

    def step(state, x, y):
        model, opt = nnx.merge(graphdef, state)
        return train_step(model, opt, x, y), nnx.state((model, opt))

    x = jax.ShapeDtypeStruct((1, rows, T), jnp.int32)
    compiled = jax.jit(step, donate_argnums=0).lower(state, x, x).compile(
        {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes


CPU_MEMORY = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="XLA:CPU's memory analysis of the step; a TPU or GPU compiler plans memory its own way")


@CPU_MEMORY
@pytest.mark.timeout(300)
def test_blockwise_training_memory_is_linear_in_T():
    """Same tokens per step, rows twice as long: activation memory must stay the same, O(T) per row.

    With T×T residuals (every block's probabilities saved, the kernel before this test) one 2048-token
    row holds 2 heads x 2048²/2 x 4 B = 8 MiB per layer of them, and T=2048 needed 1.6x the
    temporaries of T=1024 (measured: 138 vs 82 MiB, 1.69x); with the log-sum-exp alone it is within a few percent."""
    short = _train_step_memory(1024, 2)
    long = _train_step_memory(2048, 1)
    assert long < 1.15 * short, f"temporaries {long / 2**20:.1f} MiB at T=2048 vs {short / 2**20:.1f} MiB at T=1024"


@CPU_MEMORY
@pytest.mark.timeout(300)
def test_grad_checkpoint_lowers_peak():
    """Rematerialising each block must trade compute for memory (it made the peak larger while the
    attention backward kept its own saved probabilities, and XLA:CPU ran remat's recomputation
    in the forward: 144.5 vs 144.1 MiB before; see kernels.cpu.remat_block)."""
    plain = _train_step_memory(1024, 2, n_layer=4)
    remat = _train_step_memory(1024, 2, grad_checkpoint=True, n_layer=4)
    assert remat < 0.8 * plain, f"temporaries {remat / 2**20:.1f} MiB with checkpointing vs {plain / 2**20:.1f} MiB without"


_SPLASH_ON_A_MESH = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from flaxchat import ops, sharding
from flaxchat.kernels import tpu
mesh = sharding.make_mesh(jax.devices(), "fsdp")
rng = np.random.default_rng(0)  # numpy, and the reference jitted: jax.random and eager ops compile op by op
q, k, v = (rng.standard_normal(s, np.float32) for s in [(2, 128, 4, 32), (2, 128, 2, 32), (2, 128, 2, 32)])
rows = NamedSharding(mesh, P(sharding.BATCH))
q, k, v = (jax.device_put(x, rows) for x in (q, k, v))
with jax.set_mesh(mesh):
    got = jax.jit(lambda q, k, v: tpu.splash_attention(q, k, v, 64, interpret=True))(q, k, v)
want = jax.jit(ops.reference_attention, static_argnums=3)(*(np.asarray(x) for x in (q, k, v)), 64)
print("ERR", float(np.max(np.abs(np.asarray(got) - np.asarray(want)))), got.sharding.spec)
"""


@pytest.mark.timeout(120)
def test_splash_runs_per_device_under_a_mesh():
    """Rows split over 2 fake devices: the Pallas call runs through shard_map on each device's rows."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run([sys.executable, "-c", _SPLASH_ON_A_MESH], cwd=root, env=env, capture_output=True, text=True,
                       timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("ERR"))
    assert float(line.split()[1]) < 1e-5 and "fsdp" in line, line

"""The GPT of nanochat in Flax NNX.

Features (all from nanochat): rotary embeddings (base 100k), grouped-query attention, QK-norm with
a 1.2 sharpening, ReLU² MLP, parameterless RMSNorm, no biases, value embeddings on alternating
layers mixed in through an input-dependent gate, per-layer sliding windows from a pattern such as
"SSSL", per-layer `resid_lambdas` and `x0_lambdas`, smear (a gated mix of the previous token's
embedding), backout (subtract the mid-depth residual before the head), logits soft-capped at
15·tanh(x/15), optional tied embeddings, vocab padded to a multiple of 64.

Parameters live in fp32; each matmul casts its weight to the compute dtype (bf16 on TPU/GPU).
How the model runs on this backend (attention kernel, the linear layer's backward, remat, ...) is
the `kernels` record it is built with (`flaxchat.kernels`); it never changes what it computes.
Paths of the parameters (`blocks.3.attn.c_q.kernel`, ...) are the names the optimizer groups,
checkpoints and exports use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from flaxchat import ops
from flaxchat.config import GPTConfig
from flaxchat.kernels import Kernels, choose
from flaxchat.kernels.remat import SCAN_POLICY
from flaxchat.sharding import constrain

SMEAR_CHANNELS = 24
QK_SCALE = 1.2  # sharper attention after QK-norm, split between q and k (nanochat)


def _uniform(scale: float, low: float | None = None):
    """U(-scale, scale), or U(low, scale) when `low` is given."""
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale if low is None else low, scale)
    return init


class Linear(nnx.Module):
    """y = x @ kernel, kernel (in, out), no bias, through the kernels record's matmul.

    `axes` are the kernel's logical axis names; `flaxchat.sharding` maps them to mesh axes.
    """

    def __init__(self, din: int, dout: int, *, init, rngs: nnx.Rngs, axes=(None, None)):
        self.kernel = nnx.Param(init(rngs.params(), (din, dout)), logical_axes=axes)

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        return kernels.matmul(x, self.kernel[...].astype(x.dtype))


class Embedding(nnx.Module):
    """A lookup table (num, dim) with logical axes, like nnx.Embed, stored in `dtype`."""

    def __init__(self, num: int, dim: int, *, init, rngs: nnx.Rngs, axes=("vocab", "embed"), dtype=jnp.float32):
        self.embedding = nnx.Param(init(rngs.params(), (num, dim)).astype(dtype), logical_axes=axes)

    def __call__(self, idx: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], idx, axis=0)


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, layer: int, rngs: nnx.Rngs, table_dtype=jnp.float32):
        d, hd = cfg.n_embd, cfg.head_dim
        s = math.sqrt(3.0 / d)  # uniform with the std of N(0, 1/d); uniform avoids outliers
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.block = cfg.attn_block
        self.c_q = Linear(d, cfg.n_head * hd, init=_uniform(s), rngs=rngs, axes=("embed", "heads"))
        self.c_k = Linear(d, cfg.n_kv_head * hd, init=_uniform(s), rngs=rngs, axes=("embed", "kv"))
        self.c_v = Linear(d, cfg.n_kv_head * hd, init=_uniform(s), rngs=rngs, axes=("embed", "kv"))
        self.c_proj = Linear(d, d, init=nnx.initializers.zeros_init(), rngs=rngs, axes=("heads", "embed"))
        if cfg.has_value_embed(layer):
            self.ve = Embedding(cfg.padded_vocab_size, cfg.n_kv_head * hd, init=_uniform(s), rngs=rngs,
                                axes=("vocab", "kv"), dtype=table_dtype)
            # U(0, 0.02): the gate starts just above scale·sigmoid(0) for every head (nanochat).
            self.ve_gate = Linear(min(cfg.ve_gate_channels, d), cfg.n_kv_head, init=_uniform(0.02, 0.0), rngs=rngs)
            self.ve_gate_scale = cfg.ve_gate_scale
        else:
            self.ve = None
            self.ve_gate = None

    def qkv(self, x: jax.Array, idx: jax.Array, rope: ops.RotaryTable, kernels: Kernels, heads_first: bool = False):
        """q (B, T, H, D), k and v (B, T, Hkv, D), q and k rotated and QK-normed; with `heads_first`
        (B, H, T, D) and (B, Hkv, T, D), written in that layout by the projections themselves."""
        B, T, C = x.shape
        D = self.head_dim

        def project(linear: Linear, heads: int) -> jax.Array:
            if not heads_first:
                return linear(x, kernels).reshape(B, T, heads, D)
            return jnp.einsum("btc,chd->bhtd", x, linear.kernel[...].astype(x.dtype).reshape(C, heads, D))

        q, k, v = project(self.c_q, self.n_head), project(self.c_k, self.n_kv_head), project(self.c_v, self.n_kv_head)
        if self.ve is not None:
            # Value residual (ResFormer): a per-token value embedding, gated per kv head in (0, scale).
            ve = self.ve(idx).astype(x.dtype).reshape(B, T, self.n_kv_head, D)
            gate = self.ve_gate_scale * jax.nn.sigmoid(self.ve_gate(x[..., :self.ve_gate.kernel.shape[0]], kernels))
            gate = gate[..., None]
            if heads_first:
                ve, gate = ve.transpose(0, 2, 1, 3), gate.transpose(0, 2, 1, 3)
            v = v + gate * ve
        if heads_first:  # the table's (..., T, 1, D/2) as (..., 1, T, D/2)
            rope = ops.RotaryTable(rope.cos.swapaxes(-3, -2), rope.sin.swapaxes(-3, -2))
        q = kernels.rotary_rms_norm(q, rope, QK_SCALE)
        k = kernels.rotary_rms_norm(k, rope, QK_SCALE)
        return q, k, v

    def __call__(self, x, idx, rope: ops.RotaryTable, window: int, kernels: Kernels, attend=None):
        B, T, C = x.shape
        if attend is None and kernels.attention_heads_first is not None:
            # Heads before time from the projections to c_proj: the layout splash computes in, so no
            # transpose surrounds it (d12's gradient on a v5e: 144,044 -> 148,807 tok/s).
            q, k, v = self.qkv(x, idx, rope, kernels, heads_first=True)
            # not named here: splash names its output and log-sum-exp itself (a second name, on this
            # reshape of the same output, made a scanned d12 step keep both: 288 MiB)
            y = kernels.attention_heads_first(q, k, v, window, self.block)
            w = self.c_proj.kernel[...].astype(x.dtype).reshape(self.n_head, self.head_dim, C)
            return jnp.einsum("bhtd,hdc->btc", y, w)
        q, k, v = self.qkv(x, idx, rope, kernels)
        if attend is None:
            # named for the remat policy that keeps attention's output (kernels.tpu.REMAT_POLICIES)
            y = checkpoint_name(kernels.attention(q, k, v, window, self.block), "attention")
        else:
            y = attend(q, k, v, window)
        return self.c_proj(y.reshape(B, T, -1), kernels)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        s = math.sqrt(3.0 / cfg.n_embd)
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, init=_uniform(0.4 * s), rngs=rngs, axes=("embed", "mlp"))
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, init=nnx.initializers.zeros_init(), rngs=rngs,
                             axes=("mlp", "embed"))

    def __call__(self, x, kernels: Kernels):
        return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x, kernels))), kernels)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, layer: int, rngs: nnx.Rngs, table_dtype=jnp.float32):
        self.attn = Attention(cfg, layer, rngs, table_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, idx, rope: ops.RotaryTable, window: int, kernels: Kernels, attend=None):
        x = x + self.attn(ops.rms_norm(x), idx, rope, window, kernels, attend)
        return x + self.mlp(ops.rms_norm(x), kernels)


class _LookedUp(nnx.Module):
    """A value embedding whose rows (B, T, kv) were looked up already (`GPT._scanned_blocks`)."""

    def __init__(self, rows: jax.Array):
        self.rows = nnx.Param(rows)

    def __call__(self, idx: jax.Array) -> jax.Array:
        return self.rows[...]


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, kernels: Kernels | None = None):
        """`kernels`: how this backend runs the model (`flaxchat.kernels.choose().model`, the
        backend's defaults, when None); `compute_init(...).kernels` in the scripts."""
        self.config = cfg
        self.dtype = dtype
        self.kernels = kernels or choose().model
        V, d, L = cfg.padded_vocab_size, cfg.n_embd, cfg.n_layer
        # Token and value embeddings are stored in bf16 when the model computes in bf16, as nanochat
        # keeps them (their AdamW moments follow): at d20 they are half the parameters, and in fp32
        # with their moments and gradients they alone took 8 GiB of a 16 GiB v5e chip.
        tables = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
        self.wte = Embedding(V, d, init=nnx.initializers.normal(0.8), rngs=rngs, dtype=tables)
        self.blocks = nnx.List([Block(cfg, i, rngs, tables) for i in range(L)])
        self.lm_head = None if cfg.tie_embeddings else Linear(d, V, init=nnx.initializers.normal(0.001), rngs=rngs,
                                                              axes=("embed", "vocab"))
        # Stronger residual early, more of the embedding blended back in early (nanochat init).
        denom = max(L - 1, 1)
        self.resid_lambdas = nnx.Param(jnp.array([1.15 - 0.10 * i / denom for i in range(L)], jnp.float32))
        self.x0_lambdas = nnx.Param(jnp.array([0.20 - 0.15 * i / denom for i in range(L)], jnp.float32))
        nsm = min(SMEAR_CHANNELS, d)
        self.smear_gate = Linear(nsm, 1, init=_uniform(0.02, 0.0), rngs=rngs)  # U(0, 0.02) (nanochat)
        self.smear_lambda = nnx.Param(jnp.zeros((1,), jnp.float32))
        self.backout_lambda = nnx.Param(jnp.full((1,), 0.2, jnp.float32))

    def embed(self, idx: jax.Array, prev_embedding: jax.Array | None = None) -> jax.Array:
        """Token embedding, normed, then smeared with the previous token's embedding.

        `prev_embedding` (B, 1, d) is the normed embedding of the token before idx[:, 0]; the
        engine passes it when decoding one token at a time, training passes nothing.
        """
        x = ops.rms_norm(self.wte(idx).astype(self.dtype))
        nsm = self.smear_gate.kernel.shape[0]
        prev = x[:, :-1] if prev_embedding is None else jnp.concatenate([prev_embedding.astype(x.dtype), x[:, :-1]], 1)
        cur = x[:, 1:] if prev_embedding is None else x
        gate = self.smear_lambda[...].astype(x.dtype) * jax.nn.sigmoid(self.smear_gate(cur[..., :nsm], self.kernels))
        mixed = cur + gate * prev
        return mixed if prev_embedding is not None else jnp.concatenate([x[:, :1], mixed], axis=1)

    def head(self, x: jax.Array, softcap: bool = True) -> jax.Array:
        """Final norm, LM head, crop the vocab padding, soft-cap the logits (fp32; the raw logits
        with softcap=False, for the loss's fused soft-cap, the kernels record's cross_entropy)."""
        x = ops.rms_norm(x)
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, self.wte.embedding[...].astype(x.dtype))
        else:
            logits = self.lm_head(x, self.kernels)
        logits = logits[..., :self.config.vocab_size].astype(jnp.float32)
        if not softcap:
            return logits
        return ops.softcap(logits, self.config.logit_softcap)

    def head_weight(self) -> jax.Array:
        """The LM head's matrix (d, vocab_size) in the compute dtype (the embedding's transpose when
        tied), for a loss that runs the head itself (the kernels record's head_loss)."""
        w = self.wte.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return w[:, :self.config.vocab_size].astype(self.dtype)

    def __call__(self, idx: jax.Array, positions: jax.Array | None = None, *, attend=None,
                 prev_embedding: jax.Array | None = None, softcap: bool = True) -> jax.Array:
        """idx (B, T) int32 -> logits (B, T, vocab_size) fp32.

        Inference hooks (the Engine's KV cache): `positions` (T,) or (B, T) absolute positions for
        the rotary embedding; `attend(layer, q, k, v, window) -> y` replaces the training attention
        (q (B,T,H,D), k/v (B,T,Hkv,D), y (B,T,H,D)); `prev_embedding` is the normed embedding of the
        token just before idx[:, 0], for smear when decoding one token at a time. `softcap=False`
        returns the logits before the soft-cap, for the training loss (the record's cross_entropy).
        """
        return self.head(self.trunk(idx, positions, attend=attend, prev_embedding=prev_embedding), softcap)

    def trunk(self, idx: jax.Array, positions: jax.Array | None = None, *, attend=None,
              prev_embedding: jax.Array | None = None) -> jax.Array:
        """Everything before the head: idx (B, T) -> the residual stream (B, T, d) (hooks as __call__)."""
        cfg = self.config
        B, T = idx.shape
        x = constrain(self.embed(idx, prev_embedding), ("batch", None, None))
        rope = ops.rotary_table(np.arange(T) if positions is None else positions, cfg.head_dim, cfg.rope_base,
                                x.dtype)
        x0 = x
        backout_layer = cfg.n_layer // 2
        x_backout = None
        windows = cfg.window_sizes()
        kernels = self.kernels
        period, repeats = scan_plan(cfg) if kernels.scan_layers and attend is None else (1, 0)
        first = period * repeats  # layers [0, first) run under lax.scan, the rest one by one
        if repeats:
            x, x_backout = self._scanned_blocks(x, x0, idx, rope, period, repeats, backout_layer)
        for i, block in enumerate(self.blocks):
            if i < first:
                continue
            x = self.resid_lambdas[i].astype(x.dtype) * x + self.x0_lambdas[i].astype(x.dtype) * x0
            if attend is not None:
                layer_attend = lambda q, k, v, w, i=i: attend(i, q, k, v, w)
                x = block(x, idx, rope, windows[i], kernels, layer_attend)
            elif kernels.remat is not None:
                x = kernels.remat(block, x, idx, rope, windows[i], kernels)
            else:
                x = block(x, idx, rope, windows[i], kernels)
            x = constrain(x, ("batch", None, None))
            if i == backout_layer:
                x_backout = x
        if x_backout is not None:
            x = x - self.backout_lambda[...].astype(x.dtype) * x_backout
        return x

    def _scanned_blocks(self, x, x0, idx, rope, period: int, repeats: int, backout_layer: int):
        """Layers [0, period·repeats) as `repeats` iterations of one lax.scan whose body runs
        `period` consecutive blocks, so XLA compiles `period` blocks instead of all of them. Layer
        j + k·period is iteration k's j-th block: its weights are stacked along a leading axis here,
        in the step (the parameter tree, the optimizer, checkpoints and exports keep one array per
        layer). Returns (x after the last scanned layer, x after backout_layer if it was scanned)."""
        kernels, windows, dtype = self.kernels, self.config.window_sizes(), x.dtype
        graphdefs, stacks, unused_tables, rows = [], [], [], []
        for j in range(period):
            layers = [self.blocks[j + k * period] for k in range(repeats)]
            # The value embeddings are looked up here, outside the scan: it then carries the (B, T,
            # kv) rows of each layer instead of a stacked copy of its (vocab, kv) table (and of
            # that table's gradient), 2 x 288 MiB at d12 with a 32,768-token vocabulary.
            has_ve = layers[0].attn.ve is not None
            rows.append(jnp.stack([b.attn.ve(idx) for b in layers]) if has_ve else None)
            splits = [nnx.split(b, nnx.PathContains("ve"), ...) for b in layers]
            graphdefs.append(splits[0][0])
            unused_tables.append(jax.tree.map(lambda t: jnp.zeros((0, *t.shape[1:]), t.dtype), splits[0][1]))
            # In the compute dtype: every block weight is cast to it where it is used anyway (a
            # Linear's matmul), and the stacked copy of a bf16 model is half the size of an fp32 one.
            stacks.append(jax.tree.map(lambda *a: jnp.stack([w.astype(dtype) for w in a]),
                                       *[rest for _, _, rest in splits]))
        n = period * repeats
        lambdas = (self.resid_lambdas[...][:n].reshape(repeats, period),
                   self.x0_lambdas[...][:n].reshape(repeats, period))
        keep_rep, keep_j = divmod(backout_layer, period) if backout_layer < n else (-1, -1)

        def body(carry, xs):
            x, x_backout = carry
            rep, states, ve_rows, resid, x0s = xs
            for j in range(period):
                block = nnx.merge(graphdefs[j], unused_tables[j], states[j])
                if ve_rows[j] is not None:
                    block.attn.ve = _LookedUp(ve_rows[j])
                if kernels.remat is None:
                    x = _scanned_layer(block, x, x0, resid[j], x0s[j], idx, rope, windows[j], kernels)
                else:
                    x = resid[j].astype(dtype) * x + x0s[j].astype(dtype) * x0
                    x = kernels.remat(block, x, idx, rope, windows[j], kernels)
                x = constrain(x, ("batch", None, None))
                if j == keep_j:
                    x_backout = jnp.where(rep == keep_rep, x, x_backout)
            return (x, x_backout), None

        carry = (x, jnp.zeros_like(x) if keep_rep >= 0 else None)
        xs = (jnp.arange(repeats), stacks, rows, *lambdas)
        x, x_backout = jax.lax.scan(body, carry, xs)[0]
        return x, x_backout


@nnx.remat(static_argnums=(7, 8), policy=SCAN_POLICY, prevent_cse=False)
def _scanned_layer(block, x, x0, resid, x0_lambda, idx, rope, window, kernels):
    """A layer under --scan-layers: the residual mix and the block, checkpointed by SCAN_POLICY."""
    x = resid.astype(x.dtype) * x + x0_lambda.astype(x.dtype) * x0
    return block(x, idx, rope, window, kernels)


def scan_plan(cfg: GPTConfig) -> tuple[int, int]:
    """(period, repeats) of `kernels.scan_layers`: layers [0, period·repeats) are `repeats` copies
    of the first `period` layers' structure (attention window, value embedding or not), scanned;
    the rest run one by one. The period is the one that leaves the fewest blocks to compile
    (period + layers left over); repeats is 0 where nothing repeats (d4 with "SSSL": the last
    layer's forced full window breaks the only period, 4). d12 and d20 with "SSSL": period 4."""
    sig = [(w, cfg.has_value_embed(i)) for i, w in enumerate(cfg.window_sizes())]
    L = len(sig)
    best = (L, 1, 0)  # blocks compiled, period, repeats
    for p in range(1, L // 2 + 1):
        r = 1
        while (r + 1) * p <= L and sig[r * p:(r + 1) * p] == sig[:p]:
            r += 1
        if r >= 2 and p + L - r * p < best[0]:
            best = (p + L - r * p, p, r)
    return best[1], best[2]


def param_count(model: GPT) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def matmul_param_count(model: GPT) -> int:
    """Parameters that take part in matmuls: every Linear kernel (blocks and LM head).

    Embeddings (token and value) are lookups and the per-layer scalars are elementwise, so they
    are not counted (PaLM appendix B; nanochat `estimate_flops`). With tied embeddings the head's
    matmul uses the embedding table, so it is counted once.
    """
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        if name.endswith("kernel") and "smear_gate" not in name and "ve_gate" not in name:
            total += leaf.get_value().size
    if model.lm_head is None:
        total += model.wte.embedding.get_value().size
    return total


def scaling_param_count(model: GPT) -> int:
    """The parameters nanochat's horizon counts: everything in the blocks (their matrices, the
    value-embedding gates) plus the LM head (base_train `get_scaling_params`). Token and value
    embeddings and the top-level scalars are left out. With tied embeddings the table is the head."""
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        if name.startswith(("blocks.", "lm_head.")) and ".ve." not in name:
            total += leaf.get_value().size
    if model.lm_head is None:
        total += model.wte.embedding.get_value().size
    return total


def reference_scaling_param_count(cfg: GPTConfig) -> int:
    """`scaling_param_count` of nanochat's reference, d12 with `cfg`'s vocabulary and context: the
    model its LRs and batch were tuned at, against which `recipe.scaling` scales them."""
    from flaxchat.config import config_for_depth
    ref = config_for_depth(12, vocab_size=cfg.vocab_size, sequence_len=cfg.sequence_len)
    return scaling_param_count(nnx.eval_shape(lambda: GPT(ref, rngs=nnx.Rngs(0))))


def mean_keys_seen(window: int, T: int) -> float:
    """Keys a query attends to, averaged over the T positions of a causal sequence with a window:
    query t sees min(t + 1, window) keys (causal halves full attention; a window caps it)."""
    w = min(window, T)
    return (w * (w + 1) / 2 + (T - w) * w) / T


def estimate_flops(model: GPT, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 per matmul parameter, plus 12·h·d_head per key each query
    attends to (QKᵀ and AV, 2 FLOPs each per key per channel, forward and twice that backward),
    counting only the keys it sees: the causal triangle and each layer's window (MaxText counts the
    same way). The one count behind every MFU flaxchat prints, the training log's and the benches'."""
    cfg = model.config
    T = seq_len or cfg.sequence_len
    keys = sum(mean_keys_seen(w, T) for w in cfg.window_sizes())
    return 6 * matmul_param_count(model) + 12 * cfg.n_head * cfg.head_dim * keys

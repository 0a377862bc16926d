"""Muon for the block matrices + AdamW groups for everything else, as one optax transformation.

Muon (https://kellerjordan.github.io/posts/muon/) as nanochat runs it: Nesterov momentum, the
update orthogonalised by Polar Express (Amsel et al. 2025, five fixed-coefficient steps), NorMuon's
per-row/column variance reduction, cautious weight decay, and LR scaled by sqrt(max(1, out/in)).
Embeddings, the LM head, value embeddings and the scalars go to AdamW groups with nanochat's betas
and LR ratios; AdamW LRs scale as 1/sqrt(d_model/768). Parameters are grouped by their path with
`optax.multi_transform`. Every schedule is a function of the step count inside the optimizer
state, so it runs inside jit and restores with the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Polar Express coefficients for 5 iterations (nanochat optim.py / Amsel et al. 2025).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """warmup -> constant -> linear warmdown to final_lr_frac, as a multiplier of the base LR."""

    total_steps: int
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.5
    final_lr_frac: float = 0.0

    def lr_multiplier(self, step):
        step = jnp.asarray(step, jnp.float32)
        total = float(max(self.total_steps, 1))
        warmup = round(self.warmup_ratio * total)
        warmdown = round(self.warmdown_ratio * total)
        up = (step + 1) / max(warmup, 1)
        progress = (total - step) / max(warmdown, 1)
        down = progress + (1 - progress) * self.final_lr_frac
        return jnp.where(step < warmup, up, jnp.where(step <= total - warmdown, 1.0, down))

    def muon_momentum(self, step):
        # 0.85 -> 0.95 over the first 300 steps (nanochat).
        frac = jnp.minimum(jnp.asarray(step, jnp.float32) / 300.0, 1.0)
        return (1 - frac) * 0.85 + frac * 0.95

    def weight_decay_multiplier(self, step):
        # Linear decay to zero over the run (nanochat base_train).
        return jnp.maximum(0.0, 1.0 - jnp.asarray(step, jnp.float32) / max(self.total_steps, 1))


def polar_express(g: jax.Array, steps: int = 5, dtype=jnp.float32) -> jax.Array:
    """Approximately the orthogonal polar factor U·Vᵀ of g = U·S·Vᵀ."""
    x = g.astype(dtype)
    x = x / (jnp.linalg.norm(x) * 1.02 + 1e-6)
    tall = x.shape[0] > x.shape[1]
    for a, b, c in POLAR_EXPRESS[:steps]:
        # Work on the small Gram matrix: (n x n) for a tall matrix, (m x m) for a wide one.
        if tall:
            A = x.T @ x
            x = a * x + x @ (b * A + c * (A @ A))
        else:
            A = x @ x.T
            x = a * x + (b * A + c * (A @ A)) @ x
    return x.astype(g.dtype)


class MuonState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates
    second_moment: optax.Updates


def _reduce_axis(shape) -> int:
    # Our kernels are (in, out). nanochat (torch, (out, in)) reduces over `in` for matrices with
    # out >= in and over `out` otherwise; here that is axis 0 and axis 1 respectively.
    return 0 if shape[1] >= shape[0] else 1


def muon(learning_rate: float, schedule: Schedule, weight_decay: float = 0.0, beta2: float = 0.95,
         ns_steps: int = 5, ns_dtype=jnp.float32) -> optax.GradientTransformation:
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        second = jax.tree.map(lambda p: jnp.zeros(_reduced_shape(p.shape), p.dtype), params)
        return MuonState(jnp.zeros([], jnp.int32), zeros, second)

    def update(grads, state, params):
        step = state.count
        mom = schedule.muon_momentum(step)
        lr = learning_rate * schedule.lr_multiplier(step)
        wd = weight_decay * schedule.weight_decay_multiplier(step)

        def one(g, m, v, p):
            m = m + (1 - mom) * (g - m)  # momentum buffer: lerp towards g
            g = g + mom * (m - g)  # Nesterov: lerp g towards the buffer
            o = polar_express(g, ns_steps, ns_dtype)
            o, v = _normuon(o, v, beta2)
            lr_p = lr * jnp.sqrt(jnp.maximum(1.0, p.shape[1] / p.shape[0]))
            mask = (o * p) >= 0  # cautious weight decay: only where update and weight agree in sign
            return -(lr_p * o + lr_p * wd * p * mask).astype(p.dtype), m, v

        out = jax.tree.map(one, grads, state.momentum, state.second_moment, params)
        treedef = jax.tree.structure(grads)
        leaves = treedef.flatten_up_to(out)
        updates = treedef.unflatten([t[0] for t in leaves])
        momentum = treedef.unflatten([t[1] for t in leaves])
        second = treedef.unflatten([t[2] for t in leaves])
        return updates, MuonState(step + 1, momentum, second)

    return optax.GradientTransformation(init, update)


def _reduced_shape(shape):
    ax = _reduce_axis(shape)
    return tuple(1 if i == ax else n for i, n in enumerate(shape))


def _normuon(o: jax.Array, v: jax.Array, beta2: float):
    """NorMuon: normalise per output row/column by a running second moment, keep the total norm."""
    ax = _reduce_axis(o.shape)
    of = o.astype(jnp.float32)
    v_mean = jnp.mean(of * of, axis=ax, keepdims=True)
    n = o.shape[ax]
    v_norm = jnp.sqrt(jnp.sum(v_mean) * n)
    v = v + (1 - beta2) * (v_mean.astype(v.dtype) - v)
    step_size = jax.lax.rsqrt(jnp.maximum(v.astype(jnp.float32), 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * n * step_size * step_size))
    scale = step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10))
    return (of * scale).astype(o.dtype), v


# --- parameter groups ---------------------------------------------------------------------------


def param_label(path: str) -> str:
    """The optimizer group of a parameter, from its dotted path."""
    if path.startswith("wte."):
        return "embed"
    if path.startswith("lm_head."):
        return "lm_head"
    if ".ve." in path:
        return "value_embed"
    if path.startswith("resid_lambdas"):
        return "resid"
    if path.startswith("x0_lambdas"):
        return "x0"
    if path.startswith(("smear_", "backout_")):
        return "smear"
    if path.startswith("blocks."):
        return "matrix"
    raise ValueError(f"no optimizer group for parameter {path!r}")


def _path_str(path) -> str:
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(key))
    return ".".join(p for p in parts if p != "value")


def labels_for(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: param_label(_path_str(p)), params)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "muon"
    matrix_lr: float = 0.02
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    weight_decay: float = 0.2
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    n_embd: int = 768
    depth: int = 12
    ns_dtype: str = "float32"


def build_optimizer(cfg: OptimConfig, schedule: Schedule) -> optax.GradientTransformation:
    """The full optimizer: a map from group name to transformation, applied by parameter path."""
    scale = (cfg.n_embd / 768) ** -0.5  # AdamW LRs tuned at d_model 768 (nanochat)

    def adamw(lr, b1, b2, wd):
        return optax.adamw(learning_rate=lambda c: lr * schedule.lr_multiplier(c), b1=b1, b2=b2,
                           eps=1e-10, weight_decay=wd)

    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    groups: dict[str, optax.GradientTransformation] = {
        "lm_head": adamw(cfg.unembedding_lr * scale, b1, 0.96, 0.01),
        "embed": adamw(cfg.embedding_lr * scale, b1, 0.995, 0.001),
        "value_embed": adamw(cfg.embedding_lr * scale * 0.5, b1, 0.995, 0.01),
        "resid": adamw(cfg.scalar_lr * 0.01, b1, b2, 0.05),
        "x0": adamw(cfg.scalar_lr, 0.96, b2, 0.0),  # higher beta1 for the x0 blend (nanochat)
        "smear": adamw(0.2, b1, b2, 0.0),
    }
    if cfg.optimizer == "muon":
        # Weight decay tuned at depth 12, scaled as (12/depth)^2 (nanochat base_train).
        wd = cfg.weight_decay * (12 / cfg.depth) ** 2
        groups["matrix"] = muon(cfg.matrix_lr, schedule, weight_decay=wd, ns_dtype=jnp.dtype(cfg.ns_dtype))
    else:
        # Plain AdamW fallback for the block matrices: a tenth of Muon's LR, standard betas.
        groups["matrix"] = adamw(cfg.matrix_lr * 0.1, 0.9, 0.95, 0.0)
    return optax.multi_transform(groups, labels_for)

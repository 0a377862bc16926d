"""Muon for the block matrices + AdamW groups for everything else, as one optax transformation.

Muon (https://kellerjordan.github.io/posts/muon/) as nanochat runs it: Nesterov momentum, the
update row-equilibrated (MuonEq), orthogonalised by Polar Express (Amsel et al. 2025, five
fixed-coefficient steps), renormalised to sqrt(min(m, n)) (Muon+), NorMuon's per-row/column
variance reduction (beta2 0.9), cautious weight decay, and LR scaled by sqrt(max(1, out/in)); the
order and constants of nanochat's `muon_step_fused`.
Embeddings, the LM head, value embeddings and the scalars go to AdamW groups with nanochat's betas
and LR ratios; AdamW LRs scale as 1/sqrt(d_model/768). Parameters are grouped by their path with
`optax.multi_transform`. Every schedule is a function of the step count inside the optimizer
state, so it runs inside jit and restores with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from flaxchat.config import LR
from flaxchat.ops import POLAR_EXPRESS, normalised, polar_express, polar_iterations  # noqa: F401 (the optimizer's math)

@dataclasses.dataclass(frozen=True)
class Schedule:
    """The multipliers of one stage, as functions of the optimizer's step count (they run in jit).

    LR: linear warmup over `warmup_steps`, constant, then a linear warmdown over the last
    `warmdown_ratio` of the steps to `final_lr_frac` (nanochat base_train `get_lr_multiplier`).
    Muon momentum ("pretrain"): 0.85 -> 0.97 over the first 400 steps, then 0.97 -> 0.90 over the
    warmdown (base_train `get_muon_momentum`); ("finetune"): 0.85 -> 0.95 over 300 steps, as
    chat_sft keeps it. Weight decay: "cosine" from 1 to 0 over the run (base_train
    `get_weight_decay`), or "constant".
    """

    total_steps: int
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05
    momentum: str = "pretrain"
    weight_decay: str = "cosine"

    def __post_init__(self):
        if self.momentum not in ("pretrain", "finetune") or self.weight_decay not in ("cosine", "constant"):
            raise ValueError(f"unknown schedule kinds: momentum {self.momentum!r}, weight decay {self.weight_decay!r}")

    @property
    def warmdown_steps(self) -> int:
        return round(self.warmdown_ratio * max(self.total_steps, 1))

    def horizon(self) -> jax.Array:
        """(total steps, warmdown steps) as the compiled step reads them (`Horizon`)."""
        return jnp.asarray([max(self.total_steps, 1), self.warmdown_steps], jnp.int32)

    def _totals(self, horizon):
        """(total, warmdown): this schedule's constants, or the run-time `horizon` array."""
        if horizon is None:
            return float(max(self.total_steps, 1)), self.warmdown_steps
        horizon = horizon.astype(jnp.float32)
        return horizon[0], horizon[1]

    def lr_multiplier(self, step, horizon=None):
        step = jnp.asarray(step, jnp.float32)
        total, warmdown = self._totals(horizon)
        up = (step + 1) / max(self.warmup_steps, 1)
        progress = (total - step) / jnp.maximum(warmdown, 1)
        down = progress + (1 - progress) * self.final_lr_frac
        return jnp.where(step < self.warmup_steps, up, jnp.where(step <= total - warmdown, 1.0, down))

    def muon_momentum(self, step, horizon=None):
        step = jnp.asarray(step, jnp.float32)
        if self.momentum == "finetune":
            frac = jnp.minimum(step / 300.0, 1.0)
            return (1 - frac) * 0.85 + frac * 0.95
        total, warmdown = self._totals(horizon)
        start = total - warmdown
        frac = step / 400.0
        progress = (step - start) / jnp.maximum(warmdown, 1)
        return jnp.where(step < 400, (1 - frac) * 0.85 + frac * 0.97,
                         jnp.where(step >= start, 0.97 * (1 - progress) + 0.90 * progress, 0.97))

    def weight_decay_multiplier(self, step, horizon=None):
        if self.weight_decay == "constant":
            return jnp.ones([], jnp.float32)
        total, _ = self._totals(horizon)
        return 0.5 * (1 + jnp.cos(jnp.pi * jnp.asarray(step, jnp.float32) / total))


class Horizon(nnx.Variable):
    """The schedule's (total steps, warmdown steps) on the optimizer (`make_optimizer`): an input of
    the compiled step rather than a constant in it, so a rerun or an extension with another
    `--steps` loads the step from the compile cache. Set from the run's flags, never checkpointed
    (the checkpoint holds `OptState` only), so old checkpoints load unchanged."""


def make_optimizer(model, cfg: "OptimConfig", schedule: Schedule, polar=None) -> nnx.Optimizer:
    """`build_optimizer` over `model`'s parameters, reading the schedule's horizon at run time."""
    optimizer = nnx.Optimizer(model, build_optimizer(cfg, schedule, polar), wrt=nnx.Param)
    optimizer.horizon = Horizon(schedule.horizon())
    return optimizer


class MuonState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates
    second_moment: optax.Updates


def _reduce_axis(shape) -> int:
    # Our kernels are (in, out). nanochat (torch, (out, in)) reduces over `in` for matrices with
    # out >= in and over `out` otherwise; here that is axis 0 and axis 1 respectively.
    return 0 if shape[1] >= shape[0] else 1


def muon(learning_rate: float, schedule: Schedule, weight_decay: float = 0.0, beta2: float = 0.9,
         ns_steps: int = 5, ns_dtype=jnp.float32, orthogonalise=polar_express,
         batched: bool = False) -> optax.GradientTransformation:
    """Muon for the block matrices; `orthogonalise(g, ns_steps, ns_dtype)` is Polar Express in the
    form the backend's record names (`flaxchat.kernels.PolarExpress`).

    `batched` (that record's `batched`): Polar Express and NorMuon run once per group of
    same-shape matrices, on their stack (`_stacked_orthogonalise`): one chain of batched products
    per shape instead of one per matrix. Under an fsdp mesh they always do, with the stack split
    over the fsdp axis, so that each device orthogonalises whole matrices."""
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        second = jax.tree.map(lambda p: jnp.zeros(_reduced_shape(p.shape), p.dtype), params)
        return MuonState(jnp.zeros([], jnp.int32), zeros, second)

    def orthogonalise_one(g, v, with_mean=False):
        return _renormalise_normuon(orthogonalise(g, ns_steps, ns_dtype), v, beta2, with_mean)

    def second_moment(v, v_mean):  # NorMuon's running average, as `_renormalise_normuon` takes it
        return v + (1 - beta2) * (v_mean - v)

    def update(grads, state, params, horizon=None, **extra):
        step = state.count
        mom = schedule.muon_momentum(step, horizon)
        lr = learning_rate * schedule.lr_multiplier(step, horizon)
        wd = weight_decay * schedule.weight_decay_multiplier(step, horizon)

        def nesterov(g, m):
            m = m + (1 - mom) * (g - m)  # momentum buffer: lerp towards g
            return g + mom * (m - g), m  # Nesterov: lerp g towards the buffer

        def apply(o, p):
            lr_p = lr * jnp.sqrt(jnp.maximum(1.0, p.shape[1] / p.shape[0]))
            mask = (o * p) >= 0  # cautious weight decay: only where update and weight agree in sign
            return -(lr_p * o + lr_p * wd * p * mask).astype(p.dtype)

        def one(g, m, v, p):
            g, m = nesterov(g, m)
            o, v = orthogonalise_one(g, v)
            return apply(o, p), m, v

        treedef = jax.tree.structure(grads)
        devices = _fsdp_devices()
        if not batched and devices == 1:
            leaves = treedef.flatten_up_to(jax.tree.map(one, grads, state.momentum, state.second_moment, params))
            updates, momentum, second = ([t[i] for t in leaves] for i in range(3))
        else:
            g, m = zip(*map(nesterov, treedef.flatten_up_to(grads), treedef.flatten_up_to(state.momentum)))
            roles = [_role(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
            o, second = _stacked_orthogonalise(lambda g, v: orthogonalise_one(g, v, with_mean=True), second_moment,
                                               g, treedef.flatten_up_to(state.second_moment), roles, devices)
            updates = list(map(apply, o, treedef.flatten_up_to(params)))
            momentum = m
        updates, momentum, second = (treedef.unflatten(list(t)) for t in (updates, momentum, second))
        return updates, MuonState(step + 1, momentum, second)

    return optax.GradientTransformationExtraArgs(init, update)


def _role(path) -> str:
    """A matrix's place in a block, its path without the layer number: matrices of one role are
    split alike by the sharding rules (the same module's logical axes)."""
    return ".".join(p for p in _path_str(path).split(".") if not p.isdigit())


def _fsdp_devices() -> int:
    """The size of the fsdp mesh axis in context (1 outside a mesh and under dp)."""
    from flaxchat.sharding import sharded_mesh
    mesh = sharded_mesh()
    return 1 if mesh is None else mesh.shape["fsdp"]


def _stacked_orthogonalise(orthogonalise_one, second_moment, gs, vs, roles, devices: int):
    """`orthogonalise_one(g, v) -> (o, v, v_mean)` on every matrix of `gs` (second moments `vs`),
    run once per group of same-shape matrices over their stack (jax.vmap: batched products); the
    new second moments are `second_moment(v, v_mean)` of each matrix's own (see below).

    With `devices` > 1 (fsdp) the stack is padded with zero matrices (whose update is zero) to a
    multiple of the device count and split over the fsdp axis: each device orthogonalises whole
    matrices, with no collective inside the iterations, and the results go back to the parameters'
    layout after. Within a group the matrices are stacked role by role (`roles`: the same path
    without the layer number), because one role's matrices are split alike by the sharding rules
    and so reshard as one block; a square group mixes c_q (split by rows) with c_proj (by
    columns), whose matrices XLA otherwise reshards one by one. Collectives in the optimizer step
    on 8 fake devices at depths 2, 8, 12, 20, 24 (width 64): 18, 20, 24, 24, 21 by role; 18, 24,
    31, 39, 41 as one stack per shape (growing with the depth); 79 at depth 2 with the iterations
    run on the split matrices and 2 Polar Express steps, 163 with 5.

    The second moments returned are recomputed from each matrix's own (the same arithmetic as in
    the stack), so that they keep its layout: taken from the stack, nothing in the step tied them
    to it, XLA returned them replicated, and the next step's inputs no longer matched the compiled
    program's (bench.scale's second step refused them). An update gets its layout from the
    parameter it is added to."""
    groups: dict = {}
    for i, g in enumerate(gs):
        groups.setdefault((g.shape, g.dtype, vs[i].shape, vs[i].dtype), {}).setdefault(roles[i], []).append(i)
    outs, new_vs = [None] * len(gs), [None] * len(gs)
    for by_role in groups.values():
        parts = list(by_role.values())
        G, V = (_stack([[xs[i] for i in idx] for idx in parts], devices) for xs in (gs, vs))
        O, _, M = jax.vmap(orthogonalise_one)(G, V)
        O, M = (_unstack(x, [len(idx) for idx in parts], devices) for x in (O, M))
        for j, i in enumerate(i for idx in parts for i in idx):
            outs[i], new_vs[i] = O[j], second_moment(vs[i], M[j])
    return outs, new_vs


def _stack(parts, devices: int) -> jax.Array:
    """One array of the matrices of `parts` (lists of same-shape matrices, one list per role); with
    `devices` > 1, padded to a multiple of them and split over the fsdp axis. Each role's block is
    first kept unsplit along the stack (its matrices keep their own layout), so that it reshards as
    one block instead of the split of the stack reaching back into each matrix."""
    from jax.sharding import PartitionSpec as P
    blocks = [jnp.stack(p) for p in parts]
    if devices == 1:
        return jnp.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    keep = P(None, P.UNCONSTRAINED, P.UNCONSTRAINED)
    blocks = [jax.lax.with_sharding_constraint(b, keep) for b in blocks]
    pad = -sum(len(p) for p in parts) % devices
    if pad:
        blocks.append(jnp.zeros((pad, *blocks[0].shape[1:]), blocks[0].dtype))
    x = jnp.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    return jax.lax.with_sharding_constraint(x, P("fsdp", None, None))


def _unstack(x: jax.Array, sizes, devices: int) -> list:
    """The matrices of `x` (`_stack`'s output, its padding dropped), each role's block (`sizes`)
    unsplit along the stack again first, so that it goes back to its parameters' layout as one block."""
    from jax.sharding import PartitionSpec as P
    out, at = [], 0
    for n in sizes:
        block = x[at:at + n]
        at += n
        if devices > 1:
            block = jax.lax.with_sharding_constraint(block, P(None, P.UNCONSTRAINED, P.UNCONSTRAINED))
        out.extend(block[j] for j in range(n))
    return out


def _reduced_shape(shape):
    ax = _reduce_axis(shape)
    return tuple(1 if i == ax else n for i, n in enumerate(shape))


def _renormalise_normuon(o: jax.Array, v: jax.Array, beta2: float, with_mean: bool = False):
    """Muon+ (arXiv 2602.21545), then NorMuon, from one pass of sums of squares over o.

    Muon+ snaps the Frobenius norm to sqrt(min(m, n)), the norm of an exactly semi-orthogonal
    matrix, correcting for the polar iteration's under-convergence: o·r. NorMuon then normalises
    per output row/column by a running second moment and keeps the total norm. Both read the
    squares of o along NorMuon's axis (their sum is ||o||², and o·r's are r² times them), so o is
    read once and scaled once. `with_mean`: also the mean square that updated v (in v's dtype)."""
    ax = _reduce_axis(o.shape)
    of = o.astype(jnp.float32)
    n = o.shape[ax]
    sq = jnp.sum(of * of, axis=ax, keepdims=True)
    r = math.sqrt(min(o.shape)) / jnp.maximum(jnp.sqrt(jnp.sum(sq)), 1e-6)
    v_mean = sq * (r * r / n)
    v_norm = jnp.sqrt(jnp.sum(v_mean) * n)
    mean = v_mean.astype(v.dtype)
    v = v + (1 - beta2) * (mean - v)
    step_size = jax.lax.rsqrt(jnp.maximum(v.astype(jnp.float32), 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * n * step_size * step_size))
    scale = step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10))
    out = (of * (r * scale)).astype(o.dtype)
    return (out, v, mean) if with_mean else (out, v)


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
    """The optimizer of any stage, built by keyword. The LR defaults are `flaxchat.config.LR`, the
    one place they live (TrainConfig's flags and the later stages read the same numbers).

    `batch_lr_scale` multiplies the groups nanochat scales with the batch (all but smear/backout,
    which nanochat keeps at 0.2); `lr_frac` multiplies every group (a later stage's fraction).
    `weight_decay` is Muon's decay at step 0, already scaled (see `scaled_weight_decay`).
    """
    optimizer: str = "muon"
    matrix_lr: float = LR["matrix_lr"]
    embedding_lr: float = LR["embedding_lr"]
    unembedding_lr: float = LR["unembedding_lr"]
    scalar_lr: float = LR["scalar_lr"]
    smear_lr: float = LR["smear_lr"]
    weight_decay: float = LR["weight_decay"]
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    muon_beta2: float = 0.9  # NorMuon's second-moment decay (nanochat setup_optimizer)
    n_embd: int = 768
    depth: int = 12  # unused: weight decay is scaled by `scaling` (kept so existing callers still build)
    ns_dtype: str = "float32"  # Polar Express's: float32, bfloat16 or a CPU form (auto: PolarExpress.ns_dtype)
    ns_steps: int = 5  # Polar Express iterations (0 leaves only the normalisations: for measuring)
    batch_lr_scale: float = 1.0
    lr_frac: float = 1.0


def build_optimizer(cfg: OptimConfig, schedule: Schedule, polar=None) -> optax.GradientTransformation:
    """The full optimizer: a map from group name to transformation, applied by parameter path.
    Muon runs `polar` (a `flaxchat.kernels.PolarExpress`; default: this backend's, `choose().polar`)."""
    if polar is None:
        from flaxchat.kernels import choose
        polar = choose().polar
    width = (cfg.n_embd / 768) ** -0.5  # AdamW LRs tuned at d_model 768 (nanochat)
    scale = cfg.batch_lr_scale * cfg.lr_frac

    def adamw(lr, b1, b2, wd):  # optax.adamw's chain, its LR read through `horizon`
        return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=1e-10), optax.add_decayed_weights(wd),
                           scale_by_schedule(lr, schedule))

    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    groups: dict[str, optax.GradientTransformation] = {
        "lm_head": adamw(cfg.unembedding_lr * width * scale, b1, 0.96, 0.01),
        "embed": adamw(cfg.embedding_lr * width * scale, b1, 0.995, 0.001),
        "value_embed": adamw(cfg.embedding_lr * width * 0.5 * scale, b1, 0.995, 0.01),
        "resid": adamw(cfg.scalar_lr * 0.01 * scale, b1, b2, 0.05),
        "x0": adamw(cfg.scalar_lr * scale, 0.96, b2, 0.0),  # higher beta1 for the x0 blend (nanochat)
        "smear": adamw(cfg.smear_lr * cfg.lr_frac, b1, b2, 0.0),
    }
    if cfg.optimizer == "muon":
        groups["matrix"] = muon(cfg.matrix_lr * scale, schedule, weight_decay=cfg.weight_decay,
                                beta2=cfg.muon_beta2, ns_steps=cfg.ns_steps, ns_dtype=cfg.ns_dtype,
                                orthogonalise=polar.orthogonalise, batched=polar.batched)
    else:
        # Plain AdamW fallback for the block matrices: a tenth of Muon's LR, standard betas.
        groups["matrix"] = adamw(cfg.matrix_lr * 0.1 * scale, 0.9, 0.95, 0.0)
    return optax.multi_transform(groups, labels_for)


def scale_by_schedule(lr: float, schedule: Schedule) -> optax.GradientTransformationExtraArgs:
    """optax.scale_by_learning_rate(lambda c: lr * schedule.lr_multiplier(c)) (the same state and
    arithmetic) with the update's `horizon` argument passed to the schedule."""

    def init(params):
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, horizon=None, **extra):
        step_size = -1 * (lr * schedule.lr_multiplier(state.count, horizon))
        updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)

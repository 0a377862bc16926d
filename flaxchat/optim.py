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

from flaxchat.common import read_cpuinfo
from flaxchat.config import LR
from flaxchat.ops import stored_transpose

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

    def lr_multiplier(self, step):
        step = jnp.asarray(step, jnp.float32)
        total = float(max(self.total_steps, 1))
        warmup, warmdown = self.warmup_steps, self.warmdown_steps
        up = (step + 1) / max(warmup, 1)
        progress = (total - step) / max(warmdown, 1)
        down = progress + (1 - progress) * self.final_lr_frac
        return jnp.where(step < warmup, up, jnp.where(step <= total - warmdown, 1.0, down))

    def muon_momentum(self, step):
        step = jnp.asarray(step, jnp.float32)
        if self.momentum == "finetune":
            frac = jnp.minimum(step / 300.0, 1.0)
            return (1 - frac) * 0.85 + frac * 0.95
        start = float(max(self.total_steps, 1) - self.warmdown_steps)
        frac = step / 400.0
        progress = (step - start) / max(self.warmdown_steps, 1)
        return jnp.where(step < 400, (1 - frac) * 0.85 + frac * 0.97,
                         jnp.where(step >= start, 0.97 * (1 - progress) + 0.90 * progress, 0.97))

    def weight_decay_multiplier(self, step):
        if self.weight_decay == "constant":
            return jnp.ones([], jnp.float32)
        return 0.5 * (1 + jnp.cos(jnp.pi * jnp.asarray(step, jnp.float32) / max(self.total_steps, 1)))


# Polar Express for CPUs with bf16 dot instructions. Square matrices: fp32 iterates and Gram
# matrix, and the other two products of each iteration (the polynomial's A·A and its product with
# x) from bf16 operands accumulated in fp32. Rectangular ones (one side at least GRAM_FORM_ASPECT
# times the other): the Gram form in fp32 (`_gram_form`), which is faster than those bf16 products
# there and closer to the float64 iteration.
BF16_PRODUCTS = "bf16-products"
# The same, with the products that read x from bf16 operands too: the Gram matrix of every
# iteration (square or wide x), and the Gram form's first Gram matrix and final product. The Gram
# form's chain of m³ products stays fp32 (it does not correct its own rounding).
BF16_OPERANDS = "bf16-operands"
GRAM_FORM_ASPECT = 2


def polar_express(g: jax.Array, steps: int = 5, dtype=jnp.float32) -> jax.Array:
    """Approximately the orthogonal polar factor U·Vᵀ of g = U·S·Vᵀ (kernel layout (in, out)).

    First MuonEq row equilibration (arXiv 2603.28254): every output neuron's weights (a column
    here, a row of torch's (out, in)) are rescaled to the mean norm, so the spectrum entering the
    iteration is better conditioned; then the Frobenius pre-normalisation with nanochat's x1.01.
    `dtype` (a dtype or its name): float32, bfloat16 (every product and the iterate; what TPU/GPU
    run), BF16_PRODUCTS or BF16_OPERANDS (see there; what `orthogonalisation_dtype` says about each).
    """
    mixed = _mixed(dtype)
    bf16_gram = isinstance(dtype, str) and dtype == BF16_OPERANDS
    x = _normalised(g, jnp.float32 if mixed else jnp.dtype(dtype))
    if uses_gram_form(x.shape, dtype):
        return _gram_form(x, steps, bf16_x=bf16_gram).astype(g.dtype)
    mm = _bf16_operands if mixed else jnp.matmul  # a product the iteration tolerates from bf16
    tall = x.shape[0] > x.shape[1]
    for a, b, c in POLAR_EXPRESS[:steps]:
        A = _gram(x, bf16=bf16_gram)
        B = b * A + c * mm(A, A)
        x = a * x + (mm(x, B) if tall else mm(B, x))
    return x.astype(g.dtype)


def _normalised(g: jax.Array, work) -> jax.Array:
    """MuonEq's equilibration, then the Frobenius pre-normalisation with nanochat's x1.01, in `work`.

    In fp32 both come from one pass of column sums of squares: the equilibrated matrix's norm
    follows from them (||x·s||² = Σ_j s_j²·||x_j||²), so x is read once and scaled once, where
    three norms and two scalings were each a small kernel on CPU. A bf16 iterate keeps the three:
    it is scaled in bf16 and its norm measured after rounding, and the fp32 shortcut moved its
    result further from float64's (3.6e-2 -> 3.9e-2 at 768 x 3072, worse for 12 seeds of 12).
    """
    if work != jnp.float32:
        x = g.astype(work)
        xf = x.astype(jnp.float32)
        col = jnp.maximum(jnp.linalg.norm(xf, axis=0, keepdims=True), 1e-6)
        x = x * (jnp.linalg.norm(xf) / math.sqrt(x.shape[1]) / col).astype(work)
        return x / (jnp.linalg.norm(x) * 1.01 + 1e-6)
    xf = g.astype(jnp.float32)
    sq = jnp.sum(xf * xf, axis=0, keepdims=True)
    s = jnp.sqrt(jnp.sum(sq) / g.shape[1]) / jnp.maximum(jnp.sqrt(sq), 1e-6)
    return xf * (s / (jnp.sqrt(jnp.sum(s * s * sq)) * 1.01 + 1e-6))


def _mixed(dtype) -> bool:
    """Whether `dtype` names one of the CPU forms with an fp32 iterate and bf16 products."""
    return isinstance(dtype, str) and dtype in (BF16_PRODUCTS, BF16_OPERANDS)


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
    plain product for its fast library (ops.stored_transpose; on TPU/GPU a plain transpose).

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
    (fp32's standard iteration: 4-5e-6). docs/cpu_performance.md has the table.

    `bf16_x` (BF16_OPERANDS): the two products that read x, the first Gram matrix (of a wide x; see
    `_gram`) and the final product, from bf16 operands; the chain stays fp32. Polar Express on
    config A's 24 matrices went from 64.8 to 59.9 ms (2-core AMD EPYC, Zen 4; medians of 25
    interleaved rounds, faster in every one). On gradients of random tokens that moved the
    rectangular matrices' result from 7.9e-6 to 3.1e-3 (wide) and 4.0e-3 (tall) of float64's; on
    what Muon hands it while the main job learns the stories (`bench.ns_accuracy`), to 1.8e-2 and
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


class MuonState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates
    second_moment: optax.Updates


def _reduce_axis(shape) -> int:
    # Our kernels are (in, out). nanochat (torch, (out, in)) reduces over `in` for matrices with
    # out >= in and over `out` otherwise; here that is axis 0 and axis 1 respectively.
    return 0 if shape[1] >= shape[0] else 1


def muon(learning_rate: float, schedule: Schedule, weight_decay: float = 0.0, beta2: float = 0.9,
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
            o, v = _renormalise_normuon(polar_express(g, ns_steps, ns_dtype), v, beta2)
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


def _renormalise_normuon(o: jax.Array, v: jax.Array, beta2: float):
    """Muon+ (arXiv 2602.21545), then NorMuon, from one pass of sums of squares over o.

    Muon+ snaps the Frobenius norm to sqrt(min(m, n)), the norm of an exactly semi-orthogonal
    matrix, correcting for the polar iteration's under-convergence: o·r. NorMuon then normalises
    per output row/column by a running second moment and keeps the total norm. Both read the
    squares of o along NorMuon's axis (their sum is ||o||², and o·r's are r² times them), so o is
    read once and scaled once."""
    ax = _reduce_axis(o.shape)
    of = o.astype(jnp.float32)
    n = o.shape[ax]
    sq = jnp.sum(of * of, axis=ax, keepdims=True)
    r = math.sqrt(min(o.shape)) / jnp.maximum(jnp.sqrt(jnp.sum(sq)), 1e-6)
    v_mean = sq * (r * r / n)
    v_norm = jnp.sqrt(jnp.sum(v_mean) * n)
    v = v + (1 - beta2) * (v_mean.astype(v.dtype) - v)
    step_size = jax.lax.rsqrt(jnp.maximum(v.astype(jnp.float32), 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * n * step_size * step_size))
    scale = step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10))
    return (of * (r * scale)).astype(o.dtype), v


BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bf16 dot-product instructions


def cpu_has_bf16_dots(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (the flags of /proc/cpuinfo, so Linux;
    elsewhere False). `cpuinfo`: that file's text, for tests."""
    flags = read_cpuinfo(cpuinfo).get("flags", "").split()
    return any(flag in flags for flag in BF16_DOT_FLAGS)


def orthogonalisation_dtype(backend: str, cpu_bf16: bool | None = None, cpuinfo: str | None = None) -> str:
    """Polar Express's dtype, from what the machine is: bf16 on TPU and GPU (their matrix units;
    nanochat runs it in bf16 on GPU); on a CPU with bf16 dot instructions (`cpu_has_bf16_dots`, or
    `cpu_bf16`) BF16_OPERANDS on AMD and BF16_PRODUCTS on Intel, fp32 elsewhere. `--ns-dtype`
    overrides it. `cpuinfo`: /proc/cpuinfo's text, for tests.

    On a 2-core AMD EPYC (Zen 5, AVX-512 BF16), a bf16 product is fast only when it accumulates into
    fp32 and its right side is not transposed: a 2048³ product ran at 961 GFLOP/s from bf16 operands
    into fp32 against 488 in fp32, while a bf16-out product ran at 353, and a Gram product x·xᵀ
    in bf16 gained nothing. So Polar Express all in bf16 is slower than fp32 there (57.7 against
    50.3 ms at depth 4), and it moves the orthogonalised gradients by 5.6e-2 (median relative
    Frobenius difference). BF16_PRODUCTS keeps the iterate and the Gram matrix in fp32 and takes
    the other two products from bf16 operands: 45 against 50 ms at depth 4, 590 against 767 ms for
    config B's 48 matrices (bench.train_throughput), and it moves the update by 1.3-2e-2, less than
    the bf16 nanochat runs on GPU. At depth 4 and 2,048 tokens per step the main job's val bpb after
    300 steps was 0.1452 against fp32's 0.1451; figures in docs/cpu_performance.md. Its
    rectangular matrices now take the Gram form in fp32 (`_gram_form`), faster than the bf16
    products and closer to float64: inside the step, Polar Express went from 44 to 33 ms at depth 4
    and from 424 to 360 ms at config B. CPUs without bf16 dots keep the standard fp32 iteration,
    the Gram form unmeasured there. On a 2-core Intel Xeon with AMX (bf16 operands into fp32 at
    1,498 GFLOP/s against 352 in fp32 at 2048³, but 204 against 186 at 256³), Polar Express alone
    on config A's gradients took 49.0 ms with BF16_PRODUCTS, 67.1 in fp32 and 77.1 in bf16.

    BF16_OPERANDS takes the Gram products from bf16 operands too. Earlier measurements found no
    gain in that because XLA:CPU had upcast the product x @ x.T to fp32 (see `_gram`). Written as
    one dot_general, on a 2-core AMD EPYC (Zen 4, AVX-512 BF16) it took Polar Express alone from
    77.7 to 66.9 ms on config A's 24 matrices (25 interleaved rounds) and from 959.5 to 805.0 ms on
    config B's 48, and Polar Express in the main job's step from 16.2-17.1% to 14.5-15.2% of it.
    Against float64 the update moves by 1.6e-2 on the square matrices, where it was 1.4e-2 (bf16:
    5-7e-2), and by 3-4e-3 on the rectangular ones, where it was 8e-6; the main job's val bpb after
    300 steps read 0.1455 against 0.1453 with bf16-products and with fp32. Those differences are
    on random tokens' gradients; text-trained ones are worse conditioned, and there the tall
    matrices move by 1.2e-1 after 5 steps and 1.4e-2 after 60, still less than bf16's 1.7e-1 and
    5.1e-2 (`bench.ns_accuracy`, in `_gram_form`). Not yet measured on an
    Intel CPU, so Intel keeps BF16_PRODUCTS. docs/cpu_performance.md has the runs.

    A CPU flag, not a timing probe: a probe on a busy machine could choose differently in two runs
    of one job, or in a run and its resume. `python -m bench.train_throughput --phases` prints
    every dtype's time and difference on any machine.
    """
    if backend in ("tpu", "gpu", "cuda", "rocm"):
        return "bfloat16"
    if not (cpu_has_bf16_dots(cpuinfo) if cpu_bf16 is None else cpu_bf16):
        return "float32"
    return BF16_OPERANDS if read_cpuinfo(cpuinfo).get("vendor_id") == "AuthenticAMD" else BF16_PRODUCTS


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
    ns_dtype: str = "float32"  # Polar Express's: float32, bfloat16 or BF16_PRODUCTS; `orthogonalisation_dtype` picks it per machine
    ns_steps: int = 5  # Polar Express iterations (0 leaves only the normalisations: for measuring)
    batch_lr_scale: float = 1.0
    lr_frac: float = 1.0


def build_optimizer(cfg: OptimConfig, schedule: Schedule) -> optax.GradientTransformation:
    """The full optimizer: a map from group name to transformation, applied by parameter path."""
    width = (cfg.n_embd / 768) ** -0.5  # AdamW LRs tuned at d_model 768 (nanochat)
    scale = cfg.batch_lr_scale * cfg.lr_frac

    def adamw(lr, b1, b2, wd):
        return optax.adamw(learning_rate=lambda c: lr * schedule.lr_multiplier(c), b1=b1, b2=b2,
                           eps=1e-10, weight_decay=wd)

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
                                beta2=cfg.muon_beta2, ns_steps=cfg.ns_steps, ns_dtype=cfg.ns_dtype)
    else:
        # Plain AdamW fallback for the block matrices: a tenth of Muon's LR, standard betas.
        groups["matrix"] = adamw(cfg.matrix_lr * 0.1 * scale, 0.9, 0.95, 0.0)
    return optax.multi_transform(groups, labels_for)


# --- nanochat's scaling rules (base_train.py): batch size, LR and weight decay from the horizon ---

B_REF = 2**19  # tokens per step at which nanochat's d12 hyperparameters were tuned
BATCH_EXPONENT = 0.383  # Power Lines (arXiv 2505.13738): B_opt grows as D^0.383


@dataclasses.dataclass(frozen=True)
class Scaling:
    target_tokens: float  # D = tokens-per-parameter x scaling parameters
    reference_tokens: float  # D_ref, the same for the d12 reference model
    total_batch_size: int  # B, tokens per step
    batch_lr_scale: float  # sqrt(B / B_ref)
    weight_decay: float  # lambda_ref * sqrt(B / B_ref) * D_ref / D


def scaling(n_scaling: int, n_scaling_ref: int, param_data_ratio: float, weight_decay: float,
            total_batch_size: int = -1) -> Scaling:
    """nanochat's rules: the horizon D, the batch (auto when -1: B_ref (D/D_ref)^0.383 rounded to
    a power of two), LRs scaled by sqrt(B/B_ref), and weight decay by sqrt(B/B_ref) D_ref/D (the
    T_epoch rule of arXiv 2405.13698 with that LR scaling)."""
    D = param_data_ratio * n_scaling
    D_ref = param_data_ratio * n_scaling_ref
    B = total_batch_size
    if B <= 0:
        B = 2 ** round(math.log2(B_REF * (D / D_ref) ** BATCH_EXPONENT))
    ratio = B / B_REF
    return Scaling(D, D_ref, int(B), math.sqrt(ratio), weight_decay * math.sqrt(ratio) * D_ref / D)

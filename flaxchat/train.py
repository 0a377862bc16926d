"""The one train step and eval step every stage shares (pretraining, SFT, RL).

`train_step` takes a stack of micro-batches (A, B, T) and accumulates gradients over A inside one
jit with `lax.scan`, and the optimizer runs once per step: the batch a step needs never has to fit
in memory at once (and on a CPU small micro-batches keep activations in cache: 2-4 rows of 512
tokens ran at ~55% MFU where one batch of 32 rows ran at ~31% on a 2-core AVX-512 CPU). Targets < 0
are ignored (SFT's loss mask). The loss is the mean over counted tokens of the whole step, so
gradient accumulation gives the same update as one big batch. How the scan runs (micro-batches side
by side, a lone one in halves, one flat all-reduce) is the step's plan (`flaxchat.kernels.StepPlan`,
the backend's unless given).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from flaxchat import ops
from flaxchat.gpt import GPT
from flaxchat.kernels import StepPlan, choose
from flaxchat.sharding import BATCH, data_parallel_mesh


def token_losses(model: GPT, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy in nats (fp32); 0 where target < 0."""
    raw = model(inputs, softcap=False)
    losses = model.kernels.cross_entropy(raw, jnp.maximum(targets, 0), model.config.logit_softcap)
    return jnp.where(targets >= 0, losses, 0.0)


def loss_sum_for_gradients(model: GPT, inputs: jax.Array, targets: jax.Array, weights=None) -> jax.Array:
    """sum over tokens of weight x cross-entropy (targets < 0 count 0): what a step differentiates.
    Where the kernels record has a head_loss (TPU, GPU) the head and its loss run fused, a chunk of
    tokens at a time, and the logits of the whole batch are never made."""
    head_loss = model.kernels.head_loss
    if head_loss is None:
        losses = token_losses(model, inputs, targets)
        return jnp.sum(losses if weights is None else losses * weights)
    counted = (targets >= 0).astype(jnp.float32)
    weights = counted if weights is None else counted * weights
    x = ops.rms_norm(model.trunk(inputs))
    return head_loss(x, model.head_weight(), jnp.maximum(targets, 0), weights, model.config.logit_softcap)


def _micro_loss(params, graphdef, rest, inputs, targets, weights=None):
    model = nnx.merge(graphdef, params, rest)
    return loss_sum_for_gradients(model, inputs, targets, weights), jnp.sum(targets >= 0)


def _halved(batches: tuple, plan: StepPlan) -> tuple:
    """(1, B, ...) micro-batch arrays as (2, B/2, ...) where the plan halves a lone one."""
    count, rows = batches[0].shape[:2]
    if count != 1 or rows % 2 or not plan.halve_lone_micro_batch:
        return batches
    return tuple(b.reshape(2, rows // 2, *b.shape[2:]) for b in batches)


def _gradient_sums(graphdef, plan: StepPlan, params, rest, batches):
    """(gradient sums, loss sum, counted tokens) over the leading axis of `batches` (lax.scan), as
    many micro-batches at a time as the plan's scan_unroll (a lone one in halves where it says so)."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def accumulate(carry, batch):
        grads, loss_sum, count = carry
        (l, n), g = grad_fn(params, graphdef, rest, *batch)
        return (jax.tree.map(jnp.add, grads, g), loss_sum + l, count + n), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32))
    return jax.lax.scan(accumulate, init, _halved(batches, plan), unroll=plan.scan_unroll)[0]


def _device_sums_then_one_reduce(graphdef, plan: StepPlan, mesh):
    """`_gradient_sums` per device on its own rows, then one all-reduce after the scan. Left to the
    partitioner, the sums of replicated parameters' gradients are reduced inside the scan, once per
    micro-batch. The gradients go as one flat buffer where the plan says so (CPUs, where
    gloo all-reduced 35 arrays 3.5x slower than one buffer of their bytes)."""
    flat_buffer = plan.flat_gradient_reduce

    def local(params, rest, batches):
        grads, loss_sum, count = _gradient_sums(graphdef, plan, params, rest, batches)
        if not flat_buffer:
            return jax.lax.psum((grads, loss_sum, count), BATCH)
        flat, unflatten = ravel_pytree(grads)
        flat, loss_sum, count = jax.lax.psum((flat, loss_sum, count), BATCH)
        return unflatten(flat), loss_sum, count

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(None, BATCH)), out_specs=P(), check_vma=False)


def _accumulated_step(model: GPT, optimizer: nnx.Optimizer, batches: tuple, plan: StepPlan,
                      normalise: bool = True):
    """Sum gradients over the leading axis of `batches` as `plan` says, average over counted tokens
    (or not, when the weights already normalise), update once; returns the loss. In the dp layout
    over several devices each device sums its own rows and one all-reduce follows the scan."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = data_parallel_mesh()
    if mesh is not None:
        sums = _device_sums_then_one_reduce(graphdef, plan, mesh)
    else:
        sums = partial(_gradient_sums, graphdef, plan)
    grads, loss_sum, count = sums(params, rest, batches)
    denom = jnp.maximum(count, 1).astype(jnp.float32) if normalise else jnp.ones([], jnp.float32)
    # Back in each parameter's dtype: a bf16 table's gradient over an fp32 count would be fp32, and
    # AdamW's first moment with it, so the step's outputs would no longer match its inputs.
    grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
    horizon = getattr(optimizer, "horizon", None)  # optim.with_horizon: the schedule's, at run time
    optimizer.update(model, grads, **({} if horizon is None else {"horizon": horizon[...]}))
    return loss_sum / denom


@nnx.jit(donate_argnames=("model", "optimizer"), static_argnames=("plan",))
def train_step(model: GPT, optimizer: nnx.Optimizer, inputs: jax.Array, targets: jax.Array,
               plan: StepPlan | None = None):
    """One optimizer step over micro-batches inputs/targets (A, B, T), accumulated as `plan` says
    (default: this backend's, `flaxchat.kernels.choose().plan`). Returns the mean loss.

    A plain call walks the model and optimizer graph in Python every step, 14 ms a step at depth 4
    (84 arrays; 5-8 ms through `nnx.cached_partial`) on a 2-core CPU, where that time is taken
    from the two cores training; a training loop calls `StepLoop` instead (~1 ms).
    """
    return _accumulated_step(model, optimizer, (inputs, targets), plan or choose().plan)


class StepLoop:
    """The train step of a training loop (pretraining, SFT, RL): one jax.jit of the flat list of
    the model's and the optimizer's arrays, so a call costs what JAX's own dispatch does.

    nnx.jit walks the model and optimizer and writes every Variable back in Python on each call:
    4.4-4.8 ms a step at depth 4 on a 2-core CPU, against ~1 ms for a list of arrays (docs/cpu.md).
    Between calls `model` and `optimizer` hold the arrays the last call donated; `sync()` writes the
    current ones back, and `flaxchat.loop.Loop` calls it before every hook and save (a missed
    `sync()` fails loudly: donated arrays are deleted, not stale). `plan`: how the step accumulates
    (`compute_init(...).plan` in the scripts; default: this backend's, `flaxchat.kernels.choose().plan`).
    `normalise=False` (RL's policy step): the weights given with each batch carry the whole
    normalisation.
    """

    def __init__(self, model: GPT, optimizer: nnx.Optimizer, *, plan: StepPlan | None = None,
                 normalise: bool = True):
        self.objects = (model, optimizer)
        self.plan = plan = plan or choose().plan
        graphdef, state = nnx.split(self.objects)
        self.arrays, self.treedef = jax.tree.flatten(state)
        self.synced = True

        def step(arrays, *batches):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(self.treedef, arrays))
            loss = _accumulated_step(model, optimizer, batches, plan, normalise=normalise)
            out = jax.tree.leaves(nnx.state((model, optimizer)))
            check_same_types(arrays, out, self.treedef)
            return out, loss

        self._step = jax.jit(step, donate_argnums=0)

    def __call__(self, inputs: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """One optimizer step over micro-batches inputs/targets (A, B, T), and per-token `weights`
        when given. Returns the mean loss (with weights: the weighted sum)."""
        batches = (inputs, targets) if weights is None else (inputs, targets, weights)
        self.arrays, loss = self._step(self.arrays, *batches)
        self.synced = False
        return loss

    def lower(self, inputs: jax.Array, targets: jax.Array):
        """The step lowered for these inputs (`.compile()` it for its module's text)."""
        return self._step.lower(self.arrays, inputs, targets)

    def sync(self) -> None:
        """Put the current arrays back into the model and optimizer."""
        if not self.synced:
            nnx.update(self.objects, jax.tree.unflatten(self.treedef, self.arrays))
            self.synced = True


def check_same_types(before: list, after: list, treedef) -> None:
    """Raise, while the step is traced, where a state array leaves the step with another dtype,
    shape or weak type than it came in with: the next call would compile the whole step again
    (a bf16 AdamW moment that turned fp32 once cost a second compile of ~55 s at d12 on a TPU v5e)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, before))[0]]
    changed = [f"{path}: {a.dtype}{list(a.shape)}{' weak' if a.weak_type else ''} -> "
               f"{b.dtype}{list(b.shape)}{' weak' if b.weak_type else ''}"
               for path, a, b in zip(paths, map(jax.typeof, before), map(jax.typeof, after))
               if (a.dtype, a.shape, a.weak_type) != (b.dtype, b.shape, b.weak_type)]
    if changed:
        raise TypeError(f"the train step changes the type of {len(changed)} state array(s), so every start "
                        f"would compile it twice: {'; '.join(changed[:4])}")


@nnx.jit
def loss_sum(model: GPT, inputs: jax.Array, targets: jax.Array):
    """(sum of the per-token losses, number of counted tokens): a validation loss, masks honoured."""
    losses = token_losses(model, inputs, targets)
    return jnp.sum(losses), jnp.sum(targets >= 0)


@nnx.jit
def eval_step(model: GPT, inputs: jax.Array, targets: jax.Array, token_bytes: jax.Array):
    """Sums for bits-per-byte: (nats over byte-carrying targets, bytes of those targets, tokens)."""
    losses = token_losses(model, inputs, targets)
    nbytes = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    counted = nbytes > 0  # special tokens carry no bytes and are left out, as nanochat does
    return jnp.sum(jnp.where(counted, losses, 0.0)), jnp.sum(nbytes), jnp.sum(targets >= 0)


def bits_per_byte(nats: float, nbytes: float) -> float:
    return float(nats) / (math.log(2) * max(float(nbytes), 1.0))


# --- sampling: the inference Engine (one KV cache and one sampler for every caller) -----------------


def sample(model: GPT, prompts: list[list[int]], max_new: int, *, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0) -> list[list[int]]:
    """Continue each prompt by up to max_new tokens (bounded by the context; no stop token, no
    tools): pretraining's periodic samples, through `flaxchat.engine.Engine`. Returns new tokens."""
    from flaxchat.engine import Engine
    T = model.config.sequence_len
    engine = Engine(model, tools=False)
    out = []
    for i, p in enumerate(prompts):
        p = list(p[:T - 1])
        new, _ = engine.generate_batch(p, 1, min(max_new, T - len(p)), temperature=float(temperature),
                                       top_k=int(top_k) if top_k and temperature > 0 else None, seed=seed + i,
                                       stop_tokens=())
        out.append(new[0])
    return out

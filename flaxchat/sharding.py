"""One table of sharding rules: logical axis names (what modules say) -> mesh axes (where data lives).

The mesh always has four axes, ('slice', 'data', 'fsdp', 'tensor'). The layout is chosen by the
mesh's shape, not by different code: `dp` puts every device of a slice on 'data' (parameters
replicated, since the 'fsdp' axis has size 1), `fsdp` puts them on 'fsdp' (each parameter's 'embed'
dimension split over the devices, so every device holds ~1/N of parameters, gradients and optimizer
state). 'slice' counts TPU slices joined by the data-centre network (multislice; 1 on one slice, a
GPU or a CPU): parameters are replicated across slices and batches split over them (data parallel
across slices, the layout within), so the traffic between slices should be the gradient reduction
(docs/deployment.md, "Two slices", has what libtpu's compiler actually sends).
Batches are split over 'slice', 'data' and 'fsdp' together. 'tensor' is the room left for tensor
parallelism (size 1). Modules name logical axes only (`Linear(..., axes=("embed", "mlp"))`), never
mesh axes. An axis of size 1 splits nothing, so a one-slice mesh places every array as the
three-axis mesh before it did.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxchat.errors import UserError

MESH_AXES = ("slice", "data", "fsdp", "tensor")
BATCH = ("slice", "data", "fsdp")

# logical axis -> mesh axis (None: replicated along it)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH,
    "embed": "fsdp",
    "vocab": None,
    "heads": "tensor",
    "kv": "tensor",
    "mlp": "tensor",
}


def make_mesh(devices: Sequence, sharding: str, slices: int | None = None) -> Mesh:
    """A ('slice', 'data', 'fsdp', 'tensor') mesh over `devices` for the layout `dp` or `fsdp`,
    within each of `slices` slices. None: as many as TPU devices span (their `slice_index`, which
    multislice jobs and multi-slice compile-only topologies set); 1 on other platforms, whose
    devices are never split by it. A slice takes a contiguous run of the devices, by slice_index."""
    devices = list(devices)
    if slices is None:
        index = [(getattr(d, "slice_index", 0) or 0) if getattr(d, "platform", "") == "tpu" else 0 for d in devices]
        slices = len(set(index))
        if slices > 1:
            devices = [d for _, d in sorted(zip(index, devices), key=lambda p: p[0])]
    n = len(devices)
    if slices < 1 or n % slices:
        raise UserError(f"{n} devices do not divide into {slices} slices; give a slice count that divides "
                        "the device count.")
    per_slice = n // slices
    shape = {"dp": (slices, per_slice, 1, 1), "fsdp": (slices, 1, per_slice, 1)}.get(sharding)
    if shape is None:
        raise UserError(f"--sharding must be dp, fsdp or auto (got {sharding!r}).")
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def choose(sharding: str, param_bytes: int, optimizer_multiple: float, device_bytes: int | None) -> str:
    """`auto`: fsdp when parameters + optimizer state (+ gradients) would not fit on one device."""
    if sharding != "auto":
        return sharding
    if not device_bytes:
        return "dp"
    need = param_bytes * (2 + optimizer_multiple)  # params + grads + optimizer state
    return "fsdp" if need > 0.5 * device_bytes else "dp"  # keep half the memory for activations


def device_memory_bytes() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:
        return None
    return stats.get("bytes_limit")


def logical_to_spec(axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh) -> P:
    """The mesh PartitionSpec for a value with these logical axes (size-1 dims never split)."""
    if not axes:
        return P()
    out = []
    for name, size in zip(axes, shape):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is not None:
            n = math.prod(mesh.shape[a] for a in ((mesh_axis,) if isinstance(mesh_axis, str) else mesh_axis))
            if n > 1 and size % n:
                raise UserError(f"a dimension of size {size} (logical axis {name!r}) does not divide over "
                                f"{n} devices; pick a model width (64 x --depth) or a device count that "
                                "divides it, or use --sharding=dp.")
            if size == 1 or n == 1:
                mesh_axis = None
        out.append(mesh_axis)
    # FSDP must split every sizeable tensor: one with no 'embed' dimension (value embeddings:
    # vocab x kv) has its largest divisible dimension split over 'fsdp' instead.
    nf = mesh.shape["fsdp"]
    used = {a for x in out if x for a in ((x,) if isinstance(x, str) else x)}
    if nf > 1 and "fsdp" not in used:
        dims = sorted(range(len(shape)), key=lambda i: -shape[i])
        for i in dims:
            if out[i] is None and shape[i] % nf == 0 and shape[i] >= nf:
                out[i] = "fsdp"
                break
    return P(*out)


def param_specs(state: nnx.State, mesh: Mesh) -> dict[str, P]:
    """Dotted path -> PartitionSpec for every Param in `state`."""
    specs = {}
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        axes = getattr(var, "logical_axes", None)
        specs[name] = logical_to_spec(axes, value.shape, mesh)
    return specs


def place_identical(x, sharding: NamedSharding) -> jax.Array:
    """An array every process holds whole and identical (same seed, same checkpoint, same rollouts)
    -> one global array under `sharding`; each process places only its own devices' shards."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # identical on every process (same seed / same checkpoint)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def placements(model: nnx.Module, optimizer: nnx.Optimizer | None, mesh: Mesh):
    """(variable, NamedSharding) for every parameter and optimizer-state array, by the rules.

    Optimizer state mirrors the parameter tree (momentum, Adam moments: same path suffix); a state
    array with the parameter's shape takes its spec, a reduced one (NorMuon's per-row second moment)
    drops the split on its size-1 dimension, anything else (step counts) is replicated. Works on real
    arrays and on the ShapeDtypeStructs of an abstract model (`nnx.eval_shape`).
    """
    pstate = nnx.state(model, nnx.Param)
    specs = param_specs(pstate, mesh)
    shapes = {}
    for path, var in nnx.to_flat_state(pstate):
        name = ".".join(map(str, path))
        shapes[name] = var.get_value().shape
        yield var, NamedSharding(mesh, specs[name])
    if optimizer is None:
        return
    by_length = sorted(specs.items(), key=lambda kv: -len(kv[0]))
    for path, var in nnx.to_flat_state(nnx.state(optimizer)):
        value = var.get_value() if isinstance(var, nnx.Variable) else None
        if not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
            continue
        name = ".".join(str(p) for p in path)
        spec = P()
        for pname, pspec in by_length:
            if name == pname or name.endswith("." + pname):
                if value.shape == shapes[pname]:
                    spec = pspec
                elif len(value.shape) == len(shapes[pname]):
                    spec = P(*[None if n == 1 else a for n, a in zip(value.shape, tuple(pspec) + (None,) * 8)])
                break
        yield var, NamedSharding(mesh, spec)


def create_sharded(make_model, make_optimizer, mesh: Mesh):
    """(model, optimizer) from their constructors, every array born on `mesh` by the rules.

    `make_model()` builds the model, `make_optimizer(model)` its optimizer (or None for none).
    They are traced once, and the arrays they compute (random init, zeros) are materialised by one
    `jax.jit` whose outputs carry their placements, so each device computes only its own shards:
    no process ever holds a whole parameter that the rules split (fsdp). Arrays the constructor
    set from concrete values (`load_params_into` for --init-from) are trace constants: they are
    kept out of that program and placed from the host, shard by shard. The training stages create
    their state through this one function.
    """
    init, side = _sharded_init(make_model, make_optimizer, mesh)
    computed = init()
    leaves = [None] * side["n"]
    for i, x in zip(side["computed"], computed):
        leaves[i] = x
    for i, value in side["loaded"].items():
        leaves[i] = place_identical(value, side["shardings"][i])
    return nnx.merge(side["graphdef"], jax.tree.unflatten(side["treedef"], leaves))


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _sharded_init(make_model, make_optimizer, mesh: Mesh):
    """The jitted initialiser of `create_sharded` (a test compiles it to read its memory analysis)
    and what the trace found: the graph, each leaf's placement, which leaves are constants."""
    import jax.extend.core as jex

    side: dict = {}

    def build():
        model = make_model()
        optimizer = make_optimizer(model) if make_optimizer is not None else None
        where = {id(var): s for var, s in placements(model, optimizer, mesh)}
        graphdef, state = nnx.split((model, optimizer))
        replicated = NamedSharding(mesh, P())
        # One sharding per array leaf, in leaf order (a Variable holding an empty subtree, such as
        # optax's MaskedNode, has no leaf and gets none).
        per_var = jax.tree.map(lambda var: where.get(id(var), replicated) if _is_array(var.get_value())
                               else var.get_value(), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        side["shardings"] = jax.tree.leaves(per_var, is_leaf=lambda x: isinstance(x, NamedSharding))
        side["graphdef"] = graphdef
        leaves, side["treedef"] = jax.tree.flatten(state)
        return leaves

    closed = jax.make_jaxpr(build)()
    jaxpr, consts = closed.jaxpr, closed.consts
    const_of = {v: c for v, c in zip(jaxpr.constvars, consts)}
    side["n"] = len(jaxpr.outvars)
    side["loaded"] = {i: const_of[v] for i, v in enumerate(jaxpr.outvars)
                      if isinstance(v, jex.Var) and v in const_of}
    side["computed"] = [i for i in range(side["n"]) if i not in side["loaded"]]

    def init():
        # Only what is computed: a constant that is merely returned never enters this program.
        outs = jax.core.eval_jaxpr(jaxpr, consts)
        return [outs[i] for i in side["computed"]]

    return jax.jit(init, out_shardings=[side["shardings"][i] for i in side["computed"]]), side


def shard_abstract(model: nnx.Module, optimizer: nnx.Optimizer | None, mesh: Mesh) -> None:
    """The same placements on an abstract model/optimizer from `nnx.eval_shape`: each
    ShapeDtypeStruct gets its sharding, so `train_step.lower(...).compile()` sees the real layout
    without a byte of the state being allocated (what a 'does it fit' check needs)."""
    for var, where in list(placements(model, optimizer, mesh)):
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=where))


def sharded_mesh():
    """The mesh in context when its batch axes are still to be split (a mesh of ours, not inside a
    shard_map over them); None outside one (e.g. in tests) and inside the shard_map of
    `train._device_sums_then_one_reduce`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or tuple(mesh.axis_names) != MESH_AXES or set(BATCH) & set(mesh.manual_axes):
        return None
    return mesh


def data_parallel_mesh():
    """The mesh in context when it splits only the batch (the dp layout over several devices, in
    one slice or several: parameters replicated), else None."""
    mesh = sharded_mesh()
    if mesh is None or mesh.shape["slice"] * mesh.shape["data"] < 2 or mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1:
        return None
    return mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical axes, a no-op outside a mesh context (e.g. in tests)."""
    if sharded_mesh() is None:
        return x
    spec = [RULES.get(a) if a else None for a in axes]
    return jax.lax.with_sharding_constraint(x, P(*spec))


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes of `tree`'s arrays held by each addressable device, from the arrays' shardings.
    Abstract leaves (ShapeDtypeStruct with a sharding) count what their shards would hold."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
        elif isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            itemsize = np.dtype(leaf.dtype).itemsize
            for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
                n = math.prod(len(range(*sl.indices(dim))) for sl, dim in zip(index, leaf.shape))
                out[device.id] = out.get(device.id, 0) + n * itemsize
    return out

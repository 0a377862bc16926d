"""Muon under fsdp: each device orthogonalises whole matrices, so the compiled step's collectives do
not depend on the number of Polar Express iterations (issue 49, "Muon at scale").

Run on 8 fake CPU devices in a fresh process (JAX reads the device count when it starts). Only
compiled, never run: the state is abstract (nnx.eval_shape) and placed by the sharding rules.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # multi-device training: CI runs it; `-m "not slow"` skips it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COUNT = r"""
import json, os, re, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, build_optimizer, labels_for, _path_str
from flaxchat.train import train_step


CFG = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn_block=16)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
OP = re.compile(r"\s(" + "|".join(KINDS) + r")(?:-start)?\(")  # an instruction, not its name or -done


def collectives(fn, *args):
    # The collectives of fn's compiled program by kind, and how many of the state's arrays it
    # returns in another layout than they came in (the next step would not take them).
    # The collectives are placed by the partitioner, before code generation: the cheapest will do.
    cheap = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    compiled = jax.jit(fn, donate_argnums=0).lower(*args).compile(cheap)
    ops = OP.findall(compiled.as_text())
    ins = jax.tree.leaves(compiled.input_shardings[0][0])
    outs = jax.tree.leaves(compiled.output_shardings)[-len(ins):]  # the step returns (loss, state)
    moved = sum(not a.is_equivalent_to(b, len(x.shape)) for a, b, x in zip(ins, outs, jax.tree.leaves(args[0])))
    return {**{k: ops.count(k) for k in KINDS}, "moved": moved}


def counts(ns_steps):
    mesh = sharding.make_mesh(jax.devices(), "fsdp")
    tx = build_optimizer(OptimConfig(n_embd=CFG.n_embd, ns_steps=ns_steps), Schedule(10))
    model, opt = nnx.eval_shape(lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(GPT(CFG, rngs=nnx.Rngs(0))))
    sharding.shard_abstract(model, opt, mesh)
    graphdef, state = nnx.split((model, opt))

    def update(state):  # the optimizer alone, on gradients placed like the parameters
        model, opt = nnx.merge(graphdef, state)
        opt.update(model, nnx.state(model, nnx.Param))
        return nnx.state((model, opt))

    def step(state, x, y):
        model, opt = nnx.merge(graphdef, state)
        loss = train_step(model, opt, x, y)
        return loss, nnx.state((model, opt))

    xs = jax.ShapeDtypeStruct((1, 16, CFG.sequence_len), jnp.int32, sharding=NamedSharding(mesh, P(None, sharding.BATCH)))
    with jax.set_mesh(mesh):
        return collectives(update, state) if sys.argv[1] == "update" else collectives(step, state, xs, xs)


params = nnx.state(nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0))), nnx.Param)
labels = jax.tree.leaves(labels_for(params))
role = lambda path: ".".join(p for p in _path_str(path).split(".") if not p.isdigit())  # no layer number
blocks = {(leaf.shape, role(path)) for (path, leaf), label in zip(jax.tree_util.tree_flatten_with_path(params)[0], labels)
          if label == "matrix"}
print("RESULT " + json.dumps({"blocks": len(blocks), **{str(n): counts(n) for n in (5, 2)}}), flush=True)
"""


def _counts(what):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               JAX_PLATFORMS="cpu")  # keeps a TPU VM's own site folder
    r = subprocess.run([sys.executable, "-c", _COUNT, what], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


@pytest.mark.timeout(300)
def test_fsdp_muon_has_no_collective_inside_polar_express():
    res = _counts("update")
    # Three more iterations add no collective: none runs inside them. (With Polar Express on the
    # split matrices, as before the stacks: 163 collectives in this optimizer step at 5 steps, 79 at 2.)
    assert res["5"] == res["2"], res
    # What is left moves whole matrices into the stacks and back, gradient and second moment: at most
    # 4 per block of one shape and role (7 blocks here; 18 collectives were measured).
    assert sum(v for k, v in res["5"].items() if k != "moved") <= 4 * res["blocks"], res
    # and every array of the state comes back in its own layout, so the next step takes it
    assert res["5"]["moved"] == 0, res


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_train_steps_collectives_do_not_grow_with_polar_express_steps():
    res = _counts("step")  # the whole step: forward, backward, optimizer
    assert res["5"] == res["2"], res
    assert res["5"]["moved"] == 0, res

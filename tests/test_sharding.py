"""Sharding: dp and fsdp give the same step, fsdp splits parameter bytes, across processes too;
the bf16 path agrees with fp32."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.errors import UserError

pytestmark = pytest.mark.slow  # multi-device training in subprocesses: CI runs it; `-m "not slow"` skips it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(devices, **extra):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.update(extra)
    return env


def _result(stdout):
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _check(res, devices):
    dp, fsdp = res["dp"], res["fsdp"]
    assert dp["devices"] == fsdp["devices"] == devices
    assert dp["losses"] == pytest.approx(fsdp["losses"], rel=1e-6)
    # Muon matrices agree to float rounding; a few AdamW scalars whose gradient is a sum with heavy
    # cancellation differ more (summation order of all-reduce vs reduce-scatter): see the worker.
    assert res["matrices_allclose"], res
    assert res["allclose"], res
    # dp replicates every parameter; fsdp leaves each device about 1/N of the bytes.
    assert dp["max_param_bytes_per_device"] == dp["param_bytes"]
    assert fsdp["max_param_bytes_per_device"] <= 1.1 * dp["param_bytes"] / devices
    assert fsdp["max_opt_bytes_per_device"] <= 1.2 * dp["max_opt_bytes_per_device"] / devices


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dp_and_fsdp_agree_across_2_processes_of_4_devices():
    # Three steps, so that Muon's momentum and second moments take part: fsdp orthogonalises whole
    # matrices in stacks (flaxchat.optim._stacked_orthogonalise), dp one matrix at a time on CPU.
    # (This was also run in one process of 8 devices: the same checks, the same 8 devices; one
    # process's fsdp on 8 devices is test_two_slices_train_as_one's 1-slice half.)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "tests/sharding_worker.py"], cwd=ROOT,
                              env=_worker_env(4, STEPS="3", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                              JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=550))
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    _check(_result(outs[0][0]), 8)


def test_bf16_compute_tracks_fp32():
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import train_step
    cfg = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, attn_block=16)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 4, 32)), jnp.int32)
    y = jnp.roll(x, -1, -1)
    losses = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        opt = nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=64), Schedule(20)), wrt=nnx.Param)
        losses[dtype] = [float(train_step(model, opt, x, y)) for _ in range(5)]
        # master weights stay fp32 whatever the compute dtype, but for the embedding tables, which
        # are stored in the compute dtype as nanochat keeps them
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            table = path[-1] == "embedding"
            assert v.get_value().dtype == (dtype if table else jnp.float32), path
    # bf16 has 8 mantissa bits (~0.4% per rounding): after 5 steps the loss agrees within 2%.
    np.testing.assert_allclose(losses[jnp.bfloat16], losses[jnp.float32], rtol=2e-2)
    assert losses[jnp.bfloat16][-1] < losses[jnp.bfloat16][0] - 0.25  # and it learns


def test_rules_and_bad_layouts():
    mesh = sharding.make_mesh(jax.devices() * 1, "fsdp")
    assert tuple(mesh.axis_names) == ("slice", "data", "fsdp", "tensor") and mesh.shape["slice"] == 1
    with pytest.raises(UserError, match="--sharding"):
        sharding.make_mesh(jax.devices(), "zero3")
    assert sharding.choose("auto", 10**6, 2.0, 16 * 10**9) == "dp"
    assert sharding.choose("auto", 4 * 10**9, 2.0, 16 * 10**9) == "fsdp"
    assert sharding.choose("fsdp", 1, 2.0, None) == "fsdp"


def test_fsdp_axis_that_does_not_divide_is_one_sentence():
    class FakeMesh:
        shape = {"slice": 1, "data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(UserError, match="does not divide over 8 devices"):
        sharding.logical_to_spec(("embed", "mlp"), (100, 400), FakeMesh())


_PRETRAIN_ON_3_DEVICES = """
import json, sys
from flaxchat.errors import cli_main
from scripts import pretrain
out = []
for argv in json.loads(sys.argv[1]):
    code = cli_main(pretrain.main, argv)
    print("CODE", code, flush=True)
    print("END", file=sys.stderr, flush=True)
"""


@pytest.mark.timeout(180)
def test_fsdp_on_a_device_count_that_does_not_divide_is_one_sentence(tmp_path):
    """scripts.pretrain on 3 fake devices: a batch that does not split over them, and a width (64 at
    depth 1) that the fsdp axis cannot split, each stop with one sentence and exit status 2."""
    tiny = ["--depth=1", "--sequence-len=32", "--vocab-size=300", "--device-batch-size=2", "--sharding=fsdp",
            "--max-chars-tokenizer=100000", f"--tokenizer-dir={tmp_path / 'tok'}", "--steps=1"]
    runs = [[*tiny, "--total-batch-size=128", f"--run-dir={tmp_path / 'a'}"],  # 128 tokens vs 3 x 2 x 32
            [*tiny, "--total-batch-size=192", f"--run-dir={tmp_path / 'b'}"]]  # 3 x 2 x 32: only the width is wrong
    r = subprocess.run([sys.executable, "-c", _PRETRAIN_ON_3_DEVICES, json.dumps(runs)], cwd=ROOT,
                       env=_worker_env(3, FLAXCHAT_NO_CPU_TUNING="1"), capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [l for l in r.stdout.splitlines() if l.startswith("CODE")] == ["CODE 2", "CODE 2"], r.stdout
    errs = [e.strip() for e in r.stderr.split("END")[:2]]
    assert all(len(e.splitlines()) == 1 and e.startswith("error: ") for e in errs), errs
    assert "--total-batch-size 128" in errs[0] and "device_batch_size x devices x sequence_len = 192" in errs[0]
    assert ("a dimension of size 64 (logical axis 'embed') does not divide over 3 devices" in errs[1]
            and "--sharding=dp" in errs[1]), errs[1]


_SHARDED_INIT = """
import json, re, sys
import jax, numpy as np
from flax import nnx
from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.export import formats, load_params_into
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, build_optimizer

cfg = GPTConfig(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
mesh = sharding.make_mesh(jax.devices(), "fsdp")
make_opt = lambda m: nnx.Optimizer(m, build_optimizer(OptimConfig(n_embd=128), Schedule(10)), wrt=nnx.Param)
out = {}

def params(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

def report(model, opt, want):
    got = params(model)
    out["specs"] = {k: str(v.sharding.spec) for k, v in got.items()}
    out["sizes"] = {k: int(v.size) for k, v in got.items()}
    out["max_shard"] = {k: max(int(s.data.size) for s in v.addressable_shards) for k, v in got.items()}
    out["equal"] = all(np.allclose(np.asarray(got[k]), np.asarray(w), rtol=1e-6, atol=1e-7) for k, w in want.items())
    out["opt_max_shard_bytes"] = max(sharding.bytes_per_device(nnx.state(opt)).values())

# 1. random init: the values of an unsharded init, every array born on its shards
make = lambda: GPT(cfg, rngs=nnx.Rngs(0))
report(*sharding.create_sharded(make, make_opt, mesh), params(GPT(cfg, rngs=nnx.Rngs(0))))
init, side = sharding._sharded_init(make, make_opt, mesh)
compiled = init.lower().compile()
m = compiled.memory_analysis()
out["init_out_b"], out["init_temp_b"] = m.output_size_in_bytes, m.temp_size_in_bytes
sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"[fus]32\\[([0-9,]+)\\]", compiled.as_text())]
out["largest_buffer"] = max(sizes)
res = {"random": out}

# 2. --init-from: make_model loads exported weights into the model (pretrain's make_model)
path = sys.argv[1]
formats.save_npz(path, cfg, formats.model_params(GPT(cfg, rngs=nnx.Rngs(7))))
def make_loaded():
    model = GPT(cfg, rngs=nnx.Rngs(0))
    load_params_into(model, path)
    return model
out = {}
report(*sharding.create_sharded(make_loaded, make_opt, mesh), params(GPT(cfg, rngs=nnx.Rngs(7))))
out["init_arg_b"] = sharding._sharded_init(make_loaded, make_opt, mesh)[0].lower().compile().memory_analysis().output_size_in_bytes
res["loaded"] = out
print("RESULT " + json.dumps(res))
"""


@pytest.mark.timeout(300)
def test_fsdp_state_is_born_sharded(tmp_path):
    """create_sharded on 8 fake devices under fsdp: no device ever holds a whole split parameter.

    The init program (what each device runs) has no buffer as large as any matrix the rules split,
    and outputs ~1/8 of the state; what it returns is already on its shards, with the values an
    unsharded init gives. With --init-from's make_model (load_params_into) the loaded values arrive
    on their shards and are not baked into the program."""
    r = subprocess.run([sys.executable, "-c", _SHARDED_INIT, str(tmp_path / "w.npz")], cwd=ROOT,
                       env=_worker_env(8), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _result(r.stdout)
    for case in ("random", "loaded"):
        out = res[case]
        assert out["equal"], case
        split = [k for k, spec in out["specs"].items() if "fsdp" in spec]
        big = [k for k, n in out["sizes"].items() if n >= 8 * 1024]
        assert set(big) <= set(split), (case, out["specs"])
        for k in split:
            assert out["max_shard"][k] * 8 == out["sizes"][k], (case, k)
    total = 4 * sum(res["random"]["sizes"].values())
    smallest_split_matrix = min(n for k, n in res["random"]["sizes"].items() if n >= 8 * 1024)
    assert res["random"]["largest_buffer"] < smallest_split_matrix
    # outputs: this device's shards of parameters and optimizer state, nothing more; temporaries
    # (the random bits of its shards) a fraction of one replica of the parameters
    per_device = 4 * sum(res["random"]["max_shard"].values()) + res["random"]["opt_max_shard_bytes"]
    assert res["random"]["init_out_b"] <= per_device + 1024
    assert res["random"]["init_temp_b"] < 0.25 * total
    # loaded weights are placed from the host: the program outputs only placeholders for them
    assert res["loaded"]["init_arg_b"] < res["random"]["init_out_b"]


_ONE_REDUCE = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, build_optimizer
from flaxchat.train import train_step

cfg = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
x = np.random.default_rng(0).integers(0, 256, (6, 4, 32)).astype(np.int32)  # 6 micro-batches of 4 rows (a loop of 3 trips side by side)
y = np.roll(x, -1, -1)
res = {}
for layout, devices in (("dp", jax.devices()), ("one", jax.devices()[:1])):
    mesh = sharding.make_mesh(devices, "dp")
    with jax.set_mesh(mesh):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=64), Schedule(10)), wrt=nnx.Param)
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, sharding.BATCH))
        xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)
        text = train_step.lower(model, opt, xs, ys).compile().as_text()
        losses = [float(train_step(model, opt, xs, ys)) for _ in range(3)]
    # the computations of the compiled module, and which of them are loop bodies
    blocks = {m.group(1): m.group(0) for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n.*?^\}", text, re.M | re.S)}
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    res[layout] = dict(losses=losses, loops=len(bodies),
                       reduces=len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
                       reduces_in_loops=sum(len(re.findall(r"all-reduce", blocks.get(b, ""))) for b in bodies))
print("RESULT " + json.dumps(res))
"""


@pytest.mark.timeout(300)
def test_data_parallel_sums_its_rows_then_reduces_once():
    """On 2 devices in the dp layout a 6-micro-batch step all-reduces once, after the scan (left to
    the partitioner the gradients were reduced inside it, every micro-batch and array by array:
    137-142 ms per reduce of config A's gradients between two CPU processes), and trains as one
    device does."""
    r = subprocess.run([sys.executable, "-c", _ONE_REDUCE], cwd=ROOT, env=_worker_env(2), capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _result(r.stdout)
    dp, one = res["dp"], res["one"]
    assert dp["loops"] >= 1 and dp["reduces_in_loops"] == 0 and dp["reduces"] >= 1, dp
    assert one["reduces"] == 0, one
    assert dp["losses"] == pytest.approx(one["losses"], rel=1e-5)


_SAVE_SHARDED = """
import sys, jax
from flax import nnx
from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.loading import save_run
cfg = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
mesh = sharding.make_mesh(jax.devices(), "fsdp")
model = sharding.create_sharded(lambda: GPT(cfg, rngs=nnx.Rngs(0)), None, mesh)[0]
assert len(model.blocks[0].mlp.c_fc.kernel[...].sharding.device_set) == 4  # split over the pod's devices
save_run(sys.argv[1], model)
"""

_CHAT_ON_ONE = """
import sys, jax, jax.numpy as jnp
from flaxchat.loading import load_model
model, _, meta = load_model(sys.argv[1], with_tokenizer=False)
print("DEVICES", jax.device_count(), float(jnp.abs(model.blocks[0].mlp.c_fc.kernel[...]).sum()))
"""


@pytest.mark.timeout(180)
def test_a_run_saved_on_a_pod_opens_on_one_device(tmp_path):
    """A pod's checkpoint (parameters split over 4 devices, fsdp) loads for chat or eval on a
    machine with one device: the arrays are restored onto it, not onto the saved topology."""
    run = str(tmp_path / "pod-run")
    r = subprocess.run([sys.executable, "-c", _SAVE_SHARDED, run], cwd=ROOT, env=_worker_env(4),
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", _CHAT_ON_ONE, run], cwd=ROOT, env=_worker_env(1),
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("DEVICES"))
    assert line.split()[1] == "1" and float(line.split()[2]) > 0, line


_SLICES = """
import json, jax, numpy as np
from flax import nnx
from flaxchat import sharding
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import OptimConfig, Schedule, build_optimizer
from flaxchat.train import train_step

cfg = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn_block=16)
data = np.random.default_rng(0).integers(0, 256, (2, 16, 33)).astype(np.int32)  # 2 micro-batches of 16 rows

def make_model():
    model = GPT(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)  # non-zero output projections, as sharding_worker.py does
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    return model

out, params = {}, {}
for layout in ("dp", "fsdp"):
    for slices in (1, 2):
        mesh = sharding.make_mesh(jax.devices(), layout, slices=slices)
        with jax.set_mesh(mesh):
            model, opt = sharding.create_sharded(make_model, lambda m: nnx.Optimizer(
                m, build_optimizer(OptimConfig(n_embd=64, depth=2), Schedule(10)), wrt=nnx.Param), mesh)
            rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, sharding.BATCH))
            x, y = jax.device_put(data[..., :-1], rows), jax.device_put(data[..., 1:], rows)
            losses = [float(train_step(model, opt, x, y)) for _ in range(3)]
        key = f"{layout}{slices}"
        params[key] = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        kernel = model.blocks[0].mlp.c_fc.kernel[...]
        out[key] = dict(mesh=dict(mesh.shape), losses=losses, x_shards=len({str(s.index) for s in x.addressable_shards}),
                        kernel_shards=len({str(s.index) for s in kernel.addressable_shards}),
                        param_bytes_per_device=max(sharding.bytes_per_device(nnx.state(model, nnx.Param)).values()))
for layout in ("dp", "fsdp"):
    one, two = params[layout + "1"], params[layout + "2"]
    out[layout + "_max_rel"] = max(float(np.max(np.abs(one[k] - two[k]) / (np.abs(one[k]) + 1e-6))) for k in one
                                   if k.endswith("kernel"))
    out[layout + "_matrices_allclose"] = all(np.allclose(one[k], two[k], rtol=1e-5, atol=1e-6) for k in one if k.endswith("kernel"))
    out[layout + "_allclose"] = all(np.allclose(one[k], two[k], rtol=1e-5, atol=1e-3) for k in one)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(400)
def test_two_slices_train_as_one():
    """Multislice on 8 fake devices: a 2-slice mesh (4 devices a slice) splits the batch over the
    slices and keeps every parameter whole across them (fsdp within a slice: 1/4 of the bytes per
    device, against 1/8 on one 8-device slice); three steps of dp and of fsdp give the 1-slice
    losses to 1e-6 and its matrices to float rounding (AdamW scalars: see sharding_worker.py)."""
    r = subprocess.run([sys.executable, "-c", _SLICES], cwd=ROOT, env=_worker_env(8), capture_output=True,
                       text=True, timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _result(r.stdout)
    assert res["dp2"]["mesh"] == {"slice": 2, "data": 4, "fsdp": 1, "tensor": 1}
    assert res["fsdp2"]["mesh"] == {"slice": 2, "data": 1, "fsdp": 4, "tensor": 1}
    for layout in ("dp", "fsdp"):
        one, two = res[layout + "1"], res[layout + "2"]
        assert two["losses"] == pytest.approx(one["losses"], rel=1e-6), (layout, one["losses"], two["losses"])
        assert one["x_shards"] == two["x_shards"] == 8  # the batch is split over all 8 devices either way
        assert res[layout + "_matrices_allclose"] and res[layout + "_allclose"], res
    assert res["dp1"]["kernel_shards"] == res["dp2"]["kernel_shards"] == 1  # replicated
    assert res["fsdp1"]["kernel_shards"] == 8 and res["fsdp2"]["kernel_shards"] == 4  # whole across slices
    assert res["fsdp2"]["param_bytes_per_device"] == pytest.approx(2 * res["fsdp1"]["param_bytes_per_device"], rel=0.05)

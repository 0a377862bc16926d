"""Export: model.pkl / weights.npz round trips, StableHLO logits, starting training from a pkl, bad input.

The model is a tiny GPT (2 layers, grouped-query attention, a sliding-window layer) trained for a
few steps and saved as an Orbax checkpoint in a run folder, as scripts.pretrain leaves it.
"""

import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.checkpoint import Checkpointer
from flaxchat.config import GPTConfig
from flaxchat.errors import UserError, cli_main
from flaxchat.export import (export_model, export_run, load_npz, load_params_into, load_pkl, model_params,
                             read_npz, read_pkl)
from flaxchat.export.formats import flatten, pkl_bytes_equal, save_pkl
from flaxchat.export.stablehlo import load_stablehlo
from flaxchat.gpt import GPT

pytestmark = pytest.mark.slow  # exports and compiles whole models: CI runs it; `-m "not slow"` skips it


TINY = GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                 window_pattern="SL", attn_block=16)  # layer 0 sees a 16-token window


def train_tiny(steps: int = 6, seed: int = 0):
    """A TINY model after a few AdamW steps on a repeating-pattern corpus (so it is not all zeros)."""
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import train_step

    model = GPT(TINY, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig("adamw", n_embd=TINY.n_embd, depth=TINY.n_layer),
                                               Schedule(steps)), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, 250, (1, 4, 1))
        seq = (start + 3 * np.arange(TINY.sequence_len + 1)) % TINY.vocab_size  # an easy pattern to learn
        train_step(model, opt, jnp.asarray(seq[..., :-1], jnp.int32), jnp.asarray(seq[..., 1:], jnp.int32))
    return model, opt


def make_run(run_dir, steps: int = 6):
    """A run folder with one finished Orbax checkpoint, as scripts.pretrain writes it."""
    model, opt = train_tiny(steps)
    ck = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False)
    ck.save(steps, model, opt, dict(model_config=TINY.to_dict()))
    ck.close()
    os.makedirs(os.path.join(run_dir, "tokenizer"), exist_ok=True)
    with open(os.path.join(run_dir, "tokenizer", "tokenizer.json"), "w") as f:
        f.write("{}")
    return model


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """Trained, checkpointed and exported once for both test_export and test_tflite."""
    run_dir = str(tmp_path_factory.mktemp("run"))
    model = make_run(run_dir)
    paths = export_run(run_dir)
    return dict(dir=run_dir, model=model, paths=paths)


@jax.jit
def _forward_pure(state, x):
    return nnx.merge(_GRAPHDEF[0], state)(x)


_GRAPHDEF = []


def logits(model, x):
    """model(x), compiled once for every model of the TINY shape (eager runs op by op: slow) and for
    one (2, 64) input: a smaller x is zero-padded to it (each other shape is another compile, ~3 s
    from a cold cache). Rows are independent and the model causal, so padding moves no logit of x."""
    graphdef, state = nnx.split(model)
    if not _GRAPHDEF:
        _GRAPHDEF.append(graphdef)
    assert graphdef == _GRAPHDEF[0]
    (b, t), buf = x.shape, np.zeros((2, TINY.sequence_len), np.int32)
    buf[:b, :t] = x
    return np.asarray(_forward_pure(state, jnp.asarray(buf)))[:b, :t]


def _tokens(batch=2, T=TINY.sequence_len, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, TINY.vocab_size, (batch, T)), jnp.int32)


def _files(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# --- round trips -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_export_run_writes_all_files(run):
    paths = run["paths"]
    assert sorted(paths) == ["mlir", "npz", "pkl", "stablehlo", "tokenizer"]
    assert all(os.path.exists(p) for p in paths.values())
    assert not [f for f in _files(os.path.dirname(paths["pkl"])) if ".tmp" in f]
    assert "stablehlo." in open(paths["mlir"]).read()


@pytest.mark.timeout(120)
def test_pkl_round_trip_is_bit_identical_and_needs_only_numpy(run):
    cfg, params, step = read_pkl(run["paths"]["pkl"])
    assert cfg == TINY and step == 6
    assert pkl_bytes_equal(params, model_params(run["model"]))
    # No flaxchat class inside: every class the pickle asks for is numpy's.
    modules = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            modules.append(module)
            return super().find_class(module, name)

    with open(run["paths"]["pkl"], "rb") as f:
        raw = Recording(f).load()
    assert modules and all(m.split(".")[0] == "numpy" for m in modules)
    assert raw["format"] == "flaxchat-pkl" and raw["config"] == TINY.to_dict()
    assert isinstance(raw["params"]["blocks"][0]["attn"]["c_q"]["kernel"], np.ndarray)
    # Back into a GPT with one call: the same logits, bit for bit.
    x = _tokens()
    np.testing.assert_array_equal(logits(load_pkl(run["paths"]["pkl"]), x), logits(run["model"], x))


@pytest.mark.timeout(120)
def test_npz_round_trip_is_bit_identical_and_loads_without_flaxchat(run):
    with np.load(run["paths"]["npz"], allow_pickle=False) as z:  # what any numpy user does
        assert "blocks.0.attn.c_q.kernel" in z.files and "wte.embedding" in z.files
        assert json.loads(str(z["__config__"]))["n_layer"] == 2
        flat = {k: z[k] for k in z.files if not k.startswith("__")}
    assert flat.keys() == flatten(model_params(run["model"])).keys()
    cfg, params = read_npz(run["paths"]["npz"])
    assert cfg == TINY and pkl_bytes_equal(params, model_params(run["model"]))
    x = _tokens()
    np.testing.assert_array_equal(logits(load_npz(run["paths"]["npz"]), x), logits(run["model"], x))


@pytest.mark.timeout(120)
def test_stablehlo_reproduces_the_logits_for_any_batch(run):
    exported = load_stablehlo(run["paths"]["stablehlo"])
    assert str(exported.in_avals[0].shape[0]) == "b"  # symbolic batch
    for batch in (2, 1):
        x = _tokens(batch, seed=batch)
        got, want = np.asarray(exported.call(x)), logits(run["model"], x)
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-5


@pytest.mark.timeout(120)
def test_export_model_from_a_live_model_with_a_shorter_sequence(run, tmp_path):
    paths = export_model(run["model"], str(tmp_path), seq_len=32)
    exported = load_stablehlo(paths["stablehlo"])
    x = _tokens(2, 32)
    # Causal: a 32-token forward equals the first 32 positions of the full one.
    np.testing.assert_allclose(np.asarray(exported.call(x)), logits(run["model"], x), atol=1e-5)


@pytest.mark.timeout(180)
def test_training_can_start_from_model_pkl(run):
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import train_step

    model = GPT(TINY, rngs=nnx.Rngs(123))  # different random init, then overwritten
    assert load_params_into(model, run["paths"]["pkl"]) == 6
    assert pkl_bytes_equal(model_params(model), model_params(run["model"]))
    # train_tiny's optimizer and batch shape: train_step's compiled program comes from the compile
    # cache (another schedule is another program, ~10 s to compile from a cold cache).
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig("adamw", n_embd=64, depth=2), Schedule(6)), wrt=nnx.Param)
    x = _tokens(4, seed=5)[None]
    loss = float(train_step(model, opt, x, jnp.roll(x, -1, axis=-1)))
    assert np.isfinite(loss)
    other = GPT(GPTConfig(sequence_len=64, vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, n_embd=64), rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="this run builds one with depth 3"):
        load_params_into(other, run["paths"]["pkl"])


# --- bad input: one sentence, non-zero exit, nothing half-written ------------------------------------


def _export_cli(argv, capsys):
    from scripts.export import main

    rc = cli_main(main, argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.timeout(120)
def test_a_tokenizer_in_a_bucket_is_exported_into_a_local_folder_not_made_yet(run, tmp_path):
    """`scripts.export --run-dir=gs://... --out-dir=exports/d20-sft` (docs/deployment.md): the tokenizer
    comes from the object store, one file at a time, into a folder here that nobody made (memory://
    stands in for gs://: both are remote to flaxchat.paths, and nothing is written to a real bucket)."""
    import uuid

    from flaxchat import paths
    tok = f"memory://export-{uuid.uuid4().hex}/tokenizer"
    paths.write_text(f"{tok}/tokenizer.json", '{"vocab": 1}')
    paths.write_text(f"{tok}/extra/notes.txt", "nested")
    out = tmp_path / "exports" / "d1"
    files = export_run(run["dir"], str(out), tokenizer_dir=tok)
    assert (out / "tokenizer" / "tokenizer.json").read_text() == '{"vocab": 1}'
    assert (out / "tokenizer" / "extra" / "notes.txt").read_text() == "nested"
    assert files["tokenizer"] == str(out / "tokenizer") and os.path.isfile(files["pkl"])


@pytest.mark.timeout(60)
def test_missing_run_folder(tmp_path, capsys):
    rc, err = _export_cli([f"--run-dir={tmp_path / 'nope'}", f"--out-dir={tmp_path / 'out'}"], capsys)
    assert rc == 2 and err.startswith("error:") and "does not exist" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "nope").exists()


@pytest.mark.timeout(60)
def test_half_written_checkpoint_is_refused_and_left_alone(tmp_path, capsys):
    half = tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
    half.mkdir(parents=True)
    (half / "junk").write_text("half-written")
    rc, err = _export_cli([f"--run-dir={tmp_path / 'run'}", f"--out-dir={tmp_path / 'out'}"], capsys)
    assert rc == 2 and "half-written" in err and len(err.splitlines()) == 1
    assert (half / "junk").exists()  # an exporter never deletes a save in flight
    assert _files(tmp_path / "out") == []


@pytest.mark.timeout(120)
def test_damaged_checkpoint_is_refused(run, tmp_path, capsys):
    import shutil

    shutil.copytree(run["dir"], tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6" / "model" / "d")  # the array data is gone
    rc, err = _export_cli([f"--run-dir={tmp_path / 'run'}", f"--out-dir={tmp_path / 'out'}"], capsys)
    assert rc == 2 and "damaged or incomplete" in err and len(err.splitlines()) == 1
    assert _files(tmp_path / "out") == []


@pytest.mark.timeout(120)
def test_sequence_longer_than_the_model_is_refused_before_writing(run, tmp_path, capsys):
    rc, err = _export_cli([f"--run-dir={run['dir']}", f"--out-dir={tmp_path / 'out'}", "--seq-len=65"], capsys)
    assert rc == 2 and "longer than the model's context of 64" in err
    assert _files(tmp_path / "out") == []


class Foreign:  # stands for any other project's model class
    def __init__(self):
        self.weights = np.zeros(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["foreign-class", "plain-dict", "other-shapes", "truncated", "not-a-pickle"])
def test_a_pickle_from_another_model_is_refused(run, tmp_path, kind):
    path = str(tmp_path / "model.pkl")
    if kind == "foreign-class":
        pickle.dump({"model": Foreign()}, open(path, "wb"))
    elif kind == "plain-dict":
        pickle.dump({"state_dict": {"w": np.zeros(3)}}, open(path, "wb"))
    elif kind == "other-shapes":  # flaxchat's format, but the weights of another config
        cfg, params, _ = read_pkl(run["paths"]["pkl"])
        save_pkl(path, GPTConfig(**dict(cfg.to_dict(), n_embd=128, n_head=4)), params)
    elif kind == "truncated":
        blob = open(run["paths"]["pkl"], "rb").read()
        open(path, "wb").write(blob[: len(blob) // 2])
    else:
        open(path, "w").write("hello")
    with pytest.raises(UserError) as e:
        load_pkl(path)
    assert "\n" not in str(e.value)

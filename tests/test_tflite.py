"""TFLite: the LiteRT interpreter against JAX (forward, prefill + KV-cache decode, greedy tokens), int8.

Runs the conversion through `scripts.convert_to_tflite` on the tiny trained model of test_export.
Tests that need the optional converter/interpreter skip, saying so, when the `export` extra is not
installed; the "converter missing" message is tested either way.
"""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxchat.errors import UserError, cli_main
from flaxchat.export import load_pkl
from test_export import TINY, logits, run  # noqa: F401  (run: the shared session fixture)

pytestmark = pytest.mark.slow  # converts and runs TFLite models: CI runs it; `-m "not slow"` skips it


HAVE_LITERT = all(importlib.util.find_spec(m) is not None for m in ("litert_converter", "ai_edge_litert"))
needs_litert = pytest.mark.skipif(not HAVE_LITERT, reason="the export extra (litert-converter, ai-edge-litert) "
                                  "is not installed: pip install -e \".[export]\"")
T = TINY.sequence_len


def _convert(argv, capsys=None):
    from scripts.convert_to_tflite import main

    rc = cli_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines() if capsys else []
    return rc, [line for line in err if line.startswith("error:")]


@pytest.fixture(scope="module")
def lite(run):
    if not HAVE_LITERT:
        pytest.skip("the export extra is not installed")
    from flaxchat.export.tflite import TFLiteModel

    pkl = run["paths"]["pkl"]
    out = os.path.dirname(pkl)
    assert _convert([f"--checkpoint={pkl}", f"--output={out}/model.tflite", "--no-verify"])[0] == 0
    assert _convert([f"--checkpoint={pkl}", "--quantize", "--no-verify"])[0] == 0  # default name beside it
    return dict(model=load_pkl(pkl), pkl=pkl, float=TFLiteModel(f"{out}/model.tflite"),
                int8=TFLiteModel(f"{out}/model_int8.tflite"), dir=out)


def _tokens(seed=0, n=T):
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, (1, n)).astype(np.int32)


@needs_litert
@pytest.mark.timeout(180)
def test_float_forward_matches_jax(lite):
    assert lite["float"].seq_len == T and lite["float"].prefill_len == T
    for seed in range(3):
        x = _tokens(seed)
        assert np.abs(lite["float"].forward(x) - logits(lite["model"], jnp.asarray(x))).max() < 1e-4


@needs_litert
@pytest.mark.timeout(180)
def test_prefill_and_kv_cache_decode_match_the_full_forward(lite):
    """Every decode step's logits equal the full forward's at that position (windows included)."""
    x = _tokens(7)
    want = logits(lite["model"], jnp.asarray(x))[0]
    n = 5
    state = lite["float"].prefill(x[0, :n].tolist())
    errors = [np.abs(state["logits"][0] - want[n - 1]).max()]
    for pos in range(n, T):  # past the 16-token window of layer 0, to the end of the cache
        state = lite["float"].decode(int(x[0, pos]), pos, state)
        errors.append(np.abs(state["logits"][0] - want[pos]).max())
    assert max(errors) < 1e-4, errors


@needs_litert
@pytest.mark.timeout(180)
def test_greedy_32_tokens_equal_flaxchat_generation(lite):
    from flaxchat.export.decode import greedy_generate
    from flaxchat.train import sample

    prompt = [5, 8, 11, 14]  # the training pattern (+3), so the continuation is confident
    got, tok_s = lite["float"].generate(prompt, 32)
    assert len(got) == 32 and tok_s > 0
    assert got == sample(lite["model"], [prompt], 32, temperature=0)[0]
    assert got == greedy_generate(lite["model"], prompt, 32)
    prompt2 = _tokens(3, 10)[0].tolist()  # a random prompt: less confident, still equal
    assert lite["float"].generate(prompt2, 32)[0] == sample(lite["model"], [prompt2], 32, temperature=0)[0]
    print(f"\nTFLite float decode: {tok_s:.0f} tokens/s")


@needs_litert
@pytest.mark.timeout(180)
def test_greedy_equals_the_engine_when_present(lite):
    engine = pytest.importorskip("flaxchat.engine", reason="flaxchat.engine is not there yet")
    prompt = [5, 8, 11, 14]
    results, _ = engine.Engine(lite["model"], tools=False).generate_batch(prompt, 1, 32, temperature=0.0, stop_tokens=())
    assert lite["float"].generate(prompt, 32)[0] == results[0]


@needs_litert
@pytest.mark.timeout(180)
def test_int8_is_smaller_and_mostly_agrees(lite):
    f, q = (os.path.getsize(f"{lite['dir']}/{n}") for n in ("model.tflite", "model_int8.tflite"))
    assert q < 0.6 * f  # ~0.5 at this tiny width (small float tensors stay); ~0.3 at depth 4
    agree = []
    for seed in range(4):
        x = _tokens(seed)
        agree.append((lite["int8"].forward(x).argmax(-1) == lite["float"].forward(x).argmax(-1)).mean())
    tokens, tok_s = lite["int8"].generate([5, 8, 11, 14], 32)
    print(f"\nint8 {q / 1e6:.2f} MB vs float {f / 1e6:.2f} MB; top-1 agreement with float "
          f"{np.mean(agree):.4f}; int8 decode {tok_s:.0f} tokens/s")
    assert np.mean(agree) > 0.8 and len(tokens) == 32


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_missing_converter_is_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "litert_converter", None)  # as if it were not installed
    out = tmp_path / "model.tflite"
    rc, err = _convert([f"--checkpoint={tmp_path / 'model.pkl'}", f"--output={out}"], capsys)
    assert rc == 2 and len(err) == 1 and 'pip install -e ".[export]"' in err[0] and "flaxchat[export]" not in err[0]
    assert not out.exists()


@pytest.mark.timeout(60)
def test_missing_interpreter_is_one_sentence(monkeypatch):
    from flaxchat.export.tflite import TFLiteModel

    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)
    with pytest.raises(UserError, match="ai-edge-litert"):
        TFLiteModel("whatever.tflite")


@needs_litert
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["foreign-pickle", "seq-too-long", "prefill-too-long", "missing"])
def test_bad_input_leaves_no_file(lite, tmp_path, capsys, case):
    import pickle

    ckpt, extra = lite["pkl"], []
    if case == "foreign-pickle":
        ckpt = str(tmp_path / "other.pkl")
        pickle.dump({"state_dict": {"w": np.zeros(3)}}, open(ckpt, "wb"))
    elif case == "seq-too-long":
        extra = [f"--seq-len={T + 1}"]
    elif case == "prefill-too-long":
        extra = ["--seq-len=32", "--prefill-len=33"]
    else:
        ckpt = str(tmp_path / "nope.pkl")
    out = tmp_path / "model.tflite"
    rc, err = _convert([f"--checkpoint={ckpt}", f"--output={out}", "--no-verify", *extra], capsys)
    assert rc == 2 and len(err) == 1, err
    assert os.listdir(tmp_path) in ([], ["other.pkl"])


@needs_litert
@pytest.mark.timeout(60)
def test_prompts_that_do_not_fit_are_refused(lite):
    with pytest.raises(UserError, match="no room"):
        lite["float"].generate(list(range(T)), 4)
    with pytest.raises(UserError, match="outside the vocabulary"):
        lite["float"].generate([1, TINY.vocab_size], 4)


@needs_litert
def test_conversion_works_after_a_training_stage_left_a_mesh_set(lite, tmp_path):
    """An export under a mesh set in the process (jax.set_mesh, as the training stages do while they
    run) must still be a plain single-device program (it failed with "Dialect `sdy' not found")."""
    from flaxchat.export.stablehlo import export_forward
    from flaxchat.export.tflite import TFLiteModel, save_tflite

    jax.set_mesh(jax.make_mesh((1,), ("data",)))
    try:
        assert "sdy.mesh" not in export_forward(lite["model"]).mlir_module()
        path, _ = save_tflite(lite["model"], str(tmp_path / "after_mesh.tflite"))
    finally:
        jax.set_mesh(None)
    tokens = _tokens(3)
    assert np.abs(TFLiteModel(path).forward(tokens) - logits(lite["model"], jnp.asarray(tokens))).max() < 1e-4


@needs_litert
@pytest.mark.timeout(180)
def test_the_docs_generate_example_runs_as_written(lite, tmp_path, monkeypatch, capsys):
    """docs/export.md's `TFLiteModel(path).generate()` example, run as written from a folder with
    `exports/model.tflite` and an exported tokenizer: it decodes the returned (tokens, tok_per_s)."""
    import re
    import shutil

    from flaxchat.tokenizer import Tokenizer
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "export.md")).read()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "model.generate(" in b)
    (tmp_path / "exports").mkdir()
    shutil.copy(os.path.join(lite["dir"], "model.tflite"), tmp_path / "exports" / "model.tflite")
    text = "Once upon a time there was a little dog named Tom. He liked to run and play in the sun. " * 40
    Tokenizer.train([text], vocab_size=TINY.vocab_size).save(tmp_path / "exports" / "tokenizer")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/export.md", "exec"), {})
    out = capsys.readouterr().out.strip()
    assert out.startswith("Once upon a time") and out.endswith("tok/s)"), out

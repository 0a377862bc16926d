"""bench.quality: flaxchat beside nanochat on one text. What can be checked without nanochat's
torch environment: the shared inputs both systems read (the same documents, the same fixed
validation rows, the same tokenizer and token byte lengths, hence the same bpb), the table's
arithmetic, and the one-sentence answers when nanochat is not where the flags say."""

import json
import math
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs the benchmarks: CI runs it; `-m "not slow"` skips it


REPO = pathlib.Path(__file__).resolve().parents[1]


def _bench(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", FLAXCHAT_NO_CPU_TUNING="1")
    return subprocess.run([sys.executable, "-m", "bench.quality", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _text(tmp_path):
    """A small corpus split by file name, with paragraphs of varied length."""
    root = tmp_path / "text"
    root.mkdir()
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while rain fell over old stone towers and quiet rivers ran".split()
    for split, n in (("train", 300), ("val", 40)):
        paras = [" ".join(rng.choice(words, rng.integers(5, 60))) + "." for _ in range(n)]
        (root / f"{split}.txt").write_text("\n\n".join(paras) + "\n")
    return root


def test_missing_nanochat_is_one_sentence_naming_the_folder(tmp_path):
    r = _bench("--text", f"t={tmp_path}", "--nanochat", str(tmp_path / "nowhere"), "--nanochat-python", sys.executable,
               "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no nanochat repository at" in r.stderr and str(tmp_path / "nowhere") in r.stderr
    assert "Traceback" not in r.stderr
    r = _bench("--text", f"t={tmp_path}", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "--nanochat DIR" in r.stderr and "--nanochat-python PATH" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing prepared before the check


def test_both_systems_get_the_same_documents_val_rows_and_token_bytes(tmp_path):
    import pyarrow.parquet as pq

    from bench import nanochat_runner, quality
    from flaxchat.data.loader import PackingLoader
    from flaxchat.data.sources import resolve_source
    from flaxchat.tokenizer import Tokenizer, texts_of

    spec = str(_text(tmp_path))
    args = types.SimpleNamespace(out=str(tmp_path / "out"), vocab=300, seq=32, device_batch_size=4, eval_tokens=256)
    root = quality.prepare("t", spec, args)
    shards = sorted((root / "nanochat" / "base_data_climbmix").glob("shard_*.parquet"))
    assert [s.name for s in shards] == ["shard_00000.parquet", "shard_00001.parquet"]  # the last one is val
    for shard, split in zip(shards, ("train", "val")):
        assert pq.read_table(shard).column("text").to_pylist() == list(texts_of(resolve_source(spec, split=split)))

    tok = Tokenizer.load(root / "tokenizer")
    rows = np.load(root / "val_rows.npz")
    assert rows["x"].shape == rows["y"].shape == (2, 4, 32)
    loader = PackingLoader(resolve_source(spec, split="val"), tok, 4, 32, process_index=0, process_count=1)
    for i in range(2):  # what flaxchat's own evaluation reads
        x, y = loader.next_batch()
        assert (rows["x"][i] == x).all() and (rows["y"][i] == y).all()

    # nanochat's tokenizer, built by its runner from flaxchat's file: same ids, same byte lengths.
    enc = nanochat_runner.encoding_from_flaxchat(str(root / "tokenizer" / "tokenizer.json"))
    sample = "the cat sat on a mat, while rain fell over old stone towers 123"
    assert enc.encode_ordinary(sample) == tok.encode(sample)
    assert enc.n_vocab == tok.vocab_size and enc.encode_single_token("<|bos|>") == tok.bos_token_id
    assert nanochat_runner.token_byte_lengths(enc) == tok.token_bytes().tolist()

    stamp = json.loads((root / "prepared.json").read_text())
    assert stamp["val"]["docs"] == 40 and stamp["train"]["docs"] == 300
    before = (root / "val_rows.npz").stat().st_mtime_ns
    quality.prepare("t", spec, args)  # prepared once: the same inputs are not rewritten
    assert (root / "val_rows.npz").stat().st_mtime_ns == before


def test_the_table_gives_means_and_the_difference_with_its_standard_error():
    from bench.quality import table

    runs = {"nanochat": [{"seed": 0, "val_bpb": {"0": 9.0, "200": 2.0, "400": 1.5}},
                         {"seed": 1, "val_bpb": {"0": 9.0, "200": 2.2, "400": 1.7}}],
            "flaxchat x": [{"seed": 0, "val_bpb": {"0": 9.0, "200": 1.9, "400": 1.6}},
                           {"seed": 1, "val_bpb": {"0": 9.0, "200": 2.3, "400": 1.4}}]}
    text = table("t", runs)
    assert text.splitlines()[0] == "| t | seed | 200 | 400 |"  # step 0 (the untrained model) is left out
    assert "| nanochat | mean ± sd | 2.1000 ± 0.1414 | 1.6000 ± 0.1414 |" in text
    se200, se400 = math.sqrt(0.1414214 ** 2 / 2 + 0.2828427 ** 2 / 2), math.sqrt(2 * 0.1414214 ** 2 / 2)
    diff = [line for line in text.splitlines() if line.startswith("| flaxchat x - nanochat")]
    assert diff == [f"| flaxchat x - nanochat | | +0.0000 ± {se200:.4f} | -0.1000 ± {se400:.4f} |"]


@pytest.mark.parametrize("bad, says", [("--seeds=a", "--seeds takes"), ("--systems=torch", "--systems takes"),
                                       ("--eval-tokens=1000", "not a multiple")])
def test_bad_flags_are_one_sentence(tmp_path, bad, says):
    r = _bench("--text", f"t={tmp_path}", "--systems=flaxchat", bad, "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr

"""Data: built-in stories, file and hub sources, and the packing loader."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flaxchat.data import sources
from flaxchat.data.loader import PackingLoader, cut_document, cut_chars
from flaxchat.data.sources import held_out_count, parse_hub_spec, resolve_source, select_hub_files
from flaxchat.data.stories import StoriesCorpus, story
from flaxchat.errors import UserError
from flaxchat.tokenizer import Tokenizer

# --- stories ------------------------------------------------------------------------------------


def test_stories_deterministic_across_processes():
    mine = [story(0, i) for i in (0, 7, 12345)]
    code = "from flaxchat.data.stories import story; import json; print(json.dumps([story(0, i) for i in (0, 7, 12345)]))"
    # A different hash seed: the text must not depend on Python's salted hash().
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "", "PYTHONPATH": "."})
    assert json.loads(out.stdout) == mine
    assert story(0, 7) == StoriesCorpus(seed=0).doc(7) != story(1, 7)


def test_stories_varied_and_sized():
    docs = [story(0, i) for i in range(1000)]
    assert len(set(docs)) == 1000
    words = [len(d.split()) for d in docs]
    assert 100 <= min(words) and max(words) <= 300
    firsts = {re.split(r"(?<=[.!?])\s", d)[0] for d in docs}
    assert len(firsts) > 600
    grams = collections.Counter()
    for d in docs:
        w = d.split()
        grams.update(tuple(w[j:j + 5]) for j in range(len(w) - 4))
    assert len(grams) / sum(grams.values()) > 0.2  # distinct 5-grams / all 5-grams
    assert "\n\n" not in "".join(docs)  # one document even when dumped to a .txt file


def test_stories_train_val_disjoint_and_protocol():
    train, val = StoriesCorpus(seed=0, num_docs=300), StoriesCorpus(seed=0, num_docs=300, split="val")
    assert not {train.doc(i) for i in range(300)} & {val.doc(i) for i in range(300)}
    assert len(train) == 300 and "stories" in train.name
    assert [i for i, _ in train.iter_docs(2, 100)] == [2, 102, 202]
    with pytest.raises(IndexError):
        train.doc(300)
    assert isinstance(train, sources.Source)


def test_resolve_stories():
    assert isinstance(resolve_source(None), StoriesCorpus)
    val = resolve_source("stories", "val", seed=3)
    assert val.split == "val" and val.seed == 3
    with pytest.raises(UserError, match="unknown split"):
        resolve_source("stories", "holdout")


# --- files ----------------------------------------------------------------------------------------


def _write_corpus(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.txt").write_text("Doc one line1\nline2\n\n\n\nDoc two\n  \nDoc three é😀\n")
    (d / "b.jsonl").write_text(json.dumps({"text": "json one"}) + "\n\n" + json.dumps({"text": "json two"}) + "\n")
    pq.write_table(pa.table({"text": [f"pq {i}" for i in range(10)], "n": list(range(10))}), d / "c.parquet",
                   row_group_size=3)
    (d / "notes.md").write_text("ignored")
    return ["Doc one line1\nline2", "Doc two", "Doc three é😀", "json one", "json two"] + [f"pq {i}" for i in range(10)]


def test_directory_and_splits(tmp_path):
    expected = _write_corpus(tmp_path / "d")
    train, val = resolve_source(str(tmp_path / "d")), resolve_source(str(tmp_path / "d"), "val")
    assert held_out_count(15) == 1
    assert [t for _, t in train.iter_docs()] == expected[:-1]
    assert [t for _, t in val.iter_docs()] == expected[-1:]
    assert train.doc(3) == "json one" and len(train) == 14
    assert "3 jsonl/parquet/txt files" in train.name
    # Sharding: disjoint and covering.
    shards = [list(train.iter_docs(p, 3)) for p in range(3)]
    assert sorted(i for s in shards for i, _ in s) == list(range(14))


def test_glob_single_files_and_fields(tmp_path):
    _write_corpus(tmp_path)
    pq_train = resolve_source(str(tmp_path / "*.parquet"))
    assert [t for _, t in pq_train.iter_docs()] == [f"pq {i}" for i in range(9)]
    assert pq_train.doc(7) == "pq 7" and pq_train.doc(2) == "pq 2"  # across row groups, any order
    assert resolve_source(str(tmp_path / "c.parquet"), "val", field="n").doc(0) == "9"
    with pytest.raises(UserError, match="no column 'body'"):
        len(resolve_source(str(tmp_path / "c.parquet"), field="body"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n[1]\n')
    bad = resolve_source(str(tmp_path / "bad.jsonl"))
    assert bad.doc(0) == "ok"
    with pytest.raises(UserError, match="line 2 of .*bad.jsonl"):
        bad.doc(1)


def test_txt_endoftext_separators(tmp_path):
    (tmp_path / "TinyStories-train.txt").write_text("Story A\n\npara 2\n<|endoftext|>\nStory B\n<|endoftext|>\n\nStory C")
    (tmp_path / "TinyStories-valid.txt").write_text("Val story\n<|endoftext|>\n")
    train = resolve_source(str(tmp_path))
    assert [t for _, t in train.iter_docs()] == ["Story A\n\npara 2", "Story B", "Story C"]
    assert [t for _, t in resolve_source(str(tmp_path), "validation").iter_docs()] == ["Val story"]


def test_split_named_files_like_a_hub_dataset(tmp_path):
    data = tmp_path / "training_runs" / "data"  # "training" above the files must not count
    data.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["t0", "t1", "t2"]}), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["v0"]}), data / "validation-00000-of-00001.parquet")
    assert [t for _, t in resolve_source(str(data)).iter_docs()] == ["t0", "t1", "t2"]
    assert [t for _, t in resolve_source(str(data), "val").iter_docs()] == ["v0"]
    only_train = resolve_source(str(data / "train-*.parquet"))  # a single split: hold out documents
    assert len(only_train) == 2


@pytest.mark.parametrize("make, spec, match", [
    (None, "missing", "data path '.*missing' does not exist"),
    (None, "*.csv", "no .txt/.jsonl/.parquet files match"),
    ("empty_dir", "empty_dir", "no .txt/.jsonl/.parquet files match"),
    ("blank.txt", "blank.txt", "the corpus at .*blank.txt is empty"),
    ("one.txt", "one.txt", "has 1 document"),
    ("x.csv", "x.csv", "is not a .txt, .jsonl or .parquet file"),
])
def test_file_errors(tmp_path, make, spec, match):
    if make == "empty_dir":
        (tmp_path / make).mkdir()
    elif make:
        (tmp_path / make).write_text("\n \n" if make == "blank.txt" else "just one")
    with pytest.raises(UserError, match=match):
        len(resolve_source(str(tmp_path / spec)))


# --- hub ------------------------------------------------------------------------------------------


def test_hub_spec_parsing_and_file_choice():
    assert parse_hub_spec("hf:roneneldan/TinyStories")["repo"] == "roneneldan/TinyStories"
    spec = parse_hub_spec("hf://datasets/karpathy/fineweb-edu-100b-shuffle/shard_0000*.parquet?files=2&field=content")
    assert spec == {"repo": "karpathy/fineweb-edu-100b-shuffle", "pattern": "shard_0000*.parquet",
                    "max_files": 2, "field": "content", "revision": None}
    for bad in ("hf:onlyname", "hf:a/b?shards=3", "hf:a/b?files=x"):
        with pytest.raises(UserError):
            parse_hub_spec(bad)
    listing = ["README.md", "default/train/0000.parquet", "default/train/0001.parquet",
               "default/validation/0000.parquet", "extra.txt"]
    train = ["default/train/0000.parquet", "default/train/0001.parquet"]
    assert select_hub_files(listing, "train", None, None) == (train, True)
    assert select_hub_files(listing, "val", None, None) == (["default/validation/0000.parquet"], True)
    shards = [f"shard_{i:05d}.parquet" for i in range(5)]
    assert select_hub_files(shards, "train", "shard_*.parquet", 2) == (shards[:2], False)  # held out later
    tiny = ["TinyStories-train.txt", "TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt"]
    assert select_hub_files(tiny, "val", "TinyStoriesV2-*", None) == (["TinyStoriesV2-GPT4-valid.txt"], True)


def test_hub_without_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(UserError, match="needs the huggingface_hub package.*built-in stories"):
        resolve_source("hf:roneneldan/TinyStories")


def test_hub_offline_reads_the_local_cache(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "datasets--me--tiny" / "snapshots" / "abc123"
    (snap / "data").mkdir(parents=True)
    (cache / "datasets--me--tiny" / "refs").mkdir()
    (cache / "datasets--me--tiny" / "refs" / "main").write_text("abc123")
    pq.write_table(pa.table({"text": ["t0", "t1"]}), snap / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["v0"]}), snap / "data" / "validation-00000-of-00001.parquet")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert hub is not None
    assert [t for _, t in resolve_source("hf:me/tiny").iter_docs()] == ["t0", "t1"]
    assert [t for _, t in resolve_source("hf://datasets/me/tiny", "val").iter_docs()] == ["v0"]
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set and 'me/other' is not in the local hub cache"):
        resolve_source("hf:me/other")
    # Online mode with no network: the fast probe fails, and the message says so.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "_hub_reachable", lambda endpoint: False)
    with pytest.raises(UserError, match="cannot be reached.*offline default"):
        resolve_source("hf:me/other")


def test_hub_online_path_with_a_fake_hub(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    files = {"default/train/0000.parquet": ["a", "b"], "default/validation/0000.parquet": ["c"]}
    for name, rows in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": rows}), tmp_path / name)
    calls = []

    def list_repo_files(repo, repo_type=None, revision=None):
        calls.append(revision)
        return ["README.md", "raw.tar.gz"] if revision is None else list(files)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "_hub_reachable", lambda endpoint: True)
    monkeypatch.setattr(hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(hub, "hf_hub_download", lambda repo, name, **kw: str(tmp_path / name))
    # No data files on main: falls back to the hub's automatic parquet conversion branch.
    assert [t for _, t in resolve_source("hf:me/tiny").iter_docs()] == ["a", "b"]
    assert calls == [None, "refs/convert/parquet"]

    def broken(*args, **kwargs):
        raise ConnectionError("connection reset")

    monkeypatch.setattr(hub, "list_repo_files", broken)
    with pytest.raises(UserError, match="cannot read hub dataset 'me/tiny' .ConnectionError"):
        resolve_source("hf:me/tiny")


# --- packing loader ---------------------------------------------------------------------------------

BOS = 0


class FakeTokenizer:
    """Document 'i:n' -> [BOS] + [i + 1] * n, so every token says which document it came from."""

    bos_token_id = BOS

    def encode(self, texts, prepend=None, num_threads=1):
        out = []
        for text in texts:
            i, n = map(int, text.split(":"))
            out.append(([prepend] if prepend is not None else []) + [i + 1] * n)
        return out


class ListSource:
    def __init__(self, lengths):
        self.docs = [f"{i}:{n}" for i, n in enumerate(lengths)]
        self.name = f"{len(lengths)} test docs"

    def __len__(self):
        return len(self.docs)

    def doc(self, i):
        return self.docs[i]

    def iter_docs(self, start=0, step=1):
        for i in range(start, len(self.docs), step):
            yield i, self.docs[i]


def _segments(rows):
    """Split each row at BOS into (document index or None, length, ends the row) triples."""
    out = []
    for row in rows:
        starts = list(np.flatnonzero(row == BOS)) + [len(row)]
        assert starts[0] == 0
        for a, b in zip(starts[:-1], starts[1:]):
            seg = row[a:b]
            assert len(set(seg[1:].tolist())) <= 1
            out.append((int(seg[1]) - 1 if len(seg) > 1 else None, len(seg), b == len(row)))
    return out


def test_packing_accounts_for_every_token():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=400).tolist()
    src = ListSource(lengths)
    loader = PackingLoader(src, FakeTokenizer(), batch_size=4, seq_len=63, buffer_docs=50, tokenize_batch=16)
    batches = [loader.next_batch() for _ in range(10)]
    for x, y in batches:
        assert x.shape == y.shape == (4, 63) and x.dtype == y.dtype == np.int32
        assert (x[:, 0] == BOS).all()
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    rows = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in batches])
    segs = _segments(rows)
    state = loader.state_dict()
    read = list(range(loader.stats()["docs_read"]))
    consumed = collections.Counter(read) - collections.Counter(state["buffer"])
    seen = collections.Counter(d for d, _, _ in segs if d is not None)
    assert all(seen[d] == 1 for d in seen) and set(seen) <= set(consumed)
    cropped = 0
    for d, n, at_end in segs:
        full = lengths[d] + 1 if d is not None else None
        if d is None or n < full:
            assert at_end  # only the last document of a row may be cut
        if d is not None:
            assert n <= full
            cropped += full - n
    # Consumed documents never identified were cropped to their BOS alone (a 1-token segment).
    missing = [d for d in consumed if d not in seen]
    assert len(missing) == sum(1 for d, _, _ in segs if d is None)
    cropped += sum(lengths[d] for d in missing)
    assert cropped == loader.stats()["tokens_cropped"]
    assert rows.size == loader.stats()["tokens_out"]


def test_packing_best_fit_and_crop():
    src = ListSource([3, 5, 9])  # documents of 4, 6 and 10 tokens; rows hold 10
    loader = PackingLoader(src, FakeTokenizer(), batch_size=1, seq_len=9, buffer_docs=2, tokenize_batch=3)
    x, y = loader.next_batch()
    assert np.concatenate([x[0], y[0, -1:]]).tolist() == [BOS] + [3] * 9  # the largest that fits
    x, y = loader.next_batch()
    assert np.concatenate([x[0], y[0, -1:]]).tolist() == [BOS] + [2] * 5 + [BOS] + [1] * 3  # 6 + 4, exact
    assert loader.stats()["tokens_cropped"] == 0
    long = PackingLoader(ListSource([20, 25]), FakeTokenizer(), batch_size=1, seq_len=9, buffer_docs=2)
    x, _ = long.next_batch()
    assert x[0].tolist() == [BOS] + [1] * 8  # none fits: the shortest is cropped, the rest dropped
    assert long.stats()["tokens_cropped"] == 21 - 10 and long.stats()["docs_cropped"] == 1


def test_sharding_disjoint_and_covering():
    src = ListSource([5] * 30)
    seen = []
    for p in range(2):
        loader = PackingLoader(src, FakeTokenizer(), batch_size=2, seq_len=11, process_index=p, process_count=2,
                               buffer_docs=4, tokenize_batch=4)
        rows = [loader.next_batch()[0] for _ in range(10)]
        docs = {d for r in rows for d, _, _ in _segments(r) if d is not None}
        assert all(d % 2 == p for d in docs)
        assert loader.epoch >= 1
        seen.append(docs)
    assert seen[0] | seen[1] == set(range(30))
    with pytest.raises(UserError, match="fewer than the"):
        PackingLoader(ListSource([3]), FakeTokenizer(), 1, 4, process_index=1, process_count=2)


def _resume_check(make, k, m):
    a = make(None)
    for _ in range(k):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch() for _ in range(m)]
    b = make(state)
    for x, y in expected:
        bx, by = b.next_batch()
        np.testing.assert_array_equal(bx, x)
        np.testing.assert_array_equal(by, y)
    return state


def test_exact_resume_across_epochs():
    src = ListSource(np.random.default_rng(1).integers(1, 40, size=37).tolist())
    for k in (0, 1, 5, 13):  # 13 batches wraps the 37-document source several times
        _resume_check(lambda s: PackingLoader(src, FakeTokenizer(), 3, 31, process_index=1, process_count=2,
                                              buffer_docs=7, tokenize_batch=5, state=s), k, 6)


@pytest.fixture(scope="module")
def small_tok():
    return Tokenizer.train((StoriesCorpus(seed=0).doc(i) for i in range(400)), 300)


def test_loader_on_stories_resume_and_state_size(small_tok):
    src = StoriesCorpus(seed=0)
    state = _resume_check(lambda s: PackingLoader(src, small_tok, 2, 128, buffer_docs=64, state=s), 3, 3)
    assert state["source"] == src.name
    big = PackingLoader(src, small_tok, 1, 64, buffer_docs=5000, tokenize_batch=512)
    big.next_batch()
    assert len(big.state_dict()["buffer"]) >= 5000 and len(json.dumps(big.state_dict())) < 100_000
    with pytest.raises(UserError, match="process 0 of 1, not 0 of 2"):
        PackingLoader(src, small_tok, 1, 64, process_count=2, state=state)


def test_loader_rows_decode_to_story_text(small_tok):
    src = StoriesCorpus(seed=0)
    loader = PackingLoader(src, small_tok, 2, 256, buffer_docs=16)
    x, _ = loader.next_batch()
    texts = [src.doc(i) for i in range(loader.stats()["docs_read"])]
    for row in x:
        assert row[0] == small_tok.bos_token_id
        pieces = small_tok.decode(row.tolist()).split("<|bos|>")[1:]
        for piece in pieces[:-1]:  # whole documents
            assert piece in texts
        assert any(t.startswith(pieces[-1]) for t in texts)  # the last one may be cropped


# --- memory bounded by the rows, whatever the corpus's shape ------------------------------------------

_BOUNDED_CHECK = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a runaway loader fails here, not the machine
import numpy as np
from flaxchat.data.loader import PackingLoader
from flaxchat.data.sources import FileCorpus
from flaxchat.tokenizer import Tokenizer
def peak_mb():  # this process image's own peak (ru_maxrss can carry the forking parent's)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
tok, corpus = Tokenizer.load(sys.argv[1]), FileCorpus([sys.argv[2]])
make = lambda state=None: PackingLoader(corpus, tok, batch_size=4, seq_len=256, state=state)
loader = make()
first = loader.next_batch()[0]
loader.next_batch()
state = json.loads(json.dumps(loader.state_dict()))
expected = loader.next_batch()
again = make(state).next_batch()
print(json.dumps({"first": first.tolist(), "resumed": all(np.array_equal(a, b) for a, b in zip(expected, again)),
                  "peak_mb": peak_mb()}))
"""


def _bounded_run(small_tok, tmp_path, docs: list[str]) -> dict:
    small_tok.save(tmp_path / "tok")
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs))
    out = subprocess.run([sys.executable, "-c", _BOUNDED_CHECK, str(tmp_path / "tok"), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_loader_memory_bounded_on_huge_documents(small_tok, tmp_path):
    # Two documents of 20 MB and one small one: the old loader read and tokenized both whole for
    # each of the ~330 copies its 1000-document buffer wrapped around to, past the 3 GB cap.
    huge = ["\n".join(story(0, d * 1000 + i) for i in range(1000)) * 25 for d in range(2)]
    assert min(len(h) for h in huge) > 20_000_000
    result = _bounded_run(small_tok, tmp_path, huge + [story(0, 99_999)])
    assert result["resumed"] and result["peak_mb"] < 600


def test_loader_memory_bounded_on_a_tiny_corpus(small_tok, tmp_path):
    # Three documents of 300 KB: the old loader filled its buffer with ~330 tokenized copies of each.
    docs = ["\n".join(story(0, d * 1000 + i) for i in range(400)) for d in range(3)]
    assert min(len(d) for d in docs) > 300_000
    result = _bounded_run(small_tok, tmp_path, docs)
    assert result["resumed"] and result["peak_mb"] < 300
    texts = [small_tok.decode(row).split("<|bos|>")[1] for row in result["first"]]
    assert all(any(d.startswith(t) for d in docs) for t in texts)


def test_cut_document_keeps_the_tokens_of_the_whole_text(small_tok):
    # The loader tokenizes a long document only up to a gap between words; what it keeps must be the
    # whole text's own tokens, on prose, numbers, punctuation runs and non-Latin script alike.
    rng = np.random.default_rng(0)
    words = ["the", "cat's", "12345", "3.14", "--", "?!", "naïve", "東京", "x\ny", "'ll", "(a)", "\t"]
    text = " ".join(rng.choice(words, size=40_000).tolist())
    for capacity in (65, 257, 2049):
        cut = cut_document(text, capacity)
        assert len(cut) <= cut_chars(capacity) and len(cut) > cut_chars(capacity) - 4096
        tokens = small_tok.encode(cut)
        assert len(tokens) > capacity and small_tok.encode(text)[:len(tokens)] == tokens


# --- the repetition estimate on every format ---------------------------------------------------------


def test_repetition_estimate_on_a_streamed_parquet_corpus(small_tok, tmp_path):
    # A parquet text is always streamed, and the estimate used to be None for it, so `--lr-batch-scaling
    # auto` left the rule off on a text read ~4 times (val bpb 2.55 at step 400, 2.82 at 600).
    from flaxchat.recipe import REPEAT_PASSES, batch_scaling_applies, estimated_passes
    docs = [story(0, i) for i in range(600)]
    for f in range(3):
        pq.write_table(pa.table({"text": docs[f * 200:(f + 1) * 200]}), tmp_path / f"part{f}.parquet",
                       row_group_size=17)
    (tmp_path / "same.txt").write_text("\n\n".join(docs) + "\n")
    streamed = resolve_source(str(tmp_path / "*.parquet"))
    indexed = resolve_source(str(tmp_path / "same.txt"))
    assert not hasattr(indexed, "iter_reader") and hasattr(streamed, "iter_reader") and len(streamed) == len(indexed)
    exact = sum(min(len(small_tok.encode(indexed.doc(i))) + 1, 257) for i in range(len(indexed)))
    passes = estimated_passes(streamed, small_tok, 4 * exact, 256)
    assert passes == pytest.approx(4.0, rel=0.1)
    assert estimated_passes(indexed, small_tok, 4 * exact, 256) == pytest.approx(4.0, rel=0.1)
    assert batch_scaling_applies("auto", 2048, passes) and passes >= REPEAT_PASSES


def test_repetition_estimate_reads_a_row_of_each_huge_document(small_tok, tmp_path):
    from flaxchat.recipe import estimated_passes
    huge = "\n".join(story(0, i) for i in range(1000)) * 10  # 8 MB: counted as one row of 257
    pq.write_table(pa.table({"text": [huge, huge, story(0, 5), story(0, 6)]}), tmp_path / "h.parquet", row_group_size=1)
    src = resolve_source(str(tmp_path / "h.parquet"), split="train")
    assert estimated_passes(src, small_tok, len(src) * 257, 256) == pytest.approx(1.0, rel=0.01)

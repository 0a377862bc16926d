"""Streaming parquet shards, resharding of loader states, and the prefetcher."""

from __future__ import annotations

import collections
import json
import re
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from flaxchat import paths
from flaxchat.data import shards
from flaxchat.data.loader import LoaderGroup, PackingLoader, reshard_states
from flaxchat.data.prefetch import Prefetcher
from flaxchat.data.shards import ParquetShards, list_shards
from flaxchat.data.sources import FileCorpus, resolve_source
from flaxchat.errors import UserError

BOS = 0


class FakeTokenizer:
    """Document 'i:n' -> [BOS] + [i + 1] * n."""

    bos_token_id = BOS

    def encode(self, texts, prepend=None, num_threads=1):
        return [[prepend] + [int(t.split(":")[0]) + 1] * int(t.split(":")[1]) for t in texts]


class Tracking(PackingLoader):
    """A loader that records (document, epoch it was read in) for every document it packs into a
    row; exact with tokenize_batch=1, where each read is one document."""

    def __init__(self, *args, **kwargs):
        self.taken, self.read_epoch = [], {}
        super().__init__(*args, **kwargs)

    def _add(self, items):
        first = self._order
        super()._add(items)
        self.read_epoch.update((order, self.epoch) for order in range(first, self._order))

    def _take(self, j):
        order = -self._keys[j][1]
        self.taken.append((self._docs[order][0], self.read_epoch[order]))
        return super()._take(j)

    def pending(self, epoch):
        return [i for order, (i, _) in self._docs.items() if self.read_epoch[order] == epoch]


def write_shards(folder, n_docs=300, files=3, row_group=17, seed=0, write=pq.write_table):
    """`files` parquet files of documents 'i:n' (i = global document number), small row groups."""
    lengths = np.random.default_rng(seed).integers(1, 40, size=n_docs).tolist()
    docs = [f"{i}:{n}" for i, n in enumerate(lengths)]
    bounds = np.linspace(0, n_docs, files + 1).astype(int)
    for f in range(files):
        rows = docs[bounds[f]:bounds[f + 1]]
        write(pa.table({"text": rows, "n": list(range(len(rows)))}), f"{folder}/part-{f:05d}.parquet",
              row_group_size=row_group)
    return docs


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "shards"
    (d / "sub").mkdir(parents=True)
    docs = write_shards(d)
    (d / "README.md").write_text("not data")
    return d, docs


# --- the shard reader -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_shards_are_a_source_like_file_corpus(folder):
    d, docs = folder
    files = list_shards(str(d))
    assert [f.rsplit("/", 1)[1] for f in files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    src, ref = ParquetShards(files), FileCorpus(files)
    assert len(src) == len(ref) == 300 and src.num_units == 3 * 6  # 100 rows / 17 -> 6 groups per file
    assert [t for _, t in src.iter_docs()] == docs
    assert list(src.iter_docs(5, 7)) == list(ref.iter_docs(5, 7))
    assert src.doc(299) == docs[299] and src.doc(17) == docs[17]
    assert src.doc_batch([250, 3, 120, 4]) == [docs[i] for i in (250, 3, 120, 4)]
    assert src.unit_of(0) == 0 and src.unit_of(17) == 1 and src.unit_of(100) == 6
    part = src.slice(95, 105, "middle")
    assert len(part) == 10 and [t for _, t in part.iter_docs()] == docs[95:105]
    assert [u.rows for u in part.units] == [5, 5] and part.unit_of(4) == 0 and part.unit_of(5) == 1
    with pytest.raises(IndexError):
        src.doc(300)


@pytest.mark.timeout(30)
def test_resolve_streams_parquet_folders_with_the_same_split(folder):
    d, docs = folder
    train, val = resolve_source(str(d)), resolve_source(str(d), "val")
    assert isinstance(train, ParquetShards) and isinstance(val, ParquetShards)
    assert [t for _, t in train.iter_docs()] == docs[:297] and [t for _, t in val.iter_docs()] == docs[297:]
    assert "train: first 297 of 300" in train.name
    # The split cuts file 2's last group (rows 285..299): 12 rows train, 3 rows val.
    assert train.units[-1] == shards.Unit(2, 5, 0, 12, 285) and val.units == [shards.Unit(2, 5, 12, 15, 0)]
    (d / "mixed.jsonl").write_text('{"text": "x"}\n')  # not parquet-only: the indexed reader
    assert not isinstance(resolve_source(str(d)), ParquetShards)


@pytest.mark.timeout(30)
def test_readers_take_disjoint_row_groups_one_at_a_time(folder, monkeypatch):
    d, docs = folder
    src = ParquetShards(list_shards(str(d)))
    read = []
    real = ParquetShards._read
    monkeypatch.setattr(ParquetShards, "_read", lambda self, u: read.append(u) or real(self, u))
    for readers in (1, 4, 5):
        seen = []
        for r in range(readers):
            read.clear()
            mine = [i for i, _, _ in src.iter_reader(r, readers)]
            assert read == list(range(r, src.num_units, readers))  # its own groups, each once, in order
            assert {src.unit_of(i) % readers for i in mine} == {r}
            seen += mine
        assert sorted(seen) == list(range(300))
    # Positions: resuming an iterator at the position after any document continues it exactly.
    items = list(src.iter_reader(1, 4))
    for k in (0, 5, 16, 17, len(items) - 1):
        assert list(src.iter_reader(1, 4, *items[k][2])) == items[k + 1:]
    assert items[16][2] == (5, 0)  # the end of a group points at the reader's next group


def _make(src, R, state=None, cls=PackingLoader, r=0, tokenize_batch=4):
    return cls(src, FakeTokenizer(), 2, 23, process_index=r, process_count=R, buffer_docs=9,
               tokenize_batch=tokenize_batch, state=state)


@pytest.mark.timeout(30)
def test_streaming_loader_resumes_exactly_across_epochs(folder):
    d, _ = folder
    src = ParquetShards(list_shards(str(d)))
    for k in (0, 1, 6, 80):  # 80 batches wraps reader 1's 75-document share several times
        a = _make(src, 4, r=1)
        for _ in range(k):
            a.next_batch()
        state = json.loads(json.dumps(a.state_dict()))
        assert state["kind"] == "stream" and len(state["cursor"]) == 2 and (k < 80 or state["epoch"] >= 2)
        b = _make(src, 4, state, r=1)
        for _ in range(5):
            for x, y in zip(a.next_batch(), b.next_batch()):
                np.testing.assert_array_equal(x, y)
    with pytest.raises(UserError, match="saved by the stream reader"):
        _make(FileCorpus(list_shards(str(d))), 4, state, r=1)
    with pytest.raises(UserError, match="18 parquet row groups, fewer than the 20 readers"):
        _make(src, 20, r=19)


def _reshard_run(src, old, new, steps):
    """Run `old` readers for `steps` batches, reshard to `new`, run those past the end of the
    epoch; return the documents of epoch 0 packed before and after the change, those still
    waiting in the new buffers, and the new states."""
    readers = [_make(src, old, cls=Tracking, r=r, tokenize_batch=1) for r in range(old)]
    for _ in range(steps):
        for ld in readers:
            ld.next_batch()
    assert all(e == 0 for ld in readers for _, e in ld.taken)
    before = [i for ld in readers for i, _ in ld.taken]
    states = reshard_states(json.loads(json.dumps([ld.state_dict() for ld in readers])), new, src)
    assert [(s["process_index"], s["process_count"]) for s in states] == [(r, new) for r in range(new)]
    after, pending = [], []
    for r in range(new):
        ld = _make(src, new, states[r], cls=Tracking, r=r, tokenize_batch=1)
        while ld.epoch == 0:
            ld.next_batch()
        after += [i for i, e in ld.taken if e == 0]
        pending += ld.pending(0)
    return before, after, pending, states


@pytest.mark.timeout(30)
@pytest.mark.parametrize("old, new", [(4, 2), (4, 3), (3, 8), (5, 5)])
def test_reshard_skips_no_document(folder, old, new):
    d, _ = folder
    src = ParquetShards(list_shards(str(d)))
    before, after, pending, states = _reshard_run(src, old, new, steps=4)
    # Packed before the change, packed after it, or still waiting in a buffer at the epoch's end.
    assert set(before) | set(after) | set(pending) == set(range(len(src)))
    assert collections.Counter(after + pending).most_common(1)[0][1] == 1  # none twice within the new run
    twice = collections.Counter(before) & collections.Counter(after)
    if old == new:
        assert not twice  # same count: the states are used as they are, an exact resume
    else:
        # Seen twice: at most the groups between the frontier and the furthest old reader.
        frontier = min(s["cursor"][0] for s in states)  # one new reader starts right at the frontier
        assert all(src.unit_of(i) >= frontier for i in twice)
        assert len(twice) <= 2 * old * 17, len(twice)


@pytest.mark.timeout(30)
def test_reshard_indexed_source_and_bad_states(folder):
    d, _ = folder
    src = FileCorpus(list_shards(str(d)))  # indexed: readers stride over documents
    before, after, pending, states = _reshard_run(src, 3, 2, steps=3)
    assert set(before) | set(after) | set(pending) == set(range(len(src)))
    assert states[0]["kind"] == "index" and isinstance(states[0]["cursor"], int)
    with pytest.raises(UserError, match="not readers 0..1 of 2"):
        reshard_states([states[1], states[0]], 3)
    with pytest.raises(UserError, match="do not belong to one run"):
        reshard_states([states[0], {**states[1], "source": "other"}], 3)


class _ListSource:
    def __init__(self, n):
        self.name, self.texts = f"{n} docs", [f"{i}:{1 + i % 9}" for i in range(n)]

    def __len__(self):
        return len(self.texts)

    def doc(self, i):
        return self.texts[i]

    def iter_docs(self, start=0, step=1):
        for i in range(start, len(self.texts), step):
            yield i, self.texts[i]


@pytest.mark.timeout(30)
def test_loader_group_stacks_shards():
    group_src = _ListSource(40)
    loaders = [PackingLoader(group_src, FakeTokenizer(), 2, 7, process_index=r, process_count=2) for r in range(2)]
    group = LoaderGroup(loaders, grad_accum=3)
    x, y = group.next_batch()
    assert x.shape == y.shape == (3, 4, 7)
    ref = [PackingLoader(group_src, FakeTokenizer(), 2, 7, process_index=r, process_count=2) for r in range(2)]
    for m in range(3):
        np.testing.assert_array_equal(x[m], np.concatenate([ref[0].next_batch()[0], ref[1].next_batch()[0]]))
    assert [s["process_index"] for s in group.state_dict()] == [0, 1]


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_empty_and_missing_shard_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("text, not shards")
    for name in ("empty", "notes", "empty/*.parquet"):
        with pytest.raises(UserError, match=f"no parquet shards in .*{re.escape(name)}"):
            list_shards(str(tmp_path / name))
    with pytest.raises(UserError, match="does not exist"):
        list_shards(str(tmp_path / "nope"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="cannot read .*bad.parquet as parquet"):
        len(ParquetShards([str(tmp_path / "bad.parquet")]))
    write_shards(tmp_path / "empty", n_docs=10, files=1)
    with pytest.raises(UserError, match="no column 'body'"):
        len(ParquetShards(list_shards(str(tmp_path / "empty")), field="body"))


@pytest.mark.timeout(30)
def test_gs_path_without_gcsfs_is_one_sentence(monkeypatch):
    monkeypatch.setattr(paths, "_filesystems", {})
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed, even where it is
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"needs an extra package \(pip install gcsfs\) and Google Cloud credentials"):
        resolve_source("gs://my-bucket/fineweb/")
    assert time.perf_counter() - t0 < 10


# --- gs:// through a stand-in filesystem ----------------------------------------------------------------


class FakeGCS(MemoryFileSystem):
    """An in-memory object store registered as gs:// (its own store, not the memory fs's)."""

    store: dict = {}
    pseudo_dirs = [""]
    protocol = ("gs",)
    cachable = False


@pytest.fixture
def fake_gcs(monkeypatch):
    registry = sys.modules["fsspec.registry"]
    monkeypatch.setitem(registry._registry, "gs", FakeGCS)
    monkeypatch.setattr(paths, "_filesystems", {})
    monkeypatch.setattr(FakeGCS, "store", {})
    return FakeGCS()


@pytest.mark.timeout(30)
def test_streaming_from_gs_paths(fake_gcs, tmp_path):
    def write(table, path, row_group_size):
        with paths.open_file(path, "wb") as f:
            pq.write_table(table, f, row_group_size=row_group_size)

    docs = write_shards("gs://bucket/data/fineweb", n_docs=120, files=2, row_group=25, write=write)
    assert paths.listdir("gs://bucket/data", recursive=True)[0] == "gs://bucket/data/fineweb/part-00000.parquet"
    src = resolve_source("gs://bucket/data/fineweb")
    assert isinstance(src, ParquetShards) and "2 parquet files matching gs://bucket/data/fineweb" in src.name
    assert [t for _, t in src.iter_docs()] == docs[:len(src)]
    assert resolve_source("gs://bucket/data/*/part-0000[1].parquet").files == ["gs://bucket/data/fineweb/part-00001.parquet"]
    a = _make(src, 2, r=1)
    for _ in range(3):
        a.next_batch()
    b = _make(src, 2, a.state_dict(), r=1)
    np.testing.assert_array_equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(UserError, match="no parquet shards in gs://bucket/nothing-here"):
        resolve_source("gs://bucket/nothing-here")


# --- prefetch ---------------------------------------------------------------------------------------------


class CountingLoader:
    """next_batch() returns its call number; the state is the number of batches produced."""

    def __init__(self, fail_at=None, delay=0.0):
        self.produced, self.fail_at, self.delay = 0, fail_at, delay

    def next_batch(self):
        time.sleep(self.delay)
        if self.produced == self.fail_at:
            raise UserError("shard 7 is corrupt")
        self.produced += 1
        return self.produced

    def state_dict(self):
        return {"produced": self.produced}


@pytest.mark.timeout(30)
def test_prefetch_state_is_the_last_batch_handed_out():
    loader = CountingLoader()
    with Prefetcher(loader, depth=3) as p:
        assert p.state_dict() == {"produced": 0}
        assert [p.next_batch() for _ in range(4)] == [1, 2, 3, 4]
        deadline = time.time() + 5
        while loader.produced < 4 + 3 + 1 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        # 3 batches queued and one more that the thread cannot put: it reads ahead no further.
        assert loader.produced == 4 + 3 + 1
        assert p.state_dict() == {"produced": 4}  # the state of batch 4, not of the batches read ahead


@pytest.mark.timeout(30)
def test_prefetch_resume_with_a_real_loader_is_exact(folder):
    d, _ = folder
    src = ParquetShards(list_shards(str(d)))
    p = Prefetcher(_make(src, 2, r=0), depth=4)
    for _ in range(5):
        p.next_batch()
    time.sleep(0.1)  # let it read ahead
    state = json.loads(json.dumps(p.state_dict()))
    ref = _make(src, 2, r=0)
    for _ in range(5):
        ref.next_batch()
    assert state == json.loads(json.dumps(ref.state_dict()))
    resumed = _make(src, 2, state, r=0)
    for _ in range(6):
        np.testing.assert_array_equal(p.next_batch()[0], resumed.next_batch()[0])
    assert p.close()


@pytest.mark.timeout(30)
def test_prefetch_errors_reach_the_consumer_and_close_joins():
    p = Prefetcher(CountingLoader(fail_at=2), depth=2)
    assert [p.next_batch(), p.next_batch()] == [1, 2]
    for _ in range(2):  # the same error again on every later call
        with pytest.raises(UserError, match="shard 7 is corrupt"):
            p.next_batch()
    assert p.close()
    slow = Prefetcher(CountingLoader(delay=0.05), depth=1)
    slow.next_batch()
    t0 = time.perf_counter()
    assert slow.close() and time.perf_counter() - t0 < 2
    with pytest.raises(RuntimeError, match="closed"):
        slow.next_batch()
    assert not [t for t in threading.enumerate() if t.name == "flaxchat-prefetch"]

"""Streaming parquet shards: a folder of parquet files read one row group at a time, split among readers.

The corpus is the list of *units*, one per (file, row group) in sorted file order, each holding the
rows of that group that belong to the split. Reader r of R (one per device in pretraining) reads
units r, r+R, r+2R, ...: readers never share a row group, together they cover every one, and each
decodes only its own groups (a reader striding over *documents* would decode every group R times).
Memory stays bounded by one decoded row group per reader (fineweb-edu shards: ~1,000 documents,
a few MB). A reader's position is (unit, row within the unit); `PackingLoader` stores it, plus the
epoch and the (global) numbers of the documents in its packing buffer, so a resumed run continues
exactly where it stopped.

`ParquetShards` is also an ordinary `Source` (len, doc(i), iter_docs), numbering documents the way
`FileCorpus` does (rows in file order), so tokenizer training, evaluation and the held-out split
treat it like any other corpus. Files may be local or any URL `flaxchat.paths` opens (`gs://`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

from flaxchat import paths
from flaxchat.errors import UserError

# Decoded units kept for random access (`doc(i)`): restoring a packing buffer touches the last few
# row groups of each reader, and one group of fineweb-edu text is ~5 MB.
CACHE_UNITS = 4
# Parallel footer reads for remote shards: one small ranged GET each, ~50-100 ms of latency, so
# 1,800 fineweb-edu shards take ~2 minutes one by one and a few seconds 16 at a time.
METADATA_THREADS = 16


@dataclass(frozen=True)
class Unit:
    file: int   # index into ParquetShards.files
    group: int  # row group in that file
    lo: int     # first row of the group in this split
    hi: int     # one past the last
    start: int  # document number of row `lo`

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def list_shards(spec: str) -> list[str]:
    """The sorted .parquet files of a folder (recursively), glob or single file, local or remote."""
    if is_glob(spec):
        found = paths.glob(spec)
    elif spec.lower().endswith(".parquet") and paths.exists(spec) and not paths.isdir(spec):
        found = [spec]
    elif not paths.is_remote(spec) and not paths.exists(spec):
        raise UserError(f"data path '{spec}' does not exist")
    else:
        # A remote folder is a name prefix: one that matches nothing is simply empty.
        found = paths.listdir(spec, recursive=True) if paths.is_remote(spec) or paths.isdir(spec) else []
    files = [f for f in found if f.lower().endswith(".parquet")]
    if not files:
        raise UserError(f"no parquet shards in {spec}")
    return files


def _read_metadata(path: str, field: str):
    import pyarrow.parquet as pq

    try:
        if paths.is_remote(path):
            with paths.open_file(path, "rb") as f:
                md = pq.read_metadata(f)
        else:
            md = pq.read_metadata(path)
    except UserError:
        raise
    except Exception as e:  # pyarrow raises several types for a bad file
        raise UserError(f"cannot read {path} as parquet ({e})") from None
    names = md.schema.to_arrow_schema().names
    if field not in names:
        raise UserError(f"{path} has no column '{field}' (columns: {', '.join(names)}); "
                        "name the one that holds the text (scripts.pretrain: --text-field; scripts.tok_train: --field)")
    return md


def _build_units(metadata: list, rows: tuple[int, int] | None) -> list[Unit]:
    """Units for the global rows [lo, hi) (all rows if None), numbered from 0 at row lo."""
    lo, hi = rows if rows is not None else (0, float("inf"))
    units, row = [], 0
    for f, md in enumerate(metadata):
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            a, b = max(lo, row), min(hi, row + n)
            if a < b:  # empty groups and groups outside the split are not units
                units.append(Unit(f, g, a - row, b - row, a - lo))
            row += n
    return units


class ParquetShards:
    """A streaming `Source` over parquet files; see the module docstring."""

    def __init__(self, files: list[str], field: str = "text", name: str | None = None,
                 rows: tuple[int, int] | None = None, _shared: dict | None = None):
        self.files, self.field = [str(f) for f in files], field
        self.name = name or f"{len(self.files)} parquet files"
        self.rows = rows
        self._shared = _shared if _shared is not None else {}  # footers, shared with slices
        self._units: list[Unit] | None = None
        self._starts: list[int] = []
        self._cache: OrderedDict[int, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    # --- layout --------------------------------------------------------------------------------------

    def _metadata(self) -> list:
        with self._lock:
            meta = self._shared.get("meta")
        if meta is None:
            if any(paths.is_remote(f) for f in self.files):
                with ThreadPoolExecutor(METADATA_THREADS) as pool:
                    meta = list(pool.map(lambda f: _read_metadata(f, self.field), self.files))
            else:
                meta = [_read_metadata(f, self.field) for f in self.files]
            with self._lock:
                self._shared["meta"] = meta
        return meta

    @property
    def units(self) -> list[Unit]:
        if self._units is None:
            units = _build_units(self._metadata(), self.rows)
            self._starts = [u.start for u in units]
            self._units = units
        return self._units

    @property
    def num_units(self) -> int:
        return len(self.units)

    def __len__(self) -> int:
        units = self.units
        return units[-1].start + units[-1].rows if units else 0

    def unit_of(self, i: int) -> int:
        """The unit that holds document i."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} is outside 0..{len(self) - 1}")
        return bisect.bisect_right(self._starts, i) - 1

    def slice(self, lo: int, hi: int, name: str) -> "ParquetShards":
        """Documents lo..hi-1 as a new source numbered from 0 (the held-out split), sharing footers."""
        base = self.rows[0] if self.rows else 0
        return ParquetShards(self.files, self.field, name, (base + lo, base + hi), self._shared)

    # --- reading -------------------------------------------------------------------------------------

    def _read(self, u: int) -> list[str]:
        """The texts of unit u: one row group, one column, decoded once."""
        import pyarrow.parquet as pq

        unit = self.units[u]
        path, md = self.files[unit.file], self._metadata()[unit.file]
        try:
            if paths.is_remote(path):
                with paths.open_file(path, "rb") as f, pq.ParquetFile(f, metadata=md) as pf:
                    table = pf.read_row_group(unit.group, columns=[self.field])
            else:
                with pq.ParquetFile(path, metadata=md) as pf:
                    table = pf.read_row_group(unit.group, columns=[self.field])
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot read row group {unit.group} of {path} ({type(e).__name__}: {e})") from None
        values = table.column(0).slice(unit.lo, unit.rows).to_pylist()
        return [v if isinstance(v, str) else "" if v is None else str(v) for v in values]

    def _cached(self, u: int) -> list[str]:
        with self._lock:
            if u in self._cache:
                self._cache.move_to_end(u)
                return self._cache[u]
        texts = self._read(u)
        with self._lock:
            self._cache[u] = texts
            while len(self._cache) > CACHE_UNITS:
                self._cache.popitem(last=False)
        return texts

    def doc(self, i: int) -> str:
        u = self.unit_of(i)
        return self._cached(u)[i - self.units[u].start]

    def doc_batch(self, indices: list[int]) -> list[str]:
        """Many documents in any order, reading each unit once (restoring a packing buffer)."""
        by_unit: dict[int, list[int]] = {}
        for i in indices:
            by_unit.setdefault(self.unit_of(i), []).append(i)
        texts: dict[int, str] = {}
        for u in sorted(by_unit):
            group, start = self._cached(u), self.units[u].start
            texts.update((i, group[i - start]) for i in by_unit[u])
        return [texts[i] for i in indices]

    def iter_docs(self, start: int = 0, step: int = 1) -> Iterator[tuple[int, str]]:
        """(i, text) for i = start, start+step, ... in document order (the `Source` protocol)."""
        for u, unit in enumerate(self.units):
            end = unit.start + unit.rows
            first = start if start >= unit.start else start + -(-(unit.start - start) // step) * step
            if first >= end:
                continue
            texts = self._read(u)
            for i in range(first, end, step):
                yield i, texts[i - unit.start]

    def iter_reader(self, reader: int, readers: int, unit: int | None = None,
                    row: int = 0) -> Iterator[tuple[int, str, tuple[int, int]]]:
        """Reader `reader` of `readers`: (i, text, position after it) from (unit, row) to the end of
        the epoch. The position after the last row of a unit is (next own unit, 0), so a saved
        position never points at a finished unit."""
        unit = reader if unit is None else unit
        if unit % readers != reader:
            raise ValueError(f"unit {unit} does not belong to reader {reader} of {readers}")
        for u in range(unit, self.num_units, readers):
            texts, base = self._read(u), self.units[u].start
            for k in range(row if u == unit else 0, len(texts)):
                yield base + k, texts[k], ((u, k + 1) if k + 1 < len(texts) else (u + readers, 0))


def measure_reader(source: ParquetShards, readers: int = 1, max_docs: int | None = None) -> dict:
    """Docs/s and chars/s of reader 0 of `readers` over one epoch (or `max_docs`), footers excluded."""
    source.units  # reads the footers outside the timed part
    docs = chars = 0
    t0 = time.perf_counter()
    for _, text, _ in source.iter_reader(0, readers):
        docs, chars = docs + 1, chars + len(text)
        if max_docs is not None and docs >= max_docs:
            break
    dt = time.perf_counter() - t0
    return {"docs": docs, "chars": chars, "seconds": dt, "docs_per_s": docs / dt, "chars_per_s": chars / dt}

"""BOS-aligned best-fit packing: documents -> fixed-size token rows, resumable exactly.

nanochat's packing: each document is tokenized with `<|bos|>` in front, every row of T+1 tokens
starts at a document start, and rows are filled best-fit from a buffer of pending documents: the
largest document that fits the space left goes in; when none fits, the shortest one is cropped to
fill the row exactly and its remainder is dropped. No row ever starts mid-document, so the model
never sees a context without its beginning. The price is the dropped remainders, which grow as
rows get shorter relative to documents: on the built-in stories (~210 tokens per document, buffer
of 1000) about 3% of tokens at T=2048 and 13% at T=512 (`stats()` reports the exact fraction).

Each process reads only its own documents (p, p+P, p+2P, ... for process p of P) and starts over
at the end of the source (one more epoch). A streaming source (parquet shards, see
`flaxchat.data.shards`) is split by row group instead: process p reads units p, p+P, ..., and its
cursor is (unit, row). The state is the read cursor, the epoch and the buffered document
*indices* (not tokens), a few KB of JSON; a restored loader re-tokenizes the buffer and then
produces exactly the batches the uninterrupted loader would have. `reshard_states` turns the
states of P readers into states for another count (see its docstring for what that costs).
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Iterator

import numpy as np

from flaxchat.errors import UserError

STATE_FORMAT = 1


class PackingLoader:
    """`next_batch()` -> (inputs, targets), int32 (batch_size, seq_len), targets shifted by one."""

    def __init__(self, source, tokenizer, batch_size: int, seq_len: int, process_index: int = 0,
                 process_count: int = 1, buffer_docs: int = 1000, tokenize_batch: int = 128,
                 num_threads: int | None = None, state: dict | None = None):
        if batch_size < 1 or seq_len < 1 or buffer_docs < 1 or tokenize_batch < 1:
            raise ValueError("batch_size, seq_len, buffer_docs and tokenize_batch must be positive")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in 0..{process_count - 1}")
        self.streaming = is_streaming(source)
        n_docs = len(source)
        if n_docs <= process_index:
            raise UserError(f"the corpus {source.name} has {n_docs} documents, fewer than the "
                            f"{process_count} processes reading it; use a larger corpus")
        if self.streaming and source.num_units <= process_index:
            raise UserError(f"the corpus {source.name} has {source.num_units} parquet row groups, fewer than "
                            f"the {process_count} readers; write the files with smaller row groups or use "
                            "fewer devices")
        self.source, self.tokenizer = source, tokenizer
        self.batch_size, self.seq_len = batch_size, seq_len
        self.process_index, self.process_count = process_index, process_count
        self.buffer_docs, self.tokenize_batch = buffer_docs, tokenize_batch
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.bos = tokenizer.bos_token_id
        self._reset()
        if state is not None:
            self.load_state_dict(state)

    def _reset(self) -> None:
        self.cursor = self._start()  # where this process reads next: a document or a (unit, row)
        self.epoch = 0
        self._iter: Iterator[tuple[int, str, object]] | None = None
        # Pending documents sorted by (length, -order); order = arrival number, so among equal
        # lengths the oldest document is picked first.
        self._keys: list[tuple[int, int]] = []
        self._docs: dict[int, tuple[int, list[int]]] = {}  # order -> (document index, tokens)
        self._order = 0
        self._counts = {"docs_read": 0, "tokens_out": 0, "tokens_cropped": 0, "docs_cropped": 0}

    # --- reading and tokenizing ----------------------------------------------------------------

    def _start(self):
        return (self.process_index, 0) if self.streaming else self.process_index

    def _stream(self) -> Iterator[tuple[int, str, object]]:
        """(document index, text, cursor after it) from the cursor to the end of the epoch."""
        if self.streaming:
            return self.source.iter_reader(self.process_index, self.process_count, *self.cursor)
        step = self.process_count
        return ((i, text, i + step) for i, text in self.source.iter_docs(self.cursor, step))

    def _next_texts(self) -> list[tuple[int, str]]:
        """The next `tokenize_batch` documents of this process's stream, wrapping at the end."""
        out: list[tuple[int, str]] = []
        wrapped_empty = False
        while len(out) < self.tokenize_batch:
            if self._iter is None:
                self._iter = self._stream()
            item = next(self._iter, None)
            if item is None:
                if wrapped_empty:
                    raise UserError(f"the corpus {self.source.name} has no documents for process "
                                    f"{self.process_index} of {self.process_count}")
                wrapped_empty = True
                self.epoch += 1
                self.cursor, self._iter = self._start(), None
                continue
            wrapped_empty = False
            out.append(item[:2])
            self.cursor = item[2]
        return out

    def _add(self, items: list[tuple[int, str]]) -> None:
        token_lists = self.tokenizer.encode([text for _, text in items], prepend=self.bos,
                                            num_threads=self.num_threads)
        for (index, _), tokens in zip(items, token_lists):
            self._docs[self._order] = (index, tokens)
            bisect.insort(self._keys, (len(tokens), -self._order))
            self._order += 1
        self._counts["docs_read"] += len(items)

    def _take(self, j: int) -> list[int]:
        _, neg_order = self._keys.pop(j)
        return self._docs.pop(-neg_order)[1]

    # --- packing -----------------------------------------------------------------------------------

    def _row(self, capacity: int) -> list[int]:
        row: list[int] = []
        while len(row) < capacity:
            while len(self._keys) < self.buffer_docs:
                self._add(self._next_texts())
            remaining = capacity - len(row)
            j = bisect.bisect_right(self._keys, (remaining, 1)) - 1  # largest doc that fits
            if j >= 0:
                row.extend(self._take(j))
                continue
            j = bisect.bisect_right(self._keys, (self._keys[0][0], 1)) - 1  # oldest of the shortest
            tokens = self._take(j)
            row.extend(tokens[:remaining])
            self._counts["tokens_cropped"] += len(tokens) - remaining
            self._counts["docs_cropped"] += 1
        return row

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.array([self._row(self.seq_len + 1) for _ in range(self.batch_size)], dtype=np.int32)
        self._counts["tokens_out"] += rows.size
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def __iter__(self):
        while True:
            yield self.next_batch()

    # --- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serializable state; buffered documents are stored as indices in arrival order."""
        buffered = [self._docs[order][0] for order in sorted(self._docs)]
        return {"format": STATE_FORMAT, "kind": self.kind, "source": self.source.name,
                "process_index": self.process_index, "process_count": self.process_count,
                "cursor": list(self.cursor) if self.streaming else self.cursor, "epoch": self.epoch,
                "buffer": buffered, "counts": dict(self._counts)}

    @property
    def kind(self) -> str:
        return "stream" if self.streaming else "index"

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise UserError(f"the data loader state has format {state.get('format')}, expected {STATE_FORMAT}")
        if state.get("kind", "index") != self.kind:
            raise UserError(f"the data loader state was saved by the {state.get('kind', 'index')} reader, but "
                            f"{self.source.name} is read by the {self.kind} reader; resume with the same data")
        if (state["process_index"], state["process_count"]) != (self.process_index, self.process_count):
            raise UserError(f"the data loader state belongs to process {state['process_index']} of "
                            f"{state['process_count']}, not {self.process_index} of {self.process_count}; "
                            "resume with the same number of processes")
        if state["source"] != self.source.name:
            raise UserError(f"the data loader state was saved for '{state['source']}', not "
                            f"'{self.source.name}'; resume with the same data")
        self._reset()
        self.cursor = tuple(state["cursor"]) if self.streaming else state["cursor"]
        self.epoch = state["epoch"]
        buffered = state["buffer"]
        # A streaming source fetches many documents at once, decoding each row group once.
        fetch = getattr(self.source, "doc_batch", None)
        texts = fetch(buffered) if fetch else [self.source.doc(i) for i in buffered]
        for lo in range(0, len(buffered), self.tokenize_batch):
            self._add(list(zip(buffered[lo:lo + self.tokenize_batch], texts[lo:lo + self.tokenize_batch])))
        self._counts = dict(state.get("counts", self._counts))

    def stats(self) -> dict:
        """Counters since the start of training: documents read, tokens emitted, tokens dropped by
        crops and their fraction of all tokens read."""
        c = dict(self._counts)
        read = c["tokens_out"] + c["tokens_cropped"]
        c["crop_fraction"] = c["tokens_cropped"] / read if read else 0.0
        c["epoch"] = self.epoch
        return c


def is_streaming(source) -> bool:
    """Whether `source` splits among readers by row group (`iter_reader`) rather than by document."""
    return hasattr(source, "iter_reader")


def reshard_states(states: list[dict], count: int, source=None) -> list[dict]:
    """States for `count` readers that continue the run whose `len(states)` readers saved `states`
    (pass the source for a streaming one: buffered documents are placed by their row group).

    The rule: every new reader starts at the *frontier*, the earliest position any old reader was
    at (smallest epoch, then smallest cursor unit: a row group, or a document for indexed sources),
    on its own units from there (u = r, r+count, ... with u >= frontier), at row 0. Units before the
    frontier were read completely by their old readers; what of them was not yet packed (buffered
    documents) moves to the new reader of that unit. Buffered documents at or past the frontier
    are dropped, because the new readers read those units again, except documents past the old
    reader's own cursor, which it read in its previous epoch and which are kept. So no document
    is skipped, and those read between the frontier and each old reader's cursor are seen twice:
    about one row group per old reader when readers progress evenly (documents for an indexed
    source). Counters are summed into new reader r % count.
    """
    if not states:
        raise ValueError("no loader states to reshard")
    old = len(states)
    kinds, names = {s.get("kind", "index") for s in states}, {s["source"] for s in states}
    if len(kinds) > 1 or len(names) > 1 or any(s.get("format") != STATE_FORMAT for s in states):
        raise UserError("the saved data loader states do not belong to one run; resume with the same data")
    if [(s["process_index"], s["process_count"]) for s in states] != [(r, old) for r in range(old)]:
        raise UserError(f"the checkpoint holds {old} data loader states that are not readers 0..{old - 1} "
                        f"of {old}; the checkpoint's loader states are damaged")
    if old == count:
        return [dict(s) for s in states]
    streaming = kinds == {"stream"}
    if streaming and source is None:
        raise ValueError("resharding a streaming loader state needs its source")
    unit_of = source.unit_of if streaming else (lambda i: i)

    def unit(s: dict) -> int:
        return s["cursor"][0] if streaming else s["cursor"]

    def read_up_to(s: dict) -> int:
        """The first document number the old reader had not read this epoch: any of its buffered
        documents at or past it was read in its previous epoch."""
        if not streaming:
            return s["cursor"]
        u, row = s["cursor"]
        return source.units[u].start + row if u < source.num_units else len(source)

    epoch, frontier = min((s["epoch"], unit(s)) for s in states)
    new = []
    for r in range(count):
        u = frontier + (r - frontier) % count  # reader r's first unit at or after the frontier
        new.append({**states[0], "process_index": r, "process_count": count, "epoch": epoch,
                    "cursor": [u, 0] if streaming else u, "buffer": [],
                    "counts": {k: 0 for k in states[0].get("counts", {})}})
    for r, s in enumerate(states):
        end = read_up_to(s)
        for i in s["buffer"]:
            u = unit_of(i)
            if u < frontier or i >= end:
                new[u % count]["buffer"].append(i)
        for k, v in s.get("counts", {}).items():
            new[r % count]["counts"][k] = new[r % count]["counts"].get(k, 0) + v
    return new


class LoaderGroup:
    """The loaders of this process's device shards (PackingLoader, or any loader with next_batch and
    state_dict, e.g. chat_data.ConversationLoader) as one loader: `next_batch()` stacks
    `grad_accum` micro-batches of every loader into (grad_accum, loaders x batch_size, seq_len),
    shard-major within a micro-batch; `state_dict()` is the list of the loaders' states. Made to
    sit behind one `Prefetcher`, so that a single thread touches the loaders and their source."""

    def __init__(self, loaders: list, grad_accum: int = 1):
        self.loaders, self.grad_accum = list(loaders), grad_accum

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for _ in range(self.grad_accum):
            pairs = [ld.next_batch() for ld in self.loaders]
            xs.append(np.concatenate([p[0] for p in pairs]))
            ys.append(np.concatenate([p[1] for p in pairs]))
        return np.stack(xs), np.stack(ys)

    def state_dict(self) -> list[dict]:
        return [ld.state_dict() for ld in self.loaders]

    def stats(self) -> list[dict]:
        return [ld.stats() for ld in self.loaders]


def measure_throughput(loader: PackingLoader, batches: int = 20) -> float:
    """Tokens per second of `loader.next_batch()` over `batches` batches (after one warm-up)."""
    loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * loader.batch_size * loader.seq_len / (time.perf_counter() - t0)

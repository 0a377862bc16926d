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
produces exactly the batches the uninterrupted loader would have.

Memory is bounded by the rows, not by the corpus: a row uses at most its first T+1 tokens of any
document, so the buffer keeps only those (int32), at most (buffer_docs + tokenize_batch) x (T+1)
tokens, 9 MB at T=2048 whatever the documents' sizes. A document longer than `cut_chars(T+1)`
characters is tokenized only up to that many (cut at a space between two words, where the split
pattern always ends a piece, so its first T+1 tokens are those of the whole text); its length then
counts as the tokens of that prefix, a lower bound that only orders it among other documents too
long for a row. A document buffered several times (a corpus with fewer documents than the buffer
wraps around) is read and tokenized once and its tokens are shared. `reshard_states` turns the
states of P readers into states for another count (see its docstring for what that costs).
"""

from __future__ import annotations

import bisect
import os
import re
import time
from typing import Iterator

import numpy as np

from flaxchat.errors import UserError

STATE_FORMAT = 1
ENCODE_CHARS = 1 << 22  # characters encoded per tokenizer call: bounds the transient token lists


def cut_chars(capacity: int) -> int:
    """Characters of a document tokenized for rows of `capacity` tokens: 32 per token is 7x the
    ~4.5 of English text, and the floor keeps every document of a normal corpus whole at short rows."""
    return max(32 * capacity, 1 << 14)


_WORD_GAP = re.compile(r"(?<=\S) (?=\S)")


def cut_document(text: str, capacity: int) -> str:
    """`text` up to `cut_chars(capacity)` characters, ended at a single space between two words
    (the split pattern ends a piece there, so the tokens before it are those of the whole text)."""
    limit = cut_chars(capacity)
    if len(text) <= limit:
        return text
    gaps = [m.start() for m in _WORD_GAP.finditer(text, max(0, limit - 4096), limit)]
    return text[:gaps[-1] if gaps else limit]


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
        self.capacity = seq_len + 1  # tokens of a row: inputs and the targets shifted by one
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
        self._docs: dict[int, tuple[int, list]] = {}  # order -> (document index, its tokens entry)
        self._tokens: dict[int, list] = {}  # document index -> [first T+1 tokens, length, copies]
        self._order = 0
        self._counts = {"docs_read": 0, "tokens_out": 0, "tokens_cropped": 0, "docs_cropped": 0}

    # --- reading and tokenizing ----------------------------------------------------------------

    def _start(self):
        return (self.process_index, 0) if self.streaming else self.process_index

    def _stream(self) -> Iterator[tuple[int, str | None, object]]:
        """(document index, text, cursor after it) from the cursor to the end of the epoch. An
        indexed source yields no text: `_add` reads only the documents not already buffered."""
        if self.streaming:
            return self.source.iter_reader(self.process_index, self.process_count, *self.cursor)
        step = self.process_count
        return ((i, None, i + step) for i in range(self.cursor, len(self.source), step))

    def _next_texts(self) -> list[tuple[int, str | None]]:
        """The next `tokenize_batch` documents of this process's stream, wrapping at the end."""
        out: list[tuple[int, str | None]] = []
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
            index, text = item[0], item[1]
            known = text is None or index in self._tokens  # read later, or buffered already
            out.append((index, None if known else cut_document(text, self.capacity)))
            self.cursor = item[2]
        return out

    def _tokenize(self, texts: dict[int, str]) -> None:
        """Tokens of the documents `texts` (index -> text) into `self._tokens`, with 0 copies.
        Encoded a few MB of text at a time, so that the full token lists never pile up."""
        items = list(texts.items())
        lo = 0
        while lo < len(items):
            hi, chars = lo, 0
            while hi < len(items) and (hi == lo or chars + len(items[hi][1]) <= ENCODE_CHARS):
                chars += len(items[hi][1])
                hi += 1
            token_lists = self.tokenizer.encode([text for _, text in items[lo:hi]], prepend=self.bos,
                                                num_threads=self.num_threads)
            for (index, _), tokens in zip(items[lo:hi], token_lists):
                self._tokens[index] = [np.asarray(tokens[:self.capacity], dtype=np.int32), len(tokens), 0]
            lo = hi

    def _add(self, items: list[tuple[int, str | None]]) -> None:
        """Buffer the documents `items` (index, text): a text is needed only for an index not
        buffered yet, and None fetches it from the source."""
        new = {i: t for i, t in items if i not in self._tokens}
        missing = [i for i, t in new.items() if t is None]
        if missing:
            new.update(zip(missing, (cut_document(t, self.capacity) for t in self._fetch(missing))))
        self._tokenize(new)
        for index, _ in items:
            entry = self._tokens[index]
            entry[2] += 1
            self._docs[self._order] = (index, entry)
            bisect.insort(self._keys, (entry[1], -self._order))
            self._order += 1
        self._counts["docs_read"] += len(items)

    def _fetch(self, indices: list[int]) -> list[str]:
        # A streaming source fetches many documents at once, decoding each row group once.
        fetch = getattr(self.source, "doc_batch", None)
        return fetch(indices) if fetch else [self.source.doc(i) for i in indices]

    def _take(self, j: int) -> tuple[np.ndarray, int]:
        _, neg_order = self._keys.pop(j)
        index, entry = self._docs.pop(-neg_order)
        entry[2] -= 1
        if not entry[2]:
            del self._tokens[index]
        return entry[0], entry[1]

    # --- packing -----------------------------------------------------------------------------------

    def _row(self, capacity: int) -> np.ndarray:
        row = np.empty(capacity, dtype=np.int32)
        filled = 0
        while filled < capacity:
            while len(self._keys) < self.buffer_docs:
                self._add(self._next_texts())
            remaining = capacity - filled
            j = bisect.bisect_right(self._keys, (remaining, 1)) - 1  # largest doc that fits
            if j >= 0:
                tokens, length = self._take(j)
                row[filled:filled + length] = tokens
                filled += length
                continue
            j = bisect.bisect_right(self._keys, (self._keys[0][0], 1)) - 1  # oldest of the shortest
            tokens, length = self._take(j)
            row[filled:] = tokens[:remaining]
            filled = capacity
            self._counts["tokens_cropped"] += length - remaining
            self._counts["docs_cropped"] += 1
        return row

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.stack([self._row(self.capacity) for _ in range(self.batch_size)])
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
        for lo in range(0, len(buffered), self.tokenize_batch):
            self._add([(i, None) for i in buffered[lo:lo + self.tokenize_batch]])
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

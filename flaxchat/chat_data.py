"""Conversations as training batches: rendered with the chat template and packed into rows.

Each conversation is rendered once (`Tokenizer.render_conversation`: ids plus a 0/1 mask that is 1
only on what the assistant writes; one longer than a row is cut to T+1 tokens) and packed into
rows of T+1 tokens best-fit from a buffer, as nanochat's chat_sft does: a row takes the longest
buffered conversation that still fits, again and again; when none fits, the rest of the row is
padding (<|bos|>, never trained) instead of a cropped conversation, so no token is thrown away.
Targets are the next token where the mask is 1 and -1 elsewhere, which
`flaxchat.train.train_step` leaves out of the loss.

The order is a shuffle of the dataset per epoch (seeded) that refills the buffer; the loader's whole
state is (epoch, cursor, the buffered conversations): a checkpoint stores it and a resumed run
continues with the very next row. With several data streams (one per device), stream i takes every
count-th conversation from i.
"""

from __future__ import annotations

import random

import numpy as np

from flaxchat.errors import UserError


class ConversationLoader:
    def __init__(self, dataset, tokenizer, rows: int, seq_len: int, *, seed: int = 0,
                 stream: int = 0, streams: int = 1, buffer: int = 100):
        if len(dataset) < streams:
            raise UserError(f"the dataset has {len(dataset)} conversation(s), fewer than the {streams} data streams.")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.rows, self.T = rows, seq_len
        self.seed, self.stream, self.streams = seed, stream, streams
        self.buffer_size = max(1, buffer)
        self.epoch, self.cursor = 0, 0
        self.buffer: list[int] = []  # dataset indices fetched from the order, not yet packed
        self._order: list[int] | None = None
        self._cache: dict[int, tuple[list[int], list[int]]] = {}

    # --- order and rendering ------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.dataset)))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._order = order[self.stream::self.streams]
        return self._order

    def _rendered(self, index: int) -> tuple[list[int], list[int]]:
        got = self._cache.get(index)
        if got is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            got = self.tokenizer.render_conversation(self.dataset[index], max_tokens=self.T + 1)
            self._cache[index] = got
        return got

    def _refill(self) -> None:
        while len(self.buffer) < self.buffer_size:
            order = self._epoch_order()
            if self.cursor >= len(order):
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
                order = self._epoch_order()
            self.buffer.append(order[self.cursor])
            self.cursor += 1

    # --- batches ---------------------------------------------------------------------------------
    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (rows, T) int32; targets are -1 where nothing trains."""
        width = self.T + 1
        bos = self.tokenizer.bos_token_id
        ids = np.full((self.rows, width), bos, np.int32)
        mask = np.zeros((self.rows, width), np.int8)
        for r in range(self.rows):
            used = 0
            while used < width:
                self._refill()
                lengths = [len(self._rendered(i)[0]) for i in self.buffer]
                fits = [j for j, n in enumerate(lengths) if n <= width - used]
                if not fits:
                    break  # pad the rest of the row rather than crop a conversation
                best = max(fits, key=lambda j: (lengths[j], -j))  # the longest; the earliest among equals
                conv_ids, conv_mask = self._rendered(self.buffer.pop(best))
                n = len(conv_ids)
                ids[r, used:used + n] = conv_ids
                mask[r, used:used + n] = conv_mask
                used += n
        targets = np.where(mask[:, 1:] == 1, ids[:, 1:], -1).astype(np.int32)
        return ids[:, :-1].copy(), targets

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None
        self.buffer = [int(i) for i in state.get("buffer", [])]  # older checkpoints: an empty buffer

    @property
    def epochs_done(self) -> float:
        return self.epoch + (self.cursor - len(self.buffer)) / max(1, len(self._epoch_order()))


def trained_fraction(targets: np.ndarray) -> float:
    return float(np.mean(targets >= 0))

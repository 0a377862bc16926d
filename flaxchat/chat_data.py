"""Conversations as training batches: rendered with the chat template and packed into rows.

Each conversation is rendered once (`Tokenizer.render_conversation`: ids plus a 0/1 mask that is 1
only on what the assistant writes) and whole conversations are packed into rows of T+1 tokens,
first fit in order; the rest of a row is padding (<|bos|>, never trained). Targets are the next
token where the mask is 1 and -1 elsewhere, which `flaxchat.train.train_step` leaves out of the loss.

The order is a shuffle of the dataset per epoch (seeded), and the loader's whole state is
(epoch, cursor): a checkpoint stores it and a resumed run continues with the very next conversation.
With several data streams (one per device), stream i takes every count-th conversation from i.
"""

from __future__ import annotations

import random

import numpy as np

from flaxchat.errors import UserError


class ConversationLoader:
    def __init__(self, dataset, tokenizer, rows: int, seq_len: int, *, seed: int = 0,
                 stream: int = 0, streams: int = 1):
        if len(dataset) < streams:
            raise UserError(f"the dataset has {len(dataset)} conversation(s), fewer than the {streams} data streams.")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.rows, self.T = rows, seq_len
        self.seed, self.stream, self.streams = seed, stream, streams
        self.epoch, self.cursor = 0, 0
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

    def _next_conversation(self) -> tuple[list[int], list[int]]:
        order = self._epoch_order()
        if self.cursor >= len(order):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
            order = self._epoch_order()
        return self._rendered(order[self.cursor])

    # --- batches ---------------------------------------------------------------------------------
    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (rows, T) int32; targets are -1 where nothing trains."""
        width = self.T + 1
        bos = self.tokenizer.bos_token_id
        ids = np.full((self.rows, width), bos, np.int32)
        mask = np.zeros((self.rows, width), np.int8)
        for r in range(self.rows):
            used = 0
            while True:
                conv_ids, conv_mask = self._next_conversation()
                n = len(conv_ids)
                if used and used + n > width:
                    break  # does not fit: it opens the next row
                ids[r, used:used + n] = conv_ids
                mask[r, used:used + n] = conv_mask
                used += n
                self.cursor += 1
                if used >= width:
                    break
        targets = np.where(mask[:, 1:] == 1, ids[:, 1:], -1).astype(np.int32)
        return ids[:, :-1].copy(), targets

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.cursor / max(1, len(self._epoch_order()))


def trained_fraction(targets: np.ndarray) -> float:
    return float(np.mean(targets >= 0))

"""A background thread that keeps the next batches ready, so the device never waits on the host.

`Prefetcher(loader, depth)` calls `loader.next_batch()` on a daemon thread and keeps up to `depth`
batches in a bounded queue; `next_batch()` hands them out in order. Tokenizing and packing are
mostly outside the GIL (tiktoken's encoder and pyarrow's decoder release it) and so is a running
jitted step, so the two overlap on the host's cores.

Checkpoint correctness: the thread reads ahead, so the loader's own state is `depth` batches (or
more) past what training has consumed. The thread therefore records `loader.state_dict()` right
after producing each batch, and `Prefetcher.state_dict()` returns the state that belongs to the
last batch *handed out*: a run restored from it continues with the first batch it never trained on.

Errors in the thread (a bad file, a UserError) are raised again by the next `next_batch()`, with
their original type and message. `close()` stops the thread and joins it within a timeout.
"""

from __future__ import annotations

import queue
import threading
import time

_POLL_S = 0.1  # how often a blocked put/get looks at the stop flag


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Wraps any object with `next_batch()` and `state_dict()` (and optionally `stats()`)."""

    def __init__(self, loader, depth: int = 2, join_timeout: float = 10.0):
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.loader, self.depth, self.join_timeout = loader, depth, join_timeout
        self._state = loader.state_dict()  # before any batch: the loader's starting point
        self._stats = loader.stats() if hasattr(loader, "stats") else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self.wait_s = 0.0  # total time next_batch() blocked: host time the device would wait for
        self.batches = 0
        self._thread = threading.Thread(target=self._work, daemon=True, name="flaxchat-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.loader.next_batch()
                # Taken now, before the next batch changes the loader: the state *after* this batch.
                state = self.loader.state_dict()
                stats = self.loader.stats() if self._stats is not None else None
                if not self._put((batch, state, stats)):
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(_Failure(e))

    def next_batch(self):
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the prefetcher is closed")
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread stopped without a batch or an error") from None
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            self._error = item.error
            raise item.error
        batch, self._state, self._stats = item
        self.batches += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self):
        """The loader state right after the last batch handed out (a fresh object per batch)."""
        return self._state

    def stats(self):
        """The loader's counters as of the last batch handed out."""
        return self._stats

    def close(self) -> bool:
        """Stop the thread; True if it ended within `join_timeout` (a daemon thread stuck in a slow
        read is left behind and ends with the process)."""
        self._closed = True
        self._stop.set()
        try:
            while True:  # free the slot a blocked put is waiting for
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(self.join_timeout)
        return not self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""What a run leaves for a person: metrics.jsonl, a loss-curve PNG, a markdown report, JSON files.

Every writer goes through `flaxchat.paths`, so a run folder may be local or `gs://bucket/run`.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Any, Callable, Iterable

from flaxchat import paths
from flaxchat.errors import UserError


class MetricsLog:
    """Append-only JSON lines. A resumed run appends again; readers keep the last entry per step.

    An object store cannot append to an object: for a remote path the log keeps the whole file in
    memory and uploads it again at most every `flush_every_s` seconds (GCS allows about one write
    per second to one object) and on `flush()`/`read()`. A run killed in between loses at most
    that many seconds of lines; a resumed run logs those steps again.
    """

    def __init__(self, path: str, flush_every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 trackers: Iterable = ()):
        self.path = path
        self.trackers = list(trackers)  # flaxchat.trackers: each line appended is also logged to them
        self.flush_every_s = flush_every_s
        self._clock = clock
        self._remote = paths.is_remote(path)
        self._text: list[str] | None = None  # remote: the file's lines, uploaded whole on flush
        self._dirty = False
        self._flushed_at = float("-inf")
        if not self._remote and os.path.islink(path):
            raise self._link()

    def _link(self) -> UserError:
        return UserError(f"{self.path} is a symbolic link (to {os.readlink(self.path)}); a run writes its own "
                         "metrics there and never through a link into another file: remove the link.")

    def append(self, **entry) -> None:
        self.note(**entry)
        line = json.dumps(entry) + "\n"
        if not self._remote:
            # O_NOFOLLOW: a link put there while the run trains is refused too, not written through.
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError as e:
                if os.path.islink(self.path):
                    raise self._link() from None
                raise
            with os.fdopen(fd, "a") as f:
                f.write(line)
            return
        if self._text is None:
            self._text = [paths.read_text(self.path)] if paths.exists(self.path) else []
        self._text.append(line)
        self._dirty = True
        if self._clock() - self._flushed_at >= self.flush_every_s:
            self.flush()

    def note(self, **entry) -> None:
        """To the trackers only (sampled text): not a line of metrics.jsonl."""
        for tracker in self.trackers:
            tracker.log(entry)

    def close(self) -> None:
        self.flush()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def flush(self) -> None:
        if self._dirty:
            paths.write_text(self.path, "".join(self._text))
            self._dirty = False
            self._flushed_at = self._clock()

    def read(self) -> list[dict[str, Any]]:
        self.flush()
        if not paths.exists(self.path):
            return []
        by_key: dict[tuple, dict] = {}
        for line in paths.read_text(self.path).splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: skip it
            by_key[(e.get("kind"), e.get("step"))] = e
        return sorted(by_key.values(), key=lambda e: (e.get("step", 0), e.get("kind", "")))


def plot_losses(entries: Iterable[dict], path: str, title: str = "", val_key: str = "val_bpb",
                val_label: str = "val bits per byte") -> str | None:
    """Training loss (and a validation metric on a second axis) against step, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(entries)
    train = [(e["step"], e["loss"]) for e in entries if e.get("kind") == "train"]
    val = [(e["step"], e[val_key]) for e in entries if e.get("kind") == "val" and val_key in e]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train), lw=1.2, color="tab:blue", label="train loss (nats/token)")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss", color="tab:blue")
    ax.grid(alpha=0.3)
    if val:
        ax2 = ax.twinx()
        ax2.plot(*zip(*val), "o-", color="tab:orange", label=val_label)
        ax2.set_ylabel(val_label, color="tab:orange")
    ax.set_title(title or "flaxchat training")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    paths.write_bytes(path, buf.getvalue())
    return path


def write_report(path: str, *, title: str, sections: list[tuple[str, Any]]) -> str:
    """Markdown: each section is (heading, dict -> table | list -> bullets | str -> paragraph)."""
    lines = [f"# {title}", ""]
    for heading, body in sections:
        lines += [f"## {heading}", ""]
        if isinstance(body, dict):
            lines += ["| key | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in body.items()]
        elif isinstance(body, list):
            lines += [f"- {x}" for x in body]
        else:
            lines.append(str(body))
        lines.append("")
    paths.write_text(path, "\n".join(lines))
    return path


def write_json(path: str, obj) -> None:
    """JSON (indented, sorted keys), written atomically: a reader never sees half a file."""
    paths.write_json(path, obj, indent=2, sort_keys=True)

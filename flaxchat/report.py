"""What a run leaves for a person: metrics.jsonl, a loss-curve PNG and a markdown report."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable


class MetricsLog:
    """Append-only JSON lines. A resumed run appends again; readers keep the last entry per step."""

    def __init__(self, path: str):
        self.path = path

    def append(self, **entry) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        by_key: dict[tuple, dict] = {}
        with open(self.path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: skip it
                by_key[(e.get("kind"), e.get("step"))] = e
        return sorted(by_key.values(), key=lambda e: (e.get("step", 0), e.get("kind", "")))


def plot_losses(entries: Iterable[dict], path: str, title: str = "") -> str | None:
    """Training loss (and validation bpb on a second axis) against step, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(entries)
    train = [(e["step"], e["loss"]) for e in entries if e.get("kind") == "train"]
    val = [(e["step"], e["val_bpb"]) for e in entries if e.get("kind") == "val"]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train), lw=1.2, color="tab:blue", label="train loss (nats/token)")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss", color="tab:blue")
    ax.grid(alpha=0.3)
    if val:
        ax2 = ax.twinx()
        ax2.plot(*zip(*val), "o-", color="tab:orange", label="val bits/byte")
        ax2.set_ylabel("val bits per byte", color="tab:orange")
    ax.set_title(title or "flaxchat training")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
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
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)
    return path

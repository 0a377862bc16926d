"""Datasets for finetuning and evaluation, one file each, all on `tasks.base.Task`.

`get_task("arithmetic", split="train")` builds one by name; `parse_mix("chat:2,spelling,arithmetic")`
builds a weighted mixture. Built-in tasks need no network; the real datasets read files (parquet or
jsonl in each dataset's published format) or `hf:` specs through flaxchat's data layer.
"""

from __future__ import annotations

import importlib

from flaxchat.errors import UserError
from tasks.base import Task, TaskMixture

# name -> (module, class). Each module keeps its own loading code; importing one never imports the others.
KNOWN: dict[str, tuple[str, str]] = {
    # built-in, offline (kwargs: split, size, seed)
    "chat": ("tasks.synthetic_chat", "SyntheticChat"),  # greetings, identity (flaxchat), simple Q&A
    "spelling": ("tasks.spelling", "SpellingBee"),  # count letters, with str.count in the calculator
    "spell": ("tasks.spelling", "SimpleSpelling"),  # spell a word letter by letter
    "arithmetic": ("tasks.arithmetic", "Arithmetic"),  # GSM8K-shaped word problems with tool calls
    # real datasets (kwargs: path = file/folder/glob or hf:owner/name spec, split)
    "smoltalk": ("tasks.smoltalk", "SmolTalk"),
    "mmlu": ("tasks.mmlu", "MMLU"),
    "arc": ("tasks.arc", "ARC"),
    "gsm8k": ("tasks.gsm8k", "GSM8K"),
    "humaneval": ("tasks.humaneval", "HumanEval"),
}


def register(name: str, module: str, cls: str) -> None:
    KNOWN[name] = (module, cls)


def get_task(name: str, **kwargs) -> Task:
    if name not in KNOWN:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(sorted(KNOWN))}.")
    module, cls = KNOWN[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


# A weight repeats a task's examples: more than this many repeats is a typo, not a recipe (a weight
# of 1e9 on the 8,000 built-in chat examples asked for 8e12 index entries and ate the memory).
MAX_WEIGHT = 1000.0


def parse_mix(spec: str, seed: int = 0, **kwargs) -> TaskMixture:
    """'a:2,b,c:0.5' -> a mixture of tasks a (twice), b, and half of c; 'gsm8k@data/gsm8k.parquet'
    gives a file-based task its path. kwargs (e.g. split) go to every task."""
    tasks, weights = [], []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        head, _, w = item.rpartition(":")
        if not head or ("@" in item and not _is_number(w)):  # no weight, or a path's own colon (hf:...)
            head, w = item, ""
        name, _, path = head.partition("@")
        if w and not _is_number(w):
            raise UserError(f"bad weight {w!r} for task {name!r} in {spec!r}; write name:weight, e.g. chat:2.")
        weight = float(w) if w else 1.0
        if not (0 < weight <= MAX_WEIGHT):  # also refuses nan and inf
            raise UserError(f"the weight of task {name!r} in {spec!r} must be a number above 0 and at most "
                            f"{MAX_WEIGHT:g} (got {w}); 2 repeats every example twice, 0.5 takes half of them.")
        tasks.append(get_task(name, **(dict(kwargs, path=path) if path else kwargs)))
        weights.append(weight)
    return TaskMixture(tasks, weights, seed=seed)


def split_spec(spec: str) -> tuple[str, str]:
    """'name', 'name:PATH' or 'name@PATH' -> (name, path or '')."""
    cut = min((i for i in (spec.find("@"), spec.find(":")) if i >= 0), default=-1)
    return (spec, "") if cut < 0 else (spec[:cut], spec[cut + 1:])


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


__all__ = ["KNOWN", "Task", "TaskMixture", "get_task", "parse_mix", "register", "split_spec"]

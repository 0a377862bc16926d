"""The one base every dataset stands on: a Task is an indexable list of conversations.

A conversation is nanochat's dict: `{"messages": [{"role": "user"|"assistant", "content": ...}]}`
where an assistant's content is a string or a list of parts `{"type": "text"|"python"|
"python_output", "text": ...}` (see `Tokenizer.render_conversation`). Categorical tasks (multiple
choice) add `"letters": ["A", "B", ...]` and their assistant answer is exactly one of the letters.

Tasks are sliced like lists (`Task(start, stop, step)`) so a split or a shard of a task is a Task too.
`evaluate` grades one sampled reply (the assistant's text, tool calls and outputs rendered as
plain text); `reward` is what RL maximises (by default 1.0 for a correct reply, else 0.0).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from typing import Sequence

from flaxchat.errors import UserError


class Task:
    name: str = "task"
    eval_type: str = "generative"  # or "categorical": graded by the logits of the answer letters

    def __init__(self, start: int = 0, stop: int | None = None, step: int = 1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise UserError(f"bad slice of task {self.name}: start {start}, stop {stop}, step {step}.")
        self.start, self.stop, self.step = start, stop, step

    # --- what a subclass provides ---------------------------------------------------------------
    def num_examples(self) -> int:
        raise NotImplementedError

    def get_example(self, index: int) -> dict:
        raise NotImplementedError

    def evaluate(self, conversation: dict, response: str) -> bool:
        raise NotImplementedError

    def reward(self, conversation: dict, response: str) -> float:
        return float(self.evaluate(conversation, response))

    # --- list behaviour ---------------------------------------------------------------------------
    def __len__(self) -> int:
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, (stop - self.start + self.step - 1) // self.step)

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for task {self.name} of {n} examples")
        return self.get_example(self.start + (i % n) * self.step)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} examples)"


class GeneratedTask(Task):
    """A built-in task made on the fly from (seed, split, index): the split and size checks and
    the example count that every generated task shares."""

    default_size = {"train": 5000, "val": 500, "test": 500}

    def __init__(self, split: str = "train", size: int | None = None, seed: int = 0,
                 start: int = 0, stop: int | None = None, step: int = 1):
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r} for task {self.name}; use one of {', '.join(SPLITS)}.")
        if size is not None and (not isinstance(size, int) or size < 0):
            raise UserError(f"the size of task {self.name} must be a whole number >= 0 (got {size!r}).")
        super().__init__(start, stop, step)
        self.split, self.seed = split, seed
        self.size = self.default_size[split] if size is None else size

    def num_examples(self) -> int:
        return self.size

    def rng(self, index: int) -> random.Random:
        """Example `index`'s own generator: random access, the same example in every process."""
        return random.Random(f"{self.name}/{self.seed}/{self.split}/{index}")

    def draw_held_out(self, index: int, make) -> dict:
        """Example `index` of this split: `make(rng) -> (key, conversation)` is drawn until `split_of(key)`
        is this split, so content held out of training never appears there."""
        rng = self.rng(index)
        for _ in range(MAX_DRAWS):
            key, conversation = make(rng)
            if split_of(key) == self.split:
                return conversation
        raise RuntimeError(f"no {self.split} example of task {self.name} in {MAX_DRAWS} draws (example {index})")


MAX_DRAWS = 10_000  # a split owns ~10% of the content, so ~10 draws on average; this bound is only a guard
SPLITS = ("train", "val", "test")


def split_of(key: str) -> str:
    """Which split owns a piece of content: 10% val, 10% test, 80% train, by a hash that is stable
    across processes (unlike `hash()`), so held-out content never reaches training."""
    bucket = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 10
    return "val" if bucket == 0 else "test" if bucket == 1 else "train"


_CHOICE = re.compile(r"\[([^\[\]]*)\]")


def expand(template: str, rng: random.Random) -> str:
    """Replace each `[a|b|c]` (innermost first, so they may nest) with one alternative."""
    while (m := _CHOICE.search(template)) is not None:
        template = template[:m.start()] + rng.choice(m.group(1).split("|")) + template[m.end():]
    return template


# The mixture keeps an index entry per example (~70 bytes): 50M is 3.5 GB. nanochat's SFT mixture
# is about 1M examples.
MAX_MIXTURE = 50_000_000


class TaskMixture:
    """Several tasks as one shuffled list. `weights` repeat a task (2.0 = every example twice;
    fractions take a prefix), and the order is a deterministic shuffle by `seed`."""

    def __init__(self, tasks: Sequence[Task], weights: Sequence[float] | None = None, seed: int = 0):
        if not tasks:
            raise UserError("the task mixture is empty; name at least one task.")
        weights = list(weights) if weights is not None else [1.0] * len(tasks)
        if len(weights) != len(tasks) or not all(0 < w < math.inf for w in weights):
            raise UserError(f"a task mixture needs one positive, finite weight per task (got {weights}).")
        self.tasks = list(tasks)
        size = sum(int(w) * len(t) + int(round((w - int(w)) * len(t))) for t, w in zip(self.tasks, weights))
        if size > MAX_MIXTURE:
            raise UserError(f"the task mixture would hold {size:,} examples, more than {MAX_MIXTURE:,} "
                            "(about 70 bytes of memory each); lower the task weights.")
        index: list[tuple[int, int]] = []
        for t, (task, w) in enumerate(zip(self.tasks, weights)):
            whole, frac = int(w), w - int(w)
            index += [(t, i) for _ in range(whole) for i in range(len(task))]
            index += [(t, i) for i in range(int(round(frac * len(task))))]
        if not index:
            raise UserError("the task mixture has no examples (its tasks are empty).")
        random.Random(seed).shuffle(index)
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        t, j = self.index[i]
        return self.tasks[t][j]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


# --- grading helpers ------------------------------------------------------------------------------

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def extract_answer(text: str) -> str | None:
    """The final numeric answer: after the last `####` (GSM8K's convention), else the last number."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].replace(",", "")
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


def render_parts(content) -> str:
    """An assistant message as the plain text a reader sees (tool calls and outputs inlined)."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part["type"] == "python":
            out.append(f"<|python_start|>{part['text']}<|python_end|>")
        elif part["type"] == "python_output":
            out.append(f"<|output_start|>{part['text']}<|output_end|>")
        else:
            out.append(part["text"])
    return "".join(out)

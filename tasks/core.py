"""Multiple-choice sets for base models, scored by the log-likelihood of continuations (the CORE
metric of DCLM, Li et al. 2024, as nanochat uses it). This module only builds the examples; the
scoring lives in flaxchat.evaluation.

A CoreExample is a plain dict:
  kind           "mc" or "schema"
  context        mc: one string; schema: a list of strings, one per option
  continuations  mc: one string per option; schema: a list of exactly one string
  gold           the index of the right option (into continuations for mc, into context for schema)
The text a model reads for option i is exactly `context + continuations[i]` (mc) or
`context[i] + continuations[0]` (schema): continuations carry their own leading space (or newline),
so nothing is inserted between the two, and the scored tokens are those of the continuation. The
prediction is the option whose continuation has the lowest mean loss per token; chance accuracy is
1 / number of options (CORE reports accuracy centred on it). Few-shot prompts, if wanted, are made by
the scorer from other examples' `context + continuations[gold]`.

Files read (parquet or jsonl, each dataset's published columns; `path` is a file, folder, glob or
`hf:` spec as for the chat tasks, see tasks._files; the hub repos of hellaswag and piqa are
script datasets, so name their parquet conversion, e.g. `hf:Rowan/hellaswag?revision=refs/convert/parquet`):
  hellaswag   Rowan/hellaswag: ctx, endings (4), label ("0"-"3"); split validation by default, since
              the test labels are hidden. Context ctx, continuations " " + ending (WikiHow's
              "[title]"/"[step]" markers cleaned as in lm-evaluation-harness).
  piqa        ybisk/piqa: goal, sol1, sol2, label (0/1). Context "Question: <goal>\\nAnswer:",
              continuations " " + sol1, " " + sol2.
  winogrande  allenai/winogrande: sentence with one "_", option1, option2, answer ("1"/"2"). Schema,
              as in the paper's partial scoring: contexts are the sentence up to "_" with each option
              filled in, the one continuation is the rest of the sentence.
  arc_easy, arc_challenge
              allenai/ai2_arc: question, choices {text, label}, answerKey. Context
              "Question: <question>\\nAnswer:", continuations " " + choice text.
Built in, no files: stories_cloze(size, seed) - the true next sentence of a held-out story from
flaxchat.data.stories against three sentences of other stories (details at `stories_cloze`).

`load_core(name, path=None, limit=None)` builds one set by its name in CORE_TASKS.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Literal, TypedDict

from flaxchat.data.stories import story
from flaxchat.errors import UserError
from tasks._files import dataset_files, read_rows
from tasks.arc import arc_choices


class CoreExample(TypedDict):
    kind: Literal["mc", "schema"]
    context: str | list[str]
    continuations: list[str]
    gold: int


def _rows(path: str | None, split: str, subset: str | None, dataset: str, columns: tuple, seed: int | None):
    rows = read_rows(dataset_files(path, split, subset, dataset), columns, dataset)
    if not rows:
        raise UserError(f"the {split} files of {dataset} at {path} hold no rows")
    if seed is not None:  # a fixed shuffle, so that load_core(limit=N) samples the whole set
        random.Random(seed).shuffle(rows)
    return rows


def _label(row: dict, key: str, dataset: str, n: int, offset: int = 0) -> int:
    """An integer gold label stored as an int or a string; unlabelled rows (hidden test labels:
    "" or -1) are a UserError."""
    try:
        gold = int(str(row[key]).strip()) - offset
    except ValueError:
        gold = -1
    if not 0 <= gold < n:
        raise UserError(f"a row of {dataset} has {key} {row[key]!r}, not a label of its {n} options; "
                        "test splits hide their labels, so use the validation split")
    return gold


# --- file-based sets ---------------------------------------------------------------------------------


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ").strip()


def hellaswag(path: str | None, split: str = "validation", seed: int | None = 0) -> list[CoreExample]:
    rows = _rows(path, split, None, "Rowan/hellaswag", ("ctx", "endings", "label"), seed)
    return [{"kind": "mc", "context": _hellaswag_text(r["ctx"]),
             "continuations": [" " + _hellaswag_text(e) for e in r["endings"]],
             "gold": _label(r, "label", "Rowan/hellaswag", len(r["endings"]))} for r in rows]


def piqa(path: str | None, split: str = "validation", seed: int | None = 0) -> list[CoreExample]:
    rows = _rows(path, split, None, "ybisk/piqa", ("goal", "sol1", "sol2", "label"), seed)
    return [{"kind": "mc", "context": f"Question: {r['goal'].strip()}\nAnswer:",
             "continuations": [" " + r["sol1"].strip(), " " + r["sol2"].strip()],
             "gold": _label(r, "label", "ybisk/piqa", 2)} for r in rows]


def winogrande(path: str | None, split: str = "validation", subset: str | None = "winogrande_xl",
               seed: int | None = 0) -> list[CoreExample]:
    rows = _rows(path, split, subset, "allenai/winogrande", ("sentence", "option1", "option2", "answer"), seed)
    out: list[CoreExample] = []
    for r in rows:
        sentence = r["sentence"]
        if sentence.count("_") != 1:
            raise UserError(f"a winogrande sentence must have one blank '_': {sentence!r}")
        before, _, after = sentence.partition("_")
        out.append({"kind": "schema", "context": [before + r["option1"], before + r["option2"]],
                    "continuations": [" " + after.strip()],
                    "gold": _label(r, "answer", "allenai/winogrande", 2, offset=1)})
    return out


def arc_core(path: str | None, split: str = "test", subset: str | None = "ARC-Easy",
             seed: int | None = 0) -> list[CoreExample]:
    rows = _rows(path, split, subset, "allenai/ai2_arc", ("question", "choices", "answerKey"), seed)

    def bad_row(row, why):
        return UserError(f"a row of allenai/ai2_arc at {path} {why}")

    out: list[CoreExample] = []
    for r in rows:
        texts, _, gold = arc_choices(r, bad_row)
        out.append({"kind": "mc", "context": f"Question: {r['question'].strip()}\nAnswer:",
                    "continuations": [" " + t.strip() for t in texts], "gold": gold})
    return out


# --- built in: stories cloze ------------------------------------------------------------------------

_TITLES = ("Mr.", "Mrs.", "Ms.", "Dr.")
_NAME = re.compile(r"[A-Z][a-z]+")


def _sentences(text: str) -> list[tuple[str, str]]:
    """(whitespace before it, sentence) for each sentence of a story; quotes are never cut, so
    `"Stop! Wait!" she said.` stays one sentence."""
    out = []
    for p, para in enumerate(text.split("\n")):
        start, sep = 0, "\n" if p else ""
        for m in re.finditer(r" +", para):
            before = para[start:m.start()]
            if (before.endswith((".", "!", "?", '."', '!"', '?"')) and before.count('"') % 2 == 0
                    and not before.endswith(_TITLES) and not para[m.end():m.end() + 1].islower()):
                out.append((sep, before))
                sep, start = m.group(), m.end()
        if para[start:]:
            out.append((sep, para[start:]))
    return out


def _names(sentence: str) -> set[str]:
    """Capitalised words inside a sentence (not its first word, not a quote's first word): the
    characters and places of the generated stories."""
    return {m.group() for m in _NAME.finditer(sentence)
            if m.start() >= 2 and sentence[m.start() - 1] == " " and sentence[m.start() - 2] not in '.!?"'}


def stories_cloze(size: int = 200, seed: int = 0, options: int = 4) -> list[CoreExample]:
    """Which sentence comes next? For held-out story i (flaxchat.data.stories, split "val", so a model
    pretrained on the train split has not seen it): the context is the story up to a sentence that
    names a character already met, the right continuation is that sentence, and the others are
    sentences of other stories that name only characters this story does not have. A model that
    follows who is in the story beats chance (1/options); the same (size, seed) gives the same set."""
    if size < 1 or options < 2:
        raise UserError(f"stories_cloze needs size >= 1 and options >= 2 (got size {size}, options {options})")
    out: list[CoreExample] = []
    index = 0
    while len(out) < size:
        rng = random.Random(f"flaxchat-stories-cloze/{seed}/{index}")
        text = story(seed, index, "val")
        index += 1
        sents = _sentences(text)
        everyone = set().union(*(_names(s) for _, s in sents))
        seen: set[str] = set()
        cuts = []
        for j, (_, s) in enumerate(sents):
            if j >= 2 and _names(s) & seen:
                cuts.append(j)
            seen |= _names(s)
        if not cuts:
            continue
        j = rng.choice(cuts)
        sep, truth = sents[j]
        others = _distractors(rng, seed, everyone, truth, options - 1)
        choices = [truth] + others
        rng.shuffle(choices)
        out.append({"kind": "mc", "context": "".join(p + s for p, s in sents[:j]),
                    "continuations": [sep + c for c in choices], "gold": choices.index(truth)})
    return out


def _distractors(rng: random.Random, seed: int, everyone: set[str], truth: str, n: int) -> list[str]:
    found: list[str] = []
    for _ in range(100 * n):
        if len(found) == n:
            return found
        # Stories far from the ones used as items (story indices are hashed, any integer works); not
        # their opening sentence, which would give itself away.
        sents = [s for _, s in _sentences(story(seed, rng.randrange(10**6, 10**7), "val"))[1:]]
        fit = [s for s in sents if _names(s) and not _names(s) & everyone and s != truth and s not in found]
        if fit:
            found.append(rng.choice(fit))
    raise RuntimeError(f"found {len(found)} of {n} distractor sentences in {100 * n} stories")


# --- registry -----------------------------------------------------------------------------------------

CORE_TASKS: dict[str, Callable[..., list[CoreExample]]] = {
    "hellaswag": hellaswag,
    "piqa": piqa,
    "winogrande": winogrande,
    "arc_easy": lambda path, **kw: arc_core(path, subset="ARC-Easy", **kw),
    "arc_challenge": lambda path, **kw: arc_core(path, subset="ARC-Challenge", **kw),
    "stories_cloze": stories_cloze,
}
BUILT_IN = ("stories_cloze",)


def load_core(name: str, path: str | None = None, limit: int | None = None, **kwargs) -> list[CoreExample]:
    """The examples of CORE set `name` (first `limit` of them; file-based sets are in a fixed
    shuffled order). kwargs go to the loader: split/seed for files, size/seed for stories_cloze."""
    if name not in CORE_TASKS:
        raise UserError(f"unknown CORE task {name!r}; known: {', '.join(CORE_TASKS)}")
    if limit is not None and limit < 1:
        raise UserError(f"limit must be at least 1 (got {limit})")
    if name in BUILT_IN:
        if path is not None:
            raise UserError(f"{name} is built in and reads no files; drop its path")
        if limit is not None:
            kwargs.setdefault("size", limit)
        return CORE_TASKS[name](**kwargs)[:limit]
    if not path:
        raise UserError(f"the CORE task {name} reads the dataset's files; give its path "
                        "(a parquet/jsonl file, folder, glob or hf: spec)")
    return CORE_TASKS[name](path, **kwargs)[:limit]

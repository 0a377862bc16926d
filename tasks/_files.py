"""What the real-dataset tasks share: finding a dataset's files, reading its rows, and the
multiple-choice prompt of MMLU and ARC.

A dataset `path` is what `flaxchat.data.sources` understands (a file, a folder, a glob, or a hub
spec `hf:owner/name[/pattern][?revision=R]`), narrowed to one split and one subset:
  hub spec without a pattern   the pattern `{subset}/{split}*` (no subset: `*{split}*`) is added,
                               which matches both the layout of hub parquet datasets
                               (`all/test-00000-of-00001.parquet`) and that of the hub's parquet
                               conversion of script datasets (`default/validation/0000.parquet`,
                               read with `?revision=refs/convert/parquet`)
  folder or glob               files whose path (below their common folder) names the subset are
                               kept if there are any; then the files naming the split, e.g.
                               `test-*.parquet` or `hellaswag_val.jsonl` (split "validation" also
                               accepts val/valid/dev when no file says validation); files that name
                               no split at all are all read
  one file                     read as it is, whatever split was asked for
Parquet files win over jsonl files when a folder holds both (hub snapshots sometimes do). A
HumanEval-style `.jsonl.gz` file is read when named directly.

Rows are dicts of the dataset's published columns, read once (these sets are small: MMLU's test
split is 14k rows) and served in a fixed shuffled order (`seed`; None keeps file order), as
nanochat does, so that a slice such as `stop=500` samples every subject instead of the first few.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from typing import Sequence

from flaxchat.data import sources
from flaxchat.errors import UserError
from tasks.base import Task

_ALIASES = {"validation": ("val", "valid", "dev"), "val": ("validation", "valid", "dev"),
            "valid": ("validation", "val", "dev"), "train": ("training",), "test": ("testing",)}
_SPLIT_WORDS = ("train", "training", "validation", "valid", "val", "dev", "test", "testing")


def _names(word: str) -> re.Pattern:
    """`word` as a whole name inside a path: not glued to other letters or digits."""
    return re.compile(rf"(^|[^a-z0-9]){re.escape(word.lower())}([^a-z0-9]|$)")


def _relative(files: list[str]) -> dict[str, str]:
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    return {f: os.path.relpath(f, root).lower() for f in files}


def pick_files(files: list[str], split: str, subset: str | None, spec: str) -> list[str]:
    """The files of one subset and split among `files`, by the rules in the module docstring."""
    if len(files) <= 1:
        return files
    rel = _relative(files)
    if subset:
        files = [f for f in files if _names(subset).search(rel[f])] or files
    chosen = next((c for c in ([f for f in files if _names(w).search(rel[f])]
                               for w in (split, *_ALIASES.get(split, ()))) if c), None)
    if chosen is None:
        if any(_names(w).search(rel[f]) for f in files for w in _SPLIT_WORDS):
            raise UserError(f"none of the files at {spec} is for split '{split}' (their names mark other "
                            "splits); name the split those files hold, or point at one file")
        chosen = files
    parquet = [f for f in chosen if f.endswith(".parquet")]
    return parquet or chosen


def dataset_files(path: str | None, split: str, subset: str | None, dataset: str) -> list[str]:
    """Local parquet/jsonl paths of `dataset` for `split` (a hub spec is downloaded or found in the
    local hub cache by flaxchat.data.sources)."""
    if not path:
        raise UserError(f"{dataset} needs a path: a parquet/jsonl file, folder or glob, or hf:{dataset}")
    if path.endswith(".jsonl.gz") and os.path.isfile(os.path.expanduser(path)):
        return [os.path.expanduser(path)]
    if path.startswith(("hf:", "hf://")):
        opts = sources.parse_hub_spec(path)
        spec = path
        if opts["pattern"] is None:
            base, sep, query = path.partition("?")
            spec = f"{base.rstrip('/')}/{f'{subset}/' if subset else '*'}{split}*{sep}{query}"
        # sources picks between train and held-out files only when a pattern matches both kinds.
        files, _, _ = sources.hub_files(spec, "train" if split in ("train", "training") else "val")
    else:
        files = sources.local_files(path)
    files = [f for f in files if f.endswith((".parquet", ".jsonl"))]
    if not files:
        raise UserError(f"no .parquet or .jsonl files at {path}; {dataset} is read from parquet or jsonl")
    return pick_files(files, split, subset, path)


def read_rows(files: Sequence[str], columns: Sequence[str], dataset: str) -> list[dict]:
    """Every row of `files` as a dict of `columns`; a file that lacks one of them is a UserError."""
    rows: list[dict] = []
    for f in files:
        if f.endswith(".parquet"):
            rows += _read_parquet(f, columns, dataset)
        else:
            rows += _read_jsonl(f, columns, dataset)
    return rows


def _missing(f: str, missing: list[str], columns: Sequence[str], dataset: str, where: str = "") -> UserError:
    return UserError(f"{f}{where} lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}; "
                     f"a {dataset} file has columns {', '.join(columns)}")


def _read_parquet(f: str, columns: Sequence[str], dataset: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise UserError(f"cannot read {f} as parquet ({e})") from None
    schema = handle.schema_arrow
    missing = [c for c in columns if c not in schema.names]
    # cais/mmlu's auxiliary_train files wrap each row in one struct column ("train").
    wrapper = [field.name for field in schema if pa.types.is_struct(field.type)
               and all(field.type.get_field_index(c) >= 0 for c in columns)]
    if missing and wrapper:
        return [row[wrapper[0]] for row in handle.read(columns=wrapper[:1]).to_pylist()]
    if missing:
        raise _missing(f, missing, columns, dataset)
    return handle.read(columns=list(columns)).to_pylist()


def _read_jsonl(f: str, columns: Sequence[str], dataset: str) -> list[dict]:
    rows = []
    with (gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb")) as lines:
        for n, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"line {n} of {f} is not UTF-8 text (byte {e.start + 1} of the line); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
                raise UserError(f"line {n} of {f} is not valid JSON") from None
            if not isinstance(row, dict):
                raise UserError(f"line {n} of {f} is not a JSON object")
            missing = [c for c in columns if c not in row]
            if missing:
                raise _missing(f, missing, columns, dataset, f" (line {n})")
            rows.append(row)
    return rows


class FileTask(Task):
    """A Task over the rows of a dataset's files, read on first use. Subclasses set `dataset`
    (the hub name, used in messages and as the default path), `columns`, `subset`, and write
    `convert(row)` -> conversation."""

    dataset = ""
    columns: tuple[str, ...] = ()

    def __init__(self, path: str | None, split: str, subset: str | None = None, seed: int | None = 0,
                 start: int = 0, stop: int | None = None, step: int = 1):
        super().__init__(start, stop, step)
        self.path, self.split, self.subset, self.seed = path, split, subset, seed
        self.files = dataset_files(path, split, subset, self.dataset)
        self._rows: list[dict] | None = None

    @property
    def rows(self) -> list[dict]:
        if self._rows is None:
            rows = read_rows(self.files, self.columns, self.dataset)
            if not rows:
                raise UserError(f"the {self.split} files of {self.dataset} at {self.path} hold no rows")
            # Every row converted once, here: a malformed row fails before any model loads, not
            # when training reaches it (460k SmolTalk-shaped rows: 3.4 s on a busy 2-core CPU).
            for row in rows:
                try:
                    self.convert(row)
                except UserError:
                    raise
                except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
                    raise self.bad_row(row, f"is not in the {self.dataset} format ({type(e).__name__}: {e})") from None
            if self.seed is not None:
                random.Random(self.seed).shuffle(rows)
            self._rows = rows
        return self._rows

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        return self.convert(self.rows[index])

    def convert(self, row: dict) -> dict:
        raise NotImplementedError

    def bad_row(self, row: dict, why: str) -> UserError:
        """A row that breaks the dataset's format, named so a person can find it."""
        ident = next((str(row[k]) for k in ("task_id", "id", "qID", "ind") if row.get(k) is not None), None)
        return UserError(f"a row of {self.dataset} at {self.path}{f' ({ident})' if ident else ''} {why}")


# --- multiple choice --------------------------------------------------------------------------------

LETTERS = "ABCDEFGHIJ"


def multiple_choice(question: str, choices: Sequence[str], topic: str | None = None) -> str:
    """The user message of a categorical task: the question, then one "A. choice" line per choice.
    Each letter starts a line, so it is the same bare token ("A", not " A") as the reply, which small
    models bind better (nanochat's `render_mc` note)."""
    head = f"The following is a multiple choice question{f' about {topic}' if topic else ''}.\n\n"
    lines = "".join(f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, choices))
    return f"{head}{question.strip()}\n\n{lines}\nAnswer with the letter of the correct choice only."


def letter_correct(conversation: dict, response: str) -> bool:
    """A categorical reply is right when it is exactly the gold letter (surrounding space aside)."""
    return response.strip() == conversation["messages"][-1]["content"]

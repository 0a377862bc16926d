"""Document sources: the built-in stories, local .txt/.jsonl/.parquet files, and Hugging Face datasets.

A source is any object with
  name: str                         what a person reads in logs ("3 parquet files matching data/*.parquet")
  __len__() -> int                  number of documents
  doc(i) -> str                     random access (the packing loader resumes by document index)
  iter_docs(start=0, step=1)        yields (i, text) for i = start, start+step, ...; process p of P
                                    reads start=p, step=P, so processes never share a document

Documents in files:
  .txt      one document per block of lines separated by blank lines; if the file contains lines
            that are exactly `<|endoftext|>` (the TinyStories .txt format), those lines separate
            documents instead and blank lines stay inside documents.
  .jsonl    one document per non-empty line, the string in field `text` (configurable).
  .parquet  one document per row, column `text` (configurable), read one row group at a time.

Parquet-only corpora (a folder or glob of .parquet files, local or `gs://...`, or a hub dataset
whose files are parquet) are *streaming* sources (`flaxchat.data.shards.ParquetShards`): they number
documents the same way, and in addition each of R readers reads its own row groups
(`iter_reader`), which `PackingLoader` uses instead of striding over documents. A `gs://` spec
is always a parquet folder, glob or file.

Splits: if the file names mark both a train split (`train`) and a validation split (`validation`,
`valid`, `val` or `dev`; else `test`), each split reads only its files (unmarked files are unused).
Otherwise the last 1% of documents (at least 1, at most 10,000) is the validation split and the
rest is train. Either way both splits are fixed by the file list alone, so they never overlap.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
import socket
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlparse

from flaxchat.data.shards import ParquetShards, list_shards
from flaxchat.data.stories import StoriesCorpus
from flaxchat.errors import UserError
from flaxchat.paths import is_remote

EXTENSIONS = (".txt", ".jsonl", ".parquet")
EOT_LINE = b"<|endoftext|>"
SPLITS = ("train", "val")
OFFLINE_HINT = "the built-in stories (--data=stories) are the offline default"


@runtime_checkable
class Source(Protocol):
    name: str

    def __len__(self) -> int: ...

    def doc(self, i: int) -> str: ...

    def iter_docs(self, start: int = 0, step: int = 1) -> Iterator[tuple[int, str]]: ...


# --- files ----------------------------------------------------------------------------------------


def _index_text_file(path: Path) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the documents of a .txt file, in one streaming pass."""
    # Both splittings are collected at once, since which one applies is known only at the end.
    blocks, eot_docs = [], []
    block = doc = None  # [start, end] of the open blank-line block / <|endoftext|> document
    saw_eot, pos = False, 0
    with open(path, "rb") as f:
        for line in f:
            end, stripped = pos + len(line), line.strip()
            if stripped == EOT_LINE:
                saw_eot = True
                eot_docs += [tuple(doc)] if doc else []
                blocks += [tuple(block)] if block else []
                doc = block = None
            elif stripped:
                doc = [doc[0] if doc else pos, end]
                block = [block[0] if block else pos, end]
            elif block:
                blocks.append(tuple(block))
                block = None
            pos = end
    eot_docs += [tuple(doc)] if doc else []
    blocks += [tuple(block)] if block else []
    return eot_docs if saw_eot else blocks


def _index_jsonl_file(path: Path) -> list[int]:
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return offsets


class _File:
    """One file's documents, indexed lazily; reads by seeking (text) or by row group (parquet)."""

    def __init__(self, path: Path, field: str):
        self.path, self.field, self.kind = path, field, path.suffix.lower()
        self._index = None  # .txt: byte ranges; .jsonl: line offsets; .parquet: row-group starts
        self._parquet = None
        self._cached_group: tuple[int, list] | None = None

    def __len__(self) -> int:
        if self._index is None:
            if self.kind == ".txt":
                self._index = _index_text_file(self.path)
            elif self.kind == ".jsonl":
                self._index = _index_jsonl_file(self.path)
            else:
                self._index = self._index_parquet()
        return self._index[-1] if self.kind == ".parquet" else len(self._index)

    def _index_parquet(self) -> list[int]:
        import pyarrow.parquet as pq

        try:
            self._parquet = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise UserError(f"cannot read {self.path} as parquet ({e})") from None
        names = self._parquet.schema_arrow.names
        if self.field not in names:
            raise UserError(f"{self.path} has no column '{self.field}' (columns: {', '.join(names)}); "
                            "name the one that holds the text (scripts.pretrain: --text-field; scripts.tok_train: --field)")
        starts = [0]
        for g in range(self._parquet.num_row_groups):
            starts.append(starts[-1] + self._parquet.metadata.row_group(g).num_rows)
        return starts

    def doc(self, i: int) -> str:
        len(self)  # builds the index
        if self.kind == ".parquet":
            g = bisect.bisect_right(self._index, i) - 1
            if self._cached_group is None or self._cached_group[0] != g:
                table = self._parquet.read_row_group(g, columns=[self.field])
                self._cached_group = (g, table.column(0).to_pylist())
            value = self._cached_group[1][i - self._index[g]]
            return value if isinstance(value, str) else "" if value is None else str(value)
        with open(self.path, "rb") as f:
            if self.kind == ".txt":
                start, end = self._index[i]
                f.seek(start)
                return f.read(end - start).decode("utf-8", errors="replace").strip()
            f.seek(self._index[i])
            line = f.readline()
        try:
            value = json.loads(line)[self.field]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"line {i + 1} of {self.path} is not a JSON object with a '{self.field}' field") from None
        return value if isinstance(value, str) else str(value)


class FileCorpus:
    """Documents from a list of .txt/.jsonl/.parquet files, numbered across files in list order."""

    def __init__(self, paths: list[str | Path], field: str = "text", name: str | None = None):
        self.files = [_File(Path(p), field) for p in paths]
        self.name = name or f"{len(paths)} files"
        self._starts: list[int] | None = None

    def _cumulative(self) -> list[int]:
        if self._starts is None:
            starts = [0]
            for f in self.files:
                starts.append(starts[-1] + len(f))
            self._starts = starts
        return self._starts

    def __len__(self) -> int:
        return self._cumulative()[-1]

    def doc(self, i: int) -> str:
        starts = self._cumulative()
        if not 0 <= i < starts[-1]:
            raise IndexError(f"document {i} is outside 0..{starts[-1] - 1}")
        k = bisect.bisect_right(starts, i) - 1
        return self.files[k].doc(i - starts[k])

    def iter_docs(self, start: int = 0, step: int = 1) -> Iterator[tuple[int, str]]:
        # Sequential indices hit the same parquet row group, which `_File` keeps decoded.
        for i in range(start, len(self), step):
            yield i, self.doc(i)


class SliceCorpus:
    """Documents lo..hi-1 of another source, renumbered from 0 (used for the held-out split)."""

    def __init__(self, base, lo: int, hi: int, name: str):
        self.base, self.lo, self.hi, self.name = base, lo, hi, name

    def __len__(self) -> int:
        return self.hi - self.lo

    def doc(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} is outside 0..{len(self) - 1}")
        return self.base.doc(self.lo + i)

    def iter_docs(self, start: int = 0, step: int = 1) -> Iterator[tuple[int, str]]:
        for i in range(start, len(self), step):
            yield i, self.base.doc(self.lo + i)


# --- splits ---------------------------------------------------------------------------------------

_SPLIT_WORDS = {"train": re.compile(r"(^|[^a-z])(train|training)([^a-z]|$)"),
                "val": re.compile(r"(^|[^a-z])(validation|valid|val|dev)([^a-z]|$)"),
                "test": re.compile(r"(^|[^a-z])(test|testing)([^a-z]|$)")}


def split_files(paths: list[str], split: str) -> list[str] | None:
    """The files of `split` when the names carry split words, else None (hold out documents).
    Only the part of each path below the files' common folder counts, so that a folder such as
    /home/me/training/ does not tag every file in it."""
    if not paths:
        return None
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    rel = {p: os.path.relpath(p, root).lower() for p in paths}
    tagged = {name: [p for p in paths if rx.search(rel[p])] for name, rx in _SPLIT_WORDS.items()}
    if not tagged["train"] or not (tagged["val"] or tagged["test"]):
        return None
    if split == "train":
        return tagged["train"]
    return tagged["val"] or tagged["test"]


def held_out_count(n_docs: int) -> int:
    """Validation documents held out of an untagged corpus: 1%, at least 1, at most 10,000."""
    return max(1, min(10_000, n_docs // 100))


def _check_split(split: str) -> str:
    split = {"validation": "val", "valid": "val"}.get(split, split)
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; use 'train' or 'val'")
    return split


def _corpus(files: list[str], field: str, name: str):
    """Parquet-only file lists stream (row group by row group, split among readers); others index."""
    if all(f.lower().endswith(".parquet") for f in files):
        return ParquetShards(files, field, name)
    return FileCorpus(files, field, name)


def files_source(files: list[str], split: str, field: str, spec: str, description: str):
    """A source over `files` (what `spec` names) for `split`, by the rules in the module docstring."""
    chosen = split_files(files, split)
    if chosen is not None:
        corpus = _corpus(chosen, field, f"{len(chosen)} {split} files of {description}")
        if len(corpus) == 0:
            raise UserError(f"the corpus at {spec} is empty (its {split} files hold no documents)")
        return corpus
    corpus = _corpus(files, field, description)
    n = len(corpus)
    if n == 0:
        raise UserError(f"the corpus at {spec} is empty")
    if n < 2:
        raise UserError(f"the corpus at {spec} has 1 document; a train/val split needs at least 2")
    n_val = held_out_count(n)
    lo, hi, name = ((n - n_val, n, f"{description} (val: last {n_val:,} of {n:,} docs)") if split == "val"
                    else (0, n - n_val, f"{description} (train: first {n - n_val:,} of {n:,} docs)"))
    if isinstance(corpus, ParquetShards):
        return corpus.slice(lo, hi, name)
    return SliceCorpus(corpus, lo, hi, name)


def local_files(spec: str) -> list[str]:
    """Expand a file, directory (recursive) or glob into sorted .txt/.jsonl/.parquet paths."""
    if any(c in spec for c in "*?["):
        matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
        if not matches:
            raise UserError(f"no .txt/.jsonl/.parquet files match '{spec}'")
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserError(f"data path '{spec}' does not exist")
        if path.is_file():
            if path.suffix.lower() not in EXTENSIONS:
                raise UserError(f"'{spec}' is not a .txt, .jsonl or .parquet file")
            return [str(path)]
        matches = sorted(str(p) for p in path.rglob("*"))
    files = [p for p in matches if os.path.isfile(p) and Path(p).suffix.lower() in EXTENSIONS]
    if not files:
        raise UserError(f"no .txt/.jsonl/.parquet files match '{spec}'")
    return files


def _describe(spec: str, files: list[str]) -> str:
    kinds = sorted({Path(f).suffix.lstrip(".").lower() for f in files})
    return f"{len(files)} {'/'.join(kinds)} file{'s' if len(files) != 1 else ''} matching {spec}"


# --- Hugging Face hub -------------------------------------------------------------------------------


def parse_hub_spec(spec: str) -> dict:
    """`hf:owner/name[/glob][?files=N&field=text&revision=R]` or `hf://datasets/owner/name[/glob]...`."""
    path, _, query = spec[len("hf://" if spec.startswith("hf://") else "hf:"):].partition("?")
    path = path.strip("/")
    if path.startswith("datasets/"):
        path = path[len("datasets/"):]
    parts = path.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise UserError(f"'{spec}' is not a hub dataset; write hf:owner/name, e.g. hf:roneneldan/TinyStories")
    options = dict(parse_qsl(query))
    unknown = set(options) - {"files", "field", "revision"}
    if unknown:
        raise UserError(f"unknown option '{sorted(unknown)[0]}' in '{spec}'; known: files, field, revision")
    try:
        max_files = int(options["files"]) if "files" in options else None
    except ValueError:
        raise UserError(f"files={options['files']} in '{spec}' is not a whole number") from None
    return {"repo": "/".join(parts[:2]), "pattern": "/".join(parts[2:]) or None, "max_files": max_files,
            "field": options.get("field", "text"), "revision": options.get("revision")}


def select_hub_files(files: list[str], split: str, pattern: str | None,
                     max_files: int | None) -> tuple[list[str], bool]:
    """Data files to download for `split`, and whether the file names decided the split.
    Files matching `pattern` (default: all of the most preferred kind, parquet > jsonl > txt),
    restricted to the split's files when names mark the splits (otherwise all of them: documents
    are held out after download), then the first `max_files`."""
    import fnmatch

    if pattern:
        candidates = [f for f in files if fnmatch.fnmatch(f, pattern) and f.lower().endswith(EXTENSIONS)]
    else:
        candidates = []
        for ext in (".parquet", ".jsonl", ".txt"):
            candidates = [f for f in files if f.lower().endswith(ext)]
            if candidates:
                break
    candidates = sorted(candidates)
    chosen = split_files(candidates, split)
    by_name = chosen is not None
    chosen = chosen if by_name else candidates
    return (chosen[:max_files] if max_files else chosen), by_name


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """A fast TCP probe: the hub client retries for ~25 s before giving up on a dead network."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy decides; the probe would be wrong
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_files(spec: str, split: str) -> tuple[list[str], bool, dict]:
    """Download (or find in the local hub cache) the files of a hub dataset for `split`; return
    their local paths, whether the file names decided the split, and the parsed spec."""
    opts = parse_hub_spec(spec)
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise UserError(f"reading '{spec}' needs the huggingface_hub package (pip install -e '.[hub]' in the flaxchat checkout); "
                        f"{OFFLINE_HINT}") from None
    repo, revision = opts["repo"], opts["revision"]
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    if offline or not _hub_reachable(constants.ENDPOINT):
        return *_cached_hub_files(opts, split, offline), opts
    try:
        listing = huggingface_hub.list_repo_files(repo, repo_type="dataset", revision=revision)
        names, by_name = select_hub_files(listing, split, opts["pattern"], opts["max_files"])
        if not names and not opts["pattern"] and revision is None:
            # The hub keeps an automatic parquet conversion of most datasets on this branch.
            revision = "refs/convert/parquet"
            listing = huggingface_hub.list_repo_files(repo, repo_type="dataset", revision=revision)
            names, by_name = select_hub_files(listing, split, None, opts["max_files"])
        if not names:
            raise UserError(f"the hub dataset '{repo}' has no .parquet/.jsonl/.txt files for split '{split}'"
                            + (f" matching '{opts['pattern']}'" if opts["pattern"] else ""))
        print(f"downloading {len(names)} file(s) of hf:{repo} (cached after the first time)...")
        paths = [huggingface_hub.hf_hub_download(repo, n, repo_type="dataset", revision=revision) for n in names]
        return paths, by_name, opts
    except UserError:
        raise
    except Exception as e:  # network, auth and missing-repo errors all mean the same to the user
        raise UserError(f"cannot read hub dataset '{repo}' ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        f"check its name and the network, or use local files; {OFFLINE_HINT}") from None


def _cached_hub_files(opts: dict, split: str, offline: bool) -> tuple[list[str], bool]:
    """Files of a dataset already in the local hub cache, for runs without a network."""
    import huggingface_hub

    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub cannot be reached"
    try:
        root = huggingface_hub.snapshot_download(opts["repo"], repo_type="dataset", revision=opts["revision"],
                                                 local_files_only=True)
    except Exception:
        raise UserError(f"{why} and '{opts['repo']}' is not in the local hub cache; {OFFLINE_HINT}") from None
    rel = [str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()]
    names, by_name = select_hub_files(rel, split, opts["pattern"], opts["max_files"])
    if not names:
        raise UserError(f"{why} and the cached copy of '{opts['repo']}' has no data files for split '{split}'; "
                        f"{OFFLINE_HINT}")
    return [str(Path(root) / n) for n in names], by_name


# --- entry point ------------------------------------------------------------------------------------


def resolve_source(spec: str | None, split: str = "train", seed: int = 0, field: str = "text"):
    """`None`/"stories" -> built-in stories; "hf:owner/name..." -> hub dataset; "gs://..." -> a
    folder, glob or file of parquet shards; else a local path, directory or glob of
    .txt/.jsonl/.parquet files (parquet only: streaming). `field` names the JSON field / parquet column
    that holds the text (a hub spec sets it with `?field=`)."""
    split = _check_split(split)
    if spec is None or spec == "stories":
        return StoriesCorpus(seed=seed, split=split)
    if spec.startswith("hf:"):
        files, by_name, opts = hub_files(spec, split)
        if by_name:  # the download holds this split's files only
            corpus = _corpus(files, opts["field"], f"{len(files)} {split} files of hf:{opts['repo']}")
            if len(corpus) == 0:
                raise UserError(f"the corpus at {spec} is empty")
            return corpus
        return files_source(files, split, opts["field"], spec, f"hf:{opts['repo']}")
    files = list_shards(spec) if is_remote(spec) else local_files(spec)
    return files_source(files, split, field, spec, _describe(spec, files))

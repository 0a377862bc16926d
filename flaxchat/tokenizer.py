"""Byte-level BPE tokenizer: trained with rustbpe, run with tiktoken, plus chat rendering.

This follows nanochat's `RustBPETokenizer`: rustbpe learns the merges (fast, parallel, GPT-4 style
regex pre-split), and tiktoken encodes and decodes with them (faster than rustbpe's own encoder,
with a thread-parallel batch path). The special tokens come after the BPE ranks, and the requested
vocab size counts them, so `vocab_size` is exactly the embedding table size the model needs.

Saved form: one `tokenizer.json` with the token bytes in rank order (base64), the split pattern
and the special tokens. JSON rather than a pickle so loading a tokenizer never runs code.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from flaxchat.errors import UserError
from flaxchat.paths import write_json

# GPT-4's pattern with numbers split into groups of 1-2 digits instead of 1-3 (nanochat's choice:
# it wastes fewer tokens on number chunks at small vocab sizes).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|bos|>",  # every document starts with it; it is also the document separator
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calls the Python tool
    "<|output_start|>", "<|output_end|>",  # the tool's output, written back into the context
)
FILENAME = "tokenizer.json"
FORMAT_VERSION = 1


def _capped(texts: Iterable[str], max_chars: int, doc_cap: int) -> Iterator[str]:
    """Yield texts until `max_chars` characters in total; each text is cut to `doc_cap` characters
    so one huge document cannot dominate the merge statistics (nanochat uses 10,000)."""
    left = max_chars
    for text in texts:
        if left <= 0:
            return
        text = text[: min(doc_cap, left)]
        left -= len(text)
        yield text


class Tokenizer:
    """A byte-level BPE tokenizer with nanochat's special tokens; see the module docstring."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN, meta: dict | None = None):
        import tiktoken  # deferred: importing this module stays cheap

        n = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError("mergeable ranks must be exactly 0..n-1")
        specials = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="flaxchat", pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=specials)
        self.mergeable_ranks = mergeable_ranks
        self.pattern = pattern
        self.meta = dict(meta or {})
        self._special_ids = specials
        self._token_bytes: np.ndarray | None = None

    # --- training, saving, loading -----------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, max_chars: int = 50_000_000,
              doc_cap: int = 10_000) -> "Tokenizer":
        """Learn BPE merges on at most `max_chars` characters of `texts`. `vocab_size` includes the
        special tokens; if the text is too small to learn that many merges, raise UserError."""
        import rustbpe

        n_ranks = vocab_size - len(SPECIAL_TOKENS)
        if n_ranks < 256:
            raise UserError(f"vocab size {vocab_size} is too small: it must be at least "
                            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        chars = [0]

        def counted() -> Iterator[str]:
            for text in _capped(texts, max_chars, doc_cap):
                chars[0] += len(text)
                yield text

        t0 = time.perf_counter()
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(counted(), n_ranks, pattern=SPLIT_PATTERN)
        ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
        if len(ranks) < n_ranks:
            raise UserError(f"the training text ({chars[0]:,} characters) only supports a vocab size of "
                            f"{len(ranks) + len(SPECIAL_TOKENS)}, not {vocab_size}; use more text or a "
                            "smaller vocab size")
        meta = {"train_chars": chars[0], "train_seconds": round(time.perf_counter() - t0, 3)}
        return cls(ranks, bpe.get_pattern(), meta)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `directory/tokenizer.json` atomically (temp file + rename), so concurrent processes
        that train the same tokenizer never leave a half-written file."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        payload = {
            "format": FORMAT_VERSION,
            "pattern": self.pattern,
            "special_tokens": list(SPECIAL_TOKENS),
            "tokens": [base64.b64encode(token).decode("ascii") for token, _ in by_rank],
            "meta": self.meta,
        }
        path = directory / FILENAME
        write_json(str(path), payload)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        path = Path(directory) / FILENAME
        if not path.is_file():
            raise UserError(f"no tokenizer at {path}; train one with `python -m scripts.tok_train --out {directory}`")
        try:
            payload = json.loads(path.read_text())
            tokens = [base64.b64decode(t) for t in payload["tokens"]]
        except (ValueError, KeyError) as e:
            raise UserError(f"the tokenizer file {path} is corrupt ({e}); delete it and train again") from None
        if payload.get("format") != FORMAT_VERSION or tuple(payload.get("special_tokens", ())) != SPECIAL_TOKENS:
            raise UserError(f"the tokenizer file {path} was written by another version; delete it and train again")
        return cls({t: i for i, t in enumerate(tokens)}, payload["pattern"], payload.get("meta"))

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the split pattern, the token bytes in rank order and the
        special tokens: what a checkpoint records, so that a model is never resumed, finetuned or
        initialised with another tokenizer of the same size (its token ids would mean other text)."""
        import hashlib
        h = hashlib.sha256(self.pattern.encode("utf-8"))
        for token, _ in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(len(token).to_bytes(4, "little") + token)
        h.update("\n".join(SPECIAL_TOKENS).encode("utf-8"))
        return h.hexdigest()[:16]

    def check_matches(self, saved: str | None, what: str, advice: str) -> None:
        """One sentence when `what` (a checkpoint) recorded another tokenizer's fingerprint `saved`;
        a checkpoint from before fingerprints (None) is taken as it is."""
        if saved and saved != self.fingerprint():
            raise UserError(f"{what} was trained with another tokenizer (fingerprint {saved}, this one "
                            f"{self.fingerprint()}): its token ids would mean other text; {advice}")

    # --- encoding --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    @property
    def bos_token_id(self) -> int:
        return self._special_ids["<|bos|>"]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_ids)

    def encode_special(self, name: str) -> int:
        try:
            return self._special_ids[name]
        except KeyError:
            raise ValueError(f"unknown special token {name!r}; known: {', '.join(SPECIAL_TOKENS)}") from None

    def _special_id(self, token: int | str | None) -> int | None:
        return token if token is None or isinstance(token, int) else self.encode_special(token)

    def encode(self, text: str | list[str], prepend: int | str | None = None, append: int | str | None = None,
               num_threads: int = 8) -> list[int] | list[list[int]]:
        """Encode ordinary text (special-token strings in it are just text). A list is encoded with
        tiktoken's thread-parallel batch path. `prepend`/`append` add a special token by id or name."""
        pre, post = self._special_id(prepend), self._special_id(append)
        if isinstance(text, str):
            ids = self.enc.encode_ordinary(text)
            return ([pre] if pre is not None else []) + ids + ([post] if post is not None else [])
        batch = self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)
        if pre is not None:
            batch = [[pre] + ids for ids in batch]
        if post is not None:
            for ids in batch:
                ids.append(post)
        return batch

    __call__ = encode

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def id_to_token(self, token_id: int) -> str:
        return self.enc.decode([token_id])

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): UTF-8 byte length of each token, 0 for special tokens. Dividing a
        summed loss by the summed bytes gives bits per byte, comparable across vocab sizes."""
        if self._token_bytes is None:
            out = np.zeros(self.vocab_size, dtype=np.int32)
            for token, rank in self.mergeable_ranks.items():
                out[rank] = len(token)
            self._token_bytes = out
        return self._token_bytes

    # --- chat ------------------------------------------------------------------------------------

    def render_conversation(self, conversation: dict, max_tokens: int = 2048) -> tuple[list[int], list[int]]:
        """Token ids and a 0/1 training mask for a chat (nanochat's format). The mask is 1 exactly on
        what the assistant writes: its text, its Python calls, and `<|assistant_end|>`; tool outputs,
        user turns and the framing tokens are 0. Both lists are cut to `max_tokens`."""
        messages = _merged_messages(conversation)
        s = self._special_ids
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: int | list[int], trained: int) -> None:
            tokens = [tokens] if isinstance(tokens, int) else tokens
            ids.extend(tokens)
            mask.extend([trained] * len(tokens))

        add(self.bos_token_id, 0)
        for message in messages:
            content = message["content"]
            if message["role"] == "user":
                if not isinstance(content, str):
                    raise UserError("a user message's content must be a string")
                add(s["<|user_start|>"], 0)
                add(self.encode(content), 0)
                add(s["<|user_end|>"], 0)
                continue
            add(s["<|assistant_start|>"], 0)
            for part in _parts(content):
                value = self.encode(part["text"])
                if part["type"] == "text":
                    add(value, 1)
                elif part["type"] == "python":
                    add(s["<|python_start|>"], 1)
                    add(value, 1)
                    add(s["<|python_end|>"], 1)
                elif part["type"] == "python_output":
                    # The tool writes this at inference time; the model must not learn to produce it.
                    add(s["<|output_start|>"], 0)
                    add(value, 0)
                    add(s["<|output_end|>"], 0)
                else:
                    raise UserError(f"unknown assistant content part type {part['type']!r}; "
                                    "use 'text', 'python' or 'python_output'")
            add(s["<|assistant_end|>"], 1)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation: dict) -> list[int]:
        """Prompt ids for sampling the assistant's reply: the conversation without its last
        (assistant) message, followed by `<|assistant_start|>`."""
        conversation = copy.deepcopy(conversation)
        messages = conversation.get("messages") or []
        if not messages or messages[-1].get("role") != "assistant":
            raise UserError("render_for_completion needs a conversation that ends with an assistant message")
        messages.pop()
        ids, _ = self.render_conversation(conversation, max_tokens=1 << 62)
        return ids + [self._special_ids["<|assistant_start|>"]]

    def visualize(self, ids: list[int], mask: list[int]) -> str:
        """Debug view: trained tokens in green, the rest grey (ANSI colours)."""
        green, grey, reset = "\033[92m", "\033[90m", "\033[0m"
        return "|".join(f"{green if m else grey}{self.id_to_token(i)}{reset}" for i, m in zip(ids, mask))


def _merged_messages(conversation: dict) -> list[dict]:
    """Messages with a leading system message folded into the first user message (the format has
    no system role), checked to alternate user/assistant starting with the user."""
    messages = list(conversation.get("messages") or [])
    if not messages:
        raise UserError("a conversation needs at least one message")
    if messages[0].get("role") == "system":
        if len(messages) < 2 or messages[1].get("role") != "user":
            raise UserError("a system message must be followed by a user message")
        first = dict(messages[1])
        first["content"] = f"{messages[0]['content']}\n\n{messages[1]['content']}"
        messages = [first] + messages[2:]
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.get("role") != expected:
            raise UserError(f"message {i} has role {message.get('role')!r} but {expected!r} was expected: "
                            "roles must alternate user/assistant, starting with user")
    return messages


def _parts(content: str | list[dict]) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise UserError(f"assistant content must be a string or a list of parts, not {type(content).__name__}")


# --- default location and train-once helper ------------------------------------------------------


def fingerprint_beside(path: str) -> str | None:
    """The fingerprint of the tokenizer saved with the weights at `path` (a run folder's
    `tokenizer/`, or the `tokenizer/` beside an exported model.pkl / weights.npz), None if none."""
    from flaxchat import paths
    folder = path if paths.isdir(path) else paths.parent(path)
    found = paths.join(folder, "tokenizer")
    if not paths.exists(paths.join(found, FILENAME)):
        return None
    with paths.local_copy(found, upload=False) as local:
        return Tokenizer.load(local).fingerprint()


def get_default_tokenizer_dir() -> Path:
    """`$FLAXCHAT_BASE_DIR/tokenizer`, default `~/.cache/flaxchat/tokenizer`."""
    base = os.environ.get("FLAXCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")
    from flaxchat.paths import RunFolder
    return Path(base) / RunFolder.TOKENIZER  # the same name as in a run folder


def train_or_load(directory: str | os.PathLike | None, texts_fn: Callable[[], Iterable[str]], vocab_size: int,
                  max_chars: int = 10_000_000, log: Callable[[str], object] | None = print) -> Tokenizer:
    """Load the tokenizer in `directory` (default: `get_default_tokenizer_dir()`); if there is none,
    train one on `texts_fn()` and save it there, so the first run trains and later runs reuse it.
    The default 10M characters train a 4096-token vocabulary on the built-in stories in ~3 s."""
    directory = Path(directory) if directory is not None else get_default_tokenizer_dir()
    if (directory / FILENAME).is_file():
        tok = Tokenizer.load(directory)
        if tok.vocab_size != vocab_size:
            raise UserError(f"the tokenizer in {directory} has vocab size {tok.vocab_size}, not {vocab_size}; "
                            "pass that vocab size, another tokenizer directory, or delete it to retrain")
        return tok
    if log:
        log(f"training a {vocab_size}-token tokenizer into {directory} (first run only)...")
    tok = Tokenizer.train(texts_fn(), vocab_size, max_chars=max_chars)
    tok.save(directory)
    if log:
        log(f"tokenizer trained on {tok.meta['train_chars']:,} characters in {tok.meta['train_seconds']:.1f} s")
    return tok


def texts_of(source, max_docs: int | None = None) -> Iterator[str]:
    """The texts of a document source (see `flaxchat.data.sources`), optionally the first `max_docs`."""
    docs = (text for _, text in source.iter_docs())
    return itertools.islice(docs, max_docs) if max_docs is not None else docs

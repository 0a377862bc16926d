"""Evaluation: CORE-style likelihood scoring, task accuracy, validation bits per byte.

* `core_score`: nanochat's CORE (after DCLM) at zero shots. A multiple-choice example ("mc") is
  scored by the mean loss of each continuation's tokens after the shared context; a "schema"
  example by the mean loss of the one shared continuation after each context. The lowest loss is
  the prediction. `centered` rescales accuracy so random guessing is 0 and perfect is 1, as the
  CORE metric does per task before averaging tasks.
* `categorical_accuracy`: one forward per prompt, the answer is the letter whose token has the
  highest logit at the position after `<|assistant_start|>` (nanochat's MMLU/ARC evaluation).
* `generative_accuracy`: the Engine samples a reply (tool calls run), the task grades it.

Likelihood rows are padded to a few bucket lengths (powers of two up to the model's context) and a
fixed number of rows, so the jitted forward compiles once per bucket, not once per example; the
causal mask keeps the padding after a row out of its real positions. Rows longer than the context
lose tokens from the left (the continuation is kept).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.errors import UserError
from flaxchat.train import token_losses

MIN_BUCKET = 32
Progress = Callable[[int, int], object] | None  # progress(done, total)


# --- batched forward over rows of different lengths -------------------------------------------------


@nnx.jit
def _next_token_losses(model, tokens):
    """tokens (B, L) -> loss of each next token (B, L) in nats; the last column is 0."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.full((tokens.shape[0], 1), -1, tokens.dtype)], axis=1)
    return token_losses(model, tokens, targets)


@nnx.jit
def _last_logits(model, tokens, lengths):
    """tokens (B, L), lengths (B,) -> logits (B, V) at each row's last real position."""
    logits = model(tokens)
    return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def buckets(seq_len: int) -> list[int]:
    """Row lengths the forward is compiled for: 32, 64, ... and the context length itself."""
    out, b = [], MIN_BUCKET
    while b < seq_len:
        out.append(b)
        b *= 2
    return out + [seq_len]


def _batched(fn, model, rows: Sequence[Sequence[int]], batch_size: int, progress: Progress = None) -> list[np.ndarray]:
    """fn(model, tokens (batch_size, L), lengths) for every row, grouped by bucket; results in row order."""
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1 (got {batch_size}).")
    sizes = buckets(model.config.sequence_len)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[next(b for b in sizes if b >= len(row))].append(i)
    out: list[np.ndarray | None] = [None] * len(rows)
    done = 0
    for length, members in sorted(groups.items()):
        for s in range(0, len(members), batch_size):
            chunk = members[s:s + batch_size]
            tokens = np.zeros((batch_size, length), np.int32)
            lengths = np.ones(batch_size, np.int32)
            for j, i in enumerate(chunk):
                tokens[j, :len(rows[i])] = rows[i]
                lengths[j] = len(rows[i])
            res = np.asarray(fn(model, jnp.asarray(tokens), jnp.asarray(lengths)))
            for j, i in enumerate(chunk):
                out[i] = res[j]
            done += len(chunk)
            if progress:
                progress(done, len(rows))
    return out  # type: ignore[return-value]


def _crop_left(tokens: list[int], start: int, seq_len: int) -> tuple[list[int], int]:
    """Keep the last seq_len tokens; the scored span starts at `start` (at least 1: a token needs
    one before it to be predicted)."""
    cut = max(0, len(tokens) - seq_len)
    return tokens[cut:], max(1, start - cut)


# --- CORE: likelihood of continuations ----------------------------------------------------------------


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _common_suffix(seqs: list[list[int]]) -> int:
    return _common_prefix([s[::-1] for s in seqs])


def core_rows(tokenizer, example: dict, seq_len: int) -> list[tuple[list[int], int]]:
    """(tokens, start) per choice: the scored tokens are tokens[start:]. As nanochat, each choice is
    tokenised whole (BOS + context + continuation; continuations carry their own leading space, see
    tasks.core) and the scored span is found by the tokens the choices share: the common prefix for
    "mc", the common suffix for "schema"."""
    kind = example.get("kind", "mc")
    delim = example.get("delimiter", "")
    if kind == "mc":
        texts = [f"{example['context']}{delim}{c}" for c in example["continuations"]]
    elif kind == "schema":
        (cont,) = example["continuations"]
        texts = [f"{ctx}{delim}{cont}" for ctx in example["context"]]
    else:
        raise UserError(f"unknown CORE example kind {kind!r}; use 'mc' or 'schema'.")
    if len(texts) < 2:
        raise UserError(f"a CORE example needs at least two choices (got {len(texts)}).")
    seqs = tokenizer.encode(texts, prepend=tokenizer.bos_token_id)
    if kind == "mc":
        # At least one token of every choice is scored, even when one continuation is a prefix of another.
        start = min(_common_prefix(seqs), min(len(s) for s in seqs) - 1)
        starts = [start] * len(seqs)
    else:
        suffix = max(1, min(_common_suffix(seqs), min(len(s) for s in seqs) - 1))
        starts = [len(s) - suffix for s in seqs]
    return [_crop_left(s, st, seq_len) for s, st in zip(seqs, starts)]


def choice_losses(model, tokenizer, examples: Sequence[dict], batch_size: int = 16,
                  progress: Progress = None) -> list[np.ndarray]:
    """Per example, the mean loss (nats per token) of each choice's scored tokens."""
    T = model.config.sequence_len
    per_example = [core_rows(tokenizer, ex, T) for ex in examples]
    flat = [row for rows in per_example for row in rows]
    losses = _batched(lambda m, x, _: _next_token_losses(m, x), model, [t for t, _ in flat], batch_size, progress)
    means, k = [], 0
    for rows in per_example:
        # The loss at position p is of token p+1, so tokens[start:] are scored at start-1 .. len-2.
        means.append(np.array([losses[k + j][st - 1:len(t) - 1].mean() for j, (t, st) in enumerate(rows)]))
        k += len(rows)
    return means


def core_score(model, tokenizer, examples: Sequence[dict], batch_size: int = 16, progress: Progress = None) -> dict:
    """accuracy, centered accuracy ((acc - chance) / (1 - chance)) and n over the examples."""
    examples = list(examples)
    if not examples:
        raise UserError("the CORE set has no examples.")
    means = choice_losses(model, tokenizer, examples, batch_size, progress)
    correct = [int(np.argmin(m)) == int(ex["gold"]) for m, ex in zip(means, examples)]
    accuracy = float(np.mean(correct))
    chance = float(np.mean([1.0 / len(m) for m in means]))
    return dict(accuracy=accuracy, centered=(accuracy - chance) / (1.0 - chance), n=len(examples))


# --- chat tasks ------------------------------------------------------------------------------------------


def _examples(task, limit: int | None) -> list[dict]:
    if limit is not None and limit < 1:
        raise UserError(f"limit must be at least 1 (got {limit}).")
    n = len(task) if limit is None else min(limit, len(task))
    if n == 0:
        raise UserError(f"task {getattr(task, 'name', task)} has no examples.")
    return [task[i] for i in range(n)]


def letter_ids(tokenizer, letters: Sequence[str]) -> list[int]:
    ids = []
    for letter in letters:
        tok = tokenizer.encode(letter)
        if len(tok) != 1:
            raise UserError(f"the answer letter {letter!r} is {len(tok)} tokens in this tokenizer; "
                            "categorical tasks need letters that are one token each.")
        ids.append(tok[0])
    return ids


def categorical_accuracy(model, tokenizer, task, limit: int | None = None, batch_size: int = 16,
                         progress: Progress = None) -> dict:
    """The letter with the highest logit after the prompt is the answer; task.evaluate grades it."""
    examples = _examples(task, limit)
    T = model.config.sequence_len
    prompts = [tokenizer.render_for_completion(conv)[-T:] for conv in examples]
    logits = _batched(_last_logits, model, prompts, batch_size, progress)
    correct = 0
    for conv, row in zip(examples, logits):
        letters = conv["letters"]
        pick = letters[int(np.argmax(row[letter_ids(tokenizer, letters)]))]
        correct += bool(task.evaluate(conv, pick))
    return dict(accuracy=correct / len(examples), n=len(examples))


def reply_text(tokenizer, tokens: Sequence[int]) -> str:
    """A sampled reply as text, tool calls and outputs inlined with their special tokens, the form
    `tasks.base.render_parts` gives a stored conversation."""
    return tokenizer.decode(list(tokens))


def generative_accuracy(engine, tokenizer, task, limit: int | None = None, num_samples: int = 1,
                        max_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
                        seed: int = 0, progress: Progress = None) -> dict:
    """pass@k: an example counts when any of its `num_samples` replies passes task.evaluate (k=1
    with temperature 0 is greedy accuracy). Prompts that leave no room in the context fail."""
    examples = _examples(task, limit)
    T = engine.config.sequence_len
    correct = too_long = 0
    for i, conv in enumerate(examples):
        prompt = tokenizer.render_for_completion(conv)
        if len(prompt) >= T:
            too_long += 1
        else:
            samples, _ = engine.generate_batch(prompt, num_samples, max_tokens, temperature=temperature,
                                               top_k=top_k, seed=seed + i)
            correct += any(task.evaluate(conv, reply_text(tokenizer, s)) for s in samples)
        if progress:
            progress(i + 1, len(examples))
    return dict(accuracy=correct / len(examples), n=len(examples), too_long=too_long)


# --- by name ---------------------------------------------------------------------------------------------


def load_task(spec: str, split: str = "val"):
    """'name' or 'name:PATH' (a file, folder, glob or hf: spec) -> the Task from tasks.get_task."""
    from tasks import get_task
    from tasks import split_spec
    name, path = split_spec(spec)
    return get_task(name, split=split, **({"path": path} if path else {}))


def run_task(name: str, model, tokenizer, engine=None, split: str = "val", limit: int | None = None,
             task=None, progress: Progress = None, **generation) -> dict:
    """Evaluate one task ('name' or 'name:PATH', or a Task given as `task`) by its eval_type; returns
    a result row {task, metric, value, n, seconds, ...}. `generation` goes to generative_accuracy."""
    t0 = time.time()
    task = task if task is not None else load_task(name, split)
    if task.eval_type == "categorical":
        res = categorical_accuracy(model, tokenizer, task, limit, progress=progress)
        metric = "accuracy"
    elif task.eval_type == "generative":
        if engine is None:
            from flaxchat.engine import Engine
            engine = Engine(model, tokenizer, tools=True)
        res = generative_accuracy(engine, tokenizer, task, limit, progress=progress, **generation)
        metric = f"pass@{generation.get('num_samples', 1)}"
    else:
        raise UserError(f"task {name} has eval_type {task.eval_type!r}; expected 'categorical' or 'generative'.")
    extra = {k: v for k, v in res.items() if k not in ("accuracy", "n")}
    return dict(task=name, metric=metric, value=res["accuracy"], n=res["n"], seconds=time.time() - t0, **extra)


def run_core(name: str, model, tokenizer, examples: Sequence[dict], batch_size: int = 16,
             progress: Progress = None) -> list[dict]:
    """Two rows for one CORE set: its accuracy and its centered accuracy."""
    t0 = time.time()
    res = core_score(model, tokenizer, examples, batch_size, progress)
    seconds = time.time() - t0
    return [dict(task=name, metric="accuracy", value=res["accuracy"], n=res["n"], seconds=seconds),
            dict(task=name, metric="centered", value=res["centered"], n=res["n"], seconds=seconds)]


def core_metric(rows: Sequence[dict]) -> dict | None:
    """nanochat's CORE: the mean of the centered accuracies of the CORE sets (None without any)."""
    centered = [r for r in rows if r["metric"] == "centered"]
    if not centered:
        return None
    return dict(task="CORE", metric="mean centered", value=float(np.mean([r["value"] for r in centered])),
                n=len(centered), seconds=sum(r["seconds"] for r in centered))


# --- bits per byte -----------------------------------------------------------------------------------------


def evaluate_bpb(model, source, tokenizer, tokens: int, batch_size: int) -> float:
    """Bits per byte of `model` on the first `tokens` of `source` (a `flaxchat.data.sources` text
    source), packed as pretraining packs its rows; special tokens carry no bytes and are left out."""
    from flaxchat.data.loader import PackingLoader
    from flaxchat.train import bits_per_byte, eval_step

    T = model.config.sequence_len
    loader = PackingLoader(source, tokenizer, batch_size, T, process_index=0, process_count=1)
    token_bytes = jnp.asarray(tokenizer.token_bytes())
    nats = nbytes = 0.0
    for _ in range(max(1, tokens // (batch_size * T))):
        x, y = loader.next_batch()
        a, b, _ = eval_step(model, jnp.asarray(x), jnp.asarray(y), token_bytes)
        nats, nbytes = nats + float(a), nbytes + float(b)
    return bits_per_byte(nats, nbytes)


def validation_bpb(model, tokenizer, data: str = "stories", tokens: int = 65_536, batch_size: int = 8,
                   seed: int = 0) -> dict:
    """Bits per byte on the val split of `data`, as pretraining's evaluation measures it."""
    from flaxchat.data.sources import resolve_source
    T = model.config.sequence_len
    bpb = evaluate_bpb(model, resolve_source(data, split="val", seed=seed), tokenizer, tokens, batch_size)
    return dict(bpb=bpb, tokens=max(1, tokens // (batch_size * T)) * batch_size * T)


# --- tables ------------------------------------------------------------------------------------------------

COLUMNS = ("task", "metric", "value", "n", "seconds")


def _cells(row: dict) -> list[str]:
    value = row["value"]
    return [str(row["task"]), str(row["metric"]), f"{value:.4f}" if isinstance(value, float) else str(value),
            str(row.get("n", "")), f"{row.get('seconds', 0.0):.1f}"]


def format_table(rows: Sequence[dict]) -> str:
    """Plain text, aligned columns."""
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(len(COLUMNS)))
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(_cells(r)) + " |" for r in rows])

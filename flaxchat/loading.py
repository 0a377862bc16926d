"""Load a trained model and its tokenizer for inference (the chat scripts and the benchmarks).

A model is named by any of: a run folder (`runs/x`, holding `checkpoints/` and `tokenizer/`), its
checkpoints folder (`runs/x/checkpoints`), or one step of it (`runs/x/checkpoints/1000`), local or
`gs://` (the layout is `flaxchat.paths.RunFolder`'s). The latest intact step is used unless one is
given. Checkpoints are opened read-only (`flaxchat.checkpoint.open_reader`): loading a run that is
still training never touches its saves. From a bucket only what is needed is read: one listing per
level, the step's arrays (Orbax reads them straight from the bucket), the tokenizer's few files.
`save_run` writes the same layout, so a test or a conversion can make a folder the chat scripts open.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from flaxchat import paths
from flaxchat.errors import UserError
from flaxchat.paths import RunFolder


@dataclasses.dataclass(frozen=True)
class RunPaths:
    checkpoints: str  # the folder of step folders
    step: int | None  # None: the latest
    run_dir: str  # where tokenizer/ normally lives


def _missing(where: str) -> UserError:
    return paths.missing_bucket(where) or UserError(f"no run folder or checkpoint at {where}; pass a run folder made by "
                     "`python -m scripts.run_tinystories --run-dir DIR` (or its checkpoints/<step> folder).")


def resolve(path: str | os.PathLike, step: int | None = None) -> RunPaths:
    """Which checkpoints folder and step a user's path means (local or gs://); a UserError if it names none."""
    where = str(path)
    where = where.rstrip("/") if paths.is_remote(where) else os.path.expanduser(where)
    if not paths.exists(where):
        raise _missing(where)
    if RunFolder.is_step(where):
        name = int(paths.basename(where))
        if step is not None and step != name:
            raise UserError(f"{where} is step {name} but --step {step} was asked for; pass one or the other.")
        return RunPaths(paths.parent(where), name, paths.parent(paths.parent(where)))
    run = RunFolder(where)
    if paths.isdir(run.checkpoints):
        return RunPaths(run.checkpoints, step, where)
    if paths.isdir(where) and any(RunFolder.is_step(paths.join(where, n)) for n in paths.listdirs(where)):
        return RunPaths(where, step, paths.parent(where))
    raise UserError(f"{where} holds no checkpoint (no checkpoints/<step>/ folder); train one first or pass another folder.")


def _tokenizer_dir(found: RunPaths, meta: dict) -> str:
    from flaxchat.tokenizer import FILENAME
    own = RunFolder(found.run_dir).tokenizer
    if paths.exists(paths.join(own, FILENAME)):
        return own
    saved = (meta.get("train_config") or {}).get("tokenizer_dir")
    if saved and paths.exists(paths.join(saved, FILENAME)):
        return saved
    raise UserError(f"no tokenizer found for {found.run_dir} (looked in {own}"
                    f"{' and ' + saved if saved else ''}); copy the run's tokenizer/ folder next to checkpoints/.")


def _model_config(found: RunPaths, meta: dict):
    from flaxchat.config import GPTConfig
    if "model_config" not in meta:
        raise UserError(f"the checkpoint in {found.checkpoints} has no model_config in its meta; it was not written by flaxchat.")
    return GPTConfig.from_dict(meta["model_config"])


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _matching_tokenizer(found: RunPaths, meta: dict, cfg):
    from flaxchat.tokenizer import Tokenizer
    with paths.local_copy(_tokenizer_dir(found, meta), upload=False) as local:  # a bucket's: its few files
        tokenizer = Tokenizer.load(local)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model {cfg.vocab_size}; "
                        "they come from different runs.")
    return tokenizer


def read_run(path: str | os.PathLike, step: int | None = None):
    """(model config, tokenizer, meta) of a run, without loading its weights. Read-only: the run may
    still be training."""
    from flaxchat.checkpoint import open_reader
    found = resolve(path, step)
    ckpt = open_reader(found.checkpoints)
    try:
        _, meta = ckpt.newest_intact(found.step, items=("meta",), log=_warn)
        cfg = _model_config(found, meta)
    finally:
        ckpt.close()
    return cfg, _matching_tokenizer(found, meta, cfg), meta


def load_model(path: str | os.PathLike, step: int | None = None, *, with_tokenizer: bool = True):
    """(model, tokenizer or None, meta) from a run folder, checkpoints folder or step folder.
    Read-only (nothing in the run folder is written, cleaned or deleted), so a run may be loaded
    while it trains; the newest intact step is used (`flaxchat.checkpoint.Checkpointer.newest_intact`)."""
    import jax
    from flax import nnx

    from flaxchat.checkpoint import open_reader
    from flaxchat.common import resolve_dtype
    from flaxchat.gpt import GPT

    found = resolve(path, step)
    ckpt = open_reader(found.checkpoints)

    def restore(at: int, meta: dict):
        cfg = _model_config(found, meta)
        # Abstract parameters (shapes only): restoring fills them, so no time goes into a random
        # initialisation that is thrown away (~1 s per op-by-op init on a small CPU).
        # No mesh in context, whatever the caller has set (e.g. a notebook's jax.set_mesh): the
        # abstract arrays would carry its AbstractMesh, which Orbax cannot restore onto.
        with jax.set_mesh(None):
            model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=resolve_dtype("auto")))
            # Onto this process's first device, whatever device layout wrote the checkpoint: given no
            # sharding, Orbax restores onto the saved one, and a run trained on 8 chips or 2 pod
            # workers read here on one CPU failed with "Topology mismatch".
            return model, ckpt.restore(model, step=at, device=jax.local_devices()[0]), cfg

    try:
        _, (model, meta, cfg) = ckpt.use_newest_intact(restore, found.step, items=("model", "meta"), log=_warn)
    finally:
        ckpt.close()
    tokenizer = _matching_tokenizer(found, meta, cfg) if with_tokenizer else None
    return model, tokenizer, meta


def save_run(run_dir: str | os.PathLike, model, tokenizer=None, step: int = 0, meta: dict | None = None) -> Path | str:
    """Write `model` (and `tokenizer`) as a run folder (local or gs://) that `load_model` opens."""
    from flaxchat.checkpoint import Checkpointer
    run = RunFolder(run_dir)
    ckpt = Checkpointer(run.checkpoints, max_to_keep=None, async_save=False)
    try:
        ckpt.save(step, model, None, dict(meta or {}, model_config=model.config.to_dict()))
    finally:
        ckpt.close()
    if tokenizer is not None:
        with paths.local_copy(run.tokenizer) as local:
            tokenizer.save(local)
    return run.root if paths.is_remote(run.root) else Path(run.root)


# --- chat helpers shared by scripts.chat_cli and scripts.chat_web ----------------------------------


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids for the assistant's next reply to `messages` (user/assistant turns, user last)."""
    if not messages or messages[-1].get("role") != "user":
        raise UserError("the conversation must end with a user message.")
    return tokenizer.render_for_completion({"messages": list(messages) + [{"role": "assistant", "content": ""}]})


def stream_text(engine, tokenizer, prompt: list[int], **kwargs):
    """Yield the reply's text piece by piece as tokens arrive (first sample only), ending at the
    stop token. Pieces never split a UTF-8 character: a token that ends mid-character waits for the
    next one. The reply's token ids are in `.tokens` of the returned generator's final value."""
    ids: list[int] = []
    shown = 0
    stop = set(engine.stop_tokens())
    for column, forced in engine.generate(prompt, 1, **kwargs):
        tok = column[0]
        if tok is None or (tok in stop and not forced[0]):
            break
        ids.append(tok)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            continue
        if len(text) > shown:
            yield text[shown:]
            shown = len(text)
    text = tokenizer.decode(ids)
    if len(text) > shown:
        yield text[shown:]
    return ids

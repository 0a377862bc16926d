"""Chat or completion: how the chat scripts turn what a user types into a prompt.

A base model (pretraining only) has never seen the chat template: wrapped as a user turn,
"Once upon a time" came back as " boy named Dan...", the reply of a model that did not know it was
asked anything. It continues text instead. A model finetuned by SFT (or RL after it) chats. The
checkpoint says which stage made it (`stage` in its meta: "sft" or "rl"); `--mode` overrides.
"""

from __future__ import annotations

from flaxchat.errors import UserError

MODES = ("auto", "chat", "complete")
CHAT_STAGES = ("sft", "rl")  # the stages whose checkpoints have learnt the chat template
MODE_HELP = ("chat (the prompt is a user turn of the chat template), complete (the model continues the text), "
             "or auto: chat for a model finetuned by scripts.sft or scripts.rl, complete for a base model")


def resolve(meta: dict, asked: str = "auto") -> tuple[str, str]:
    """('chat' or 'complete', one line saying why) for a checkpoint's `meta`."""
    if asked not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)} (got {asked!r}).")
    stage = (meta or {}).get("stage")
    made_by = f"a chat model (made by scripts.{stage})" if stage in CHAT_STAGES else "a base model (pretraining only)"
    if asked != "auto":
        return asked, f"mode: {asked} (--mode {asked}; the checkpoint is {made_by})"
    if stage in CHAT_STAGES:
        return "chat", f"mode: chat: {made_by}; --mode complete continues text instead"
    return "complete", f"mode: complete: {made_by} continues the text you give; --mode chat wraps it as a chat turn"


def completion_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids for continuing `text` as a document: <|bos|> then the text, no template."""
    return tokenizer.encode(text, prepend=tokenizer.bos_token_id)

"""SmolTalk: general chat for supervised finetuning (HuggingFaceTB/smol-smoltalk, 460k train /
24k test conversations, nanochat's main SFT set).

Format read: parquet/jsonl rows with a column `messages`, a list of `{"role", "content"}` whose
roles alternate user/assistant after an optional leading system message (the chat renderer folds
that into the first user turn). Example row:
  {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]}

It has no gold answers, so it is for training only: `evaluate` raises UserError.
"""

from __future__ import annotations

from flaxchat.errors import UserError
from tasks._files import FileTask


class SmolTalk(FileTask):
    name = "smoltalk"
    dataset = "HuggingFaceTB/smol-smoltalk"
    columns = ("messages",)

    def __init__(self, path: str | None = "hf:HuggingFaceTB/smol-smoltalk", split: str = "train",
                 subset: str | None = "data", seed: int | None = 0, **slice_args):
        super().__init__(path, split, subset, seed, **slice_args)

    def convert(self, row: dict) -> dict:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise self.bad_row(row, "has no messages")
        if not all(isinstance(m, dict) for m in messages):
            raise self.bad_row(row, 'has a message that is not an object {"role": ..., "content": ...}')
        out = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
        first = 1 if out[0]["role"] == "system" else 0
        roles = [m["role"] for m in out[first:]]
        expected = ["user", "assistant"] * (len(roles) // 2)
        if roles != expected or not roles:
            raise self.bad_row(row, f"has roles {roles}; they must alternate user/assistant (after an "
                                    "optional system message) and end with the assistant")
        if not all(isinstance(m["content"], str) for m in out):
            raise self.bad_row(row, "has a message whose content is not a string")
        return {"messages": out}

    def evaluate(self, conversation: dict, response: str) -> bool:
        raise UserError("smoltalk is for training (it has no gold answers to grade); "
                        "evaluate with a task such as gsm8k, mmlu, arc or humaneval")

"""GSM8K: grade-school math word problems solved with a calculator (openai/gsm8k; Cobbe et al., 2021).

Format read: parquet/jsonl rows with columns `question` and `answer`, where the answer is worked
text with calculator annotations and a final line "#### <number>". The hub layout is
`{subset}/{split}-*.parquet`, subsets main and socratic, splits train (7,473) and test (1,319).

As in nanochat, each annotation `<<expr=value>>` becomes a tool call: the text before it, a
`python` part with `expr` (what the model learns to write) and a `python_output` part with `value`
(what the tool answers at inference; masked out of the loss), then the text that follows. So
  "She sold 48/2 = <<48/2=24>>24 clips.\n#### 24"
becomes the parts
  text "She sold 48/2 = " | python "48/2" | python_output "24" | text "24 clips.\n#### 24".
The example carries `answer` (the text after ####, commas removed); `evaluate` compares it with the
reply's final number (after its last ####, else its last number).
"""

from __future__ import annotations

import re

from tasks._files import FileTask
from tasks.base import extract_answer, numbers_equal

_CALL = re.compile(r"<<([^<>]*)>>")


def answer_parts(answer: str) -> list[dict]:
    """GSM8K's worked answer as assistant content parts (see the module docstring)."""
    parts, pos = [], 0
    for m in _CALL.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos:m.start()]})
        expr, _, value = m.group(1).rpartition("=") if "=" in m.group(1) else (m.group(1), "", "")
        parts.append({"type": "python", "text": expr})
        parts.append({"type": "python_output", "text": value})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return parts


class GSM8K(FileTask):
    name = "gsm8k"
    dataset = "openai/gsm8k"
    columns = ("question", "answer")

    def __init__(self, path: str | None = "hf:openai/gsm8k", split: str = "test", subset: str | None = "main",
                 seed: int | None = 0, **slice_args):
        super().__init__(path, split, subset, seed, **slice_args)

    def convert(self, row: dict) -> dict:
        answer = row["answer"]
        if not isinstance(answer, str) or "####" not in answer:
            raise self.bad_row(row, "has an answer without the final '#### <number>' line")
        final = answer.rpartition("####")[2].strip().replace(",", "")
        return {"messages": [{"role": "user", "content": row["question"]},
                             {"role": "assistant", "content": answer_parts(answer)}],
                "answer": final}

    def evaluate(self, conversation: dict, response: str) -> bool:
        return numbers_equal(extract_answer(response), conversation["answer"])

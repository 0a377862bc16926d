"""HumanEval: 164 Python functions to complete, graded by running their tests (openai/openai_humaneval;
Chen et al., 2021).

Format read: parquet/jsonl rows with columns `task_id`, `prompt` (imports, the signature and the
docstring), `canonical_solution` (the body), `test` (a `check(candidate)` function) and
`entry_point` (the function's name). The hub layout is `openai_humaneval/test-*.parquet`; the
original `HumanEval.jsonl.gz` (github.com/openai/human-eval) is read too when named directly.

A row becomes
  user:      Complete this Python function. ```python <prompt> ```
  assistant: the whole function (prompt + canonical solution), as plain code
and carries `task_id`, `prompt`, `test` and `entry_point`.

`evaluate` takes the reply's first ```python block (else the whole reply). If it defines the entry
point, the program is prompt + reply (the reply's definition replaces the docstring-only one from the
prompt, while the prompt's imports and helper functions stay); otherwise the reply is the body and
the program is prompt + reply. Then come the tests and `check(<entry_point>)`, run in the sandbox
(`flaxchat.execution.execute_code`, `timeout` seconds); the reply is right iff it exits cleanly.
"""

from __future__ import annotations

import re
import textwrap

from flaxchat.execution import execute_code
from tasks._files import FileTask

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The first fenced code block of a reply, else the reply; indentation of its first line kept."""
    m = _BLOCK.search(response)
    code = m.group(1) if m else response
    return code.strip("\n").rstrip()


def build_program(prompt: str, entry_point: str, test: str, response: str) -> str:
    code = extract_code(response)
    prompt = prompt if prompt.endswith("\n") else prompt + "\n"
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        program = f"{prompt}\n\n{code}\n"
    else:
        lines = [ln for ln in code.splitlines() if ln.strip()]
        if lines and not any(ln[0].isspace() for ln in lines):
            # A body written flush left (e.g. a one-line "return a + b" in a code block) belongs inside.
            code = textwrap.indent(code, "    ")
        program = f"{prompt}{code}\n"
    return f"{program}\n\n{test}\n\ncheck({entry_point})\n"


class HumanEval(FileTask):
    name = "humaneval"
    dataset = "openai/openai_humaneval"
    columns = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

    def __init__(self, path: str | None = "hf:openai/openai_humaneval", split: str = "test",
                 subset: str | None = "openai_humaneval", seed: int | None = 0, timeout: float = 5.0,
                 **slice_args):
        super().__init__(path, split, subset, seed, **slice_args)
        self.timeout = timeout

    def convert(self, row: dict) -> dict:
        prompt = row["prompt"]
        user = f"Complete this Python function.\n\n```python\n{prompt.rstrip()}\n```"
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": prompt + row["canonical_solution"]}],
                "task_id": row["task_id"], "prompt": prompt, "test": row["test"], "entry_point": row["entry_point"]}

    def evaluate(self, conversation: dict, response: str) -> bool:
        program = build_program(conversation["prompt"], conversation["entry_point"], conversation["test"], response)
        return execute_code(program, timeout=self.timeout).ok

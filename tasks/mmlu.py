"""MMLU: 57 subjects of four-way multiple choice (cais/mmlu; Hendrycks et al., 2021).

Format read: parquet/jsonl rows with columns `question`, `subject`, `choices` (four strings) and
`answer` (the index 0-3 of the right choice). The hub layout is `{subset}/{split}-*.parquet`, subset
"all" or a subject, splits test (14,042), validation (1,531), dev (285, few-shot) and
auxiliary_train (99,842; `split="auxiliary_train"`, what nanochat trains on).

A row becomes
  user:      The following is a multiple choice question about college biology.
             <question>
             A. <choice 0>  ...  D. <choice 3>
             Answer with the letter of the correct choice only.
  assistant: the gold letter, e.g. "B"
with `letters = ["A", "B", "C", "D"]` and `subject`. `evaluate` is exact match on the letter.
"""

from __future__ import annotations

from tasks._files import LETTERS, FileTask, letter_correct, multiple_choice


class MMLU(FileTask):
    name = "mmlu"
    eval_type = "categorical"
    dataset = "cais/mmlu"
    columns = ("question", "subject", "choices", "answer")

    def __init__(self, path: str | None = "hf:cais/mmlu", split: str = "test", subset: str | None = "all",
                 seed: int | None = 0, **slice_args):
        super().__init__(path, split, subset, seed, **slice_args)

    def convert(self, row: dict) -> dict:
        choices, answer = row["choices"], row["answer"]
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise self.bad_row(row, f"has choices {choices!r}; MMLU has a list of four")
        try:
            answer = int(answer)  # an int in cais/mmlu; some copies store "2" or a class label name
        except (TypeError, ValueError):
            answer = LETTERS.find(str(answer).strip().upper())
        if not 0 <= answer < len(choices):
            raise self.bad_row(row, f"has answer {row['answer']!r}, not an index of its {len(choices)} choices")
        letters = list(LETTERS[:len(choices)])
        subject = str(row["subject"] or "").replace("_", " ")
        return {"messages": [{"role": "user", "content": multiple_choice(row["question"], choices, subject or None)},
                             {"role": "assistant", "content": letters[answer]}],
                "letters": letters, "subject": row["subject"]}

    def evaluate(self, conversation: dict, response: str) -> bool:
        return letter_correct(conversation, response)

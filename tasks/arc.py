"""ARC: grade-school science questions, multiple choice (allenai/ai2_arc; Clark et al., 2018).

Format read: parquet/jsonl rows with columns `question`, `choices` = `{"text": [...], "label": [...]}`
and `answerKey` (one of the labels). The hub layout is `{subset}/{split}-*.parquet` with subsets
ARC-Easy (2,251 train / 570 validation / 2,376 test) and ARC-Challenge (1,119 / 299 / 1,172).
Most items have four choices labelled A-D; some have three or five, and a few are labelled
"1"-"5", which become A-E here so that every reply is a letter.

Rendered like MMLU (`tasks.mmlu`): the user message lists "A. ..." lines and asks for the letter,
the assistant answers the gold letter, `letters` lists the item's letters, `evaluate` is exact match.
"""

from __future__ import annotations

from tasks._files import LETTERS, FileTask, letter_correct, multiple_choice


class ARC(FileTask):
    name = "arc"
    eval_type = "categorical"
    dataset = "allenai/ai2_arc"
    columns = ("question", "choices", "answerKey")

    def __init__(self, path: str | None = "hf:allenai/ai2_arc", split: str = "test",
                 subset: str | None = "ARC-Easy", seed: int | None = 0, **slice_args):
        super().__init__(path, split, subset, seed, **slice_args)

    def convert(self, row: dict) -> dict:
        texts, letters, gold = arc_choices(row, self.bad_row)
        return {"messages": [{"role": "user", "content": multiple_choice(row["question"], texts)},
                             {"role": "assistant", "content": letters[gold]}],
                "letters": letters}

    def evaluate(self, conversation: dict, response: str) -> bool:
        return letter_correct(conversation, response)


def arc_choices(row: dict, bad_row) -> tuple[list[str], list[str], int]:
    """(choice texts, their letters A.., index of the gold choice) of one ARC row."""
    choices = row["choices"] if isinstance(row["choices"], dict) else {}
    texts, labels = list(choices.get("text") or []), [str(x).strip() for x in choices.get("label") or []]
    if not 2 <= len(texts) <= len(LETTERS) or len(texts) != len(labels):
        raise bad_row(row, f"has choices {row['choices']!r}; ARC has {{'text': [...], 'label': [...]}} of equal length")
    key = str(row["answerKey"]).strip()
    if key not in labels:
        raise bad_row(row, f"has answerKey {key!r}, which is none of its labels {labels}")
    return texts, list(LETTERS[:len(texts)]), labels.index(key)

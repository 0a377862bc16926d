"""Real-dataset tasks and CORE sets: files written here in each dataset's published format (rows in
the spirit of the real ones) are read, rendered, graded; bad inputs are one-sentence UserErrors."""

from __future__ import annotations

import gzip
import json
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flaxchat.data import sources
from flaxchat.data.stories import StoriesCorpus
from flaxchat.errors import UserError
from flaxchat.execution import execute_code
from flaxchat.tokenizer import Tokenizer
from tasks import TaskMixture, get_task
from tasks.arc import ARC
from tasks.core import CORE_TASKS, arc_core, hellaswag, load_core, piqa, stories_cloze, winogrande
from tasks.gsm8k import GSM8K
from tasks.humaneval import HumanEval
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk

pytestmark = pytest.mark.timeout(120)


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(200)], 300)


def trained_text(tok: Tokenizer, conversation: dict) -> str:
    """What the model is trained to write in a conversation (mask 1), decoded."""
    ids, mask = tok.render_conversation(conversation, max_tokens=1 << 20)
    return tok.decode([i for i, m in zip(ids, mask) if m])


# --- rows ----------------------------------------------------------------------------------------------

SMOLTALK = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "The capital of France is Paris."}],
     "source": "smol-magpie-ultra-short"},
    {"messages": [{"role": "user", "content": "Rewrite this more formally: gonna be late, sorry"},
                  {"role": "assistant", "content": "I apologize, but I will be arriving late."},
                  {"role": "user", "content": "Shorter please."},
                  {"role": "assistant", "content": "Apologies, I will be late."}],
     "source": "smol-rewrite"},
]

MMLU_ROWS = [
    {"question": "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.",
     "subject": "abstract_algebra", "choices": ["0", "4", "2", "6"], "answer": 1},
    {"question": "What is the embryological origin of the hyoid bone?", "subject": "anatomy",
     "choices": ["The first pharyngeal arch", "The first and second pharyngeal arches",
                 "The second pharyngeal arch", "The second and third pharyngeal arches"], "answer": 3},
    {"question": "Which of these branches of the trigeminal nerve contain somatic motor processes?",
     "subject": "anatomy", "choices": ["The supraorbital nerve", "The infraorbital nerve",
                                       "The mental nerve", "None of the above"], "answer": 3},
    {"question": "The pleura", "subject": "anatomy",
     "choices": ["have no sensory innervation.", "are separated by a 2 mm space.",
                 "extend into the neck.", "are composed of respiratory epithelium."], "answer": 2},
]

ARC_ROWS = [
    {"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster after a meteorite "
     "impact. Which is the most likely effect of this increase in rotation?",
     "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                          "Planetary days will become shorter.", "Planetary gravity will become stronger."],
                 "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
    {"id": "NYSEDREGENTS_2015_4_8", "question": "Which form of energy is produced when a rubber band vibrates?",
     "choices": {"text": ["chemical", "light", "electrical", "sound"], "label": ["1", "2", "3", "4"]},
     "answerKey": "4"},
    {"id": "Mercury_SC_LBS10276", "question": "Which of these is a way to conserve water at home?",
     "choices": {"text": ["take long showers", "fix leaking faucets", "water the lawn at noon"],
                 "label": ["A", "B", "C"]}, "answerKey": "B"},
]

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
               "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A stadium holds 1,500 people per section and has 3 sections. How many people fit?",
     "answer": "The stadium holds 1500 * 3 = <<1500*3=4500>>4,500 people.\n#### 4,500"},
]

HUMANEVAL_ROWS = [
    {"task_id": "HumanEval/2",
     "prompt": '\n\ndef truncate_number(number: float) -> float:\n    """ Given a positive floating point number, it '
               'can be decomposed into\n    and integer part (largest integer smaller than given number) and '
               'decimals\n    (leftover part always smaller than 1).\n\n    Return the decimal part of the number.\n'
               '    >>> truncate_number(3.5)\n    0.5\n    """\n',
     "canonical_solution": "    return number % 1.0\n",
     "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
             "    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
             "    assert abs(candidate(123.456) - 0.456) < 1e-6\n",
     "entry_point": "truncate_number"},
    {"task_id": "HumanEval/10",
     "prompt": '\n\ndef is_palindrome(string: str) -> bool:\n    """ Test if given string is a palindrome """\n'
               '    return string == string[::-1]\n\n\ndef make_palindrome(string: str) -> str:\n'
               '    """ Find the shortest palindrome that begins with a supplied string.\n'
               "    >>> make_palindrome('cat')\n    'catac'\n    \"\"\"\n",
     "canonical_solution": "    if not string:\n        return ''\n\n    beginning_of_suffix = 0\n\n"
                           "    while not is_palindrome(string[beginning_of_suffix:]):\n"
                           "        beginning_of_suffix += 1\n\n"
                           "    return string + string[:beginning_of_suffix][::-1]\n",
     "test": "\n\ndef check(candidate):\n    assert candidate('') == ''\n    assert candidate('x') == 'x'\n"
             "    assert candidate('xyz') == 'xyzyx'\n    assert candidate('xyx') == 'xyx'\n"
             "    assert candidate('jerry') == 'jerryrrej'\n",
     "entry_point": "make_palindrome"},
]


# --- chat tasks ----------------------------------------------------------------------------------------


def test_smoltalk_reads_messages_and_renders(tmp_path, tok):
    write_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", SMOLTALK)
    write_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", SMOLTALK[:1])
    task = SmolTalk(str(tmp_path), split="train", seed=None)
    assert len(task) == 2 and task.eval_type == "generative"
    assert task[0]["messages"][0] == {"role": "system", "content": "You are a helpful assistant who answers briefly."}
    assert trained_text(tok, task[0]) == "The capital of France is Paris.<|assistant_end|>"
    assert trained_text(tok, task[1]).count("<|assistant_end|>") == 2
    assert len(SmolTalk(str(tmp_path), split="test")) == 1
    with pytest.raises(UserError, match="smoltalk is for training"):
        task.evaluate(task[0], "Paris.")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(UserError, match="alternate user/assistant"):
        SmolTalk(str(bad))[0]


def test_mmlu_letters_gold_and_grading(tmp_path, tok):
    write_parquet(tmp_path / "all" / "test-00000-of-00001.parquet", MMLU_ROWS)
    write_parquet(tmp_path / "all" / "validation-00000-of-00001.parquet", MMLU_ROWS[:1])
    write_parquet(tmp_path / "all" / "dev-00000-of-00001.parquet", MMLU_ROWS[:2])
    write_parquet(tmp_path / "anatomy" / "test-00000-of-00001.parquet", MMLU_ROWS[1:])  # subject subset: not read
    task = MMLU(str(tmp_path), split="test", seed=None)
    assert len(task) == 4 and task.eval_type == "categorical"
    ex = task[0]
    assert ex["letters"] == ["A", "B", "C", "D"] and ex["subject"] == "abstract_algebra"
    user = ex["messages"][0]["content"]
    assert "about abstract algebra" in user and "\nA. 0\nB. 4\nC. 2\nD. 6\n" in user
    assert user.endswith("Answer with the letter of the correct choice only.")
    assert [t["messages"][1]["content"] for t in task] == ["B", "D", "D", "C"]
    assert trained_text(tok, ex) == "B<|assistant_end|>"
    assert task.evaluate(ex, " B\n") and not task.evaluate(ex, "A") and not task.evaluate(ex, "B. 4")
    assert len(MMLU(str(tmp_path), split="validation")) == 1  # "validation", not the few-shot "dev" files
    assert len(MMLU(str(tmp_path), split="dev")) == 2
    assert len(MMLU(str(tmp_path / "anatomy"), split="test")) == 3
    # A fixed shuffle (the default) serves every row once, the same way every time.
    shuffled = [t["messages"][0]["content"] for t in MMLU(str(tmp_path), split="test")]
    assert sorted(shuffled) == sorted(t["messages"][0]["content"] for t in task)
    assert shuffled == [t["messages"][0]["content"] for t in MMLU(str(tmp_path), split="test")]
    # Task slices and the registry work on real tasks.
    assert len(MMLU(str(tmp_path), split="test", start=1, stop=3)) == 2
    assert len(get_task("mmlu", path=str(tmp_path), split="test")) == 4


def test_mmlu_auxiliary_train_rows_wrapped_in_a_struct(tmp_path):
    # cais/mmlu's auxiliary_train/train-*.parquet wraps each row in a column named "train".
    path = write_parquet(tmp_path / "auxiliary_train" / "train-00000-of-00001.parquet",
                         [{"train": r} for r in MMLU_ROWS[:2]])
    task = MMLU(str(path), split="train", seed=None)
    assert [t["messages"][1]["content"] for t in task] == ["B", "D"]


def test_arc_numeric_labels_and_odd_choice_counts(tmp_path, tok):
    write_jsonl(tmp_path / "ARC-Easy" / "test.jsonl", ARC_ROWS)
    write_parquet(tmp_path / "ARC-Challenge" / "test-00000-of-00001.parquet", ARC_ROWS[:1])
    task = ARC(str(tmp_path), split="test", subset="ARC-Easy", seed=None)
    assert len(task) == 3 and task.eval_type == "categorical"
    assert [t["messages"][1]["content"] for t in task] == ["C", "D", "B"]
    assert [t["letters"] for t in task] == [list("ABCD"), list("ABCD"), list("ABC")]
    numeric = task[1]["messages"][0]["content"]
    assert "\nA. chemical\nB. light\nC. electrical\nD. sound\n" in numeric and "1." not in numeric
    assert trained_text(tok, task[1]) == "D<|assistant_end|>"
    assert task.evaluate(task[1], "D") and not task.evaluate(task[1], "4")
    assert len(ARC(str(tmp_path), split="test", subset="ARC-Challenge")) == 1
    # The hub's parquet (a struct column) reads the same.
    write_parquet(tmp_path / "one.parquet", ARC_ROWS)
    assert [t["messages"][1]["content"] for t in ARC(str(tmp_path / "one.parquet"), seed=None)] == ["C", "D", "B"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(ARC_ROWS[0], answerKey="E")])
    with pytest.raises(UserError, match=r"Mercury_7175875.*answerKey 'E'"):
        ARC(str(bad))[0]


def test_gsm8k_tool_parts_and_grading(tmp_path, tok):
    write_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", GSM8K_ROWS)
    write_parquet(tmp_path / "socratic" / "train-00000-of-00001.parquet", GSM8K_ROWS[:1])
    task = GSM8K(str(tmp_path), split="train", seed=None)
    assert len(task) == 3 and task.eval_type == "generative"
    ex = task[0]
    assert ex["answer"] == "72"
    assert ex["messages"][1]["content"] == [
        {"type": "text", "text": "Natalia sold 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips in May.\nNatalia sold 48+24 = "},
        {"type": "python", "text": "48+24"},
        {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips altogether in April and May.\n#### 72"},
    ]
    # The model is trained on its text and calls, never on the tool's outputs.
    assert trained_text(tok, ex) == ("Natalia sold 48/2 = <|python_start|>48/2<|python_end|>24 clips in May.\n"
                                     "Natalia sold 48+24 = <|python_start|>48+24<|python_end|>72 clips "
                                     "altogether in April and May.\n#### 72<|assistant_end|>")
    assert task.evaluate(ex, "She sold 24 in May, so 72 in all.\n#### 72")
    assert task.evaluate(ex, "The answer is 72.")
    assert not task.evaluate(ex, "#### 71") and not task.evaluate(ex, "I do not know")
    assert task[1]["answer"] == "10" and task.evaluate(task[1], "She earned $10.00.")
    assert task[2]["answer"] == "4500" and task.evaluate(task[2], "#### 4,500")
    assert task.reward(ex, "#### 72") == 1.0 and task.reward(ex, "#### 7") == 0.0
    assert len(GSM8K(str(tmp_path), split="train", subset="socratic")) == 1


def test_humaneval_grades_by_running_the_tests(tmp_path, tok):
    write_jsonl(tmp_path / "HumanEval.jsonl", HUMANEVAL_ROWS)
    task = HumanEval(str(tmp_path / "HumanEval.jsonl"), seed=None, timeout=2.0)
    assert len(task) == 2
    ex, helper = task[0], task[1]
    assert ex["entry_point"] == "truncate_number" and ex["task_id"] == "HumanEval/2"
    assert "```python\n\n\ndef truncate_number(number: float) -> float:" in ex["messages"][0]["content"]
    assert ex["messages"][1]["content"].endswith("    return number % 1.0\n")
    assert trained_text(tok, ex).endswith("return number % 1.0\n<|assistant_end|>")
    # Right: the reference answer, a bare body, a flush-left one-liner in a block, a whole function
    # in a block with prose around it, and a body that calls a helper defined in the prompt.
    assert task.evaluate(ex, ex["messages"][1]["content"])
    assert task.evaluate(ex, "    return number - int(number)\n")
    assert task.evaluate(ex, "```python\nreturn number - int(number)\n```")
    assert task.evaluate(ex, "Here you go:\n```python\ndef truncate_number(number):\n    return number % 1\n```\nDone.")
    assert task.evaluate(helper, HUMANEVAL_ROWS[1]["canonical_solution"])
    # Wrong: a wrong body, a syntax error, an infinite loop (stopped by the sandbox's timeout).
    assert not task.evaluate(ex, "    return number\n")
    assert not task.evaluate(ex, "    return number %% 1\n")
    assert not task.evaluate(ex, "    while True:\n        pass\n")
    # The original release is gzipped jsonl.
    gz = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in HUMANEVAL_ROWS)
    assert len(HumanEval(str(gz))) == 2


def test_humaneval_prompts_that_import_typing(tmp_path):
    # HumanEval/0: most prompts start with `from typing import List` (and /162 imports hashlib);
    # the sandbox preloads both, since its child may not be able to read Python's folder.
    assert execute_code("import typing, hashlib").ok
    row = {"task_id": "HumanEval/0", "entry_point": "has_close_elements",
           "prompt": 'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) '
                     '-> bool:\n    """ Check if in given list of numbers, are any two numbers closer to each '
                     'other than\n    given threshold.\n    """\n',
           "canonical_solution": "    for idx, elem in enumerate(numbers):\n"
                                 "        for idx2, elem2 in enumerate(numbers):\n"
                                 "            if idx != idx2:\n                distance = abs(elem - elem2)\n"
                                 "                if distance < threshold:\n                    return True\n\n"
                                 "    return False\n",
           "test": "\n\ndef check(candidate):\n    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
                   "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"}
    task = HumanEval(str(write_parquet(tmp_path / "test-00000-of-00001.parquet", [row])), timeout=2.0)
    assert task.evaluate(task[0], task[0]["messages"][1]["content"])
    assert not task.evaluate(task[0], "    return False\n")


def test_real_tasks_mix_with_each_other(tmp_path, tok):
    mmlu = MMLU(str(write_parquet(tmp_path / "mmlu.parquet", MMLU_ROWS)))
    gsm = GSM8K(str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)))
    mix = TaskMixture([mmlu, gsm], weights=[1.0, 2.0])
    assert len(mix) == 4 + 6
    for conversation in mix:
        assert tok.render_conversation(conversation)[0]


# --- bad input -------------------------------------------------------------------------------------------


def test_bad_paths_and_files_are_one_sentence_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        MMLU(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .txt/.jsonl/.parquet files"):
        GSM8K(str(tmp_path / "empty"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    with pytest.raises(UserError, match="no .parquet or .jsonl files.*openai/gsm8k"):
        GSM8K(str(tmp_path / "texts"))
    with pytest.raises(UserError, match="needs a path"):
        ARC(None)
    # Columns: parquet names all that are missing, jsonl the line too.
    no_cols = write_parquet(tmp_path / "m.parquet", [{"question": "q", "choices": ["a", "b", "c", "d"]}])
    with pytest.raises(UserError, match="lacks the columns subject, answer; a cais/mmlu file has columns"):
        len(MMLU(str(no_cols)))
    gsm = write_jsonl(tmp_path / "g.jsonl", [GSM8K_ROWS[0], {"question": "q", "solution": "s"}])
    with pytest.raises(UserError, match=r"g.jsonl \(line 2\) lacks the column answer"):
        len(GSM8K(str(gsm)))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 of .*broken.jsonl is not valid JSON"):
        len(SmolTalk(str(tmp_path / "broken.jsonl")))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="cannot read .*fake.parquet as parquet"):
        len(SmolTalk(str(tmp_path / "fake.parquet")))
    # Split files exist, but not the one asked for.
    write_parquet(tmp_path / "splits" / "train-0.parquet", GSM8K_ROWS)
    write_parquet(tmp_path / "splits" / "test-0.parquet", GSM8K_ROWS)
    with pytest.raises(UserError, match="none of the files at .* is for split 'validation'"):
        GSM8K(str(tmp_path / "splits"), split="validation")
    # Empty file: no rows.
    (tmp_path / "none.jsonl").write_text("\n")
    with pytest.raises(UserError, match="hold no rows"):
        len(GSM8K(str(tmp_path / "none.jsonl")))


# --- hub specs ---------------------------------------------------------------------------------------------


def test_hub_spec_goes_through_the_data_layer_with_the_split_pattern(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "all" / "test-00000-of-00001.parquet", MMLU_ROWS)
    asked = []

    def hub_files(spec, split):
        asked.append((spec, split))
        return [str(path)], False, sources.parse_hub_spec(spec)

    monkeypatch.setattr(sources, "hub_files", hub_files)
    assert len(MMLU()) == 4  # the default path is the hub dataset
    assert len(MMLU("hf:cais/mmlu/all/test-*.parquet")) == 4  # a pattern is used as given
    with pytest.raises(UserError, match="lacks the columns ctx, endings, label"):  # the fake gave MMLU rows
        hellaswag("hf:Rowan/hellaswag?revision=refs/convert/parquet")
    assert asked == [("hf:cais/mmlu/all/test*", "val"), ("hf:cais/mmlu/all/test-*.parquet", "val"),
                     ("hf:Rowan/hellaswag/*validation*?revision=refs/convert/parquet", "val")]


def test_hub_without_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(UserError, match="needs the huggingface_hub package"):
        GSM8K()


def test_hub_spec_read_from_a_fake_hub_cache(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "datasets--cais--mmlu"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    write_parquet(snap / "all" / "test-00000-of-00001.parquet", MMLU_ROWS)
    write_parquet(snap / "all" / "validation-00000-of-00001.parquet", MMLU_ROWS[:1])
    write_parquet(snap / "all" / "auxiliary_train-00000-of-00001.parquet", MMLU_ROWS[:2])
    write_parquet(snap / "anatomy" / "test-00000-of-00001.parquet", MMLU_ROWS[1:])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert hub is not None
    assert len(MMLU("hf:cais/mmlu", split="test")) == 4
    assert len(MMLU("hf:cais/mmlu", split="validation")) == 1
    assert len(MMLU("hf:cais/mmlu", split="auxiliary_train")) == 2
    assert len(MMLU("hf:cais/mmlu", split="test", subset="anatomy")) == 3
    with pytest.raises(UserError, match="not in the local hub cache"):
        GSM8K("hf:openai/gsm8k")


# --- CORE ---------------------------------------------------------------------------------------------------

HELLASWAG = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain", "label": "3"},
    {"ind": 5013, "activity_label": "Home and Garden", "ctx_a": "", "ctx_b": "",
     "ctx": "[header] How to fold a paper airplane [title] Fold the paper in half lengthwise. [step] Crease the fold",
     "endings": ["sharply with your thumbnail, then unfold the paper.", "by eating it.",
                 "into the shape of a small dog.", "while standing on one foot in the rain."],
     "source_id": "wikihow~8311", "split": "val", "split_type": "zeroshot", "label": "0"},
]
PIQA = [
    {"goal": "How do I ready a guinea pig cage for it's new occupants?",
     "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
             "you will also need to supply it with a water bottle and a food dish.",
     "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, "
             "you will also need to supply it with a water bottle and a food dish.", "label": 0},
    {"goal": "dresser", "sol1": "replace drawer with bobby pin ", "sol2": "finish, woodgrain with  bobby pin ",
     "label": 1},
]
WINOGRANDE = [
    {"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
     "option1": "Sarah", "option2": "Maria", "answer": "1"},
    {"sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
     "option1": "Sarah", "option2": "Maria", "answer": "2"},
]


def test_core_hellaswag_piqa_winogrande_arc(tmp_path):
    write_jsonl(tmp_path / "hellaswag" / "hellaswag_val.jsonl", [dict(r, label=int(r["label"])) for r in HELLASWAG])
    write_jsonl(tmp_path / "hellaswag" / "hellaswag_train.jsonl", HELLASWAG[:1])
    roof, wiki = hellaswag(str(tmp_path / "hellaswag"), seed=None)
    assert roof == {"kind": "mc", "context": "A man is sitting on a roof. he", "gold": 3,
                    "continuations": [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
                                      " is holding a rubik's cube.", " starts pulling up roofing on a roof."]}
    assert wiki["context"] == "How to fold a paper airplane. Fold the paper in half lengthwise. Crease the fold"
    assert wiki["gold"] == 0
    assert len(hellaswag(str(tmp_path / "hellaswag"), split="train")) == 1
    hub_layout = write_parquet(tmp_path / "hs" / "default" / "validation" / "0000.parquet", HELLASWAG)
    assert [e["gold"] for e in hellaswag(str(hub_layout.parent.parent.parent), seed=None)] == [3, 0]

    first, second = piqa(str(write_parquet(tmp_path / "piqa" / "validation.parquet", PIQA)), seed=None)
    assert first["context"] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert first["continuations"][0].startswith(" Provide the guinea pig") and first["gold"] == 0
    assert second["continuations"] == [" replace drawer with bobby pin", " finish, woodgrain with  bobby pin"]
    assert second["gold"] == 1

    wino = winogrande(str(write_jsonl(tmp_path / "winogrande" / "dev.jsonl", WINOGRANDE)), seed=None)
    assert wino[0] == {"kind": "schema", "gold": 0,
                       "context": ["Sarah was a much better surgeon than Maria so Sarah",
                                   "Sarah was a much better surgeon than Maria so Maria"],
                       "continuations": [" always got the harder cases."]}
    assert wino[1]["gold"] == 1 and wino[1]["continuations"] == [" always got the easier cases."]

    arc = arc_core(str(write_jsonl(tmp_path / "arc.jsonl", ARC_ROWS)), seed=None)
    assert [e["gold"] for e in arc] == [2, 3, 1]
    assert arc[1]["continuations"] == [" chemical", " light", " electrical", " sound"]
    assert arc[0]["context"].startswith("Question: An astronomer") and arc[0]["context"].endswith("\nAnswer:")

    # The registry: names, limits, the fixed shuffle.
    assert len(load_core("arc_easy", str(tmp_path / "arc.jsonl"), limit=2)) == 2
    assert sorted(e["gold"] for e in load_core("arc_easy", str(tmp_path / "arc.jsonl"))) == [1, 2, 3]
    assert load_core("piqa", str(tmp_path / "piqa"), split="validation", seed=None)[0] == first


def test_core_unlabelled_rows_and_bad_names(tmp_path):
    test_split = write_jsonl(tmp_path / "hellaswag_test.jsonl", [dict(HELLASWAG[0], label="")])
    with pytest.raises(UserError, match="test splits hide their labels"):
        hellaswag(str(test_split))
    with pytest.raises(UserError, match="unknown CORE task 'boolq'; known: hellaswag, piqa, winogrande, arc_easy"):
        load_core("boolq")
    with pytest.raises(UserError, match="the CORE task hellaswag reads the dataset's files; give its path"):
        load_core("hellaswag")
    with pytest.raises(UserError, match="stories_cloze is built in"):
        load_core("stories_cloze", path=str(tmp_path))
    with pytest.raises(UserError, match="lacks the column option2"):
        winogrande(str(write_jsonl(tmp_path / "w.jsonl", [{"sentence": "a _ b", "option1": "x", "answer": "1"}])))
    assert set(CORE_TASKS) >= {"hellaswag", "piqa", "winogrande", "arc_easy", "stories_cloze"}


def test_stories_cloze_is_deterministic_and_well_posed():
    items = stories_cloze(size=40, seed=0)
    assert items == stories_cloze(size=40, seed=0)
    assert items != stories_cloze(size=40, seed=1)
    assert load_core("stories_cloze", limit=10) == stories_cloze(size=10)
    golds = set()
    for item in items:
        assert item["kind"] == "mc" and len(item["continuations"]) == 4 and len(set(item["continuations"])) == 4
        truth = item["continuations"][item["gold"]]
        sep = re.match(r"\s+", truth).group()
        assert all(c.startswith(sep) and not c[len(sep)].isspace() for c in item["continuations"])
        assert truth[len(sep)].isupper() or truth[len(sep)] == '"'
        # The right continuation is the story's own next sentence.
        assert any((item["context"] + truth) in StoriesCorpus(seed=0, split="val").doc(i) for i in range(60))
        golds.add(item["gold"])
    assert golds == {0, 1, 2, 3}  # the right answer is not always in the same place

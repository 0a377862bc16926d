"""The built-in offline tasks: chat, spelling, spell, arithmetic.

Determinism, disjoint splits, rendering with the chat tokenizer, tool calls that the calculator
agrees with, grading of the reference and of wrong replies, bad arguments, the registry, mixtures.
"""

from __future__ import annotations

import re

import pytest

import tasks
from flaxchat.data.stories import StoriesCorpus
from flaxchat.errors import UserError
from flaxchat.tokenizer import Tokenizer
from flaxchat.tools import calculate
from tasks.arithmetic import TEMPLATES, Arithmetic
from tasks.base import TaskMixture, render_parts
from tasks.spelling import WORDS, SimpleSpelling, SpellingBee, words_of
from tasks.synthetic_chat import SyntheticChat

CLASSES = {"chat": SyntheticChat, "spelling": SpellingBee, "spell": SimpleSpelling, "arithmetic": Arithmetic}
SPLITS = ("train", "val", "test")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    texts = [StoriesCorpus(seed=0).doc(i) for i in range(300)]
    return Tokenizer.train(texts, 400)


def _user_prompts(example: dict) -> str:
    return " | ".join(m["content"] for m in example["messages"] if m["role"] == "user")


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def _reference(example: dict) -> str:
    return render_parts(example["messages"][-1]["content"])


def _sample(task, n: int = 150) -> list[dict]:
    step = max(1, len(task) // n)
    return [task[i] for i in range(0, len(task), step)]


# --- construction, determinism, splits --------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CLASSES)
def test_registry_builds_each_task_with_default_sizes(name):
    sizes = {s: len(tasks.get_task(name, split=s)) for s in SPLITS}
    assert sizes["train"] == 5000
    assert 200 <= sizes["val"] <= 500 and 200 <= sizes["test"] <= 500
    task = tasks.get_task(name, split="val", size=7)
    assert isinstance(task, CLASSES[name]) and task.name == name and len(task) == 7


@pytest.mark.timeout(30)
def test_get_task_arithmetic_val():
    task = tasks.get_task("arithmetic", split="val")
    assert isinstance(task, Arithmetic) and len(task) == 500
    example = task[0]
    assert example["messages"][0]["role"] == "user" and example["answer"].isdigit()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CLASSES)
def test_same_seed_same_examples_other_seed_different(name):
    cls = CLASSES[name]
    a, b, c = cls(split="train", seed=3), cls(split="train", seed=3), cls(split="train", seed=4)
    first = [a[i] for i in range(50)]
    assert first == [b[i] for i in range(50)]
    assert [a[i] for i in (7, 3, 7)] == [first[7], first[3], first[7]]  # random access, no hidden state
    differ = sum(x != y for x, y in zip(first, (c[i] for i in range(50))))
    assert differ >= 40, differ
    assert [a[i] for i in range(10)] != [cls(split="val", seed=3)[i] for i in range(10)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CLASSES)
def test_slice_args_pick_every_step_th_example(name):
    cls = CLASSES[name]
    whole = cls(split="val", size=30)
    part = cls(split="val", size=30, start=2, stop=20, step=3)
    assert len(part) == 6
    assert list(part) == [whole[i] for i in range(2, 20, 3)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CLASSES)
def test_val_and_test_prompts_never_appear_in_train(name):
    cls = CLASSES[name]
    # chat and arithmetic: normalised prompts; the spelling tasks: even the words are disjoint
    key = (lambda e: e["word"]) if name in ("spelling", "spell") else (lambda e: _normal(_user_prompts(e)))
    train = {key(e) for e in cls(split="train")} | {key(e) for e in cls(split="train", seed=1, size=2000)}
    val = {key(e) for e in cls(split="val")}
    test = {key(e) for e in cls(split="test")}
    assert len(val) > 20 and len(test) > 20
    assert not val & train
    assert not test & train
    assert not val & test


@pytest.mark.timeout(30)
def test_arithmetic_question_texts_of_val_and_test_are_not_in_train():
    train = {e["messages"][0]["content"] for e in Arithmetic(split="train")}
    for split in ("val", "test"):
        held_out = [e["messages"][0]["content"] for e in Arithmetic(split=split)]
        assert len(set(held_out)) > 0.9 * len(held_out)
        assert not set(held_out) & train


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls", list(CLASSES.values()))
def test_bad_split_or_size_is_a_user_error(cls):
    with pytest.raises(UserError, match="dev"):
        cls(split="dev")
    with pytest.raises(UserError, match="size"):
        cls(size=-1)
    with pytest.raises(UserError):
        cls(start=5, stop=2)


# --- rendering and tool calls ----------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CLASSES)
def test_every_example_renders_with_a_trained_assistant_part(tok, name):
    end = tok.encode_special("<|assistant_end|>")
    for split in SPLITS:
        for example in _sample(CLASSES[name](split=split)):
            ids, mask = tok.render_conversation(example)
            assert len(ids) == len(mask) < 2048
            assert ids[0] == tok.bos_token_id and mask[0] == 0
            assert ids[-1] == end and mask[-1] == 1
            text = tok.decode(ids)
            for message in example["messages"]:
                assert render_parts(message["content"]) in text
            trained = tok.decode([i for i, m in zip(ids, mask) if m])
            last = example["messages"][-1]["content"]
            for part in last if isinstance(last, list) else [{"type": "text", "text": last}]:
                if part["type"] == "python_output":
                    assert f"<|output_start|>{part['text']}" not in trained
                else:
                    assert part["text"] in trained


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["spelling", "arithmetic"])
def test_tool_calls_evaluate_to_their_outputs(name):
    for split in SPLITS:
        for example in CLASSES[name](split=split, size=None if split != "train" else 1000):
            parts = example["messages"][-1]["content"]
            assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
            assert calculate(parts[1]["text"]) == parts[2]["text"] == example["answer"]
            assert parts[3]["text"].endswith(f"#### {example['answer']}")


@pytest.mark.timeout(30)
def test_spelling_bee_counts_are_right():
    letters_zero = 0
    for example in SpellingBee(split="train", size=2000):
        word, letter = example["word"], example["letter"]
        assert example["answer"] == str(word.count(letter))
        assert word in example["messages"][0]["content"]
        assert example["messages"][-1]["content"][1]["text"] == f"'{word}'.count('{letter}')"
        letters_zero += example["answer"] == "0"
    assert 0 < letters_zero < 400  # some letters absent from the word, most present


@pytest.mark.timeout(30)
def test_word_list_is_clean_and_split_by_word():
    assert len(WORDS) >= 300 and len(set(WORDS)) == len(WORDS)
    assert all(w.isalpha() and w.islower() and len(w) >= 2 for w in WORDS)
    parts = [set(words_of(s)) for s in SPLITS]
    assert sum(map(len, parts)) == len(WORDS) and set().union(*parts) == set(WORDS)
    assert min(map(len, parts)) >= 20


@pytest.mark.timeout(30)
def test_arithmetic_is_small_varied_and_integral():
    val = Arithmetic(split="val")
    assert len(TEMPLATES) >= 12
    assert len({e["template"] for e in val}) == len(TEMPLATES)
    for example in val:
        numbers = [int(n) for n in re.findall(r"\d+", example["messages"][0]["content"])]
        assert numbers and max(numbers) < 100
        assert 0 <= int(example["answer"]) < 100
        expr = example["messages"][-1]["content"][1]["text"]
        assert len(re.findall(r"[-+*]|//", expr)) in (1, 2)


# --- grading ---------------------------------------------------------------------------------------

def _wrong(name: str, example: dict) -> str:
    if name in ("spelling", "arithmetic"):
        return _reference(example).rpartition("####")[0] + f"#### {int(example['answer']) + 1}"
    if name == "spell":
        word = example["word"]
        return "It is spelled " + "-".join(word[:-1] + ("x" if word[-1] != "x" else "y")) + "."
    return "I do not know."


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CLASSES)
def test_evaluate_accepts_the_reference_and_rejects_a_wrong_reply(name):
    for split in SPLITS:
        task = CLASSES[name](split=split)
        for example in _sample(task):
            assert task.evaluate(example, _reference(example)) is True
            assert task.reward(example, _reference(example)) == 1.0
            assert task.evaluate(example, _wrong(name, example)) is False
            assert task.reward(example, _wrong(name, example)) == 0.0


@pytest.mark.timeout(30)
def test_grading_details():
    bee = SpellingBee(split="val", size=1)
    example = dict(bee[0], answer="3")
    assert bee.evaluate(example, "so 3 of them.\n#### 3")
    assert bee.evaluate(example, "there are 3")  # no ####: the last number
    assert not bee.evaluate(example, "#### 3 ... #### 4")

    spell = SimpleSpelling(split="val", size=1)
    example = dict(spell[0], word="apple")
    for good in ("a-p-p-l-e", "A-P-P-L-E", "Apple is spelled a-p-p-l-e.", "x-y, then apple: a-p-p-l-e"):
        assert spell.evaluate(example, good), good
    for bad in ("apple", "a-p-l-e", "a-p-p-l-e-s", "a p p l e", "a-p-p-l-e, no: a-p-l"):
        assert not spell.evaluate(example, bad), bad

    chat = SyntheticChat(split="val", size=1)
    identity = dict(chat[0], expect=["flaxchat"])
    assert chat.evaluate(identity, "I am FlaxChat, a small model.")
    assert not chat.evaluate(identity, "I am a small language model.")
    colour = dict(chat[0], expect=["red"])
    assert chat.evaluate(colour, "It is Red.") and not chat.evaluate(colour, "I am bored.")


@pytest.mark.timeout(30)
def test_chat_covers_its_kinds_and_identity_says_flaxchat():
    examples = list(SyntheticChat(split="train", size=2000))
    kinds = {e["kind"].split("+")[0] for e in examples}
    assert {"greeting", "identity", "colour", "sound", "opposite", "capital", "sequence", "counting",
            "followup", "thanks"} <= kinds
    two_turn = [e for e in examples if len(e["messages"]) == 4]
    assert 0.1 < len(two_turn) / len(examples) < 0.4
    identity = [e for e in examples if e["kind"].endswith("identity")]
    assert identity and all("flaxchat" in e["messages"][-1]["content"].lower() for e in identity)
    assert len({e["messages"][0]["content"] for e in identity}) > 100  # many phrasings
    for e in examples:
        assert [m["role"] for m in e["messages"]] == ["user", "assistant"] * (len(e["messages"]) // 2)


# --- mixtures --------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_mixture_of_the_builtin_tasks_is_deterministic():
    def mix(seed):
        return TaskMixture([SyntheticChat(split="val"), SpellingBee(split="val"), Arithmetic(split="val")], seed=seed)

    a, b, c = mix(0), mix(0), mix(1)
    assert len(a) == 500 + 200 + 500
    first = [a[i] for i in range(100)]
    assert first == [b[i] for i in range(100)]
    assert first != [c[i] for i in range(100)]
    kinds = {("answer" in e, "expect" in e, "letter" in e) for e in first}
    assert len(kinds) == 3  # all three tasks are mixed in early on

    spec = tasks.parse_mix("chat:2,spelling,arithmetic:0.5", split="val")
    assert len(spec) == 2 * 500 + 200 + 250

"""Tokenizer: training, round trips, special tokens, persistence, token bytes, chat rendering."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from flaxchat.data.stories import StoriesCorpus
from flaxchat.errors import UserError
from flaxchat.tokenizer import FILENAME, SPECIAL_TOKENS, Tokenizer, train_or_load

VOCAB = 512


def _stories(n_docs: int = 1500) -> list[str]:
    return [StoriesCorpus(seed=0).doc(i) for i in range(n_docs)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(_stories(), VOCAB)


TEXTS = [
    "Once upon a time, there was a little bunny named Pip.",
    "héllo wörld — naïve café, Ünïcödé; 日本語のテキスト; Привет!",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷, tabs\tand\nnew\r\nlines   spaced",
    "numbers 1234567890 3.14159 and code: def f(x): return x**2",
    "",
    "<|bos|> <|assistant_end|> look like special tokens but are plain text",
]


def test_train_gives_requested_vocab_and_specials_last(tok):
    assert tok.vocab_size == VOCAB
    ids = [tok.encode_special(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(VOCAB - len(SPECIAL_TOKENS), VOCAB))
    assert tok.bos_token_id == tok.encode_special("<|bos|>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_and_never_come_from_text(tok):
    specials = set(tok.special_tokens.values())
    for text in TEXTS:
        assert not specials & set(tok.encode(text))
    for name in SPECIAL_TOKENS:
        assert tok.decode([tok.encode_special(name)]) == name
    with pytest.raises(ValueError):
        tok.encode_special("<|nope|>")


def test_prepend_append_and_batch_match_single(tok):
    bos, end = tok.bos_token_id, tok.encode_special("<|assistant_end|>")
    single = [tok.encode(t, prepend="<|bos|>", append=end) for t in TEXTS]
    assert all(ids[0] == bos and ids[-1] == end for ids in single)
    assert tok.encode(TEXTS, prepend=bos, append="<|assistant_end|>", num_threads=2) == single
    assert tok.encode(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_merges_compress_stories(tok):
    text = StoriesCorpus(seed=0, split="val").doc(0)
    assert len(text.encode()) / len(tok.encode(text)) > 2.0  # bytes per token; raw bytes would be 1.0


def test_save_load_equal(tok, tmp_path):
    path = tok.save(tmp_path / "t")
    assert path.name == FILENAME
    assert [p.name for p in (tmp_path / "t").iterdir()] == [FILENAME]  # no temp file left behind
    json.loads(path.read_text())
    loaded = Tokenizer.load(tmp_path / "t")
    assert loaded.mergeable_ranks == tok.mergeable_ranks
    assert loaded.vocab_size == tok.vocab_size and loaded.special_tokens == tok.special_tokens
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    np.testing.assert_array_equal(loaded.token_bytes(), tok.token_bytes())


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="no tokenizer"):
        Tokenizer.load(tmp_path)
    (tmp_path / FILENAME).write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        Tokenizer.load(tmp_path)


def test_training_is_deterministic(tok):
    again = Tokenizer.train(_stories(), VOCAB)
    assert again.mergeable_ranks == tok.mergeable_ranks


def test_train_errors():
    with pytest.raises(UserError, match="too small"):
        Tokenizer.train(["hello"], 100)
    with pytest.raises(UserError, match="only supports"):
        Tokenizer.train(["ab cd"], 1000)


def test_max_chars_caps_training_text():
    seen = []

    def texts():
        for i in itertools.count():  # endless: only the cap stops reading
            seen.append(i)
            yield StoriesCorpus(seed=0).doc(i)

    tok = Tokenizer.train(texts(), 300, max_chars=20_000)
    assert tok.meta["train_chars"] == 20_000
    assert len(seen) < 40


def test_token_bytes(tok):
    tb = tok.token_bytes()
    assert tb.shape == (VOCAB,) and tb.dtype == np.int32
    for i in range(VOCAB - len(SPECIAL_TOKENS)):
        assert tb[i] == len(tok.enc.decode_single_token_bytes(i))
    assert (tb[VOCAB - len(SPECIAL_TOKENS):] == 0).all()
    assert (tb[:256] == 1).all()
    for text in TEXTS:
        assert tb[tok.encode(text, prepend="<|bos|>")].sum() == len(text.encode("utf-8"))


# --- chat rendering ---------------------------------------------------------------------------

CONVERSATION = {"messages": [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "python", "text": "1+1"},
        {"type": "python_output", "text": "2"},
        {"type": "text", "text": "It is 2."},
    ]},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Bye"},
]}


def test_render_conversation_token_by_token(tok):
    s = tok.special_tokens
    expected: list[tuple[int, int]] = []

    def add(ids, m):
        expected.extend((i, m) for i in ([ids] if isinstance(ids, int) else ids))

    add(tok.bos_token_id, 0)
    add(s["<|user_start|>"], 0), add(tok.encode("Be nice.\n\nWhat is 1+1?"), 0), add(s["<|user_end|>"], 0)
    add(s["<|assistant_start|>"], 0)
    add(tok.encode("Let me compute."), 1)
    add(s["<|python_start|>"], 1), add(tok.encode("1+1"), 1), add(s["<|python_end|>"], 1)
    add(s["<|output_start|>"], 0), add(tok.encode("2"), 0), add(s["<|output_end|>"], 0)
    add(tok.encode("It is 2."), 1)
    add(s["<|assistant_end|>"], 1)
    add(s["<|user_start|>"], 0), add(tok.encode("Thanks"), 0), add(s["<|user_end|>"], 0)
    add(s["<|assistant_start|>"], 0), add(tok.encode("Bye"), 1), add(s["<|assistant_end|>"], 1)

    ids, mask = tok.render_conversation(CONVERSATION)
    assert list(zip(ids, mask)) == expected
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "Let me compute.<|python_start|>1+1<|python_end|>It is 2.<|assistant_end|>Bye<|assistant_end|>"
    assert CONVERSATION["messages"][1]["content"] == "What is 1+1?"  # the input is not modified

    short_ids, short_mask = tok.render_conversation(CONVERSATION, max_tokens=7)
    assert short_ids == ids[:7] and short_mask == mask[:7]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "assistant", "content": "hi"}], "message 0 has role 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "followed by a user"),
    ([], "at least one message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
     "unknown assistant content part"),
])
def test_render_conversation_errors(tok, messages, match):
    with pytest.raises(UserError, match=match):
        tok.render_conversation({"messages": messages})


def test_render_for_completion(tok):
    ids = tok.render_for_completion(CONVERSATION)
    prompt = {"messages": CONVERSATION["messages"][:-1]}
    assert ids == tok.render_conversation(prompt)[0] + [tok.encode_special("<|assistant_start|>")]
    assert len(CONVERSATION["messages"]) == 5  # not modified
    with pytest.raises(UserError, match="ends with an assistant"):
        tok.render_for_completion(prompt)


# --- train_or_load and the script ---------------------------------------------------------------


def test_train_or_load_trains_once(tmp_path):
    calls = []

    def texts_fn():
        calls.append(1)
        return iter(_stories(300))

    first = train_or_load(tmp_path, texts_fn, 300, log=None)
    second = train_or_load(tmp_path, texts_fn, 300, log=None)
    assert len(calls) == 1 and second.mergeable_ranks == first.mergeable_ranks
    with pytest.raises(UserError, match="vocab size 300, not 400"):
        train_or_load(tmp_path, texts_fn, 400, log=None)


def test_tok_train_script(tmp_path, capsys):
    from flaxchat.errors import cli_main
    from scripts import tok_train

    argv = ["--vocab-size=300", "--max-chars=200_000", "--eval-docs=20", "--out", str(tmp_path)]
    assert cli_main(tok_train.main, argv) == 0
    out = capsys.readouterr().out
    assert "bytes/token" in out and (tmp_path / FILENAME).is_file()
    assert Tokenizer.load(tmp_path).vocab_size == 300
    assert cli_main(tok_train.main, argv) == 2  # refuses to overwrite without --force
    assert "already has a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-chars=0", "--doc-cap=0", "--eval-docs=-1"])
def test_tok_train_refuses_a_size_that_leaves_nothing(flag, tmp_path, capsys):
    """--doc-cap 0 cut every document to nothing and read the whole corpus doing it (minutes on a real
    one) before failing on an empty training text: now one sentence, before any reading."""
    from flaxchat.errors import cli_main
    from scripts import tok_train
    assert cli_main(tok_train.main, [flag, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-chars, --doc-cap and --eval-docs must be positive" in err and err.count("\n") == 0, err
    assert not any(tmp_path.iterdir())

"""flaxchat.evaluation and scripts.eval.

CORE scoring: padded, bucketed batches give the same per-choice losses as one unpadded forward per
row (1e-5), compiles stay per bucket, and a model trained on the gold continuations picks them.
Categorical: the letter with the highest logit of a direct forward. Generative: grades exactly the
Engine's own replies (tool calls and outputs inlined), pass@k. The script end to end on a saved run
folder, and every user mistake as one sentence.

One architecture throughout (test_engine's TINY: 64-token context, so the buckets are 32 and 64).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tasks
from flaxchat import evaluation as E
from flaxchat.config import GPTConfig
from flaxchat.data.stories import StoriesCorpus
from flaxchat.engine import Engine
from flaxchat.errors import cli_main
from flaxchat.loading import save_run
from scripts import eval as eval_script
from tasks.base import Task, render_parts
from support import ENGINE_TINY as TINY
from support import nonzero_model, scripted_model

T = TINY.sequence_len
ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def model():
    return nonzero_model(seed=11)


def words(seed, n):
    text = StoriesCorpus(seed=0, split="val").doc(seed).split()
    return " ".join(text[:n])


# --- reference: one unpadded forward per row ----------------------------------------------------------


_forward = nnx.jit(lambda m, x: m(x))


def one_row_logits(model, seq):
    """Logits (len(seq), V) of one row alone, at the full context length (an eager forward at
    each exact length would compile every op per length: minutes here). Cropped in numpy: slicing
    the jax array would compile a slice per length."""
    buf = np.zeros((1, T), np.int32)
    buf[0, :len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(buf)))[0, :len(seq)].astype(np.float64)


def reference_losses(model, tokenizer, ex):
    """Mean loss per choice, restating nanochat's CORE rule: whole prompts tokenised with BOS, the
    scored span is after the choices' common prefix (mc) or is their common suffix (schema), rows
    longer than the context lose tokens from the left."""
    bos = tokenizer.bos_token_id
    if ex["kind"] == "mc":
        seqs = [[bos] + tokenizer.encode(ex["context"] + c) for c in ex["continuations"]]
        n = 0
        while all(len(s) > n + 1 for s in seqs) and len({s[n] for s in seqs}) == 1:
            n += 1
        starts = [n] * len(seqs)
    else:
        seqs = [[bos] + tokenizer.encode(c + ex["continuations"][0]) for c in ex["context"]]
        n = 0
        while all(len(s) > n + 1 for s in seqs) and len({s[-1 - n] for s in seqs}) == 1:
            n += 1
        starts = [len(s) - max(n, 1) for s in seqs]
    out = []
    for seq, start in zip(seqs, starts):
        cut = max(0, len(seq) - T)
        seq, start = seq[cut:], max(1, start - cut)
        logits = one_row_logits(model, seq)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        out.append(-np.mean([logp[p, seq[p + 1]] for p in range(start - 1, len(seq) - 1)]))
    return np.array(out)


def mixed_examples():
    """mc and schema, short and long (past the 64-token context), 2-4 choices, in two buckets."""
    exs = []
    for i in range(7):
        ctx = words(i, [3, 10, 20, 70][i % 4])
        conts = [" " + words(20 + i + j, 2 + (i + j) % 5) for j in range(2 + i % 3)]
        exs.append(dict(kind="mc", context=ctx, continuations=conts, gold=i % len(conts)))
    for i in range(5):
        ctxs = [words(40 + i + j, [4, 12, 60][(i + j) % 3]) for j in range(2 + i % 2)]
        exs.append(dict(kind="schema", context=ctxs, continuations=[" " + words(60 + i, 5)], gold=0))
    return exs


@pytest.mark.timeout(300)
def test_batched_padded_core_scoring_equals_one_forward_per_row(model, tokenizer, monkeypatch):
    """Rows of the 32-token bucket are padded differently there than in the reference."""
    traces = []
    real = E.token_losses
    monkeypatch.setattr(E, "token_losses", lambda *a: (traces.append(a[1].shape), real(*a))[1])
    exs = mixed_examples()
    got = E.choice_losses(model, tokenizer, exs, batch_size=4)
    lengths = {len(t) for ex in exs for t, _ in E.core_rows(tokenizer, ex, T)}
    assert max(lengths) == T and min(lengths) < 32 and len(lengths) > 5  # cropped rows, both buckets
    assert len(traces) <= len(E.buckets(T)), traces  # one compile per bucket, not per row
    for g, ex in zip(got, exs):
        np.testing.assert_allclose(g, reference_losses(model, tokenizer, ex), atol=1e-5, rtol=0)
    res = E.core_score(model, tokenizer, exs, batch_size=3)  # another batch size, same answers
    preds = [int(np.argmin(g)) for g in got]
    acc = np.mean([p == ex["gold"] for p, ex in zip(preds, exs)])
    chance = np.mean([1 / len(g) for g in got])
    assert res["n"] == len(exs) and res["accuracy"] == pytest.approx(acc)
    assert res["centered"] == pytest.approx((acc - chance) / (1 - chance))


SENTENCES = {"cat": "The cat sat on the mat.", "dog": "The dog barked at the mailman.",
             "fish": "The fish swam in the pond.", "bird": "The bird sang in the tree."}


@pytest.mark.timeout(300)
def test_core_picks_the_continuations_a_trained_model_learned(tokenizer):
    """Train a fresh 1-layer model for a few dozen steps on four sentences: the gold continuation
    (mc) and the context that fits the shared continuation (schema) must win every example."""
    import optax

    from flaxchat.gpt import GPT
    from flaxchat.train import train_step
    cfg = GPTConfig(sequence_len=T, vocab_size=TINY.vocab_size, n_layer=1, n_head=4, n_kv_head=4, n_embd=64,
                    window_pattern="L", attn_block=16)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    docs = [tokenizer.encode(s, prepend=tokenizer.bos_token_id) for s in SENTENCES.values()]
    rng = np.random.default_rng(0)

    def row():
        out = []
        while len(out) < T + 1:
            out += docs[rng.integers(len(docs))]
        return out[:T + 1]
    for _ in range(120):
        batch = np.array([row() for _ in range(8)], np.int32)
        loss = train_step(model, opt, jnp.asarray(batch[None, :, :-1]), jnp.asarray(batch[None, :, 1:]))
    assert float(loss) < 1.0
    ends = {k: (s.rsplit(" ", 1)[0], " " + s.rsplit(" ", 1)[1]) for k, s in SENTENCES.items()}  # context, " word."
    keys = list(SENTENCES)
    exs = [dict(kind="mc", context=ends[k][0], continuations=[ends[o][1] for o in keys[i:] + keys[:i]], gold=0)
           for i, k in enumerate(keys)]
    exs += [dict(kind="schema", context=[ends[o][0] for o in keys[i:] + keys[:i]], continuations=[ends[k][1]], gold=0)
            for i, k in enumerate(keys)]
    res = E.core_score(model, tokenizer, exs, batch_size=8)
    assert res == dict(accuracy=1.0, centered=1.0, n=8)
    wrong = [dict(ex, gold=1) for ex in exs]
    assert E.core_score(model, tokenizer, wrong)["accuracy"] == 0.0


# --- chat tasks -------------------------------------------------------------------------------------------


class FakeCategorical(Task):
    name = "fake_cat"
    eval_type = "categorical"
    golds: list[str] = []

    def __init__(self, split="val", **kw):
        super().__init__(**kw)

    def num_examples(self):
        return 6

    def get_example(self, i):
        q = words(80 + i, 90 if i == 5 else 8)  # the last prompt outgrows the context
        letters = ["A", "B", "C", "D"]
        opts = " ".join(f"{l}) {words(90 + i + j, 2)}" for j, l in enumerate(letters))
        gold = self.golds[i] if self.golds else "A"
        return {"messages": [{"role": "user", "content": f"{q}? {opts}"}, {"role": "assistant", "content": gold}],
                "letters": letters}

    def evaluate(self, conversation, response):
        return response == conversation["messages"][-1]["content"]


@pytest.mark.timeout(300)
def test_categorical_answer_is_the_letter_with_the_highest_logit(model, tokenizer, monkeypatch):
    task = FakeCategorical()
    ids = E.letter_ids(tokenizer, ["A", "B", "C", "D"])
    picks = []
    for conv in task:
        prompt = tokenizer.render_for_completion(conv)[-T:]
        logits = one_row_logits(model, prompt)[-1]
        picks.append("ABCD"[int(np.argmax(logits[ids]))])
    assert len(tokenizer.render_for_completion(task[5])) > T
    # Gold = the model's pick on examples 0, 2, 3, 5; a different letter on 1 and 4.
    golds = [p if i in (0, 2, 3, 5) else "ABCD"[("ABCD".index(p) + 1) % 4] for i, p in enumerate(picks)]
    monkeypatch.setattr(FakeCategorical, "golds", golds)
    assert E.categorical_accuracy(model, tokenizer, task, batch_size=4) == dict(accuracy=4 / 6, n=6)
    assert E.categorical_accuracy(model, tokenizer, task, limit=2, batch_size=4) == dict(accuracy=0.5, n=2)


class FakeGenerative(Task):
    """evaluate: the reply equals conversation['expected']; every reply graded is kept in `seen`."""
    name = "fake_gen"
    expected: list[str] = []
    seen: list[str] = []

    def __init__(self, split="val", **kw):
        super().__init__(**kw)

    def num_examples(self):
        return 4

    def get_example(self, i):
        return {"messages": [{"role": "user", "content": words(100 + i, 3 + i)}, {"role": "assistant", "content": ""}],
                "expected": self.expected[i] if self.expected else "never"}

    def evaluate(self, conversation, response):
        type(self).seen.append(response)
        return response == conversation["expected"]


@pytest.mark.timeout(300)
def test_generative_accuracy_grades_the_engines_own_replies(model, tokenizer, monkeypatch):
    engine = Engine(model, tokenizer)
    task = FakeGenerative()
    greedy = [tokenizer.decode(engine.generate_batch(tokenizer.render_for_completion(c), 1, 6, temperature=0.0)[0][0])
              for c in task]
    monkeypatch.setattr(FakeGenerative, "expected", [g if i % 2 == 0 else g + "!" for i, g in enumerate(greedy)])
    monkeypatch.setattr(FakeGenerative, "seen", [])
    assert E.generative_accuracy(engine, tokenizer, task, max_tokens=6) == dict(accuracy=0.5, n=4, too_long=0)
    assert FakeGenerative.seen == greedy
    # pass@3: example i passes when any of its three samples (seed i) is the expected one.
    sampled = [[tokenizer.decode(s) for s in engine.generate_batch(tokenizer.render_for_completion(c), 3, 6,
                                                                   temperature=1.0, seed=i)[0]]
               for i, c in enumerate(task)]
    monkeypatch.setattr(FakeGenerative, "expected", [s[i % 3] if i < 3 else "never" for i, s in enumerate(sampled)])
    res = E.generative_accuracy(engine, tokenizer, task, num_samples=3, max_tokens=6, temperature=1.0)
    assert res == dict(accuracy=0.75, n=4, too_long=0)


class FakeLongGenerative(FakeGenerative):
    name = "fake_long"

    def num_examples(self):
        return 2

    def get_example(self, i):
        conv = super().get_example(i)
        conv["messages"][0]["content"] = words(120 + i, 100 if i == 0 else 3)  # the first one outgrows the context
        conv["expected"] = "never"
        return conv


@pytest.mark.timeout(300)
def test_prompts_that_leave_no_room_count_as_wrong_and_are_counted(model, tokenizer, fake_tasks, run_dir, capsys):
    task = FakeLongGenerative()
    assert E.generative_accuracy(Engine(model, tokenizer), tokenizer, task, max_tokens=4) == \
        dict(accuracy=0.0, n=2, too_long=1)
    assert cli_main(eval_script.main, ["--model", str(run_dir), "--tasks", "fake_long", "--max-tokens", "4"]) == 0
    assert "note: 1 of the 2 fake_long prompts leave no room" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_generative_replies_show_tool_calls_and_outputs_as_render_parts_does(tokenizer, monkeypatch):
    s = tokenizer.special_tokens
    chain = ([s["<|assistant_start|>"], s["<|python_start|>"]] + tokenizer.encode("6*7") + [s["<|python_end|>"]]
             + [s["<|output_end|>"], s["<|assistant_end|>"]])
    engine = Engine(scripted_model(chain), tokenizer)
    want = render_parts([{"type": "python", "text": "6*7"}, {"type": "python_output", "text": "42"}])
    monkeypatch.setattr(FakeGenerative, "expected", [want] * 4)
    monkeypatch.setattr(FakeGenerative, "seen", [])
    res = E.generative_accuracy(engine, tokenizer, FakeGenerative(), limit=2, max_tokens=20)
    assert res["accuracy"] == 1.0, FakeGenerative.seen
    assert E.reply_text(tokenizer, [s["<|python_start|>"]] + tokenizer.encode("1+1") + [s["<|python_end|>"]]) == \
        render_parts([{"type": "python", "text": "1+1"}])


def test_run_task_dispatches_on_eval_type_and_tables_align(model, tokenizer, monkeypatch):
    monkeypatch.setitem(tasks.KNOWN, "fake_cat", ("test_evaluation", "FakeCategorical"))
    row = E.run_task("fake_cat", model, tokenizer, limit=3)
    assert row["task"] == "fake_cat" and row["metric"] == "accuracy" and row["n"] == 3 and row["seconds"] >= 0
    rows = [row, dict(task="stories_cloze", metric="centered", value=0.25, n=10, seconds=1.0)]
    text = E.format_table(rows).splitlines()
    assert len(text) == 4 and len({len(line.rstrip()) for line in text[:2]}) == 1
    assert E.markdown_table(rows).count("\n") == 3
    assert E.core_metric(rows) == dict(task="CORE", metric="mean centered", value=0.25, n=1, seconds=1.0)


# --- the script ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model, tokenizer):
    return save_run(tmp_path_factory.mktemp("eval") / "run", model, tokenizer, step=5)


@pytest.fixture
def fake_tasks(monkeypatch):
    monkeypatch.setitem(tasks.KNOWN, "fake_cat", ("test_evaluation", "FakeCategorical"))
    monkeypatch.setitem(tasks.KNOWN, "fake_gen", ("test_evaluation", "FakeGenerative"))
    monkeypatch.setitem(tasks.KNOWN, "fake_long", ("test_evaluation", "FakeLongGenerative"))


@pytest.mark.timeout(300)
def test_script_writes_eval_json_and_appends_to_the_report(run_dir, fake_tasks, capsys):
    (run_dir / "report.md").write_text("# my run\n\nnotes a person wrote\n")
    argv = ["--model", str(run_dir), "--tasks", "fake_cat,fake_gen", "--limit", "3", "--max-tokens", "4",
            "--bpb", "--bpb-tokens", "64"]
    results = eval_script.run(eval_script.parse_args(argv))
    out = capsys.readouterr().out
    assert [(r["task"], r["metric"], r["n"]) for r in results["results"]] == [
        ("fake_cat", "accuracy", 3), ("fake_gen", "pass@1", 3), ("stories val", "bits/byte", 8 * T)]
    bpb = results["results"][-1]["value"]
    assert 0 < bpb < 20 and results["step"] == 5
    assert "fake_gen" in out and "bits/byte" in out
    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved["results"] == results["results"]
    assert cli_main(eval_script.main, argv[:6]) == 0  # a second evaluation: another section
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# my run\n\nnotes a person wrote\n") and report.count("## Evaluation (step 5") == 2
    assert "| fake_cat | accuracy |" in report


@pytest.mark.timeout(300)
def test_script_creates_a_report_when_there_is_none(tmp_path, model, tokenizer, fake_tasks):
    run = save_run(tmp_path / "run", model, tokenizer, step=2)
    assert cli_main(eval_script.main, ["--model", str(run / "checkpoints" / "2"), "--tasks", "fake_cat", "--limit", "2"]) == 0
    assert "## Evaluation (step 2" in (run / "report.md").read_text() and (run / "eval.json").is_file()


@pytest.mark.parametrize("args,words", [
    (["--tasks", "nope"], "unknown task 'nope'; known tasks: "),
    (["--tasks", "mmlu"], "mmlu:PATH"),
    (["--tasks", "stories_cloze"], "--core"),
    (["--tasks", "none", "--core", "nope"], "unknown CORE set 'nope'; known: "),
    (["--tasks", "none", "--core", "hellaswag"], "hellaswag:PATH"),
    (["--tasks", "none"], "nothing to evaluate"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--num-samples", "0"], "--num-samples"),
    (["--bogus"], "unrecognized"),
])
def test_mistakes_are_one_sentence(run_dir, capsys, args, words):
    rc = cli_main(eval_script.main, ["--model", str(run_dir)] + args)
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_missing_model_folder_is_one_sentence(tmp_path, capsys):
    rc = cli_main(eval_script.main, ["--model", str(tmp_path / "absent"), "--tasks", "chat"])
    err = capsys.readouterr().err
    assert rc == 2 and "no run folder" in err and err.count("\n") == 1


def test_help_and_bad_flags_never_import_jax(tmp_path):
    code = ("import sys\nfrom flaxchat.errors import cli_main\nfrom scripts import eval as ev\n"
            "try:\n    ev.main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"rc = cli_main(ev.main, ['--model', {str(tmp_path / 'absent')!r}, '--tasks', 'chat'])\n"
            "print('RC', rc, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "--tasks" in out.stdout and "RC 2 False" in out.stdout, out.stdout + out.stderr


# --- with the real task modules -----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_all_runs_every_builtin_task_and_the_stories_cloze(run_dir, model, tokenizer):
    from tasks.core import load_core
    results = eval_script.run(eval_script.parse_args(["--model", str(run_dir), "--tasks", "all", "--limit", "2",
                                                      "--max-tokens", "4"]))
    rows = {(r["task"], r["metric"]): r for r in results["results"]}
    assert set(rows) == {("chat", "pass@1"), ("spelling", "pass@1"), ("spell", "pass@1"), ("arithmetic", "pass@1"),
                         ("stories_cloze", "accuracy"), ("stories_cloze", "centered")}
    assert all(r["n"] == 2 and 0 <= r["value"] <= 1 for k, r in rows.items() if k[1] != "centered")
    direct = E.core_score(model, tokenizer, load_core("stories_cloze", limit=2))  # the run holds this model
    assert results["core"] == rows[("stories_cloze", "centered")]["value"] == pytest.approx(direct["centered"])

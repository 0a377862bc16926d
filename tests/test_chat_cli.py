"""scripts.chat_cli: one prompt, a multi-turn session, and every user mistake as one sentence.

The model is random (TINY's architecture, so the engine's compiled functions are shared with
test_engine in one pytest run) with a real 512-token tokenizer, saved as a run folder.
"""

from __future__ import annotations

import builtins
import subprocess
import sys

import pytest

from flaxchat.errors import cli_main
from flaxchat.loading import load_model, save_run
from scripts import chat_cli
from support import nonzero_model


def typing(monkeypatch, lines):
    """Replace input(): echo the prompt, hand out `lines`, then Ctrl-D (EOFError)."""
    it = iter(lines)

    def fake(prompt=""):
        print(prompt, end="")
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr(builtins, "input", fake)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    """A chat model: its checkpoint says scripts.sft made it, as a real SFT checkpoint does."""
    return save_run(tmp_path_factory.mktemp("chat") / "run", nonzero_model(seed=3), tokenizer, step=7,
                    meta={"stage": "sft"})


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    """A base model: a checkpoint as scripts.pretrain leaves it (no stage)."""
    return save_run(tmp_path_factory.mktemp("base") / "run", nonzero_model(seed=3), tokenizer, step=5)


@pytest.fixture
def prompts(monkeypatch):
    """The token ids the real engine is handed, in order."""
    from flaxchat.engine import Engine
    seen, generate = [], Engine.generate

    def recording(self, tokens, *args, **kwargs):
        seen.append(list(tokens))
        return generate(self, tokens, *args, **kwargs)
    monkeypatch.setattr(Engine, "generate", recording)
    return seen


def test_load_model_finds_run_checkpoints_and_step_folders(run_dir):
    for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "7"):
        model, tok, meta = load_model(path)
        assert meta["step"] == 7 and tok.vocab_size == model.config.vocab_size == 512


def test_one_prompt_streams_a_reply(run_dir, capsys):
    rc = cli_main(chat_cli.main, ["--run-dir", str(run_dir), "-p", "Hello there!", "--max-tokens", "12", "-t", "0"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip() and "Traceback" not in out.err


def test_interactive_multi_turn_session(run_dir, capsys, monkeypatch):
    typing(monkeypatch, ["Hi!", "", "Tell me more.", "clear", "A new start.", "quit"])
    rc = cli_main(chat_cli.main, ["--run-dir", str(run_dir), "--max-tokens", "8", "-k", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("Assistant: ") == 3 and "(new conversation)" in out


def test_a_conversation_that_outgrows_the_context_says_so_and_goes_on(run_dir, capsys, monkeypatch):
    typing(monkeypatch, ["word " * 80, "Hi!"])  # 80 words > the 64-token context
    rc = cli_main(chat_cli.main, ["--run-dir", str(run_dir), "--max-tokens", "4"])  # ends at EOF
    out = capsys.readouterr().out
    assert rc == 0 and "context holds 64" in out and "'clear'" in out
    assert out.count("Assistant: ") == 2  # the second message still got its reply


@pytest.mark.parametrize("args,words", [
    (["-p", "   "], "empty"),
    (["-p", "hi", "-t", "-1"], "temperature"),
    (["-p", "hi", "--top-p", "2"], "top_p"),
    (["-p", "hi", "--step", "99"], "step 99"),
    (["-p", "hi", "--bogus"], "unrecognized"),
])
def test_mistakes_are_one_sentence(run_dir, capsys, args, words):
    rc = cli_main(chat_cli.main, ["--run-dir", str(run_dir)] + args)
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.timeout(120)
def test_unknown_checkpoint_from_the_real_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "--run-dir", str(tmp_path / "nope"), "-p", "hi"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 2 and "no run folder or checkpoint" in out.stderr and "Traceback" not in out.stderr


def test_a_folder_without_checkpoints(tmp_path, capsys):
    assert cli_main(chat_cli.main, ["--run-dir", str(tmp_path), "-p", "hi"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_a_base_model_continues_the_text_and_a_chat_model_chats(run_dir, base_dir, tokenizer, prompts, capsys):
    from flaxchat.loading import chat_prompt
    text = "Once upon a time"
    as_text = tokenizer.encode(text, prepend=tokenizer.bos_token_id)
    as_turn = chat_prompt(tokenizer, [{"role": "user", "content": text}])
    rc = cli_main(chat_cli.main, ["--run-dir", str(base_dir), "-p", text, "--max-tokens", "6", "-t", "0"])
    out = capsys.readouterr()
    assert rc == 0 and prompts[-1] == as_text  # no chat template around the text
    assert out.out.startswith(text) and "mode: complete: a base model (pretraining only)" in out.err
    rc = cli_main(chat_cli.main, ["--run-dir", str(run_dir), "-p", text, "--max-tokens", "6", "-t", "0"])
    out = capsys.readouterr()
    assert rc == 0 and prompts[-1] == as_turn and "mode: chat: a chat model (made by scripts.sft)" in out.err
    # The flag overrides what the checkpoint says, both ways.
    cli_main(chat_cli.main, ["--run-dir", str(base_dir), "-p", text, "--max-tokens", "2", "--mode", "chat"])
    assert prompts[-1] == as_turn and "mode: chat (--mode chat" in capsys.readouterr().err
    cli_main(chat_cli.main, ["--run-dir", str(run_dir), "-p", text, "--max-tokens", "2", "--mode", "complete"])
    assert prompts[-1] == as_text


def test_interactive_base_model_continues_each_line_on_its_own(base_dir, tokenizer, prompts, capsys, monkeypatch):
    typing(monkeypatch, ["Once upon a time", "The old dog", "quit"])
    rc = cli_main(chat_cli.main, ["--run-dir", str(base_dir), "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("mode: complete") and out.count("Text: ") == 3 and "Assistant" not in out
    assert prompts == [tokenizer.encode(t, prepend=tokenizer.bos_token_id) for t in ("Once upon a time", "The old dog")]


# A run trained on another device layout (8 chips of a TPU VM, 2 pod workers) is read here on one CPU:
# its checkpoint records the layout it was saved from, which Orbax restored onto ("Topology mismatch")
# unless told where the arrays go. Saved with one device more than this process has, replicated over
# all of them, as a data-parallel run leaves its parameters.
SAVE_ON_MORE_DEVICES = r'''
import sys, jax, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.loading import save_run
cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
model = GPT(cfg, rngs=nnx.Rngs(0))
everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P())
nnx.update(model, jax.tree.map(lambda a: jax.device_put(a, everywhere), nnx.state(model, nnx.Param)))
save_run(sys.argv[1], model, step=3)
np.savez(sys.argv[2], **{"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))})
print(jax.device_count(), flush=True)
'''


@pytest.mark.timeout(120)
def test_a_run_saved_on_more_devices_loads_on_this_one(tmp_path):
    import os

    import jax
    import numpy as np
    from flax import nnx
    n = jax.device_count() + 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    out = subprocess.run([sys.executable, "-c", SAVE_ON_MORE_DEVICES, str(tmp_path / "run"), str(tmp_path / "w.npz")],
                         env={**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0 and out.stdout.split()[-1] == str(n), out.stdout + out.stderr[-2000:]
    model, _, meta = load_model(tmp_path / "run", with_tokenizer=False)
    assert meta["step"] == 3
    saved = np.load(tmp_path / "w.npz")
    got = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert sorted(got) == sorted(saved.files) and all(np.array_equal(got[k], saved[k]) for k in got)

"""flaxchat.checkpoint keeps what it wrote: checksums per step, a damaged step gives way to the newest
intact one (moved aside by the owner, left in place by a reader, never deleted), readers never write
into a run, and a save that fails on a full disk is abandoned with one sentence.

The damage is what a person meets: a data file cut in half (a copy that stopped), `meta` emptied, an
item folder removed, 4 KB of flipped bytes. The full disk is a real one: a 3 MB tmpfs (root only;
skipped with the reason elsewhere), plus a stand-in that fails the write the way TensorStore does."""

from __future__ import annotations

import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flaxchat import checkpoint as ck
from flaxchat.errors import UserError


class Net(nnx.Module):
    def __init__(self, width: int, seed: int = 0):
        self.w = nnx.Param(jnp.asarray(np.random.default_rng(seed).standard_normal((width, width)), jnp.float32))


def _pair(width=64, seed=0):
    net = Net(width, seed)
    return net, nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param)


def _saved(directory, steps=(2, 4), width=64, keep=None):
    """A checkpoints folder holding `steps`, each with different weights; returns {step: weights}."""
    c = ck.Checkpointer(str(directory), max_to_keep=keep)
    weights = {}
    for s in steps:
        net, opt = _pair(width, seed=s)
        c.save(s, net, opt, {"note": s})
        weights[s] = np.asarray(net.w[...])
    c.close()
    return weights


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _largest(step_dir, item):
    found = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, item)) for f in fs]
    return max(found, key=os.path.getsize)


def damage(step_dir, how):
    if how == "truncated data file":
        f = _largest(step_dir, "model")
        os.truncate(f, os.path.getsize(f) // 2)
    elif how == "emptied meta":
        open(os.path.join(step_dir, "meta", "metadata"), "w").close()
    elif how == "removed optimizer folder":
        shutil.rmtree(os.path.join(step_dir, "optimizer"))
    elif how == "flipped bytes":
        f = _largest(step_dir, "model")
        n = os.path.getsize(f)
        k = min(4096, n // 2)
        with open(f, "r+b") as h:
            h.seek(n // 2 - k // 2)
            chunk = h.read(k)
            h.seek(n // 2 - k // 2)
            h.write(bytes(b ^ 0xFF for b in chunk))


DAMAGE = ["truncated data file", "emptied meta", "removed optimizer folder", "flipped bytes"]
REASON = {"truncated data file": "bytes,", "emptied meta": "meta/metadata is 0 bytes",
          "removed optimizer folder": "its optimizer folder is missing",
          "flipped bytes": "does not match the checksum"}


def test_every_step_records_checksums_that_verify(tmp_path):
    _saved(tmp_path / "c")
    for s in (2, 4):
        record = (tmp_path / "c" / str(s) / ck.CHECKSUMS)
        assert record.is_file()
        assert ck.step_problem(str(tmp_path / "c" / str(s))) is None
    assert not [n for n in os.listdir(tmp_path / "c") if "tmp" in n]


@pytest.mark.parametrize("how", DAMAGE)
def test_the_owner_moves_a_damaged_latest_step_aside_and_resumes_the_one_before(tmp_path, how):
    weights = _saved(tmp_path / "c")
    damage(str(tmp_path / "c" / "4"), how)
    before = _files(tmp_path / "c" / "4")
    said = []
    c = ck.Checkpointer(str(tmp_path / "c"))
    step, meta = c.newest_intact(log=said.append, move_damaged=True)
    assert step == 2 and meta["note"] == 2
    assert len(said) == 1 and said[0].startswith("warning: checkpoint step 4 in ") and REASON[how] in said[0]
    assert "using step 2" in said[0] and ".damaged" in said[0]
    assert c.all_steps() == [2] and c.latest_step() == 2
    moved = os.listdir(tmp_path / "c.damaged")
    assert len(moved) == 1 and moved[0].startswith("4-")
    assert _files(tmp_path / "c.damaged" / moved[0]) == before  # moved whole, nothing deleted
    net, opt = _pair()
    assert c.restore(net, opt, step)["note"] == 2
    np.testing.assert_array_equal(np.asarray(net.w[...]), weights[2])
    c.save(4, net, opt, {"note": "again"})  # the step number is free again for the resumed run
    c.close()
    assert ck.step_problem(str(tmp_path / "c" / "4")) is None


@pytest.mark.parametrize("how", [d for d in DAMAGE if d != "removed optimizer folder"])  # a model has none
def test_a_reader_uses_the_newest_intact_step_and_leaves_the_damaged_one_alone(tmp_path, capsys, how):
    from flaxchat.loading import load_model, save_run
    from support import nonzero_model

    run = tmp_path / "run"
    for s, seed in ((2, 1), (4, 2)):
        save_run(run, nonzero_model(seed=seed), step=s)
    damage(str(run / "checkpoints" / "4"), how)
    before = _files(run)
    model, _, meta = load_model(run, with_tokenizer=False)
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]),
                                  np.asarray(nonzero_model(seed=1).lm_head.kernel[...]))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 4" in err[0] and REASON[how] in err[0] and "using step 2" in err[0], err
    assert _files(run) == before  # nothing moved, nothing written
    with pytest.raises(UserError, match="step 4 .* is damaged"):
        load_model(run, step=4, with_tokenizer=False)


def test_a_reader_checks_only_what_it_reads(tmp_path):
    """The model of a step whose optimizer folder is gone still serves chat and eval; the owner,
    which resumes the optimizer too, falls back."""
    _saved(tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "4" / "optimizer")
    c = ck.open_reader(str(tmp_path / "c"))
    assert c.newest_intact(items=("model", "meta"), log=print)[0] == 4
    assert c.newest_intact(log=print)[0] == 2
    c.close()


def test_no_intact_step_is_one_sentence_and_nothing_moves(tmp_path):
    _saved(tmp_path / "c")
    damage(str(tmp_path / "c" / "4"), "flipped bytes")
    damage(str(tmp_path / "c" / "2"), "emptied meta")
    before = _files(tmp_path / "c")
    c = ck.Checkpointer(str(tmp_path / "c"))
    with pytest.raises(UserError) as e:
        c.newest_intact(log=print, move_damaged=True)
    c.close()
    msg = str(e.value)
    assert "is damaged or incomplete" in msg and "step 4:" in msg and "step 2:" in msg and "--fresh" in msg
    assert "\n" not in msg and "<bound method" not in msg
    assert _files(tmp_path / "c") == before and not (tmp_path / "c.damaged").exists()


def test_readers_never_write_into_the_run(tmp_path):
    """A save in flight looks like `<step>.orbax-checkpoint-tmp`: the old readers (chat, eval, SFT's
    --base) opened the run as its owner and deleted it, which ended the training run's save."""
    from flaxchat.loading import load_model, read_run, save_run
    from flaxchat.tokenizer import Tokenizer
    from support import nonzero_model
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.export import read_checkpoint

    run = tmp_path / "run"
    tok = Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(100)], 512, max_chars=50_000)
    save_run(run, nonzero_model(seed=1), tok, step=3)
    in_flight = run / "checkpoints" / "4.orbax-checkpoint-tmp"
    (in_flight / "model").mkdir(parents=True)
    (in_flight / "model" / "half-written").write_bytes(b"x" * 100)
    before = {p: os.stat(run / p).st_mtime_ns for p in _files(run)}
    load_model(run)
    read_run(run)
    read_checkpoint(str(run))
    assert {p: os.stat(run / p).st_mtime_ns for p in _files(run)} == before


# --- a full disk -----------------------------------------------------------------------------------




def _fill_until_it_fails(directory):
    c = ck.Checkpointer(str(directory), max_to_keep=2)
    net, opt = _pair(width=520)  # 1.08 MB of random weights (Adam's zero moments compress to nothing)
    step = 0
    with pytest.raises(UserError) as e:
        for step in range(1, 20):
            net.w[...] = net.w[...] + 1.0
            c.save(step, net, opt, {"note": step})
    return c, step, str(e.value)


@pytest.mark.timeout(120)
def test_a_full_disk_abandons_the_save_with_one_sentence_and_the_last_good_step_restores(small_disk):
    directory = small_disk / "checkpoints"
    c, at, msg = _fill_until_it_fails(directory)
    assert msg.startswith("saving checkpoint step ") and "no space left on the device" in msg
    assert re.search(r"\(\d\.\d MB free; a step takes about (0\.9|1\.\d) MB and up to 3 are on disk", msg), msg
    assert "the same command resumes from step" in msg
    assert "\n" not in msg and "Traceback" not in msg
    failed = int(msg.split()[3])
    assert not [n for n in os.listdir(directory) if "tmp" in n]  # the half step is gone, its space back
    c.close()
    reader = ck.open_reader(str(directory))
    good, _ = reader.newest_intact(log=print)
    assert good < failed and ck.step_problem(str(directory / str(good))) is None
    net, opt = _pair(width=520)
    assert reader.restore(net, opt, good)["note"] == good
    np.testing.assert_allclose(np.asarray(net.w[...]), np.asarray(_pair(width=520)[0].w[...]) + good, rtol=1e-5)
    reader.close()


@pytest.mark.timeout(60)
def test_a_failed_saves_other_writes_land_before_its_folder_is_removed(tmp_path, monkeypatch):
    """Orbax raises the first item's write that failed while the other items' writes go on; one that
    lands after the removal brings the half step back (seen in CI: `300.orbax-checkpoint-tmp` left
    after a full disk). Here the first write fails at once and another lands 0.5 s later, into the
    step's temporary folder as the optimizer's did: the folder must be gone after both."""
    import concurrent.futures
    import errno
    import threading
    import time
    c = ck.Checkpointer(str(tmp_path / "c"), max_to_keep=2)
    net, opt = _pair()
    c.save(1, net, opt, {})
    c.wait()
    manager = c._mgr._checkpointer._async_manager
    real_commit, landed = manager.start_async_commit, threading.Event()

    def one_fails_one_lands_late(directory, commit_futures, on_commit_callback):
        failed = concurrent.futures.Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        late = concurrent.futures.Future()

        def write_late():  # where the optimizer's late write landed when this was reproduced on a tmpfs
            time.sleep(0.5)
            d = tmp_path / "c" / "2.orbax-checkpoint-tmp" / "optimizer.orbax-checkpoint-tmp" / "ocdbt.process_0" / "d"
            d.mkdir(parents=True, exist_ok=True)
            (d / "late").write_bytes(b"x" * 4096)
            landed.set()
            late.set_result(None)
        threading.Thread(target=write_late, daemon=True).start()
        return real_commit(directory, [failed, *commit_futures, late], on_commit_callback)

    monkeypatch.setattr(manager, "start_async_commit", one_fails_one_lands_late)
    c.save(2, net, opt, {})
    with pytest.raises(UserError, match=r"saving checkpoint step 2 .* no space left on the device"):
        c.wait()
    assert landed.wait(10)
    assert sorted(os.listdir(tmp_path / "c")) == ["1"]  # no half step 2, not even a late part of it
    monkeypatch.undo()
    c.close()


def test_a_write_that_fails_in_the_background_stops_the_next_step(tmp_path, monkeypatch):
    """The stand-in where no tmpfs can be mounted: the write in flight fails as TensorStore reports
    a full disk, and `raise_if_failed` (called every step) raises it as one sentence."""
    c = ck.Checkpointer(str(tmp_path / "c"), max_to_keep=2)
    net, opt = _pair()
    c.save(1, net, opt, {})
    c.wait()

    def full(*_a, **_k):
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file '
                         f'"{tmp_path}/c/2.orbax-checkpoint-tmp/model/": Failed to write 230644 bytes to file 4: '
                         "No space left on device [os_error_code='28']")

    c.save(2, net, opt, {})
    c._mgr.wait_until_finished()  # the real write is done; its outcome is what the stand-in decides
    monkeypatch.setattr(c._mgr, "wait_until_finished", full)
    with pytest.raises(UserError, match=r"saving checkpoint step 2 .* no space left on the device .* resumes from step 1"):
        c.raise_if_failed()
    monkeypatch.undo()
    c.close()

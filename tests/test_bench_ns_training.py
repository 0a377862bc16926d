"""bench.ns_training: the main job per Polar Express dtype, each a real run in its own process."""
import json
import math
import re

import pytest

from bench import ns_training
from flaxchat.errors import UserError, cli_main

TINY = ["--", "--eval-tokens", "2048", "--max-chars-tokenizer", "200000", "--vocab-size", "512",
        "--num-samples", "0", "--sequence-len", "64"]


@pytest.mark.slow
def test_each_dtype_trains_its_own_run_and_is_tabulated(tmp_path, capsys):
    bpb = ns_training.main(["--steps", "2", "--depth", "1", "--seeds", "0", "--dtypes", "float32,bfloat16",
                            "--keep", str(tmp_path), *TINY])
    out = capsys.readouterr().out
    assert f"seed 0 bfloat16: training 2 steps (its output: {tmp_path / 'bfloat16_seed0'}.log)" in out  # progress
    assert set(bpb) == {"float32", "bfloat16"}
    for dt in bpb:
        run = tmp_path / f"{dt}_seed0"
        train = json.loads((run / "config.json").read_text())["train"]
        assert (train["ns_dtype"], train["seed"], train["eval_tokens"]) == (dt, 0, 2048)  # the flags reached the run
        assert bpb[dt][0] == ns_training.final_val_bpb(str(run))
        assert math.isfinite(bpb[dt][0]) and 0 < bpb[dt][0] < 20
    table = out[out.index("validation bpb after 2 steps"):].splitlines()
    assert table[2].split()[0] == "float32" and table[2].split()[-1] == "+0.00000"  # float32 against itself
    assert table[3].split()[0] == "bfloat16"


def test_a_failed_run_is_one_sentence_naming_its_log(tmp_path, capsys):
    code = cli_main(ns_training.main, ["--steps", "1", "--depth", "1", "--seeds", "0", "--dtypes", "float32",
                                       "--keep", str(tmp_path), "--", "--no-such-flag"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and re.search("failed .*exit 2.*float32_seed0.log", err)
    assert "--no-such-flag" in (tmp_path / "float32_seed0.log").read_text()


@pytest.mark.parametrize("argv, says", [(["--dtypes", "bfloat16"], "--dtypes starts with float32"),
                                        (["--dtypes", "float32,fp8"], "--dtypes starts with float32"),
                                        (["--seeds", "one"], "--seeds takes comma-separated integers"),
                                        (["--seeds", "0,0"], "--seeds and --dtypes name each value once"),
                                        (["--steps", "0"], "--steps and --depth are at least 1")])
def test_bad_flags_are_one_sentence(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        ns_training.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_run_without_a_validation_figure_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 3.0}) + "\n")
    with pytest.raises(UserError, match="no validation figure"):
        ns_training.final_val_bpb(str(tmp_path))

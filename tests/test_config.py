"""Every flag's --help text lives on its config field (`flaxchat.config.flag`), and none is missing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from flaxchat.config import RunConfig, TrainConfig, flag, flag_help, parse_config
from flaxchat.finetune import StageConfig
from scripts.rl import RLConfig
from scripts.sft import SFTConfig

ROOT = Path(__file__).resolve().parent.parent
# Every class a script builds its flags from: those given to parse_config, and chat_web's Limits.
CONFIGS = {"TrainConfig": TrainConfig, "SFTConfig": SFTConfig, "RLConfig": RLConfig}


def _limits():
    pytest.importorskip("fastapi")
    from scripts.chat_web import Limits
    return Limits


def test_every_config_given_to_parse_config_is_checked_here():
    given = set()
    for path in [*ROOT.glob("scripts/*.py"), *ROOT.glob("flaxchat/**/*.py")]:
        given |= set(re.findall(r"parse_config\(\s*(\w+)\s*,", path.read_text()))
    assert given - {"cls"} == set(CONFIGS), "add the new config class to CONFIGS"


@pytest.mark.parametrize("name", [*CONFIGS, "Limits"])
def test_every_flag_has_help(name):
    cls = CONFIGS[name] if name in CONFIGS else _limits()
    missing = [f.name for f in dataclasses.fields(cls) if not flag_help(cls, f.name).strip()]
    assert not missing, (f"{name}: these fields have no help text; give each one with "
                         f"flaxchat.config.flag(default, help): {missing}")


def test_a_new_default_keeps_the_parents_help_and_a_new_text_replaces_it():
    # SFTConfig.run_dir and RLConfig.steps change only the default; StageConfig rewords both.
    assert flag_help(SFTConfig, "run_dir") == flag_help(StageConfig, "run_dir") != flag_help(TrainConfig, "run_dir")
    assert flag_help(RLConfig, "steps") == "optimizer steps"
    assert flag_help(SFTConfig, "steps") == "optimizer steps; -1 derives them from --epochs"
    assert (SFTConfig().run_dir, RLConfig().steps, SFTConfig().steps) == ("runs/sft", 100, RunConfig.steps)
    # the ones StageConfig leaves alone are RunConfig's
    assert flag_help(RLConfig, "tracker") == flag_help(RunConfig, "tracker") != flag_help(TrainConfig, "tracker")


def test_the_fields_help_reaches_the_parser(capsys):
    @dataclasses.dataclass(frozen=True)
    class Base:
        width: int = flag(3, "how wide the thing is")
        fast: bool = flag(False, "go fast")

        def validate(self):
            pass

    @dataclasses.dataclass(frozen=True)
    class Child(Base):
        width: int = 5

    with pytest.raises(SystemExit):
        parse_config(Child, ["--help"], prog="p", description=None)
    out = " ".join(capsys.readouterr().out.split())
    assert "--width WIDTH how wide the thing is (default: 5)" in out
    assert "--fast, --no-fast go fast (default: False)" in out
    assert parse_config(Child, ["--width", "7", "--fast"], prog="p", description=None) == Child(width=7, fast=True)

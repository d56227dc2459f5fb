"""``boost train``'s flags are generated from TrainConfig's fields (issue 43): the names stay
as they were, every help line shows its field's default, and the choices are the lists the
code checks against (layouts.LAYOUTS, schedules.SCHEDULES, convert.METHODS)."""

from __future__ import annotations

import argparse
import dataclasses

from boost_compiler.convert import METHODS
from boost_compiler.layouts import LAYOUTS
from boost_compiler.train.config import TrainConfig, add_arguments, from_args
from boost_compiler.train.schedules import SCHEDULES

# The flags as they were written by hand before issue 43: none renamed, none lost.
FLAGS = """config model hf-config init-from layout low-rank-method rank-ratio rank rank-multiple
tp dp pp microbatches pp-layers schedule virtual-stages steps stop-at batch seq lr warmup
min-lr-ratio weight-decay clip seed data tokenizer text-field txt-unit eos-token
eval-fraction eval-data eval-every eval-batches checkpoint-dir save-every resume
resume-or-start overwrite on-nonfinite keep allow-schedule-change metrics plot tensorboard
peak-tflops bf16 mixed-precision compile fsdp progress throttle comm-timeout
log-every""".split()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def _actions() -> dict[str, argparse.Action]:
    return {a.option_strings[0][2:]: a for a in _parser()._actions if a.option_strings[0] != "-h"}


def test_flag_names_are_unchanged() -> None:
    assert sorted(_actions()) == sorted(FLAGS)


def test_every_field_flag_shows_its_default_from_the_field() -> None:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, action in _actions().items():
        if name == "config":
            continue
        f = fields[name.replace("-", "_")]
        assert action.help and action.help.endswith(")") and "(default: " in action.help, name
        if f.default is not None and not isinstance(f.default, bool):
            assert action.help.endswith(f"(default: {f.default})"), (name, action.help)


def test_choices_come_from_the_code_lists() -> None:
    acts = _actions()
    assert acts["layout"].choices == ("hf", *LAYOUTS)
    assert acts["schedule"].choices == SCHEDULES
    assert acts["low-rank-method"].choices == METHODS


def test_no_flags_is_the_dataclass_default_and_flags_parse() -> None:
    assert from_args(_parser().parse_args([])) == TrainConfig()
    cfg = from_args(_parser().parse_args(
        ["--tp", "2", "--pp-layers", "3,5", "--data", "a", "b", "--no-compile", "--resume",
         "--checkpoint-dir", "d", "--rank-ratio", "0.5"]))  # fmt: skip
    assert (cfg.tp, cfg.pp_layers, cfg.data, cfg.compile, cfg.resume, cfg.rank_ratio) == (
        2, (3, 5), ["a", "b"], False, True, 0.5)  # fmt: skip

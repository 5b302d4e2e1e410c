"""Tests of MaxText/config/xla_flags.py: the pre-launch check of a recipe's `xla_flags` against the installed jaxlib.

Covers: every flag of every shipped GPU recipe starts XLA; renamed, invented and malformed flags are
reported (with the right suggestion, in the order given, good flags untouched); a bad value does not hide
an unknown flag; the caller's XLA_FLAGS is not inherited; a Python that cannot run is a problem, not an
exception; the known-name list and the suggestion rule. Each check_flags call is one CPU subprocess (~0.5 s).
"""

from __future__ import annotations

import glob
import os

import pytest

from MaxText.config.load import load_config
from MaxText.config.xla_flags import FlagProblem, check_flags, known_flag_names, suggest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RECIPES = sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "gpu", "*.yml")))

GOOD = ["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_command_buffer=FUSION",
        "--xla_disable_hlo_passes=rematerialization"]
RENAMED = "--xla_gpu_enable_nccl_symmetric_buffers=true"
NEW_NAME = "--xla_gpu_experimental_enable_nccl_symmetric_buffers"
INVENTED = "--xla_gpu_made_up_flag=1"
MALFORMED = "xla_gpu_enable_latency_hiding_scheduler=true"
MIXED = [GOOD[0], RENAMED, GOOD[1], MALFORMED, INVENTED, GOOD[2]]


def describe(problems: list[FlagProblem]) -> str:
    """The problems one per line, for assertion messages."""
    return "\n".join(f"  {p.flag}: {p.message}" for p in problems) or "  (none)"


@pytest.fixture(scope="module")
def mixed_problems() -> list[FlagProblem]:
    """check_flags over good and bad flags interleaved, run once for the tests that read it."""
    return check_flags(MIXED)


def test_gpu_recipes_exist():
    assert GPU_RECIPES, "no configs/gpu/*.yml found: the recipe test below would pass vacuously"


@pytest.mark.parametrize("path", GPU_RECIPES, ids=os.path.basename)
def test_every_gpu_recipe_flag_starts_xla(path):
    from MaxText.config.load import load_config

    flags = load_config([path]).xla_flags  # the recipe's own or inherited from its base_config
    assert flags and flags.split(), f"{path} has no xla_flags; the GPU recipes are expected to set them"
    problems = check_flags(flags)
    assert problems == [], f"{os.path.basename(path)}: XLA rejects its xla_flags:\n{describe(problems)}"


def test_only_bad_flags_reported_in_order(mixed_problems):
    got = [p.flag for p in mixed_problems]
    assert got == [RENAMED, MALFORMED, INVENTED], (
        f"expected exactly the renamed, malformed and invented flags, in that order:\n{describe(mixed_problems)}")


def test_renamed_flag_suggests_new_name(mixed_problems):
    problem = next(p for p in mixed_problems if p.flag == RENAMED)
    assert problem.suggestion == NEW_NAME, f"suggestion for {RENAMED}: {problem.suggestion!r}, want {NEW_NAME!r}"
    assert "unknown XLA flag --xla_gpu_enable_nccl_symmetric_buffers" in problem.message, problem.message
    assert f"did you mean {NEW_NAME}?" in problem.message, problem.message


def test_invented_flag_named_in_message(mixed_problems):
    problem = next(p for p in mixed_problems if p.flag == INVENTED)
    assert "--xla_gpu_made_up_flag" in problem.message, problem.message
    assert "\n" not in problem.message, f"message should be one line: {problem.message!r}"


def test_malformed_flag_reported_without_running():
    # A Python that cannot start would add a "could not check" problem if anything had been run.
    problems = check_flags([MALFORMED], python="/nonexistent/python")
    assert [p.flag for p in problems] == [MALFORMED], describe(problems)
    assert "malformed" in problems[0].message and "--name=value" in problems[0].message, problems[0].message


def test_bad_value_does_not_hide_unknown_flag():
    # XLA stops at a bad value before it looks for unknown flags; both must still be reported.
    problems = check_flags(["--xla_gpu_enable_latency_hiding_scheduler=maybe", "--xla_gpu_made_up_flag=1"])
    assert [p.flag for p in problems] == ["--xla_gpu_enable_latency_hiding_scheduler=maybe",
                                          "--xla_gpu_made_up_flag=1"], describe(problems)
    assert "bad value" in problems[0].message and "maybe" in problems[0].message, problems[0].message
    assert "unknown XLA flag" in problems[1].message, problems[1].message


def test_callers_xla_flags_not_inherited(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_flag_only_the_caller_has=1")
    problems = check_flags(GOOD[0])
    assert problems == [], f"the caller's XLA_FLAGS leaked into the check:\n{describe(problems)}"


def test_unrunnable_python_is_a_problem_not_an_exception():
    problems = check_flags(GOOD, python="/nonexistent/python")
    assert len(problems) == 1 and "could not check" in problems[0].message, describe(problems)


def test_known_flag_names():
    names = known_flag_names()
    for flag in GOOD + [NEW_NAME]:
        name = flag.lstrip("-").split("=")[0]
        assert name in names, f"{name} (a flag this jaxlib accepts) missing from known_flag_names()"
    old = RENAMED.lstrip("-").split("=")[0]
    assert old not in names, f"{old} (rejected by this jaxlib) listed by known_flag_names()"
    assert names == sorted(set(names)), "known_flag_names() should be sorted and without duplicates"


def test_suggest_prefers_the_renamed_tail():
    known = ["xla_gpu_enable_nccl_user_buffers", "xla_gpu_experimental_enable_nccl_symmetric_buffers"]
    assert suggest("xla_gpu_enable_nccl_symmetric_buffers", known) == known[1]
    # Without a unique tail, plain similarity decides; far-off names get no suggestion at all.
    assert suggest("xla_gpu_enable_nccl_user_bufers", known) == known[0]
    assert suggest("xla_gpu_made_up_flag", known) is None


def test_retired_aliases_are_named_with_their_successors():
    """jaxlib 0.12 still parses --xla_gpu_enable_pipelined_* (the recipes' first flags) but has retired them:
    `reserved` in its descriptor, aliases of --xla_gpu_pipeline_*=on. Current flags are not reported."""
    from MaxText.config.xla_flags import retired_flags

    old = ["--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_enable_pipelined_reduce_scatter=true"]
    assert check_flags(old) == []  # they still parse ...
    lines = retired_flags(old + GOOD)  # ... but are named, each with its successor
    assert len(lines) == 2 and "of --xla_gpu_pipeline_all_gather;" in lines[0], lines
    assert "of --xla_gpu_pipeline_reduce_scatter;" in lines[1], lines
    for recipe in GPU_RECIPES:
        assert retired_flags(load_config([recipe]).xla_flags) == [], recipe

"""configs/base.yml and the README are held to MaxText/config/schema.py, and the schema's rules are what
load_config enforces: every key, by the class of value its rules name (below a bound, above it, off its choices,
null), not a hand-picked few."""

from __future__ import annotations

import math
import os
import re

import pytest
import yaml

from MaxText.config import parse
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config, plain, replace
from MaxText.config.schema import SCHEMA, Key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_TEXT = open(parse.BASE_CONFIG, encoding="utf-8").read()
DEFAULTS = yaml.safe_load(BASE_TEXT)


def refusal(argv) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    return str(e.value)


def test_base_yml_names_the_schemas_keys_in_its_order():
    assert list(DEFAULTS) == list(SCHEMA), (
        f"only in configs/base.yml: {sorted(set(DEFAULTS) - set(SCHEMA))}; only in MaxText/config/schema.py: "
        f"{sorted(set(SCHEMA) - set(DEFAULTS))}; or the two list them in different orders")


def test_each_base_yml_line_carries_its_keys_doc():
    """The comment after each key in configs/base.yml is the schema's doc of that key, word for word."""
    wrong = []
    for number, line in enumerate(BASE_TEXT.splitlines(), 1):
        match = re.match(r"([a-z_0-9]+):.*?\s#\s(.*)$", line)
        if match and match.group(1) in SCHEMA and match.group(2).strip() != SCHEMA[match.group(1)].doc:
            wrong.append(f"configs/base.yml:{number} {match.group(1)}: {match.group(2).strip()!r} != "
                         f"{SCHEMA[match.group(1)].doc!r}")
    documented = {m.group(1) for m in re.finditer(r"^([a-z_0-9]+):.*?\s#\s", BASE_TEXT, re.M)}
    wrong += [f"configs/base.yml: {key} has no comment (give it schema.py's doc)" for key in SCHEMA
              if key not in documented]
    assert not wrong, "\n".join(wrong)


def test_each_default_is_of_its_keys_type_and_within_its_rules():
    wrong = []
    for key, default in DEFAULTS.items():
        spec = SCHEMA[key]
        if default is None:
            if not spec.null:
                wrong.append(f"{key}: default null, but the schema does not allow null")
        elif type(default) is not spec.type:
            wrong.append(f"{key}: default {default!r} is a {type(default).__name__}, the schema says "
                         f"{spec.type.__name__}")
        elif spec.error(default):
            wrong.append(f"{key}: default {default!r} {spec.error(default)}")
        wrong += [f"{key}: choice {c!r} is not a {spec.type.__name__}" for c in spec.choices
                  if type(c) is not spec.type]
    assert not wrong, "\n".join(wrong)


def test_the_readme_names_only_keys_the_schema_has():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = readme.splitlines()
    implemented = next(line for line in lines if line.startswith("| implemented |"))
    table = lines[lines.index("| key | here | upstream | why |") + 2:]
    differing = [re.match(r"\| `([a-z_0-9]+)` \|", line).group(1) for line in table[:next(
        i for i, line in enumerate(table) if not line.startswith("| `"))]]
    named = re.findall(r"`([a-z_0-9]+)`", implemented.split("|")[2]) + differing
    assert len(named) > 100, "the README's key tables were not found"
    assert not [k for k in named if k not in SCHEMA], [k for k in named if k not in SCHEMA]


def _outside(spec: Key) -> list[tuple[str, float]]:
    """(side, value) just outside each bound of a numeric key."""
    cases = []
    if spec.low is not None:
        cases.append(("low", spec.low if spec.low_open else spec.low - 1))
    if spec.high is not None:
        cases.append(("high", spec.high if spec.high_open else (spec.high + 1 if spec.type is int else spec.high * 2)))
    return [(side, int(v) if spec.type is int else float(v)) for side, v in cases]


BOUNDED = [(key, side, value) for key, spec in SCHEMA.items() if spec.type in (int, float)
           for side, value in _outside(spec)]


@pytest.mark.parametrize("key, side, value", BOUNDED, ids=[f"{k}-{s}" for k, s, _ in BOUNDED])
def test_a_value_past_a_bound_is_refused_naming_the_key_and_the_range(key, side, value):
    message = refusal([f"{key}={value!r}"])
    assert message.startswith(f"{key}={value!r} must "), message


@pytest.mark.parametrize("key", [k for k, spec in SCHEMA.items() if spec.choices])
def test_a_value_off_the_choices_is_refused_listing_them(key):
    message = refusal([f"{key}=bogus"])
    assert message.startswith(f"{key}=bogus is not one of ") and all(c in message for c in SCHEMA[key].choices), message


@pytest.mark.parametrize("key", [k for k, spec in SCHEMA.items() if spec.type is not str])
def test_null_is_taken_exactly_where_the_schema_allows_it(key):
    if SCHEMA[key].null:
        assert load_config([f"{key}=null"])[key] is None
    else:
        assert "cannot be null" in refusal([f"{key}=null"])


@pytest.mark.parametrize("spec, value, error", [
    (Key(int, "", low=1), 0, "must be at least 1"),
    (Key(int, "", low=0), -1, "must not be negative"),
    (Key(float, "", low=0, low_open=True), 0.0, "must be greater than 0"),
    (Key(float, "", high=10.0), 11.0, "must be at most 10"),
    (Key(float, "", low=0, high=1.0), 1.5, "must be between 0 and 1"),
    (Key(float, "", low=0, high=1, high_open=True, why="a fraction"), 1.0, "must be in [0, 1) (a fraction)"),
    (Key(int, "", low=0, high=2 ** 32, high_open=True), 2 ** 32, "must be in [0, 2**32)"),
    (Key(int, "", low=1, also={-1: "all"}), 0, "must be at least 1 (or -1: all)"),
    (Key(int, "", low=1, also={-1: "all"}), -1, None),
    (Key(float, "", null=True, low=0, low_open=True), -2.0, "must be greater than 0 (or null)"),
    (Key(int, "", low=1), 2 ** 31, "is out of range: at most 2**31 - 1"),
    (Key(float, "", low=0), math.inf, "must be a finite number"),
    (Key(str, "", choices=("a", "b")), "c", "is not one of a, b"),
    (Key(str, "", choices=("a", "b")), "b", None),
])
def test_a_keys_rule_says_what_is_wrong_in_words(spec, value, error):
    got = spec.error(value)
    assert (got is None and error is None) or (got is not None and error is not None and got.startswith(error)), got


def test_a_loaded_config_is_frozen_and_replace_validates_the_copy():
    cfg = load_config(["steps=7"])
    with pytest.raises(AttributeError):
        cfg.steps = 0
    assert hash(cfg) == hash(load_config(["steps=7"])), "the same values freeze to the same hashable config"
    changed = replace(cfg, steps="9", run_name="r")
    assert (changed.steps, changed.run_name, cfg.steps, cfg.run_name) == (9, "r", 7, None)
    with pytest.raises(ConfigError, match="steps=0 must be at least 1"):
        replace(cfg, steps=0)
    with pytest.raises(ConfigError, match="unknown key 'stepz'.*did you mean 'steps'"):
        replace(cfg, stepz=3)
    rules = plain(cfg)["logical_axis_rules"]
    assert type(rules) is list and all(type(r) is list and type(r[1]) is list for r in rules), rules
    assert yaml.safe_load(yaml.safe_dump(plain(cfg))) == plain(load_config(["steps=7"])), "the run's config.yaml"

"""Reading a config's values: YAML files parsed strictly (a key given twice is an error), and one value
parsed to its key's type (schema.py's; no JAX here). load.py merges them; upstream.py reads upstream MaxText's
keys with the same rules.
"""

from __future__ import annotations

import copy
import difflib
import functools
import io
import os
import re
from typing import Any

import yaml

from MaxText.config.errors import ConfigError, clip, shown
from MaxText.config.schema import SCHEMA

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
BASE_CONFIG = os.path.join(CONFIG_DIR, "base.yml")


class _DuplicateKey(Exception):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"{key} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


@functools.lru_cache(maxsize=256)
def _parse_yaml(path: str, text: str) -> Any:
    """PyYAML's parse of one file's text, kept: pure Python, it is most of a load_config (the layout search loads
    hundreds of configs, the tests thousands), and a config's files are the same text each time. Keyed on the
    text itself, so an edited file is parsed afresh; failures are not kept."""
    stream = io.StringIO(text)
    stream.name = path  # PyYAML's error marks name the file, as when it reads the file object
    return yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str) -> dict[str, Any]:
    shown = clip(path, 200)  # the reason after it must survive error_line's bound
    if not os.path.isfile(path):
        raise ConfigError(f"config file {shown} does not exist")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"config file {shown} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {shown} is not UTF-8 text: byte {e.start} is 0x{raw[e.start]:02x}; save it "
                          "as UTF-8") from None
    try:
        data = copy.deepcopy(_parse_yaml(path, text))  # callers edit what they get (base_config is popped)
    except _DuplicateKey as e:
        raise ConfigError(f"config file {shown}: {clip(str(e), 200)}; keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {shown} is not valid YAML: {clip(str(e).splitlines()[0], 200)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {shown} must hold a mapping of key: value, not {type(data).__name__}")
    return data


# Command-line numbers and booleans are read by their key's type, not by YAML 1.1, which takes 010 for 8
# (octal), 1:30 for 90 (base 60) and yes/on for true.
_INT = re.compile(r"[+-]?[0-9]+")
COMMAND_LINE = "on the command line"  # load._merge's origin for key=value arguments
_BOOLS = {"true": True, "false": False}


def _command_line_scalar(want: type, value: str) -> Any:
    """`value` as `want` when it spells one plainly; else the string itself (rejected by _coerce)."""
    text = value.strip()
    if want is int and _INT.fullmatch(text):
        return int(text, 10)
    if want is float:
        try:
            return float(text) if not _INT.fullmatch(text) else float(int(text, 10))
        except ValueError:
            return value
    if want is bool and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if want is bool and text in ("1", "0"):  # upstream's pydantic config reads 1/0 as booleans
        return text == "1"
    return value


def nearest(key: str, known) -> str:
    """"; did you mean 'x'?" for the known name that `key` spells in other case or with '-' for '_', else for one
    close to it; nothing when none is."""
    plain = {name.lower().replace("-", "_"): name for name in known}
    wanted = key.lower().replace("-", "_")
    close = [wanted] if wanted in plain else difflib.get_close_matches(wanted, list(plain), n=1, cutoff=0.75)
    return f"; did you mean {plain[close[0]]!r}?" if close else ""


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def coerce(key: str, value: Any, default: Any, origin: str) -> Any:
    """Parses `value` to its key's type: the schema's for this trainer's keys, that of `default` (upstream's) for
    upstream MaxText's; `origin` says where the value came from."""
    spec = SCHEMA.get(key)
    want = spec.type if spec is not None else type(default)
    optional = spec is not None and spec.null
    if isinstance(value, str) and value.strip() in ("null", "None", "~", "") and (optional or want is not str):
        value = None  # a string key that may not be null keeps the text (a file or split may be named "null")
    elif isinstance(value, str) and origin == COMMAND_LINE and want in (int, float, bool):
        value = _command_line_scalar(want, value)
    elif isinstance(value, str) and want is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} ({origin}) cannot be null; give {_article(want.__name__)} {want.__name__}, "
                          f"e.g. {key}={default}")
    ok = False
    if want is bool:
        if value in (0, 1) and not isinstance(value, (bool, float)):  # 1/0 in YAML, as upstream reads them
            value = bool(value)
        ok = isinstance(value, bool)
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
    elif want is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif want is str:
        # Scalars YAML typed otherwise (123, 2024-05-01) are still valid names and paths.
        ok = not isinstance(value, (bool, list, dict))
        value = str(value) if ok else value
    elif want is list:
        ok = isinstance(value, list)
    if not ok:
        example = default if default is not None else "..."
        raise ConfigError(f"{key}={shown(value)} ({origin}) is not a valid {want.__name__}; "
                          f"use {_article(want.__name__)} {want.__name__} such as {key}={example}")
    return value

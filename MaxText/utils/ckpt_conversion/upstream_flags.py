"""Upstream MaxText's converter flags, read onto this trainer's key=value arguments.

Upstream's converters take some options as flags (`--hf_model_path=<dir>`, `--hf_model_path <dir>`, and for
to_maxtext also `hf_model_path=<dir>`). Each flag of upstream 0.2.5 either maps onto this converter's
argument, is accepted with a log line where it cannot change the result here, or is refused in one line.
"""

from __future__ import annotations

from typing import NamedTuple

from MaxText.config.errors import ConfigError
from MaxText.config.storage import shown_path


class Flag(NamedTuple):
    ours: str | None          # the key=value argument it becomes; None: accepted, no effect (reason in note)
    note: str
    values: tuple = ()        # the values accepted (empty: any)
    boolean: bool = False     # may stand alone (`--flag` means true)


TO_MAXTEXT = {
    "hf_model_path": Flag("hf_model_path", "the Hugging Face checkpoint directory"),
    "save_dtype": Flag("weight_dtype", "the dtype the params are written in is weight_dtype here",
                       values=("float32", "bfloat16")),
    "lazy_load_tensors": Flag(None, "tensors are always read one at a time here", boolean=True),
    "eager_load_method": Flag(None, "the safetensors files are read directly here",
                              values=("safetensors", "transformers")),
    "revision": Flag(None, "a local directory is read here (no hub), so there is no revision to pick"),
    "simulated_cpu_devices_count": Flag(None, "the arrays are written whole; Orbax restores them onto any mesh"),
}
TO_HUGGINGFACE = {
    "hf_model_path": Flag("hf_tokenizer_path", "the directory whose tokenizer files are copied into the export"),
    "override_model_architecture": Flag(None, "config.json is always written from this config's model keys",
                                        boolean=True),
}
BOOLEANS = {"true": "true", "1": "true", "false": "false", "0": "false"}


def normalize(argv: list[str], flags: dict[str, Flag], tool: str, log=print, bare: bool = False) -> list[str]:
    """argv with upstream's flags of `tool` read as this converter's key=value arguments; `bare`: upstream's tool
    also takes them without the dashes (to_maxtext's name=value)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        dashed = arg.startswith("--")
        name, sep, value = arg.lstrip("-").partition("=")
        if name not in flags or not (dashed or (bare and sep)):
            if dashed:
                raise ConfigError(f"{shown_path(arg.split('=')[0])} is not a flag of {tool} (MaxText's are "
                                  f"{', '.join('--' + f for f in flags)}); give other settings as key=value")
            out.append(arg)
            continue
        flag = flags[name]
        if not sep:
            if flag.boolean and (i == len(argv) or argv[i].lower() not in BOOLEANS):
                value = "true"
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise ConfigError(f"--{name} needs a value (--{name}=<value>)")
        if flag.boolean:
            if value.lower() not in BOOLEANS:
                raise ConfigError(f"--{name}={shown_path(value)} is not a boolean (true/false)")
            value = BOOLEANS[value.lower()]
        if flag.values and value not in flag.values:
            raise ConfigError(f"--{name}={shown_path(value)} is not supported by {tool}: {flag.note} (one of "
                              f"{', '.join(flag.values)})")
        if flag.ours is None:
            log(f"--{name}={value} (MaxText's flag) has no effect here: {flag.note}")
            continue
        if flag.ours != name:
            log(f"--{name}={value} is MaxText's flag for {flag.ours}={value} ({flag.note})")
        out.append(f"{flag.ours}={value}")
    return out

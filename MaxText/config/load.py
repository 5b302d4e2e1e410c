"""Configuration: a YAML chain plus `key=value` overrides, loaded into a validated, frozen config.

Order of precedence, lowest first (upstream MaxText's):
  1. configs/base.yml (every key, with its default);
  2. the YAML files of the chain named on the command line (`base_config:` links, root first);
  3. the model file of `model_name` (configs/models/<model_name>.yml, or a path), when set in 2 or 4;
  4. `key=value` arguments.
A key that 2 or 4 sets and the model file sets otherwise is an error unless override_model_config=true
(_model_layer says exactly when).
A value is parsed to its key's type in schema.py, which also gives its choices and range; the cross-key
checks are checks.py's; each raises ConfigError naming the keys. Loading touches no JAX device, network or
output directory.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import ml_collections

from MaxText.config import upstream
from MaxText.config.checks import PLAIN_NAME, validate
from MaxText.config.errors import ConfigError, clip, error_line
from MaxText.config import parse  # parse.CONFIG_DIR and parse.BASE_CONFIG read at each load: tests point them elsewhere
from MaxText.config.parse import COMMAND_LINE, coerce, nearest, read_yaml
from MaxText.config.schema import SCHEMA

# XLA's pool for pinned_host buffers (offloaded activations) per process, in GB; 64 when unset
# (xla/pjrt/gpu/gpu_helpers.cc). host_memory_limit_gb sets it.
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_HOST_POOL_GB = 64


def _yaml_chain(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The files of a `base_config:` chain, root first, each as (path, values without base_config). A relative
    base_config is found beside the file naming it, else in configs/ (as upstream falls back to its own)."""
    chain: list[tuple[str, dict[str, Any]]] = []
    seen = set()
    while path is not None:
        path = os.path.abspath(path)
        if path in seen:
            raise ConfigError(f"base_config in {clip(path, 200)} forms a cycle")
        seen.add(path)
        values = read_yaml(path)
        parent = values.pop("base_config", None)
        chain.append((path, values))
        if parent is not None:
            beside = os.path.join(os.path.dirname(path), str(parent))
            parent = beside if os.path.isfile(beside) else os.path.join(parse.CONFIG_DIR, str(parent))
            if not os.path.isfile(parent):
                raise ConfigError(f"base_config: {clip(beside, 200)} (named in {clip(path, 200)}) does not exist, "
                                  f"nor does {clip(parent, 200)}")
        path = parent
    return chain[::-1]


# Where upstream's commands name its configs folder; a path there that does not exist is read from ours.
UPSTREAM_CONFIG_DIRS = ("MaxText/configs/", "src/maxtext/configs/", "src/MaxText/configs/", "maxtext/configs/")


def _config_path(path: str) -> str:
    """The config file a command names: the path itself, or for upstream's `MaxText/configs/base.yml` and
    `src/maxtext/configs/...` forms (absent here) the same file under configs/, with a log line."""
    if os.path.isfile(path):
        return path
    for prefix in UPSTREAM_CONFIG_DIRS:
        if prefix in path.replace(os.sep, "/"):
            ours = os.path.join(parse.CONFIG_DIR, path.replace(os.sep, "/").split(prefix, 1)[1])
            if os.path.isfile(ours):
                logging.warning("config: %s is MaxText's path of a config; using %s", path, ours)
                return ours
    return path


def _parse_overrides(argv: Sequence[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {clip(arg)!r} is not key=value (or a .yml config file first)")
        key = key.strip()
        if key in overrides:
            raise ConfigError(f"{key} is given twice on the command line ({key}={clip(overrides[key], 40)} and "
                              f"{key}={clip(value, 40)}); keep one")
        overrides[key] = value
    return overrides


def _refuse_empty(overrides: dict[str, str], defaults: dict[str, Any]) -> None:
    """`key=` with nothing after it (what a job script writes when its variable is unset) is an error, not the
    key's default: `run_name=` would pick a fresh name on every restart and never resume. Keys whose default is
    the empty string (profiler) take it, as do the keys where upstream MaxText gives "" a meaning of its own
    (base_output_directory: ./maxtext_output, with a log line; upstream.VALUE_SPELLINGS); `key=null` still asks for
    a null default."""
    upstream_empty = {"base_output_directory"} | {key for key, value in upstream.VALUE_SPELLINGS if value == ""}
    for key, value in overrides.items():
        known = key in defaults or key in upstream.upstream_defaults()
        theirs_only = key not in defaults and upstream.upstream_defaults().get(key) == ""  # as upstream reads it
        if value.strip() or not known or defaults.get(key) == "" or key in upstream_empty or theirs_only:
            continue
        unset = f", or {key}=null for " + ("a fresh automatic name (a rerun then never resumes)" if key == "run_name"
                                           else "its default") if SCHEMA[key].null else ""
        raise ConfigError(f"{key}= is empty on the command line (an unset variable in a job script?); give it a "
                          f"value{unset}")


def _value(key: str, value: Any, defaults: dict[str, Any], origin: str) -> Any:
    """One key's value as the config will hold it: parsed to its type (upstream's type for upstream's keys this
    trainer does not have), MaxText's -1 for "unset" read as null. An unknown key is an error."""
    if key in defaults:
        parsed = coerce(key, value, defaults[key], origin)
        return None if SCHEMA[key].minus_one_null and parsed == -1 else parsed
    if key in upstream.upstream_defaults():
        return upstream.parse_value(key, value, origin)
    raise ConfigError(f"unknown key {clip(repr(key))} ({origin}){nearest(key, defaults)}")


def _merge(values: dict[str, Any], layer: dict[str, Any], defaults: dict[str, Any], origin: str,
           foreign: dict[str, tuple[Any, str]]) -> None:
    """Merges one layer's values into `values`; upstream MaxText keys this trainer does not have go to `foreign`
    ({key: (value, origin)}) for upstream.apply."""
    for key, value in layer.items():
        if key in defaults:
            values[key] = _value(key, value, defaults, origin)
        else:
            foreign[key] = (_value(key, value, defaults, origin), origin)


def _model_file(model_name: str, config_path: str) -> str:
    """The file of `model_name`: an explicit .yml path, else <name>.yml under the config's models/ folder, its
    parent's, or configs/models/ (upstream's search order)."""
    if model_name.endswith((".yml", ".yaml")):  # a model file anywhere, given by its path
        if not os.path.isfile(model_name):
            raise ConfigError(f"model_name={clip(model_name)}: no such file")
        return model_name
    if not PLAIN_NAME.fullmatch(model_name):
        raise ConfigError(f"model_name={clip(model_name)} is not a name under configs/models/ (letters, digits, "
                          "'.', '_', '-'); give a .yml path for a model file elsewhere")
    here = os.path.dirname(os.path.abspath(config_path))
    for folder in (here, os.path.dirname(here), parse.CONFIG_DIR):
        path = os.path.join(folder, "models", f"{model_name}.yml")
        if os.path.isfile(path):
            return path
    models_dir = os.path.join(parse.CONFIG_DIR, "models")
    known = sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml")) if os.path.isdir(models_dir) else []
    raise ConfigError(f"model_name={model_name}: no file {os.path.join(models_dir, model_name + '.yml')}"
                      f"{nearest(model_name, known)}")


def _model_layer(model_path: str, model: dict[str, Any], chain, root: bool, overrides: dict[str, str],
                 defaults: dict[str, Any], override: bool) -> dict[str, Any]:
    """The model file's values that apply over the config chain: upstream's precedence (config files, then the
    model file, then the command line) and its conflict rule. A command-line key the model file sets otherwise
    is an error unless override_model_config=true. So is a config-file key the model file sets otherwise
    (upstream would drop it without a word), unless it is a default in the chain's root file (`root`: a file
    naming no base_config, such as a copy of upstream's base.yml): with override_model_config=true the config
    file's value stands, with a log line."""
    keep = dict(model)
    here = f"in {model_path}"
    for key, raw in model.items():
        mine = _value(key, raw, defaults, here)
        if key in overrides:
            theirs = _value(key, overrides[key], defaults, COMMAND_LINE)
            if theirs != mine and not override:
                raise ConfigError(
                    f"{key}={upstream.show(theirs)} on the command line conflicts with {key}: {upstream.show(mine)} "
                    f"in the model file {model_path}; as in MaxText, add override_model_config=true to use "
                    f"{upstream.show(theirs)}, or drop it")
            continue
        setter = next(((i, p, layer) for i, (p, layer) in reversed(list(enumerate(chain))) if key in layer), None)
        if setter is None:
            continue
        index, path, layer = setter
        theirs = _value(key, layer[key], defaults, f"in {path}")
        if theirs == mine:
            continue
        base_default = root and index == 0 and theirs in (defaults.get(key), _upstream_default(key, defaults))
        if base_default:
            continue
        if not override:
            raise ConfigError(
                f"{key}: {upstream.show(theirs)} in {path} conflicts with {key}: {upstream.show(mine)} in the model "
                f"file {model_path}, which MaxText applies over config files (and would keep); set "
                f"override_model_config: true to use {upstream.show(theirs)}, or drop it from {os.path.basename(path)}")
        logging.warning("config: override_model_config=true: %s=%s from %s replaces %s=%s of the model file %s",
                        key, upstream.show(theirs), path, key, upstream.show(mine), model_path)
        del keep[key]
    return keep


def _upstream_default(key: str, defaults: dict[str, Any]) -> Any:
    """Upstream's default of `key` as this config would hold it (None where it does not parse as ours)."""
    if key not in upstream.upstream_defaults():
        return None
    try:
        return _value(key, upstream.upstream_defaults()[key], defaults, "MaxText's default")
    except ConfigError:
        return None


def load_config(argv: Sequence[str] = ()) -> ml_collections.FrozenConfigDict:
    """Loads `[config.yml] key=value ...`, validates it and returns it frozen: nothing changes a validated config
    (replace gives a changed copy, validated again). Lists are tuples there; `plain` gives the values as loaded.

    Raises ConfigError for any user mistake. Has no side effects (no JAX, no files written).
    """
    argv = list(argv)
    config_path = parse.BASE_CONFIG
    if argv and "=" not in argv[0] and argv[0].endswith((".yml", ".yaml")):
        config_path = _config_path(argv.pop(0))
    overrides = _parse_overrides(argv)

    base_path = os.path.abspath(parse.BASE_CONFIG)
    defaults = read_yaml(base_path)
    defaults.pop("base_config", None)
    _refuse_empty(overrides, defaults)
    if set(defaults) != set(SCHEMA):  # a maintainer's slip; tests/test_config.py says which line to fix
        raise ConfigError(f"{clip(base_path, 200)} and MaxText/config/schema.py name different keys: "
                          f"{', '.join(sorted(set(defaults) ^ set(SCHEMA)))}; give each key in both")

    whole_chain = _yaml_chain(config_path)
    chain = [(p, v) for p, v in whole_chain if p != base_path]
    root = whole_chain[0][0] != base_path  # the chain's root is a file of the user's (maybe a copy of base.yml)
    values = dict(defaults)
    foreign: dict[str, tuple[Any, str]] = {}
    for path, layer in chain:
        _merge(values, layer, defaults, f"in {path}", foreign)
    explicit = set(overrides).union(*(layer for _, layer in chain))

    model_name = overrides.get("model_name")
    if model_name is None:
        for _, layer in chain:
            model_name = layer.get("model_name", model_name)
    model: dict[str, Any] = {}
    if model_name not in (None, "", "null", "default"):
        model_path = _model_file(str(model_name), config_path)
        model = read_yaml(model_path)
        upstream.check_model_file(model_path, model)
        override = (_value("override_model_config", overrides["override_model_config"], defaults, COMMAND_LINE)
                    if "override_model_config" in overrides else values["override_model_config"])  # chain merged
        _merge(values, _model_layer(model_path, model, chain, root, overrides, defaults, override), defaults,
               f"in {model_path}", foreign)
        upstream.model_defaults(values, set(model) | explicit, model_path)
        explicit |= set(model)
    _merge(values, overrides, defaults, COMMAND_LINE, foreign)
    upstream.apply(values, defaults, foreign, explicit)
    # what the user's files and command line state, a copy of upstream's base.yml (the chain's root) left out
    upstream.block_routing(values, set(overrides) | set(model) | set().union(*(layer for _, layer in chain[root:])))
    _map_upstream_spellings(values, "moe_impl" in explicit)
    if values["model_name"] == "default":  # upstream's name for "no model file"
        values["model_name"] = None
    if values["base_output_directory"] == "":  # upstream's empty value: ./maxtext_output, as upstream infers it
        values["base_output_directory"] = "maxtext_output"
        logging.warning("config: base_output_directory is empty, as in MaxText's base.yml; using ./maxtext_output as "
                        "MaxText does")

    return _validated(values)


def _validated(values: dict[str, Any]) -> ml_collections.FrozenConfigDict:
    cfg = ml_collections.ConfigDict(values, type_safe=False)
    validate(cfg)
    return ml_collections.FrozenConfigDict(cfg)


def replace(cfg, **changes) -> ml_collections.FrozenConfigDict:
    """A copy of a loaded config with `changes` (key=value, each parsed to its key's type), validated again."""
    values = plain(cfg)
    for key, value in changes.items():
        if key not in SCHEMA:
            raise ConfigError(f"unknown key {clip(repr(key))} (given to config.replace){nearest(key, SCHEMA)}")
        values[key] = coerce(key, value, values[key], "given to config.replace")
    return _validated(values)


def plain(cfg) -> dict[str, Any]:
    """A config's values as loaded (lists, not the frozen config's tuples): what YAML and JSON write."""
    return cfg.as_configdict().to_dict() if isinstance(cfg, ml_collections.FrozenConfigDict) else cfg.to_dict()


def _map_upstream_spellings(values: dict[str, Any], explicit_moe_impl: bool) -> None:
    """te_moe_block=true -> moe_impl=te_dropless (TE's fused block runs under it); sparse_matmul=true|false ->
    ragged|dense (with a log line)."""
    mapped = None
    if values["te_moe_block"]:
        mapped = ("te_moe_block=true", "te_dropless")
    elif values["sparse_matmul"] is not None:
        mapped = (f"sparse_matmul={str(values['sparse_matmul']).lower()}",
                  "ragged" if values["sparse_matmul"] else "dense")
    if mapped is None:
        return
    spelling, impl = mapped
    if explicit_moe_impl and values["moe_impl"] != impl:
        raise ConfigError(f"{spelling} means moe_impl={impl}, but moe_impl={values['moe_impl']} is also set; "
                          "keep only moe_impl")
    if values["te_moe_block"]:
        logging.warning("config: te_moe_block=true runs Transformer Engine's fused MoE block, under "
                        "moe_impl=te_dropless")
    else:
        logging.warning("config: %s is MaxText's spelling of moe_impl=%s; using moe_impl=%s", spelling, impl, impl)
    values["moe_impl"] = impl



# ------------------------------------------------------------------------------------------- derived


def layer_counts(cfg) -> tuple[int, int]:
    """(dense layers, MoE layers) of the decoder: the first first_num_dense_layers are dense, the rest MoE;
    all are dense when num_experts is 1."""
    num_dense = cfg.first_num_dense_layers if cfg.num_experts > 1 else cfg.base_num_decoder_layers
    return num_dense, cfg.base_num_decoder_layers - num_dense


def global_batch_size(cfg, num_devices: int) -> int:
    """per_device_batch_size x devices, which must be a whole number of sequences."""
    batch = cfg.per_device_batch_size * num_devices
    if not math.isclose(batch, round(batch)) or round(batch) < 1:
        raise ConfigError(
            f"per_device_batch_size={cfg.per_device_batch_size} x {num_devices} devices = {batch:g} "
            "is not a whole number of sequences; change per_device_batch_size")
    return int(round(batch))


def batch_parts(cfg) -> int:
    """The parts each device's batch runs in side by side (use_batch_split_schedule; 1: not split)."""
    return cfg.batch_split_factor if cfg.use_batch_split_schedule else 1


def with_buffer(cfg, factor):
    """The config of the program that runs with receive-buffer factor `factor` (ragged_buffer_factor; None: the
    dropless worst case, which has nothing to fall back from): moe_dropless_fallback=step's worst-case and
    first-phase programs, and the evaluation's (eval_ragged_buffer_factor)."""
    if factor == cfg.ragged_buffer_factor:
        return cfg
    fallback = cfg.moe_dropless_fallback if factor is not None else None
    return replace(cfg, ragged_buffer_factor=factor, moe_dropless_fallback=fallback, retry_dropless_first_steps=0,
                   first_phase_ragged_buffer_factor=0.0)


def worst_case_program(cfg):
    """The config of moe_dropless_fallback=step's rerun program: the worst-case buffers (with_buffer(cfg, None)) under
    remat_policy=full, which keeps only each layer's input for the backward, so that the program that runs the rare
    overflowing step needs little more memory than the bounded one (MaxText.plan shows both). Remat recomputes values,
    it does not change them (XLA could still round a recomputed value differently; on CPU they are identical)."""
    return replace(with_buffer(cfg, None), remat_policy="full")


def cli_arguments(argv, doc: str) -> tuple[list[str], bool] | None:
    """The command line of a config-reading tool (MaxText.plan, MaxText.preflight): its arguments without
    `--json`, and whether `--json` was given; None after printing `doc` for -h/--help."""
    if argv and argv[0] in ("-h", "--help"):
        print(doc)
        return None
    return [x for x in argv if x != "--json"], "--json" in argv


def tool_main(run, argv, doc: str) -> int:
    """The main() of a tool that takes key=value arguments: -h/--help prints `doc`; run(argv) otherwise, a
    ConfigError becoming one `error:` line and exit status 2."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return 0
    try:
        run(argv)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    return 0


def apply_xla_flags(cfg, environ=os.environ) -> None:
    """Merges cfg.xla_flags into XLA_FLAGS and sets XLA's pinned-host pool from host_memory_limit_gb; must run
    before JAX initialises its backend.

    A flag given in both keeps the config's value (the later occurrence wins in XLA's parser,
    but we drop the older one so XLA_FLAGS stays readable).
    """
    if cfg.host_memory_limit_gb is not None:
        environ[HOST_POOL_ENV] = str(cfg.host_memory_limit_gb)
    if not cfg.xla_flags:
        return
    new = cfg.xla_flags.split()
    new_names = {f.split("=", 1)[0] for f in new}
    old = [f for f in environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in new_names]
    environ["XLA_FLAGS"] = " ".join(old + new)

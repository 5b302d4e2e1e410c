"""Configuration: a YAML chain plus `key=value` overrides, loaded into a locked ConfigDict.

Order of precedence, lowest first:
  1. configs/base.yml (every key, with its default);
  2. configs/models/<model_name>.yml, when `model_name` is set anywhere below;
  3. the YAML files of the chain named on the command line (`base_config:` links, root last applied first);
  4. `key=value` arguments.
A value is parsed to the type of its default in base.yml (keys whose default is null are typed in
OPTIONAL_KEY_TYPES). Cross-key checks are the small `check_*` functions below; each raises ConfigError
naming the keys. Loading touches no JAX device, network or output directory.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections
import yaml

from MaxText import upstream

from MaxText.hardware import GPU_PROFILES

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
BASE_CONFIG = os.path.join(CONFIG_DIR, "base.yml")

# Keys whose default is null (unset), with the type a set value takes.
OPTIONAL_KEY_TYPES: dict[str, type] = {
    "run_name": str,
    "xla_flags": str,
    "model_name": str,
    "capacity_factor": float,
    "learning_rate_schedule_steps": int,
    "gradient_clipping_threshold": float,
    "max_num_checkpoints_to_keep": int,
    "load_parameters_path": str,
    "load_full_state_path": str,
    "ragged_buffer_factor": float,
    "num_devices": int,
    "dataset_path": str,
    "dataset_name": str,
    "tokenizer_path": str,
    "hbm_gib": float,
    "gpu_profile": str,
    "mu_dtype": str,
    "host_memory_limit_gb": int,
    "n_routing_groups": int,
    "topk_routing_group": int,
    "te_moe_block": bool,
    "sparse_matmul": bool,
    "decoder_block": str,
    "tokenizer_type": str,
    "grain_train_files": str,
    "grain_eval_files": str,
    "hf_path": str,
    "hf_name": str,
    "hf_data_dir": str,
    "hf_train_files": str,
    "hf_eval_files": str,
    "hf_eval_split": str,
}

# Upstream keys whose -1 means "unset"; we read -1 as null so upstream configs keep working.
MINUS_ONE_IS_UNSET = ("ragged_buffer_factor", "n_routing_groups", "topk_routing_group", "capacity_factor",
                      "learning_rate_schedule_steps")

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# XLA's pool for pinned_host buffers (offloaded activations) per process, in GB; 64 when unset
# (xla/pjrt/gpu/gpu_helpers.cc). host_memory_limit_gb sets it.
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
# run_name and model_name: one path component, never a way out of its directory.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
XLA_DEFAULT_HOST_POOL_GB = 64
MOE_IMPLS = ("dense", "ragged", "te_dropless")
REMAT_POLICIES = ("full", "minimal", "none", "custom")
REMAT_LOCATIONS = ("remat", "device", "offload")
# Tensors tagged with jax.ad_checkpoint.checkpoint_name in the model; `remat_policy: custom` reads one
# REMAT_LOCATIONS value per name from the key of the same name.
REMAT_TENSOR_NAMES = (
    "query_proj", "key_proj", "value_proj", "out_proj", "mla_q", "mla_kv",
    "mlpwi_0", "mlpwi_1", "mlpwo",
    "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "moe_dispatch",
)
DTYPES = ("float32", "bfloat16", "float16")
HARDWARE = ("auto", "cpu", "gpu", "gpu_multiprocess")
DATASET_TYPES = ("tfds", "grain", "hf", "synthetic")
TE_KERNELS = ("auto", "reference")
TE_GMM_QUANTIZATIONS = ("none", "fp8_current", "mxfp8")
ROUTER_SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE_LOSS_TYPES = ("global", "sequence")
ROPE_TYPES = ("default", "yarn")
ATTENTION_TYPES = ("mha", "mla")
ATTENTION_IMPLS = ("dot_product", "chunked", "cudnn_flash")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------- loading


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


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError(f"config file {path}: {e}; keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of key: value, not {type(data).__name__}")
    return data


def _yaml_chain(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The files of a `base_config:` chain, root first, each as (path, values without base_config)."""
    chain: list[tuple[str, dict[str, Any]]] = []
    seen = set()
    while path is not None:
        path = os.path.abspath(path)
        if path in seen:
            raise ConfigError(f"base_config in {path} forms a cycle")
        seen.add(path)
        values = _read_yaml(path)
        parent = values.pop("base_config", None)
        chain.append((path, values))
        if parent is not None:
            parent = os.path.join(os.path.dirname(path), str(parent))
            if not os.path.isfile(parent):
                raise ConfigError(f"base_config: {parent} (named in {path}) does not exist")
        path = parent
    return chain[::-1]


def _parse_overrides(argv: Sequence[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {_clip(arg)!r} is not key=value (or a .yml config file first)")
        key = key.strip()
        if key in overrides:
            raise ConfigError(f"{key} is given twice on the command line ({key}={_clip(overrides[key], 40)} and "
                              f"{key}={_clip(value, 40)}); keep one")
        overrides[key] = value
    return overrides


# Command-line numbers and booleans are read by their key's type, not by YAML 1.1, which takes 010 for 8
# (octal), 1:30 for 90 (base 60) and yes/on for true.
_INT = re.compile(r"[+-]?[0-9]+")
COMMAND_LINE = "on the command line"  # _merge's origin for key=value arguments
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
    return value


def _nearest(key: str, known) -> str:
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def _key_type(key: str, default: Any) -> type:
    if default is None:
        return OPTIONAL_KEY_TYPES[key]
    return type(default)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _coerce(key: str, value: Any, default: Any, origin: str) -> Any:
    """Parses `value` to the type of `default`; `origin` says where the value came from."""
    want = _key_type(key, default)
    optional = key in OPTIONAL_KEY_TYPES
    if isinstance(value, str) and optional and value.strip() in ("null", "None", "~", ""):
        value = None
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
        raise ConfigError(f"{key}={value!r} ({origin}) is not a valid {want.__name__}; "
                          f"use {_article(want.__name__)} {want.__name__} such as {key}={example}")
    return value


def _merge(values: dict[str, Any], layer: dict[str, Any], defaults: dict[str, Any], origin: str,
           foreign: dict[str, tuple[Any, str]]) -> None:
    """Merges one layer's values into `values`; upstream MaxText keys this trainer does not have go to `foreign`
    ({key: (value, origin)}) for upstream.apply."""
    for key, value in layer.items():
        if key in defaults:
            values[key] = _coerce(key, value, defaults[key], origin)
        elif key in upstream.upstream_defaults():
            foreign[key] = (upstream.parse_value(key, value, origin), origin)
        else:
            raise ConfigError(f"unknown key {key!r} ({origin}){_nearest(key, defaults)}")


def load_config(argv: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Loads `[config.yml] key=value ...` into a locked ConfigDict and validates it.

    Raises ConfigError for any user mistake. Has no side effects (no JAX, no files written).
    """
    argv = list(argv)
    config_path = BASE_CONFIG
    if argv and "=" not in argv[0] and argv[0].endswith((".yml", ".yaml")):
        config_path = argv.pop(0)
    overrides = _parse_overrides(argv)

    base_path = os.path.abspath(BASE_CONFIG)
    defaults = _read_yaml(base_path)
    defaults.pop("base_config", None)
    for key, default in defaults.items():
        assert default is not None or key in OPTIONAL_KEY_TYPES, f"base.yml: type of null key {key} unknown"

    chain = [(p, v) for p, v in _yaml_chain(config_path) if p != base_path]
    values = dict(defaults)
    files: list[tuple[str, dict[str, Any]]] = list(chain)

    model_name = overrides.get("model_name")
    if model_name is None:
        for _, layer in chain:
            model_name = layer.get("model_name", model_name)
    if model_name not in (None, "", "null", "default"):
        model_name = str(model_name)
        explicit = model_name.endswith((".yml", ".yaml"))  # a model file anywhere, given by its path
        if not explicit and not PLAIN_NAME.fullmatch(model_name):
            raise ConfigError(f"model_name={_clip(model_name)} is not a name under configs/models/ (letters, digits, "
                              "'.', '_', '-'); give a .yml path for a model file elsewhere")
        model_path = model_name if explicit else os.path.join(CONFIG_DIR, "models", f"{model_name}.yml")
        if explicit and not os.path.isfile(model_path):
            raise ConfigError(f"model_name={_clip(model_name)}: no such file")
        if not os.path.isfile(model_path):
            models_dir = os.path.join(CONFIG_DIR, "models")
            known = sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml")) \
                if os.path.isdir(models_dir) else []
            raise ConfigError(f"model_name={model_name}: no file {model_path}{_nearest(str(model_name), known)}")
        files.insert(0, (model_path, _read_yaml(model_path)))

    foreign: dict[str, tuple[Any, str]] = {}
    for path, layer in files:
        _merge(values, layer, defaults, f"in {path}", foreign)
    _merge(values, overrides, defaults, COMMAND_LINE, foreign)
    explicit = set(overrides).union(*(layer for _, layer in files))
    upstream.apply(values, defaults, foreign, explicit)
    _map_upstream_spellings(values, "moe_impl" in explicit)
    if values["model_name"] == "default":  # upstream's name for "no model file"
        values["model_name"] = None
    for key in MINUS_ONE_IS_UNSET:
        if values[key] == -1:
            values[key] = None

    cfg = ml_collections.ConfigDict(values, type_safe=False)
    validate(cfg)
    cfg.lock()
    return cfg


def _map_upstream_spellings(values: dict[str, Any], explicit_moe_impl: bool) -> None:
    """te_moe_block=true -> moe_impl=te_dropless; sparse_matmul=true|false -> ragged|dense (with a log line)."""
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
    logging.warning("config: %s is MaxText's spelling of moe_impl=%s; using moe_impl=%s", spelling, impl, impl)
    values["moe_impl"] = impl


# ------------------------------------------------------------------------------------------- checks


def check_choices(cfg) -> None:
    """Keys with a fixed set of values."""
    choices = {
        "moe_impl": MOE_IMPLS, "remat_policy": REMAT_POLICIES, "dtype": DTYPES, "weight_dtype": DTYPES,
        "hardware": HARDWARE, "dataset_type": DATASET_TYPES, "opt_type": ("adamw",), "te_kernels": TE_KERNELS,
        "te_gmm_quantization": TE_GMM_QUANTIZATIONS, "routed_score_func": ROUTER_SCORE_FUNCS,
        "load_balance_loss_type": LOAD_BALANCE_LOSS_TYPES, "rope_type": ROPE_TYPES,
        "attention_type": ATTENTION_TYPES, "attention": ATTENTION_IMPLS, "profiler": ("", "xplane"),
        "routing_group_score": ("topk_sum", "max"),
        "lr_schedule_type": ("cosine", "wsd"), "wsd_decay_style": ("linear", "cosine"),
        **{name: REMAT_LOCATIONS for name in REMAT_TENSOR_NAMES},
    }
    for key, allowed in choices.items():
        if cfg[key] not in allowed:
            raise ConfigError(f"{key}={cfg[key]} is not one of {', '.join(allowed)}")
    if cfg.mu_dtype is not None and cfg.mu_dtype not in DTYPES:
        raise ConfigError(f"mu_dtype={cfg.mu_dtype} is not one of {', '.join(DTYPES)} (or null: the weight dtype)")
    if cfg.gpu_profile is not None and cfg.gpu_profile not in GPU_PROFILES:
        raise ConfigError(f"gpu_profile={cfg.gpu_profile} is not one of {', '.join(GPU_PROFILES)} (or null)")


def check_te_options(cfg) -> None:
    """FP8/MXFP8 grouped GEMMs exist only on the Transformer Engine path."""
    if cfg.te_gmm_quantization != "none" and cfg.moe_impl != "te_dropless":
        raise ConfigError(f"te_gmm_quantization={cfg.te_gmm_quantization} applies to moe_impl=te_dropless only "
                          f"(moe_impl={cfg.moe_impl}); set te_gmm_quantization=none or moe_impl=te_dropless")
    if (cfg.moe_impl == "te_dropless" and cfg.n_routing_groups is not None
            and cfg.num_experts_per_tok % cfg.topk_routing_group):
        raise ConfigError(f"moe_impl=te_dropless: TE's fused router scores each routing group by its best "
                          f"num_experts_per_tok / topk_routing_group experts and needs a whole number, not "
                          f"{cfg.num_experts_per_tok} / {cfg.topk_routing_group}; make num_experts_per_tok a "
                          "multiple of topk_routing_group or use moe_impl=ragged")


def check_router(cfg) -> None:
    """Group-limited routing, the selection bias and the router losses."""
    groups, keep = cfg.n_routing_groups, cfg.topk_routing_group
    if (groups is None) != (keep is None):
        raise ConfigError("set both n_routing_groups and topk_routing_group (group-limited routing), or neither")
    if groups is not None:
        if groups < 1 or cfg.num_experts % groups:
            raise ConfigError(f"n_routing_groups={groups} must divide num_experts={cfg.num_experts}")
        if not 1 <= keep <= groups:
            raise ConfigError(f"topk_routing_group={keep} must be between 1 and n_routing_groups={groups}")
        if cfg.num_experts_per_tok > keep * (cfg.num_experts // groups):
            raise ConfigError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in the kept groups "
                f"(topk_routing_group={keep} x {cfg.num_experts // groups}); raise topk_routing_group")
    if groups is not None and cfg.routing_group_score == "max" and cfg.moe_impl == "te_dropless":
        raise ConfigError("routing_group_score=max (DeepSeek-V2) is not what TE's fused router computes (a group's "
                          "top-k sum); use moe_impl=ragged or dense")
    if cfg.routed_bias and cfg.routed_score_func != "sigmoid":
        raise ConfigError("routed_bias=true needs routed_score_func=sigmoid: the aux-loss-free bias (DeepSeek-V3) "
                          "shifts independent sigmoid scores; with softmax it would also rescale the others")
    if cfg.routed_bias_update_rate < 0:
        raise ConfigError(f"routed_bias_update_rate={cfg.routed_bias_update_rate} must not be negative")
    if cfg.routed_bias_update_rate > 0 and not cfg.routed_bias:
        raise ConfigError("routed_bias_update_rate > 0 needs routed_bias=true (there is no bias to update)")
    if cfg.router_z_loss_weight < 0:
        raise ConfigError(f"router_z_loss_weight={cfg.router_z_loss_weight} must not be negative")
    if cfg.ragged_buffer_factor is not None and not cfg.ragged_buffer_factor > 0:
        raise ConfigError(f"ragged_buffer_factor={cfg.ragged_buffer_factor} must be > 0, or null for the "
                          "dropless worst case")


def check_positive(cfg) -> None:
    """Sizes and periods that must be at least 1 (or > 0 for floats)."""
    for key in ("steps", "log_period", "checkpoint_period", "base_emb_dim", "base_num_query_heads",
                "base_num_kv_heads", "head_dim", "base_mlp_dim", "base_moe_mlp_dim", "base_num_decoder_layers",
                "vocab_size", "num_experts", "num_experts_per_tok", "max_target_length", "attention_chunk_size",
                "num_vocab_tiling", "num_devices", "max_num_checkpoints_to_keep", "learning_rate_schedule_steps",
                "eval_steps", "profiler_steps", "checkpoint_timeout_s", "num_moe_token_chunks"):
        minus_one_ok = key == "eval_steps" or (key == "base_moe_mlp_dim" and cfg.num_experts == 1)  # MaxText's -1
        if cfg[key] is not None and cfg[key] < 1 and not (minus_one_ok and cfg[key] == -1):
            raise ConfigError(f"{key}={cfg[key]} must be at least 1" + (" (or -1: the whole eval split)"
                                                                        if key == "eval_steps" else ""))
    for key in ("per_device_batch_size", "capacity_factor", "gradient_clipping_threshold",
                "normalization_layer_epsilon", "rope_max_timescale", "hbm_gib", "rope_attention_factor"):
        if cfg[key] is not None and not cfg[key] > 0:
            raise ConfigError(f"{key}={cfg[key]} must be greater than 0")
    for key in ("learning_rate", "load_balance_loss_weight", "router_z_loss_weight", "adam_weight_decay",
                "shared_experts", "mtp_num_layers", "mtp_loss_scaling_factor", "skip_first_n_steps_for_profiler",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "routed_bias_update_rate", "first_num_dense_layers"):
        if cfg[key] is not None and cfg[key] < 0:
            raise ConfigError(f"{key}={cfg[key]} must not be negative")
    for key, value in cfg.items():  # inf and nan in a float key make no sense anywhere
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
    for key in ("adam_b1", "adam_b2"):
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be in [0, 1) (Adam's moment decay)")
    if not cfg.adam_eps > 0:
        raise ConfigError(f"adam_eps={cfg.adam_eps} must be greater than 0")
    for key in ("init_weights_seed", "data_shuffle_seed"):
        if not 0 <= cfg[key] < 2 ** 32:
            raise ConfigError(f"{key}={cfg[key]} must be in [0, 2**32) (a PRNG seed)")
    if cfg.per_device_batch_size > 2 ** 20:
        raise ConfigError(f"per_device_batch_size={cfg.per_device_batch_size} is absurd (over 2**20 sequences per "
                          "device); MaxText.plan says what fits")
    if cfg.eval_interval != -1 and cfg.eval_interval < 1:
        raise ConfigError(f"eval_interval={cfg.eval_interval} must be at least 1, or -1 for no evaluation")
    for key in ("warmup_steps_fraction", "cosine_learning_rate_final_fraction", "wsd_decay_steps_fraction"):
        if not 0 <= cfg[key] <= 1:
            raise ConfigError(f"{key}={cfg[key]} must be between 0 and 1")
    if cfg.lr_schedule_type == "wsd" and cfg.warmup_steps_fraction + cfg.wsd_decay_steps_fraction > 1:
        raise ConfigError(f"warmup_steps_fraction={cfg.warmup_steps_fraction} + wsd_decay_steps_fraction="
                          f"{cfg.wsd_decay_steps_fraction} exceed 1 (the whole schedule); lower one of them")


def check_rope(cfg) -> None:
    """YaRN's own keys do nothing under plain RoPE: a value set there would be ignored in silence."""
    if cfg.rope_type != "yarn" and cfg.rope_attention_factor != 1.0:
        raise ConfigError(f"rope_attention_factor={cfg.rope_attention_factor} applies under rope_type=yarn only; set "
                          "rope_type=yarn (rope_factor=1.0 keeps every frequency) or drop it")


def check_attention_heads(cfg) -> None:
    """GQA: every key/value head serves the same number of query heads."""
    if cfg.base_num_query_heads % cfg.base_num_kv_heads:
        raise ConfigError(
            f"base_num_query_heads={cfg.base_num_query_heads} must be a multiple of "
            f"base_num_kv_heads={cfg.base_num_kv_heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim={cfg.head_dim} must be even (RoPE rotates pairs of features)")


def check_layers(cfg) -> None:
    """Dense-then-MoE layer split."""
    if not 0 <= cfg.first_num_dense_layers <= cfg.base_num_decoder_layers:
        raise ConfigError(
            f"first_num_dense_layers={cfg.first_num_dense_layers} must be between 0 and "
            f"base_num_decoder_layers={cfg.base_num_decoder_layers}")


def check_experts(cfg) -> None:
    """Top-k within the experts, and experts divisible over the expert mesh axis."""
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok={cfg.num_experts_per_tok} must not exceed num_experts={cfg.num_experts}")
    ep = cfg.ici_expert_parallelism * cfg.dcn_expert_parallelism
    if cfg.num_experts > 1 and ep > 0 and cfg.num_experts % ep:
        raise ConfigError(
            f"num_experts={cfg.num_experts} must be divisible by the expert parallelism "
            f"ici_expert_parallelism x dcn_expert_parallelism = {ep}")


# moe_impl=dense builds float32 one-hot dispatch and combine masks [S, E, C] per sequence of S tokens (C = S
# without a capacity: quadratic in the sequence length); a config whose masks exceed this is refused.
DENSE_MASK_LIMIT_BYTES = 2 ** 30


def check_dense_masks(cfg) -> None:
    """moe_impl=dense only where its per-sequence masks stay under DENSE_MASK_LIMIT_BYTES."""
    if cfg.moe_impl != "dense" or cfg.num_experts <= 1:
        return
    from MaxText.layers.moe.dense import capacity  # noqa: PLC0415 - the layer imports this module

    s, e = cfg.max_target_length, cfg.num_experts
    mask = s * e * capacity(s, e, cfg.num_experts_per_tok, cfg.capacity_factor) * 4
    if mask > DENSE_MASK_LIMIT_BYTES:
        capped = s * e * capacity(s, e, cfg.num_experts_per_tok, 1.25) * 4
        cap, fix = ((("capacity_factor=null (capacity = the sequence)", f"cap it (capacity_factor=1.25: "
                      f"{capped / 2 ** 30:.2f} GiB, drops what overflows)")) if cfg.capacity_factor is None
                    else (f"capacity_factor={cfg.capacity_factor}", "lower capacity_factor"))
        raise ConfigError(
            f"moe_impl=dense with {cap} builds two float32 [S, E, C] masks of {mask / 2 ** 30:.1f} GiB per sequence "
            f"per MoE layer at max_target_length={s}, num_experts={e} (limit {DENSE_MASK_LIMIT_BYTES / 2 ** 30:g} "
            f"GiB); use moe_impl=ragged (dropless, no masks) or {fix}")


def check_parallelism(cfg) -> None:
    """Each ici_*/dcn_* value is a positive size, or -1/null (absorb the rest) for at most one axis per group."""
    for group in ("ici", "dcn"):
        absorbing = []
        for axis in MESH_AXES:
            key = f"{group}_{axis}_parallelism"
            value = cfg[key]
            if value is None or value == -1:
                absorbing.append(key)
            elif value < 1:
                raise ConfigError(f"{key}={value} must be a positive size, or -1 to absorb the remaining devices")
        if len(absorbing) > 1:
            raise ConfigError(f"only one {group}_*_parallelism may be -1, got {', '.join(absorbing)}; set the others")


def check_logical_axis_rules(cfg) -> None:
    """Rules are [logical_name, [mesh axes]] pairs over known mesh axes."""
    for rule in cfg.logical_axis_rules:
        ok = (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
              and isinstance(rule[1], (list, tuple, str, type(None))))
        axes = [] if not ok or rule[1] is None else ([rule[1]] if isinstance(rule[1], str) else list(rule[1]))
        if not ok or any(a not in MESH_AXES for a in axes):
            raise ConfigError(
                f"logical_axis_rules entry {rule!r} must be [logical_name, [mesh axes from {', '.join(MESH_AXES)}]]")
    # The dropless impls run per device in shard_map: tokens must be split over `expert` wherever experts are,
    # or every expert-parallel rank would hold (and dispatch) the same tokens.
    expert_parallel = any(cfg[f"{g}_expert_parallelism"] not in (1,) for g in ("ici", "dcn"))
    if cfg.moe_impl in ("ragged", "te_dropless") and cfg.num_experts > 1 and expert_parallel:
        batch = next((rule[1] for rule in cfg.logical_axis_rules if rule[0] == "activation_batch"), None)
        if "expert" not in ([batch] if isinstance(batch, str) else list(batch or [])):
            raise ConfigError(f"moe_impl={cfg.moe_impl} with expert parallelism needs the batch split over `expert` "
                              "too: keep 'expert' in the activation_batch rule of logical_axis_rules")


def check_run_name(cfg) -> None:
    """run_name is one plain path component under base_output_directory."""
    if cfg.run_name is not None and (not PLAIN_NAME.fullmatch(str(cfg.run_name)) or ".." in str(cfg.run_name)):
        raise ConfigError(f"run_name={_clip(str(cfg.run_name))} must be a plain name (letters, digits, '.', '_', "
                          "'-'; no '/', no '..', at most 200 characters): it names a directory under "
                          "base_output_directory")


def _clip(text: str, limit: int = 80) -> str:
    """A user's value in an error line, at most `limit` characters."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_checkpoint_sources(cfg) -> None:
    """At most one of the two ways to start from a checkpoint."""
    if cfg.load_parameters_path and cfg.load_full_state_path:
        raise ConfigError("set only one of load_parameters_path and load_full_state_path")


# MaxText's decoder_block values this trainer builds, with what each needs of the keys that build it here.
DECODER_BLOCKS = {
    "llama2": {"attention_type": "mha", "qk_norm": False}, "mistral": {"attention_type": "mha", "qk_norm": False},
    "mixtral": {"attention_type": "mha", "qk_norm": False}, "deepseek": {"attention_type": "mla"},
    "qwen3": {"attention_type": "mha", "qk_norm": True}, "qwen3_moe": {"attention_type": "mha", "qk_norm": True},
}
TOKENIZER_TYPES = {"sentencepiece": ".model", "huggingface": ".json"}


def check_upstream_consistency(cfg) -> None:
    """MaxText's decoder_block and tokenizer_type agree with the keys that decide the same things here;
    eval_steps=-1 needs a finite eval split."""
    if cfg.decoder_block is not None:
        needs = DECODER_BLOCKS.get(cfg.decoder_block)
        if needs is None:
            raise ConfigError(f"decoder_block={cfg.decoder_block} is a MaxText model family this trainer does not "
                              f"build (it builds {', '.join(DECODER_BLOCKS)})")
        for key, value in needs.items():
            if cfg[key] != value:
                raise ConfigError(f"decoder_block={cfg.decoder_block} needs {key}={str(value).lower()}, but this config "
                                  f"has {key}={str(cfg[key]).lower()}; fix one of them")
    if cfg.tokenizer_type is not None:
        suffix = TOKENIZER_TYPES.get(cfg.tokenizer_type)
        if suffix is None:
            raise ConfigError(f"tokenizer_type={cfg.tokenizer_type} is not supported here (sentencepiece or "
                              "huggingface, given by tokenizer_path)")
        if cfg.tokenizer_path is not None and not str(cfg.tokenizer_path).endswith(suffix):
            raise ConfigError(f"tokenizer_type={cfg.tokenizer_type} expects a {suffix} file, but tokenizer_path="
                              f"{_clip(str(cfg.tokenizer_path))}; fix one of them")
    if cfg.eval_steps == -1 and cfg.eval_interval != -1 and cfg.dataset_type == "synthetic":
        raise ConfigError("eval_steps=-1 (the whole eval split) needs a dataset with an end; synthetic data has "
                          "none: set eval_steps to a number of batches")


CHECKS = (check_choices, check_te_options, check_router, check_positive, check_rope, check_attention_heads,
          check_layers, check_experts, check_dense_masks, check_parallelism, check_logical_axis_rules, check_run_name,
          check_checkpoint_sources, check_upstream_consistency)


def validate(cfg) -> None:
    """Runs every cross-key check; raises ConfigError on the first failure."""
    for check in CHECKS:
        check(cfg)


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
        print(f"error: {e}", file=sys.stderr)
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

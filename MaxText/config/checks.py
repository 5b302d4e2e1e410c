"""Cross-key checks of a loaded config: each `check_*` function raises ConfigError naming the keys and the fix.

load.load_config runs them all (validate) on the merged values; they read a ConfigDict and touch nothing
else. The sets of allowed values live here beside the checks that use them.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from MaxText.config.errors import ConfigError, clip, shown
from MaxText.config.hardware import GPU_PROFILES

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# run_name and model_name: one path component, never a way out of its directory.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
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
                "eval_steps", "profiler_steps", "checkpoint_timeout_s", "num_moe_token_chunks",
                "gradient_accumulation_steps"):
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


INT32_MAX = 2 ** 31 - 1
# Keys outside int32 (each checks its own range elsewhere): PRNG seeds are uint32.
UINT32_KEYS = ("init_weights_seed", "data_shuffle_seed")
# Upper (and the lower bounds check_positive does not give) of keys with a range that makes sense:
# {key: (lowest, highest)}, both inclusive, None for no bound there.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "learning_rate": (None, 10.0), "adam_weight_decay": (None, 10.0), "adam_eps": (None, 1.0),
    "normalization_layer_epsilon": (None, 1.0), "cosine_learning_rate_final_fraction": (0.0, 1.0),
    "wsd_decay_steps_fraction": (0.0, 1.0), "load_balance_loss_weight": (None, 100.0),
    "router_z_loss_weight": (None, 100.0), "mtp_loss_scaling_factor": (None, 100.0),
    "routed_bias_update_rate": (None, 1.0), "hbm_gib": (None, 1e5), "host_memory_limit_gb": (1, 1e5),
    "rope_factor": (1e-6, None), "beta_fast": (1e-6, None), "beta_slow": (1e-6, None), "mscale": (0.0, None),
    "original_max_position_embeddings": (1, None), "routed_scaling_factor": (1e-6, None),
    "grain_worker_count": (0, 1024), "grain_worker_count_eval": (0, 1024), "reuse_example_batch": (0, None),
}


def check_ranges(cfg) -> None:
    """Both bounds: every integer fits the int32 that JAX and Optax count steps, sizes and ids in (a seed the
    uint32 of a PRNG key), and the keys of RANGES stay in theirs."""
    for key, value in cfg.items():
        if isinstance(value, int) and not isinstance(value, bool) and key not in UINT32_KEYS \
                and not -INT32_MAX <= value <= INT32_MAX:
            raise ConfigError(f"{key}={value} is out of range: at most 2**31 - 1 = {INT32_MAX} (steps, periods and "
                              "sizes are int32 in JAX and Optax)")
    for key, (low, high) in RANGES.items():
        value = cfg[key]
        if value is None:
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f"between {low:g} and {high:g}" if low is not None and high is not None
                      else f"at least {low:g}" if low is not None else f"at most {high:g}")
            raise ConfigError(f"{key}={value} must be {bounds}")


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
    if cfg.attention_type == "mla":
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if cfg[key] < 1:
                raise ConfigError(f"{key}={cfg[key]} must be at least 1 under attention_type=mla")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs of features)")


def check_layers(cfg) -> None:
    """Dense-then-MoE layer split."""
    if not 0 <= cfg.first_num_dense_layers <= cfg.base_num_decoder_layers:
        raise ConfigError(
            f"first_num_dense_layers={cfg.first_num_dense_layers} must be between 0 and "
            f"base_num_decoder_layers={cfg.base_num_decoder_layers}")


def check_experts(cfg) -> None:
    """Top-k within the experts. (Experts over the expert mesh axis: parallel/checks.check_mesh, once the axis's
    size is known, -1 included.)"""
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok={cfg.num_experts_per_tok} must not exceed num_experts={cfg.num_experts}")


def capacity(group_size: int, num_experts: int, top_k: int, capacity_factor) -> int:
    """Slots per expert per group of L tokens: ceil(L*K/E * factor), at most L; L when uncapped."""
    if capacity_factor is None:
        return group_size
    # Exact arithmetic: in floats 50 * 1.1 = 55.000000000000007 would ceil to 56.
    slots = Fraction(group_size * top_k, num_experts) * Fraction(str(capacity_factor))
    return max(1, min(group_size, math.ceil(slots)))


# moe_impl=dense builds float32 one-hot dispatch and combine masks [S, E, C] per sequence of S tokens (C = S
# without a capacity: quadratic in the sequence length); a config whose masks exceed this is refused.
DENSE_MASK_LIMIT_BYTES = 2 ** 30


def check_dense_masks(cfg) -> None:
    """moe_impl=dense only where its per-sequence masks stay under DENSE_MASK_LIMIT_BYTES."""
    if cfg.moe_impl != "dense" or cfg.num_experts <= 1:
        return
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
                f"logical_axis_rules entry {shown(rule)} must be [logical_name, [mesh axes from "
                f"{', '.join(MESH_AXES)}]]")
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
        raise ConfigError(f"run_name={clip(str(cfg.run_name))} must be a plain name (letters, digits, '.', '_', "
                          "'-'; no '/', no '..', at most 200 characters): it names a directory under "
                          "base_output_directory")


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
                              f"{clip(str(cfg.tokenizer_path))}; fix one of them")
    if cfg.eval_steps == -1 and cfg.eval_interval != -1 and cfg.dataset_type == "synthetic":
        raise ConfigError("eval_steps=-1 (the whole eval split) needs a dataset with an end; synthetic data has "
                          "none: set eval_steps to a number of batches")


# Keys naming a file or directory. The run's outputs and the checkpoints it starts from may be in a gs:// bucket
# (MaxText.config.storage); the input pipeline reads local files only. Any other URL is refused here, before anything is
# created from it: a URL must never become a local "gs:" folder.
REMOTE_OK_KEYS = ("base_output_directory", "load_parameters_path", "load_full_state_path")
DATA_PATH_KEYS = ("dataset_path", "grain_train_files", "grain_eval_files", "hf_data_dir", "hf_train_files",
                  "hf_eval_files", "tokenizer_path")
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
MOUNT = {"gs": "gcsfuse", "s3": "mountpoint-s3"}


def remote_path_error(key: str, value, local_only: str | None = None) -> str | None:
    """The one-line refusal of a URL that cannot be used as `key`, or None. `local_only` names who reads and writes
    local paths only (e.g. "the converters read and write"); without it gs:// is accepted where gcsfs is installed."""
    if not isinstance(value, str) or not URL.match(value):
        return None
    scheme = value.split("://", 1)[0]
    mount = f"mount the bucket ({MOUNT.get(scheme, 'a FUSE mount')}) and give the mounted path"
    if local_only:
        return f"{key}={clip(value)} is a {scheme}:// URL; {local_only} local paths only: {mount}"
    if scheme == "s3":  # orbax-checkpoint 0.12.8's OCDBT store takes only gs:// for a bucket (s3:// fails as local)
        return (f"{key}={clip(value)}: orbax-checkpoint writes and reads checkpoints in gs:// buckets only (it takes "
                f"an s3:// URL for a local path); {mount}")
    if scheme != "gs":
        return f"{key}={clip(value)} is a {scheme}:// URL; only local paths and gs:// are supported: {mount}"
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:
        return (f"{key}={clip(value)} needs gcsfs (epath's gs:// client; requirements.txt pins it): pip install "
                f"gcsfs, or {mount}")
    return None


def check_paths(cfg) -> None:
    """gs:// for the outputs and checkpoints, local paths for the data; anything else stops here, before anything is
    created from it."""
    for key in REMOTE_OK_KEYS + DATA_PATH_KEYS:
        error = remote_path_error(key, cfg[key], None if key in REMOTE_OK_KEYS else "the input pipeline reads")
        if error:
            raise ConfigError(error)


CHECKS = (check_choices, check_te_options, check_router, check_positive, check_ranges, check_rope,
          check_attention_heads, check_layers, check_experts, check_dense_masks, check_parallelism,
          check_logical_axis_rules, check_run_name, check_checkpoint_sources, check_upstream_consistency,
          check_paths)


def validate(cfg) -> None:
    """Runs every cross-key check; raises ConfigError on the first failure."""
    for check in CHECKS:
        check(cfg)

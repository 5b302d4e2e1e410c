"""Cross-key checks of a loaded config: each `check_*` function raises ConfigError naming the keys and the fix.

load.load_config runs them all (validate) on the merged values; they read a ConfigDict and touch nothing
else. Each key's own choices and range are schema.py's (check_schema reads them); the other checks relate keys to
each other.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import NamedTuple

from MaxText.config.errors import ConfigError, clip, shown
from MaxText.config.schema import MESH_AXES, SCHEMA

# run_name and model_name: one path component, never a way out of its directory.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def check_schema(cfg) -> None:
    """Each key by its own rules (schema.SCHEMA): one of its choices, within its range, a finite number."""
    for key, spec in SCHEMA.items():
        error = None if cfg[key] is None else spec.error(cfg[key])
        if error:
            raise ConfigError(f"{key}={cfg[key]} {error}")


def te_router_mode(cfg) -> tuple[bool, bool]:
    """(use_pre_softmax, fused weights) for TE's fused router under this config's routing semantics.

    TE's sigmoid weights are renormalised exactly when K > 1; its softmax either takes the top-k of the
    softmax over all experts (use_pre_softmax=True: our norm_topk_prob=false) or the softmax over the top-k
    logits (our norm_topk_prob=true, the same choice unless group-limited routing scores groups on logits
    rather than on probabilities). Where TE's weights mean ours, TE's fused forward and backward give them;
    elsewhere TE makes the choice (on probabilities) and the weights are our scores of the chosen experts.
    """
    k, grouped = cfg.num_experts_per_tok, cfg.n_routing_groups is not None
    if cfg.routed_score_func == "sigmoid":
        return False, cfg.norm_topk_prob == (k > 1)
    return not cfg.norm_topk_prob or grouped, not (cfg.norm_topk_prob and grouped)


def check_te_options(cfg) -> None:
    """FP8/MXFP8 grouped GEMMs exist only on the Transformer Engine path; TE's fused MoE block (te_moe_block) takes
    what it computes: TE's kernels, BF16 or MXFP8 grouped GEMMs (moe.py _validate_moe_quantizer_sets), and the
    combine weights of its fused router (te_router_mode)."""
    if cfg.te_gmm_quantization != "none" and cfg.moe_impl != "te_dropless":
        raise ConfigError(f"te_gmm_quantization={cfg.te_gmm_quantization} applies to moe_impl=te_dropless only "
                          f"(moe_impl={cfg.moe_impl}); set te_gmm_quantization=none or moe_impl=te_dropless")
    if (cfg.moe_impl == "te_dropless" and cfg.n_routing_groups is not None
            and cfg.num_experts_per_tok % cfg.topk_routing_group):
        raise ConfigError(f"moe_impl=te_dropless: TE's fused router scores each routing group by its best "
                          f"num_experts_per_tok / topk_routing_group experts and needs a whole number, not "
                          f"{cfg.num_experts_per_tok} / {cfg.topk_routing_group}; make num_experts_per_tok a "
                          "multiple of topk_routing_group or use moe_impl=ragged")
    if cfg.te_moe_block:
        _check_te_moe_block(cfg)


def _check_te_moe_block(cfg) -> None:
    fix = "or te_moe_block=false (the composed moe_impl=te_dropless path, which takes it)"
    if cfg.te_kernels == "reference":
        raise ConfigError("te_moe_block=true runs Transformer Engine's own fused MoE block, which has no pure-JAX "
                          "stand-in; set te_kernels=auto (an NVIDIA GPU) or te_moe_block=false")
    if cfg.te_gmm_quantization not in ("none", "mxfp8"):
        raise ConfigError(f"te_gmm_quantization={cfg.te_gmm_quantization}: TE's fused MoE block runs its grouped GEMMs "
                          f"in BF16 or MXFP8 only; set te_gmm_quantization=none or mxfp8, {fix}")
    if cfg.te_gmm_quantization == "mxfp8" and (cfg.base_emb_dim % 128 or cfg.base_moe_mlp_dim % 128):
        raise ConfigError(f"te_moe_block=true with te_gmm_quantization=mxfp8 needs base_emb_dim and base_moe_mlp_dim "
                          f"to be multiples of 128 (they are {cfg.base_emb_dim} and {cfg.base_moe_mlp_dim}): TE's "
                          "block quantizes NCCL EP's receive buffer, whose expert groups stop short of its end, and only "
                          f"TE's V2 MXFP8 kernels (128-multiple widths) take that; {fix}")
    if not te_router_mode(cfg)[1]:
        raise ConfigError(f"norm_topk_prob={str(cfg.norm_topk_prob).lower()}: with routed_score_func="
                          f"{cfg.routed_score_func}, num_experts_per_tok={cfg.num_experts_per_tok}"
                          f"{' and routing groups' if cfg.n_routing_groups else ''} TE's fused router weighs the "
                          f"chosen experts otherwise, and its fused MoE block takes only those weights; {fix}")


class DenseWeight(NamedTuple):
    """One dense GEMM's weight as the layers declare it: its shape, logical axes, how many leading dims the GEMM
    contracts (its input width is their product), the keys that set it, and how many such weights a layer has."""
    shape: tuple
    logical: tuple
    contracted: int
    keys: str
    count: int = 1

    @property
    def widths(self) -> tuple[int, int]:
        return math.prod(self.shape[:self.contracted]), math.prod(self.shape[self.contracted:])


def attention_weights(cfg) -> dict[str, DenseWeight]:
    """The weights of an attention block's projections (GQA or MLA), by the GEMM's name."""
    d, h, w = cfg.base_emb_dim, cfg.base_num_query_heads, DenseWeight
    if cfg.attention_type == "mla":
        qk, rq, rkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        if rq > 0:
            out = {"MLA's query down-projection": w((d, rq), ("embed", "q_lora"), 1, "base_emb_dim, q_lora_rank"),
                   "MLA's query up-projection": w((rq, h, qk), ("q_lora", "heads", "head_dim"), 1,
                                                  "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim")}
        else:
            out = {"MLA's query projection": w((d, h, qk), ("embed", "heads", "head_dim"), 1,
                                               "base_emb_dim, qk_nope_head_dim, qk_rope_head_dim")}
        out["MLA's key-value down-projection"] = w((d, rkv + cfg.qk_rope_head_dim), ("embed", "kv_lora"), 1,
                                                   "kv_lora_rank, qk_rope_head_dim")
        out["MLA's key-value up-projection"] = w((rkv, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                 ("kv_lora", "heads", "head_dim"), 1,
                                                 "kv_lora_rank, qk_nope_head_dim, v_head_dim")
        out["MLA's output projection"] = w((h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), 2,
                                           "v_head_dim, base_emb_dim")
    else:
        k, n = cfg.head_dim, cfg.base_num_kv_heads
        out = {"the query projection": w((d, h, k), ("embed", "heads", "head_dim"), 1,
                                         "base_emb_dim, base_num_query_heads, head_dim"),
               "the key and value projections": w((d, n, k), ("embed", "kv_heads", "head_dim"), 1,
                                                  "base_num_kv_heads, head_dim", 2),
               "the output projection": w((h, k, d), ("heads", "head_dim", "embed"), 2,
                                          "base_num_query_heads, head_dim")}
    return out


def dense_weights(cfg) -> dict[str, DenseWeight]:
    """The weights of the model's dense GEMMs (the ones `quantization` puts through TE), by the GEMM's name: the
    attention projections, the dense MLPs and the shared experts; the layers' own (tests/test_config.py holds
    this table to their parameters)."""
    d, w, out = cfg.base_emb_dim, DenseWeight, attention_weights(cfg)
    moe = cfg.num_experts > 1  # else every layer is dense (load.layer_counts)
    mlps = {"the dense MLP": (cfg.base_mlp_dim, "base_mlp_dim") if cfg.first_num_dense_layers > 0 or not moe
            else None,
            "the shared experts": (cfg.shared_experts * cfg.base_moe_mlp_dim, "shared_experts, base_moe_mlp_dim")
            if cfg.shared_experts and moe else None}
    for name, mlp in mlps.items():
        if mlp is not None:
            out[f"{name}'s input projections"] = w((d, mlp[0]), ("embed", "mlp"), 1, f"base_emb_dim, {mlp[1]}", 2)
            out[f"{name}'s output projection"] = w((mlp[0], d), ("mlp", "embed"), 1, f"{mlp[1]}, base_emb_dim")
    return out


RHT_WIDTH = 128  # TE's fused Hadamard-transform cast takes matrices whose columns are multiples of 128


def nvfp4_rht(quantization: str, width_in: int, width_out: int) -> bool:
    """Whether a GEMM of these widths takes te_nvfp4's random Hadamard transform (linear.dense_gemm): its weight
    gradient's operands (x and the output gradient, [tokens, width_in] and [tokens, width_out]) must both be RHT'd
    or neither, and TE's kernel needs their widths to be multiples of 128 (the tokens, of 64:
    check_quantized_gemms)."""
    return quantization == "te_nvfp4" and width_in % RHT_WIDTH == 0 and width_out % RHT_WIDTH == 0


def nvfp4_without_rht(cfg) -> list[str]:
    """The dense GEMMs te_nvfp4 runs without its Hadamard transform (widths not multiples of 128: nvfp4_rht), for
    the run's first lines; [] for any other quantization."""
    if cfg.quantization != "te_nvfp4":
        return []
    return [name for name, weight in dense_weights(cfg).items() if not nvfp4_rht(cfg.quantization, *weight.widths)]


def sequence_block(quantization: str) -> int:
    """How many tokens of a sequence TE's quantized copies of the activations block together (a sequence's length,
    or under context parallelism each device's piece of it, must be a multiple): MXFP8's scaling blocks 32, NVFP4's
    Hadamard transform 64; tensor-scaled FP8 and bf16 block nothing."""
    return 64 if quantization.startswith("te_nvfp4") else 32 if quantization == "te_mxfp8" else 1


def check_quantized_gemms(cfg) -> None:
    """What TE's quantized GEMMs need of every dense GEMM's widths (each is contracted in one pass or another):
    multiples of 16 for FP8 (cuBLAS), of 32 for MXFP8 (its scaling blocks) and NVFP4 (cuBLAS); likewise the
    tokens of one device's micro-batch, which the weight gradient contracts, and for MXFP8 a sequence's length
    (TE blocks the activations' second dim), for NVFP4 both multiples of 64. Each weight is gathered whole before
    TE quantizes it (DenseGemms._weight). te_nvfp4's Hadamard transform needs widths that are multiples of 128 as
    well: a GEMM whose widths are not runs without it (nvfp4_rht; the run's first lines name it)."""
    if cfg.quantization == "none":
        return
    nvfp4 = cfg.quantization.startswith("te_nvfp4")
    align = 32 if cfg.quantization == "te_mxfp8" or nvfp4 else 16
    why = ("cuBLAS's NVFP4 GEMMs contract multiples of 32" if nvfp4 else "MXFP8 scales blocks of 32" if align == 32
           else "cuBLAS's FP8 GEMMs contract multiples of 16")
    for name, weight in dense_weights(cfg).items():
        width_in, width_out = weight.widths
        if width_in % align or width_out % align:
            raise ConfigError(f"quantization={cfg.quantization}: {name} is {width_in} -> {width_out} wide and {why} "
                              f"(set by {weight.keys}); use widths that are multiples of {align} or "
                              "quantization=none")
    tokens = cfg.per_device_batch_size * cfg.max_target_length / cfg.gradient_accumulation_steps
    if nvfp4 and (tokens % 64 or cfg.max_target_length % sequence_block(cfg.quantization)):
        raise ConfigError(f"quantization={cfg.quantization}: a device's micro-batch holds {tokens:g} tokens "
                          f"(per_device_batch_size x max_target_length / gradient_accumulation_steps) of sequences "
                          f"of {cfg.max_target_length}: TE's NVFP4 copies block the tokens by 16 in scale tiles of "
                          "4 blocks, and its Hadamard transform takes 64 rows at a time; make both multiples of 64")
    if tokens % align or cfg.max_target_length % sequence_block(cfg.quantization):
        raise ConfigError(f"quantization={cfg.quantization}: a device's micro-batch holds {tokens:g} tokens "
                          f"(per_device_batch_size x max_target_length / gradient_accumulation_steps) of sequences "
                          f"of {cfg.max_target_length}: {why}, and the weight gradient contracts the tokens; make "
                          f"both multiples of {align}")


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
    if cfg.routed_bias_update_rate > 0 and not cfg.routed_bias:
        raise ConfigError("routed_bias_update_rate > 0 needs routed_bias=true (there is no bias to update)")


def check_sizes(cfg) -> None:
    """What the schema's ranges cannot say: a batch no device holds, a schedule longer than itself."""
    if cfg.per_device_batch_size > 2 ** 20:
        raise ConfigError(f"per_device_batch_size={cfg.per_device_batch_size} is absurd (over 2**20 sequences per "
                          "device); MaxText.plan says what fits")
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
    if cfg.base_moe_mlp_dim == -1 and cfg.num_experts > 1:
        raise ConfigError(f"base_moe_mlp_dim=-1 must be at least 1 with num_experts={cfg.num_experts} (MaxText's -1 "
                          "means none, in a dense model)")


def check_dropless_fallback(cfg) -> None:
    """moe_dropless_fallback and its first-phase keys, as upstream MaxText relates them: a fallback replaces the
    overflow of a bounded (ragged_buffer_factor) dropless buffer, so it needs one; the first-phase keys belong to the
    step fallback. (NCCL EP, bootstrapped once for one receive capacity: parallel/checks.check_nccl_ep.)"""
    mode = cfg.moe_dropless_fallback
    if mode is not None:
        if cfg.num_experts == 1 or cfg.moe_impl == "dense":
            raise ConfigError(f"moe_dropless_fallback={mode} applies to the dropless MoE (moe_impl=ragged or "
                              f"te_dropless with num_experts > 1), not moe_impl={cfg.moe_impl} with num_experts="
                              f"{cfg.num_experts}; set moe_dropless_fallback=null")
        if cfg.ragged_buffer_factor is None:
            raise ConfigError(f"moe_dropless_fallback={mode} needs a bounded buffer to fall back from: with "
                              "ragged_buffer_factor unset the buffers are the worst case and never overflow; set "
                              "ragged_buffer_factor (e.g. 1.25) or moe_dropless_fallback=null")
    if cfg.retry_dropless_first_steps and mode != "step":
        raise ConfigError(f"retry_dropless_first_steps={cfg.retry_dropless_first_steps} needs "
                          f"moe_dropless_fallback=step (it is {mode}); set it or retry_dropless_first_steps=0")
    factor = cfg.first_phase_ragged_buffer_factor
    if factor:
        if not cfg.retry_dropless_first_steps or mode != "step":
            raise ConfigError(f"first_phase_ragged_buffer_factor={factor} sizes the buffer of the first "
                              "retry_dropless_first_steps steps under moe_dropless_fallback=step; set both, or "
                              "first_phase_ragged_buffer_factor=0")
        if factor < cfg.ragged_buffer_factor:
            raise ConfigError(f"first_phase_ragged_buffer_factor={factor} is below ragged_buffer_factor="
                              f"{cfg.ragged_buffer_factor}: the first steps, the least balanced, would get the smaller "
                              "buffer; raise it to at least ragged_buffer_factor or set it to 0")


def check_two_hop(cfg) -> None:
    """ep_two_hop: the pure-JAX exchange's two hops need slices to cross (the expert axis's DCN part, set) and send
    a token once per slice and device (ep_dedup). (NCCL EP, two-hop already: parallel/checks.check_nccl_ep.)"""
    if not cfg.ep_two_hop:
        return
    if cfg.moe_impl == "dense":
        raise ConfigError("ep_two_hop=true is the dropless exchange's (moe_impl=ragged or te_dropless); moe_impl=dense "
                          "exchanges nothing; set ep_two_hop=false")
    if cfg.dcn_expert_parallelism in (None, -1) or cfg.dcn_expert_parallelism < 2:
        raise ConfigError(f"ep_two_hop=true needs the expert axis across slices, dcn_expert_parallelism of 2 or more "
                          f"(it is {cfg.dcn_expert_parallelism}): inside one slice there is no second hop; set "
                          "ep_two_hop=false")
    if not cfg.ep_dedup:
        raise ConfigError("ep_two_hop=true sends a token once per destination slice and device, which is ep_dedup; "
                          "set ep_dedup=true or ep_two_hop=false")


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
    """At most one ici_*/dcn_* value per group is -1 (absorbs the rest)."""
    for group in ("ici", "dcn"):
        absorbing = []
        for axis in MESH_AXES:
            key = f"{group}_{axis}_parallelism"
            if cfg[key] == -1:  # the schema allows a positive size or -1
                absorbing.append(key)
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


CHECKS = (check_schema, check_te_options, check_router, check_sizes, check_rope,
          check_attention_heads, check_layers, check_experts, check_dropless_fallback, check_two_hop,
          check_quantized_gemms, check_dense_masks, check_parallelism, check_logical_axis_rules, check_run_name,
          check_checkpoint_sources, check_upstream_consistency, check_paths)


def validate(cfg) -> None:
    """Runs every cross-key check; raises ConfigError on the first failure."""
    for check in CHECKS:
        check(cfg)

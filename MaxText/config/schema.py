"""The config schema: every key of configs/base.yml with the type of a set value, whether it may be null, its
allowed values or range, and its one-line doc.

parse.coerce reads a value's type from here and checks.check_schema its choices and range; the checks that relate
keys to each other stay in checks.py. Tests hold configs/base.yml to this table (the same keys, each default of its
key's type and within its rules, each line's comment its doc) and fail on a `cfg` key the code reads that is not
here. configs/base.yml holds the defaults. No JAX here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from MaxText.config.hardware import GPU_PROFILES

INT32_MAX = 2 ** 31 - 1  # JAX and Optax count steps, sizes and ids in int32


@dataclasses.dataclass(frozen=True, eq=False)
class Key:
    """One key. `type`: of a set value (bool, int, float, str or list). `null`: whether null (unset) is allowed.
    `choices`: the values allowed, when they are a fixed set. `low`, `high`: the bounds, inclusive unless
    `low_open`/`high_open`; an int without `high` is bounded by int32. `also`: values outside the range that mean
    something, {value: meaning}. `why`: what the range comes from, said in its error. `minus_one_null`: upstream
    MaxText's -1 for "unset" is read as null. `doc`: the key's line in configs/base.yml."""

    type: type
    doc: str
    null: bool = False
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: dict[Any, str] | None = None
    why: str = ""
    minus_one_null: bool = False

    def error(self, value: Any) -> str | None:
        """What is wrong with a set (non-null) value, said after `key=value` ("must be at least 1"), or None."""
        if self.choices and value not in self.choices:
            return f"is not one of {', '.join(self.choices)}" + (" (or null)" if self.null else "")
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if self.also and value in self.also or self.type not in (int, float):
            return None
        low, high = self.low, self.high
        if ((low is not None and (value <= low if self.low_open else value < low))
                or (high is not None and (value >= high if self.high_open else value > high))):
            also = "".join(f" (or {v}: {meaning})" for v, meaning in (self.also or {}).items())
            return self._bounds() + also + (f" ({self.why})" if self.why else "") + (" (or null)" if self.null else "")
        if self.type is int and high is None and not -INT32_MAX <= value <= INT32_MAX:
            return (f"is out of range: at most 2**31 - 1 = {INT32_MAX} (steps, periods and sizes are int32 in JAX "
                    "and Optax)")
        return None

    def _bounds(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"must be between {low} and {high}"
            return f"must be in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.high is not None:
            return f"must be {'less than' if self.high_open else 'at most'} {high}"
        if self.low_open:
            return f"must be greater than {low}"
        return "must not be negative" if self.low == 0 else f"must be at least {low}"


def _number(x: float | None) -> str:
    """A bound as people write it: 2**32 for a large power of two, else the shortest form (1e-06, 10)."""
    if isinstance(x, int) and x >= 2 ** 16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if x is not None else ""


MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
MOE_IMPLS = ("dense", "ragged", "te_dropless")
DROPLESS_FALLBACKS = ("step", "layer")
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
QUANTIZATIONS = ("none", "te_fp8_currentscaling", "te_mxfp8", "te_nvfp4", "te_nvfp4_no_rht")  # upstream's names
# quantization -> te_kernels.quantizer_set's name of the same TE recipe (the first two are te_gmm_quantization's too)
QUANTIZATION_RECIPES = {"te_fp8_currentscaling": "fp8_current", "te_mxfp8": "mxfp8", "te_nvfp4": "nvfp4",
                        "te_nvfp4_no_rht": "nvfp4_no_rht"}
ROUTER_SCORE_FUNCS = ("softmax", "sigmoid")
DECODE_SAMPLING = ("greedy", "weighted", "topk", "nucleus", "composite")  # upstream's decode_sampling_strategy
LOAD_BALANCE_LOSS_TYPES = ("global", "sequence")
ROPE_TYPES = ("default", "yarn")
ATTENTION_TYPES = ("mha", "mla")
ATTENTION_IMPLS = ("dot_product", "chunked", "cudnn_flash")
ABSORB = {-1: "absorb the remaining devices"}  # an ici_*/dcn_* size; at most one per group (checks.check_parallelism)

# In configs/base.yml's order, by its sections.
SCHEMA: dict[str, Key] = {
    # run and output
    "run_name": Key(str, null=True, doc='output subdirectory; rerunning a run_name resumes it; null = run_<timestamp>'),
    "base_output_directory": Key(str, doc='root of <run_name>/{checkpoints,metrics,tensorboard}'),
    "steps": Key(int, low=1, doc='number of optimizer steps the run ends at'),
    "log_period": Key(int, low=1, doc='log metrics every this many steps (and at the last step)'),
    "enable_tensorboard": Key(bool, doc='also write TensorBoard events under <run>/tensorboard'),
    "init_weights_seed": Key(int, low=0, high=2 ** 32, high_open=True, why="a PRNG seed", doc=
        'PRNG seed for parameter initialisation'),
    "num_devices": Key(int, null=True, low=1, doc=
        'devices this config is laid out for; MaxText.plan plans for it (null: the visible ones)'),
    "hbm_gib": Key(float, null=True, low=0, low_open=True, high=100000.0, doc=
        "memory per device (GiB) MaxText.plan checks the fit against (null: the local device's); train checks against "
        "the device's own, or this where it reports none (CPU)"),
    "dropless_fallback_rate": Key(float, low=0, high=1, doc=
        'MaxText.plan: the share of steps (moe_dropless_fallback=step) or MoE layer calls (layer) assumed to overflow; '
        'the step-time model charges their worst-case rerun (a run logs its own: moe_step_replays, '
        'moe_dropless_fallback_layers)'),
    "gpu_profile": Key(str, null=True, choices=GPU_PROFILES, doc=
        'target GPU system for MaxText.preflight: h100-sxm | h200-sxm | gb200-nvl72 | gb300-nvl72 (null: none)'),
    "host_memory_limit_gb": Key(int, null=True, low=1, high=100000.0, doc=
        "XLA's pinned-host pool per process for offloaded activations (sets XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB; null: "
        "XLA's 64)"),
    "hardware": Key(str, choices=HARDWARE, doc=
        'auto | cpu | gpu | gpu_multiprocess; gpu_multiprocess always calls jax.distributed.initialize()'),
    "skip_jax_distributed_system": Key(bool, doc=
        'never call jax.distributed.initialize(), even when the environment announces several processes'),
    "xla_flags": Key(str, null=True, doc='extra XLA flags, merged into XLA_FLAGS before JAX starts its backend'),

    # model
    "model_name": Key(str, null=True, doc=
        'merges configs/models/<model_name>.yml (or a .yml path) over the config files, as in MaxText'),
    "override_model_config": Key(bool, doc=
        'let the command line (and config files) set keys the model file sets otherwise; false: such a clash is an '
        'error'),
    "decoder_block": Key(str, null=True, doc=
        "MaxText's model family (llama2, mistral, mixtral, deepseek, qwen3, qwen3_moe): checked against the keys that "
        'build it; null: not checked'),
    "base_emb_dim": Key(int, low=1, doc='model width D'),
    "base_num_query_heads": Key(int, low=1, doc='attention query heads H'),
    "base_num_kv_heads": Key(int, low=1, doc='key/value heads (GQA groups); must divide base_num_query_heads'),
    "head_dim": Key(int, low=1, doc='per-head dimension'),
    "base_mlp_dim": Key(int, low=1, doc='SwiGLU hidden size F of dense layers'),
    "base_num_decoder_layers": Key(int, low=1, doc='decoder layers in total'),
    "vocab_size": Key(int, low=1, doc='vocabulary size V'),
    "logits_via_embedding": Key(bool, doc='tie the output projection to the token embedding'),
    "normalization_layer_epsilon": Key(float, low=0, low_open=True, high=1.0, doc='RMSNorm epsilon'),
    "rope_max_timescale": Key(int, low=0, low_open=True, doc='RoPE base wavelength (theta)'),
    "rope_type": Key(str, choices=ROPE_TYPES, doc='default | yarn (YaRN context extension, DeepSeek-V3)'),
    "rope_factor": Key(float, low=1e-06, doc="yarn: context extension factor (DeepSeek-V3's 40)"),
    "original_max_position_embeddings": Key(int, low=1, doc='yarn: the context length the model was first trained at'),
    "beta_fast": Key(float, low=1e-06, doc='yarn: rotations above which a frequency is kept as is'),
    "beta_slow": Key(float, low=1e-06, doc='yarn: rotations below which a frequency is fully interpolated'),
    "mscale": Key(float, low=0.0, doc=
        "yarn, mla: attention-scale coefficient, softmax scale x (0.1 mscale ln(factor) + 1)^2 (transformers' "
        'mscale_all_dim)'),
    "rope_attention_factor": Key(float, low=0, low_open=True, doc=
        "yarn: factor on the rotated query/key features (cos and sin; transformers' attention_factor)"),
    "rope_interleave": Key(bool, doc=
        "yarn: rotate interleaved feature pairs (x[2i], x[2i+1]) as DeepSeek's release does; false: pairs (x[i], x[i +"
        ' K/2])'),
    "qk_norm": Key(bool, doc="mha: RMSNorm over each head's query and key before RoPE (Qwen3)"),
    "attention_type": Key(str, choices=ATTENTION_TYPES, doc=
        'mha (grouped-query attention) | mla (DeepSeek Multi-head Latent Attention)'),
    "q_lora_rank": Key(int, low=0, doc='mla: rank of the low-rank query projection; 0 = a full-rank query'),
    "kv_lora_rank": Key(int, low=0, doc='mla: rank of the compressed key/value latent'),
    "qk_nope_head_dim": Key(int, low=0, doc='mla: per-head query/key features without RoPE'),
    "qk_rope_head_dim": Key(int, low=0, doc=
        'mla: per-head query/key features with RoPE (the key part is shared by all heads)'),
    "v_head_dim": Key(int, low=0, doc='mla: per-head value features'),
    "attention": Key(str, choices=ATTENTION_IMPLS, doc=
        'dot_product (all [B, H, L, L] scores at once) | chunked (query chunks, recomputed in backward) | cudnn_flash '
        "(cuDNN's fused flash kernel on CUDA GPUs, Hopper+, bf16/fp16; elsewhere, and for a batch with a row of more "
        'than 64 documents, chunked)'),
    "attention_chunk_size": Key(int, low=1, doc=
        "chunked, and cudnn_flash's chunked path: query rows per chunk; peak score memory B x H x chunk x L floats"),

    # mixture of experts
    "num_experts": Key(int, low=1, doc='routed experts E; 1 = a dense model'),
    "num_experts_per_tok": Key(int, low=1, doc='experts per token K (top-k)'),
    "base_moe_mlp_dim": Key(int, low=1, also={-1: "none, in a dense model"}, doc=
        'SwiGLU hidden size F of each routed expert'),
    "first_num_dense_layers": Key(int, low=0, doc='the first this many layers use a dense MLP, the rest MoE'),
    "mtp_num_layers": Key(int, low=0, doc=
        'Multi-Token Prediction depths after the decoder (DeepSeek-V3: 1); each predicts one token further'),
    "mtp_loss_scaling_factor": Key(float, low=0, high=100.0, doc='weight of the mean MTP cross-entropy in the loss'),
    "shared_experts": Key(int, low=0, doc=
        'MoE layers: always-on SwiGLU of shared_experts x base_moe_mlp_dim beside the routed experts (DeepSeek-V3: 1)'),
    "moe_impl": Key(str, choices=MOE_IMPLS, doc=
        'ragged (pure-JAX dropless) | te_dropless (Transformer Engine dropless) | dense (capacity-based one-hot masks,'
        ' may drop; refused where a mask would pass 1 GiB per sequence)'),
    "capacity_factor": Key(float, null=True, low=0, low_open=True, minus_one_null=True, doc=
        'dense: per-sequence expert capacity = ceil(L*K/E * factor); null = no cap (nothing dropped)'),
    "ragged_buffer_factor": Key(float, null=True, low=0, low_open=True, minus_one_null=True, doc=
        'ragged/te_dropless with expert parallelism: receive buffer = balanced load x factor; null = dropless worst '
        'case; overflow is counted, never silent'),
    "eval_ragged_buffer_factor": Key(float, null=True, low=0, low_open=True, minus_one_null=True, doc=
        'evaluation: the receive-buffer factor of the eval program; null = ragged_buffer_factor\'s'),
    "moe_dropless_fallback": Key(str, null=True, choices=DROPLESS_FALLBACKS, doc=
        'with a ragged_buffer_factor: null = overflow is counted and dropped | step = a step that overflowed is undone '
        'and rerun by the worst-case-buffer program | layer = an overflowing MoE layer takes a worst-case branch'),
    "retry_dropless_first_steps": Key(int, low=0, doc=
        'moe_dropless_fallback=step: the first this many steps after (re)start run the worst-case program directly '
        '(or the first_phase_ragged_buffer_factor one); 0 = off'),
    "first_phase_ragged_buffer_factor": Key(float, low=0, doc=
        'retry_dropless_first_steps: those steps try a buffer of this factor first (an overflow still reruns them '
        'worst-case); 0 = off'),
    "ep_dedup": Key(bool, doc=
        'ragged/te_dropless (reference) expert parallelism: a token travels once per destination device, not once per '
        'chosen expert'),
    "ep_two_hop": Key(bool, doc=
        "ragged/te_dropless over XLA's exchange, expert parallelism across slices (dcn_expert_parallelism > 1): a "
        "token crosses to each destination slice once, to the device at its own position there, which forwards it "
        "inside the slice; same result"),
    "num_moe_token_chunks": Key(int, low=1, doc=
        'ragged/te_dropless (reference) expert parallelism: the tokens in this many slices, each with its own all-to-'
        "alls, so one slice's exchange can overlap another's GEMMs; same result"),
    "use_batch_split_schedule": Key(bool, doc=
        "split each device's batch into batch_split_factor parts that run every layer side by side, so one part's "
        "expert-parallel exchange can run under another part's compute; same result"),
    "batch_split_factor": Key(int, low=1, doc=
        'use_batch_split_schedule: the parts (the per-device batch must divide into them)'),
    "te_kernels": Key(str, choices=TE_KERNELS, doc=
        'te_dropless: auto = TE kernels on an NVIDIA GPU | reference = the pure-JAX references (any platform)'),
    "te_gmm_quantization": Key(str, choices=TE_GMM_QUANTIZATIONS, doc=
        'te_dropless grouped GEMMs: none (bf16) | fp8_current (Hopper+) | mxfp8 (Blackwell only)'),
    "quantization": Key(str, choices=QUANTIZATIONS, doc=
        'dense GEMMs (attention projections, dense MLPs, shared experts) through TE: none (bf16) | '
        'te_fp8_currentscaling (SM 8.9+) | te_mxfp8 (Blackwell) | te_nvfp4 (Blackwell: NVFP4 with 2D weight '
        'scales, stochastic rounding of the output gradient, the random Hadamard transform on the weight '
        'gradient\'s operands where a GEMM\'s widths are multiples of 128) | te_nvfp4_no_rht (the same without the '
        'transform); the embedding, the output head, the router, the norms and the attention core stay in high '
        'precision (as DeepSeek-V3 kept them)'),
    "routed_score_func": Key(str, choices=ROUTER_SCORE_FUNCS, doc='softmax | sigmoid (DeepSeek-V3)'),
    "norm_topk_prob": Key(bool, doc='renormalise the k chosen weights to sum to 1 (Mixtral/Qwen3/DeepSeek-V3)'),
    "routed_scaling_factor": Key(float, low=1e-06, doc='multiply the combine weights by this (DeepSeek-V3: 2.5)'),
    "n_routing_groups": Key(int, null=True, minus_one_null=True, doc=
        'group-limited routing: experts split into this many groups (DeepSeek-V3: 8); null or -1 = off'),
    "topk_routing_group": Key(int, null=True, minus_one_null=True, doc=
        '... and each token picks experts only from its best this many groups (DeepSeek-V3: 4)'),
    "routing_group_score": Key(str, choices=("topk_sum", "max"), doc=
        "a group's score: topk_sum = the sum of its best num_experts_per_tok / topk_routing_group scores (DeepSeek-V3)"
        " | max = its best score (DeepSeek-V2's device-limited routing)"),
    "routed_bias": Key(bool, doc=
        'aux-loss-free balancing: a float32 per-expert bias added to the scores for selection only'),
    "routed_bias_update_rate": Key(float, low=0, high=1.0, doc=
        'bias += rate * sign(mean load - expert load) after every step (not trained by the optimizer)'),
    "load_balance_loss_weight": Key(float, low=0, high=100.0, doc=
        'weight of the Switch-style load-balance loss, per MoE layer (summed over layers); 0 = off'),
    "load_balance_loss_type": Key(str, choices=LOAD_BALANCE_LOSS_TYPES, doc=
        "global (over the whole batch) | sequence (per sequence, then averaged; DeepSeek-V3's)"),
    "router_z_loss_weight": Key(float, low=0, high=100.0, doc=
        'weight of the router z-loss mean(logsumexp(logits)^2), per MoE layer; 0 = off'),
    "te_moe_block": Key(bool, null=True, doc="true: TE's fused MoE block (implies moe_impl=te_dropless); false/null: "
                        "the composed path"),
    "sparse_matmul": Key(bool, null=True, doc=
        "MaxText's spelling: true = moe_impl=ragged, false = moe_impl=dense (with a log line)"),

    # parallelism
    "ici_data_parallelism": Key(int, low=1, also=ABSORB, doc=
        'pure data parallelism inside a node'),
    "ici_fsdp_parallelism": Key(int, low=1, also=ABSORB, doc=
        'fully-sharded data parallelism inside a node'),
    "ici_context_parallelism": Key(int, low=1, also=ABSORB, doc=
        'context parallelism inside a node: each sequence split over this many devices (keys and values gathered '
        'in attention)'),
    "ici_expert_parallelism": Key(int, low=1, also=ABSORB, doc=
        'expert parallelism inside a node (routed experts sharded; other layers use it for batch)'),
    "ici_tensor_parallelism": Key(int, low=1, also=ABSORB, doc=
        'tensor parallelism inside a node'),
    "dcn_data_parallelism": Key(int, low=1, also=ABSORB, doc=
        'data parallelism across nodes (-1: the number of slices, 1 on one node)'),
    "dcn_fsdp_parallelism": Key(int, low=1, also=ABSORB, doc='fsdp across nodes'),
    "dcn_context_parallelism": Key(int, low=1, also=ABSORB, doc='context parallelism across nodes'),
    "dcn_expert_parallelism": Key(int, low=1, also=ABSORB, doc=
        'expert parallelism across nodes'),
    "dcn_tensor_parallelism": Key(int, low=1, also=ABSORB, doc=
        'tensor parallelism across nodes'),
    "context_parallel_strategy": Key(str, choices=("all_gather",), doc=
        "context parallelism's attention: all_gather (each device's queries against the sequence's keys and values, "
        "gathered over the context axis)"),
    "context_parallel_load_balance": Key(bool, doc=
        "causal load balance across the context axis (attention: chunked or cudnn_flash): each device computes an "
        "early and a late block of queries (chunked: each chunk against the keys it needs, about 0.7 of the "
        "unbalanced work); the same numbers"),
    "logical_axis_rules": Key(list, doc="[logical axis, [mesh axes]] pairs; earlier rules win"),

    # training
    "per_device_batch_size": Key(float, low=0, low_open=True, doc=
        'sequences per device; global batch = this x device count'),
    "gradient_accumulation_steps": Key(int, low=1, doc=
        "take each step's batch in this many micro-batches, one at a time: the same update, less activation memory"),
    "max_target_length": Key(int, low=1, doc='sequence length L'),
    "dtype": Key(str, choices=DTYPES, doc='compute dtype (activations, matmul inputs)'),
    "weight_dtype": Key(str, choices=DTYPES, doc='parameter and optimizer-state dtype'),
    "opt_type": Key(str, choices=("adamw",), doc='optimizer (adamw only)'),
    "learning_rate": Key(float, low=0, high=10.0, doc='peak learning rate'),
    "warmup_steps_fraction": Key(float, low=0, high=1, doc=
        'linear warmup over this fraction of learning_rate_schedule_steps'),
    "learning_rate_schedule_steps": Key(int, null=True, low=1, minus_one_null=True, doc=
        'length of the schedule (warmup + decay, or warmup + stable + decay); null = steps'),
    "cosine_learning_rate_final_fraction": Key(float, low=0.0, high=1.0, doc=
        'final learning rate as a fraction of the peak'),
    "lr_schedule_type": Key(str, choices=("cosine", "wsd"), doc=
        'cosine (warmup, cosine decay) | wsd (warmup, stable at the peak, decay)'),
    "wsd_decay_steps_fraction": Key(float, low=0.0, high=1.0, doc=
        'wsd: the decay phase as a fraction of learning_rate_schedule_steps'),
    "wsd_decay_style": Key(str, choices=("linear", "cosine"), doc=
        'wsd: linear | cosine decay to cosine_learning_rate_final_fraction of the peak'),
    "adam_b1": Key(float, low=0, high=1, high_open=True, why="Adam's moment decay", doc='AdamW beta1'),
    "adam_b2": Key(float, low=0, high=1, high_open=True, why="Adam's moment decay", doc='AdamW beta2'),
    "adam_eps": Key(float, low=0, low_open=True, high=1.0, doc='AdamW epsilon'),
    "adam_weight_decay": Key(float, low=0, high=10.0, doc='AdamW decoupled weight decay'),
    "mu_dtype": Key(str, null=True, choices=DTYPES, doc=
        "dtype of Adam's first moment (bfloat16 halves it; null: the weight dtype)"),
    "gradient_clipping_threshold": Key(float, null=True, low=0, low_open=True, doc=
        'clip gradients to this global norm; null = no clipping'),
    "num_vocab_tiling": Key(int, low=1, doc=
        'output projection + loss in this many token tiles, each recomputed in the backward: float32 logits '
        '[tokens/tiles, V] at a time'),
    "scan_layers": Key(bool, doc='run identical layers through one lax.scan (one compiled layer)'),
    "remat_policy": Key(str, choices=REMAT_POLICIES, doc=
        "full (save only layer inputs) | minimal (save every matmul output) | none | custom (the keys below)"),
    "query_proj": Key(str, choices=REMAT_LOCATIONS, doc='custom: attention query projection output'),
    "key_proj": Key(str, choices=REMAT_LOCATIONS, doc='custom: attention key projection output'),
    "value_proj": Key(str, choices=REMAT_LOCATIONS, doc='custom: attention value projection output'),
    "out_proj": Key(str, choices=REMAT_LOCATIONS, doc='custom: attention output projection'),
    "mla_q": Key(str, choices=REMAT_LOCATIONS, doc='custom: MLA low-rank query [B, L, q_lora_rank] (before its norm)'),
    "mla_kv": Key(str, choices=REMAT_LOCATIONS, doc=
        'custom: MLA low-rank key-value and RoPE key [B, L, kv_lora_rank + rope]'),
    "mlpwi_0": Key(str, choices=REMAT_LOCATIONS, doc='custom: dense MLP gate projection'),
    "mlpwi_1": Key(str, choices=REMAT_LOCATIONS, doc='custom: dense MLP up projection'),
    "mlpwo": Key(str, choices=REMAT_LOCATIONS, doc=
        'custom: dense MLP down projection (no backward reads it: saving it keeps nothing)'),
    "moe_mlpwi_0": Key(str, choices=REMAT_LOCATIONS, doc='custom: expert gate projections'),
    "moe_mlpwi_1": Key(str, choices=REMAT_LOCATIONS, doc='custom: expert up projections'),
    "moe_mlpwo": Key(str, choices=REMAT_LOCATIONS, doc='custom: expert down projections'),
    "moe_dispatch": Key(str, choices=REMAT_LOCATIONS, doc=
        "custom: the rows expert parallelism delivered to this device's experts (device/offload: the backward does not"
        ' redo the all-to-all)'),

    # data
    "dataset_type": Key(str, choices=DATASET_TYPES, doc=
        'tfds (a prepared TensorFlow Datasets dataset) | grain (ArrayRecord files read by Grain: constant-time resume)'
        ' | hf (local Parquet/JSON/Arrow files read by Hugging Face datasets) | synthetic (a learnable token process '
        'generated on the fly); the first three tokenize and pack alike (MaxText/data/packing.py)'),
    "dataset_name": Key(str, null=True, doc=
        "tfds: name[/config][:version], e.g. c4/en:3.0.1; python_stdlib = this Python's standard-library sources, "
        'built locally once'),
    "dataset_path": Key(str, null=True, doc=
        'tfds: the TFDS data dir holding the prepared dataset (nothing is downloaded); null = '
        '~/.cache/maxtext_moe/tensorflow_datasets'),
    "train_split": Key(str, doc='tfds: split trained on (TFDS split syntax, e.g. train[:90%])'),
    "eval_split": Key(str, doc='tfds: split evaluated on'),
    "grain_train_files": Key(str, null=True, doc=
        'grain: ArrayRecord files of tf.train.Example records, a glob (several: comma-separated), e.g. '
        '/data/c4/train-*.array_record; MaxText.data.to_array_record writes them'),
    "grain_eval_files": Key(str, null=True, doc='grain: the eval files, as grain_train_files'),
    "grain_file_type": Key(str, doc="grain: the files' format (arrayrecord only: for Parquet use dataset_type=hf)"),
    "grain_worker_count": Key(int, low=0, high=1024, doc=
        'grain: child processes reading and tokenizing the train stream; 0 = in the training process'),
    "grain_worker_count_eval": Key(int, low=0, high=1024, doc='grain: the same for the eval stream'),
    "hf_path": Key(str, null=True, doc=
        'hf: a `datasets` loader for local files (parquet, json, arrow, text) or a local directory of such files; '
        'never the hub'),
    "hf_name": Key(str, null=True, doc="hf: the dataset's config name, if it has several"),
    "hf_data_dir": Key(str, null=True, doc='hf: the directory of the files (with hf_path a loader name)'),
    "hf_train_files": Key(str, null=True, doc=
        'hf: the train files, a glob (several: comma-separated), e.g. /data/c4/train-*.parquet'),
    "hf_eval_files": Key(str, null=True, doc=
        'hf: the eval files; null = the split hf_eval_split of hf_path/hf_data_dir'),
    "hf_eval_split": Key(str, null=True, doc=
        "hf: the eval split's name when hf_eval_files is null (train_split names the train split)"),
    "train_data_columns": Key(list, doc=
        'tfds, grain, hf: the column (feature) holding each document: text (grain, hf: or token ids already '
        'tokenized)'),
    "eval_data_columns": Key(list, doc='tfds, grain, hf: the same for the eval files'),
    "data_shuffle_seed": Key(int, low=0, high=2 ** 32, high_open=True, why="a PRNG seed", doc=
        'seed of the document order (tfds) or of the token stream (synthetic)'),
    "tokenizer_path": Key(str, null=True, doc=
        'tfds: a SentencePiece *.model or a Hugging Face tokenizer.json; null = built-in byte-level tokenizer (259 '
        'ids)'),
    "tokenizer_type": Key(str, null=True, doc=
        "MaxText's sentencepiece | huggingface: checked against tokenizer_path when both are set"),
    "add_bos": Key(bool, doc="tfds: begin each document with the tokenizer's BOS id"),
    "add_eos": Key(bool, doc="tfds: end each document with the tokenizer's EOS id"),
    "eval_interval": Key(int, low=1, also={-1: "no evaluation"}, doc=
        'evaluate every this many steps (and at the last step); -1 = never'),
    "eval_steps": Key(int, low=1, also={-1: "the whole eval split"}, doc=
        'batches per evaluation (the same batches every time); -1 = the whole eval split, once (tfds)'),
    "reuse_example_batch": Key(int, low=0, doc=
        '>0: train on the first batch over and over (a benchmark of the step without the input pipeline)'),

    # profiling
    "profiler": Key(str, choices=("", "xplane"), doc=
        '"" (off) | xplane: a JAX trace (XProf, TensorBoard profile plugin) under <run>/tensorboard/plugins/profile'),
    "skip_first_n_steps_for_profiler": Key(int, low=0, doc=
        'xplane: start after this many steps of this run (compilation and warm-up stay out)'),
    "profiler_steps": Key(int, low=1, doc='xplane: steps traced'),

    # checkpoints
    "enable_checkpointing": Key(bool, doc='write Orbax checkpoints under <run>/checkpoints/<step>/items'),
    "checkpoint_period": Key(int, low=1, doc='save every this many steps (and at the last step)'),
    "async_checkpointing": Key(bool, doc='write checkpoints in the background while training continues'),
    "save_checkpoint_on_start": Key(bool, doc='also save the state before the first step of a fresh run (step 0)'),
    "save_checkpoint_on_completion": Key(bool, doc=
        'save at the last step (false: only at multiples of checkpoint_period)'),
    "checkpoint_timeout_s": Key(int, low=1, doc=
        'a save not durable this many seconds after it began stops the run (exit 1): a hung filesystem is an error, '
        'not a stall'),
    "max_num_checkpoints_to_keep": Key(int, null=True, low=1, doc=
        'keep the newest this many checkpoints; null = keep all'),
    "load_parameters_path": Key(str, null=True, doc=
        'start from the params of this checkpoint item dir (.../checkpoints/N/items), step 0'),
    "load_full_state_path": Key(str, null=True, doc=
        'start from the full state (params, optimizer, step) of this item dir'),

    # decoding (python -m MaxText.decode)
    "prompt": Key(str, doc='the text MaxText.decode continues (through the tokenizer; add_bos: after a BOS id)'),
    "max_prefill_predict_length": Key(int, low=1, doc=
        "decode: the longest prompt in tokens; 1 + max_target_length - max_prefill_predict_length tokens follow it"),
    "autoregressive_decode_assert": Key(str, doc=
        'decode: exit 1 unless the continuation starts with this text ("" = no check)'),
    "decode_sampling_strategy": Key(str, choices=DECODE_SAMPLING, doc=
        'decode: greedy | weighted (softmax / temperature) | topk | nucleus (top-p) | composite (top-k, then top-p, '
        'then weighted)'),
    "decode_sampling_temperature": Key(float, low=0, low_open=True, doc='decode: softmax temperature of the sampling'),
    "decode_sampling_top_k": Key(int, low=0, doc='decode, topk and composite: sample among the k likeliest (0 = all)'),
    "decode_sampling_nucleus_p": Key(float, low=0, high=1, low_open=True, null=True, minus_one_null=True, doc=
        'decode, nucleus and composite: sample among the likeliest tokens whose probabilities reach p (null = all)'),
}

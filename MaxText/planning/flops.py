"""Model FLOPs per token, counted from the config, and MFU against a device's peak (no JAX here): the trainer's
step lines and the planner's step-time model count the same FLOPs.
"""

from __future__ import annotations

from MaxText.config.load import layer_counts

# Dense bf16 peak TFLOP/s per device (no sparsity), matched as a substring of jax's device_kind;
# longer names first so 'GH200' is not read as 'H200'. Unknown devices (and CPUs) get no MFU.
PEAK_TFLOPS_BF16 = (
    ("GB300", 2500.0), ("GB200", 2500.0), ("B300", 2250.0), ("B200", 2250.0),
    ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0),
)


def peak_tflops(device_kind: str):
    """The table's peak for this device kind, or None where it is not known."""
    for name, peak in PEAK_TFLOPS_BF16:
        if name.lower() in device_kind.lower():
            return peak
    return None


def attention_core_flops_per_token(cfg) -> float:
    """Forward FLOPs of one attention layer's causal score and value products per token (each token attends
    to L/2 positions on average)."""
    h, length = cfg.base_num_query_heads, cfg.max_target_length
    if cfg.attention_type == "mla":
        return 2 * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * length / 2
    return 2 * 2 * h * cfg.head_dim * length / 2


def attention_flops_per_token(cfg) -> float:
    """Forward FLOPs of one attention layer per token: projections, and the causal score and value products."""
    d, h = cfg.base_emb_dim, cfg.base_num_query_heads
    if cfg.attention_type == "mla":
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        query = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
        kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + v)
        return 2 * (query + kv + h * v * d) + attention_core_flops_per_token(cfg)
    n, k = cfg.base_num_kv_heads, cfg.head_dim
    return 2 * d * (h * k + 2 * n * k) + 2 * h * k * d + attention_core_flops_per_token(cfg)


def quantizable_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of the dense GEMMs upstream's `quantization` puts through TE (layers/linear.py):
    the attention projections, the dense MLPs and the shared experts, in the decoder and each MTP depth."""
    num_dense, num_moe = layer_counts(cfg)
    d, moe = cfg.base_emb_dim, cfg.num_experts > 1
    projections = attention_flops_per_token(cfg) - attention_core_flops_per_token(cfg)
    dense_mlp = 2 * 3 * d * cfg.base_mlp_dim
    shared = cfg.shared_experts * 2 * 3 * d * cfg.base_moe_mlp_dim if moe else 0
    per_mtp = projections + (shared if moe else dense_mlp)
    return (cfg.base_num_decoder_layers * projections + num_dense * dense_mlp + num_moe * shared
            + cfg.mtp_num_layers * per_mtp)


def model_flops_per_token(cfg) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token, counted from the config.

    Counts matmuls only: attention (attention_flops_per_token), dense MLPs, the router, the K active and
    the shared experts of MoE layers, the output projection, and each Multi-Token Prediction depth (its
    [2D, D] projection, one more layer, and the output projection again).
    """
    d = cfg.base_emb_dim
    moe = cfg.num_experts > 1
    num_dense, num_moe = layer_counts(cfg)
    dense_mlp = 2 * 3 * d * cfg.base_mlp_dim
    experts_per_token = cfg.num_experts_per_tok + cfg.shared_experts
    moe_mlp = 2 * d * cfg.num_experts + experts_per_token * 2 * 3 * d * cfg.base_moe_mlp_dim
    attention, logits = attention_flops_per_token(cfg), 2 * d * cfg.vocab_size
    forward = cfg.base_num_decoder_layers * attention + num_dense * dense_mlp + num_moe * moe_mlp + logits
    mtp_depth = 2 * 2 * d * d + attention + (moe_mlp if moe else dense_mlp) + logits
    return 3.0 * (forward + cfg.mtp_num_layers * mtp_depth)


def throughput(cfg, tokens_per_step: int, num_devices: int, step_time_s: float, peak):
    """tokens/s/device, model TFLOP/s/device and MFU (None without a known peak)."""
    tokens_per_s_per_device = tokens_per_step / step_time_s / num_devices
    tflops = model_flops_per_token(cfg) * tokens_per_s_per_device / 1e12
    return tokens_per_s_per_device, tflops, (tflops / peak if peak else None)

"""The checks of a config against its mesh's shape, in one function run as soon as the shape is known
(sharding.mesh_shape): the trainer, the planner, the preflight and the layout search refuse the same configs, in
one line naming the keys, before anything is built on the mesh. No JAX here.
"""

from __future__ import annotations

import math

from MaxText.config.checks import sequence_block
from MaxText.config.schema import MESH_AXES
from MaxText.config.errors import ConfigError
from MaxText.config.load import batch_parts, global_batch_size

# Mesh axes the batch is split over: attention and dense layers use the expert axis for data too.
DATA_AXES = ("data", "fsdp", "expert")


def check_mesh(cfg, shape: dict) -> None:
    """Experts over the expert axis, widths over the tensor axis, the global batch over the data axes, and what
    NCCL EP cannot take; `shape` is {axis: size}."""
    if cfg.num_experts > 1 and cfg.num_experts % shape["expert"]:
        raise ConfigError(f"num_experts={cfg.num_experts} must be divisible by the expert mesh axis, "
                          f"which is {shape['expert']} here; change ici_expert_parallelism/dcn_expert_parallelism")
    check_tensor_split(cfg, shape["tensor"])
    check_context(cfg, shape)
    devices = math.prod(shape[a] for a in MESH_AXES)
    check_batch(cfg, shape, global_batch_size(cfg, devices))
    check_nccl_ep(cfg, shape)


def check_context(cfg, shape: dict) -> None:
    """Context parallelism splits every sequence in `context` equal pieces (the all-gather strategy), each a whole
    number of the blocks TE's quantized copies take under `quantization`; what it does not take yet is refused in
    one line."""
    context = shape["context"]
    if context == 1:
        return
    axes = "ici_context_parallelism/dcn_context_parallelism"
    length = next((rule[1] for rule in cfg.logical_axis_rules if rule[0] == "activation_length"), None)
    if "context" not in ([length] if isinstance(length, str) else list(length or [])):
        raise ConfigError(f"{axes} = {context} but logical_axis_rules does not split activation_length over "
                          "'context' (every context device would compute the whole sequence); add "
                          "['activation_length', ['context']]")
    if cfg.max_target_length % context:
        raise ConfigError(f"max_target_length={cfg.max_target_length} does not split over the context axis of size "
                          f"{context}; change {axes} or max_target_length")
    block = sequence_block(cfg.quantization)
    if (cfg.max_target_length // context) % block:
        raise ConfigError(f"quantization={cfg.quantization}: each device's piece of a sequence holds "
                          f"{cfg.max_target_length // context} tokens (max_target_length / context = "
                          f"{cfg.max_target_length} / {context}) and TE's quantized copies block it by {block}; "
                          f"make max_target_length a multiple of {block * context} or change {axes}")
    if cfg.num_experts > 1 and nccl_ep_used(cfg, shape):
        raise ConfigError(f"moe_impl=te_dropless's NCCL EP exchange with context parallelism ({axes} = {context}) is "
                          "not built yet (TE's MeshResource takes the context axis as a replica); set "
                          "moe_dropless_fallback=layer (TE's router and grouped GEMMs, XLA's exchange) or "
                          "moe_impl=ragged")


def check_tensor_split(cfg, tensor: int) -> None:
    """Tensor parallelism splits heads, MLP widths and the vocabulary: each must divide evenly."""
    if tensor == 1:
        return
    heads = ("base_num_query_heads",) + (("base_num_kv_heads",) if cfg.attention_type == "mha" else ())
    for key in heads + ("base_mlp_dim", "base_moe_mlp_dim", "vocab_size"):
        if cfg[key] % tensor:
            raise ConfigError(f"{key}={cfg[key]} does not split over the tensor axis of size {tensor}; change "
                              "ici_tensor_parallelism/dcn_tensor_parallelism")


def check_batch(cfg, shape: dict, global_batch: int) -> None:
    """The global batch must split evenly over the data axes."""
    shards = math.prod(shape[a] for a in DATA_AXES)
    if global_batch % shards:
        raise ConfigError(
            f"per_device_batch_size={cfg.per_device_batch_size} gives a global batch of {global_batch}, which "
            f"does not split over the {shards} data shards (data x fsdp x expert); change per_device_batch_size")
    steps = cfg.gradient_accumulation_steps
    if (global_batch // shards) % steps:
        raise ConfigError(
            f"gradient_accumulation_steps={steps} must divide each data shard's {global_batch // shards} rows of the "
            f"global batch ({global_batch} over {shards} shards): every micro-batch splits over the same shards; "
            "change per_device_batch_size or gradient_accumulation_steps")
    parts = batch_parts(cfg)
    rows = global_batch // shards // steps
    if rows % parts:
        raise ConfigError(
            f"batch_split_factor={parts} must divide the {rows} sequences each device runs a step"
            f"{f' (micro-batch of {steps})' if steps > 1 else ''}: each part holds whole sequences of every device's "
            "batch; change per_device_batch_size or batch_split_factor")


def nccl_ep_used(cfg, mesh_shape) -> bool:
    """Whether te_dropless runs NCCL EP on a mesh of this shape: TE kernels with expert parallelism, or TE's fused
    MoE block (te_moe_block), which exchanges tokens through NCCL EP on any mesh. With moe_dropless_fallback the
    composed path exchanges over XLA's ragged all-to-all instead (NCCL EP takes one receive capacity per process:
    a bounded program and its worst-case fallback cannot share it), still with TE's router and grouped GEMMs."""
    te = cfg.moe_impl == "te_dropless" and cfg.te_kernels == "auto"
    if cfg.te_moe_block:
        return te
    return te and mesh_shape.get("expert", 1) > 1 and cfg.moe_dropless_fallback is None


def check_nccl_ep(cfg, mesh_shape) -> None:
    """What NCCL EP cannot take, refused in one line before anything is built (no-op when it is not used).

    TE's MeshResource names one data-parallel axis outside `expert` (ep.py `_ep_outer_axis`: a second one
    makes ep_dispatch's leading dim wrong), NCCL EP wants num_experts % 4 == 0, and
    get_moe_recv_capacity_per_rank raises for a receive capacity factor below 1; its dispatch takes a layer's
    tokens in one call (no num_moe_token_chunks)."""
    if not nccl_ep_used(cfg, mesh_shape):
        return
    outer = [a for a in ("data", "fsdp") if mesh_shape.get(a, 1) > 1]
    if len(outer) > 1:
        raise ConfigError(f"moe_impl=te_dropless with expert parallelism (NCCL EP) takes one data-parallel axis "
                          f"beside `expert`, the mesh has {' and '.join(f'{a}={mesh_shape[a]}' for a in outer)}; "
                          "set ici/dcn_data_parallelism=1 (use fsdp) or te_kernels=reference")
    if cfg.num_experts % 4:
        raise ConfigError(f"num_experts={cfg.num_experts}: NCCL EP lays out num_experts (local experts x expert "
                          "parallelism) in groups of 4 for its TMA copies (TE tests/jax/test_multi_process_ep.py); "
                          "use a multiple of 4 or te_kernels=reference")
    if cfg.ragged_buffer_factor is not None and cfg.ragged_buffer_factor < 1.0:
        raise ConfigError(f"ragged_buffer_factor={cfg.ragged_buffer_factor} is below 1, which NCCL EP's receive "
                          "buffer does not take (moe_impl=te_dropless with expert parallelism); set it >= 1 or null")
    if cfg.num_moe_token_chunks > 1:
        raise ConfigError(f"num_moe_token_chunks={cfg.num_moe_token_chunks}: NCCL EP dispatches a layer's tokens in "
                          "one call sized at bootstrap (moe_impl=te_dropless with expert parallelism); set it to 1 "
                          "(use_batch_split_schedule=true overlaps NCCL EP's exchange instead), or te_kernels=reference "
                          "/ moe_impl=ragged")
    if cfg.ep_two_hop:
        raise ConfigError("ep_two_hop=true: NCCL EP (moe_impl=te_dropless with TE's kernels and expert parallelism) "
                          "already crosses between nodes once per destination node; set ep_two_hop=false (it is "
                          "for the pure-JAX exchange: moe_impl=ragged, te_kernels=reference or moe_dropless_fallback)")
    if cfg.moe_dropless_fallback is not None:  # only te_moe_block gets here with one (nccl_ep_used)
        raise ConfigError(f"moe_dropless_fallback={cfg.moe_dropless_fallback}: TE's fused MoE block (te_moe_block=true) "
                          "exchanges over NCCL EP, bootstrapped once per process for one receive capacity (TE 2.20), so "
                          "a bounded program and its worst-case fallback cannot both run; set te_moe_block=false (the "
                          "composed te_dropless path takes a fallback, over XLA's exchange) or moe_dropless_fallback=null")
    if cfg.te_moe_block:
        devices = math.prod(mesh_shape.values())
        if devices < 2:
            raise ConfigError("te_moe_block=true runs TE's fused MoE block, whose NCCL EP exchange needs 2 GPUs or "
                              "more (TE's ep_bootstrap), and this mesh has 1; set te_moe_block=false (the composed "
                              "moe_impl=te_dropless path, the same TE router and grouped GEMMs)")
        if mesh_shape.get("tensor", 1) > 1:
            raise ConfigError(f"te_moe_block=true: TE's fused MoE block does not split the experts' width over "
                              f"`tensor` (each of the {mesh_shape['tensor']} tensor ranks would compute every expert's "
                              "whole FFN); set ici/dcn_tensor_parallelism=1 or te_moe_block=false (the composed path)")

"""Plan a run before renting the machines: `python -m MaxText.plan <config.yml> [key=value ...] [--json]`.

    python -m MaxText.plan --validate [--json]    # the step-time model against published runs
    python -m MaxText.plan <recipe.yml> --search [num_devices=N] [--json]   # the fastest layouts that fit
    python -m MaxText.plan <recipe.yml> --collectives=lowering.json   # FSDP/DP/TP times from the compiled step

--collectives takes MaxText.lowering's JSON for the same config (`python -m MaxText.lowering <recipe.yml> >
lowering.json`, minutes on a laptop for a 128-GPU recipe): the step-time model then times the collectives the
compiler put in the step, group by group, instead of its formulas (MaxText.planning.steptime.module_comm).

Nothing is allocated and no accelerator is needed: the parameters come from jax.eval_shape over the real
model, their per-device bytes from the shardings the trainer would give them (on an abstract mesh of
`num_devices`), and the activations from a per-token count of what the config's remat/offload policy keeps
(see `activation_bytes`). The verdict compares the per-device total with `hbm_gib`. With a `gpu_profile`, the
step-time model (MaxText.planning.steptime) adds seconds per step by term, tokens/s/GPU, TFLOP/s/GPU, MFU and the bound.

Shapes in names: T tokens per device, D embed, V vocabulary, R rows in a MoE expert buffer.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from MaxText.parallel import sharding
from MaxText.parallel.checks import nccl_ep_used
from MaxText.config.schema import QUANTIZATION_RECIPES, REMAT_TENSOR_NAMES
from MaxText.config.checks import attention_weights
from MaxText.config.errors import ConfigError
from MaxText.config.load import global_batch_size, layer_counts, with_buffer, worst_case_program
from MaxText.layers.attention_cudnn import max_segments
from MaxText.layers.moe import dense as dense_moe
from MaxText.layers.moe.ep import peer_capacity, worst_case_chunks
from MaxText.layers.moe.dispatch import aligned_buffer_rows
from MaxText.layers.moe.two_hop import hop_capacities
from MaxText.planning.flops import model_flops_per_token
from MaxText.step.state import state_spec
from MaxText.config.storage import shown_path
from MaxText.planning import steptime, validation
from MaxText.planning.params import parameter_counts

GIB = 2.0 ** 30
# Memory a step needs beyond what is counted here (XLA workspace, cuBLAS/NCCL buffers, fragmentation):
# a plan within this fraction of HBM "fits"; above it, up to 100%, it is "tight".
HEADROOM = 0.90
# How far the total here may be from what XLA will allocate (an assumption until measured on GPUs): the
# trainer refuses a run at start-up only when even the total less this fraction exceeds the device memory.
ESTIMATE_MARGIN = 0.25
# Usable HBM per GPU (GiB), as nvidia-smi reports it, for hbm_gib when the config does not set it.
KNOWN_HBM_GIB = {"H100": 79.6, "H200": 140.4, "B200": 178.4, "GB200": 184.0, "GB300": 277.0}


def abstract_mesh(shape: dict) -> AbstractMesh:
    axes = sharding.MESH_AXES
    return AbstractMesh(tuple(shape[a] for a in axes), axes, axis_types=(AxisType.Auto,) * len(axes))


def shard_bytes(shape, dtype, spec, mesh_shape: dict, skip=()) -> int:
    """Bytes of one device's shard of an array with PartitionSpec `spec` (padded shards round up); mesh
    axes in `skip` count as unsplit (an fsdp all-gather undoes them)."""
    dims = list(shape)
    for i, axes in enumerate(spec):
        split = math.prod(mesh_shape[a] for a in sharding.spec_axes(axes) if a not in skip)
        dims[i] = -(-dims[i] // split)
    return math.prod(dims) * np.dtype(dtype).itemsize


def _tree_bytes(tree, mesh_shape) -> int:
    return sum(shard_bytes(a.shape, a.dtype, a.sharding.spec, mesh_shape) for a in jax.tree.leaves(tree))


def state_bytes(cfg, spec, mesh_shape: dict) -> dict:
    """Per-device bytes of params, gradients (the params' shape, dtype and sharding), optimizer state and
    the MoE routing biases, exactly as state_spec shards them; and the largest layer's weights as the
    layer loop holds them (fsdp all-gathered, in the compute dtype; two with fsdp, which prefetches the
    next layer) with their gradient before it is reduce-scattered into the stacked gradients. `spec` is
    state_spec's on abstract_mesh(mesh_shape)."""
    params = _tree_bytes(spec.abstract["params"], mesh_shape)
    layer_weights = 0.0
    for stack, count in zip(("dense_layers", "moe_layers"), layer_counts(cfg)):
        if count:  # scanned ("layers", stacked on a leading axis) or unrolled ("layers_0", ...): all layers
            layers = spec.abstract["params"][stack]
            one = sum(shard_bytes(a.shape, a.dtype, a.sharding.spec, mesh_shape, skip=("fsdp", "context"))
                      for a in jax.tree.leaves(layers)) / count
            layer_weights = max(layer_weights, one)
    ratio = np.dtype(cfg.dtype).itemsize / np.dtype(cfg.weight_dtype).itemsize
    copies = 2 if mesh_shape["fsdp"] * mesh_shape["context"] > 1 else 1  # fsdp prefetches the next layer's gather
    return {
        "params": params,
        # under gradient accumulation the step's sum beside each micro-batch's gradients
        "gradients": params * (2 if cfg.gradient_accumulation_steps > 1 else 1),
        "optimizer": _tree_bytes(spec.abstract["opt_state"], mesh_shape),
        "moe_bias": _tree_bytes(spec.abstract.get("nnx_aux", {}), mesh_shape),
        "layer_weights": layer_weights * (copies * ratio + 1),
    }


# ------------------------------------------------------------------------------------ activation estimate

class LayerTensors(NamedTuple):
    named: dict       # checkpoint name -> bytes per device (what a remat policy may save or offload)
    other: float      # the block's other forward intermediates its backward reads (recomputed under remat)
    working: float    # the largest short-lived set inside the block (attention scores, a buffer's cotangent)

    def __add__(self, o):
        return LayerTensors(self.named | o.named, self.other + o.other, max(self.working, o.working))

    @property
    def residuals(self):
        return sum(self.named.values()) + self.other


def with_te_dense_copies(cfg, block: LayerTensors, t: int, tp: int, widths) -> LayerTensors:
    """block plus the FP8 copies TE's dense() makes for `quantization` in its GEMMs of these (input, output)
    widths (each weight gathered, DenseGemms._weight): in the forward each GEMM's input and weight, kept for its
    backward; in the backward the output's cotangent, beside the block's working set. Split over the tensor
    axis as the widths are (taken as even)."""
    q = TE_FP8_BYTES.get(QUANTIZATION_RECIPES.get(cfg.quantization))
    if not q:
        return block
    return LayerTensors(block.named, block.other + q * sum(t * i + i * o for i, o in widths) / tp,
                        block.working + q * sum(t * o for _, o in widths) / tp)


def _attention(cfg, t: int, b: int, tp: int, a: int, cp: int = 1) -> LayerTensors:
    """One attention block on a device with t tokens of b sequences (each split in cp pieces over the context axis:
    t = b L / cp queries; the keys and values, or MLA's latent, gathered whole: b L of them)."""
    d, h, length = cfg.base_emb_dim, cfg.base_num_query_heads // tp, cfg.max_target_length
    whole = b * length  # the keys' tokens: every sequence's whole length
    queries = length // cp  # a device's query rows per sequence
    if cfg.attention_type == "mla":
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        # keys and values expand from the gathered latent: b L of them on each device under context parallelism
        named = {"mla_q": t * cfg.q_lora_rank * a, "mla_kv": t * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * a,
                 "query_proj": t * h * qk * a, "key_proj": whole * h * qk * a, "value_proj": whole * h * v * a}
        # the normed low-rank inputs of the up-projections (the kv latent gathered whole)
        other = t * cfg.q_lora_rank * a + whole * cfg.kv_lora_rank * a
        out_width = h * v
        gathered = h * (qk + v)  # per key token: the cotangents of the whole keys and values in the backward
    else:
        n, k = max(cfg.base_num_kv_heads // tp, 1), cfg.head_dim
        named = {"query_proj": t * h * k * a, "key_proj": t * n * k * a, "value_proj": t * n * k * a}
        other = t * (h + n) * k * a  # q and k after RoPE
        if cp > 1:  # the keys and values gathered whole, which attention keeps for its backward
            other += 2 * whole * n * k * a
        out_width = h * k
        gathered = 2 * n * k
    named["out_proj"] = t * d * a
    other += t * out_width * a + t * d * a  # the context before the output projection, the block's norm
    # float32 scores and softmax, probabilities in the compute dtype: whole, the probabilities are kept for
    # the backward; chunked, one chunk of them exists at a time and is recomputed there. cudnn_flash holds no
    # scores, but XLA reserves its chunked fallback's whether or not it runs (attention_cudnn.py).
    if cfg.attention == "dot_product":
        other += b * h * queries * length * a
        working = b * h * queries * length * 2 * 4
    else:
        working = b * h * min(cfg.attention_chunk_size, queries) * length * (2 * 4 + a)
    if cp > 1:  # the whole keys' and values' cotangents (MLA: expanded), before they are summed over the axis
        working += whole * gathered * a
    if cfg.attention == "cudnn_flash":
        # the kernel's float32 softmax statistics [B * M, H, L] (under context parallelism, of a device's query rows,
        # and [B, H, rows] twice more for the first document's merged calls); MLA's V zero-padded to the q/k head dim
        # for the packed call; under context parallelism the merged call's whole keys and values copied rolled
        other += b * max_segments(queries) * h * queries * 4 + (2 * b * h * queries * 4 if cp > 1 else 0)
        if cfg.attention_type == "mla" and qk > v:
            other += t * h * qk * a
        if cp > 1:
            working += whole * (h * (qk + v) if cfg.attention_type == "mla" else 2 * n * k) * a
    projections = [w.widths for w in attention_weights(cfg).values() for _ in range(w.count)]
    return with_te_dense_copies(cfg, LayerTensors(named, other, working), t, tp, projections)


def _mlp(cfg, t: int, tp: int, a: int, width: int) -> LayerTensors:
    d, f = cfg.base_emb_dim, width // tp
    # mlpwo is not among them: its output only joins the residual stream, which no backward reads.
    named = {"mlpwi_0": t * f * a, "mlpwi_1": t * f * a}
    block = LayerTensors(named, t * f * a + t * d * a, 2 * t * f * a)  # silu(gate) * up, the norm
    return with_te_dense_copies(cfg, block, t, tp, [(d, width), (d, width), (width, d)])


def dispatch_rows(cfg, t: int, ep: int) -> int:
    """Rows one device receives from the expert-parallel dispatch: NCCL EP (te_dropless with TE's kernels)
    delivers one per slot in its expert-aligned buffer (moe_rows); ep.py ep peers x its per-peer row capacity."""
    if nccl_ep_used(cfg, {"expert": ep}):
        return moe_rows(cfg, t, ep)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    node = two_hop_node(cfg, ep)
    if node:  # both hops' receive buffers: a row per (token, slice), then per (row, device)
        first, second = hop_capacities(t, k, e, e // ep, node, cfg.ragged_buffer_factor)
        return (ep // node) * first.rows + node * second.rows
    return ep * peer_capacity(t, k, e, e // ep, cfg.ragged_buffer_factor, cfg.ep_dedup).rows


def two_hop_node(cfg, ep: int) -> int:
    """ep_two_hop's devices of the expert axis per slice (dropless.dispatcher), 0 where the exchange is not two_hop.py's."""
    if not cfg.ep_two_hop or ep == 1 or nccl_ep_used(cfg, {"expert": ep}):
        return 0
    return ep // cfg.dcn_expert_parallelism


def moe_rows(cfg, t: int, ep: int) -> int:
    """Rows of one device's expert buffer (the grouped GEMMs' input): the static shapes each moe_impl allocates."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if cfg.moe_impl == "dense":  # [E, G, C] over all E experts: split over `expert`, the batch G is gathered
        s = cfg.max_target_length  # by as much, so a device holds E x (its G) x C rows whatever the EP size
        return (t // s) * e * dense_moe.capacity(s, e, k, cfg.capacity_factor)
    # Under EP: the slots the peers may send (NCCL EP's receive capacity alike), however many rows carry them.
    rows = t * k if ep == 1 else ep * peer_capacity(t, k, e, e // ep, cfg.ragged_buffer_factor).slots
    node = two_hop_node(cfg, ep)
    if node:  # the relays of the device's slice may send it so many
        rows = node * hop_capacities(t, k, e, e // ep, node, cfg.ragged_buffer_factor)[1].slots
    return aligned_buffer_rows(rows, e // ep) if cfg.moe_impl == "te_dropless" else rows


# Bytes per element of a Transformer Engine FP8 copy, both layouts (TE keeps a row-wise and a column-wise copy
# of each GEMM operand: MXFP8 and NVFP4 always, tensor-scaled FP8 on Hopper, whose FP8 GEMM takes only the NT
# layout): 1 byte each, plus MXFP8's one E8M0 scale per 32 elements; NVFP4 half a byte and one E4M3 scale per 16.
TE_FP8_BYTES = {"fp8_current": 2.0, "mxfp8": 2 * (1 + 1 / 32), "nvfp4": 2 * (0.5 + 1 / 16),
                "nvfp4_no_rht": 2 * (0.5 + 1 / 16)}


def te_quantized_bytes(cfg, r: int, ep: int, tp: int) -> dict:
    """One MoE layer's FP8 copies in TE's quantized grouped GEMMs (moe_impl=te_dropless): "forward", what the
    three GEMMs quantize and keep for their backward (the buffer twice, for wi_0 and wi_1, the [R, F] hidden
    once, the local experts' three weights), and "backward", the cotangents they quantize there."""
    q = TE_FP8_BYTES.get(cfg.te_gmm_quantization) if cfg.moe_impl == "te_dropless" else None
    if not q:
        return {"forward": 0, "backward": 0}
    d, f, local = cfg.base_emb_dim, cfg.base_moe_mlp_dim // tp, cfg.num_experts // ep
    return {"forward": q * (2 * r * d + r * f + 3 * local * d * f), "backward": q * (2 * r * f + r * d)}


def _moe(cfg, t: int, tp: int, ep: int, a: int) -> LayerTensors:
    d, k, f = cfg.base_emb_dim, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim // tp
    r = moe_rows(cfg, t, ep)
    named = {"moe_mlpwi_0": r * f * a, "moe_mlpwi_1": r * f * a, "moe_mlpwo": r * d * a}
    # router scores (float32), the K copies of each token going out and coming back, the buffer in
    # expert order (under expert parallelism: the rows dispatch delivered, `moe_dispatch`), silu(gate) * up,
    # the norm
    other = 3 * t * cfg.num_experts * 4 + 2 * t * k * d * a + r * f * a + t * d * a
    if ep > 1 and cfg.moe_impl != "dense":
        named["moe_dispatch"] = dispatch_rows(cfg, t, ep) * d * a
    else:
        other += r * d * a
    if cfg.moe_impl == "dense":  # float32 one-hot dispatch and combine tensors [T, E, C]
        other += 2 * r * cfg.max_target_length * 4
    working = 2 * r * d * a
    fp8 = te_quantized_bytes(cfg, r, ep, tp)
    block = LayerTensors(named, other + fp8["forward"], working + fp8["backward"])
    if cfg.shared_experts:
        # DeepSeek's shared experts are an MLP beside the routed ones (their tensors carry the mlp* names)
        block = block + _mlp(cfg, t, tp, a, cfg.shared_experts * cfg.base_moe_mlp_dim)
    return block


def worst_branch_bytes(cfg, moe_layer: LayerTensors, t: int, tp: int, ep: int, a: int) -> int:
    """moe_dropless_fallback=layer: the most a MoE layer holds while its worst-case branch runs backward: the layer's
    own tensors (lax.cond keeps the bounded branch's residuals) and one worst-case chunk's, recomputed
    (dropless.moe_ffn: the chunks one at a time, ep.worst_case_chunks of them)."""
    e = cfg.num_experts
    chunks = cfg.num_moe_token_chunks
    many = worst_case_chunks(t, chunks, cfg.num_experts_per_tok, e, e // ep, cfg.ragged_buffer_factor)
    chunk = _moe(with_buffer(cfg, None), -(-t // many), tp, ep, a)
    return moe_layer.residuals + moe_layer.working + chunk.residuals + chunk.working


def layer_tensors(cfg, moe: bool, t: int, b: int, tp: int, ep: int, a: int, cp: int = 1) -> LayerTensors:
    ffn = _moe(cfg, t, tp, ep, a) if moe else _mlp(cfg, t, tp, a, cfg.base_mlp_dim)
    return _attention(cfg, t, b, tp, a, cp) + ffn


def kept_names(cfg) -> tuple[set, set]:
    """(names kept in HBM, names offloaded to host) under cfg's remat policy."""
    if cfg.remat_policy in ("none", "minimal"):
        return set(REMAT_TENSOR_NAMES), set()
    if cfg.remat_policy == "full":
        return set(), set()
    return ({n for n in REMAT_TENSOR_NAMES if cfg[n] == "device"},
            {n for n in REMAT_TENSOR_NAMES if cfg[n] == "offload"})


def activation_bytes(cfg, mesh_shape: dict, num_devices: int) -> dict:
    """Per-device activation bytes of one train step: what the forward keeps for the backward (layer
    inputs, the tensors the remat policy saves, the float32 logits), and the largest transient set (one
    layer recomputed with its gradients, or the loss's softmax and its gradient). Offloaded tensors are
    counted in host memory instead."""
    batch = global_batch_size(cfg, num_devices)
    shards = math.prod(mesh_shape[x] for x in sharding.DATA_AXES)
    b = -(-batch // shards) // cfg.gradient_accumulation_steps  # one micro-batch is live at a time
    cp, tp, ep = mesh_shape["context"], mesh_shape["tensor"], mesh_shape["expert"]
    t = b * cfg.max_target_length // cp  # each of the b sequences split over the context axis
    a = np.dtype(cfg.dtype).itemsize
    moe = cfg.num_experts > 1
    num_dense, num_moe = layer_counts(cfg)
    kinds = [(num_dense, layer_tensors(cfg, False, t, b, tp, ep, a, cp))]
    kinds.append((num_moe + cfg.mtp_num_layers, layer_tensors(cfg, moe, t, b, tp, ep, a, cp)))
    kinds = [(n, lt) for n, lt in kinds if n]
    keep, offload = kept_names(cfg)
    saved = host = 0
    for count, lt in kinds:
        if cfg.remat_policy == "none":
            saved += count * lt.residuals
        else:
            saved += count * (t * cfg.base_emb_dim * a + sum(v for n, v in lt.named.items() if n in keep))
        host += count * sum(v for n, v in lt.named.items() if n in offload)
    # The backward of a rematerialised layer first rebuilds everything its backward reads, then works
    # through it block by block; without remat those residuals are already in `saved`.
    layer = max((0 if cfg.remat_policy == "none" else lt.residuals) + lt.working for _, lt in kinds)
    if cfg.moe_dropless_fallback == "layer" and moe and ep > 1:
        layer = max(layer, worst_branch_bytes(cfg, kinds[-1][1], t, tp, ep, a))
    # float32 logits of the main head and each MTP depth: kept for the backward, or with
    # num_vocab_tiling one tile at a time (recomputed in the backward)
    heads = 1 + cfg.mtp_num_layers
    logits = t * (cfg.vocab_size // tp) * 4
    tiles = cfg.num_vocab_tiling
    kept_logits = heads * logits if tiles == 1 else 0
    inputs = 5 * t * 4 + heads * 2 * t * cfg.base_emb_dim * a  # the batch; embeddings and final norms
    fp8 = te_quantized_bytes(cfg, moe_rows(cfg, t, ep), ep, tp) if moe else {"forward": 0, "backward": 0}
    return {"saved": saved + kept_logits + inputs, "transient": max(layer, 2 * logits / tiles),
            "host_offload": host, "tokens_per_device": t, "te_fp8_per_moe_layer": fp8["forward"] + fp8["backward"]}


# ------------------------------------------------------------------------------------------------ the plan

def default_hbm_gib():
    """The local accelerator's memory (GiB), or None on a CPU-only machine."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] / GIB
    return next((g for name, g in KNOWN_HBM_GIB.items() if name in device.device_kind), None)


def host_memory_gib() -> float | None:
    """This host's physical memory (GiB), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def planned_devices(cfg) -> int:
    """num_devices; else the product of the parallelism sizes when none is -1; else the visible devices."""
    if cfg.num_devices:
        return cfg.num_devices
    sizes = [cfg[f"{g}_{a}_parallelism"] for g in ("ici", "dcn") for a in sharding.MESH_AXES]
    if all(s not in (None, -1) for s in sizes):
        return math.prod(sizes)
    return jax.device_count()


def device_bytes(cfg, spec, mesh_shape: dict, num_devices: int) -> tuple[dict, dict]:
    """(state_bytes with "activations" added, activation_bytes): what one device holds during a step."""
    memory = state_bytes(cfg, spec, mesh_shape)
    acts = activation_bytes(cfg, mesh_shape, num_devices)
    memory["activations"] = acts["saved"] + acts["transient"]
    return memory, acts


def fallback_bytes(cfg, spec, mesh_shape: dict, num_devices: int) -> dict | None:
    """moe_dropless_fallback=step: device_bytes of the program that reruns an overflowing step (worst-case buffers,
    remat_policy=full), which must fit too; None otherwise."""
    if cfg.moe_dropless_fallback != "step":
        return None
    return device_bytes(worst_case_program(cfg), spec, mesh_shape, num_devices)[0]


def check_fits(cfg, spec, mesh_shape: dict, num_devices: int, log) -> None:
    """The trainer's start-up check against the local device's memory, else hbm_gib, else on CPU the host's memory
    shared by its CPU devices.
    ConfigError with the estimate and the limit when even the estimate less ESTIMATE_MARGIN does not fit (XLA
    would fail or hang allocating); a warning line when the estimate alone exceeds HEADROOM of it."""
    hbm, has = default_hbm_gib() or cfg.hbm_gib, "a device has"
    if not hbm and jax.devices()[0].platform == "cpu":  # CPU devices share the host's memory
        host, local = host_memory_gib(), jax.local_device_count()
        hbm, has = (host / local if host else None), f"this host's {host:.3g} GiB over {local} CPU devices gives each"
    if not hbm:
        return
    memory = device_bytes(cfg, spec, mesh_shape, num_devices)[0]
    rerun = fallback_bytes(cfg, spec, mesh_shape, num_devices)
    if rerun and sum(rerun.values()) > sum(memory.values()):  # the larger of the two programs must fit
        memory = rerun
    total, limit = sum(memory.values()), hbm * GIB
    state = memory["params"] + memory["gradients"] + memory["optimizer"]
    parts = f"params, gradients and optimizer {state / GIB:.3g}, activations {memory['activations'] / GIB:.3g}"
    if total * (1 - ESTIMATE_MARGIN) > limit:
        raise ConfigError(
            f"this run needs about {total / GIB:.3g} GiB per device ({parts}) and {has} {hbm:.3g} GiB "
            f"(even {ESTIMATE_MARGIN:.0%} less would not fit); lower per_device_batch_size, spread the model over "
            "more devices or offload more (python -m MaxText.plan with the same arguments shows the parts)")
    if total > limit * HEADROOM:
        log(f"warning: this run needs about {total / GIB:.3g} GiB per device ({parts}) of {hbm:.3g} GiB; it may "
            "not fit (python -m MaxText.plan shows the parts)")


def plan(cfg, hbm_gib: float | None = None, collectives: list[dict] | None = None) -> dict:
    """Everything the console table and --json show, in bytes per device unless named otherwise; the verdict
    against hbm_gib, else cfg.hbm_gib, else the local device's memory. `collectives`: a lowering's
    collectives.by_group, which the step-time model then uses."""
    num_devices = planned_devices(cfg)
    mesh_shape = sharding.mesh_shape(cfg, num_devices)
    spec = state_spec(cfg, abstract_mesh(mesh_shape))  # traces the model once, for counts and bytes
    counts = parameter_counts(cfg, spec.abstract["params"])
    memory, acts = device_bytes(cfg, spec, mesh_shape, num_devices)
    device_total = sum(memory.values())
    rerun = fallback_bytes(cfg, spec, mesh_shape, num_devices)
    rerun_total = sum(rerun.values()) if rerun else 0
    hbm = hbm_gib or cfg.hbm_gib or default_hbm_gib()
    verdict = None
    if hbm:
        use = max(device_total, rerun_total) / (hbm * GIB)
        verdict = "fits" if use <= HEADROOM else ("tight" if use <= 1.0 else "does not fit")
    return {
        "num_devices": num_devices,
        "mesh": {a: mesh_shape[a] for a in sharding.MESH_AXES},
        "global_batch": global_batch_size(cfg, num_devices),
        "tokens_per_device": acts["tokens_per_device"],
        "params_total": counts.total,
        "params_mtp": counts.mtp,
        "params_active": counts.active,
        "params_active_mtp": counts.mtp_active,
        "flops_per_token": model_flops_per_token(cfg),
        "bytes": memory | {"total": device_total},
        "fallback_program_bytes": rerun and rerun | {"total": rerun_total},
        "activation_detail": {k: acts[k] for k in ("saved", "transient", "te_fp8_per_moe_layer")},
        "fsdp_gather_dtype": cfg.dtype,  # layers are gathered in the compute dtype, gradients reduced in weight_dtype
        "host_offload_bytes": acts["host_offload"],
        "hbm_gib": hbm,
        "verdict": verdict,
        "step_time": modelled_step(cfg, mesh_shape, num_devices, counts.total, acts["host_offload"], collectives),
    }


def modelled_step(cfg, mesh_shape: dict, num_devices: int, total_params: float, offload_bytes: float,
                  collectives: list[dict] | None = None) -> dict | None:
    """MaxText.planning.steptime for this config on its gpu_profile's hardware (None without a profile); with a
    lowering's collectives.by_group, its FSDP, DP and TP collectives instead of the formulas'."""
    if cfg.gpu_profile not in steptime.PROFILE_HARDWARE:
        return None
    hw = steptime.HARDWARE[steptime.PROFILE_HARDWARE[cfg.gpu_profile]]
    layout = steptime.layout_from_config(cfg, mesh_shape, num_devices, offload_bytes)
    comm = None if collectives is None else steptime.module_comm(cfg, mesh_shape, collectives, hw)
    got = steptime.step_time(steptime.Model.from_config(cfg, total_params), layout, hw, comm)
    tflops = model_flops_per_token(cfg) * got["tokens_per_s_per_gpu"] / 1e12
    return got | {"hardware": hw.name, "tflops_per_gpu": tflops, "mfu": tflops / hw.bf16_tflops,
                  "collectives_from": "formulas" if collectives is None else "compiled module"}


def read_collectives(path: str) -> list[dict]:
    """collectives.by_group of MaxText.lowering's JSON output at path (ConfigError naming the file otherwise)."""
    try:
        with open(path) as f:
            text = f.read().strip().splitlines()
        by_group = json.loads(text[-1])["collectives"]["by_group"]
    except (OSError, IndexError, ValueError, KeyError, TypeError, RecursionError) as e:
        # an OSError's own text repeats the file's name (which may be long): its strerror alone
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"--collectives={shown_path(path)}: not the JSON of `python -m MaxText.lowering <config> > "
                          f"FILE` with collectives counted ({type(e).__name__}: {reason})") from None
    return by_group


def format_table(p: dict) -> str:
    """The console view of plan()."""
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items() if n > 1) or "one device"
    lines = [
        f"devices            {p['num_devices']}  ({mesh})",
        f"global batch       {p['global_batch']} sequences, {p['tokens_per_device']} tokens per device",
        f"parameters         {p['params_total'] / 1e9:.2f}B total"
        + (f" ({(p['params_total'] - p['params_mtp']) / 1e9:.2f}B without MTP)" if p["params_mtp"] else ""),
        f"active per token   {p['params_active'] / 1e9:.2f}B"
        + (f" ({(p['params_active'] + p['params_active_mtp']) / 1e9:.2f}B with MTP)" if p["params_mtp"] else ""),
        f"model FLOPs/token  {p['flops_per_token'] / 1e9:.2f} GFLOP (forward + backward)",
        "",
        f"{'per device':<18} {'GiB':>10}",
    ]
    for name, value in p["bytes"].items():
        if name == "total":
            lines.append("-" * 29)
        lines.append(f"{name:<18} {value / GIB:>10.2f}")
    if p["host_offload_bytes"]:
        lines.append(f"{'host (offloaded)':<18} {p['host_offload_bytes'] / GIB:>10.2f}")
    if p["activation_detail"]["te_fp8_per_moe_layer"]:
        lines.append(f"(activations include TE's FP8 copies in one MoE layer: "
                     f"{p['activation_detail']['te_fp8_per_moe_layer'] / GIB:.2f} GiB)")
    rerun = p["fallback_program_bytes"]
    if rerun:
        lines.append(f"{'step rerun program':<18} {rerun['total'] / GIB:>10.2f}  (moe_dropless_fallback=step: worst-case "
                     f"buffers, remat full; activations {rerun['activations'] / GIB:.2f})")
    if p["verdict"]:
        use = max(p["bytes"]["total"], rerun["total"] if rerun else 0) / (p["hbm_gib"] * GIB)
        lines.append(f"\nverdict: {p['verdict']} in {p['hbm_gib']:g} GiB HBM ({use:.0%} used; "
                     f"'fits' leaves {1 - HEADROOM:.0%} for XLA workspace and communication buffers)")
    else:
        lines.append("\nverdict: none (no accelerator here); set hbm_gib=G, e.g. "
                     + ", ".join(f"{k} {v:g}" for k, v in KNOWN_HBM_GIB.items()))
    st = p["step_time"]
    if st is None:
        lines.append("\nstep time: set gpu_profile (" + ", ".join(steptime.PROFILE_HARDWARE) + ") for the model's")
        return "\n".join(lines)
    lines += ["", f"step time (MaxText.planning.steptime on {st['hardware']}; collectives from the {st['collectives_from']})"
                  f"      s"]
    for name, value in st["compute_s"].items():
        lines.append(f"  {name:<20} {value:>10.2f}")
    for name, value in st["comm_s"].items():
        share = st["overlap"].get(name)
        lines.append(f"  {name + ' comm':<20} {value:>10.2f}" + (f"   ({share:.0%} under compute)" if share else ""))
        if name == "ep" and st.get("ep_overlap"):
            lines.append(f"    hidden: {st['ep_overlap']}")
    lines.append(f"  {'exposed comm':<20} {st['exposed_comm_s']:>10.2f}")
    if st["fallback_s"]:
        what = "steps rerun worst-case" if p["fallback_program_bytes"] else "MoE layer calls worst-case"
        lines.append(f"  {'dropless fallback':<20} {st['fallback_s']:>10.2f}   (dropless_fallback_rate: "
                     f"{st['fallback_rate']:.1%} of {what})")
    lines.append(f"step {st['step_s']:.2f} s: {st['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
                 f"{st['tflops_per_gpu']:.0f} TFLOP/s/GPU, MFU {st['mfu']:.0%} of bf16 peak; bound by {st['bound']}")
    return "\n".join(lines)


def format_validation(rows: list[dict]) -> str:
    """The console view of validation.validate()."""
    lines = [f"{'published run':<50}{'tokens/s/GPU':>13}{'model':>8}{'error':>8}  bound",
             *(f"{r['run']:<50}{r['published']:>13.0f}{r['model']:>8.0f}{r['error']:>+8.0%}  {r['bound']}"
               for r in rows),
             f"goal: within {validation.VALIDATION_GOAL:.0%} of each; sources:",
             *(f"  {r['run']}: {r['source']}" for r in rows)]
    return "\n".join(lines)

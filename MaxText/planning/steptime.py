"""Step-time model: how long a training step takes on a GPU cluster, from FLOPs, bytes and the links they cross.

    python -m MaxText.plan <recipe.yml> [key=value ...]     # the plan's step-time section (needs gpu_profile)
    python -m MaxText.plan --validate                        # the model against published runs

Per step and per GPU (work spreads evenly: tokens over data parallelism, layers over pipeline stages, heads and
hidden units over tensor parallelism, experts over expert parallelism):

  compute   GEMM FLOPs (dense and grouped apart) at a fraction of the GEMM precision's dense peak; attention's
            score and value products at a fraction of the bf16 peak (a fused flash kernel, or XLA's unfused
            attention); recomputed forward work included; memory-bound work (the MoE's permutes, activation
            and FP8 casts, the optimizer update) at HBM bandwidth.
  comm      each collective's bytes over the slowest link its group crosses: NVLink inside an NVLink domain,
            the GPU's scale-out NIC across domains. EP all-to-all with the rows the dispatch really sends (one
            per token and destination GPU, or per destination node where the dispatch forwards inside the node
            over NVLink), TP all-reduces, FSDP all-gathers and reduce-scatters (the volumes this trainer's
            compiled step has: fsdp_collective_bytes, held to the module by tests/test_collectives.py),
            data-parallel gradient reduction, context parallelism's all-gathers of each layer's keys and values
            (MLA: its latent; each device then computes MLA's key/value up-projection for the whole sequence),
            the all-reduce of their cotangents and the load balance's permutes of queries and outputs,
            host offload over PCIe / NVLink-C2C. Given a lowering's
            collectives (module_comm), the module's own FSDP, DP and TP groups replace those formulas.
  overlap   each collective kind runs a stated fraction under compute (OVERLAP, EP_OVERLAP: assumptions per
            mechanism, the same in every case, never tuned per case); this trainer's EP exchange, the fraction
            its schedule allows (ep_hidden_fraction); the rest is exposed, and so is any overlapped
            communication beyond the compute time.
  pipeline  a (pp - 1) / (microbatches x virtual stages) bubble on top (DualPipe: half of it).

The step is bounded by whichever of compute or a collective kind takes longest. The constants below were set
once, for all of MaxText.planning.validation's published runs together; `plan --validate` prints each published
figure beside the model's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from MaxText.config.schema import MESH_AXES
from MaxText.config.load import batch_parts, global_batch_size, layer_counts
from MaxText.layers.attention import balanced, context_share
from MaxText.parallel.checks import nccl_ep_used
from MaxText.planning.flops import attention_core_flops_per_token, model_flops_per_token, quantizable_flops_per_token


class Hardware(NamedTuple):
    """One GPU of a system: dense peaks (no sparsity), bandwidths per direction."""
    name: str
    bf16_tflops: float
    fp8_tflops: float
    fp4_tflops: float      # NVFP4 (Blackwell); 0: none (Hopper)
    hbm_tbps: float
    nvlink_gbps: float     # per GPU, per direction
    nvlink_domain: int     # GPUs one NVLink fabric joins
    nic_gbps: float        # scale-out per GPU, per direction (400 Gb/s = 50 GB/s)
    host_gbps: float       # host link per GPU, per direction
    source: str


# Sources: NVIDIA datasheets (H100/H200 "with sparsity" figures halved; FP4: B200 18 PF, GB200 NVL72 1440 PF over 72
# GPUs, both with sparsity, halved; GB300 NVL72 1080 PF dense over 72), DeepSeek's ISCA paper for the H800
# (arXiv 2505.09343: NVLink 400 GB/s, one 400G CX7 per GPU), the Megatron-LM GB200 note (900 GB/s per
# direction on NVL72), NVIDIA's GB300 reference architecture (ConnectX-8). The host links are nominal
# (PCIe Gen5 x16: 64 GB/s a direction; NVLink-C2C taken as 900 GB/s shared by a Grace and two GPUs: unsourced).
HARDWARE = {h.name: h for h in (
    Hardware("h100", 989, 1979, 0, 3.35, 450, 8, 50, 64, "H100 SXM datasheet; DGX H100: 8x CX-7 400G"),
    Hardware("h800", 989, 1979, 0, 3.35, 200, 8, 50, 64, "Hopper compute as H100; NVLink 400 GB/s, CX7 400G"),
    Hardware("h200", 989, 1979, 0, 4.8, 450, 8, 50, 64, "H200 SXM datasheet: H100 compute, 4.8 TB/s"),
    Hardware("b200", 2250, 4500, 9000, 8.0, 900, 8, 50, 64, "HGX B200: 2.25/4.5/9 PF dense, NVLink 5, CX-7 400G"),
    Hardware("gb200", 2500, 5000, 10000, 8.0, 900, 72, 50, 450,
             "GB200 NVL72: 2.5/5/10 PF dense, 900 GB/s per direction"),
    Hardware("gb300", 2500, 5000, 15000, 8.0, 900, 72, 100, 450, "GB300 NVL72: as GB200 for bf16/fp8, FP4 15 PF dense, "
             "CX-8 800G"),
)}
# gpu_profile (MaxText.config.hardware) -> HARDWARE, and its NVLink domain
PROFILE_HARDWARE = {"h100-sxm": "h100", "h200-sxm": "h200", "gb200-nvl72": "gb200", "gb300-nvl72": "gb300"}
GPU_DOMAIN = {profile: HARDWARE[name].nvlink_domain for profile, name in PROFILE_HARDWARE.items()}

# Fractions of peak reached, set once for every case.
GEMM_EFFICIENCY = 0.55          # large dense GEMMs (cuBLAS), of the precision's dense peak
GROUPED_GEMM_EFFICIENCY = 0.45  # expert grouped GEMMs (skewed group sizes, smaller per-expert shapes)
# FP8 GEMMs (current scaling, MXFP8) reach this fraction of bf16's efficiency against their 2x peak: quantizing
# the inputs and the scales cost what the faster math saves elsewhere (Megatron-Bridge 25.11, GB300, same
# layout: FP8-MX 4357 tokens/s/GPU against BF16 3848, 1.13x end to end).
FP8_GEMM_FACTOR = 0.65
# NVFP4 GEMMs are taken to reach the same fraction of their (4x bf16) peak: unvalidated, no published NVFP4 run of a
# DeepSeek-V3-class model gives an end-to-end figure to set it from (its Hadamard transform and second quantization
# pass may cost more than FP8's casts).
FP4_GEMM_FACTOR = FP8_GEMM_FACTOR
ATTENTION_EFFICIENCY = {"flash": 0.40, "xla": 0.12}  # fused flash kernel vs XLA's materialised scores (bf16)
HBM_EFFICIENCY = 0.70
COLLECTIVE_EFFICIENCY = 0.70    # ring all-gather / reduce-scatter / all-reduce, of the link bandwidth
ALL_TO_ALL_EFFICIENCY = 0.50    # all-to-all: many peers, smaller messages
# Fraction of each kind's time that runs under compute: XLA's latency-hiding scheduler (and Megatron's bucketed
# overlap) hide gradient reduction, FSDP gathers and host transfers behind other layers' compute; tensor-parallel
# all-reduces sit on the critical path.
# Context parallelism's key/value gathers sit on the critical path too: a layer's attention waits for its own.
OVERLAP = {"fsdp": 0.9, "dp": 0.9, "tp": 0.0, "cp": 0.0, "offload": 0.9}
# The MoE all-to-all's overlap depends on the mechanism: none (XLA, whose grouped GEMMs wait for it; TE's NCCL
# EP on its own stream), partial (Megatron-Core's 1F1B A2A overlap), full (DeepSeek's DualPipe).
EP_OVERLAP = {"none": 0.0, "partial": 0.5, "full": 1.0}
# Full overlap runs the all-to-all in kernels that hold SMs: DeepSeek-V3 kept 20 of the H800's 132 SMs for
# communication (report section 3.2.2), so compute runs on the rest. This trainer's hidden exchange (chunks, a split
# batch) is charged the same share for the time it runs under compute (NCCL's and NCCL EP's kernels hold SMs too).
FULL_OVERLAP_SM_SHARE = 20 / 132
OPTIMIZER_BYTES_PER_PARAM = 28  # AdamW: read param, grad, two moments (fp32), write param and moments


class Layout(NamedTuple):
    """How a run spreads over the GPUs, and what its kernels and collectives do."""
    devices: int
    seq: int
    global_batch: int               # sequences per step
    tp: int = 1
    pp: int = 1
    vp: int = 1                     # virtual pipeline stages per GPU
    ep: int = 1
    cp: int = 1                     # context parallelism: each sequence split over cp GPUs (keys/values gathered)
    cp_local: int = 0               # members of a context group inside one NVLink domain (0: the whole group)
    fsdp: int = 1                   # expert weights' shards gathered before use (this trainer's fsdp axes)
    fsdp_dense: int = 0             # dense weights' shards gathered before use (0: as fsdp; here fsdp x expert)
    fsdp_local: int = 0             # members of an FSDP group inside one NVLink domain (0: the whole group)
    fsdp_dense_local: int = 0       # the same for the dense weights' group
    micro_batch: int = 1
    gemm_precision: str = "bf16"    # bf16 | fp8 | fp4 (the GEMMs' inputs; fp8 covers MXFP8, fp4 NVFP4)
    grouped_precision: str = ""     # the expert GEMMs' precision where it differs ("": gemm_precision)
    dense_precision: str = ""       # the quantizable dense GEMMs' (attention projections, dense MLPs, shared
                                    # experts: upstream's `quantization`) where it differs ("": gemm_precision)
    dispatch_bytes: float = 2.0     # per element of a dispatched token (FP8 dispatch: 1)
    dispatch_per: str = "gpu"       # the EP dispatch sends one row per (token, destination): slot | gpu | node
    ep_overlap: str = "none"        # EP_OVERLAP
    ep_slices: int = 1              # this trainer's MoE tokens in slices, each with its own exchanges
                                    # (num_moe_token_chunks): ep_hidden_fraction
    batch_parts: int = 1            # the batch in parts running each layer side by side (use_batch_split_schedule)
    dualpipe: bool = False          # DeepSeek's bidirectional pipeline: half the 1F1B bubble
    recompute: float = 0.0          # fraction of a layer's forward FLOPs recomputed in the backward
    attention_kernel: str = "flash"  # flash | xla
    attention_share: float = 1.0    # of its attention work, the share the busiest GPU computes under context
                                    # parallelism (attention.context_share)
    cp_balanced: bool = False       # context parallelism's causal load balance (attention.balanced_chunks)
    zero: bool = True               # distributed optimizer: reduce-scatter gradients, all-gather parameters
    grad_bytes: float = 4.0         # gradient reduction dtype
    gather_bytes: float = 2.0       # FSDP / ZeRO parameter all-gather dtype
    offload_bytes: float = 0.0      # host offload per GPU per step, each way
    vocab_tiles: int = 1            # num_vocab_tiling: the head is gathered per tile, forward and backward
    expert_regather: bool = True    # the backward gathers the expert weights again (any remat; not with none)
    dispatch_recompute: bool = False  # the backward redoes the EP dispatch (moe_dispatch rematerialised)
    grad_accumulation: int = 1      # this trainer's micro-batches per step: FSDP gathers, gradient reductions each
    fallback: str = ""              # moe_dropless_fallback: step | layer ("": none)
    fallback_rate: float = 0.0      # the share of steps (step) or MoE layer calls (layer) that overflow: fallback_time


def layout_from_config(cfg, mesh_shape: dict, num_devices: int, offload_bytes: float = 0.0) -> Layout:
    """This trainer's layout for a config on its mesh: no pipeline; tensor, expert and FSDP axes as the sharding
    rules place them (dense weights gathered over fsdp x context x expert, expert weights over fsdp x context),
    DCN axes outermost."""
    def ici(name):
        return _ici(cfg, mesh_shape, name)

    ep, tp, cp = mesh_shape["expert"], mesh_shape["tensor"], mesh_shape.get("context", 1)
    fsdp = mesh_shape["fsdp"] * cp  # the weights are sharded over the context axis too
    domain = GPU_DOMAIN.get(cfg.gpu_profile, 8)
    nccl_ep = nccl_ep_used(cfg, mesh_shape)
    length = cfg.max_target_length
    return Layout(
        devices=num_devices, seq=cfg.max_target_length, global_batch=global_batch_size(cfg, num_devices),
        tp=tp, ep=ep, cp=cp, cp_local=_local(ici("context"), ici("expert") * ici("tensor"), cp, domain),
        fsdp=fsdp, fsdp_dense=fsdp * ep,
        fsdp_local=_local(ici("fsdp") * ici("context"), ici("expert") * ici("tensor"), fsdp, domain),
        fsdp_dense_local=_local(ici("fsdp") * ici("context") * ici("expert"), ici("tensor"), fsdp * ep, domain),
        grouped_precision="fp8" if cfg.moe_impl == "te_dropless" and cfg.te_gmm_quantization != "none" else "",
        dense_precision=("" if cfg.quantization == "none" else "fp4" if cfg.quantization.startswith("te_nvfp4")
                         else "fp8"),
        # NCCL EP's high-throughput algorithm (TE's) is hierarchical: RDMA between nodes, NVLink inside one (NVIDIA/nccl
        # contrib/nccl_ep/README.md), so a token crosses the NICs once per destination node; so does ep_two_hop's.
        dispatch_per="node" if nccl_ep or cfg.ep_two_hop else "gpu" if cfg.ep_dedup else "slot",
        ep_slices=1 if nccl_ep or cfg.te_moe_block else cfg.num_moe_token_chunks,  # NCCL EP: one call a layer
        batch_parts=batch_parts(cfg),
        recompute=recompute_fraction(cfg), attention_kernel="flash" if cfg.attention == "cudnn_flash" else "xla",
        attention_share=context_share(cfg.attention, cfg.context_parallel_load_balance, length, cp,
                                      cfg.attention_chunk_size),
        cp_balanced=balanced(cfg.attention, cfg.context_parallel_load_balance, length, cp),
        zero=False, grad_bytes=4.0 if cfg.weight_dtype == "float32" else 2.0,
        gather_bytes=2.0 if cfg.dtype in ("bfloat16", "float16") else 4.0, offload_bytes=offload_bytes,
        vocab_tiles=cfg.num_vocab_tiling, expert_regather=cfg.remat_policy != "none",
        dispatch_recompute=cfg.remat_policy == "full" or (cfg.remat_policy == "custom"
                                                           and cfg.moe_dispatch == "remat"),
        grad_accumulation=cfg.gradient_accumulation_steps, fallback=cfg.moe_dropless_fallback or "",
        fallback_rate=cfg.dropless_fallback_rate if cfg.moe_dropless_fallback else 0.0)


# The named matmul outputs (config.py's remat names) by kind of FLOPs.
_DENSE_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mla_q", "mla_kv", "mlpwi_0", "mlpwi_1", "mlpwo")
_MOE_NAMES = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")


def recompute_fraction(cfg) -> float:
    """Of a step's forward FLOPs, the fraction the backward recomputes under remat_policy: full, everything;
    none, nothing; minimal, the attention products (every named matmul output is kept); custom, the attention
    products and each named matmul whose tensor is set to remat (FLOPs shared evenly among a kind's names). Under
    te_moe_block the routed experts' GEMMs are recomputed by any policy but none (TE's block names nothing)."""
    if cfg.remat_policy in ("full", "none"):
        return float(cfg.remat_policy == "full")
    m = Model.from_config(cfg, 0.0)
    total = m.dense_gemm_flops + m.grouped_gemm_flops + m.attention_flops
    redo = m.attention_flops
    if cfg.remat_policy == "custom":
        redo += m.dense_gemm_flops * sum(cfg[n] == "remat" for n in _DENSE_NAMES) / len(_DENSE_NAMES)
    if cfg.te_moe_block:  # TE's fused block names none of its outputs: under remat its whole forward runs again
        redo += m.grouped_gemm_flops
    elif cfg.remat_policy == "custom":
        redo += m.grouped_gemm_flops * sum(cfg[n] == "remat" for n in _MOE_NAMES) / len(_MOE_NAMES)
    return redo / total


def expected_destinations(num_experts: int, top_k: int, units: int, groups: int | None = None,
                          keep: int | None = None) -> float:
    """Expected distinct units (`units` equal blocks of consecutive experts: GPUs or nodes) that a token's top_k
    distinct experts fall in, when `keep` of `groups` groups are kept uniformly and the experts are chosen
    uniformly among theirs (all experts without groups): balanced routing, which training approaches."""
    size = num_experts // units
    groups, keep = (groups, keep) if groups else (num_experts, num_experts)  # no groups: every expert "kept"
    group = num_experts // groups
    pool = keep * group  # the experts a token chooses from

    def missed(experts_in_unit):  # P(none of the top_k falls among these of the pool)
        return math.comb(pool - experts_in_unit, top_k) / math.comb(pool, top_k)

    if size <= group:  # a unit inside one group: hit when its group is kept and a choice falls in it
        return units * keep / groups * (1 - missed(size))
    per_unit = size // group  # whole groups per unit: hit when one of its kept groups receives a choice
    kept = [math.comb(per_unit, j) * math.comb(groups - per_unit, keep - j) / math.comb(groups, keep)
            for j in range(min(per_unit, keep) + 1)]
    return units * (1 - sum(p * missed(j * group) for j, p in enumerate(kept)))


def _ici(cfg, mesh_shape: dict, name: str) -> int:
    """A mesh axis's size inside a slice (ICI); the rest of it is DCN."""
    return mesh_shape.get(name, 1) // max(1, cfg[f"dcn_{name}_parallelism"])


def _local(ici_members: int, ici_stride: int, group: int, domain: int) -> int:
    """Members of a mesh group inside one NVLink domain: its ICI part, as far as the domain reaches past the
    inner axes (0 when the whole group is inside one domain)."""
    inside = max(1, min(ici_members, domain // max(1, ici_stride)))
    return 0 if inside >= group else inside


def _ring(bytes_: float, group: int, local: int, hw: Hardware) -> float:
    """Seconds of a ring all-gather / reduce-scatter of a `bytes_` buffer over `group` GPUs, `local` of them in
    each NVLink domain (0: all in one). Across domains NCCL runs one ring per rail, so a domain's `local`
    members' NICs carry the crossing traffic together: bus bandwidth min(NVLink, local x NIC)."""
    if group <= 1:
        return 0.0
    bw = hw.nvlink_gbps if not local else min(hw.nvlink_gbps, local * hw.nic_gbps)
    return bytes_ * (group - 1) / group / (bw * 1e9 * COLLECTIVE_EFFICIENCY)


class Model(NamedTuple):
    """The architecture numbers the model needs, per token (forward FLOPs) and per GPU (parameters)."""
    dense_gemm_flops: float     # attention projections, dense MLPs, shared experts, router, output head
    grouped_gemm_flops: float   # routed experts
    attention_flops: float      # causal score and value products
    dense_params: float         # everything but the routed experts
    expert_params: float
    moe_layers: int
    emb: int
    experts: int
    top_k: int
    moe_hidden: int
    groups: int | None
    keep: int | None
    layers: int
    head_params: float = 0.0    # the output head (D x V; 0 when the logits use the embedding)
    embed_params: float = 0.0   # the token embedding (looked up where it lies: never gathered)
    head_uses: int = 1          # output heads computed per step (the main one, and one per MTP depth)
    quantizable_gemm_flops: float = 0.0  # the part of dense_gemm_flops `quantization` quantizes (not the router,
                                         # the heads or MTP's projection)
    kv_gather_width: int = 0    # numbers a token's keys and values (MLA: its latent) have in a layer, which context
                                # parallelism gathers and whose cotangents it sums over its group
    kv_gather_by_tp: bool = True  # whether tensor parallelism splits them (heads; MLA's latent is whole)
    kv_up_params: float = 0.0   # MLA's key/value up-projection weight, one layer's: under context parallelism its
                                # gradient is summed over the batch and context axes (an all-reduce) each layer
    q_out_width: int = 0        # numbers of a token's queries and attention output in a layer (all heads), which
                                # context parallelism's load balance moves between the devices of a group
    kv_up_flops: float = 0.0    # MLA's key/value up-projection, forward FLOPs per token over all layers: context
                                # parallelism computes it for the whole gathered sequence on each device
    kv_width: int = 0           # numbers of a token's keys and values as attention reads them (MLA: expanded, all
                                # heads), which context parallelism's cuDNN path copies rolled (attention_cudnn_cp)

    @classmethod
    def from_config(cls, cfg, total_params: float) -> "Model":
        _, num_moe = layer_counts(cfg)
        d, k, f = cfg.base_emb_dim, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim
        moe_layers = num_moe + (cfg.mtp_num_layers if cfg.num_experts > 1 else 0)
        attention = attention_core_flops_per_token(cfg) * (cfg.base_num_decoder_layers + cfg.mtp_num_layers)
        grouped = moe_layers * k * 2 * 3 * d * f if cfg.num_experts > 1 else 0.0
        dense = model_flops_per_token(cfg) / 3 - attention - grouped
        expert_params = moe_layers * cfg.num_experts * 3 * d * f if cfg.num_experts > 1 else 0.0
        head = 0.0 if cfg.logits_via_embedding else d * cfg.vocab_size
        layers = cfg.base_num_decoder_layers + cfg.mtp_num_layers
        if cfg.attention_type == "mla":
            width, by_tp = cfg.kv_lora_rank + cfg.qk_rope_head_dim, False
            q_out = cfg.base_num_query_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
            up = cfg.kv_lora_rank * cfg.base_num_query_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            kv_up = layers * 2 * cfg.kv_lora_rank * cfg.base_num_query_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            kv = q_out  # every head's key (qk) and value (v): as wide as its query and output
        else:
            width, by_tp, kv_up = 2 * cfg.base_num_kv_heads * cfg.head_dim, True, 0.0
            q_out, up, kv = 2 * cfg.base_num_query_heads * cfg.head_dim, 0.0, width
        return cls(dense, grouped, attention, total_params - expert_params, expert_params, moe_layers, d,
                   cfg.num_experts, k, f, cfg.n_routing_groups, cfg.topk_routing_group,
                   layers, head, d * cfg.vocab_size, 1 + cfg.mtp_num_layers, quantizable_flops_per_token(cfg),
                   kv_gather_width=width, kv_gather_by_tp=by_tp, kv_up_params=up,
                   q_out_width=q_out, kv_up_flops=kv_up, kv_width=kv)


def fsdp_collective_bytes(m: Model, lay: Layout) -> dict[str, dict[str, float]]:
    """This trainer's FSDP weight collectives per GPU per step, as buffer bytes (an all-gather's result, a
    reduce-scatter's input: what MaxText.planning.collectives counts in the compiled module), for the dense weights
    (gathered over fsdp_dense) and the routed experts' (over fsdp). Read off the partitioned module (tests hold
    the two within 10%):
      dense layers  gathered twice in the compute dtype (the backward gathers again, even with remat_policy=none:
                    XLA re-gathers rather than keep a gathered copy); gradients reduce-scattered once, in the
                    compute dtype;
      output head   gathered once per head (the main one and each MTP depth's), or, with vocab tiling, once per
                    tile forward and again per tile in the backward (each tile is recomputed); its gradient
                    reduce-scattered per tile, in float32 (the logits' precision);
      experts       gathered forward and, unless remat_policy=none, again for the backward; gradients
                    reduce-scattered once in grad_bytes (float32 master weights);
      embedding     never gathered: each device looks up the rows it holds."""
    out = {}
    if (lay.fsdp_dense or lay.fsdp) > 1:
        layers = (m.dense_params - m.head_params - m.embed_params) / lay.tp
        head = m.head_params / lay.tp * m.head_uses
        head_gathers = 1 if lay.vocab_tiles == 1 else 2 * lay.vocab_tiles
        out["dense"] = {"all-gather": lay.gather_bytes * (2 * layers + head_gathers * head),
                        "reduce-scatter": lay.gather_bytes * layers + 4.0 * lay.vocab_tiles * head}
    if lay.fsdp > 1:
        experts = m.expert_params / lay.ep
        out["expert"] = {"all-gather": lay.gather_bytes * (1 + lay.expert_regather) * experts,
                         "reduce-scatter": lay.grad_bytes * experts}
    return out


def compute_time(m: Model, lay: Layout, hw: Hardware, tokens: float) -> tuple[dict, float]:
    """Seconds per step of each kind of computation for `tokens` per GPU ({term: s}) and their sum, slowed where
    the EP exchange takes SMs of its own."""
    def peak(precision):
        if precision == "fp4" and hw.fp4_tflops:
            return hw.fp4_tflops * FP4_GEMM_FACTOR * 1e12
        # (NVFP4 on a GPU without FP4, which the trainer and the preflight refuse, at FP8's rate)
        return (hw.fp8_tflops * FP8_GEMM_FACTOR if precision in ("fp8", "fp4") else hw.bf16_tflops) * 1e12

    grouped_precision = lay.grouped_precision or lay.gemm_precision
    forward = 1.0 + lay.recompute  # forward passes per step (recompute included), the backward twice a forward
    passes = forward + 2.0
    t = {}
    quantized = m.quantizable_gemm_flops if lay.dense_precision else 0.0
    # context parallelism: MLA's key/value up-projection runs on the whole gathered sequence on each of cp devices
    redundant = m.kv_up_flops * (lay.cp - 1)
    t["dense_gemm"] = tokens * passes / GEMM_EFFICIENCY * (
        (m.dense_gemm_flops + redundant - quantized) / peak(lay.gemm_precision)
        + quantized / peak(lay.dense_precision or lay.gemm_precision))
    t["grouped_gemm"] = tokens * m.grouped_gemm_flops * passes / (peak(grouped_precision) * GROUPED_GEMM_EFFICIENCY)
    t["attention"] = tokens * m.attention_flops * passes * lay.attention_share / (
        hw.bf16_tflops * 1e12 * ATTENTION_EFFICIENCY[lay.attention_kernel])
    hbm = hw.hbm_tbps * 1e12 * HBM_EFFICIENCY
    d, k, f = m.emb, m.top_k, m.moe_hidden
    # per token and MoE layer, forward: permute in (D) and out (K x D), unpermute and combine (K x D + D), SwiGLU
    # (2 K F in, K F out), in bf16; FP8 casts read the GEMM inputs again. The backward moves about twice this.
    moe_bytes = 2 * ((2 + 2 * k) * d + 3 * k * f) + (2 * k * (d + f) if grouped_precision == "fp8" else 0)
    fsdp_dense = lay.fsdp_dense or lay.fsdp
    local_params = (m.dense_params + m.expert_params) / lay.devices if lay.zero else (
        m.dense_params / (lay.tp * lay.pp * fsdp_dense) + m.expert_params / (lay.ep * lay.pp * lay.fsdp))
    t["memory_bound"] = (tokens * m.moe_layers * moe_bytes * passes + local_params * OPTIMIZER_BYTES_PER_PARAM) / hbm
    if lay.cp > 1 and lay.attention_kernel == "flash":
        # attention_cudnn_cp copies the whole sequence's keys and values rolled for each block's first document (read
        # and written): in the forward, again where recomputed, and in the backward, with the gradients' roll back
        whole = tokens * lay.cp * m.kv_width / lay.tp * 2
        t["memory_bound"] += m.layers * (2 if lay.cp_balanced else 1) * (3 + lay.recompute) * 2 * whole / hbm
    compute = sum(t.values())
    if lay.ep_overlap == "full" and lay.ep > 1:
        compute /= 1 - FULL_OVERLAP_SM_SHARE

    return t, compute


def comm_time(m: Model, lay: Layout, hw: Hardware, tokens: float) -> dict:
    """Seconds per step of each kind of communication for `tokens` per GPU ({ep, tp, cp, fsdp, dp, offload: s})."""
    d, k = m.emb, m.top_k
    fsdp_dense = lay.fsdp_dense or lay.fsdp
    dense_dp = lay.devices // (lay.tp * lay.pp * fsdp_dense)  # replicas of each dense weight shard
    expert_dp = lay.devices // (lay.ep * lay.pp * lay.fsdp)
    comm = {}
    if lay.ep > 1 and m.experts > 1:
        crosses = lay.ep * lay.tp > hw.nvlink_domain
        # "node": one row per destination node across the NICs (fanned out over NVLink there); inside one NVLink
        # domain there is no such hop, and a token goes to each destination GPU.
        nodes = max(1, lay.ep * lay.tp // hw.nvlink_domain) if crosses else lay.ep
        units = {"slot": None, "gpu": lay.ep, "node": nodes}[lay.dispatch_per]
        rows = k if units is None else expected_destinations(m.experts, k, units, m.groups, m.keep)
        remote = (1 - hw.nvlink_domain / (lay.ep * lay.tp)) if crosses else (1 - 1 / lay.ep)
        bw = (hw.nic_gbps if crosses else hw.nvlink_gbps) * 1e9 * ALL_TO_ALL_EFFICIENCY
        # dispatch and combine forward, their transposes backward, the dispatch again where recomputed
        per_row = d * (lay.dispatch_bytes + 2 + 2 + 2 + lay.recompute * lay.dispatch_bytes)
        comm["ep"] = tokens * m.moe_layers * rows * remote * per_row / bw
    if lay.tp > 1:
        # sequence-parallel reduce-scatter + all-gather around attention and the MLP, forward and backward
        # (a stage's layers/pp layers over its replica's tokens x tp x pp: per GPU, all layers over tokens x tp)
        comm["tp"] = m.layers * 8 * _ring(tokens * lay.tp * d * 2, lay.tp, 0, hw)
    if lay.cp > 1 and m.kv_gather_width:
        # each layer gathers its keys and values (MLA: the latent) over the context group, again where the layer is
        # recomputed, and in the backward sums their cotangents over it, an all-reduce: two rings of the same bytes
        # (attention.context_parallel; MLA: also its up-projection's weight gradient, over the batch axes too); bf16
        gathered = tokens * lay.cp * m.kv_gather_width / (lay.tp if m.kv_gather_by_tp else 1) * 2  # whole sequences
        comm["cp"] = m.layers * ((1 + lay.recompute + 2) * _ring(gathered, lay.cp, lay.cp_local, hw)
                                 + 2 * _ring(m.kv_up_params / lay.tp * 2, lay.devices // lay.tp,
                                             lay.fsdp_dense_local, hw))
        comm["cp"] += balance_permute_time(m, lay, hw, tokens)
    links = {"dense": (fsdp_dense, lay.fsdp_dense_local), "expert": (lay.fsdp, lay.fsdp_local)}
    fsdp = sum(_ring(b, *links[part], hw) for part, kinds in fsdp_collective_bytes(m, lay).items()
               for b in kinds.values())
    if fsdp:  # every micro-batch gathers the weights again and reduces its own gradients
        comm["fsdp"] = fsdp * lay.grad_accumulation
    dp = 0.0
    for params, group, stride in ((m.dense_params / (lay.tp * lay.pp), dense_dp, lay.tp),
                                  (m.expert_params / (lay.ep * lay.pp), expert_dp, lay.ep * lay.tp)):
        local = _local(group, stride * lay.fsdp, group, hw.nvlink_domain)  # all of the group is on ICI
        per = params * lay.grad_bytes
        dp += (_ring(per, group, local, hw) + _ring(params * lay.gather_bytes, group, local, hw)
               if lay.zero else 2 * _ring(per, group, local, hw))
    if dp:
        comm["dp"] = dp * lay.grad_accumulation
    if lay.offload_bytes:
        comm["offload"] = 2 * lay.offload_bytes / (hw.host_gbps * 1e9)
    return comm


def balance_permute_bytes(m: Model, lay: Layout, tokens: float) -> float:
    """Bytes a GPU sends per step for context parallelism's causal load balance (attention.balanced_chunks): each
    layer sends the device's queries to the devices that compute them and their outputs back (collective permutes),
    again where recomputed, and the cotangents of both the other way in the backward; bf16."""
    if lay.cp <= 1 or not lay.cp_balanced:
        return 0.0
    return m.layers * (2 + lay.recompute) * tokens * m.q_out_width / lay.tp * 2


def balance_permute_time(m: Model, lay: Layout, hw: Hardware, tokens: float) -> float:
    """Seconds per step of balance_permute_bytes, each GPU over its own link (NVLink, or its NIC across domains)."""
    bw = (hw.nvlink_gbps if not lay.cp_local else hw.nic_gbps) * 1e9 * COLLECTIVE_EFFICIENCY
    return balance_permute_bytes(m, lay, tokens) / bw


def ep_hidden_fraction(lay: Layout, t: dict, ep_s: float) -> float:
    """The share of the EP exchange's time that runs under compute. A published run's mechanism states it
    (ep_overlap: EP_OVERLAP). This trainer's follows from its schedule, as the partitioned module shows it
    (MaxText.planning.overlap; tests/test_overlap.py): with a layer's tokens in c slices (num_moe_token_chunks) no
    slice's exchange depends on another slice's expert GEMMs, nor they on it; with the batch in p parts
    (use_batch_split_schedule) no part's exchange depends on another part's compute in the layer (attention, dense
    and expert GEMMs). Of s = p c slices, all but the first dispatch and the last combine, (s - 1) / s of the
    exchange, can be in flight while another slice computes, as far as that compute lasts: min(E, C) (s - 1) / s,
    C the expert GEMMs (chunks alone) or all the layer's GEMMs and attention (parts). With chunks alone, a dispatch
    recomputed in the backward sits in a shard_map body of its own, beside no GEMM: exposed. One slice (NCCL EP
    without a split batch: a layer's tokens in one call) hides nothing."""
    slices = lay.ep_slices * lay.batch_parts
    if lay.ep_overlap != "none" or slices <= 1 or ep_s <= 0:
        return EP_OVERLAP[lay.ep_overlap]
    if lay.batch_parts > 1:
        beside, compute = ep_s, t["dense_gemm"] + t["grouped_gemm"] + t["attention"]
    else:  # comm_time's bytes a row: the recomputed dispatch's share apart
        beside = ep_s * (lay.dispatch_bytes + 6) / (lay.dispatch_bytes * (1 + lay.recompute) + 6)
        compute = t["grouped_gemm"]
    return min(beside, compute) * (slices - 1) / slices / ep_s


def ep_overlap_reason(lay: Layout) -> str:
    """Which part of the EP exchange runs under compute, in words (MaxText.plan prints it under the ep term)."""
    if lay.ep_overlap != "none":
        return f"stated for the mechanism ({lay.ep_overlap}: {EP_OVERLAP[lay.ep_overlap]:.0%})"
    if lay.batch_parts > 1:
        chunks = f" x {lay.ep_slices} chunks" if lay.ep_slices > 1 else ""
        return (f"{lay.batch_parts} batch parts{chunks}: a part's exchange under the other parts' compute as far as it "
                "lasts, all but one slice's share of each layer's")
    if lay.ep_slices > 1:
        return (f"{lay.ep_slices} chunks: a chunk's exchange under the other chunks' expert GEMMs as far as they last, "
                "all but one chunk's share; a dispatch recomputed in the backward exposed")
    return "none: each layer's exchange is one, which its expert GEMMs wait for (use_batch_split_schedule splits it)"


def step_time(m: Model, lay: Layout, hw: Hardware, module_comm: dict | None = None) -> dict:
    """Seconds per step by term, the step, tokens/s/GPU, and the bounding resource."""
    tokens = lay.global_batch * lay.seq / lay.devices  # per GPU per step
    t, compute = compute_time(m, lay, hw, tokens)
    comm = comm_time(m, lay, hw, tokens)
    if module_comm is not None:  # the compiled module's FSDP, DP, TP and CP collectives replace the formulas'
        comm = {k: v for k, v in comm.items() if k not in ("fsdp", "dp", "tp", "cp")} | module_comm
        if "cp" in comm:  # but for the load balance's collective permutes, which module_comm does not time
            comm["cp"] += balance_permute_time(m, lay, hw, tokens)

    overlap = OVERLAP | {"ep": ep_hidden_fraction(lay, t, comm.get("ep", 0.0))}
    if lay.ep_overlap == "none" and overlap["ep"]:  # the exchange's kernels hold SMs while compute runs beside them
        compute += comm["ep"] * overlap["ep"] * FULL_OVERLAP_SM_SHARE / (1 - FULL_OVERLAP_SM_SHARE)
    hidden = sum(v * overlap[kind] for kind, v in comm.items())
    exposed = sum(v * (1 - overlap[kind]) for kind, v in comm.items()) + max(0.0, hidden - compute)
    microbatches = max(1, lay.global_batch // (lay.micro_batch * lay.devices // (lay.tp * lay.pp)))
    bubble = (lay.pp - 1) / (microbatches * lay.vp) * (0.5 if lay.dualpipe else 1.0) if lay.pp > 1 else 0.0
    fallback = fallback_time(m, lay, hw, module_comm, t, comm) if lay.fallback and lay.fallback_rate else 0.0
    step = (compute + exposed) * (1 + bubble) + fallback
    terms = {"compute": compute} | comm
    return {"compute_s": t, "comm_s": comm, "overlap": {k: overlap[k] for k in comm}, "exposed_comm_s": exposed,
            "ep_overlap": ep_overlap_reason(lay) if "ep" in comm else None, "bubble": bubble, "fallback_s": fallback,
            "fallback_rate": lay.fallback_rate, "step_s": step,
            "tokens_per_s_per_gpu": lay.global_batch * lay.seq / lay.devices / step,
            "bound": max(terms, key=terms.get)}


def fallback_time(m: Model, lay: Layout, hw: Hardware, module_comm: dict | None, t: dict, comm: dict) -> float:
    """Seconds a step spends on average in moe_dropless_fallback at fallback_rate. step: that share of the steps run
    again with the worst-case program (MaxText.trainer.programs: remat_policy=full, so everything is recomputed and
    nothing offloaded). layer: that share of the MoE layer calls keep nothing of their worst-case branch, so the
    backward runs its grouped GEMMs' forward and its dispatch and combine once more (half of the exchange's time)."""
    if lay.fallback == "step":
        worst = lay._replace(fallback="", fallback_rate=0.0, recompute=1.0, offload_bytes=0.0, expert_regather=True,
                             dispatch_recompute=True)
        return lay.fallback_rate * step_time(m, worst, hw, module_comm)["step_s"]
    return lay.fallback_rate * (t["grouped_gemm"] / (3.0 + lay.recompute) + comm.get("ep", 0.0) / 2)


def module_comm(cfg, mesh_shape: dict, by_group: list[dict], hw: Hardware) -> dict[str, float]:
    """Seconds per step of a compiled module's collectives (MaxText.lowering's collectives.by_group), by the
    step-time term they belong to: a group spanning `tensor` is tp; one over `data` alone, dp; over `context` alone
    (context parallelism's key/value gathers), cp; the rest of the
    all-gathers, reduce-scatters and all-reduces (FSDP's weights and gradients, small statistics) fsdp. Each
    crosses the slowest link of its group, as in the formulas. The EP all-to-all stays the routing's (on CPU the
    module's is fixed buffers; under NCCL EP it is inside TE's kernels)."""
    domain = GPU_DOMAIN.get(cfg.gpu_profile, 8)
    axes_order = [a for a in MESH_AXES if mesh_shape.get(a, 1) > 1]
    out: dict[str, float] = {}
    for g in by_group:
        # The axes of more than one device, in mesh order; () in the module: every device.
        axes = [a for a in axes_order if a in (g["axes"] or axes_order)]
        if g["kind"] == "all-to-all" and axes == ["expert"] or not g["group"] or g["group"] <= 1 or not axes:
            continue
        inner = [a for a in axes_order[axes_order.index(axes[-1]) + 1:] if a not in axes]
        local = _local(math.prod(_ici(cfg, mesh_shape, a) for a in axes),
                       math.prod(_ici(cfg, mesh_shape, a) for a in inner), g["group"], domain)
        term = ("tp" if "tensor" in axes else "dp" if set(axes) <= {"data"} else "cp" if axes == ["context"]
                else "fsdp")
        seconds = _ring(g["bytes"], g["group"], local, hw) * (2 if g["kind"] == "all-reduce" else 1)
        out[term] = out.get(term, 0.0) + seconds
    return out

"""`te_moe_block=true`: Transformer Engine's own fused MoE block (TE 2.20 `transformer_engine.jax.moe.moe`) in place of
te_dropless's composition of TE's router, NCCL EP and grouped GEMMs (dropless.py, nccl_ep.py).

TE's block runs gate -> fused top-k -> NCCL EP dispatch -> grouped SwiGLU FFN -> NCCL EP combine under one custom
VJP, over the MoE layer's own weights (wi_0 and wi_1 concatenated into TE's fused [E, D, 2F] `wi` on the way in,
so a checkpoint restores under either path). What it does not give back is computed beside it, in MoeBlock:
router.route on the same logits (TE's formula: the gate GEMM in bf16) with the same fused top-k, for the
per-expert load (the aux-loss-free bias update and the load statistics), the balance and z losses and the
entropy; TE keeps its own aux loss off (aux_loss_coeff=0). The block's receive total per rank gives the
overflow, as for the composed path.

Precision: NCCL EP moves bf16 tokens only (notes/te.md §14.3), so the block's activations, its gate GEMM and its
FFN weights are bf16 whatever `dtype` is; its FFN weight gradients are summed over the data axes in bf16 inside
TE (the composed path gathers in bf16 but reduce-scatters gradients in the weights' dtype). The combine weights
scale each row before the second GEMM (apply_topk_weights_early, as upstream MaxText calls the block).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from MaxText.config.checks import te_router_mode
from MaxText.layers.moe import te_kernels
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.layout import mesh_layout
from MaxText.layers.moe.nccl_ep import overflow_rows
from MaxText.layers.moe.te_runtime import bootstrapped_capacity, tokens_per_ep_rank

DTYPE = jnp.bfloat16  # NCCL EP's only token dtype


def gate_logits(x_TD, gate_DE):
    """The router logits as TE's block computes them (moe.py: the gate GEMM in the activations' dtype, bf16
    here, then float32), so that router.route beside the block chooses what the block chose."""
    return jnp.einsum("td,de->te", x_TD.astype(DTYPE), gate_DE.astype(DTYPE)).astype(jnp.float32)


def quantizer_sets(te, quantization: str, data_shards: int, num_experts: int):
    """TE's (FC1, FC2) quantizer sets for the block: no-op (bf16), or stateless grouped MXFP8 whose token
    quantizers count data_shards x num_experts groups (one per (data shard, expert) receive slab) and whose
    weight quantizers count the experts (moe.py _validate_moe_quantizer_sets)."""
    if quantization == "none":
        return te["noop_quantizer_set"], te["noop_quantizer_set"]
    tokens, experts = (te_kernels.quantizer_set(te, quantization, n) for n in (data_shards * num_experts, num_experts))
    fc = te["QuantizerSet"](x=tokens.x, kernel=experts.kernel, dgrad=tokens.dgrad)
    return fc, fc


def moe_ffn(x_BLD, gate_DE, bias_E, w: ExpertWeights, cfg, rules):
    """(y_TD, {"overflow": receive rows over capacity, over all ranks}) of TE's fused block on the current mesh.
    bias_E (None without routed_bias) steers the choice only; config/checks.py has refused what the block cannot
    compute, te_runtime.bootstrap_ep has bootstrapped NCCL EP and recorded it for the block."""
    te = te_kernels.kernels(cfg).te
    layout = mesh_layout(rules)
    mesh = jax.sharding.get_abstract_mesh()
    b, l, d = x_BLD.shape
    # TE's MeshResource names data and fsdp as the axes outside `expert` (te_runtime.mesh_context); they split the
    # batch, `expert` innermost, as TE's block wants its tokens.
    data_axes = tuple(a for a in layout.batch if a != "expert")
    recv_cap = bootstrapped_capacity(te, cfg, tokens_per_ep_rank(dict(mesh.shape), b * l), mesh.shape["expert"], d)
    pre_softmax, _ = te_router_mode(cfg)
    wi_EDG = jnp.concatenate([w.wi_0_EDF, w.wi_1_EDF], axis=-1).astype(DTYPE)  # TE's fused [E, D, 2F] FC1
    fc1, fc2 = quantizer_sets(te, cfg.te_gmm_quantization, math.prod(mesh.shape[a] for a in data_axes),
                              cfg.num_experts)
    y_BLD, _, total_N1 = te["moe"].moe(
        x_BLD.astype(DTYPE), gate_DE, wi_EDG, w.wo_EFD.astype(DTYPE),
        expert_bias=None if bias_E is None else jax.lax.stop_gradient(bias_E),
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, activation_type="silu",
        score_function=cfg.routed_score_func, use_pre_softmax=pre_softmax, num_groups=cfg.n_routing_groups,
        group_topk=cfg.topk_routing_group, scaling_factor=float(cfg.routed_scaling_factor), aux_loss_coeff=0.0,
        apply_topk_weights_early=True, quantizer_sets=(fc1, fc2), ep_axis="expert",
        data_parallelism_axes=data_axes, dtype=DTYPE, recv_capacity_per_rank=recv_cap,
        # No logical-axis constraints from TE: without Flax's logical rules (this trainer's are its own) TE falls back
        # to a deprecated table of its own names, which would pin the weight gradients' sharding to its guess.
        input_axes=(), gate_kernel_axes=(), wi_kernel_axes=(), wo_kernel_axes=())
    return y_BLD.reshape(b * l, d).astype(x_BLD.dtype), {"overflow": overflow_rows(total_N1, recv_cap)}

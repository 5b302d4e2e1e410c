"""`moe_impl=ragged` and `moe_impl=te_dropless`: the dropless MoE as dispatch -> experts -> combine (the block
has routed already).

    dispatcher(cfg, layout, kernels)       which of dispatch.py's four: LocalSort (ragged) or AlignedSort
                                           (te_dropless) here, around them ExpertParallel with expert
                                           parallelism, NcclEp with TE kernels and expert parallelism (but
                                           ExpertParallel under moe_dropless_fallback)
    kernels                                te_kernels.REFERENCE (ragged; te_kernels=reference) or TE's

No token is dropped unless a ragged_buffer_factor smaller than the worst case bounds the EP buffers, and then
every slot that found no room is counted (`overflow`); with moe_dropless_fallback=layer a layer whose tokens would
overflow runs with the worst-case buffers instead (a lax.cond on a flag computed from the routing), in as many chunks
as keep each chunk's buffers within the bounded ones (ep.worst_case_chunks), so none is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from MaxText.layers.moe import te_kernels
from MaxText.layers.moe.dispatch import AlignedSort, LocalSort, Selection
from MaxText.layers.moe.ep import ExpertParallel, worst_case_chunks
from MaxText.layers.moe.experts import expert_ffn
from MaxText.layers.moe.layout import mesh_layout, slice_scope
from MaxText.layers.moe.nccl_ep import NcclEp
from MaxText.layers.moe.router import Routing
from MaxText.layers.moe.two_hop import TwoHop


def dispatcher(cfg, layout, kernels, num_experts: int):
    """The dispatcher of this impl on this layout (num_experts: every expert, over all devices)."""
    local = AlignedSort if cfg.moe_impl == "te_dropless" else LocalSort
    if layout.num_ep == 1:
        return local(num_experts)
    if kernels.te is not None and cfg.moe_dropless_fallback is None:  # NCCL EP takes no fallback (checks.nccl_ep_used)
        return NcclEp(kernels.te, cfg, layout)
    if cfg.ep_two_hop:  # the axis's slices: dcn_expert_parallelism of them (config.checks.check_two_hop)
        return TwoHop(num_experts, num_experts // layout.num_ep, layout.num_ep // cfg.dcn_expert_parallelism, local,
                      "expert", cfg.ragged_buffer_factor)
    return ExpertParallel(num_experts, num_experts // layout.num_ep, local, "expert", cfg.ragged_buffer_factor,
                          cfg.ep_dedup)


def _chunks(tokens: int, chunks: int):
    """num_moe_token_chunks consecutive slices of a device's tokens (fewer when there are fewer tokens)."""
    bounds = sorted({tokens * i // chunks for i in range(chunks + 1)})
    return list(zip(bounds, bounds[1:]))


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None, kernels=None):
    """y_TD and {"overflow": real token-slots that got no expert output, over all devices}, through the kernel
    set `kernels` (default: te_kernels.kernels(cfg)). Per device in shard_map (layout.py); with expert
    parallelism and num_moe_token_chunks > 1 each consecutive slice of a device's tokens has its own
    exchanges, so a slice's all-to-all need not wait for another's GEMMs (the result is the same)."""
    kernels = kernels or te_kernels.kernels(cfg)
    layout = mesh_layout(rules)
    plan = dispatcher(cfg, layout, kernels, w.wi_0_EDF.shape[-3])  # [E, D, F], or gather_once's [1, E, D, F]
    gemm = kernels.gemm(cfg.te_gmm_quantization)
    if isinstance(plan, NcclEp):
        # TE partitions its NCCL EP ops over the global arrays: only the experts run per rank, in shard_map.
        x_NRD, sizes_NE, handle = plan.dispatch(x_TD, routing)

        def experts(x_1RD, sizes_1E, w):
            y_RD = expert_ffn(x_1RD[0], sizes_1E[0], layout.gather(w, x_1RD.dtype), gemm)
            return layout.reduce(y_RD[None], jnp.zeros((), jnp.int32))

        y_NRD, _ = layout.run(experts, (x_NRD, sizes_NE), w, kernels.check_vma)
        y_TD = plan.combine(y_NRD, handle)
        return y_TD.astype(x_TD.dtype), {"overflow": handle.overflow}

    chunks = cfg.num_moe_token_chunks if layout.num_ep > 1 else 1
    fallback = cfg.moe_dropless_fallback == "layer" and isinstance(plan, (ExpertParallel, TwoHop))

    def stages(x_TD, experts_TK, weights_TK, w, plan=plan, chunks=chunks, top=True):
        """This device's tokens in `chunks` slices, each dispatched, run by its experts and combined. At the top of
        shard_map the expert weights are gathered first and the result reduced last, and with
        moe_dropless_fallback=layer the layer may take its worst-case branch instead (with_fallback)."""
        if top:
            w = layout.gather(w, x_TD.dtype)
            if fallback:
                return with_fallback(stages, plan, chunks, layout, x_TD, experts_TK, weights_TK, w)
        ys, overflow = [], 0
        for i, (a, b) in enumerate(_chunks(x_TD.shape[0], chunks)):
            with slice_scope("moe_chunk", i, chunks):
                x_RD, group_sizes_E, handle = plan.dispatch(x_TD[a:b], Selection(experts_TK[a:b], weights_TK[a:b]))
                y_RD = expert_ffn(x_RD, group_sizes_E, w, gemm)
                ys.append(plan.combine(y_RD, handle))
            overflow = overflow + handle.overflow
        y_TD = ys[0] if len(ys) == 1 else jnp.concatenate(ys)
        return layout.reduce(y_TD, overflow) if top else (y_TD, overflow)

    y_TD, overflow = layout.run(stages, (x_TD, routing.experts_TK, routing.weights_TK), w, kernels.check_vma)
    if fallback:
        overflow, took = overflow
        return y_TD, {"overflow": overflow, "fallback": took}
    return y_TD, {"overflow": overflow}


def with_fallback(stages, plan, chunks: int, layout, x_TD, experts_TK, weights_TK, w):
    """moe_dropless_fallback=layer, inside shard_map: moe_ffn's bounded `stages`, or where any device's would
    overflow, the worst-case ones: in as many chunks as keep each one's buffers within the bounded ones
    (ep.worst_case_chunks), one after another, each recomputed on its own in the backward and nothing of the branch
    kept (lax.cond holds the union of both branches' residuals: the worst case's would otherwise be held every step).
    Returns (y_TD, (overflow, 1.0 if the worst-case branch ran))."""
    took = worst_case_needed(plan, experts_TK, weights_TK, chunks, layout.batch)
    many = worst_case_chunks(x_TD.shape[0], chunks, experts_TK.shape[1], plan.num_experts, plan.num_local_experts,
                             plan.buffer_factor)
    nothing = jax.checkpoint_policies.nothing_saveable
    one = jax.checkpoint(functools.partial(stages, plan=plan._replace(buffer_factor=None), chunks=1, top=False),
                         policy=nothing)

    def worst(x_TD, experts_TK, weights_TK, w):
        ys, overflow = [], 0
        for a, b in _chunks(x_TD.shape[0], many):
            x_chunk = jax.lax.optimization_barrier((x_TD[a:b], ys[-1]))[0] if ys else x_TD[a:b]  # after the last
            y_TD, dropped = one(x_chunk, experts_TK[a:b], weights_TK[a:b], w)
            ys.append(y_TD)
            overflow = overflow + dropped
        return (ys[0] if len(ys) == 1 else jnp.concatenate(ys)), overflow

    bounded = functools.partial(stages, top=False)
    y_TD, overflow = jax.lax.cond(took, jax.checkpoint(worst, policy=nothing), bounded, x_TD, experts_TK, weights_TK,
                                  w)
    y_TD, overflow = layout.reduce(y_TD, overflow)
    return y_TD, (overflow, took.astype(jnp.float32))


def worst_case_needed(plan, experts_TK, weights_TK, chunks: int, batch_axes: tuple):
    """moe_dropless_fallback=layer, inside shard_map: whether any device's tokens, in any of its chunks, would
    overflow a bounded buffer; the same on every device (the branch taken holds collectives, which all must join):
    reduced over the axes that split the tokens (the devices of the others hold the same tokens)."""
    over = jnp.zeros((), bool)
    for a, b in _chunks(experts_TK.shape[0], chunks):
        over = over | plan.overflows(Selection(experts_TK[a:b], weights_TK[a:b]))
    return jax.lax.pmax(over.astype(jnp.int32), batch_axes) > 0

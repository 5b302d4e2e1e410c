"""`moe_impl=te_dropless`: the Transformer Engine dropless MoE, with pure-JAX references for every stage.

Stages (te_kernels.py holds both kernel sets):
  route      TE fused router (fused_topk_with_score_function) | router.select_experts
  permute    token-slots sorted by expert into a static buffer where every expert group starts on a
             128-row boundary and its size is rounded up to 128 (zero rows), as TE's grouped GEMM and
             NCCL EP lay tokens out
  GEMMs      TE grouped_dense (bf16, FP8 current scaling or MXFP8) | gmm.grouped_matmul
  EP         with expert parallelism, each token travels once to each device holding any of its experts
             and back (ep.py, as NCCL EP does); the combine weights travel with it and weight the expert
             outputs before the return trip (NCCL EP's combine is an unweighted sum), and the receive buffer
             holds the dropless worst case unless ragged_buffer_factor shrinks it (overflow counted).
On CPU (or with te_kernels=reference) every stage is the reference, so the whole orchestration is
tested here; on an NVIDIA GPU scripts/ checks the TE kernels against these references.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe import ep, te_kernels
from MaxText.layers.moe.layout import mesh_layout, run_on_mesh
from MaxText.layers.moe.ragged import combine, expert_ffn
from MaxText.layers.moe.router import Routing, route as shared_route

ALIGN = te_kernels.ALIGN


@jax.named_scope("moe_route")
def route(x_TD, gate_DE, bias_E, cfg, valid_T=None) -> Routing:
    """The shared router with the kernel set's top-k (TE's fused router on GPU)."""
    return shared_route(x_TD, gate_DE, bias_E, cfg, topk=te_kernels.kernels(cfg).topk, valid_T=valid_T)


def aligned_buffer_rows(slots: int, num_experts: int, align: int = ALIGN) -> int:
    """Static rows that hold `slots` rows in groups padded to `align`, TE's token_dispatch buffer size
    (permutation.py). The padded groups add up to at most slots + E*(align-1) rows and to a multiple of
    `align`, hence to at most that bound rounded DOWN to a multiple of `align`."""
    return (slots + num_experts * (align - 1)) // align * align


@jax.named_scope("moe_dispatch")
def aligned_permute(x_ND, experts_S, num_experts: int, align: int = ALIGN, rows_per_input: int = 1,
                    max_slots: int | None = None):
    """Slots -> expert-major buffer with 128-row-aligned groups; slot s reads input row s // rows_per_input.
    The buffer is sized for `max_slots` real slots (static; default: all of them).

    Returns (x_RD, group_sizes_E, rows_S): the buffer (padding rows 0), each group's size rounded up to
    `align` (TE's aligned counts), and the buffer row of every slot. Slots whose id is >= num_experts
    (empty slots of an EP buffer) get row R (out of range) and stay out of the buffer.
    """
    s = experts_S.shape[0]
    rows = aligned_buffer_rows(s if max_slots is None else max_slots, num_experts, align)
    counts_E = jnp.sum(jax.nn.one_hot(experts_S, num_experts, dtype=jnp.int32), axis=0)
    sizes_E = (counts_E + align - 1) // align * align
    order_S = jnp.argsort(experts_S, stable=True)
    sorted_e = experts_S[order_S]
    real = sorted_e < num_experts
    e = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(s) - (jnp.cumsum(counts_E) - counts_E)[e]  # position inside its expert group
    rows_sorted = jnp.where(real, (jnp.cumsum(sizes_E) - sizes_E)[e] + rank, rows)
    rows_S = jnp.zeros((s,), jnp.int32).at[order_S].set(rows_sorted.astype(jnp.int32))
    x_SD = x_ND[jnp.arange(s) // rows_per_input] if rows_per_input > 1 else x_ND
    x_RD = jnp.zeros((rows,) + x_SD.shape[1:], x_SD.dtype).at[rows_S].set(x_SD, mode="drop")
    return x_RD, sizes_E, rows_S


@jax.named_scope("moe_combine")
def unpermute(out_RD, rows_S):
    """The buffer rows back in slot order; slots outside the buffer read 0."""
    return jnp.take(out_RD, rows_S, axis=0, mode="fill", fill_value=0)


def grouped_ffn(kernels, quantization, x_RD, sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD):
    """ragged.expert_ffn through the kernel set's grouped GEMM."""
    def gemm(x, w, sizes):
        return kernels.grouped_gemm(x, w, sizes, quantization)

    return expert_ffn(x_RD, sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD, gemm=gemm)


def local_moe(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, *, kernels, quantization):
    """All experts on this device: aligned permute, three grouped GEMMs, unpermute, weighted sum."""
    k = experts_TK.shape[1]
    x_RD, sizes_E, rows_S = aligned_permute(x_TD, experts_TK.reshape(-1), wi_0.shape[0], rows_per_input=k)
    out_RD = grouped_ffn(kernels, quantization, x_RD, sizes_E, wi_0, wi_1, wo)
    return combine(unpermute(out_RD, rows_S), weights_TK)


def expert_parallel_moe(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, *, kernels, quantization, num_experts,
                        axis_name, buffer_factor, dedup):
    """This device's E/N experts (ep.expert_parallel_moe): each received row expands into its slots, which
    run through the aligned grouped GEMMs; each row returns its slots' outputs summed, router-weighted, as
    NCCL EP's combine expects them."""
    num_local = wi_0.shape[0]

    def slot_ffn(x_RD, local_S, rows_per_input, max_slots):
        x_AD, sizes_E, rows_S = aligned_permute(x_RD, local_S, num_local, rows_per_input=rows_per_input,
                                                max_slots=max_slots)
        return unpermute(grouped_ffn(kernels, quantization, x_AD, sizes_E, wi_0, wi_1, wo), rows_S)

    return ep.expert_parallel_moe(x_TD, experts_TK, weights_TK, slot_ffn, num_experts=num_experts,
                                  num_local_experts=num_local, axis_name=axis_name, buffer_factor=buffer_factor,
                                  dedup=dedup)


def nccl_ep_moe(kernels, x_TD, routing: Routing, w, cfg, layout):
    """TE's NCCL EP: ep_dispatch and ep_combine act on the global arrays (their leading dim split over the
    batch axes, `expert` innermost); the grouped FFN runs per rank in between on its [recv_cap, D] buffer,
    whose expert groups NCCL EP already aligns to 128 rows (token_counts are the aligned sizes)."""
    te, mesh = kernels.te, jax.sharding.get_abstract_mesh()
    t = x_TD.shape[0]
    tokens_per_rank = te_kernels.tokens_per_ep_rank({axis: mesh.shape[axis] for axis in layout.batch}, t)
    recv_cap = te_kernels.ep_recv_capacity(te, cfg, tokens_per_rank, layout.num_ep)
    ep_cfg = te["ep"].EpLayerConfig(top_k=cfg.num_experts_per_tok, dispatch_output_per_expert_alignment=ALIGN)
    # TE's ep_prepare/ep_dispatch partitioning folds only `expert` into a replicated leading dim: a token
    # array left to the partitioner would send T/ep rows per rank and overrun the send buffer sized at
    # bootstrap for T/ranks. Pin all three to the batch axes, `expert` innermost, as TE's moe.py does.
    tokens = P(layout.batch)
    experts_TK, x_bf16_TD, weights_TK = (jax.lax.with_sharding_constraint(a, tokens) for a in (
        routing.experts_TK, x_TD.astype(jnp.bfloat16), routing.weights_TK.astype(jnp.float32)))
    with jax.named_scope("moe_dispatch"):
        recv_PRD, recv_w_PR, handle, counts_PE, total_P1 = te["ep"].ep_dispatch(
            ep_cfg, experts_TK, x_bf16_TD, weights_TK, recv_cap)
        recv_PRD = checkpoint_name(recv_PRD, "moe_dispatch")

    def per_rank(recv, counts, recv_w, wi_0, wi_1, wo):
        # NCCL EP zero-fills the padding between expert groups but leaves the rows past the last group
        # uninitialized (TE moe.py, tests/jax/test_multi_process_ep.py). The last group takes them as slack
        # (TE's V1 grouped GEMM wants sum(group_sizes) == rows): zero them and their weights first, or they
        # reach that expert's output, its weight gradient and any FP8 scale.
        # Groups cut at the buffer's end, should NCCL EP report pre-drop sizes after an overflow.
        rows = recv.shape[1]
        sizes_E = jnp.diff(jnp.minimum(jnp.cumsum(counts[0]), rows), prepend=0)
        valid_R = jnp.arange(rows) < jnp.sum(sizes_E)
        x_RD = jnp.where(valid_R[:, None], recv[0], jnp.zeros((), recv.dtype))
        w_R = jnp.where(valid_R, recv_w[0], 0.0)
        out_RD = grouped_ffn(kernels, cfg.te_gmm_quantization, x_RD, sizes_E, wi_0, wi_1, wo)
        return (out_RD.astype(jnp.float32) * w_R[:, None]).astype(out_RD.dtype)[None], jnp.zeros((), jnp.int32)

    out_PRD, _ = layout.run_on(per_rank, (recv_PRD, counts_PE, recv_w_PR), w, recv_PRD.dtype, check_vma=False)
    with jax.named_scope("moe_combine"):
        # num_local_tokens is the GLOBAL token count (TE moe.py passes the global (B, S)); ep_combine's
        # partitioning splits it over the ranks.
        y_TD = te["ep"].ep_combine(ep_cfg, handle, counts_PE, out_PRD, num_local_tokens=t)
    # Overflow in receive rows over capacity (NCCL EP's demand includes each group's 128-row padding): an upper
    # bound on the token copies dropped, exact when whole padded groups are cut.
    return y_TD.astype(x_TD.dtype), jnp.sum(jnp.maximum(total_P1 - recv_cap, 0)).astype(jnp.float32)


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None):
    """Dropless MoE through the kernel set of cfg.te_kernels, per device in shard_map like `ragged`
    (with TE kernels and expert parallelism: NCCL EP around the per-rank FFN)."""
    kernels = te_kernels.kernels(cfg)
    layout = mesh_layout(rules)
    if layout is not None and layout.num_ep > 1 and kernels.te is not None:
        y, overflow = nccl_ep_moe(kernels, x_TD, routing, w, cfg, layout)
        return y, {"overflow": overflow}
    kw = dict(kernels=kernels, quantization=cfg.te_gmm_quantization)
    expert_parallel = functools.partial(expert_parallel_moe, num_experts=cfg.num_experts, axis_name="expert",
                                        buffer_factor=cfg.ragged_buffer_factor, dedup=cfg.ep_dedup, **kw)
    return run_on_mesh(x_TD, routing, w, rules, functools.partial(local_moe, **kw), expert_parallel,
                       check_vma=kernels.te is None, chunks=cfg.num_moe_token_chunks)

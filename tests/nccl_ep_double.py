"""A CPU double of NCCL EP's contract (Transformer Engine 2.20's `transformer_engine.jax.ep`), in pure JAX.

TE's ep_dispatch / ep_combine run only as CUDA kernels, so nccl_ep.NcclEp cannot run on CPU with
them. This double has their signatures, output shapes, shardings and receive-buffer layout, and computes
the same values with gathers inside jax.shard_map, so the NCCL EP dispatcher runs numerically on CPU and its gradients
come from JAX's autodiff of those gathers (what NCCL EP's custom VJPs compute by hand). Correctness, not
speed: each rank all-gathers its EP group's routing and tokens.

Legend (besides the MoE package's): P ranks (the product of the batch mesh axes), N ranks of one EP group
(the `expert` axis), L local experts per rank (E/N), R receive rows per rank (recv_capacity_per_rank),
H hidden, S slots (token copies, one per (token, k)) of one EP group, in (source rank, token, k) order.

Import only after Transformer Engine's Python is importable on CPU (te_trace.install(), the `te_standin`
fixture): EpLayerConfig is TE's own dataclass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe import te_kernels, te_runtime
from MaxText.planning import te_trace


def _batch_axes():
    """The mesh axes EP tensors' leading dim is split over, `expert` innermost (TE cpp_extensions/ep.py
    _leading_axis_ok: "Leading dim is ``ep`` or a tuple ending in ``ep`` (outer dp/fsdp axes first)"), and
    the `expert` axis itself, as TE's global_mesh_resource names them (te_runtime.mesh_context sets it)."""
    from transformer_engine.jax.sharding import global_mesh_resource

    mesh = jax.sharding.get_abstract_mesh()
    names = global_mesh_resource()
    if mesh.empty or names.ep_resource is None:
        raise ValueError("nccl_ep_double: call inside jax.set_mesh(...) and te_runtime.mesh_context(cfg), "
                         "as NCCL EP reads its axes from both")
    axes = tuple(a for a in (names.dp_resource, names.fsdp_resource) if a is not None and a in mesh.shape)
    return axes + (names.ep_resource,), names.ep_resource


class NcclEpDouble:
    """The `te["ep"]` namespace the NCCL EP dispatcher uses: EpLayerConfig, ep_dispatch, ep_combine.

    Built from the arguments of te_runtime.ep_bootstrap_args, as NCCL EP sizes its buffers at bootstrap:
    a step that sends more tokens per rank or asks for a larger receive buffer than was bootstrapped is
    refused (on GPUs it would overrun NCCL EP's buffers)."""

    def __init__(self, num_experts: int, max_tokens_per_rank: int, recv_capacity_per_rank: int, hidden_dim: int):
        from transformer_engine.jax.ep import EpLayerConfig

        self.EpLayerConfig = EpLayerConfig  # noqa: N802 - TE's name, read by the NCCL EP dispatcher
        self.num_experts = num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.recv_capacity_per_rank = recv_capacity_per_rank
        self.hidden_dim = hidden_dim

    # ------------------------------------------------------------------------------------- dispatch

    def ep_dispatch(self, cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank: int):
        """TE's ep_dispatch: (recv_tokens [P, R, H] tokens' dtype, recv_topk_weights [P, R] f32,
        handle [P, 2*t*K] int32, token_counts [P, L] int32, total_recv_tokens [P, 1] int32)."""
        k, h = cfg.top_k, tokens.shape[-1]
        if topk_idx.shape[-1] != k or topk_weights.shape[-1] != k:
            raise ValueError(f"ep_dispatch: topk_idx {topk_idx.shape} / topk_weights {topk_weights.shape} "
                             f"must end in top_k={k}")
        if tokens.dtype != jnp.bfloat16:  # TE ep.py ep_bootstrap: "only max_token_dtype=jnp.bfloat16"
            raise TypeError(f"ep_dispatch: NCCL EP moves bfloat16 tokens only, got {tokens.dtype}")
        if not jnp.issubdtype(topk_weights.dtype, jnp.floating):  # TE ep.py _dispatch_fwd
            raise TypeError(f"ep_dispatch: topk_weights must be floating, got {topk_weights.dtype}")
        if recv_capacity_per_rank > self.recv_capacity_per_rank or h != self.hidden_dim:
            raise ValueError(f"ep_dispatch: recv_capacity_per_rank={recv_capacity_per_rank}, H={h} exceed what was "
                             f"bootstrapped ({self.recv_capacity_per_rank}, {self.hidden_dim})")
        axes, ep_axis = _batch_axes()
        mesh = jax.sharding.get_abstract_mesh()
        ranks = math.prod(mesh.shape[a] for a in axes)
        t_rank = math.prod(tokens.shape[:-1]) // ranks
        if t_rank > self.max_tokens_per_rank:
            raise ValueError(f"ep_dispatch: {t_rank} tokens per rank overrun the send buffer bootstrapped for "
                             f"max_tokens_per_rank={self.max_tokens_per_rank}")
        n = mesh.shape[ep_axis]
        if self.num_experts % n:
            raise ValueError(f"ep_dispatch: num_experts={self.num_experts} does not split over {n} EP ranks")
        body = _dispatch_body(num_experts=self.num_experts, ep_size=n, ep_axis=ep_axis,
                              align=max(cfg.dispatch_output_per_expert_alignment, 1),
                              recv_rows=recv_capacity_per_rank)
        spec = P(axes)
        return jax.shard_map(body, in_specs=(spec,) * 3, out_specs=(spec,) * 5)(topk_idx, tokens, topk_weights)

    # ------------------------------------------------------------------------------------- combine

    def ep_combine(self, cfg, handle, token_counts, expert_out, num_local_tokens, out_sharding=None):
        """TE's ep_combine: the UNWEIGHTED sum of each token's K expert rows, [*num_local_tokens, H].
        num_local_tokens is the GLOBAL token shape (TE moe.py passes (B, S)); its leading dim splits over
        the ranks. Slots dropped on overflow add nothing."""
        del token_counts  # TE ep.py _combine_fwd: `del token_counts`, the handle carries the layout
        (y,) = self._to_tokens(cfg, handle, (expert_out,), num_local_tokens, sum_over_k=(True,))
        if out_sharding is not None:
            y = jax.lax.with_sharding_constraint(y, P(*out_sharding))
        return y

    def _to_tokens(self, cfg, handle, buffers, num_local_tokens, sum_over_k):
        """Each rank's own slots read back from the EP group's receive buffers ([P, R, ...] each): per buffer
        [*num_local_tokens, ...] summed over the K slots of a token, or [*num_local_tokens, K, ...] as they are
        (sum_over_k False); a dropped slot reads 0. Combine, and the transpose of dispatch, are this gather."""
        leading = (num_local_tokens,) if isinstance(num_local_tokens, int) else tuple(num_local_tokens)
        axes, ep_axis = _batch_axes()
        mesh = jax.sharding.get_abstract_mesh()
        ranks = math.prod(mesh.shape[a] for a in axes)
        k = cfg.top_k
        t_rank = handle.shape[-1] // (2 * k)
        if leading[0] % ranks or leading[0] // ranks * math.prod(leading[1:]) != t_rank:
            raise ValueError(f"ep_combine: num_local_tokens={num_local_tokens} is not the global token shape of "
                             f"this dispatch ({ranks} ranks x {t_rank} tokens); TE splits its leading dim over "
                             "the ranks")
        local = (leading[0] // ranks,) + leading[1:]

        def body(handle_1X, *buffers_1R):
            dest_S, row_S = handle_1X[0, :t_rank * k], handle_1X[0, t_rank * k:]
            kept_S = row_S >= 0
            outs = []
            for buf_1R, summed in zip(buffers_1R, sum_over_k):
                rows_S = jax.lax.all_gather(buf_1R[0], ep_axis)[dest_S, jnp.maximum(row_S, 0)]
                # where, not a multiply by the mask: an unused row may hold NaN (the uninitialized tail).
                rows_S = jnp.where(kept_S.reshape((-1,) + (1,) * (rows_S.ndim - 1)), rows_S.astype(jnp.float32), 0.0)
                rows_TK = rows_S.reshape((t_rank, k) + rows_S.shape[1:])
                out = jnp.sum(rows_TK, axis=1) if summed else rows_TK
                outs.append(out.astype(buf_1R.dtype).reshape(local + out.shape[1:]))
            return tuple(outs)

        spec = P(axes)
        return jax.shard_map(body, in_specs=(spec,) * (1 + len(buffers)), out_specs=(spec,) * len(buffers))(
            handle, *buffers)

    # ------------------------------------------------------------------------------------- TE's primitive calls

    # TE's fused MoE block (transformer_engine/jax/moe.py) calls NCCL EP one level down, through
    # transformer_engine.jax.cpp_extensions (`tex`), under its own custom VJP: the same ops split into prepare /
    # dispatch and their backwards by hand. patch_tex puts these in their place.

    def ep_prepare(self, cfg, topk_idx):
        """tex.ep_prepare: (token_counts [P, L], total_recv_tokens [P, 1], handle_mem) from the routing alone,
        the receive layout of the capacity NCCL EP was bootstrapped with."""
        tokens = jnp.zeros(topk_idx.shape[:-1] + (self.hidden_dim,), jnp.bfloat16)
        weights = jnp.zeros(topk_idx.shape, jnp.float32)
        _, _, handle, counts, total = self.ep_dispatch(cfg, topk_idx, tokens, weights, self.recv_capacity_per_rank)
        return counts, total, handle

    def ep_dispatch_fwd(self, cfg, handle_mem, topk_idx, tokens, topk_weights, recv_capacity_per_rank):
        """tex.ep_dispatch_fwd: (recv_tokens [P, R, H], recv_topk_weights [P, R])."""
        del handle_mem  # the double lays the buffer out again from the routing
        recv, recv_w, *_ = self.ep_dispatch(cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank)
        return recv, recv_w

    def ep_combine_fwd(self, cfg, handle_mem, expert_out, num_local_tokens, out_partition_spec=None):
        return self.ep_combine(cfg, handle_mem, None, expert_out, num_local_tokens, out_sharding=out_partition_spec)

    def ep_dispatch_bwd(self, cfg, handle_mem, grad, g_recv_topk_weights, num_local_tokens, out_partition_spec=None):
        """tex.ep_dispatch_bwd: (d tokens [*num_local_tokens, H], d topk_weights [*num_local_tokens, K]): each
        token's rows' gradients summed, each slot's weight gradient read back; dropped slots get 0."""
        d_x, d_w = self._to_tokens(cfg, handle_mem, (grad, g_recv_topk_weights), num_local_tokens, (True, False))
        if out_partition_spec is not None:
            d_x = jax.lax.with_sharding_constraint(d_x, P(*out_partition_spec))
        return d_x, d_w

    def ep_combine_bwd(self, cfg, handle_mem, grad, recv_capacity_per_rank):
        """tex.ep_combine_bwd: [P, R, H], each occupied row its token's gradient, padding and tail rows 0 (the
        transpose of combine's gather)."""
        axes, _ = _batch_axes()
        ranks = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
        zeros = jnp.zeros((ranks, recv_capacity_per_rank, grad.shape[-1]), grad.dtype)
        _, transpose = jax.vjp(lambda out: self.ep_combine(cfg, handle_mem, None, out, grad.shape[:-1]), zeros)
        return transpose(grad)[0]


def patch_tex(monkeypatch, cfg, mesh_shape, global_batch: int) -> NcclEpDouble:
    """NCCL EP on CPU for TE's own Python: the double behind `tex`'s five NCCL EP calls, which TE's ep.py (the
    composed path's ep_dispatch / ep_combine, their custom VJPs for real) and TE's fused MoE block call; TE's
    EpConfig and moe.py's bootstrap record as te_runtime.bootstrap_ep leaves them on GPUs. Both are restored when
    the test ends (monkeypatch)."""
    from transformer_engine.jax import cpp_extensions as tex, moe
    from transformer_engine.jax.cpp_extensions import ep as tex_ep

    double = namespace(cfg, mesh_shape, global_batch)
    for name in ("ep_prepare", "ep_dispatch_fwd", "ep_combine_fwd", "ep_dispatch_bwd", "ep_combine_bwd"):
        monkeypatch.setattr(tex, name, getattr(double, name))
    shape = dict(mesh_shape)
    args = te_runtime.ep_bootstrap_args(cfg, shape, global_batch)
    monkeypatch.setattr(moe, "_te_ep_bootstrap_signature", te_runtime.moe_signature(args, shape))
    monkeypatch.setattr(tex_ep, "_ep_config", ep_config(cfg, shape, global_batch))
    return double


def ep_config(cfg, mesh_shape, global_batch: int):
    """TE's EpConfig for the bootstrap the double models; its EP groups: the one outer batch axis beside `expert`."""
    groups = math.prod(n for axis, n in mesh_shape.items() if axis in ("data", "fsdp"))
    return te_trace.ep_config(cfg, dict(mesh_shape), global_batch, groups)


def _dispatch_body(*, num_experts, ep_size, ep_axis, align, recv_rows):
    """Per rank: all-gather the EP group's routing, tokens and weights, lay out this rank's receive buffer."""
    num_local = num_experts // ep_size

    def body(idx_tK, x_tH, w_tK):
        k, h = idx_tK.shape[-1], x_tH.shape[-1]
        idx_tK, x_tH, w_tK = idx_tK.reshape(-1, k), x_tH.reshape(-1, h), w_tK.reshape(-1, k)
        t = idx_tK.shape[0]
        me = jax.lax.axis_index(ep_axis)
        # The EP group's slots in (source rank, token, k) order (ep_prepare all-gathers topk_idx over the EP
        # group, notes/te.md §6); TE does not say how NCCL EP orders rows inside a slab: this is the double's order.
        idx_S = jax.lax.all_gather(idx_tK, ep_axis).reshape(-1).astype(jnp.int32)
        x_GH = jax.lax.all_gather(x_tH, ep_axis).reshape(-1, h)  # [N*t, H]: slot s reads token s // K
        w_S = jax.lax.all_gather(w_tK.astype(jnp.float32), ep_axis).reshape(-1)

        onehot_SE = jax.nn.one_hot(idx_S, num_experts, dtype=jnp.int32)
        counts_E = jnp.sum(onehot_SE, axis=0)
        rank_in_expert_S = jnp.take_along_axis(jnp.cumsum(onehot_SE, axis=0) - 1, idx_S[:, None], axis=1)[:, 0]
        # Expert-major slabs, each padded up to the alignment (TE common/include/transformer_engine/ep.h, quoted
        # in notes/te.md §6: recv layout "expert-major (contiguous per-expert slabs, padded per layer_cfg)"; TE
        # moe.py _ffn_fwd_per_shard feeds token_counts straight to the grouped GEMM as group sizes, so they are
        # the ALIGNED sizes). Slab e of rank d starts after d's earlier local slabs.
        aligned_NL = (-(-counts_E // align) * align).reshape(ep_size, num_local)
        start_E = (jnp.cumsum(aligned_NL, axis=1) - aligned_NL).reshape(-1)
        row_S = start_E[idx_S] + rank_in_expert_S
        dest_S = idx_S // num_local
        # Drop on overflow (TE ep.py ep_bootstrap drop_on_overflow: "Drop tokens exceeding recv_capacity_per_rank
        # instead of trapping"): the rows past R do not exist. total_recv_tokens is the pre-drop demand (TE:
        # "the per-rank pre-drop recv-slot count ... counts dropped tokens too").
        kept_S = row_S < recv_rows
        demand = jnp.sum(aligned_NL[me])
        slot_of_row_R = jnp.full((recv_rows,), idx_S.size, jnp.int32).at[
            jnp.where((dest_S == me) & kept_S, row_S, recv_rows)].set(jnp.arange(idx_S.size, dtype=jnp.int32),
                                                                       mode="drop")
        occupied_R = slot_of_row_R < idx_S.size
        slot_R = jnp.minimum(slot_of_row_R, idx_S.size - 1)
        # Padding between slabs is zero-filled, rows past the last slab are left uninitialized (TE moe.py
        # _ffn_bwd_per_shard: "Padding between groups is zero padded due to NCCL EP" / "Overallocated padding
        # past all groups is uninitialized"): NaN models garbage there, tokens and weights alike.
        in_slab_R = jnp.arange(recv_rows) < demand
        recv_RH = jnp.where(occupied_R[:, None], x_GH[slot_R // k],
                            jnp.where(in_slab_R[:, None], jnp.zeros((), x_GH.dtype), jnp.full((), jnp.nan, x_GH.dtype)))
        recv_w_R = jnp.where(occupied_R, w_S[slot_R], jnp.where(in_slab_R, 0.0, jnp.nan))
        # Counts of what the buffer holds: the aligned slab sizes, cut where the buffer ends on overflow (R is
        # a multiple of the alignment, so the cut slabs stay aligned). A modelling choice: TE does not say.
        end_L = jnp.minimum(jnp.cumsum(aligned_NL[me]), recv_rows)
        counts_L = (end_L - jnp.concatenate([jnp.zeros((1,), end_L.dtype), end_L[:-1]])).astype(jnp.int32)
        # The handle: for this rank's own slots, the destination rank in the group and the row there (-1: dropped).
        mine = jax.lax.dynamic_slice_in_dim(jnp.stack([dest_S, jnp.where(kept_S, row_S, -1)]), me * t * k, t * k, 1)
        return (recv_RH[None], recv_w_R[None], mine.reshape(1, -1).astype(jnp.int32), counts_L[None],
                demand.reshape(1, 1).astype(jnp.int32))

    return body


def namespace(cfg, mesh_shape, global_batch: int) -> NcclEpDouble:
    """The double bootstrapped as te_runtime.bootstrap_ep would bootstrap NCCL EP for this config and mesh."""
    args = te_runtime.ep_bootstrap_args(cfg, dict(mesh_shape), global_batch)
    return NcclEpDouble(args["num_experts"], args["max_tokens_per_rank"], args["recv_capacity_per_rank"],
                        args["hidden_dim"])


def slack_grouped_gemm(x_RD, w_EDF, group_sizes_E, quantization: str):
    """The reference grouped GEMM with the rows past the last group joined to the last group, as TE's V1
    grouped GEMM takes them (sum(group_sizes) == rows), and without te_kernels._te_grouped_gemm's own zeroing
    of those rows: the plain reference never reads them, so an unmasked NaN tail would pass unseen on CPU;
    with this, the tail reaches the last expert's output and weight gradients unless the NCCL EP dispatcher's per-rank
    masking stops it (the tests prove that masking on its own)."""
    sizes_E = group_sizes_E.at[-1].add(x_RD.shape[0] - jnp.sum(group_sizes_E))
    return te_kernels.reference_grouped_gemm(x_RD, w_EDF, sizes_E, quantization)


def kernels(cfg, mesh_shape, global_batch: int) -> te_kernels.Kernels:
    """The kernel set the NCCL EP dispatcher runs on CPU: the reference top-k, the reference grouped GEMM with TE's tail
    slack, the double for NCCL EP and TE's real moe module (te_runtime.ep_recv_capacity reads
    get_moe_recv_capacity_per_rank from it)."""
    from transformer_engine.jax import moe

    config = ep_config(cfg, mesh_shape, global_batch)
    return te_kernels.Kernels("nccl_ep_double", te_kernels.reference_topk, slack_grouped_gemm,
                              {"ep": namespace(cfg, mesh_shape, global_batch), "moe": moe,
                               "ep_config": lambda: config})

"""`moe_impl=ragged`: pure-JAX dropless MoE.

Per device: sort the token-slots by expert, run the three expert matmuls as grouped GEMMs over the
contiguous expert groups, unsort, and sum each token's K outputs weighted by the router. With expert
parallelism (mesh axis `expert` > 1) the sorted slots first travel to the device that holds their
expert and come back after the GEMMs (dispatch / combine, see ep.py). Nothing is dropped unless a
ragged_buffer_factor smaller than the worst case is set, and then every dropped slot is counted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.moe import ep
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.layout import run_on_mesh
from MaxText.layers.moe.router import Routing


def sort_by_expert(experts_S, num_experts: int):
    """(order_S, group_sizes_E): a stable permutation that sorts slots by expert id, and the group sizes.
    Ids >= num_experts (padding) sort last and are not counted."""
    order_S = jnp.argsort(experts_S, stable=True)
    group_sizes_E = jnp.sum(jax.nn.one_hot(experts_S, num_experts, dtype=jnp.int32), axis=0)
    return order_S, group_sizes_E


@jax.named_scope("moe_grouped_gemm")
def expert_ffn(x_RD, group_sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD, gemm=grouped_matmul):
    """SwiGLU of each contiguous expert group; rows past sum(group_sizes) come out as 0.
    `gemm(x_RD, w_EDF, group_sizes_E)` is the grouped GEMM (te_dropless passes its kernel set's)."""
    dt = x_RD.dtype
    gate = checkpoint_name(gemm(x_RD, wi_0_EDF.astype(dt), group_sizes_E), "moe_mlpwi_0")
    up = checkpoint_name(gemm(x_RD, wi_1_EDF.astype(dt), group_sizes_E), "moe_mlpwi_1")
    h = jax.nn.silu(gate) * up
    return checkpoint_name(gemm(h, wo_EFD.astype(dt), group_sizes_E), "moe_mlpwo")


def sorted_ffn(x_ND, experts_S, num_experts: int, wi_0_EDF, wi_1_EDF, wo_EFD, rows_per_input: int = 1):
    """expert_ffn for slots in any order: sort by expert, grouped GEMMs, unsort. Slot s reads input row
    s // rows_per_input, so K slots of a token share its row without a repeated copy of x."""
    with jax.named_scope("moe_dispatch"):
        order_S, group_sizes_E = sort_by_expert(experts_S, num_experts)
        x_RD = x_ND[order_S // rows_per_input]
    out_SD = expert_ffn(x_RD, group_sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD)
    with jax.named_scope("moe_combine"):
        return out_SD[jnp.argsort(order_S)]


@jax.named_scope("moe_combine")
def combine(out_SD, weights_TK):
    """y_t = sum_k weight_tk * out_(t,k), accumulated in float32."""
    t, k = weights_TK.shape
    out_TKD = out_SD.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", out_TKD, weights_TK.astype(jnp.float32)).astype(out_SD.dtype)


def local_moe(x_TD, experts_TK, weights_TK, wi_0_EDF, wi_1_EDF, wo_EFD):
    """Every expert on this device: the whole dropless MoE without communication."""
    # Slot s is (token s // K, choice s % K).
    out_SD = sorted_ffn(x_TD, experts_TK.reshape(-1), wi_0_EDF.shape[0], wi_0_EDF, wi_1_EDF, wo_EFD,
                        rows_per_input=experts_TK.shape[1])
    return combine(out_SD, weights_TK)


def expert_parallel_moe(x_TD, experts_TK, weights_TK, wi_0_EDF, wi_1_EDF, wo_EFD, *, num_experts, axis_name,
                        buffer_factor):
    """The dropless MoE with this device's E/N experts: dispatch slots to their experts' devices, grouped
    GEMMs there, combine back. Returns (y_TD, overflowed slots on this device)."""
    k = experts_TK.shape[1]
    num_local = wi_0_EDF.shape[0]
    x_SD = jnp.repeat(x_TD, k, axis=0)
    dispatch = ep.dispatch(x_SD, experts_TK.reshape(-1), num_experts=num_experts, num_local_experts=num_local,
                           axis_name=axis_name, capacity=ep.peer_capacity(x_TD.shape[0], k, num_experts,
                                                                             num_local, buffer_factor))
    out_RD = sorted_ffn(dispatch.x_RD, dispatch.local_expert_R, num_local, wi_0_EDF, wi_1_EDF, wo_EFD)
    out_SD = ep.combine(out_RD, dispatch, axis_name=axis_name)
    return combine(out_SD, weights_TK), dispatch.overflow


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None):
    """Dropless MoE over all tokens; inside a mesh, per device in shard_map (see MeshLayout)."""
    expert_parallel = functools.partial(expert_parallel_moe, num_experts=cfg.num_experts, axis_name="expert",
                                        buffer_factor=cfg.ragged_buffer_factor)
    return run_on_mesh(x_TD, routing, w, rules, local_moe, expert_parallel)

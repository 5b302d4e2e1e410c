"""`moe_impl=ragged`: pure-JAX dropless MoE.

Per device: sort the token-slots by expert, run the three expert matmuls as grouped GEMMs over the
contiguous expert groups, unsort, and sum each token's K outputs weighted by the router. With expert
parallelism (mesh axis `expert` > 1) each token first travels to the devices that hold its experts, once per
device, and its weighted expert outputs come back after the GEMMs (dispatch / combine, see ep.py). Nothing is dropped unless a
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


def sorted_ffn(x_ND, experts_S, num_experts: int, wi_0_EDF, wi_1_EDF, wo_EFD, rows_per_input: int = 1,
               max_slots: int | None = None):
    """expert_ffn for slots in any order: sort by expert, grouped GEMMs, unsort. Slot s reads input row
    s // rows_per_input, so K slots of a token share its row without a repeated copy of x. `max_slots`
    (static; at least the slots with an expert id < num_experts) bounds the GEMMs' rows: the empty slots
    sort last, and those past it are left out (their output is 0 either way)."""
    s = experts_S.shape[0]
    with jax.named_scope("moe_dispatch"):
        order_S, group_sizes_E = sort_by_expert(experts_S, num_experts)
        order_M = order_S[:max_slots]
        x_MD = x_ND[order_M // rows_per_input]
    out_MD = expert_ffn(x_MD, group_sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD)
    with jax.named_scope("moe_combine"):
        if order_M.shape[0] == s:
            return out_MD[jnp.argsort(order_S)]
        return jnp.zeros((s,) + out_MD.shape[1:], out_MD.dtype).at[order_M].set(out_MD)


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
                        buffer_factor, dedup):
    """The dropless MoE with this device's E/N experts (ep.expert_parallel_moe around sorted_ffn).
    Returns (y_TD, overflowed slots on this device)."""
    num_local = wi_0_EDF.shape[0]

    def slot_ffn(x_RD, local_S, rows_per_input, max_slots):
        return sorted_ffn(x_RD, local_S, num_local, wi_0_EDF, wi_1_EDF, wo_EFD, rows_per_input, max_slots)

    return ep.expert_parallel_moe(x_TD, experts_TK, weights_TK, slot_ffn, num_experts=num_experts,
                                  num_local_experts=num_local, axis_name=axis_name, buffer_factor=buffer_factor,
                                  dedup=dedup)


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None):
    """Dropless MoE over all tokens; inside a mesh, per device in shard_map (see MeshLayout)."""
    expert_parallel = functools.partial(expert_parallel_moe, num_experts=cfg.num_experts, axis_name="expert",
                                        buffer_factor=cfg.ragged_buffer_factor, dedup=cfg.ep_dedup)
    return run_on_mesh(x_TD, routing, w, rules, local_moe, expert_parallel, chunks=cfg.num_moe_token_chunks)

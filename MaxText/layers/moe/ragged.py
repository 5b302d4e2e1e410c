"""`moe_impl=ragged`: pure-JAX dropless MoE.

Per device: sort the token-slots by expert, run the three expert matmuls as grouped GEMMs over the
contiguous expert groups, unsort, and sum each token's K outputs weighted by the router. With expert
parallelism (mesh axis `expert` > 1) the sorted slots first travel to the device that holds their
expert and come back after the GEMMs (dispatch / combine, see ep.py). Nothing is dropped unless a
ragged_buffer_factor smaller than the worst case is set, and then every dropped slot is counted.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.config import ConfigError
from MaxText.layers.moe import ep
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import Routing
from MaxText.sharding import logical_to_spec


def sort_by_expert(experts_S, num_experts: int):
    """(order_S, group_sizes_E): a stable permutation that sorts slots by expert id, and the group sizes.
    Ids >= num_experts (padding) sort last and are not counted."""
    order_S = jnp.argsort(experts_S, stable=True)
    group_sizes_E = jnp.sum(jax.nn.one_hot(experts_S, num_experts, dtype=jnp.int32), axis=0)
    return order_S, group_sizes_E


@jax.named_scope("moe_grouped_gemm")
def expert_ffn(x_GD, group_sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD, gemm=grouped_matmul):
    """SwiGLU of each contiguous expert group; rows past sum(group_sizes) come out as 0.
    `gemm(x_RD, w_EDF, group_sizes_E)` is the grouped GEMM (te_dropless passes its kernel set's)."""
    dt = x_GD.dtype
    gate = checkpoint_name(gemm(x_GD, wi_0_EDF.astype(dt), group_sizes_E), "moe_mlpwi_0")
    up = checkpoint_name(gemm(x_GD, wi_1_EDF.astype(dt), group_sizes_E), "moe_mlpwi_1")
    h = jax.nn.silu(gate) * up
    return checkpoint_name(gemm(h, wo_EFD.astype(dt), group_sizes_E), "moe_mlpwo")


def sorted_ffn(x_ND, experts_S, num_experts: int, wi_0_EDF, wi_1_EDF, wo_EFD, rows_per_input: int = 1):
    """expert_ffn for slots in any order: sort by expert, grouped GEMMs, unsort. Slot s reads input row
    s // rows_per_input, so K slots of a token share its row without a repeated copy of x."""
    with jax.named_scope("moe_dispatch"):
        order_S, group_sizes_E = sort_by_expert(experts_S, num_experts)
        x_GD = x_ND[order_S // rows_per_input]
    out_SD = expert_ffn(x_GD, group_sizes_E, wi_0_EDF, wi_1_EDF, wo_EFD)
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
    out_GD = sorted_ffn(dispatch.x_GD, dispatch.local_expert_G, num_local, wi_0_EDF, wi_1_EDF, wo_EFD)
    out_SD = ep.combine(out_GD, dispatch, axis_name=axis_name)
    return combine(out_SD, weights_TK), dispatch.overflow


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_for_compute(w, axes: tuple, dim: int, dtype):
    """Inside shard_map: this device's shard of a weight, cast to the compute dtype, then all-gathered over
    `axes` along `dim` (tiled). The forward gather (and its rematerialised repeat) moves compute-dtype bytes,
    half of an fp32 master weight's; the gradient is reduce-scattered in the weight's own dtype, so with
    fp32 master weights the sum over the FSDP shards loses nothing to bf16 rounding."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True) if axes else w.astype(dtype)


def _gather_fwd(w, axes, dim, dtype):
    return gather_for_compute(w, axes, dim, dtype), jnp.zeros((0,), w.dtype)  # the residual carries w's dtype


def _gather_bwd(axes, dim, dtype, empty, g):
    g = g.astype(empty.dtype)  # reduced in the weight's dtype: float32 master weights, float32 sums
    if axes:
        g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    return (g,)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)


class MeshLayout(NamedTuple):
    """How a per-device MoE function sits on the mesh: tokens split over the batch axes; expert weights enter
    in their own sharding (E over `expert`, D over the `embed` axes: fsdp, F over the `mlp` axes) and are
    gathered over D inside, in the compute dtype (gather_for_compute)."""
    batch: tuple
    mlp: tuple
    num_ep: int
    embed: tuple = ()  # mesh axes splitting the expert weights' model dim D (the param's `embed` sharding)

    def run(self, per_device, x_TD, routing: Routing, w, check_vma: bool = True):
        """shard_map of per_device(x, experts, weights, wi_0, wi_1, wo) -> (y, overflow): adds up the
        tensor shards' partial outputs and the devices' overflow counts. Weights arrive in x_TD's dtype."""
        return self.run_on(per_device, (x_TD, routing.experts_TK, routing.weights_TK), w, x_TD.dtype, check_vma)

    def run_on(self, per_device, token_arrays, w, dtype, check_vma: bool = True):
        """shard_map of per_device(*token_arrays, wi_0, wi_1, wo) -> (y, overflow) where every token array
        is split over the batch axes on its leading dim and the weights arrive gathered, in `dtype`.
        check_vma=False for bodies with Transformer Engine's custom VJPs, whose abstract values carry no
        manual-axis type (JAX's check rejects them)."""
        batch, mlp, embed = self.batch, self.mlp, self.embed
        exp, f, d = ("expert" if self.num_ep > 1 else None), (mlp or None), (embed or None)

        def body(*args):
            *tokens_, wi_0, wi_1, wo = args
            wi_0, wi_1 = (gather_for_compute(w_, embed, 1, dtype) for w_ in (wi_0, wi_1))
            y, overflow = per_device(*tokens_, wi_0, wi_1, gather_for_compute(wo, embed, 2, dtype))
            if mlp:  # each tensor shard holds a slice of F: its partial outputs add up
                y = jax.lax.psum(y, mlp)
            overflow = jax.lax.psum(overflow, batch) if batch else overflow
            return y, overflow.astype(jnp.float32)

        tokens = P(batch or None)
        return jax.shard_map(
            body, in_specs=(*(tokens,) * len(token_arrays), P(exp, d, f), P(exp, d, f), P(exp, f, d)),
            out_specs=(tokens, P()), check_vma=check_vma,
        )(*token_arrays, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD)


def _axes(entry) -> tuple:
    """One PartitionSpec entry as a tuple of mesh axes."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _mesh_axes(logical: str, rules) -> tuple:
    return _axes(logical_to_spec((logical,), rules)[0])


def mesh_layout(rules) -> MeshLayout | None:
    """The layout in the current mesh, or None outside one (then everything is local)."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return None
    layout = MeshLayout(_mesh_axes("activation_batch", rules), _mesh_axes("activation_mlp", rules),
                        mesh.shape.get("expert", 1),
                        _axes(logical_to_spec(("exp", "embed", "mlp"), rules)[1]))  # how the weights' D is split
    if layout.num_ep > 1 and "expert" not in layout.batch:
        raise ConfigError("a dropless MoE with expert parallelism needs the batch split over `expert` too: "
                          "keep 'expert' in the activation_batch rule of logical_axis_rules")
    return layout


def run_on_mesh(x_TD, routing: Routing, w, rules, local, expert_parallel, check_vma: bool = True):
    """Runs a dropless MoE where it belongs: `local(x, experts, weights, wi_0, wi_1, wo) -> y` outside a mesh
    or without expert parallelism, `expert_parallel(same) -> (y, overflow)` with it, per device in
    shard_map (see MeshLayout). Returns (y_TD, {"overflow": slots that did not fit})."""
    layout = mesh_layout(rules)
    if layout is None:
        y = local(x_TD, routing.experts_TK, routing.weights_TK, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD)
        return y, {"overflow": jnp.zeros((), jnp.float32)}

    def per_device(*args):
        if layout.num_ep > 1:
            return expert_parallel(*args)
        return local(*args), jnp.zeros((), jnp.int32)

    y, overflow = layout.run(per_device, x_TD, routing, w, check_vma)
    return y, {"overflow": overflow}


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None):
    """Dropless MoE over all tokens; inside a mesh, per device in shard_map (see MeshLayout)."""
    expert_parallel = functools.partial(expert_parallel_moe, num_experts=cfg.num_experts, axis_name="expert",
                                        buffer_factor=cfg.ragged_buffer_factor)
    return run_on_mesh(x_TD, routing, w, rules, local_moe, expert_parallel)

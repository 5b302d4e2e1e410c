"""Where a dropless MoE runs on the mesh (`ragged` and `te_dropless` both): per device in shard_map, tokens
split over the batch axes, each device's experts' weights gathered over FSDP inside, in the compute dtype.

    layout = mesh_layout(rules)                       # None outside a mesh: everything is local
    y_TD, stats = run_on_mesh(x_TD, routing, w, rules, local, expert_parallel)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe.router import Routing
from MaxText.parallel.sharding import logical_to_spec


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
    # config.check_logical_axis_rules makes sure `expert` splits the batch too when it splits the experts.
    return MeshLayout(_mesh_axes("activation_batch", rules), _mesh_axes("activation_mlp", rules),
                      mesh.shape.get("expert", 1),
                      _axes(logical_to_spec(("exp", "embed", "mlp"), rules)[1]))  # how the weights' D is split


def run_on_mesh(x_TD, routing: Routing, w, rules, local, expert_parallel, check_vma: bool = True, chunks: int = 1):
    """Runs a dropless MoE where it belongs: `local(x, experts, weights, wi_0, wi_1, wo) -> y` outside a mesh
    or without expert parallelism, `expert_parallel(same) -> (y, overflow)` with it, per device in
    shard_map (see MeshLayout). With `chunks` > 1 (num_moe_token_chunks) expert_parallel runs on that many
    consecutive slices of the device's tokens, each with its own exchanges: a slice's all-to-all does not wait
    for another's GEMMs, so the scheduler may overlap them; the result is the same. Returns (y_TD,
    {"overflow": slots that did not fit})."""
    layout = mesh_layout(rules)
    if layout is None:
        y = local(x_TD, routing.experts_TK, routing.weights_TK, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD)
        return y, {"overflow": jnp.zeros((), jnp.float32)}

    def per_device(x, experts, weights, *w_):
        if layout.num_ep == 1:
            return local(x, experts, weights, *w_), jnp.zeros((), jnp.int32)
        t = x.shape[0]
        bounds = sorted({t * i // chunks for i in range(chunks + 1)})  # static; fewer slices than chunks if t < chunks
        parts = [expert_parallel(x[a:b], experts[a:b], weights[a:b], *w_) for a, b in zip(bounds, bounds[1:])]
        return jnp.concatenate([y for y, _ in parts]), sum(o for _, o in parts)

    y, overflow = layout.run(per_device, x_TD, routing, w, check_vma)
    return y, {"overflow": overflow}

"""Where a dropless MoE runs on the mesh (`ragged` and `te_dropless` both): per device in shard_map, tokens
split over the batch axes, each device's experts' weights gathered over FSDP inside, in the compute dtype.

    layout = mesh_layout(rules)                                   # LOCAL outside a mesh
    y_TD, overflow = layout.run(body, (x_TD, experts_TK, weights_TK), w, check_vma)
    # body(x, experts, weights, w) runs on each device's share and calls layout.gather(w, dtype) first and
    # layout.reduce(y, overflow) last
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.gmm import cast_varying
from MaxText.parallel.sharding import context_axes, logical_to_spec, spec_axes


def slice_scope(scheme: str, k: int, count: int):
    """The JAX name scope of slice k of `count` (scheme moe_chunk: num_moe_token_chunks; batch_split: the parts of
    use_batch_split_schedule), none when there is one: XLA keeps it in each instruction's metadata, where
    MaxText.planning.overlap reads which slice's exchange waits for which slice's compute."""
    return jax.named_scope(f"{scheme}{k}") if count > 1 else contextlib.nullcontext()


def split_batch(x, parts: int):
    """[B, ...] as `parts` arrays [B / parts, ...], part k the rows k, k + parts, k + 2 parts, ...: a device's rows
    stay on it (B splits as [B / parts, parts], the sharded batch dim the major one), so splitting moves nothing."""
    b = x.shape[0]
    return tuple(x.reshape(b // parts, parts, *x.shape[1:])[:, k] for k in range(parts))


def merge_batch(xs: tuple):
    """split_batch's inverse: each device's rows stay on it (a concatenation of the parts would move them)."""
    return jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:])


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


class Gathered(ExpertWeights):
    """Expert weights gathered once for every part of a split batch (MeshLayout.gather_once): each device's
    whole copy of its experts' weights, [1, E/ep, D, F], on a leading dim split over the axes they were gathered
    over and the data axes (MeshLayout._replicas), so that each part's shard_map takes that copy as it is and its
    gradient stays the device's own until the gather's backward reduce-scatters the parts' sum once."""

    __slots__ = ()


class MeshLayout(NamedTuple):
    """How a per-device MoE function sits on the mesh: tokens split over the batch axes; expert weights enter
    in their own sharding (E over `expert`, D over the `embed` axes: fsdp, F over the `mlp` axes) and are
    gathered over D inside, in the compute dtype (gather_for_compute). LOCAL (outside a mesh) runs the body
    as it is, on every token and expert."""
    batch: tuple
    mlp: tuple
    num_ep: int
    embed: tuple = ()  # mesh axes splitting the expert weights' model dim D (the param's `embed` sharding)
    on_mesh: bool = True

    def run(self, body, token_arrays, w: ExpertWeights, check_vma: bool = True):
        """shard_map of body(*token_arrays, w) -> (y, overflow), every token array split over the batch axes on
        its leading dim and y too. check_vma=False for bodies with Transformer Engine's custom VJPs, whose
        abstract values carry no manual-axis type (JAX's check rejects them)."""
        if not self.on_mesh:
            return body(*token_arrays, w)
        tokens = P(self.batch or None)
        weights = self._gathered_specs() if isinstance(w, Gathered) else self._weight_specs()
        return jax.shard_map(body, in_specs=(*(tokens,) * len(token_arrays), weights), out_specs=(tokens, P()),
                             check_vma=check_vma)(*token_arrays, w)

    def _expert_axis(self):
        """The mesh axis splitting the experts (E), None without expert parallelism."""
        return "expert" if self.num_ep > 1 else None

    def _weight_specs(self) -> ExpertWeights:
        exp, f, d = self._expert_axis(), (self.mlp or None), (self.embed or None)
        return ExpertWeights(P(exp, d, f), P(exp, d, f), P(exp, f, d))

    def _replicas(self) -> tuple:
        """The axes a device's copy of gathered weights is its own over (gather_once): those it was gathered over,
        then the batch's others but `expert`, so that no part's backward sums it there (over the data axes the
        weight's own shard is summed once, after the reduce-scatter)."""
        return self.embed + tuple(a for a in self.batch if a not in (*self.embed, self._expert_axis()))

    def _gathered_specs(self) -> Gathered:
        exp, f, r = self._expert_axis(), (self.mlp or None), self._replicas()
        return Gathered(P(r, exp, None, f), P(r, exp, None, f), P(r, exp, f, None))

    def gather(self, w: ExpertWeights, dtype) -> ExpertWeights:
        """Inside run's body: this device's experts' whole weights, in `dtype` (LOCAL: w as it is; gather_once's:
        the device's copy)."""
        if not self.on_mesh:
            return w
        if isinstance(w, Gathered):
            return ExpertWeights(*(a[0].astype(dtype) for a in w))
        return ExpertWeights(gather_for_compute(w.wi_0_EDF, self.embed, 1, dtype),
                             gather_for_compute(w.wi_1_EDF, self.embed, 1, dtype),
                             gather_for_compute(w.wo_EFD, self.embed, 2, dtype))

    def gather_once(self, w: ExpertWeights, dtype) -> ExpertWeights:
        """The weights gathered over FSDP once, for run's bodies to take as they are (Gathered), where the parts
        of a split batch would each gather them again (and reduce-scatter their gradients again: twice the FSDP
        traffic of one batch, as the compiled step showed). w itself where nothing is gathered."""
        if not self.on_mesh or not self.embed:
            return w

        def once(w):
            return Gathered(*(cast_varying(a, frozenset(self._replicas()))[None] for a in self.gather(w, dtype)))

        return jax.shard_map(once, in_specs=(self._weight_specs(),), out_specs=self._gathered_specs())(w)

    def reduce(self, y, overflow):
        """Inside run's body, its result: the tensor shards' partial outputs added up (each holds a slice of F)
        and the devices' overflow counts summed, as float32."""
        if self.mlp:
            y = jax.lax.psum(y, self.mlp)
        overflow = jax.lax.psum(overflow, self.batch) if self.batch else overflow
        return y, jnp.asarray(overflow).astype(jnp.float32)


LOCAL = MeshLayout((), (), 1, (), on_mesh=False)


def _mesh_axes(logical: str, rules) -> tuple:
    return spec_axes(logical_to_spec((logical,), rules)[0])


def mesh_layout(rules) -> MeshLayout:
    """The layout in the current mesh, or LOCAL outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return LOCAL
    # config.check_logical_axis_rules makes sure `expert` splits the batch too when it splits the experts.
    # Tokens [B * L] split over the batch axes, then over the length's with context parallelism (B's shards are the
    # major ones when [B, L] flattens).
    tokens = _mesh_axes("activation_batch", rules) + context_axes(rules)
    return MeshLayout(tokens, _mesh_axes("activation_mlp", rules),
                      mesh.shape.get("expert", 1),
                      spec_axes(logical_to_spec(("exp", "embed", "mlp"), rules)[1]))  # how the weights' D is split

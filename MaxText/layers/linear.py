"""The dense GEMMs of the attention projections, the dense MLPs and the shared experts: one einsum in the
activation dtype, or, under upstream's `quantization`, Transformer Engine's dense() with that recipe's quantizer
set (FP8, MXFP8 or NVFP4 operands, forward and both gradients; te_kernels.quantizer_set, the grouped GEMMs' own).
NVFP4 rounds the output gradient stochastically: inside `stochastic_rounding(key)` (the train step's, a new key
each step) every GEMM call site draws from its own stream of that key.

Everything else keeps its precision: the embedding, the output head, the router, the norms and the attention
core (scores, softmax, values) never come here.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.config.checks import nvfp4_rht
from MaxText.config.schema import QUANTIZATION_RECIPES
from MaxText.layers.moe.te_kernels import quantizer_set
from MaxText.layers.moe.te_runtime import import_te
from MaxText.parallel.checks import DATA_AXES
from MaxText.parallel.sharding import logical_to_spec, spec_axes


def contracting_dims(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The contracted positions of an einsum "xs,ws->out" of two operands: (in x, in w)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    shared = [c for c in x if c in w and c not in out]
    return tuple(x.index(c) for c in shared), tuple(w.index(c) for c in shared)


def _whole(spec: P) -> P:
    """A weight's sharding with its FSDP shards gathered (every data axis and the context axis taken off; the tensor
    axis kept), as XLA gathers a weight for an einsum."""
    return P(*(tuple(a for a in spec_axes(axes) if a not in (*DATA_AXES, "context")) or None for axes in spec))


_ONCE: list = []  # {(layer, weight name): gathered weight} of the innermost gather_once


@contextlib.contextmanager
def gather_once(parts: int):
    """Within (the `parts` parts of a split batch running one layer: use_batch_split_schedule; nothing for one): each
    dense weight a layer reads (DenseGemms._weight) is cast and FSDP-gathered once for every part, where XLA's
    partitioner gathered it again at each part's GEMM. Its gradient is the parts' sum; each part's GEMM still
    reduces its own share over the data axes in the partitioned module (XLA's GPU passes may reassociate the pair:
    not verified)."""
    if parts == 1:
        yield
        return
    _ONCE.append({})
    try:
        yield
    finally:
        _ONCE.pop()


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_and_gather(w, dtype, sharded: P, whole: P):
    """w cast to dtype in its own sharding, then gathered to `whole` (the cast first: the gather moves dtype's
    bytes). The gradient comes back in w's dtype, constrained to w's sharding (the transpose of the constraints
    would constrain it whole first: an all-reduce where a reduce-scatter does)."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(w.astype(dtype), sharded), whole)


def _cast_and_gather_fwd(w, dtype, sharded, whole):
    return _cast_and_gather(w, dtype, sharded, whole), jnp.zeros((0,), w.dtype)  # the residual carries w's dtype


def _cast_and_gather_bwd(dtype, sharded, whole, empty, g):
    return (jax.lax.with_sharding_constraint(g.astype(empty.dtype), sharded),)


_cast_and_gather.defvjp(_cast_and_gather_fwd, _cast_and_gather_bwd)


_STREAMS: list = []  # [key, call sites drawn so far] of the innermost stochastic_rounding


@contextlib.contextmanager
def stochastic_rounding(key):
    """Within: each NVFP4 GEMM call site traced rounds its output gradient from its own stream of `key` (JAX's
    fold-in of the call's number). Outside (evaluation, no gradient): a fixed key."""
    _STREAMS.append([key, 0])
    try:
        yield
    finally:
        _STREAMS.pop()


def _next_stream():
    if not _STREAMS:
        return None
    _STREAMS[-1][1] += 1
    return jax.random.fold_in(_STREAMS[-1][0], _STREAMS[-1][1])


def dense_gemm(spec: str, x, w, quantization: str = "none"):
    """einsum(spec, x, w) with w already in x's dtype (and, for TE, gathered: DenseGemms._weight). The contracted dims
    must be x's last and w's first, the output x's free dims then w's (every projection here): what TE's dense()
    computes in the recipe's precision."""
    if quantization == "none":
        return jnp.einsum(spec, x, w)
    te = import_te()
    dims = contracting_dims(spec)
    recipe = QUANTIZATION_RECIPES[quantization]
    if recipe.startswith("nvfp4"):
        width_in = math.prod(w.shape[i] for i in dims[1])
        recipe = "nvfp4" if nvfp4_rht(quantization, width_in, w.size // width_in) else "nvfp4_no_rht"
    return te["dense"].dense(x, w, contracting_dims=dims,
                             quantizer_set=quantizer_set(te, recipe, 1, sr_key=_next_stream()))


class DenseGemms:
    """For a layer whose projections go through dense_gemm: its class's AXES (weight name -> logical axes, the
    parameter's own) and its dtype, quantization and rules."""

    AXES: dict = {}

    def _weight(self, name: str):
        """The weight `name` in the compute dtype, for a GEMM: on a mesh, for TE's dense() and inside gather_once (once
        for every part of a split batch), cast on its shards and then gathered (_cast_and_gather); elsewhere cast, for
        XLA's partitioner to gather at the einsum in the compute dtype. TE's dense() takes it gathered: handed an
        FSDP-sharded weight, TE's partitioner keeps the weight's sharding in its output, which clashes with a batch
        split over some of the same axes (data 2 x expert 4: P(('data', 'expert'), None, 'expert'), found running
        TE's partitioner on CPU), and quantizes each shard on its own (MXFP8 would need 32-row shards); handed the
        cast weight constrained whole, XLA's partitioner gathered the float32 master weight, twice the bytes."""
        w = getattr(self, name)[...]
        if self.rules is None or jax.sharding.get_abstract_mesh().empty or not (_ONCE or self.quantization != "none"):
            return w.astype(self.dtype)
        cache, key = (_ONCE[-1] if _ONCE else {}), (id(self), name)
        if key not in cache:
            spec = logical_to_spec(self.AXES[name], self.rules)
            cache[key] = _cast_and_gather(w, self.dtype, spec, _whole(spec))
        return cache[key]

    def _gemm(self, spec: str, x, name: str):
        return dense_gemm(spec, x, self._weight(name), self.quantization)

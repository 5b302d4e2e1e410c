"""The dense GEMMs of the attention projections, the dense MLPs and the shared experts: one einsum in the
activation dtype, or, under upstream's `quantization`, Transformer Engine's dense() with that recipe's quantizer
set (FP8 or MXFP8 operands, forward and both gradients; te_kernels.quantizer_set is the grouped GEMMs' own).

Everything else keeps its precision: the embedding, the output head, the router, the norms and the attention
core (scores, softmax, values) never come here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.config.schema import QUANTIZATION_RECIPES
from MaxText.layers.moe.te_kernels import quantizer_set
from MaxText.layers.moe.te_runtime import import_te
from MaxText.parallel.checks import DATA_AXES
from MaxText.parallel.sharding import logical_to_spec


def contracting_dims(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The contracted positions of an einsum "xs,ws->out" of two operands: (in x, in w)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    shared = [c for c in x if c in w and c not in out]
    return tuple(x.index(c) for c in shared), tuple(w.index(c) for c in shared)


def gathered(w, logical, rules):
    """w with its FSDP shards gathered (every data axis taken off its sharding; the tensor axis kept), as XLA
    gathers a weight for an einsum. TE's dense() partitions by its own rules: handed an FSDP-sharded weight it
    keeps the weight's sharding in its output, which clashes with a batch split over some of the same axes
    (data 2 x expert 4: P(('data', 'expert'), None, 'expert'), found running TE's partitioner on CPU), and it
    quantizes each shard on its own (MXFP8 would need 32-row shards)."""
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return w
    spec = logical_to_spec(logical, rules)
    kept = [tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in DATA_AXES) or None
            for axes in spec]
    return jax.lax.with_sharding_constraint(w, P(*kept))


def dense_gemm(spec: str, x, w, quantization: str = "none", logical=(), rules=None):
    """einsum(spec, x, w) with w already in x's dtype and `logical` its logical axes. The contracted dims must be x's
    last and w's first, the output x's free dims then w's (every projection here): what TE's dense() computes in
    the recipe's precision, on the gathered weight."""
    if quantization == "none":
        return jnp.einsum(spec, x, w)
    te = import_te()
    return te["dense"].dense(x, gathered(w, logical, rules), contracting_dims=contracting_dims(spec),
                             quantizer_set=quantizer_set(te, QUANTIZATION_RECIPES[quantization], 1))


class DenseGemms:
    """For a layer whose projections go through dense_gemm: its class's AXES (weight name -> logical axes, the
    parameter's own) and its dtype, quantization and rules."""

    AXES: dict = {}

    def _gemm(self, spec: str, x, name: str):
        w = getattr(self, name)[...].astype(self.dtype)
        return dense_gemm(spec, x, w, self.quantization, self.AXES[name], self.rules)

"""The dense GEMMs of the attention projections, the dense MLPs and the shared experts: one einsum in the
activation dtype, or, under upstream's `quantization`, Transformer Engine's dense() with that recipe's quantizer
set (FP8 or MXFP8 operands, forward and both gradients; te_kernels.quantizer_set is the grouped GEMMs' own).

Everything else keeps its precision: the embedding, the output head, the router, the norms and the attention
core (scores, softmax, values) never come here.
"""

from __future__ import annotations

import jax.numpy as jnp

from MaxText.layers.moe.te_kernels import quantizer_set
from MaxText.layers.moe.te_runtime import import_te

# upstream's `quantization` -> te_kernels' name of the same TE recipe
RECIPES = {"te_fp8_currentscaling": "fp8_current", "te_mxfp8": "mxfp8"}


def contracting_dims(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The contracted positions of an einsum "xs,ws->out" of two operands: (in x, in w)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    shared = [c for c in x if c in w and c not in out]
    return tuple(x.index(c) for c in shared), tuple(w.index(c) for c in shared)


def dense_gemm(spec: str, x, w, quantization: str = "none"):
    """einsum(spec, x, w) with w already in x's dtype. The contracted dims must be x's last and w's first, the
    output x's free dims then w's (every projection here): what TE's dense() computes in the recipe's precision."""
    if quantization == "none":
        return jnp.einsum(spec, x, w)
    te = import_te()
    return te["dense"].dense(x, w, contracting_dims=contracting_dims(spec),
                             quantizer_set=quantizer_set(te, RECIPES[quantization], 1))

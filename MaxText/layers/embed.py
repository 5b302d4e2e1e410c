"""Token embedding and the output (logits) projection, tied or untied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.params import fan_in_init, param


class Embed(nnx.Module):
    """embedding [V, D]; with logits_via_embedding the same matrix projects back to the vocabulary."""

    def __init__(self, cfg, *, dtype, weight_dtype, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.base_emb_dim
        self.embedding = param(rngs, nnx.initializers.normal(1.0), (v, d), ("vocab", "embed"), weight_dtype)
        self.tied = cfg.logits_via_embedding
        if not self.tied:
            self.logits_dense = param(rngs, fan_in_init(0, 1), (d, v), ("embed", "vocab"), weight_dtype)
        self.dtype = dtype

    def __call__(self, tokens_BL):
        return jnp.take(self.embedding[...], tokens_BL, axis=0).astype(self.dtype)

    def logits(self, x_BLD):
        """float32 logits [B, L, V]."""
        if self.tied:
            # The embedding rows have unit-variance entries; 1/sqrt(D) keeps initial logits O(1).
            w_DV = self.embedding[...].astype(self.dtype).T * (x_BLD.shape[-1] ** -0.5)
        else:
            w_DV = self.logits_dense[...].astype(self.dtype)
        return logits_dot(x_BLD, w_DV)


@jax.custom_vjp
def logits_dot(x_BLD, w_DV):
    """x @ w accumulated and returned in float32 (the loss wants float32 logits), with a backward in the inputs'
    dtype: the logits' cotangent is rounded to it before the two transposed matmuls, as a bf16 logits matmul
    would have it. Left to autodiff, the float32 cotangent would promote the backward matmuls to float32 and
    the FSDP all-gather of w and the reduce-scatter of its gradient (V x D, the largest weight) with them."""
    return jnp.einsum("bld,dv->blv", x_BLD, w_DV, preferred_element_type=jnp.float32)


def _logits_dot_fwd(x_BLD, w_DV):
    return logits_dot(x_BLD, w_DV), (x_BLD, w_DV)


def _logits_dot_bwd(residuals, g_BLV):
    x_BLD, w_DV = residuals
    g_BLV = g_BLV.astype(x_BLD.dtype)
    dx = jnp.einsum("blv,dv->bld", g_BLV, w_DV, preferred_element_type=jnp.float32).astype(x_BLD.dtype)
    dw = jnp.einsum("bld,blv->dv", x_BLD, g_BLV, preferred_element_type=jnp.float32).astype(w_DV.dtype)
    return dx, dw


logits_dot.defvjp(_logits_dot_fwd, _logits_dot_bwd)

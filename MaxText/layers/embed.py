"""Token embedding and the output (logits) projection, tied or untied."""

from __future__ import annotations

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
        return jnp.einsum("bld,dv->blv", x_BLD, w_DV, preferred_element_type=jnp.float32)

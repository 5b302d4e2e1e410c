"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.params import param


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 (the reduction loses too much in bf16)."""

    def __init__(self, dim: int, *, epsilon: float, dtype, weight_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), weight_dtype)
        self.epsilon = epsilon
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)

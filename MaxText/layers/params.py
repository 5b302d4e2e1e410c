"""How parameters are made: initialiser, parameter dtype and logical axes in one call."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    """An nnx.Param holding `init(key, shape, dtype)`, tagged with its logical axis names.

    Sharding is applied later, all at once, by jitting the initialiser with out_shardings
    (so no parameter is ever materialised whole on one device), hence eager_sharding=False.
    """
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes), eager_sharding=False)


def fan_in_init(in_axis=0, out_axis=-1, batch_axis=()):
    """Truncated-normal with variance 1/fan_in, the usual init for projections."""
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis)


def dtype_of(name: str):
    """jnp dtype from its config name (float32, bfloat16, float16)."""
    return jnp.dtype(name)

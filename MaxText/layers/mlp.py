"""SwiGLU feed-forward block: wo(silu(x wi_0) * (x wi_1))."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.params import fan_in_init, param
from MaxText.parallel.sharding import constrain


class MLP(nnx.Module):
    """The dense MLP of a decoder layer."""

    def __init__(self, dim: int, hidden: int, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        self.wi_0 = param(rngs, fan_in_init(0, 1), (dim, hidden), ("embed", "mlp"), weight_dtype)
        self.wi_1 = param(rngs, fan_in_init(0, 1), (dim, hidden), ("embed", "mlp"), weight_dtype)
        self.wo = param(rngs, fan_in_init(0, 1), (hidden, dim), ("mlp", "embed"), weight_dtype)
        self.dtype = dtype
        self.rules = rules

    def __call__(self, x_BLD):
        dt = self.dtype
        gate = checkpoint_name(x_BLD @ self.wi_0[...].astype(dt), "mlpwi_0")
        up = checkpoint_name(x_BLD @ self.wi_1[...].astype(dt), "mlpwi_1")
        h = constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"), self.rules)
        out = checkpoint_name(h @ self.wo[...].astype(dt), "mlpwo")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)

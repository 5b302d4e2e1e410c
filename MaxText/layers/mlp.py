"""SwiGLU feed-forward block: wo(silu(x wi_0) * (x wi_1))."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.linear import dense_gemm
from MaxText.layers.params import fan_in_init, param
from MaxText.parallel.sharding import constrain


class MLP(nnx.Module):
    """The dense MLP of a decoder layer."""

    def __init__(self, dim: int, hidden: int, *, dtype, weight_dtype, rules, rngs: nnx.Rngs, quantization="none"):
        self.wi_0 = param(rngs, fan_in_init(0, 1), (dim, hidden), ("embed", "mlp"), weight_dtype)
        self.wi_1 = param(rngs, fan_in_init(0, 1), (dim, hidden), ("embed", "mlp"), weight_dtype)
        self.wo = param(rngs, fan_in_init(0, 1), (hidden, dim), ("mlp", "embed"), weight_dtype)
        self.quantization = quantization  # upstream's `quantization`: linear.dense_gemm
        self.dtype = dtype
        self.rules = rules

    def __call__(self, x_BLD):
        dt, qz = self.dtype, self.quantization
        gate = checkpoint_name(dense_gemm("bld,df->blf", x_BLD, self.wi_0[...].astype(dt), qz), "mlpwi_0")
        up = checkpoint_name(dense_gemm("bld,df->blf", x_BLD, self.wi_1[...].astype(dt), qz), "mlpwi_1")
        h = constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"), self.rules)
        out = checkpoint_name(dense_gemm("blf,fd->bld", h, self.wo[...].astype(dt), qz), "mlpwo")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)

"""SwiGLU feed-forward block: wo(silu(x wi_0) * (x wi_1))."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.linear import DenseGemms
from MaxText.layers.params import fan_in_init, param
from MaxText.parallel.sharding import constrain


# Each projection's logical axes: its parameter's and what linear.dense_gemm gathers it by (DenseGemms).
AXES = {"wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"), "wo": ("mlp", "embed")}


class MLP(DenseGemms, nnx.Module):
    """The dense MLP of a decoder layer."""

    AXES = AXES

    def __init__(self, dim: int, hidden: int, *, dtype, weight_dtype, rules, rngs: nnx.Rngs, quantization="none"):
        self.wi_0 = param(rngs, fan_in_init(0, 1), (dim, hidden), AXES["wi_0"], weight_dtype)
        self.wi_1 = param(rngs, fan_in_init(0, 1), (dim, hidden), AXES["wi_1"], weight_dtype)
        self.wo = param(rngs, fan_in_init(0, 1), (hidden, dim), AXES["wo"], weight_dtype)
        self.quantization = quantization  # upstream's `quantization`: linear.dense_gemm
        self.dtype = dtype
        self.rules = rules

    def __call__(self, x_BLD):
        gate = checkpoint_name(self._gemm("bld,df->blf", x_BLD, "wi_0"), "mlpwi_0")
        up = checkpoint_name(self._gemm("bld,df->blf", x_BLD, "wi_1"), "mlpwi_1")
        h = constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"), self.rules)
        out = checkpoint_name(self._gemm("blf,fd->bld", h, "wo"), "mlpwo")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)

"""The MoE layer module: router gate and expert weights, computed by the impl `moe_impl` names."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from MaxText.layers.moe import dense
from MaxText.layers.moe.router import route
from MaxText.layers.params import fan_in_init, param
from MaxText.sharding import constrain


class ExpertWeights(NamedTuple):
    wi_0_EDF: jax.Array
    wi_1_EDF: jax.Array
    wo_EFD: jax.Array


# moe_impl -> moe_ffn(x_TD, routing, ExpertWeights, cfg, rules) -> (y_TD, stats)
MOE_FFNS = {"dense": dense.moe_ffn}


class MoeBlock(nnx.Module):
    """Routed experts. Weight names, shapes and logical axes are the same under every moe_impl, so one
    checkpoint restores under any of them."""

    def __init__(self, cfg, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.base_emb_dim, cfg.base_moe_mlp_dim
        self.gate = param(rngs, fan_in_init(0, 1), (d, e), ("embed", None), weight_dtype)
        self.wi_0 = param(rngs, fan_in_init(1, 2, 0), (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.wi_1 = param(rngs, fan_in_init(1, 2, 0), (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.wo = param(rngs, fan_in_init(1, 2, 0), (e, f, d), ("exp", "mlp", "embed"), weight_dtype)
        self.cfg = cfg
        self.rules = rules

    def __call__(self, x_BLD):
        """Returns y_BLD and per-layer stats: lb_loss, load_E, dropped_fraction."""
        b, l, d = x_BLD.shape
        x_TD = x_BLD.reshape(b * l, d)
        routing = route(x_TD, self.gate[...], self.cfg)
        weights = ExpertWeights(self.wi_0[...], self.wi_1[...], self.wo[...])
        y_TD, stats = MOE_FFNS[self.cfg.moe_impl](x_TD, routing, weights, self.cfg, self.rules)
        y_BLD = constrain(y_TD.reshape(b, l, d), ("activation_batch", "activation_length", "activation_embed"),
                          self.rules)
        return y_BLD, {"lb_loss": routing.lb_loss, "load_E": routing.load_E, **stats}

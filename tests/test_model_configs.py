"""Shipped model configs build the published architectures (counted on abstract params: nothing allocated)."""

import math

import jax
import pytest
from flax import nnx

from MaxText.config import load_config
from MaxText.layers.models import Transformer

# name: (total parameters, active parameters per token), as published.
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9)}


def parameter_counts(cfg):
    """(total, active per token): of the routed expert weights only K of E experts are active."""
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    total = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    experts = params.get("moe_layers", {}).get("layers", {}).get("moe", {})
    routed = sum(math.prod(experts[k].shape) for k in ("wi_0", "wi_1", "wo") if k in experts)
    inactive = routed * (cfg.num_experts - cfg.num_experts_per_tok) / cfg.num_experts
    return total, total - inactive


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published(name):
    total, active = parameter_counts(load_config([f"model_name={name}"]))
    want_total, want_active = PUBLISHED[name]
    assert abs(total / want_total - 1) < 0.01, f"{name}: {total / 1e9:.2f}B total, published {want_total / 1e9}B"
    assert abs(active / want_active - 1) < 0.02, f"{name}: {active / 1e9:.2f}B active, published {want_active / 1e9}B"

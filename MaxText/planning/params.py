"""The model's parameters without allocating them: their abstract tree (jax.eval_shape over the real model) and
their counts, total and active per token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from MaxText.layers.models import Transformer

def abstract_params(cfg):
    """The model's parameters as a pure dict of ShapeDtypeStructs (nothing allocated)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


class ParameterCounts(NamedTuple):
    total: int          # every parameter, the Multi-Token Prediction depths included
    active: float       # used per token by the main model: of the routed experts only K of E are active
    mtp: int            # of total, in the Multi-Token Prediction depths
    mtp_active: float   # of those, used per token


def _count(tree) -> int:
    return sum(math.prod(p.shape) for p in jax.tree.leaves(tree))


def _active(cfg, tree) -> float:
    """Parameters of `tree` used per token: its routed expert weights count K/E of their size."""
    routed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(k, "key", None) for k in path]
        if len(keys) > 1 and keys[-2] == "moe" and keys[-1] in ("wi_0", "wi_1", "wo"):  # not shared_experts
            routed += math.prod(leaf.shape)
    inactive = routed * (cfg.num_experts - cfg.num_experts_per_tok) / cfg.num_experts
    return _count(tree) - inactive


def parameter_counts(cfg, params=None) -> ParameterCounts:
    """Total and active-per-token parameter counts of cfg's model (or of its abstract `params`, when the
    caller already has them), and those of its MTP depths."""
    params = abstract_params(cfg) if params is None else params
    mtp = params.get("mtp", {})
    main = {k: v for k, v in params.items() if k != "mtp"}
    return ParameterCounts(_count(params), _active(cfg, main), _count(mtp), _active(cfg, mtp))


# ----------------------------------------------------------------------------------- state bytes per device

"""`moe_impl=dense`: GShard-style capacity dispatch with one-hot einsums (the baseline that drops tokens).

Capacity is counted per group of L tokens (one sequence, as in MaxText), with every token's first
choice served before any second choice. capacity_factor=null means no cap: C = S, which holds every
token because a token picks distinct experts. Dropped token-slots contribute nothing to the output.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.config.checks import capacity  # C of this layer, pure arithmetic: also checked at start-up
from MaxText.layers.moe.router import Routing
from MaxText.parallel.sharding import constrain


def dispatch_masks(experts_GLK, weights_GLK, num_experts: int, cap: int, valid_GL=None):
    """One-hot dispatch [G,L,E,C] (0/1) and combine [G,L,E,C] (weights) tensors, plus the kept mask [G,L,K].
    Padding (outside valid_GL) takes no capacity and is not kept."""
    g, s, k = experts_GLK.shape
    onehot_GLKE = jax.nn.one_hot(experts_GLK, num_experts, dtype=jnp.int32)
    if valid_GL is not None:
        onehot_GLKE = onehot_GLKE * valid_GL[:, :, None, None].astype(jnp.int32)
    # Priority order: all first choices of the group, then all second choices, ...
    onehot_GKLE = onehot_GLKE.transpose(0, 2, 1, 3).reshape(g, k * s, num_experts)
    position_GKLE = (jnp.cumsum(onehot_GKLE, axis=1) - 1).reshape(g, k, s, num_experts)
    position_GLK = jnp.sum(position_GKLE.transpose(0, 2, 1, 3) * onehot_GLKE, axis=-1)
    kept_GLK = position_GLK < cap
    if valid_GL is not None:
        kept_GLK = kept_GLK & valid_GL[:, :, None]
    slot_GLKC = jax.nn.one_hot(jnp.where(kept_GLK, position_GLK, cap), cap, dtype=jnp.float32)
    dispatch_GLEC = jnp.einsum("gske,gskc->gsec", onehot_GLKE.astype(jnp.float32), slot_GLKC)
    combine_GLEC = jnp.einsum("gske,gskc,gsk->gsec", onehot_GLKE.astype(jnp.float32), slot_GLKC, weights_GLK)
    return dispatch_GLEC, combine_GLEC, kept_GLK


def moe_ffn(x_TD, routing: Routing, w, cfg, rules=None):
    """y_TD = sum over kept (token, expert) slots of weight * SwiGLU_expert(x). Returns (y_TD, {"overflow": real
    slots past their expert's capacity})."""
    t, d = x_TD.shape
    num_experts = w.wi_0_EDF.shape[0]
    s = cfg.max_target_length if t % cfg.max_target_length == 0 else t
    g = t // s
    cap = capacity(s, num_experts, cfg.num_experts_per_tok, cfg.capacity_factor)
    dt = x_TD.dtype
    with jax.named_scope("moe_dispatch"):
        valid_GL = None if routing.valid_T is None else routing.valid_T.reshape(g, s)
        dispatch, combine, kept_GLK = dispatch_masks(
            routing.experts_TK.reshape(g, s, -1), routing.weights_TK.reshape(g, s, -1), num_experts, cap, valid_GL)
        x_GLD = x_TD.reshape(g, s, d)
        x_EGCD = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dt), x_GLD)
        x_EGCD = constrain(x_EGCD, ("exp", "activation_batch", None, "activation_embed"), rules)
    def matmul(spec, a, b):  # accumulated in float32, rounded once to the compute dtype (as gmm.py's)
        return jnp.einsum(spec, a, b.astype(dt), preferred_element_type=jnp.float32).astype(dt)

    with jax.named_scope("moe_grouped_gemm"):  # batched per-expert matmuls over capacity buffers
        gate = checkpoint_name(matmul("egcd,edf->egcf", x_EGCD, w.wi_0_EDF), "moe_mlpwi_0")
        up = checkpoint_name(matmul("egcd,edf->egcf", x_EGCD, w.wi_1_EDF), "moe_mlpwi_1")
        h = jax.nn.silu(gate) * up
        out_EGCD = checkpoint_name(matmul("egcf,efd->egcd", h, w.wo_EFD), "moe_mlpwo")
        out_EGCD = constrain(out_EGCD, ("exp", "activation_batch", None, "activation_embed"), rules)
    with jax.named_scope("moe_combine"):  # the router-weighted sum in float32, as ragged's (float32 weights)
        y_GLD = jnp.einsum("gsec,egcd->gsd", combine, out_EGCD.astype(jnp.float32)).astype(dt)
    real_slots = kept_GLK.size if valid_GL is None else jnp.sum(valid_GL) * kept_GLK.shape[-1]
    return y_GLD.reshape(t, d), {"overflow": real_slots - jnp.sum(kept_GLK.astype(jnp.float32))}

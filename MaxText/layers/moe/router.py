"""Token -> expert routing shared by every MoE implementation: softmax top-k and the load-balance loss."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    weights_TK: jax.Array   # float32 combine weight of each chosen expert
    experts_TK: jax.Array   # int32 chosen expert ids, distinct per token, best first
    probs_TE: jax.Array     # float32 router probabilities over all experts
    lb_loss: jax.Array      # scalar load-balance loss (unweighted; 1.0 when perfectly balanced)
    load_E: jax.Array       # float32 token-slots assigned to each expert


def route(x_TD, gate_DE, cfg) -> Routing:
    """Softmax over expert logits (float32), top-k, optional renormalisation of the k weights."""
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), gate_DE.astype(jnp.float32))
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_TK, experts_TK = jax.lax.top_k(probs_TE, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    num_experts = gate_DE.shape[-1]
    load_E = jnp.sum(jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.float32), axis=(0, 1))
    return Routing(weights_TK, experts_TK.astype(jnp.int32), probs_TE,
                   load_balance_loss(load_E, probs_TE), load_E)


def load_balance_loss(load_E, probs_TE):
    """Switch-Transformer loss E * sum_e f_e * p_e, with f_e the fraction of token-slots sent to expert e
    and p_e its mean router probability; 1.0 at a perfectly uniform routing."""
    num_experts = probs_TE.shape[-1]
    fraction_E = load_E / jnp.sum(load_E)
    return num_experts * jnp.sum(fraction_E * jnp.mean(probs_TE, axis=0))

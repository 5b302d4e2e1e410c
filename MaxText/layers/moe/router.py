"""Token -> expert routing, shared by every MoE implementation.

Scores are softmax or sigmoid of the gate logits (float32). An optional per-expert bias (DeepSeek-V3's
aux-loss-free balancing) is added for *selection only*; the combine weights are the unbiased scores of
the chosen experts, optionally renormalised (norm_topk_prob) and scaled (routed_scaling_factor).
Group-limited routing first keeps each token's best `topk_routing_group` of `n_routing_groups` expert
groups, a group scored by the sum of its best K // topk_routing_group (biased) scores.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    weights_TK: jax.Array   # float32 combine weight of each chosen expert
    experts_TK: jax.Array   # int32 chosen expert ids, distinct per token, best first (TE's router: by id)
    lb_loss: jax.Array      # scalar load-balance loss, unweighted (1.0 when perfectly balanced)
    z_loss: jax.Array       # scalar router z-loss mean(logsumexp(logits)^2), unweighted
    load_E: jax.Array       # float32 token-slots assigned to each expert (real tokens only)
    entropy: jax.Array      # scalar mean entropy of the per-token expert distribution (nats)
    valid_T: jax.Array | None = None  # bool: a real token, not padding (None: all are)


def expert_scores(logits_TE, score_func: str):
    """Per-expert scores: softmax probabilities, or independent sigmoids."""
    if score_func == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    return jax.nn.sigmoid(logits_TE)


def top_k(x, k: int):
    """lax.top_k's (values, indices) over the last dim, ties to the lower index, by a stable sort. XLA's
    partitioner splits a sort over its other dims, but gathers the whole operand to every device for TopK
    (measured under jaxlib 0.12.0.1: every token's [T, E] scores, a 3 GB all-gather per MoE layer for
    DeepSeek-V3 at 3M tokens a step, and top-k over all of them on each device)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    negated, indices = jax.lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return -negated[..., :k], indices[..., :k]


def select_experts(scores_TE, bias_E, cfg):
    """(weights_TK, experts_TK): top-k on scores + bias within the kept groups; weights from unbiased scores."""
    k = cfg.num_experts_per_tok
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.astype(jnp.float32)
    if cfg.n_routing_groups is not None:
        t, e = choice_TE.shape
        grouped = choice_TE.reshape(t, cfg.n_routing_groups, e // cfg.n_routing_groups)
        if cfg.routing_group_score == "max":  # DeepSeek-V2: a group (a device) scores by its best expert
            group_score_TG = jnp.max(grouped, axis=-1)
        else:  # DeepSeek-V3: the sum of the group's best k / topk_routing_group scores
            group_score_TG = jnp.sum(top_k(grouped, max(1, k // cfg.topk_routing_group))[0], axis=-1)
        _, kept_groups = top_k(group_score_TG, cfg.topk_routing_group)
        kept_TG = jnp.sum(jax.nn.one_hot(kept_groups, cfg.n_routing_groups, dtype=jnp.int32), axis=1) > 0
        choice_TE = jnp.where(jnp.repeat(kept_TG, e // cfg.n_routing_groups, axis=1), choice_TE, -jnp.inf)
    _, experts_TK = top_k(choice_TE, k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, experts_TK.astype(jnp.int32)


def load_balance_loss(experts_TK, probs_TE, num_sequences: int = 1, valid_T=None):
    """Switch-Transformer loss E * sum_e f_e * p_e: f_e the fraction of token-slots sent to expert e, p_e
    its mean probability. Computed per sequence and averaged when num_sequences > 1 (DeepSeek-V3's
    sequence-wise variant); 1.0 at perfectly uniform routing either way. Tokens outside valid_T (padding)
    count in neither, and a sequence of padding alone is left out of the average."""
    t, e = probs_TE.shape
    n = num_sequences
    v_T = jnp.ones((t,), jnp.float32) if valid_T is None else valid_T.astype(jnp.float32)
    onehot = (jax.nn.one_hot(experts_TK, e, dtype=jnp.float32).sum(axis=1) * v_T[:, None]).reshape(n, t // n, e)
    fraction_SE = onehot.sum(axis=1) / jnp.maximum(jnp.sum(onehot, axis=(1, 2)), 1.0)[:, None]
    tokens_S = v_T.reshape(n, t // n).sum(axis=1)
    mean_prob_SE = (probs_TE * v_T[:, None]).reshape(n, t // n, e).sum(axis=1) / jnp.maximum(tokens_S, 1.0)[:, None]
    real_S = (tokens_S > 0).astype(jnp.float32)
    return e * jnp.sum(jnp.sum(fraction_SE * mean_prob_SE, axis=-1) * real_S) / jnp.maximum(jnp.sum(real_S), 1.0)


def _mean(x_T, v_T):
    """Mean of x over the real tokens (all of them when v_T is None)."""
    if v_T is None:
        return jnp.mean(x_T)
    return jnp.sum(x_T * v_T) / jnp.maximum(jnp.sum(v_T), 1.0)


def float32_logits(x_TD, gate_DE):
    """The router logits in float32 (every path but TE's fused block, te_block.gate_logits)."""
    return jnp.einsum("td,de->te", x_TD.astype(jnp.float32), gate_DE.astype(jnp.float32))


class Choice(NamedTuple):
    """route's per-token part: what the dispatch needs, and what the statistics are computed from."""
    logits_TE: jax.Array
    scores_TE: jax.Array
    weights_TK: jax.Array
    experts_TK: jax.Array


def route(x_TD, gate_DE, bias_E, cfg, topk=None, valid_T=None, logits=float32_logits) -> Routing:
    """Routes the T tokens of x (whole sequences of cfg.max_target_length tokens, in order).

    `topk(logits_TE, bias_E, cfg) -> (weights_TK, experts_TK)` replaces the selection (the te_dropless
    path passes Transformer Engine's fused router, which has these semantics); losses and statistics
    are computed here either way, over the real tokens (valid_T; None: every token is real); `logits(x_TD,
    gate_DE)` computes the logits (te_moe_block: as TE's block does). Padding is
    still routed (its outputs carry no loss weight) but is no load: not in load_E, so not in the bias
    update, nor in the balance loss, the z-loss or the entropy.
    """
    return routing_stats(choose(x_TD, gate_DE, bias_E, cfg, topk, logits), cfg, valid_T)


@jax.named_scope("moe_route")
def choose(x_TD, gate_DE, bias_E, cfg, topk=None, logits=float32_logits) -> Choice:
    """Each token's experts and combine weights (route's arguments), token by token: the parts of a split batch
    choose apart (none waits for another) and pool their choices for the statistics (routing_stats)."""
    logits_TE = logits(x_TD, gate_DE)
    scores_TE = expert_scores(logits_TE, cfg.routed_score_func)
    if topk is None:
        weights_TK, experts_TK = select_experts(scores_TE, bias_E, cfg)
    else:
        weights_TK, experts_TK = topk(logits_TE, bias_E, cfg)
    return Choice(logits_TE, scores_TE, weights_TK, experts_TK)


@jax.named_scope("moe_route")
def routing_stats(c: Choice, cfg, valid_T=None) -> Routing:
    """The Routing of the tokens of c (whole sequences, in any order of sequences): losses and statistics."""
    # The balance loss and the entropy read a distribution over experts: sigmoid scores are normalised.
    probs_TE = c.scores_TE / jnp.sum(c.scores_TE, axis=-1, keepdims=True)
    t, e = c.logits_TE.shape
    per_sequence = cfg.load_balance_loss_type == "sequence" and t % cfg.max_target_length == 0
    lb_loss = load_balance_loss(c.experts_TK, probs_TE, t // cfg.max_target_length if per_sequence else 1, valid_T)
    v_T = None if valid_T is None else valid_T.astype(jnp.float32)
    z_loss = _mean(jnp.square(jax.nn.logsumexp(c.logits_TE, axis=-1)), v_T)
    entropy = -_mean(jnp.sum(probs_TE * jnp.log(jnp.maximum(probs_TE, 1e-30)), axis=-1), v_T)
    slots_TKE = jax.nn.one_hot(c.experts_TK, e, dtype=jnp.float32)
    load_E = jnp.sum(slots_TKE if v_T is None else slots_TKE * v_T[:, None, None], axis=(0, 1))
    return Routing(c.weights_TK, c.experts_TK, lb_loss, z_loss, load_E, entropy, valid_T)


def bias_update(bias_E, load_E, rate: float):
    """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the over-loaded ones."""
    return bias_E + rate * jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E)

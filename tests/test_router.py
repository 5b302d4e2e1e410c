"""Tests of the MoE router (MaxText/layers/moe/router.py) against a plain float64 numpy reference.

The reference below is written per token with Python loops, following Transformer Engine's fused-router
references (reference_topk_softmax_sigmoid / reference_group_limited_topk, see shared/notes/te.md sections
4 and 11.1): scores = softmax or sigmoid of the logits; selection on scores + bias; a group scored by the sum
of its best max(1, K // topk_routing_group) selection scores; top-K among the kept groups' experts; weights =
the *unbiased* scores of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor.

Covers: 1. selection and weights (softmax, sigmoid + bias, group-limited routing, one case where group
limiting must change the answer); 2. the load-balance loss (global, per sequence, uniform = 1);
3. z-loss, entropy, load_E; 4. gradients w.r.t. the gate kernel (finite differences in float64 and a jnp
re-implementation) and none w.r.t. the bias; 5. bias_update and a toy aux-loss-free balancing loop;
6. config validation of the router keys and MaxText's upstream spellings.

Logits are built without ties (an uneven ramp, permuted per token), and every case first asserts that
the reference's decisions have a clear margin, so float32 code and float64 reference must agree exactly
on the chosen expert sets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.layers.moe import router
from tests.tiny import tiny_config

MIN_MARGIN = 1e-4   # smallest gap allowed between a reference decision and the runner-up (well-posed cases)


# ------------------------------------------------------------------------------------ numpy reference


def ref_scores(logits, score_func):
    """float64 softmax or sigmoid, per token."""
    logits = np.asarray(logits, np.float64)
    if score_func == "softmax":
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)
    assert score_func == "sigmoid"
    return 1.0 / (1.0 + np.exp(-logits))


def ref_route(logits, bias, cfg, use_groups=True):
    """Per-token reference routing. Returns (experts_TK best first, weights_TK, scores_TE, min margin)."""
    k = cfg.num_experts_per_tok
    scores = ref_scores(logits, cfg.routed_score_func)
    t_count, e_count = scores.shape
    sel = scores + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :])
    experts = np.zeros((t_count, k), np.int64)
    weights = np.zeros((t_count, k), np.float64)
    margin = np.inf
    for t in range(t_count):
        allowed = list(range(e_count))
        if use_groups and cfg.n_routing_groups is not None:
            groups, keep = cfg.n_routing_groups, cfg.topk_routing_group
            size = e_count // groups
            per_group = max(1, k // keep)
            group_score = []
            for g in range(groups):
                members = sorted((sel[t, e] for e in range(g * size, (g + 1) * size)), reverse=True)
                group_score.append(sum(members[:per_group]))
            ranked_groups = sorted(range(groups), key=lambda g: -group_score[g])
            kept = ranked_groups[:keep]
            if keep < groups:
                margin = min(margin, group_score[ranked_groups[keep - 1]] - group_score[ranked_groups[keep]])
            allowed = [e for g in sorted(kept) for e in range(g * size, (g + 1) * size)]
        ranked = sorted(allowed, key=lambda e: -sel[t, e])
        chosen = ranked[:k]
        gaps = [sel[t, ranked[i]] - sel[t, ranked[i + 1]] for i in range(min(k, len(ranked) - 1))]
        margin = min([margin] + gaps)   # the K-th vs the (K+1)-th, and the order among the chosen
        w = scores[t, chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        experts[t] = chosen
        weights[t] = w * cfg.routed_scaling_factor
    return experts, weights, scores, margin


def dense_weights(experts_TK, weights_TK, num_experts):
    """[T, E] matrix holding each chosen expert's weight (0 elsewhere): order-free comparison."""
    experts_TK, weights_TK = np.asarray(experts_TK), np.asarray(weights_TK, np.float64)
    out = np.zeros((experts_TK.shape[0], num_experts))
    for t in range(experts_TK.shape[0]):
        for k in range(experts_TK.shape[1]):
            out[t, experts_TK[t, k]] += weights_TK[t, k]
    return out


def chosen_mask(experts_TK, num_experts):
    experts_TK = np.asarray(experts_TK)
    mask = np.zeros((experts_TK.shape[0], num_experts), bool)
    np.put_along_axis(mask, experts_TK, True, axis=1)
    return mask


def ref_lb_loss(experts_TK, scores_TE, num_sequences=1):
    """E * sum_e f_e p_e per sequence, averaged: f_e = slots sent to e / all slots, p_e = mean normalised score."""
    t_count, e_count = scores_TE.shape
    probs = scores_TE / scores_TE.sum(axis=-1, keepdims=True)
    length = t_count // num_sequences
    losses = []
    for s in range(num_sequences):
        ex = np.asarray(experts_TK)[s * length:(s + 1) * length]
        counts = np.bincount(ex.ravel(), minlength=e_count).astype(np.float64)
        f = counts / ex.size
        p = probs[s * length:(s + 1) * length].mean(axis=0)
        losses.append(e_count * np.sum(f * p))
    return float(np.mean(losses))


def ramp_logits(num_tokens, num_experts, seed, lo=-3.0, hi=3.0):
    """Per token, a random permutation of a fixed uneven ramp: no ties, clear gaps between experts."""
    rng = np.random.default_rng(seed)
    steps = 1.0 + 0.5 * rng.random(num_experts - 1)            # uneven gaps: fewer exact ties of group sums
    base = np.concatenate([[0.0], np.cumsum(steps)])
    base = lo + (hi - lo) * base / base[-1]
    return np.stack([rng.permutation(base) for _ in range(num_tokens)]).astype(np.float32)


def route_logits(logits, bias, cfg):
    """router.route with x = logits and an identity gate, so the router sees exactly these logits."""
    logits = jnp.asarray(logits, jnp.float32)
    eye = jnp.eye(logits.shape[-1], dtype=jnp.float32)
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    return jax.jit(lambda x, g, b: router.route(x, g, b, cfg))(logits, eye, b)


# ------------------------------------------------------------------ 1. selection and combine weights

ROUTING_CASES = {
    # name: (config overrides, number of tokens, use a bias)
    "softmax_topk": (["num_experts=16", "num_experts_per_tok=4"], 64, False),
    "softmax_topk_norm": (["num_experts=16", "num_experts_per_tok=4", "norm_topk_prob=true"], 64, False),
    "softmax_top1_scaled": (["num_experts=8", "num_experts_per_tok=1", "routed_scaling_factor=1.5"], 32, False),
    "sigmoid_bias_norm_scale": (["num_experts=16", "num_experts_per_tok=4", "routed_score_func=sigmoid",
                                 "routed_bias=true", "norm_topk_prob=true", "routed_scaling_factor=2.5"], 64, True),
    "sigmoid_no_norm": (["num_experts=16", "num_experts_per_tok=4", "routed_score_func=sigmoid"], 64, False),
    "softmax_groups_4keep2_k4": (["num_experts=16", "num_experts_per_tok=4", "n_routing_groups=4",
                                  "topk_routing_group=2"], 64, False),
    "sigmoid_bias_groups_8keep4_k8": (["num_experts=16", "num_experts_per_tok=8", "routed_score_func=sigmoid",
                                       "routed_bias=true", "norm_topk_prob=true", "routed_scaling_factor=2.5",
                                       "n_routing_groups=8", "topk_routing_group=4"], 64, True),
    "sigmoid_groups_keep1_k2": (["num_experts=16", "num_experts_per_tok=2", "routed_score_func=sigmoid",
                                 "n_routing_groups=4", "topk_routing_group=1", "norm_topk_prob=true"], 64, False),
    "softmax_groups_k_lt_keep": (["num_experts=16", "num_experts_per_tok=2", "n_routing_groups=8",
                                  "topk_routing_group=4", "norm_topk_prob=true"], 64, False),
    "softmax_groups_8keep2_k3": (["num_experts=16", "num_experts_per_tok=3", "n_routing_groups=8",
                                  "topk_routing_group=2"], 64, False),
}


def _case_bias(num_experts, seed):
    return (np.random.default_rng(seed + 1000).uniform(-0.3, 0.3, num_experts)).astype(np.float32)


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_matches_reference(case):
    overrides, num_tokens, use_bias = ROUTING_CASES[case]
    cfg = tiny_config(*overrides)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    seed = sorted(ROUTING_CASES).index(case)
    logits = ramp_logits(num_tokens, e, seed)
    bias = _case_bias(e, seed) if use_bias else None
    ref_experts, ref_weights, _, margin = ref_route(logits, bias, cfg)
    assert margin > MIN_MARGIN, f"{case}: test data has a near tie (margin {margin})"

    # select_experts directly on float32 scores, and route() end to end.
    scores = router.expert_scores(jnp.asarray(logits), cfg.routed_score_func)
    sel_w, sel_e = router.select_experts(scores, None if bias is None else jnp.asarray(bias), cfg)
    r = route_logits(logits, bias, cfg)
    for name, (w, ex) in {"select_experts": (sel_w, sel_e), "route": (r.weights_TK, r.experts_TK)}.items():
        ex = np.asarray(ex)
        assert ex.shape == (num_tokens, k) and ex.dtype == np.int32, f"{case} {name}: experts {ex.shape} {ex.dtype}"
        assert np.asarray(w).dtype == np.float32, f"{case} {name}: weights dtype {np.asarray(w).dtype}"
        np.testing.assert_array_equal(chosen_mask(ex, e), chosen_mask(ref_experts, e),
                                      err_msg=f"{case} {name}: chosen expert sets")
        np.testing.assert_array_equal(ex, ref_experts, err_msg=f"{case} {name}: experts best first")
        np.testing.assert_allclose(dense_weights(ex, w, e), dense_weights(ref_experts, ref_weights, e),
                                   rtol=1e-5, atol=1e-7, err_msg=f"{case} {name}: combine weights")
    if cfg.norm_topk_prob:
        np.testing.assert_allclose(np.asarray(r.weights_TK).sum(-1), cfg.routed_scaling_factor, rtol=1e-5,
                                   err_msg=f"{case}: normalised weights sum to routed_scaling_factor")

    # The case must exercise what it claims: the bias / the group limit changes some token's choice.
    if use_bias:
        unbiased, _, _, _ = ref_route(logits, None, cfg)
        assert (chosen_mask(unbiased, e) != chosen_mask(ref_experts, e)).any(), f"{case}: bias changed nothing"
    if cfg.n_routing_groups is not None:
        plain, _, _, _ = ref_route(logits, bias, cfg, use_groups=False)
        differs = (chosen_mask(plain, e) != chosen_mask(ref_experts, e)).any()
        if k <= cfg.topk_routing_group:
            # Groups scored by their best expert (K // keep < 1 -> 1) and K <= kept groups: the plain
            # top-K always lies in the best K groups, so group limiting must change nothing.
            assert not differs, f"{case}: K <= topk_routing_group must equal plain top-k"
        else:
            assert differs, f"{case}: groups changed nothing"


def test_bias_selects_but_weights_stay_unbiased():
    """A large bias on experts 0..3 forces their selection; the weights are their (low) unbiased sigmoids."""
    cfg = tiny_config("num_experts=8", "num_experts_per_tok=4", "routed_score_func=sigmoid", "routed_bias=true",
                      "norm_topk_prob=true", "routed_scaling_factor=2.5")
    logits = np.array([[-2.0, -1.5, -1.0, -0.5, 3.0, 2.5, 2.0, 1.5],
                       [-0.5, -2.0, -1.0, -1.5, 1.0, 2.0, 3.0, 4.0]], np.float32)
    bias = np.array([5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    r = route_logits(logits, bias, cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(r.experts_TK), -1), [[0, 1, 2, 3]] * 2,
                                  err_msg="bias-forced experts")
    s = ref_scores(logits, "sigmoid")
    want = dense_weights([[0, 1, 2, 3]] * 2, 2.5 * s[:, :4] / s[:, :4].sum(-1, keepdims=True), 8)
    np.testing.assert_allclose(dense_weights(r.experts_TK, r.weights_TK, 8), want, rtol=1e-5,
                               err_msg="weights are the unbiased sigmoid scores, normalised, x2.5")
    # Without the bias the same tokens pick experts 4..7.
    r0 = route_logits(logits, None, tiny_config("num_experts=8", "num_experts_per_tok=4",
                                                  "routed_score_func=sigmoid", "norm_topk_prob=true",
                                                  "routed_scaling_factor=2.5"))
    np.testing.assert_array_equal(np.sort(np.asarray(r0.experts_TK), -1), [[4, 5, 6, 7]] * 2,
                                  err_msg="unbiased choice")


def test_group_limit_excludes_the_best_expert():
    """Hand-built token: expert 0 is the single best, but its group (0..3) has a poor runner-up, so with
    4 groups keep 2 and K=4 (per-group score = best 2) the kept groups are 1 and 2 and expert 0 is dropped."""
    cfg = tiny_config("num_experts=16", "num_experts_per_tok=4", "routed_score_func=sigmoid",
                      "n_routing_groups=4", "topk_routing_group=2")
    token = np.full(16, -3.0, np.float32)
    token[0] = 3.0                          # group 0: s(3) + s(-3) = 1.0
    token[4], token[5] = 2.5, 2.4           # group 1: 0.924 + 0.917 = 1.84
    token[8], token[9] = 2.3, 2.2           # group 2: 0.909 + 0.900 = 1.81
    token[12], token[13] = 0.5, 0.4         # group 3: 0.62 + 0.60 = 1.22
    logits = token[None, :]
    plain, _, _, _ = ref_route(logits, None, cfg, use_groups=False)
    grouped, grouped_w, _, margin = ref_route(logits, None, cfg)
    assert margin > MIN_MARGIN
    assert set(plain[0]) == {0, 4, 5, 8}, f"plain top-k reference {plain[0]}"
    assert set(grouped[0]) == {4, 5, 8, 9}, f"group-limited reference {grouped[0]}"
    r = route_logits(logits, None, cfg)
    assert set(np.asarray(r.experts_TK)[0].tolist()) == {4, 5, 8, 9}, \
        f"group-limited route chose {np.asarray(r.experts_TK)[0]}, plain top-k would be {plain[0]}"
    np.testing.assert_allclose(dense_weights(r.experts_TK, r.weights_TK, 16), dense_weights(grouped, grouped_w, 16),
                               rtol=1e-5, err_msg="group-limited weights (hand-built token)")


def test_group_score_max_is_deepseek_v2_device_limited_routing():
    """routing_group_score=max (DeepSeek-V2): a group scores by its best expert. Expert 0 alone makes group 0 the
    best group, so with keep 2 the token takes experts from groups 0 and 1, where the top-2 sum (DeepSeek-V3) keeps
    groups 1 and 2; weights are the softmax scores of the chosen experts (no renormalisation, x scaling)."""
    token = np.array([2.6, -2.0, -2.5, -2.8, 2.5, 2.4, -2.9, -2.95, 2.3, 2.2, -3, -3, 0.5, 0.4, -3, -3], np.float32)
    keys = ("num_experts=16", "num_experts_per_tok=4", "routed_score_func=softmax", "n_routing_groups=4",
            "topk_routing_group=2", "routed_scaling_factor=16", "moe_impl=ragged")
    v2 = route_logits(token[None, :], None, tiny_config(*keys, "routing_group_score=max"))
    v3 = route_logits(token[None, :], None, tiny_config(*keys))
    assert set(np.asarray(v2.experts_TK)[0].tolist()) == {0, 1, 4, 5}, np.asarray(v2.experts_TK)
    assert set(np.asarray(v3.experts_TK)[0].tolist()) == {4, 5, 8, 9}, np.asarray(v3.experts_TK)
    p = np.exp(token - token.max()) / np.exp(token - token.max()).sum()
    np.testing.assert_allclose(dense_weights(v2.experts_TK, v2.weights_TK, 16),
                               dense_weights([[0, 1, 4, 5]], [16 * p[[0, 1, 4, 5]]], 16), rtol=1e-5)


def test_group_score_uses_biased_scores():
    """The bias enters the group score too (TE/DeepSeek-V3): a bias on group 3 makes it a kept group."""
    cfg = tiny_config("num_experts=8", "num_experts_per_tok=2", "routed_score_func=sigmoid", "routed_bias=true",
                      "n_routing_groups=4", "topk_routing_group=1")
    logits = np.array([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -1.5]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0.9, 0.9], np.float32)
    grouped, _, _, margin = ref_route(logits, bias, cfg)
    assert margin > MIN_MARGIN and set(grouped[0]) == {6, 7}, f"reference {grouped[0]}"
    r = route_logits(logits, bias, cfg)
    assert set(np.asarray(r.experts_TK)[0].tolist()) == {6, 7}, f"route chose {np.asarray(r.experts_TK)[0]}"


# --------------------------------------------------------------------------------- 2. load balance


@pytest.mark.parametrize("case", ["softmax_topk", "sigmoid_bias_norm_scale", "sigmoid_bias_groups_8keep4_k8"])
def test_lb_loss_global_matches_numpy(case):
    overrides, num_tokens, use_bias = ROUTING_CASES[case]
    cfg = tiny_config(*overrides)
    e = cfg.num_experts
    # Skewed logits so the loss is well above 1 and f, p are far from uniform.
    logits = ramp_logits(num_tokens, e, 7) + np.linspace(2.0, -2.0, e, dtype=np.float32)
    bias = _case_bias(e, 7) if use_bias else None
    ref_experts, _, scores, margin = ref_route(logits, bias, cfg)
    assert margin > MIN_MARGIN, f"{case}: near tie"
    want = ref_lb_loss(ref_experts, scores)
    r = route_logits(logits, bias, cfg)
    np.testing.assert_allclose(float(r.lb_loss), want, rtol=1e-5, err_msg=f"{case}: global lb_loss")
    assert want > 1.05, f"{case}: test data should be unbalanced (lb {want})"


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_lb_loss_per_sequence(score_func):
    """Sequence 0 prefers experts 0,1 and sequence 1 experts 2,3: balanced over the batch (global ~1),
    badly unbalanced within each sequence (per-sequence ~2)."""
    length, e = 8, 4
    common = ["num_experts=4", "num_experts_per_tok=2", f"max_target_length={length}",
              f"routed_score_func={score_func}"]
    cfg_seq = tiny_config(*common, "load_balance_loss_type=sequence")
    cfg_glob = tiny_config(*common, "load_balance_loss_type=global")
    rng = np.random.default_rng(3)
    seq0 = np.array([4.0, 3.0, -4.0, -4.5], np.float32) + rng.uniform(-0.3, 0.3, (length, e)).astype(np.float32)
    seq1 = np.array([-4.0, -4.5, 4.0, 3.0], np.float32) + rng.uniform(-0.3, 0.3, (length, e)).astype(np.float32)
    logits = np.concatenate([seq0, seq1])          # T = 2 * L
    ref_experts, _, scores, margin = ref_route(logits, None, cfg_seq)
    assert margin > MIN_MARGIN
    want_seq, want_glob = ref_lb_loss(ref_experts, scores, 2), ref_lb_loss(ref_experts, scores, 1)
    got_seq = float(route_logits(logits, None, cfg_seq).lb_loss)
    got_glob = float(route_logits(logits, None, cfg_glob).lb_loss)
    np.testing.assert_allclose(got_seq, want_seq, rtol=1e-5, err_msg=f"{score_func}: per-sequence lb_loss")
    np.testing.assert_allclose(got_glob, want_glob, rtol=1e-5, err_msg=f"{score_func}: global lb_loss")
    assert want_seq - want_glob > 0.5, f"case must separate the variants: seq {want_seq}, global {want_glob}"
    assert got_seq - got_glob > 0.5, f"{score_func}: per-sequence {got_seq} vs global {got_glob}"
    # And directly: the mean of the per-sequence losses of each half.
    halves = [float(router.load_balance_loss(jnp.asarray(ref_experts[i * length:(i + 1) * length]),
                                             jnp.asarray(scores[i * length:(i + 1) * length]
                                                         / scores[i * length:(i + 1) * length].sum(-1, keepdims=True),
                                                         jnp.float32)))
              for i in range(2)]
    np.testing.assert_allclose(got_seq, np.mean(halves), rtol=1e-5, err_msg=f"{score_func}: mean of halves")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("loss_type", ["global", "sequence"])
def test_lb_loss_is_one_when_uniform(score_func, loss_type):
    """Token t's logits are the ramp rolled by t: over each run of E tokens every expert gets the same
    slots and the same mean probability, so f_e = p_e = 1/E and the loss is exactly 1."""
    e, k = 8, 2
    cfg = tiny_config(f"num_experts={e}", f"num_experts_per_tok={k}", f"routed_score_func={score_func}",
                      f"max_target_length={e}", f"load_balance_loss_type={loss_type}")
    ramp = np.linspace(-2.0, 2.0, e, dtype=np.float32)
    logits = np.stack([np.roll(ramp, t) for t in range(3 * e)])   # 3 sequences of L = E
    r = route_logits(logits, None, cfg)
    np.testing.assert_allclose(np.asarray(r.load_E), np.full(e, 3 * k), err_msg="uniform load")
    np.testing.assert_allclose(float(r.lb_loss), 1.0, rtol=1e-5, err_msg=f"uniform lb_loss {score_func} {loss_type}")


# ---------------------------------------------------------------------- 3. z-loss, entropy, load


@pytest.mark.parametrize("case", ["softmax_topk", "sigmoid_bias_groups_8keep4_k8"])
def test_z_loss_entropy_load(case):
    overrides, num_tokens, use_bias = ROUTING_CASES[case]
    cfg = tiny_config(*overrides)
    e = cfg.num_experts
    logits = 2.0 * ramp_logits(num_tokens, e, 11) + 1.5        # shifted: logsumexp far from 0
    bias = _case_bias(e, 11) if use_bias else None
    ref_experts, _, scores, margin = ref_route(logits, bias, cfg)
    assert margin > MIN_MARGIN
    x = np.asarray(logits, np.float64)
    m = x.max(-1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(-1))
    probs = scores / scores.sum(-1, keepdims=True)
    r = route_logits(logits, bias, cfg)
    np.testing.assert_allclose(float(r.z_loss), np.mean(lse ** 2), rtol=1e-5, err_msg=f"{case}: z_loss")
    np.testing.assert_allclose(float(r.entropy), np.mean(-np.sum(probs * np.log(probs), -1)), rtol=1e-5,
                               err_msg=f"{case}: entropy")
    np.testing.assert_array_equal(np.asarray(r.load_E), np.bincount(ref_experts.ravel(), minlength=e),
                                  err_msg=f"{case}: load_E")
    assert np.asarray(r.load_E).dtype == np.float32


def test_entropy_extremes():
    """Equal logits: entropy log(E); one dominant expert: entropy near 0."""
    cfg = tiny_config("num_experts=8", "num_experts_per_tok=2")
    flat = route_logits(np.zeros((4, 8), np.float32), None, cfg)
    np.testing.assert_allclose(float(flat.entropy), np.log(8), rtol=1e-6, err_msg="uniform entropy")
    np.testing.assert_allclose(float(flat.z_loss), np.log(8) ** 2, rtol=1e-6, err_msg="z_loss at zero logits")
    peaked = route_logits(np.array([[30.0] + [0.0] * 7] * 4, np.float32), None, cfg)
    assert float(peaked.entropy) < 1e-8, f"peaked entropy {float(peaked.entropy)}"


# ------------------------------------------------------------------------------------- 4. gradients

GRAD_CASES = {
    "softmax": ["num_experts=8", "num_experts_per_tok=2"],
    "softmax_norm": ["num_experts=8", "num_experts_per_tok=2", "norm_topk_prob=true"],
    "sigmoid_bias_norm_scale": ["num_experts=8", "num_experts_per_tok=2", "routed_score_func=sigmoid",
                                "routed_bias=true", "norm_topk_prob=true", "routed_scaling_factor=2.5"],
    "sigmoid_bias_groups": ["num_experts=8", "num_experts_per_tok=2", "routed_score_func=sigmoid",
                            "routed_bias=true", "routed_scaling_factor=2.5", "n_routing_groups=4",
                            "topk_routing_group=2"],
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gate_gradient(case):
    """d/d gate of sum_t,k w_tk * C[t, e_tk] through route(): against central finite differences of the
    float64 reference, and against a jnp re-implementation on the reference's (fixed) choices. The bias
    gets exactly zero gradient: it only selects."""
    cfg = tiny_config(*GRAD_CASES[case])
    t_count, e = 16, cfg.num_experts
    seed = sorted(GRAD_CASES).index(case)
    rng = np.random.default_rng(seed)
    # A generic, well-conditioned [E, E] gate, and x chosen so that x @ gate is a tie-free ramp.
    gate = (rng.normal(scale=0.5, size=(e, e)) + 2.0 * np.eye(e)).astype(np.float32)
    x = (ramp_logits(t_count, e, seed + 50).astype(np.float64) @ np.linalg.inv(gate.astype(np.float64)))
    x = x.astype(np.float32)
    d = e
    coef = rng.normal(size=(t_count, e)).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, e).astype(np.float32) if cfg.routed_bias else None

    x64, coef64 = x.astype(np.float64), coef.astype(np.float64)
    ref_experts, _, _, margin = ref_route(x64 @ gate.astype(np.float64), bias, cfg)
    assert margin > MIN_MARGIN, f"{case}: near tie (margin {margin})"   # >> the FD step (~1e-5)

    def ref_objective(g64):
        ex, w, _, _ = ref_route(x64 @ g64, bias, cfg)
        np.testing.assert_array_equal(ex, ref_experts, err_msg=f"{case}: FD step changed the routing")
        return float(np.sum(w * np.take_along_axis(coef64, ex, axis=1)))

    eps = 1e-5
    g64 = gate.astype(np.float64)
    fd = np.zeros_like(g64)
    for i in range(d):
        for j in range(e):
            step = np.zeros_like(g64)
            step[i, j] = eps
            fd[i, j] = (ref_objective(g64 + step) - ref_objective(g64 - step)) / (2 * eps)

    def objective(gate_, bias_):
        r = router.route(jnp.asarray(x), gate_, bias_, cfg)
        return jnp.sum(r.weights_TK * jnp.take_along_axis(jnp.asarray(coef), r.experts_TK, axis=1))

    def reimpl(gate_):
        logits = jnp.asarray(x) @ gate_
        s = jax.nn.softmax(logits, -1) if cfg.routed_score_func == "softmax" else jax.nn.sigmoid(logits)
        w = jnp.take_along_axis(s, jnp.asarray(ref_experts), axis=1)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, -1, keepdims=True)
        w = w * cfg.routed_scaling_factor
        return jnp.sum(w * jnp.take_along_axis(jnp.asarray(coef), jnp.asarray(ref_experts), axis=1))

    b = None if bias is None else jnp.asarray(bias)
    if b is None:
        got = jax.jit(jax.grad(objective))(jnp.asarray(gate), None)
    else:
        got, got_b = jax.jit(jax.grad(objective, argnums=(0, 1)))(jnp.asarray(gate), b)
        np.testing.assert_array_equal(np.asarray(got_b), np.zeros(e), err_msg=f"{case}: bias gradient")
    got = np.asarray(got, np.float64)
    assert np.abs(fd).max() > 1e-2, f"{case}: degenerate objective"
    np.testing.assert_allclose(got, fd, rtol=1e-3, atol=1e-4 * np.abs(fd).max(),
                               err_msg=f"{case}: d/dgate vs float64 finite differences")
    want = np.asarray(jax.jit(jax.grad(reimpl))(jnp.asarray(gate)), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(),
                               err_msg=f"{case}: d/dgate vs jnp re-implementation")


# ------------------------------------------------------------------------------ 5. bias balancing


def test_bias_update_rule():
    bias = np.array([0.0, 0.1, -0.2, 0.3], np.float32)
    load = np.array([10.0, 2.0, 4.0, 0.0], np.float32)      # mean 4: expert 2 exactly at the mean
    got = np.asarray(router.bias_update(jnp.asarray(bias), jnp.asarray(load), 0.01))
    np.testing.assert_allclose(got, bias + 0.01 * np.sign(load.mean() - load), rtol=1e-6, err_msg="[E] update")
    np.testing.assert_allclose(got, [-0.01, 0.11, -0.2, 0.31], rtol=1e-6, err_msg="[E] update, literal")

    # Stacked [layers, E]: each layer compares to its own mean.
    bias_le = np.zeros((3, 4), np.float32)
    load_le = np.array([[10, 2, 4, 0], [1, 1, 1, 1], [0, 0, 0, 8]], np.float32)
    got = np.asarray(router.bias_update(jnp.asarray(bias_le), jnp.asarray(load_le), 0.5))
    want = 0.5 * np.sign(load_le.mean(axis=1, keepdims=True) - load_le)
    np.testing.assert_allclose(got, want, err_msg="[layers, E] update, mean per layer")
    np.testing.assert_allclose(got, [[-0.5, 0.5, 0, 0.5], [0, 0, 0, 0], [0.5, 0.5, 0.5, -0.5]],
                               err_msg="[layers, E] update, literal")


def test_aux_loss_free_balancing_loop():
    """Skewed router (experts 0, 1 strongly preferred), sigmoid + routed_bias: 200 steps of
    route -> load_E -> bias_update(rate 0.01) must flatten the load."""
    e, k, t_count, d = 8, 2, 128, 8
    cfg = tiny_config(f"num_experts={e}", f"num_experts_per_tok={k}", "routed_score_func=sigmoid",
                      "routed_bias=true", "routed_bias_update_rate=0.01", "norm_topk_prob=true")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(t_count, d)).astype(np.float32)
    x[:, 0] = 1.0                                            # constant feature: its gate row is a logit offset
    gate = rng.normal(scale=0.5, size=(d, e)).astype(np.float32)
    gate[0] = [2.5, 2.0, 0, 0, -0.5, -0.5, -1.0, -1.0]
    x, gate = jnp.asarray(x), jnp.asarray(gate)

    @jax.jit
    def step(bias):
        load = router.route(x, gate, bias, cfg).load_E
        return router.bias_update(bias, load, cfg.routed_bias_update_rate), load

    bias = jnp.zeros((e,), jnp.float32)
    loads = []
    for _ in range(200):
        bias, load = step(bias)
        loads.append(np.asarray(load))
    mean = t_count * k / e
    first = loads[0].max() / mean
    last = np.mean(loads[-20:], axis=0).max() / mean                 # averaged over the last 20 steps
    final = loads[-1].max() / mean
    assert first > 2.0, f"initial max/mean load {first:.2f} should be > 2 (skewed router)"
    assert last < 1.3 and final < 1.3, f"after 200 steps max/mean load {last:.2f} (last step {final:.2f}), " \
                                       f"started at {first:.2f}; bias {np.asarray(bias)}"
    b = np.asarray(bias)
    assert b[0] < b[4] and b[1] < b[6], f"over-loaded experts should end with lower bias: {b}"


# ----------------------------------------------------------------------------- 6. config validation


@pytest.mark.parametrize("overrides, needle", [
    (["num_experts=16", "num_experts_per_tok=4", "topk_routing_group=2"], "n_routing_groups"),
    (["num_experts=16", "num_experts_per_tok=4", "n_routing_groups=4"], "topk_routing_group"),
    (["num_experts=16", "num_experts_per_tok=4", "n_routing_groups=3", "topk_routing_group=1"], "divide"),
    (["num_experts=16", "num_experts_per_tok=4", "n_routing_groups=4", "topk_routing_group=5"], "topk_routing_group"),
    (["num_experts=16", "num_experts_per_tok=5", "n_routing_groups=4", "topk_routing_group=1"], "kept groups"),
    (["num_experts=16", "num_experts_per_tok=9", "n_routing_groups=8", "topk_routing_group=4"], "kept groups"),
    (["routed_bias=true"], "sigmoid"),
    (["routed_bias=true", "routed_score_func=softmax"], "sigmoid"),
    (["routed_bias_update_rate=0.01"], "routed_bias"),
    (["routed_score_func=sigmoid", "routed_bias_update_rate=0.01"], "routed_bias"),
    (["routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=-0.1"], "between 0 and 1"),
    (["router_z_loss_weight=-1.0"], "router_z_loss_weight"),
    (["routed_score_func=relu"], "routed_score_func"),
    (["sparse_matmul=true", "moe_impl=dense"], "moe_impl"),
    (["sparse_matmul=false", "moe_impl=ragged"], "moe_impl"),
    (["te_moe_block=true", "moe_impl=ragged"], "moe_impl"),
])
def test_router_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as info:
        tiny_config(*overrides)
    assert needle in str(info.value), f"{overrides}: error should mention {needle!r}: {info.value}"


def test_router_configs_that_load():
    cfg = tiny_config("num_experts=16", "num_experts_per_tok=8", "n_routing_groups=8", "topk_routing_group=4",
                      "routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.001",
                      "routed_scaling_factor=2.5", "norm_topk_prob=true", "router_z_loss_weight=0.001",
                      "load_balance_loss_type=sequence")
    assert (cfg.n_routing_groups, cfg.topk_routing_group) == (8, 4)
    # -1 is upstream MaxText's "unset" for both group keys.
    for overrides in (["n_routing_groups=-1"], ["n_routing_groups=-1", "topk_routing_group=-1"]):
        cfg = tiny_config("num_experts=16", "num_experts_per_tok=4", *overrides)
        assert cfg.n_routing_groups is None and cfg.topk_routing_group is None, overrides
    cfg = tiny_config("num_experts=16", "num_experts_per_tok=4", "n_routing_groups=-1", "topk_routing_group=-1")
    r = route_logits(ramp_logits(8, 16, 0), None, cfg)           # routes as plain top-k
    ref_experts, _, _, _ = ref_route(ramp_logits(8, 16, 0), None, cfg)
    np.testing.assert_array_equal(np.asarray(r.experts_TK), ref_experts, err_msg="n_routing_groups=-1 routing")


@pytest.mark.parametrize("overrides, impl", [
    (["te_moe_block=true"], "te_dropless"),
    (["sparse_matmul=true"], "ragged"),
    (["sparse_matmul=false"], "dense"),
    (["sparse_matmul=true", "moe_impl=ragged"], "ragged"),
    (["te_moe_block=true", "moe_impl=te_dropless"], "te_dropless"),
    (["te_moe_block=false"], "ragged"),  # not TE: the default, dropless (MaxText's default is sparse_matmul=true)
    (["moe_impl=ragged"], "ragged"),
])
def test_upstream_moe_spellings(overrides, impl):
    assert tiny_config(*overrides).moe_impl == impl, overrides


def test_top_k_by_sort_is_lax_top_k_ties_included():
    """router.top_k (a stable sort, which XLA partitions over tokens) returns lax.top_k's values and indices,
    ties going to the lower index, also at -inf (masked groups)."""
    from MaxText.layers.moe.router import top_k

    x = jax.random.randint(jax.random.key(0), (64, 3, 16), 0, 5).astype(jnp.float32)  # many ties
    x = x.at[:, :, ::3].set(-jnp.inf)
    for k in (1, 4, 16):
        values, indices = top_k(x, k)
        want_values, want_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(indices, want_indices)
        np.testing.assert_array_equal(values, want_values)


@pytest.mark.parametrize("scan", [True, False])
def test_bias_update_is_a_tree_map_over_the_module_tree(scan):
    """models.moe_load puts each MoE layer's load row (and each MTP depth's) where that layer's routing bias is
    in the model's MoeBias state, so update_moe_bias is one jax.tree.map: 12 MoE layers (unrolled: layers_2
    before layers_10), a scanned [L, E] stack, two MTP depths. A load tree that does not pair up with the biases
    raises instead of leaving a bias unmoved."""
    from flax import nnx

    from MaxText.layers.models import Transformer, moe_load, update_moe_bias
    from MaxText.layers.moe.block import MoeBias

    cfg = tiny_config("routed_bias=true", "routed_score_func=sigmoid", "base_num_decoder_layers=13",
                      "first_num_dense_layers=1", "mtp_num_layers=2", f"scan_layers={str(scan).lower()}")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nnx.to_pure_dict(nnx.state(model, MoeBias)))
    e = cfg.num_experts
    load_LE = jnp.arange(12 * e, dtype=jnp.float32).reshape(12, e) ** 2 % 7  # distinct rows
    mtp_load_KE = -load_LE[:2]
    new = update_moe_bias(aux, moe_load(model, load_LE, mtp_load_KE), 0.5)
    step = lambda load: np.sign(np.mean(load, axis=-1, keepdims=True) - load) * 0.5  # noqa: E731
    layers = new["moe_layers"]
    if scan:
        np.testing.assert_allclose(layers["layers"]["moe"]["bias"], step(load_LE))
    else:
        assert len(layers) == 12
        for i in range(12):
            np.testing.assert_allclose(layers[f"layers_{i}"]["moe"]["bias"], step(load_LE[i]), err_msg=f"layer {i}")
    for k in (1, 2):
        np.testing.assert_allclose(new["mtp"][f"mtp_{k}"]["layer"]["moe"]["bias"], step(mtp_load_KE[k - 1]))
    with pytest.raises(ValueError):
        update_moe_bias(aux, moe_load(model, load_LE), 0.5)  # no MTP load: the MTP biases would not move


# ---------------------------------------------------------------------------------- padding is not load

def test_padding_is_no_load_for_the_router_the_losses_or_the_bias():
    """route(valid_T=...) over a batch with padded rows (eval pads after one pass) gives the load, balance
    loss (global and per sequence), z-loss and entropy of the real rows alone; a partly padded sequence
    counts its real tokens only. Before, padding was load: it moved the bias and the balance losses."""
    length = 8
    x = jax.random.normal(jax.random.key(7), (4 * length, 16))
    gate = jax.random.normal(jax.random.key(8), (16, 8))
    valid = np.ones(4 * length, bool)
    valid[2 * length:3 * length] = False  # the third sequence is padding
    for kind in ("global", "sequence"):
        cfg = tiny_config("num_experts=8", "num_experts_per_tok=2", f"max_target_length={length}",
                          f"load_balance_loss_type={kind}")
        masked = router.route(x, gate, None, cfg, valid_T=jnp.asarray(valid))
        real = router.route(x[valid], gate, None, cfg)
        for field in ("lb_loss", "z_loss", "load_E", "entropy"):
            np.testing.assert_allclose(getattr(masked, field), getattr(real, field), rtol=1e-6, err_msg=f"{kind} {field}")
        np.testing.assert_array_equal(masked.experts_TK[valid], real.experts_TK)  # padding is still routed
    # A partly padded sequence (global loss): its real tokens only.
    partly = valid.copy()
    partly[:3] = False
    cfg = tiny_config("num_experts=8", "num_experts_per_tok=2", f"max_target_length={length}")
    masked = router.route(x, gate, None, cfg, valid_T=jnp.asarray(partly))
    real = router.route(x[partly], gate, None, cfg)
    np.testing.assert_allclose(masked.load_E, real.load_E)
    np.testing.assert_allclose(masked.lb_loss, real.lb_loss, rtol=1e-6)


def test_padding_takes_no_dense_capacity():
    """moe_impl=dense: padded slots take no capacity (a real token behind them keeps its place), are not
    kept and do not count in dropped_fraction."""
    from MaxText.layers.moe import dense

    experts = jnp.zeros((1, 4, 1), jnp.int32)  # 4 tokens, all to expert 0, capacity 2
    weights = jnp.ones((1, 4, 1))
    valid = jnp.array([[False, False, True, True]])
    _, _, kept = dense.dispatch_masks(experts, weights, 2, 2, valid)
    np.testing.assert_array_equal(kept[0, :, 0], [False, False, True, True])
    _, _, kept = dense.dispatch_masks(experts, weights, 2, 2)
    np.testing.assert_array_equal(kept[0, :, 0], [True, True, False, False])  # without the mask: padding wins


def test_the_moe_block_reads_padding_from_segment_ids():
    """MoeBlock(x, segment_ids): rows of segment id 0 are no load in the stats the bias update reads."""
    from flax import nnx

    from MaxText.layers.moe.block import MoeBlock

    cfg = tiny_config("moe_impl=ragged", "max_target_length=8", "routed_bias=true", "routed_score_func=sigmoid")
    block = MoeBlock(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(9), (3, 8, cfg.base_emb_dim))
    segments = jnp.ones((3, 8), jnp.int32).at[1].set(0)  # the middle row is padding
    _, masked = block(x, segments)
    _, real = block(x[jnp.array([0, 2])])
    np.testing.assert_allclose(masked["load_E"], real["load_E"])
    assert float(jnp.sum(masked["load_E"])) == 2 * 8 * cfg.num_experts_per_tok

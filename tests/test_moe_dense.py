"""moe_impl=dense against the plain float32 reference in tests/moe_reference.py: forward, gradients,
adversarial routing, capacity drops, the router, the MoeBlock module and bfloat16."""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.config.load import load_config
from MaxText.layers.moe import dense, router
from MaxText.layers.moe.block import MoeBlock
from MaxText.layers.moe.experts import ExpertWeights
from tests.moe_reference import capacity_kept_reference, moe_reference

B, S, D, F, K = 2, 16, 16, 32, 2   # 2 sequences of 16 tokens
T = B * S
TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=4e-2, atol=4e-2)


def make_cfg(num_experts=4, capacity_factor=None, norm_topk_prob=False):
    return load_config([
        f"max_target_length={S}", f"num_experts={num_experts}", f"num_experts_per_tok={K}",
        "dtype=float32", "weight_dtype=float32", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
        f"capacity_factor={'null' if capacity_factor is None else capacity_factor}",
        f"norm_topk_prob={'true' if norm_topk_prob else 'false'}", "moe_impl=dense",
    ])


def make_inputs(num_experts, seed=0, gate_scale=1.0):
    """x [T, D], gate [D, E] and ExpertWeights, float32, fan-in scaled so outputs are O(1)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    x = rng.standard_normal((T, D)).astype(f32)
    gate = (gate_scale * rng.standard_normal((D, num_experts)) / np.sqrt(D)).astype(f32)
    w = ExpertWeights(
        jnp.asarray((rng.standard_normal((num_experts, D, F)) / np.sqrt(D)).astype(f32)),
        jnp.asarray((rng.standard_normal((num_experts, D, F)) / np.sqrt(D)).astype(f32)),
        jnp.asarray((rng.standard_normal((num_experts, F, D)) / np.sqrt(F)).astype(f32)),
    )
    return jnp.asarray(x), jnp.asarray(gate), w


def dropped_fraction(stats, routing):
    """dense.moe_ffn reports the slots it dropped (overflow); the MoE block divides by the real slots."""
    return float(stats["overflow"]) / routing.experts_TK.size


def fixed_routing(experts_TK, weights_TK, num_experts):
    """A router.Routing from given choices; probs_TE puts each slot's weight on its expert."""
    experts_TK = jnp.asarray(experts_TK, jnp.int32)
    weights_TK = jnp.asarray(weights_TK, jnp.float32)
    onehot_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.float32)
    probs_TE = jnp.einsum("tk,tke->te", weights_TK, onehot_TKE)
    probs_TE = probs_TE / jnp.sum(probs_TE, axis=-1, keepdims=True)
    load_E = jnp.sum(onehot_TKE, axis=(0, 1))
    return router.Routing(weights_TK, experts_TK, router.load_balance_loss(experts_TK, probs_TE), jnp.zeros(()),
                          load_E, jnp.zeros(()))


def random_weights_TK(seed=1):
    """Positive, descending per token (as top-k softmax weights are)."""
    w = np.random.default_rng(seed).uniform(0.05, 1.0, (T, K)).astype(np.float32)
    return -np.sort(-w, axis=-1)


def grad_fn(fn, argnums):
    """jit(grad(fn)): one compile per loss instead of one dispatch per primitive."""
    return jax.grad(fn, argnums)


def assert_close(actual, desired, name, tol=TOL):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(desired, np.float32),
                               err_msg=name, **tol)


def kept_ref_TK(experts_TK, num_experts, cfg):
    cap = dense.capacity(S, num_experts, K, cfg.capacity_factor)
    return capacity_kept_reference(np.asarray(experts_TK).reshape(B, S, K), num_experts, cap).reshape(T, K)


# ------------------------------------------------------------------------------- 1. no cap: forward, grads


@pytest.mark.parametrize("num_experts,norm_topk_prob", [(4, False), (4, True), (8, False)])
def test_uncapped_forward_and_grads_match_reference(num_experts, norm_topk_prob):
    case = f"E={num_experts} norm_topk_prob={norm_topk_prob}"
    cfg = make_cfg(num_experts, None, norm_topk_prob)
    x, gate, w = make_inputs(num_experts, seed=num_experts)
    routing = router.route(x, gate, None, cfg)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal((T, D)).astype(np.float32))

    y, stats = dense.moe_ffn(x, routing, w, cfg)
    y_ref = moe_reference(x, routing.weights_TK, routing.experts_TK, *w)
    assert y.shape == (T, D) and y.dtype == jnp.float32, case
    assert float(jnp.max(jnp.abs(y_ref))) > 0.1, case   # the comparison is not of zeros
    assert_close(y, y_ref, f"forward, {case}")
    assert dropped_fraction(stats, routing) == 0.0, case

    # Fixed routing passed as an argument: grads w.r.t. x, the combine weights and the expert weights.
    def loss_impl(x, weights_TK, experts_TK, wi_0, wi_1, wo):
        r = routing._replace(weights_TK=weights_TK, experts_TK=experts_TK)
        return jnp.sum(dense.moe_ffn(x, r, ExpertWeights(wi_0, wi_1, wo), cfg)[0] * ct)

    def loss_ref(x, weights_TK, experts_TK, wi_0, wi_1, wo):
        return jnp.sum(moe_reference(x, weights_TK, experts_TK, wi_0, wi_1, wo) * ct)

    args = (x, routing.weights_TK, routing.experts_TK, *w)
    argnums = (0, 1, 3, 4, 5)
    g_impl = grad_fn(loss_impl, argnums)(*args)
    g_ref = grad_fn(loss_ref, argnums)(*args)
    for name, a, b in zip(("x", "weights_TK", "wi_0", "wi_1", "wo"), g_impl, g_ref):
        assert float(jnp.max(jnp.abs(b))) > 0, f"{case} d/d{name} reference is all zero"
        assert_close(a, b, f"grad fixed routing d/d{name}, {case}")

    # Routed end to end: x -> route(x, gate) -> combine; grads include the router gate.
    def routed_impl(x, gate, wi_0, wi_1, wo):
        r = router.route(x, gate, None, cfg)
        return jnp.sum(dense.moe_ffn(x, r, ExpertWeights(wi_0, wi_1, wo), cfg)[0] * ct)

    def routed_ref(x, gate, wi_0, wi_1, wo):
        r = router.route(x, gate, None, cfg)
        return jnp.sum(moe_reference(x, r.weights_TK, r.experts_TK, wi_0, wi_1, wo) * ct)

    g_impl = grad_fn(routed_impl, (0, 1, 2, 3, 4))(x, gate, *w)
    g_ref = grad_fn(routed_ref, (0, 1, 2, 3, 4))(x, gate, *w)
    for name, a, b in zip(("x", "gate", "wi_0", "wi_1", "wo"), g_impl, g_ref):
        assert float(jnp.max(jnp.abs(b))) > 0, f"{case} routed d/d{name} reference is all zero"
        assert_close(a, b, f"grad routed d/d{name}, {case}")


def test_reference_matches_per_token_loop():
    """The reference itself against the literal per-(token, slot) definition in numpy."""
    num_experts = 4
    x, _, w = make_inputs(num_experts, seed=3)
    experts = np.random.default_rng(4).permuted(np.tile(np.arange(num_experts), (T, 1)), axis=1)[:, :K]
    weights = random_weights_TK(5)
    kept = np.random.default_rng(6).random((T, K)) < 0.7
    xn, (w0, w1, wo) = np.asarray(x, np.float64), [np.asarray(a, np.float64) for a in w]
    expected = np.zeros((T, D))
    for t in range(T):
        for j in range(K):
            if kept[t, j]:
                e = experts[t, j]
                a = xn[t] @ w0[e]
                expected[t] += weights[t, j] * ((a / (1 + np.exp(-a)) * (xn[t] @ w1[e])) @ wo[e])
    assert_close(moe_reference(x, weights, experts, *w, kept_TK=kept), expected, "reference vs per-token loop")


# ------------------------------------------------------------------------------- 2. adversarial, no cap


@pytest.mark.parametrize("pair", [(0, 1), (3, 2)])
def test_all_tokens_to_one_expert_uncapped(pair):
    num_experts = 4
    case = f"every token -> experts {pair}"
    cfg = make_cfg(num_experts, None)
    x, _, w = make_inputs(num_experts, seed=11)
    routing = fixed_routing(np.tile(np.asarray(pair), (T, 1)), random_weights_TK(12), num_experts)
    y, stats = dense.moe_ffn(x, routing, w, cfg)
    y_ref = moe_reference(x, routing.weights_TK, routing.experts_TK, *w)
    assert_close(y, y_ref, f"forward, {case}")
    assert dropped_fraction(stats, routing) == 0.0, case
    _, _, kept = dense.dispatch_masks(routing.experts_TK.reshape(B, S, K), routing.weights_TK.reshape(B, S, K),
                                      num_experts, dense.capacity(S, num_experts, K, None))
    assert bool(jnp.all(kept)), case

    def loss(fn, x, weights_TK, experts_TK, wi_0, wi_1, wo):
        return jnp.sum(fn(x, weights_TK, experts_TK, wi_0, wi_1, wo) ** 2)

    impl = lambda x, wt, ex, a, b, c: dense.moe_ffn(x, routing._replace(weights_TK=wt, experts_TK=ex),
                                                     ExpertWeights(a, b, c), cfg)[0]
    args = (x, routing.weights_TK, routing.experts_TK, *w)
    g_impl = grad_fn(lambda *a: loss(impl, *a), (0, 1, 3, 4, 5))(*args)
    g_ref = grad_fn(lambda *a: loss(moe_reference, *a), (0, 1, 3, 4, 5))(*args)
    for name, a, b in zip(("x", "weights_TK", "wi_0", "wi_1", "wo"), g_impl, g_ref):
        assert_close(a, b, f"grad d/d{name}, {case}")


# ------------------------------------------------------------------------------- 3. capacity drops


def test_capacity_reference_hand_example():
    """First choices are served before any second choice, even a second choice of an earlier token."""
    # Group of 8 tokens, E=3, cap 2. Tokens 0,1: first -> 1, second -> 0. Tokens 2..7: first -> 0, second -> 2.
    experts = np.array([[[1, 0]] * 2 + [[0, 2]] * 6])
    expected = np.zeros((1, 8, 2), bool)
    expected[0, 0:2, 0] = True    # expert 1 first choices
    expected[0, 2:4, 0] = True    # expert 0: first choices of tokens 2, 3 fill it ...
    expected[0, 0:2, 1] = False   # ... so tokens 0, 1 lose their second choice (expert 0)
    expected[0, 2:4, 1] = True    # expert 2 second choices of tokens 2, 3
    np.testing.assert_array_equal(capacity_kept_reference(experts, 3, 2), expected, err_msg="reference")
    _, _, kept = dense.dispatch_masks(jnp.asarray(experts, jnp.int32), jnp.ones((1, 8, 2), jnp.float32), 3, 2)
    np.testing.assert_array_equal(np.asarray(kept), expected, err_msg="dense.dispatch_masks")


@pytest.mark.parametrize("num_experts,capacity_factor,gate_scale", [
    (4, 0.5, 1.0), (4, 0.5, 6.0), (8, 1.0, 6.0)])
def test_capped_matches_reference_with_kept_mask(num_experts, capacity_factor, gate_scale):
    case = f"E={num_experts} capacity_factor={capacity_factor} gate_scale={gate_scale}"
    cfg = make_cfg(num_experts, capacity_factor)
    cap = dense.capacity(S, num_experts, K, capacity_factor)
    assert cap == math.ceil(S * K / num_experts * capacity_factor) < S, case
    x, gate, w = make_inputs(num_experts, seed=21, gate_scale=gate_scale)
    routing = router.route(x, gate, None, cfg)
    kept_ref = kept_ref_TK(routing.experts_TK, num_experts, cfg)
    assert 0 < kept_ref.sum() < kept_ref.size, f"{case}: routing drops nothing or everything"

    _, _, kept = dense.dispatch_masks(routing.experts_TK.reshape(B, S, K), routing.weights_TK.reshape(B, S, K),
                                      num_experts, cap)
    np.testing.assert_array_equal(np.asarray(kept).reshape(T, K), kept_ref, err_msg=f"kept mask, {case}")

    y, stats = dense.moe_ffn(x, routing, w, cfg)
    y_ref = moe_reference(x, routing.weights_TK, routing.experts_TK, *w, kept_TK=kept_ref)
    assert_close(y, y_ref, f"forward, {case}")
    np.testing.assert_allclose(dropped_fraction(stats, routing), 1.0 - kept_ref.mean(), rtol=0, atol=1e-6,
                               err_msg=f"dropped_fraction, {case}")

    def loss_impl(x, weights_TK, experts_TK, wi_0, wi_1, wo):
        r = routing._replace(weights_TK=weights_TK, experts_TK=experts_TK)
        return jnp.sum(dense.moe_ffn(x, r, ExpertWeights(wi_0, wi_1, wo), cfg)[0] ** 2)

    def loss_ref(x, weights_TK, experts_TK, wi_0, wi_1, wo, kept_TK):
        return jnp.sum(moe_reference(x, weights_TK, experts_TK, wi_0, wi_1, wo, kept_TK) ** 2)

    args = (x, routing.weights_TK, routing.experts_TK, *w)
    g_impl = grad_fn(loss_impl, (0, 1, 3, 4, 5))(*args)
    g_ref = grad_fn(loss_ref, (0, 1, 3, 4, 5))(*args, jnp.asarray(kept_ref))
    for name, a, b in zip(("x", "weights_TK", "wi_0", "wi_1", "wo"), g_impl, g_ref):
        assert_close(a, b, f"grad d/d{name}, {case}")
    # Dropped slots get no gradient on their combine weight.
    assert bool(jnp.all(g_impl[1][~kept_ref] == 0)), case


@pytest.mark.parametrize("pair", [(0, 1), (2, 0)])
def test_all_tokens_to_one_expert_capped(pair):
    num_experts, capacity_factor = 4, 0.5
    case = f"every token -> experts {pair}, capacity_factor={capacity_factor}"
    cfg = make_cfg(num_experts, capacity_factor)
    cap = dense.capacity(S, num_experts, K, capacity_factor)
    assert cap == 4, case
    x, _, w = make_inputs(num_experts, seed=31)
    routing = fixed_routing(np.tile(np.asarray(pair), (T, 1)), random_weights_TK(32), num_experts)

    expected_GLK = np.zeros((B, S, K), bool)
    expected_GLK[:, :cap, :] = True     # only the first C tokens of each sequence, for both choices
    np.testing.assert_array_equal(capacity_kept_reference(routing.experts_TK.reshape(B, S, K), num_experts, cap),
                                  expected_GLK, err_msg=f"reference kept, {case}")
    _, _, kept = dense.dispatch_masks(routing.experts_TK.reshape(B, S, K), routing.weights_TK.reshape(B, S, K),
                                      num_experts, cap)
    np.testing.assert_array_equal(np.asarray(kept), expected_GLK, err_msg=f"dispatch_masks kept, {case}")

    y, stats = dense.moe_ffn(x, routing, w, cfg)
    y_ref = moe_reference(x, routing.weights_TK, routing.experts_TK, *w, kept_TK=expected_GLK.reshape(T, K))
    assert_close(y, y_ref, f"forward, {case}")
    y_GLD = np.asarray(y).reshape(B, S, D)
    assert np.all(y_GLD[:, cap:] == 0), f"{case}: tokens past capacity must get exactly 0"
    assert np.all(np.abs(y_GLD[:, :cap]).max(axis=-1) > 0), case
    np.testing.assert_allclose(dropped_fraction(stats, routing), 1.0 - cap / S, rtol=0, atol=1e-6,
                               err_msg=f"dropped_fraction, {case}")


def test_dispatch_and_combine_tensors_are_consistent():
    """Each (expert, slot) holds at most one token; combine = dispatch * that slot's weight."""
    num_experts, cap = 4, 3
    rng = np.random.default_rng(41)
    experts = np.stack([rng.permutation(num_experts)[:K] for _ in range(T)]).reshape(B, S, K)
    weights = random_weights_TK(42).reshape(B, S, K)
    dispatch, combine, kept = dense.dispatch_masks(jnp.asarray(experts, jnp.int32), jnp.asarray(weights),
                                                   num_experts, cap)
    dispatch, combine, kept = np.asarray(dispatch), np.asarray(combine), np.asarray(kept)
    assert dispatch.shape == combine.shape == (B, S, num_experts, cap)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert dispatch.sum(axis=1).max() <= 1                     # one token per (group, expert, slot)
    np.testing.assert_array_equal(dispatch.sum(axis=(2, 3)), kept.sum(-1), err_msg="slots per token")
    expected_combine = np.zeros_like(combine)
    for g in range(B):
        for s in range(S):
            for j in range(K):
                e = experts[g, s, j]
                expected_combine[g, s, e] += weights[g, s, j] * dispatch[g, s, e] * kept[g, s, j]
    np.testing.assert_allclose(combine, expected_combine, rtol=0, atol=0, err_msg="combine tensor")
    np.testing.assert_array_equal(kept, capacity_kept_reference(experts, num_experts, cap), err_msg="kept")


# ------------------------------------------------------------------------------- 4. capacity()


def test_capacity_values():
    assert dense.capacity(16, 4, 2, None) == 16
    assert dense.capacity(128, 64, 8, None) == 128
    assert dense.capacity(16, 4, 2, 0.5) == 4        # 16*2/4*0.5 = 4
    assert dense.capacity(16, 4, 2, 1.0) == 8
    assert dense.capacity(16, 8, 2, 1.0) == 4
    assert dense.capacity(10, 4, 2, 1.25) == 7       # 6.25 -> 7
    assert dense.capacity(16, 3, 2, 1.0) == 11       # 10.67 -> 11
    assert dense.capacity(16, 4, 2, 4.0) == 16       # 32 clipped to S
    assert dense.capacity(16, 4, 2, 100.0) == 16
    assert dense.capacity(16, 64, 1, 0.01) == 1      # 0.0025 -> at least 1
    assert dense.capacity(1, 8, 2, 1.0) == 1
    for s, e, k, f in [(16, 4, 2, 0.5), (32, 8, 2, 1.5), (64, 16, 4, 0.3), (128, 8, 1, 2.0), (16, 2, 2, 3.0)]:
        want = max(1, min(s, math.ceil(s * k / e * f)))
        assert dense.capacity(s, e, k, f) == want, (s, e, k, f)


@pytest.mark.parametrize("s,e,k,factor", [(100, 2, 1, "1.1"), (1000, 10, 1, "1.1"), (100, 6, 1, "0.9")])
def test_capacity_exact_for_decimal_factors(s, e, k, factor):
    """ceil(S*K/E * factor) with the factor as written in the config (1.1 means 11/10): when that product
    is a whole number the capacity is exactly it, not one more from float rounding."""
    want = max(1, min(s, math.ceil(Fraction(s * k, e) * Fraction(factor))))
    got = dense.capacity(s, e, k, float(factor))
    assert got == want, f"capacity(S={s}, E={e}, K={k}, capacity_factor={factor}) = {got}, want {want}"


# ------------------------------------------------------------------------------- 5. router: tests/test_router.py


# ------------------------------------------------------------------------------- 6. MoeBlock


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_block_matches_route_plus_reference(capacity_factor):
    num_experts = 4
    case = f"MoeBlock capacity_factor={capacity_factor}"
    cfg = make_cfg(num_experts, capacity_factor)
    blk = MoeBlock(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(0))
    assert blk.gate[...].shape == (D, num_experts) and blk.wi_0[...].shape == (num_experts, D, F)
    assert blk.wo[...].shape == (num_experts, F, D)
    x_BLD = jnp.asarray(np.random.default_rng(61).standard_normal((B, S, D)).astype(np.float32))
    y_BLD, stats = blk(x_BLD)
    assert y_BLD.shape == (B, S, D), case

    x_TD = x_BLD.reshape(T, D)
    r = router.route(x_TD, blk.gate[...], None, cfg)
    kept = kept_ref_TK(r.experts_TK, num_experts, cfg) if capacity_factor is not None else None
    if kept is not None:
        assert 0 < kept.sum() < kept.size, case
    y_ref = moe_reference(x_TD, r.weights_TK, r.experts_TK, blk.wi_0[...], blk.wi_1[...], blk.wo[...], kept)
    assert float(jnp.max(jnp.abs(y_ref))) > 0.01, case
    assert_close(y_BLD.reshape(T, D), y_ref, f"forward, {case}")
    assert_close(stats["lb_loss"], r.lb_loss, f"lb_loss, {case}")
    np.testing.assert_array_equal(np.asarray(stats["load_E"]), np.asarray(r.load_E), err_msg=f"load_E, {case}")
    want_dropped = 0.0 if kept is None else 1.0 - kept.mean()
    np.testing.assert_allclose(float(stats["dropped_fraction"]), want_dropped, rtol=0, atol=1e-6,
                               err_msg=f"dropped_fraction, {case}")


# ------------------------------------------------------------------------------- 7. bfloat16


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_bf16_within_tolerance_of_f32_reference(capacity_factor):
    num_experts = 4
    case = f"bf16 capacity_factor={capacity_factor}"
    cfg = make_cfg(num_experts, capacity_factor)
    x, gate, w = make_inputs(num_experts, seed=71)
    routing = router.route(x, gate, None, cfg)
    bf = jnp.bfloat16
    y, stats = dense.moe_ffn(x.astype(bf), routing, ExpertWeights(*(a.astype(bf) for a in w)), cfg)
    assert y.dtype == bf, case
    kept = kept_ref_TK(routing.experts_TK, num_experts, cfg) if capacity_factor is not None else None
    y_ref = moe_reference(x, routing.weights_TK, routing.experts_TK, *w, kept_TK=kept)
    assert_close(y, y_ref, f"forward, {case}", BF16_TOL)
    want_dropped = 0.0 if kept is None else 1.0 - kept.mean()
    np.testing.assert_allclose(dropped_fraction(stats, routing), want_dropped, rtol=0, atol=1e-6, err_msg=case)


# ------------------------------------------------------------------------------------- a safe default

def test_the_default_is_dropless_and_dense_refuses_quadratic_masks():
    """moe_impl defaults to ragged (dropless, as MaxText's default). dense without a capacity builds float32
    [S, E, S] masks per sequence: 8 GiB each for qwen3-30b-a3b at 4K, refused in one line naming the fix;
    capped, or at a short sequence, it loads."""
    from MaxText.config.errors import ConfigError

    assert load_config(["model_name=qwen3-30b-a3b", "max_target_length=4096"]).moe_impl == "ragged"
    with pytest.raises(ConfigError, match=r"8\.0 GiB per sequence .* use moe_impl=ragged") as raised:
        load_config(["model_name=qwen3-30b-a3b", "max_target_length=4096", "moe_impl=dense"])
    assert "\n" not in str(raised.value) and "capacity_factor=1.25" in str(raised.value)
    load_config(["model_name=qwen3-30b-a3b", "max_target_length=4096", "moe_impl=dense", "capacity_factor=1.25"])
    load_config(["model_name=qwen3-30b-a3b", "max_target_length=512", "moe_impl=dense"])


def test_plan_counts_dense_buffers_whole_under_expert_parallelism():
    """dense's [E, G, C] buffer is split over `expert` on E while its batch G is gathered by the same factor:
    a device holds E x its own G x C rows at any EP size (the plan used to divide by EP)."""
    from MaxText.planning import plan

    cfg = load_config(["moe_impl=dense", "capacity_factor=1.0", "max_target_length=64", "num_experts=8"])
    t = 4 * 64
    rows = [plan.moe_rows(cfg, t, ep) for ep in (1, 2, 8)]
    assert rows == [4 * 8 * dense.capacity(64, 8, cfg.num_experts_per_tok, 1.0)] * 3, rows

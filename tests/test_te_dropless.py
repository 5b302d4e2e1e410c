"""te_dropless stages on CPU: the 128-row aligned permutation, the kernel-set selection, and (marked `gpu`)
Transformer Engine's kernels against their pure-JAX references at TE's own tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config import ConfigError
from MaxText.layers.moe import te_dropless, te_kernels
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts
from tests.tiny import tiny_config

ALIGN = te_dropless.ALIGN


@pytest.mark.parametrize("name,experts", [
    ("skewed with empty experts", np.array([0, 3, 3, 0, 3, 5, 3, 0, 0, 3] * 30)),
    ("all to one", np.full(200, 2)),
    ("with EP padding ids", np.array([1, 4, 0, 4, 4, 2, 4, 3] * 20)),  # id 4 == num_experts: padding
])
def test_aligned_permute_layout_and_round_trip(name, experts):
    num_experts = 6 if "EP" not in name else 4
    x = np.arange(experts.size * 3, dtype=np.float32).reshape(-1, 3) + 1.0
    x_RD, sizes_E, rows_S = te_dropless.aligned_permute(jnp.asarray(x), jnp.asarray(experts, jnp.int32), num_experts)
    x_RD, sizes_E, rows_S = np.asarray(x_RD), np.asarray(sizes_E), np.asarray(rows_S)
    counts = np.bincount(experts[experts < num_experts], minlength=num_experts)
    np.testing.assert_array_equal(sizes_E, -(-counts // ALIGN) * ALIGN, err_msg=f"{name}: aligned sizes")
    assert x_RD.shape[0] == te_dropless.aligned_buffer_rows(experts.size, num_experts) and x_RD.shape[0] % ALIGN == 0
    starts = np.concatenate([[0], np.cumsum(sizes_E)[:-1]])
    for e in range(num_experts):
        mine = np.flatnonzero(experts == e)
        # Group e occupies [start, start + count) in slot order; the rest of its aligned block is zeros.
        np.testing.assert_array_equal(rows_S[mine], starts[e] + np.arange(mine.size), err_msg=f"{name}: expert {e}")
        np.testing.assert_array_equal(x_RD[starts[e] + mine.size: starts[e] + sizes_E[e]], 0.0)
    padding = experts >= num_experts
    assert np.all(rows_S[padding] >= x_RD.shape[0]), f"{name}: padding ids must stay out of the buffer"
    back = np.asarray(te_dropless.unpermute(jnp.asarray(x_RD), jnp.asarray(rows_S)))
    np.testing.assert_array_equal(back[~padding], x[~padding], err_msg=f"{name}: round trip")
    np.testing.assert_array_equal(back[padding], 0.0)


def test_kernel_sets_and_start_up_check():
    ref = tiny_config("moe_impl=te_dropless", "te_kernels=reference")
    assert te_kernels.kernels(ref) is te_kernels.REFERENCE
    te_kernels.check_available(ref)  # the references need nothing
    te_kernels.check_available(tiny_config("moe_impl=ragged"))  # other impls are not checked
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ConfigError, match="te_kernels=reference"):
            te_kernels.check_available(tiny_config("moe_impl=te_dropless"))


def test_te_options_are_validated():
    with pytest.raises(ConfigError, match="te_gmm_quantization"):
        tiny_config("moe_impl=ragged", "te_gmm_quantization=mxfp8")
    with pytest.raises(ConfigError, match="topk_routing_group"):
        tiny_config("moe_impl=te_dropless", "num_experts=8", "num_experts_per_tok=1", "n_routing_groups=4",
                    "topk_routing_group=2")


# ------------------------------------------------------------------------------------------- GPU only
# Run on an NVIDIA GPU with Transformer Engine installed: pytest -m gpu tests/test_te_dropless.py
# Tolerances are TE's own (tests/jax/utils.py dtype_tols): fp32 ~2.4e-5, bf16 ~3.9e-2.


@pytest.mark.gpu
@pytest.mark.parametrize("score_func,groups", [("softmax", None), ("sigmoid", (8, 4))])
def test_te_router_matches_reference(score_func, groups):
    extra = [f"n_routing_groups={groups[0]}", f"topk_routing_group={groups[1]}"] if groups else []
    cfg = tiny_config("moe_impl=te_dropless", "num_experts=64", "num_experts_per_tok=8",
                      f"routed_score_func={score_func}", "norm_topk_prob=true", "routed_scaling_factor=2.5", *extra)
    logits = jax.random.normal(jax.random.key(0), (2048, 64), jnp.float32)
    bias = jax.random.normal(jax.random.key(1), (64,)) * 0.1 if score_func == "sigmoid" else None
    te = te_kernels.kernels(cfg)
    w_te, e_te = jax.jit(lambda l, b: te.topk(l, b, cfg))(logits, bias)
    w_ref, e_ref = select_experts(expert_scores(logits, score_func), bias, cfg)
    np.testing.assert_array_equal(np.sort(e_te, -1), np.sort(e_ref, -1))
    order_te, order_ref = np.argsort(e_te, -1), np.argsort(e_ref, -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w_te), order_te, -1),
                               np.take_along_axis(np.asarray(w_ref), order_ref, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 3.9e-2), (jnp.float32, 2.4e-5)])
def test_te_grouped_gemm_matches_reference_forward_and_backward(dtype, tol):
    cfg = tiny_config("moe_impl=te_dropless")
    te = te_kernels.kernels(cfg)
    sizes = jnp.array([256, 0, 128, 512, 128, 0, 256, 768], jnp.int32)  # 128-aligned, with empty groups
    x = jax.random.normal(jax.random.key(0), (int(sizes.sum()), 256), dtype)
    w = jax.random.normal(jax.random.key(1), (8, 256, 512), dtype) * 256 ** -0.5

    def loss(gemm):
        return lambda x, w: jnp.sum(gemm(x, w).astype(jnp.float32)) / np.sqrt(x.size)

    got = jax.jit(jax.value_and_grad(loss(lambda x, w: te.grouped_gemm(x, w, sizes, "none")), (0, 1)))(x, w)
    want = jax.jit(jax.value_and_grad(loss(lambda x, w: grouped_matmul(x, w, sizes, kernel="ragged_dot")),
                                      (0, 1)))(x, w)
    for a, b, label in ((got[0], want[0], "loss"), (got[1][0], want[1][0], "dx"), (got[1][1], want[1][1], "dw")):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol,
                                   err_msg=label)


@pytest.mark.gpu
def test_te_permutation_matches_aligned_permute():
    """TE's token_dispatch with 128-row alignment builds the buffer our aligned_permute builds (same aligned
    group sizes and buffer size, the same rows in every expert group, zero padding), and token_combine with
    the routing probabilities gives our unpermute + weighted combine."""
    from transformer_engine.jax import permutation

    from MaxText.layers.moe.ragged import combine
    from MaxText.layers.moe.te_dropless import aligned_permute, unpermute

    t, e, k, h = 512, 8, 2, 64
    scores = jax.random.gumbel(jax.random.key(0), (t, e)) - 1.5 * jnp.log1p(jnp.arange(e))  # skewed
    experts_TK = jnp.argsort(-scores, axis=1)[:, :k].astype(jnp.int32)
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32)
    routing_map = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=jnp.int32), axis=1)
    probs = jax.random.uniform(jax.random.key(2), (t, e)) * routing_map
    out, _, row_id_map, pad_offsets, tokens_per_expert = permutation.token_dispatch(
        x, routing_map, num_out_tokens=t * k, probs=probs, align_size=128)
    x_RD, sizes_E, rows_S = aligned_permute(jnp.repeat(x, k, axis=0), experts_TK.reshape(-1), e)
    np.testing.assert_array_equal(np.asarray(tokens_per_expert), np.asarray(sizes_E), err_msg="aligned group sizes")
    assert out.shape == x_RD.shape, (out.shape, x_RD.shape)
    start = 0
    for i, size in enumerate(np.asarray(sizes_E)):
        got, want = (np.asarray(a[start:start + size]) for a in (out, x_RD))
        np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)], err_msg=f"expert {i} rows")
        start += size
    np.testing.assert_array_equal(np.asarray(out[start:]), 0.0, err_msg="rows after the last group")
    y_te = permutation.token_combine(out, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
    weights_TK = jnp.take_along_axis(probs, experts_TK, axis=1)
    y_ref = combine(unpermute(x_RD, rows_S), weights_TK)
    np.testing.assert_allclose(np.asarray(y_te), np.asarray(y_ref), rtol=2.4e-5, atol=2.4e-5)

"""Tiled cross-entropy (num_vocab_tiling) equals the whole-logits loss, in value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers.losses import cross_entropy


def _case(b=3, l=5, d=8, v=11, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (b, l, d))
    w = jax.random.normal(k[1], (d, v))
    targets = jax.random.randint(k[2], (b, l), 0, v)
    weights = (jax.random.uniform(k[3], (b, l)) > 0.3).astype(jnp.float32)
    return h, w, targets, weights


def _reference(h, w, targets, weights):
    """float64 numpy: -log softmax(h w)[target], weighted mean over tokens."""
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return np.sum((logz - picked) * weights) / max(np.sum(weights), 1.0)


@pytest.mark.parametrize("tiles", [1, 3, 4, 15])  # 15 tokens: 4 tiles pad the last one
def test_tiled_cross_entropy_matches_reference_and_whole(tiles):
    h, w, targets, weights = _case()

    def loss(h, w, t):
        return cross_entropy(h, targets, weights, lambda x: x @ w, t)

    np.testing.assert_allclose(loss(h, w, tiles), _reference(h, w, targets, weights), rtol=1e-5,
                               err_msg=f"tiles={tiles}: value")
    grads = jax.grad(loss, argnums=(0, 1))(h, w, tiles)
    whole = jax.grad(loss, argnums=(0, 1))(h, w, 1)
    for name, g, want in zip(("d h", "d w"), grads, whole):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7, err_msg=f"tiles={tiles}: {name}")


def test_tiling_keeps_logits_out_of_the_saved_residuals():
    """Compiled gradient: with 8 tiles the temp memory is well below the whole-logits version's."""
    h, w, targets, weights = _case(b=4, l=64, d=16, v=2048)

    def temp(tiles):
        f = jax.jit(jax.grad(lambda h, w: cross_entropy(h, targets, weights, lambda x: x @ w, tiles), (0, 1)))
        return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    whole, tiled = temp(1), temp(8)
    assert tiled < 0.5 * whole, (whole, tiled)


def test_logits_dot_backward_runs_in_the_input_dtype():
    """embed.logits_dot: float32 logits forward; its backward rounds the cotangent to bf16 (as a bf16 logits
    matmul would) and returns gradients in the inputs' dtype, within bf16 rounding of float32 autodiff."""
    from MaxText.layers.embed import logits_dot

    h, w, targets, weights = _case(d=16, v=64)

    def loss(fn, h, w):
        return cross_entropy(h, targets, weights, lambda x: fn(x, w))

    def f32(x, w_):
        return jnp.einsum("bld,dv->blv", x.astype(jnp.float32), w_.astype(jnp.float32))

    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert logits_dot(hb, wb).dtype == jnp.float32
    np.testing.assert_allclose(loss(logits_dot, hb, wb), loss(f32, hb, wb), rtol=1e-6)
    got = jax.grad(lambda h_, w_: loss(logits_dot, h_, w_), argnums=(0, 1))(hb, wb)
    want = jax.grad(lambda h_, w_: loss(f32, h_, w_), argnums=(0, 1))(hb, wb)
    for g, r in zip(got, want):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=2e-2 * scale)

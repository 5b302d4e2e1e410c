"""`attention: chunked` against `dot_product` (and both against a float64 numpy reference): outputs and
q/k/v gradients for GQA and MLA shapes with packed documents and padding, lengths that are not a multiple
of the chunk, chunk >= L; that chunking lowers the compiled backward's temporary memory; and whole models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.layers.attention import chunked_attention, dot_product_attention
from MaxText.layers.models import Transformer
from tests.tiny import tiny_config

B = 2
# name: (L, H query heads, N key/value heads, K, V, scale or None for 1/sqrt(K), chunk)
CASES = {
    "gqa": (24, 4, 2, 8, 8, None, 8),
    "gqa_ragged": (21, 4, 2, 8, 8, None, 8),  # 3 chunks, the last padded with 3 masked rows
    "mla": (24, 4, 4, 12, 8, 0.37, 8),  # MLA: one query head per key head, V != K, a given scale
    "mla_ragged": (21, 4, 4, 12, 8, 0.37, 5),
    "chunk_is_L": (24, 4, 2, 8, 8, None, 24),
    "chunk_over_L": (21, 4, 4, 12, 8, 0.37, 64),
}


def _segments(length):
    """Row 0: documents of 9 and 7 tokens, then padding (segment 0); row 1: documents of 5, 6 and the rest."""
    pos = np.arange(length)
    row0 = np.where(pos < 9, 1, np.where(pos < 16, 2, 0))
    row1 = np.where(pos < 5, 1, np.where(pos < 11, 2, 3))
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


def _qkv(length, h, n, kd, vd, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, length, h, kd)), jax.random.normal(kk, (B, length, n, kd)),
            jax.random.normal(kv, (B, length, n, vd)))


def _np_attention(q, k, v, segments, scale):
    """One batch row, head and query at a time, in float64. A padding query (segment 0) sees no key, so
    its softmax over all-masked logits is uniform over every key, as in the implementations."""
    q, k, v, segments = (np.asarray(a, np.float64) for a in (q, k, v, segments))
    b, length, h, _ = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, length, h, v.shape[-1]))
    for r in range(b):
        for head in range(h):
            for i in range(length):
                visible = [j for j in range(i + 1) if segments[r, j] == segments[r, i]] if segments[r, i] else []
                if not visible:
                    out[r, i, head] = v[r, :, head // group].mean(0)
                    continue
                logits = np.array([q[r, i, head] @ k[r, j, head // group] * scale for j in visible])
                w = np.exp(logits - logits.max())
                out[r, i, head] = (w / w.sum()) @ v[r, visible, head // group]
    return out


def _loss(attend):
    """A random linear function of the attention output; returns (loss, output)."""
    w_key = jax.random.key(9)

    def loss(q, k, v, segments):
        out = attend(q, k, v, segments)
        return jnp.sum(out * jax.random.normal(w_key, out.shape)), out
    return loss


def _output_and_grads(attend, *args):
    """attend's output and d/dq, d/dk, d/dv of _loss, from one compiled program."""
    (_, out), grads = jax.jit(jax.value_and_grad(_loss(attend), argnums=(0, 1, 2), has_aux=True))(*args)
    return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_dot_product(case):
    """Forward against the float64 reference, and forward plus d/dq, d/dk, d/dv of chunked against dot_product;
    with chunk >= L the two are the same program, so they agree exactly."""
    length, h, n, kd, vd, scale, chunk = CASES[case]
    q, k, v = _qkv(length, h, n, kd, vd)
    segments = _segments(length)
    out_dense, grads_dense = _output_and_grads(
        lambda q, k, v, s: dot_product_attention(q, k, v, s, scale=scale), q, k, v, segments)
    out_chunked, grads_chunked = _output_and_grads(
        lambda q, k, v, s: chunked_attention(q, k, v, s, chunk_size=chunk, scale=scale), q, k, v, segments)
    want = _np_attention(q, k, v, segments, kd ** -0.5 if scale is None else scale)
    np.testing.assert_allclose(out_dense, want, rtol=1e-5, atol=1e-5, err_msg=f"{case}: dot_product vs reference")
    np.testing.assert_allclose(out_chunked, want, rtol=1e-5, atol=1e-5, err_msg=f"{case}: chunked vs reference")
    exact = chunk >= length
    for name, a, b in zip(("output", "d/dq", "d/dk", "d/dv"), [out_dense, *grads_dense], [out_chunked, *grads_chunked]):
        assert np.abs(a).sum() > 0, f"{case}: {name} is all zero"
        if exact:
            np.testing.assert_array_equal(b, a, err_msg=f"{case}: chunk >= L must equal dot_product ({name})")
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"{case}: chunked {name} vs dot_product")


def test_chunked_backward_needs_less_temporary_memory():
    """L=512, chunk 64: the compiled grad's temporaries (scores saved for the backward pass, or recomputed
    one chunk at a time) are well under half of dot_product's."""
    length, chunk = 512, 64
    q, k, v = _qkv(length, 4, 2, 16, 16)
    segments = jnp.ones((B, length), jnp.int32)

    def temp_bytes(attend):
        grad = jax.jit(jax.grad(lambda *a: _loss(attend)(*a)[0], argnums=(0, 1, 2)))
        return grad.lower(q, k, v, segments).compile().memory_analysis().temp_size_in_bytes

    dense = temp_bytes(lambda q, k, v, s: dot_product_attention(q, k, v, s))
    chunked = temp_bytes(lambda q, k, v, s: chunked_attention(q, k, v, s, chunk_size=chunk))
    scores = B * 4 * length * length * 4  # one float32 [B, H, L, L]
    print(f"temp bytes: dot_product {dense}, chunked {chunked}, one [B, H, L, L] float32 {scores}")
    assert chunked < 0.5 * dense, f"chunked temp {chunked} bytes is not < 0.5 x dot_product's {dense}"


MODELS = {
    "mha": lambda *o: tiny_config("max_target_length=32", *o),
    "deepseek3-tiny": lambda *o: load_config(["model_name=deepseek3-tiny", "dtype=float32", "max_target_length=32",
                                              "enable_tensorboard=false", *o]),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_model_logits_same_with_chunked_attention(model):
    """Same parameters, a packed batch with padding: attention=chunked (chunk 8 of L=32) gives the logits of
    attention=dot_product."""
    length = 32
    logits = {}
    for impl in ("dot_product", "chunked"):
        cfg = MODELS[model](f"attention={impl}", "attention_chunk_size=8")
        m = Transformer(cfg, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (B, length), 0, cfg.vocab_size)
        segments = _segments(length)
        starts = jnp.asarray([[0, 9, 16], [0, 5, 11]])
        positions = jnp.arange(length)[None] - jnp.take_along_axis(
            starts, jnp.clip(segments - 1, 0, 2), axis=1) * (segments > 0)
        logits[impl] = np.asarray(nnx.jit(lambda m, t, p, s: m(t, p, s)[0])(m, tokens, positions, segments))
    np.testing.assert_allclose(logits["chunked"], logits["dot_product"], rtol=2e-5, atol=2e-5,
                               err_msg=f"{model}: chunked vs dot_product logits")


@pytest.mark.parametrize("override, needle", [("attention=bogus", "attention=bogus is not one of"),
                                              ("attention_chunk_size=0", "attention_chunk_size=0 must be at least 1")])
def test_attention_keys_are_checked(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([override])

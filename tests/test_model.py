"""Model properties: causality and document masking, and that scan / remat variants change nothing numerically."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.layers.attention import Attention
from MaxText.layers.models import Transformer
from MaxText.step.train_step import loss_fn
from tests.tiny import tiny_config

B, L = 2, 16


def _batch(seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, L + 1)).astype(np.int32)
    ones = np.ones((B, L), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": np.tile(np.arange(L), (B, 1)),
            "inputs_segmentation": ones, "targets_segmentation": ones}


def test_attention_is_causal_by_gradient():
    """d out[:, i] / d x[:, j] is zero for every j > i and non-zero for j <= i."""
    cfg = tiny_config()
    attn = Attention(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, L, cfg.base_emb_dim))
    positions = jnp.arange(L)[None]
    segments = jnp.ones((1, L), jnp.int32)
    grad_fn = nnx.jit(lambda a, x, i: jax.grad(lambda x: jnp.sum(
        jnp.take(a(x, positions, segments), i, axis=1) ** 2))(x))
    for i in (0, 5, L - 1):
        grad = grad_fn(attn, x, i)
        per_position = np.abs(np.asarray(grad[0])).sum(-1)
        np.testing.assert_array_equal(per_position[i + 1:], 0.0, err_msg=f"query {i} sees the future")
        assert np.all(per_position[: i + 1] > 0), f"query {i} ignores some past position: {per_position[: i + 1]}"


def test_model_logits_do_not_depend_on_later_tokens():
    """Changing token j leaves the logits of every earlier position unchanged (up to float noise: with the
    dense MoE a later first choice can move an earlier second choice to another capacity slot)."""
    model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
    apply = nnx.jit(lambda m, t: m(t)[0])
    tokens = jnp.asarray(_batch()["inputs"])
    base = apply(model, tokens)
    j = 9
    changed = apply(model, tokens.at[:, j].set((tokens[:, j] + 1) % 64))
    np.testing.assert_allclose(np.asarray(changed[:, :j]), np.asarray(base[:, :j]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(changed[:, j:], base[:, j:]), "a changed token must change its own logits"


def test_segments_do_not_attend_across_documents():
    """With two packed documents, the second one's logits equal those of the document run on its own."""
    model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(_batch()["inputs"][:1])
    split = 6
    segments = jnp.where(jnp.arange(L) < split, 1, 2)[None]
    positions = jnp.where(jnp.arange(L) < split, jnp.arange(L), jnp.arange(L) - split)[None]
    apply = nnx.jit(lambda m, t, p, s: m(t, p, s)[0])
    packed = apply(model, tokens, positions, segments)
    alone = apply(model, tokens[:, split:], positions[:, split:], segments[:, split:])
    np.testing.assert_allclose(np.asarray(packed[:, split:]), np.asarray(alone), rtol=2e-5, atol=2e-5)


def _stack(unrolled: dict) -> dict:
    """Unrolled params (layers_0, layers_1, ...) -> the scanned layout (one `layers` stack)."""
    out = {}
    for name, sub in unrolled.items():
        if isinstance(sub, dict) and "layers_0" in sub:
            out[name] = {"layers": jax.tree.map(lambda *a: jnp.stack(a), *(sub[f"layers_{i}"] for i in range(len(sub))))}
        else:
            out[name] = sub
    return out


def _unstack(scanned: dict) -> dict:
    """Scanned params (a `layers` stack with a leading layer axis) -> unrolled (layers_0, layers_1, ...)."""
    out = {}
    for name, sub in scanned.items():
        if isinstance(sub, dict) and set(sub) == {"layers"}:
            count = jax.tree.leaves(sub["layers"])[0].shape[0]
            out[name] = {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], sub["layers"]) for i in range(count)}
        else:
            out[name] = sub
    return out


VARIANTS = [
    ("scan", "none"), ("scan", "full"), ("scan", "minimal"), ("scan", "custom"),
    ("unrolled", "full"), ("unrolled", "custom"),  # unrolled/none is the reference itself
]


@pytest.fixture(scope="module")
def reference_loss_and_grads():
    cfg = tiny_config("scan_layers=false", "remat_policy=none")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    (loss, _), grads = jax.jit(jax.value_and_grad(
        lambda p, b: loss_fn(p, b, graphdef, cfg), has_aux=True))(params, _batch())
    return params, loss, grads


@pytest.mark.parametrize("layout,remat", VARIANTS)
def test_scan_and_remat_variants_match_plain_model(layout, remat, reference_loss_and_grads):
    """Same params, same batch: loss and every gradient agree with the unrolled, no-remat model."""
    ref_params, ref_loss, ref_grads = reference_loss_and_grads
    custom = ["query_proj=offload", "value_proj=offload", "key_proj=device", "mlpwo=device", "moe_mlpwi_0=device"]
    cfg = tiny_config(f"scan_layers={layout == 'scan'}", f"remat_policy={remat}", *(custom if remat == "custom" else []))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = _stack(ref_params) if layout == "scan" else ref_params
    (loss, _), grads = jax.jit(jax.value_and_grad(
        lambda p, b: loss_fn(p, b, graphdef, cfg), has_aux=True))(params, _batch())
    if layout == "scan":
        grads = _unstack(grads)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=f"{layout}/{remat} loss")
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    flat = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    for path, ref in flat_ref:
        np.testing.assert_allclose(flat[path], ref, rtol=2e-5, atol=1e-6,
                                   err_msg=f"{layout}/{remat} grad {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_invariant_to_query_key_scale(qk_norm):
    """With per-head RMSNorm on queries and keys (Qwen3), scaling wq and wk changes nothing; without it,
    it sharpens the attention."""
    cfg = tiny_config(f"qk_norm={qk_norm}", "normalization_layer_epsilon=1e-6")  # eps << mean square
    attn = Attention(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, L, cfg.base_emb_dim))
    positions, segments = jnp.tile(jnp.arange(L), (2, 1)), jnp.ones((2, L), jnp.int32)
    before = attn(x, positions, segments)
    attn.wq[...] = attn.wq[...] * 10.0
    attn.wk[...] = attn.wk[...] * 10.0
    after = attn(x, positions, segments)
    if qk_norm:
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)
    else:
        assert not np.allclose(after, before, atol=1e-3)

"""MLA and YaRN: the module against a float64 numpy reference written from the formulas, causality and
segment masking by gradient, YaRN frequencies against hand-derived values, gradients and remat."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.layers.attention_mla import MLA
from MaxText.layers.rope import apply_rope, rope_frequencies, rope_frequencies_for, yarn_frequencies, yarn_mscale
from tests.tiny import tiny_config

B, L, D, H, NOPE, ROPE, V, RKV = 2, 12, 32, 4, 8, 4, 8, 16
THETA = 10000.0
MLA_KEYS = ("attention_type=mla", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4", "v_head_dim=8")
# A yarn setting whose 2 rope pairs land on both sides of the ramp: pair 0 (10 rotations over 64 positions,
# above beta_fast=4) is kept, pair 1 (0.1 rotations) sits half-way up the ramp (low=0, high=2).
YARN_KEYS = ("rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=64", "beta_fast=4",
             "beta_slow=0.05", "mscale=0.8")
CASES = {"q_lora16": ("q_lora_rank=16",), "q_lora0": ("q_lora_rank=0",),
         "q_lora16_yarn": ("q_lora_rank=16",) + YARN_KEYS, "q_lora0_yarn": ("q_lora_rank=0",) + YARN_KEYS,
         "q_lora0_yarn_half_pairs": ("q_lora_rank=0", "rope_interleave=false") + YARN_KEYS}
TAGS = ("mla_q", "mla_kv", "query_proj", "key_proj", "value_proj", "out_proj")


def _cfg(*overrides):
    return tiny_config(*MLA_KEYS, *overrides)


def _mla(cfg, seed=0):
    """An MLA whose every parameter (norm scales included) is random, so the reference sees them all."""
    m = MLA(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(seed))
    state = nnx.state(m, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(100 + seed), len(leaves))
    new = [(1.0 if p.ndim == 1 else 0.0) + 0.3 * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
    nnx.update(m, jax.tree.unflatten(treedef, new))
    return m


def _inputs(seed=1):
    x = jax.random.normal(jax.random.key(seed), (B, L, D), jnp.float32)
    # Row 0: one document; row 1: two packed documents, positions restarting at the second.
    split = 7
    segments = np.stack([np.ones(L), np.where(np.arange(L) < split, 1, 2)]).astype(np.int32)
    positions = np.stack([np.arange(L), np.where(np.arange(L) < split, np.arange(L), np.arange(L) - split)])
    return x, jnp.asarray(positions, jnp.int32), jnp.asarray(segments)


def _np_yarn_frequencies(dim, theta, factor, original, beta_fast, beta_slow):
    """YaRN (DeepSeek-V3 convention) in float64 numpy: ramp linear in the pair index between the pairs that
    turn beta_fast and beta_slow times over `original` positions; 0 (keep) on the fast side, 1 (/factor) on
    the slow side."""
    def pair(rotations):
        return dim * np.log(original / (2 * np.pi * rotations)) / (2 * np.log(theta))
    low, high = max(np.floor(pair(beta_fast)), 0), min(np.ceil(pair(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    base = theta ** (-np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return base * (1 - ramp) + base / factor * ramp


def _np_rope(x_K, position, freqs, interleave=False):
    """Half-split layout: pair (x[i], x[i + K/2]) rotated by position * freqs[i]; interleaved: pair
    (x[2i], x[2i + 1]), written back in place."""
    a = position * freqs
    if interleave:
        out = x_K.copy()
        for i, angle in enumerate(a):
            x1, x2 = x_K[2 * i], x_K[2 * i + 1]
            out[2 * i], out[2 * i + 1] = x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)
        return out
    x1, x2 = np.split(x_K, 2)
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)])


def _np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * scale


def _reference(m, cfg, x, positions, segments):
    """MLA from the formulas, one batch row, head and query at a time, in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(m, nnx.Param)).items()
         if not isinstance(v, dict)}
    q_scale = np.asarray(m.q_norm.scale[...], np.float64) if cfg.q_lora_rank else None
    kv_scale = np.asarray(m.kv_norm.scale[...], np.float64)
    eps = cfg.normalization_layer_epsilon
    if cfg.rope_type == "yarn":
        freqs = _np_yarn_frequencies(ROPE, THETA, cfg.rope_factor, cfg.original_max_position_embeddings,
                                     cfg.beta_fast, cfg.beta_slow)
        scale = (NOPE + ROPE) ** -0.5 * (0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1) ** 2
    else:
        freqs = THETA ** (-np.arange(0, ROPE, 2) / ROPE)
        scale = (NOPE + ROPE) ** -0.5
    inter = cfg.rope_type == "yarn" and cfg.rope_interleave
    x, positions, segments = np.asarray(x, np.float64), np.asarray(positions), np.asarray(segments)
    out = np.zeros((B, L, D))
    for b in range(B):
        q, k, v = np.zeros((L, H, NOPE + ROPE)), np.zeros((L, H, NOPE + ROPE)), np.zeros((L, H, V))
        for t in range(L):
            xt = x[b, t]
            q_t = (np.einsum("r,rhk->hk", _np_rms(xt @ p["wq_a"], q_scale, eps), p["wq_b"])
                   if cfg.q_lora_rank else np.einsum("d,dhk->hk", xt, p["wq"]))
            latent = xt @ p["wkv_a"]
            k_pe = _np_rope(latent[RKV:], positions[b, t], freqs, inter)
            kv_t = np.einsum("r,rhk->hk", _np_rms(latent[:RKV], kv_scale, eps), p["wkv_b"])
            for h in range(H):
                q[t, h] = np.concatenate([q_t[h, :NOPE], _np_rope(q_t[h, NOPE:], positions[b, t], freqs, inter)])
                k[t, h] = np.concatenate([kv_t[h, :NOPE], k_pe])
                v[t, h] = kv_t[h, NOPE:]
        for h in range(H):
            for i in range(L):
                visible = [j for j in range(i + 1) if segments[b, j] == segments[b, i]]
                logits = np.array([q[i, h] @ k[j, h] * scale for j in visible])
                w = np.exp(logits - logits.max())
                o = (w / w.sum()) @ v[visible, h]
                out[b, i] += o @ p["out"][h]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_mla_matches_reference(case):
    """Two batch rows (one document; two packed documents with restarting positions) vs the reference."""
    cfg = _cfg(*CASES[case])
    m = _mla(cfg)
    x, positions, segments = _inputs()
    got = nnx.jit(lambda m, x, p, s: m(x, p, s))(m, x, positions, segments)
    want = _reference(m, cfg, x, positions, segments)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"MLA {case} vs reference")


@pytest.mark.parametrize("case", ["q_lora16", "q_lora0_yarn"])
def test_mla_is_causal_by_gradient(case):
    """d out[:, i] / d x[:, j] is zero for every j > i and non-zero for j <= i."""
    m = _mla(_cfg(*CASES[case]))
    x = jax.random.normal(jax.random.key(1), (1, L, D))
    positions, segments = jnp.arange(L)[None], jnp.ones((1, L), jnp.int32)
    grad_fn = nnx.jit(lambda m, x, i: jax.grad(lambda x: jnp.sum(
        jnp.take(m(x, positions, segments), i, axis=1) ** 2))(x))
    for i in (0, 5, L - 1):
        per_position = np.abs(np.asarray(grad_fn(m, x, i)[0])).sum(-1)
        np.testing.assert_array_equal(per_position[i + 1:], 0.0, err_msg=f"{case}: query {i} sees the future")
        assert np.all(per_position[: i + 1] > 0), f"{case}: query {i} ignores some past position {per_position}"


@pytest.mark.parametrize("case", ["q_lora16", "q_lora0_yarn"])
def test_mla_segments_do_not_attend_across_documents(case):
    """The second packed document's output equals that document run on its own, and gets no gradient
    from the first document's tokens."""
    m = _mla(_cfg(*CASES[case]))
    x, positions, segments = _inputs()
    split = 7
    apply = nnx.jit(lambda m, x, p, s: m(x, p, s))
    packed = apply(m, x[1:], positions[1:], segments[1:])
    alone = apply(m, x[1:, split:], positions[1:, split:], segments[1:, split:])
    np.testing.assert_allclose(np.asarray(packed[:, split:]), np.asarray(alone), rtol=1e-5, atol=1e-5,
                               err_msg=f"{case}: second document differs when packed")
    grad = nnx.jit(lambda m, x: jax.grad(lambda x: jnp.sum(m(x, positions[1:], segments[1:])[:, split:] ** 2))(x))(
        m, x[1:])
    np.testing.assert_array_equal(np.asarray(grad[0, :split]), 0.0,
                                  err_msg=f"{case}: the second document depends on the first")


def test_yarn_frequencies_hand_derived():
    """rope_dim 8, theta 1e4: pair frequencies 1, 0.1, 0.01, 0.001 turn 652, 65, 6.5, 0.65 times over 4096
    positions. Pair index at 32 rotations: 8 ln(4096 / (2 pi 32)) / (2 ln 1e4) = 1.309 -> low = 1; at 1
    rotation: 8 ln(4096 / 2 pi) / (2 ln 1e4) = 2.814 -> high = 3. Ramp (i - 1) / 2 = 0, 0, 0.5, 1."""
    got = np.asarray(yarn_frequencies(8, THETA, 4.0, 4096, 32.0, 1.0))
    want = np.array([1.0, 0.1, 0.5 * 0.01 + 0.5 * 0.01 / 4, 0.001 / 4])
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg="yarn_frequencies(8, 1e4, factor 4, 4096, 32, 1)")


def test_yarn_frequencies_deepseek_setting():
    """DeepSeek-V3's setting (rope 64, factor 40, 4096, beta 32/1): the numpy formula, and by rotations:
    above beta_fast kept, below beta_slow divided by 40, a monotone ramp in between."""
    dim, factor, original = 64, 40.0, 4096
    got = np.asarray(yarn_frequencies(dim, THETA, factor, original, 32.0, 1.0), np.float64)
    np.testing.assert_allclose(got, _np_yarn_frequencies(dim, THETA, factor, original, 32.0, 1.0), rtol=1e-6,
                               err_msg="yarn_frequencies vs the numpy formula")
    base = THETA ** (-np.arange(0, dim, 2) / dim)
    rotations = original * base / (2 * np.pi)
    fast, slow = rotations > 32.0, rotations < 1.0
    assert fast.sum() >= 8 and slow.sum() >= 8, (fast.sum(), slow.sum())  # the case covers both sides
    np.testing.assert_allclose(got[fast], base[fast], rtol=1e-6, err_msg="high-frequency pairs must be kept")
    np.testing.assert_allclose(got[slow], base[slow] / factor, rtol=1e-6, err_msg="low-frequency pairs must be /40")
    ratio = got / base
    middle = ~fast & ~slow
    assert np.all((ratio[middle] > 1 / factor) & (ratio[middle] < 1)), f"ramp pairs not interpolated: {ratio}"
    assert np.all(np.diff(ratio) <= 1e-6), f"ratio to the base frequency must not increase with i: {ratio}"


def test_yarn_factor_one_is_default_rope():
    """factor 1: interpolated and kept frequencies coincide, so YaRN is plain RoPE."""
    np.testing.assert_allclose(np.asarray(yarn_frequencies(64, THETA, 1.0, 4096, 32.0, 1.0)),
                               np.asarray(rope_frequencies(64, THETA)), rtol=1e-7, err_msg="factor 1 changed RoPE")


def test_yarn_mscale():
    """0.1 * mscale * ln(factor) + 1, and 1 when factor <= 1."""
    np.testing.assert_allclose(yarn_mscale(40.0, 1.0), 0.1 * math.log(40.0) + 1, rtol=1e-12, err_msg="(40, 1)")
    np.testing.assert_allclose(yarn_mscale(40.0, 0.707), 0.0707 * math.log(40.0) + 1, rtol=1e-12, err_msg="(40, .707)")
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 1.0) == 1.0, "no temperature without extension"


def test_rope_frequencies_for():
    """rope_type picks plain RoPE or YaRN with the config's yarn keys."""
    default = np.asarray(rope_frequencies_for(_cfg(), ROPE))
    np.testing.assert_array_equal(default, np.asarray(rope_frequencies(ROPE, THETA)), err_msg="rope_type=default")
    yarn = np.asarray(rope_frequencies_for(_cfg(*YARN_KEYS), ROPE))
    np.testing.assert_allclose(yarn, _np_yarn_frequencies(ROPE, THETA, 4.0, 64, 4.0, 0.05), rtol=1e-6,
                               err_msg="rope_type=yarn")
    assert not np.allclose(yarn, default), "the yarn case must differ from plain RoPE"


def test_apply_rope_default_unchanged():
    """Without frequencies apply_rope is the half-split rotation by theta^(-2i/K), same as passing them."""
    k = 8
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, k))
    positions = jnp.asarray(np.stack([np.arange(5), np.arange(5) + 100]))
    plain = np.asarray(apply_rope(x, positions, THETA))
    explicit = np.asarray(apply_rope(x, positions, frequencies_K2=rope_frequencies(k, THETA)))
    np.testing.assert_array_equal(plain, explicit, err_msg="apply_rope(theta) vs apply_rope(rope_frequencies)")
    freqs = THETA ** (-np.arange(0, k, 2) / k)
    want = np.array([[[_np_rope(np.asarray(x[b, t, h], np.float64), int(positions[b, t]), freqs) for h in range(3)]
                      for t in range(5)] for b in range(2)])
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5, err_msg="apply_rope vs numpy half-split rotation")
    yarn = np.asarray(apply_rope(x, positions, frequencies_K2=yarn_frequencies(k, THETA, 4.0, 64, 4.0, 0.05)))
    assert not np.allclose(yarn, plain), "frequencies_K2 was ignored"


def _loss_and_args(case):
    m = _mla(_cfg(*CASES[case]))
    graphdef, params = nnx.split(m)
    x, positions, segments = _inputs()
    w = jax.random.normal(jax.random.key(7), (B, L, D))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, positions, segments) * w)
    return loss, params, x


@pytest.mark.parametrize("case", ["q_lora16", "q_lora0"])
def test_mla_gradients_reach_every_parameter(case):
    """The parameter set is the one the config asks for, and each gets a non-zero gradient."""
    loss, params, x = _loss_and_args(case)
    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params, x))
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    query = ["['wq_a']", "['q_norm']['scale']", "['wq_b']"] if case == "q_lora16" else ["['wq']"]
    want = sorted(query + ["['wkv_a']", "['kv_norm']['scale']", "['wkv_b']", "['out']"])
    assert sorted(jax.tree_util.keystr(p) for p, _ in flat) == want, [jax.tree_util.keystr(p) for p, _ in flat]
    for path, g in flat:
        assert np.abs(np.asarray(g)).sum() > 0, f"{case}: no gradient reaches {jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("case", ["q_lora16", "q_lora0_yarn"])
def test_mla_remat_matches_no_remat(case):
    """jit + jax.checkpoint(save_only_these_names('mla_q', 'mla_kv')) gives the gradients of the plain loss,
    and every checkpoint_name tag is in the traced program."""
    loss, params, x = _loss_and_args(case)
    names = set(TAGS) - ({"mla_q"} if case.startswith("q_lora0") else set())
    program = str(jax.make_jaxpr(loss)(params, x))
    missing = [n for n in names if f"name[name={n}]" not in program]
    assert not missing, f"{case}: checkpoint_name tags missing: {missing}"
    policy = jax.checkpoint_policies.save_only_these_names("mla_q", "mla_kv")
    plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(plain)[0], jax.tree.leaves(remat)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7,
                                   err_msg=f"{case}: remat gradient differs at {jax.tree_util.keystr(path)}")

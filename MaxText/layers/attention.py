"""Causal grouped-query attention (GQA) with RoPE and document (segment) masking."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import fan_in_init, param
from MaxText.layers.rope import apply_rope, static_rope_frequencies
from MaxText.sharding import constrain


class Attention(nnx.Module):
    """Multi-head attention where N key/value heads each serve H/N query heads."""

    def __init__(self, cfg, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        d, h, n, k = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
        self.wq = param(rngs, fan_in_init(0, (1, 2)), (d, h, k), ("embed", "heads", "head_dim"), weight_dtype)
        self.wk = param(rngs, fan_in_init(0, (1, 2)), (d, n, k), ("embed", "kv_heads", "head_dim"), weight_dtype)
        self.wv = param(rngs, fan_in_init(0, (1, 2)), (d, n, k), ("embed", "kv_heads", "head_dim"), weight_dtype)
        self.wo = param(rngs, fan_in_init((0, 1), 2), (h, k, d), ("heads", "head_dim", "embed"), weight_dtype)
        if cfg.qk_norm:
            norm = dict(epsilon=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
            self.query_norm, self.key_norm = RMSNorm(k, **norm), RMSNorm(k, **norm)
        self.qk_norm = cfg.qk_norm
        self.rope_frequencies = static_rope_frequencies(cfg, k)  # RoPE, or YaRN with rope_type: yarn
        self.dtype = dtype
        self.rules = rules

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        dt = self.dtype
        q = checkpoint_name(jnp.einsum("bld,dhk->blhk", x_BLD, self.wq[...].astype(dt)), "query_proj")
        k = checkpoint_name(jnp.einsum("bld,dnk->blnk", x_BLD, self.wk[...].astype(dt)), "key_proj")
        v = checkpoint_name(jnp.einsum("bld,dnk->blnk", x_BLD, self.wv[...].astype(dt)), "value_proj")
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), self.rules)
        if self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        freqs = jnp.asarray(self.rope_frequencies, jnp.float32)
        q = apply_rope(q, positions_BL, frequencies_K2=freqs)
        k = apply_rope(k, positions_BL, frequencies_K2=freqs)
        out_BLHK = dot_product_attention(q, k, v, segment_ids_BL)
        out = jnp.einsum("blhk,hkd->bld", out_BLHK, self.wo[...].astype(dt))
        out = checkpoint_name(out, "out_proj")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)


def attention_mask(segment_ids_BL):
    """[B, 1, L, L] True where query i may attend key j: j <= i, same segment, and not padding (segment 0)."""
    length = segment_ids_BL.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
    real = (segment_ids_BL != 0)[:, :, None]
    return (causal[None] & same & real)[:, None]


def dot_product_attention(q_BLHK, k_BLNK, v_BLNK, segment_ids_BL):
    """softmax(q k^T / sqrt(K)) v with GQA grouping; logits and softmax in float32."""
    b, l, h, kd = q_BLHK.shape
    n = k_BLNK.shape[2]
    q = q_BLHK.reshape(b, l, n, h // n, kd)
    logits = jnp.einsum("bqngk,bsnk->bngqs", q, k_BLNK, preferred_element_type=jnp.float32)
    logits = logits * (kd ** -0.5)
    mask = attention_mask(segment_ids_BL)[:, :, None]  # [B, 1, 1, L, L]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BLNK.dtype)
    out = jnp.einsum("bngqs,bsnk->bqngk", probs, v_BLNK)
    return out.reshape(b, l, h, kd)

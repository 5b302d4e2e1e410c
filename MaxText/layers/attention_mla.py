"""DeepSeek-V3 Multi-head Latent Attention (MLA): keys and values from a shared low-rank latent.

Shapes: B batch, L length, D embed, H heads, R lora rank (Rq query, Rkv key/value), K query/key head dim
(nope + rope), V value head dim, P the RoPE part of K (qk_rope_head_dim).

    query  = [x Wq  (or norm(x Wq_a) Wq_b)] -> per head (q_nope, q_pe); q_pe rotated
    latent = x Wkv_a -> (c_kv [Rkv], k_pe [P]); k_pe rotated once and shared by every head
    (k_nope, v) = norm(c_kv) Wkv_b per head;  key = (k_nope, k_pe)
    out    = softmax(q k^T * scale + mask) v Wo

RoPE uses apply_rope's half-split layout (pairs (x[i], x[i + P/2])), also for YaRN frequencies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.attention import cached_mask, expanded_attention, whole_sequence, write_cache
from MaxText.layers.linear import DenseGemms, dense_gemm
from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import fan_in_init, param
from MaxText.layers.rope import apply_rope, attention_factor, interleaved, static_rope_frequencies, yarn_mscale
from MaxText.parallel.sharding import constrain

_HEADS = ("activation_batch", "activation_length", "activation_heads", None)
# Each projection's logical axes: its parameter's and what linear.dense_gemm gathers it by (DenseGemms).
AXES = {"wq_a": ("embed", "q_lora"), "wq_b": ("q_lora", "heads", "head_dim"), "wq": ("embed", "heads", "head_dim"),
        "wkv_a": ("embed", "kv_lora"), "wkv_b": ("kv_lora", "heads", "head_dim"),
        "out": ("heads", "head_dim", "embed")}


class MLA(DenseGemms, nnx.Module):
    """Multi-head latent attention; same call signature as Attention so a decoder layer can use either."""

    AXES = AXES

    def __init__(self, cfg, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        d, h = cfg.base_emb_dim, cfg.base_num_query_heads
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        norm_kw = dict(epsilon=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        if rq > 0:
            self.wq_a = param(rngs, fan_in_init(0, 1), (d, rq), AXES["wq_a"], weight_dtype)
            self.q_norm = RMSNorm(rq, **norm_kw)
            self.wq_b = param(rngs, fan_in_init(0, (1, 2)), (rq, h, nope + rope), AXES["wq_b"], weight_dtype)
        else:
            self.wq = param(rngs, fan_in_init(0, (1, 2)), (d, h, nope + rope), AXES["wq"], weight_dtype)
        self.wkv_a = param(rngs, fan_in_init(0, 1), (d, rkv + rope), AXES["wkv_a"], weight_dtype)
        self.kv_norm = RMSNorm(rkv, **norm_kw)
        self.wkv_b = param(rngs, fan_in_init(0, (1, 2)), (rkv, h, nope + v), AXES["wkv_b"], weight_dtype)
        self.out = param(rngs, fan_in_init((0, 1), 2), (h, v, d), AXES["out"], weight_dtype)
        self.rope_frequencies = static_rope_frequencies(cfg, rope)
        self.rope_interleave = interleaved(cfg)
        self.rope_scale = attention_factor(cfg)
        scale = (nope + rope) ** -0.5
        if cfg.rope_type == "yarn":
            # DeepSeek's convention: YaRN's temperature (mscale, transformers' mscale_all_dim) multiplies the softmax
            # scale, squared; cos/sin are multiplied by rope_attention_factor (1 in DeepSeek-V3's release).
            scale *= yarn_mscale(cfg.rope_factor, cfg.mscale) ** 2
        self.softmax_scale = scale
        self.q_lora_rank, self.kv_lora_rank, self.nope_dim = rq, rkv, nope
        self.attention, self.attention_chunk_size = cfg.attention, cfg.attention_chunk_size
        self.load_balance = cfg.context_parallel_load_balance
        self.quantization = cfg.quantization
        self.dtype = dtype
        self.rules = rules

    def _query(self, x_BLD, positions_BL):
        """The queries [B, L, H, nope + rope], their rope part rotated."""
        if self.q_lora_rank > 0:
            q_BLR = checkpoint_name(self._gemm("bld,dr->blr", x_BLD, "wq_a"), "mla_q")
            q_BLHK = self._gemm("blr,rhk->blhk", self.q_norm(q_BLR), "wq_b")
        else:
            q_BLHK = self._gemm("bld,dhk->blhk", x_BLD, "wq")
        q_BLHK = constrain(q_BLHK, _HEADS, self.rules)
        q_nope, q_pe = jnp.split(q_BLHK, [self.nope_dim], axis=-1)
        q_pe = self._rope(q_pe, positions_BL)
        return checkpoint_name(jnp.concatenate([q_nope, q_pe], axis=-1), "query_proj")

    def _rope(self, x_BLHP, positions_BL):
        return apply_rope(x_BLHP, positions_BL, frequencies_K2=jnp.asarray(self.rope_frequencies, jnp.float32),
                          interleave=self.rope_interleave, scale=self.rope_scale)

    def _latent(self, x_BLD, positions_BL):
        """What MLA caches per position: the normalised key-value latent [B, L, Rkv] and the rotated shared rope
        key [B, L, 1, P]."""
        kv_BLR = checkpoint_name(self._gemm("bld,dr->blr", x_BLD, "wkv_a"), "mla_kv")
        c_kv_BLR, k_pe_BLP = jnp.split(kv_BLR, [self.kv_lora_rank], axis=-1)
        return self.kv_norm(c_kv_BLR), self._rope(k_pe_BLP[:, :, None, :], positions_BL)

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        q_BLHK = self._query(x_BLD, positions_BL)
        c_BLR, k_pe_BL1P = self._latent(x_BLD, positions_BL)
        # Context parallelism gathers the latent (Rkv + P numbers a token), not the keys and values it expands to;
        # the expansion runs with the attention, on each device (expanded_attention).
        c_BLR = whole_sequence(c_BLR, ("activation_batch", None, None), self.rules)
        k_pe_BL1P = whole_sequence(k_pe_BL1P, ("activation_batch", None, None, None), self.rules)
        w_RHK = self._weight("wkv_b")
        # The GQA core with one query head per key head; V may differ from K and the scale is given (YaRN).
        latent_axes = (("activation_batch", None, None), ("activation_batch", None, None, None),
                       (None, "activation_heads", None))
        out_BLHV = expanded_attention(
            q_BLHK, self._keys_values, (c_BLR, k_pe_BL1P, w_RHK), latent_axes, segment_ids_BL, impl=self.attention,
            chunk_size=self.attention_chunk_size, scale=self.softmax_scale, rules=self.rules,
            load_balance=self.load_balance, check_vma=self.quantization == "none")
        return self._out(out_BLHV)

    def _keys_values(self, c_BLR, k_pe_BL1P, w_RHK, rules):
        """Every head's keys (nope part expanded from the latent, the shared rope key) and values [B, L, H, .]; rules
        None inside context parallelism's per-device function (no sharding constraints there)."""
        kv_BLHK = dense_gemm("blr,rhk->blhk", c_BLR, w_RHK, self.quantization)
        kv_BLHK = constrain(kv_BLHK, ("activation_batch", None, "activation_heads", None), rules)  # length whole
        k_nope, v_BLHV = jnp.split(kv_BLHK, [self.nope_dim], axis=-1)
        b, l, h, _ = k_nope.shape
        k_pe_BLHP = jnp.broadcast_to(k_pe_BL1P, (b, l, h, k_pe_BL1P.shape[-1]))
        k_BLHK = checkpoint_name(jnp.concatenate([k_nope, k_pe_BLHP], axis=-1), "key_proj")
        return k_BLHK, checkpoint_name(v_BLHV, "value_proj")

    def _out(self, out_BLHV):
        out = checkpoint_name(self._gemm("blhv,hvd->bld", out_BLHV, "out"), "out_proj")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict:
        """MLA's compressed cache of one layer: the normalised latent and the rotated rope key per position, shared
        by every head (Rkv + P numbers a position, where GQA's cache would hold 2 H x K)."""
        return {"c": (batch, length, cfg.kv_lora_rank), "k_pe": (batch, length, cfg.qk_rope_head_dim)}

    def decode(self, x_BTD, start, cache: dict):
        """T new tokens at positions start .. start + T - 1 against the compressed cache, absorbed as DeepSeek decodes:
        each head's query is taken into the latent space through its key up-projection (q_nope W_kb^T), scored
        against the cached latents plus the rope keys, and the softmax-weighted latent goes out through the value
        up-projection: the keys and values per head are never formed. (out, new cache)."""
        positions_BT = jnp.broadcast_to(start + jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
        q_nope, q_pe = jnp.split(self._query(x_BTD, positions_BT), [self.nope_dim], axis=-1)
        c_BTR, k_pe_BT1P = self._latent(x_BTD, positions_BT)
        cache = {"c": write_cache(cache["c"], c_BTR, start),
                 "k_pe": write_cache(cache["k_pe"], k_pe_BT1P[:, :, 0], start)}
        w_kb, w_vb = jnp.split(self.wkv_b[...].astype(self.dtype), [self.nope_dim], axis=-1)  # [R, H, nope], [R, H, V]
        q_lat_BTHR = jnp.einsum("bthn,rhn->bthr", q_nope, w_kb)
        logits = (jnp.einsum("bthr,bsr->bhts", q_lat_BTHR, cache["c"], preferred_element_type=jnp.float32)
                  + jnp.einsum("bthp,bsp->bhts", q_pe, cache["k_pe"], preferred_element_type=jnp.float32))
        mask_TS = cached_mask(start, x_BTD.shape[1], cache["c"].shape[1])
        logits = jnp.where(mask_TS, logits * self.softmax_scale, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(cache["c"].dtype)
        out_BTHV = jnp.einsum("bthr,rhv->bthv", jnp.einsum("bhts,bsr->bthr", probs, cache["c"]), w_vb)
        return self._out(out_BTHV), cache

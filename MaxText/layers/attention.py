"""Causal grouped-query attention (GQA) with RoPE and document (segment) masking.

The score/softmax/value core is shared with MLA (attention_mla.py); `attention: chunked` runs it over
blocks of query rows so that no [B, H, L, L] score matrix is ever held; `attention: cudnn_flash` runs cuDNN's
fused kernel on CUDA GPUs (attention_cudnn.py) and the chunked path elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import attention_cudnn, attention_cudnn_cp
from MaxText.layers.linear import DenseGemms
from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import fan_in_init, param
from MaxText.layers.rope import apply_rope, attention_factor, interleaved, static_rope_frequencies
from MaxText.parallel.sharding import constrain, context_axes, logical_to_spec, spec_axes


# Each projection's logical axes: its parameter's and what linear.dense_gemm gathers it by (DenseGemms).
AXES = {"wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
        "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed")}


class Attention(DenseGemms, nnx.Module):
    """Multi-head attention where N key/value heads each serve H/N query heads."""

    AXES = AXES

    def __init__(self, cfg, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        d, h, n, k = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
        self.wq = param(rngs, fan_in_init(0, (1, 2)), (d, h, k), AXES["wq"], weight_dtype)
        self.wk = param(rngs, fan_in_init(0, (1, 2)), (d, n, k), AXES["wk"], weight_dtype)
        self.wv = param(rngs, fan_in_init(0, (1, 2)), (d, n, k), AXES["wv"], weight_dtype)
        self.wo = param(rngs, fan_in_init((0, 1), 2), (h, k, d), AXES["wo"], weight_dtype)
        if cfg.qk_norm:
            norm = dict(epsilon=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
            self.query_norm, self.key_norm = RMSNorm(k, **norm), RMSNorm(k, **norm)
        self.qk_norm = cfg.qk_norm
        self.rope_frequencies = static_rope_frequencies(cfg, k)  # RoPE, or YaRN with rope_type: yarn
        self.rope_interleave = interleaved(cfg)
        self.rope_scale = attention_factor(cfg)
        self.attention, self.attention_chunk_size = cfg.attention, cfg.attention_chunk_size
        self.load_balance = cfg.context_parallel_load_balance
        self.quantization = cfg.quantization
        self.dtype = dtype
        self.rules = rules

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        q, k, v = self._qkv(x_BLD, positions_BL)
        k, v = (whole_sequence(a, ("activation_batch", None, "activation_kv_heads", None), self.rules) for a in (k, v))
        out_BLHK = attention(q, k, v, segment_ids_BL, impl=self.attention, chunk_size=self.attention_chunk_size,
                             rules=self.rules, load_balance=self.load_balance)
        return self._out(out_BLHK)

    def _qkv(self, x_BLD, positions_BL):
        """Queries, keys and values, RoPE applied (and qk_norm before it)."""
        q = checkpoint_name(self._gemm("bld,dhk->blhk", x_BLD, "wq"), "query_proj")
        k = checkpoint_name(self._gemm("bld,dnk->blnk", x_BLD, "wk"), "key_proj")
        v = checkpoint_name(self._gemm("bld,dnk->blnk", x_BLD, "wv"), "value_proj")
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), self.rules)
        if self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        freqs = jnp.asarray(self.rope_frequencies, jnp.float32)
        q = apply_rope(q, positions_BL, frequencies_K2=freqs, interleave=self.rope_interleave, scale=self.rope_scale)
        k = apply_rope(k, positions_BL, frequencies_K2=freqs, interleave=self.rope_interleave, scale=self.rope_scale)
        return q, k, v

    def _out(self, out_BLHK):
        out = checkpoint_name(self._gemm("blhk,hkd->bld", out_BLHK, "wo"), "out_proj")
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.rules)

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict:
        """The KV cache of one layer for `batch` rows of `length` positions: keys (RoPE applied) and values."""
        shape = (batch, length, cfg.base_num_kv_heads, cfg.head_dim)
        return {"k": shape, "v": shape}

    def decode(self, x_BTD, start, cache: dict):
        """T new tokens at positions start .. start + T - 1 of every row: their keys and values written into the
        cache there, their queries attending every cached position up to their own. (out, new cache)."""
        positions_BT = jnp.broadcast_to(start + jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
        q, k, v = self._qkv(x_BTD, positions_BT)
        cache = {"k": write_cache(cache["k"], k, start), "v": write_cache(cache["v"], v, start)}
        out_BTHK = cached_attention(q, cache["k"], cache["v"], start, scale=q.shape[-1] ** -0.5)
        return self._out(out_BTHK), cache


def whole_sequence(x, logical_axes, rules):
    """Context parallelism's all-gather strategy: x [B, L, ...] (keys, values, or MLA's latent) constrained to its
    logical axes with the length whole, so that XLA gathers it over the context axis and each device's queries meet
    every key; the queries stay split. Nothing without a context axis of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty or mesh.shape.get("context", 1) == 1:
        return x
    return constrain(x, logical_axes, rules)


def write_cache(cache_BS, new_BT, start):
    """new_BT written into the cache at positions start .. start + T - 1 (the same for every row)."""
    return jax.lax.dynamic_update_slice_in_dim(cache_BS, new_BT.astype(cache_BS.dtype), start, axis=1)


def cached_mask(start, t: int, s: int):
    """[T, S] True where new token i (at position start + i) sees cache position j: j <= start + i (the cache beyond
    is unwritten or stale)."""
    return jnp.arange(s)[None, :] <= (start + jnp.arange(t))[:, None]


def cached_attention(q_BTHK, k_BSNK, v_BSNV, start, scale: float):
    """Queries at positions start .. start + T - 1 against the cache's S positions (cached_mask): _softmax_values'
    core, as training's causal attention computes it."""
    mask_BTS = cached_mask(start, q_BTHK.shape[1], k_BSNK.shape[1])[None]
    return _softmax_values(q_BTHK, k_BSNK, v_BSNV, mask_BTS, scale)


KV_AXES = ("activation_batch", None, "activation_kv_heads", None)  # keys and values, the length whole


def attention(q_BLHK, k_BSNK, v_BSNV, segment_ids_BL, *, impl: str, chunk_size: int, scale: float | None = None,
              rules=None, load_balance: bool = False):
    """The `attention` config choice: dot_product (all [B, H, L, L] scores at once), chunked (one
    [B, H, chunk_size, L] block of query rows at a time, recomputed in the backward pass) or cudnn_flash
    (cuDNN's fused kernel on CUDA, chunked elsewhere and for rows with more documents than it takes).
    rules (logical_axis_rules) let cudnn_flash pin q, k, v and its row tables to one sharding. Under context
    parallelism (k, v whole: whole_sequence) attention runs per device (context_parallel), the chunked path and
    cuDNN's load-balanced with context_parallel_load_balance."""
    return expanded_attention(q_BLHK, lambda k, v, rules: (k, v), (k_BSNK, v_BSNV), (KV_AXES, KV_AXES),
                              segment_ids_BL, impl=impl, chunk_size=chunk_size, scale=scale, rules=rules,
                              load_balance=load_balance)


def expanded_attention(q_BLHK, expand, kv_args, kv_axes, segment_ids_BL, *, impl: str, chunk_size: int,
                       scale: float | None = None, rules=None, load_balance: bool = False, check_vma: bool = True):
    """attention against the keys and values expand(*kv_args, rules) -> (k, v) (GQA: given; MLA: expanded from the
    whole sequence's latent), kv_axes the logical axes of kv_args. Under context parallelism the expansion runs per
    device with the attention (context_parallel), so the backward sums kv_args' cotangents over the context axis
    (MLA: the latent's, 576 numbers a token, not its expanded keys' and values' 40960). check_vma=False where
    expand calls Transformer Engine (its custom VJPs carry no shard_map manual-axis types)."""
    if context_axes(rules):
        return context_parallel(q_BLHK, expand, kv_args, kv_axes, segment_ids_BL, impl=impl, chunk_size=chunk_size,
                                scale=scale, rules=rules, load_balance=load_balance, check_vma=check_vma)
    k_BSNK, v_BSNV = expand(*kv_args, rules)
    if impl == "cudnn_flash":
        scale = q_BLHK.shape[-1] ** -0.5 if scale is None else scale
        fallback = functools.partial(chunked_attention, chunk_size=chunk_size, scale=scale)
        return attention_cudnn.attention(q_BLHK, k_BSNK, v_BSNV, segment_ids_BL, scale=scale, fallback=fallback,
                                         rules=rules)
    if impl == "chunked":
        return chunked_attention(q_BLHK, k_BSNK, v_BSNV, segment_ids_BL, chunk_size=chunk_size, scale=scale)
    return dot_product_attention(q_BLHK, k_BSNK, v_BSNV, segment_ids_BL, scale=scale)


def context_parallel(q_BLHK, expand, kv_args, kv_axes, segment_ids_BL, *, impl: str, chunk_size: int, scale, rules,
                     load_balance: bool = False, check_vma: bool = True):
    """Context parallelism's all-gather strategy on one device, in shard_map: its piece of every sequence's queries
    (positions from the piece's start on) against the whole keys and values expanded there from kv_args (given
    whole: XLA gathers them over the context axis), document masking by the whole row's segment ids. Left to the
    partitioner, the chunked path's loop over query chunks re-gathered the keys in every trip. The backward sums
    kv_args' cotangents over the axes they are whole on (an all-reduce over the context axis; a gathered weight's,
    over the batch axes too). load_balance (chunked, cudnn_flash): balanced_chunks. cudnn_flash runs cuDNN's kernel
    on CUDA (attention_cudnn_cp), the chunked path elsewhere."""
    mesh, axes = jax.sharding.get_abstract_mesh(), context_axes(rules)
    spec = functools.partial(logical_to_spec, rules=rules)
    q_spec = spec(("activation_batch", "activation_length", "activation_heads", None))
    kv_specs = tuple(spec(a) for a in kv_axes)
    rows = spec(("activation_batch", None))
    scale = q_BLHK.shape[-1] ** -0.5 if scale is None else scale
    devices = math.prod(mesh.shape[a] for a in axes)
    piece = q_BLHK.shape[1] // devices
    balance = balanced(impl, load_balance, q_BLHK.shape[1], devices)
    # the mesh axes each of kv_args is whole on (replicated over)
    whole_on = [tuple(m for m in mesh.axis_names if m not in {a for e in s for a in spec_axes(e)}) for s in kv_specs]

    def local(q, kv_segment_ids, *kv_args):
        # Whole on devices that differ in their queries, kv_args are marked as varying over those axes here, so that
        # the backward sums their cotangents over the devices once, here, and not in every trip of the chunk loop
        # (without check_vma nothing is typed and shard_map's transpose sums them on the way out).
        if check_vma:
            kv_args = [jax.lax.pcast(a, over, to="varying") for a, over in zip(kv_args, whole_on)]
        k, v = expand(*kv_args, None)

        def exact(q_BQHK, start, latest=None):  # the XLA paths for queries at start ..
            q_segment_ids = jax.lax.dynamic_slice_in_dim(kv_segment_ids, start, q_BQHK.shape[1], axis=1)
            if latest is not None:
                return _prefix_chunks(q_BQHK, k, v, q_segment_ids, kv_segment_ids, start, latest, chunk_size, scale)
            if impl == "dot_product":
                return _attend(q_BQHK, k, v, q_segment_ids, kv_segment_ids, start, scale)
            return _chunked(q_BQHK, k, v, q_segment_ids, kv_segment_ids, start, chunk_size, scale)

        block = exact
        if impl == "cudnn_flash":  # cuDNN's kernel on CUDA, the exact chunked path elsewhere
            def block(q_BQHK, start, latest=None):
                fallback = lambda q, start: exact(q, start, latest)  # noqa: E731
                return attention_cudnn_cp.attend(q_BQHK, start, k, v, kv_segment_ids, scale=scale, fallback=fallback)
        if balance:
            return balanced_chunks(q, axes, devices, block)
        return block(q, jax.lax.axis_index(axes) * piece)

    return jax.shard_map(local, in_specs=(q_spec, rows, *kv_specs), out_specs=q_spec,
                         check_vma=check_vma)(q_BLHK, segment_ids_BL, *kv_args)


def balanced(impl: str, load_balance: bool, length: int, devices: int) -> bool:
    """Whether context parallelism over `devices` runs the load-balanced path (balanced_chunks): load_balance
    (context_parallel_load_balance) with the chunked attention or cuDNN's, each device's piece in two equal blocks."""
    return devices > 1 and load_balance and impl in ("chunked", "cudnn_flash") and (length // devices) % 2 == 0


def context_share(impl: str, load_balance: bool, length: int, devices: int, chunk_size: int) -> float:
    """Under context parallelism over `devices`, the attention work of the busiest device per token, as a share of
    what the same kernel does per token on one device: the chunked path computes every device's rectangle of its
    queries against the whole sequence (1.0), or prefix_share of it load-balanced; cuDNN's kernel computes the
    causal triangle, whose last piece is the largest (2 - 1/devices of the average), or the average itself
    load-balanced (each device an early and a late block)."""
    if devices <= 1:
        return 1.0
    if impl == "cudnn_flash":
        return 1.0 if balanced(impl, load_balance, length, devices) else 2.0 - 1.0 / devices
    return prefix_share(length, devices, chunk_size) if balanced(impl, load_balance, length, devices) else 1.0


def balanced_chunks(q_BPHK, axes, devices: int, block):
    """Causal load balance for context parallelism, on one device in shard_map. The sequence is 2c blocks (c devices);
    device j holds blocks 2j and 2j + 1 (its piece) but computes the queries of blocks j and 2c - 1 - j, one early
    and one late, so that every device's queries see about as many keys: the queries travel there (two collective
    permutes of half a piece) and their outputs back. block(q, start, latest) attends the queries at start ..
    against the whole sequence's keys, start at most latest on every device: the chunked path computes each group
    of query rows against the static key prefix the latest such group can see, about 0.7 of the whole-sequence
    rectangle the unbalanced chunked path computes (prefix_share); cuDNN's kernel, the causal triangle. The same
    numbers as the unbalanced path, but for padding query rows (segment 0), whose outputs the loss masks out."""
    half = q_BPHK.shape[1] // 2
    j = jax.lax.axis_index(axes)
    # Half h of device d's piece is block 2d + h, which device computer(2d + h) takes: a permutation per half.
    perms = [[(d, balanced_computer(2 * d + h, devices)) for d in range(devices)] for h in (0, 1)]
    moved = [jax.lax.ppermute(part, axes, perm) for part, perm in zip((q_BPHK[:, :half], q_BPHK[:, half:]), perms)]
    # Of device j's blocks j and 2c - 1 - j, the even one came by the first permutation.
    even = j % 2 == 0
    early, late = jnp.where(even, moved[0], moved[1]), jnp.where(even, moved[1], moved[0])
    outs = [block(early, j * half, (devices - 1) * half),
            block(late, (2 * devices - 1 - j) * half, (2 * devices - 1) * half)]
    back = [jax.lax.ppermute(out, axes, [(dst, src) for src, dst in perm]) for out, perm in
            zip((jnp.where(even, outs[0], outs[1]), jnp.where(even, outs[1], outs[0])), perms)]
    return jnp.concatenate(back, axis=1)


def balanced_computer(block: int, devices: int) -> int:
    """The device that computes the queries of `block` (of 2 x devices) under causal load balance."""
    return block if block < devices else 2 * devices - 1 - block


# Row groups per balanced block, each with its own static key prefix (and a loop over its chunks): more would unroll
# more attention into the layer (compile time), fewer would compute more of the masked-out triangle.
PREFIX_GROUPS = 8


def prefix_rows(queries: int, latest: int, keys: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """(first row, last row + 1, keys) of each group of `queries` rows starting at most at position `latest`: whole
    chunks, at most PREFIX_GROUPS groups, each with the static key prefix its last row needs on every device."""
    c = min(chunk_size, queries)
    rows = -(-queries // (PREFIX_GROUPS * c)) * c
    return [(lo, min(lo + rows, queries), min(latest + min(lo + rows, queries), keys))
            for lo in range(0, queries, rows)]


def prefix_share(length: int, devices: int, chunk_size: int) -> float:
    """Of the score rectangle the unbalanced chunked path computes on a device ((length / devices) x length), the
    share balanced_chunks computes."""
    half = length // (2 * devices)
    done = sum((hi - lo) * keys for latest in ((devices - 1) * half, (2 * devices - 1) * half)
               for lo, hi, keys in prefix_rows(half, latest, length, chunk_size))
    return done / (2 * half * length)


def _prefix_chunks(q_BQHK, k_BSNK, v_BSNV, q_segment_ids_BQ, kv_segment_ids_BS, q_start, latest: int,
                   chunk_size: int, scale):
    """_chunked for queries at q_start.. (q_start <= latest on every device), a group of rows at a time, each
    against the static key prefix it needs (prefix_rows)."""
    outs = []
    for lo, hi, keys in prefix_rows(q_BQHK.shape[1], latest, k_BSNK.shape[1], chunk_size):
        outs.append(_chunked(q_BQHK[:, lo:hi], k_BSNK[:, :keys], v_BSNV[:, :keys], q_segment_ids_BQ[:, lo:hi],
                             kv_segment_ids_BS[:, :keys], q_start + lo, chunk_size, scale))
    return jnp.concatenate(outs, axis=1)


def attention_mask(q_segment_ids_BQ, kv_segment_ids_BS, q_start=0):
    """[B, Q, S] True where query q_start + i may attend key j: j <= q_start + i, same segment, and the
    query is not padding (segment 0)."""
    q_pos_Q = q_start + jnp.arange(q_segment_ids_BQ.shape[1])
    causal_QS = jnp.arange(kv_segment_ids_BS.shape[1])[None, :] <= q_pos_Q[:, None]
    same = q_segment_ids_BQ[:, :, None] == kv_segment_ids_BS[:, None, :]
    real = (q_segment_ids_BQ != 0)[:, :, None]
    return causal_QS[None] & same & real


def _attend(q_BQHK, k_BSNK, v_BSNV, q_segment_ids_BQ, kv_segment_ids_BS, q_start, scale):
    """softmax(q k^T * scale + mask) v for queries q_start.. against all S keys; N key/value heads each
    serve H/N query heads (N = H for MLA). Logits and softmax in float32; V may differ from K."""
    mask = attention_mask(q_segment_ids_BQ, kv_segment_ids_BS, q_start)
    return _softmax_values(q_BQHK, k_BSNK, v_BSNV, mask, scale)


def _softmax_values(q_BQHK, k_BSNK, v_BSNV, mask_BQS, scale):
    """softmax(q k^T * scale) v where mask_BQS (B may be 1) holds, the groups of H/N query heads per key head."""
    b, q_len, h, kd = q_BQHK.shape
    n = k_BSNK.shape[2]
    q = q_BQHK.reshape(b, q_len, n, h // n, kd)
    logits = jnp.einsum("bqngk,bsnk->bngqs", q, k_BSNK, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask_BQS[:, None, None], logits, jnp.finfo(jnp.float32).min)  # [B, 1, 1, Q, S]
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BSNV.dtype)
    out = jnp.einsum("bngqs,bsnv->bqngv", probs, v_BSNV)
    return out.reshape(b, q_len, h, v_BSNV.shape[-1])


def dot_product_attention(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, scale: float | None = None):
    """softmax(q k^T * scale) v, causal and within segments, with GQA grouping; scale defaults to 1/sqrt(K).

    Materialises the full [B, H, L, L] float32 scores (and keeps them for the backward pass)."""
    scale = q_BLHK.shape[-1] ** -0.5 if scale is None else scale
    return _attend(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, segment_ids_BL, 0, scale)


def chunked_attention(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, *, chunk_size: int, scale: float | None = None):
    """dot_product_attention computed chunk_size query rows at a time: peak memory is one chunk's
    [B, H, chunk_size, L] scores, forward and backward. With chunk_size >= L it is dot_product_attention.

    A length that is not a multiple of chunk_size is padded with segment-0 (fully masked) query rows.
    """
    scale = q_BLHK.shape[-1] ** -0.5 if scale is None else scale
    return _chunked(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, segment_ids_BL, 0, chunk_size, scale)


def _chunked(q_BQHK, k_BSNK, v_BSNV, q_segment_ids_BQ, kv_segment_ids_BS, q_start, chunk_size: int, scale):
    """_attend for queries q_start.. against all S keys, chunk_size query rows at a time (see chunked_attention)."""
    b, l, h, _ = q_BQHK.shape
    c = min(chunk_size, l)
    if c == l:
        return _attend(q_BQHK, k_BSNK, v_BSNV, q_segment_ids_BQ, kv_segment_ids_BS, q_start, scale)
    chunks = -(-l // c)
    pad = chunks * c - l
    q_BPHK = jnp.pad(q_BQHK, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_segment_ids_BP = jnp.pad(q_segment_ids_BQ, ((0, 0), (0, pad)))  # padded rows: segment 0, dropped below
    # M chunks of C query rows, chunk axis first for lax.map.
    q_MBCHK = q_BPHK.reshape(b, chunks, c, h, -1).swapaxes(0, 1)
    q_segment_ids_MBC = q_segment_ids_BP.reshape(b, chunks, c).swapaxes(0, 1)

    # nothing_saveable: the backward recomputes each chunk's scores rather than keeping all of them,
    # so only q, k, v are residuals.
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one_chunk(args):
        q_BCHK, q_segment_ids_BC, start = args
        return _attend(q_BCHK, k_BSNK, v_BSNV, q_segment_ids_BC, kv_segment_ids_BS, start, scale)

    out_MBCHV = jax.lax.map(one_chunk, (q_MBCHK, q_segment_ids_MBC, q_start + jnp.arange(chunks) * c))
    return out_MBCHV.swapaxes(0, 1).reshape(b, chunks * c, h, -1)[:, :l]

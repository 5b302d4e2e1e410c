"""`attention: cudnn_flash` under context parallelism: cuDNN's fused kernel for one device's block of queries
against the whole sequence's keys and values (gathered), inside attention.context_parallel's shard_map.

Shapes: B batch, Q the block's query rows (at positions start .. start + Q - 1 of the sequence), S the whole
sequence, H query heads, N key/value heads (GQA: each serves H/N query heads; MLA: N = H), K query/key head dim,
V value head dim. Everything here runs on one device.

The kernel's causal mask is aligned at each sequence's first query and first key (cuDNN's top-left diagonal,
the only one XLA's binding offers), so a block whose first document began on an earlier device cannot be given
to it in one call. The block is therefore cut by its rows' documents:
  - the block's first run of equal segment id ("the first run", r_B rows): its own keys in the block, causal
    (a non-packed call, q and kv lengths r_B: PADDING_CAUSAL), and, where its document began before the block
    (start - d_B keys from the document's first token d_B), those earlier keys, all visible (a non-packed
    PADDING call against the keys rolled so that the document's first key comes first). The two are merged by
    their softmax statistics (the log-sum-exp of each row's scaled logits, cuDNN's `Stats`, which XLA's binding
    returns with return_residual, [B, H, Q] float32): out = sum_i exp(lse_i - lse) out_i, lse = logaddexp.
  - every later run, a document that begins inside the block: attention_cudnn's packed call on the block's
    queries and keys, one slot per run (as without context parallelism: q, k and v zero-padded to one head dim,
    which XLA's packed offsets need), the first run left out. The non-packed calls take V != K as they are.
The merge has its own VJP: each of the two calls' backward kernel is run with the merged output and merged
statistics as its residuals (the flash backward then computes exactly the merged softmax's gradient restricted
to that call's keys: dS = P * (dO V^T - rowsum(dO * O)) with P = exp(S - lse)), the way ring attention merges
flash blocks (Transformer Engine's context-parallel cuDNN attention does the same); JAX's own VJP of a call
with return_residual ignores the statistics' cotangent and could not be used.

What is assumed of cuDNN and XLA's binding, read from their sources and TE's use of the same kernel, checked on a
GPU by `scripts/gpu_check.sh` (tests/test_attention_cudnn_cp.py's GPU case), and on CPU only through reference
kernels that implement this reading: Stats is the natural log-sum-exp of the scaled logits, laid out
[B, H, Q]; a non-packed PADDING call masks query rows at or past q_seqlen and keys at or past kv_seqlen, its
outputs there are not used here (the merge selects rows); the backward kernel takes (stats, output) as given.

A block whose later runs number more than attention_cudnn.max_segments(Q) takes `fallback` (the exact chunked
path) through lax.cond, as without context parallelism.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fused

from MaxText.layers import attention_cudnn


def attend(q_BQHK, start, k_BSNK, v_BSNV, kv_segment_ids_BS, *, scale: float, fallback):
    """Causal attention within segments of the queries at start .. start + Q - 1 against the whole sequence's
    keys and values: cuDNN's kernel on CUDA (block_attention), fallback(q, start) elsewhere (the exact chunked
    path, which must compute the same function). Outputs [B, Q, H, V]."""
    cuda = functools.partial(block_attention, scale=scale, fallback=fallback)
    return attention_cudnn.cuda_or(cuda, lambda q, start, *_: fallback(q, start), q_BQHK, start, k_BSNK, v_BSNV,
                                   kv_segment_ids_BS)


def block_attention(q_BQHK, start, k_BSNK, v_BSNV, kv_segment_ids_BS, *, scale: float, fallback):
    """attend's CUDA branch: the block cut by its documents (module docstring), or fallback(q, start) where the
    block holds more documents than the packed call takes. A padding query's (segment 0) output is finite and
    unused."""
    attention_cudnn.check_gpu(q_BQHK.dtype)
    q_len = q_BQHK.shape[1]
    segment_ids_BQ = jax.lax.dynamic_slice_in_dim(kv_segment_ids_BS, start, q_len, axis=1)
    first_B = jnp.sum(jnp.cumprod(segment_ids_BQ == segment_ids_BQ[:, :1], axis=1), axis=1).astype(jnp.int32)
    doc_start_B = _document_start(kv_segment_ids_BS, start)
    slots = attention_cudnn.max_segments(q_len)
    seqlens_BM, offsets_BM1, runs_B = attention_cudnn.packed_segments(segment_ids_BQ, slots + 1)
    seqlens_BM, offsets_BM1 = seqlens_BM[:, 1:], offsets_BM1[:, 1:]  # the first run is merged apart

    def kernels(q_BQHK, k_BSNK, v_BSNV):
        k_BQNK, v_BQNV = (jax.lax.dynamic_slice_in_dim(x, start, q_len, axis=1) for x in (k_BSNK, v_BSNV))
        first = _first_run(q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, scale)
        in_first_BQ = _in_first_run(first_B, q_len)
        # The packed call leaves the first run's rows (in no slot) unwritten, forward and backward: their gradients
        # are cut here, before anything reads them.
        later_args = [_gradient_where(~in_first_BQ, x) for x in (q_BQHK, k_BQNK, v_BQNV)]
        later = jax.lax.cond(jnp.any(runs_B > 1), functools.partial(_later_runs, scale=scale),
                             lambda *_: jnp.zeros_like(first), *later_args, seqlens_BM, offsets_BM1)
        return jnp.where(in_first_BQ[..., None, None], first, later)

    if slots + 1 >= q_len:  # the bound cannot be exceeded
        return kernels(q_BQHK, k_BSNK, v_BSNV)
    return jax.lax.cond(jnp.all(runs_B <= slots + 1), kernels, lambda q, *_: fallback(q, start),
                        q_BQHK, k_BSNK, v_BSNV)


def _in_first_run(first_B, q_len: int):
    """[B, Q] whether each query row of the block is in its row's first run (the first first_B rows)."""
    return jnp.arange(q_len)[None, :] < first_B[:, None]


@jax.custom_vjp
def _gradient_where(keep_BQ, x_BQ):
    """x itself; its cotangent where keep_BQ holds, zero elsewhere (selected, so a NaN there goes no further)."""
    return x_BQ


def _gradient_where_fwd(keep_BQ, x_BQ):
    return x_BQ, keep_BQ


def _gradient_where_bwd(keep_BQ, dx_BQ):
    keep = keep_BQ.reshape(keep_BQ.shape + (1,) * (dx_BQ.ndim - keep_BQ.ndim))
    return None, jnp.where(keep, dx_BQ, 0).astype(dx_BQ.dtype)


_gradient_where.defvjp(_gradient_where_fwd, _gradient_where_bwd)


def _document_start(segment_ids_BS, start):
    """[B] the position where the document holding position start - 1 begins, or start where that position is in
    another document (or start is 0): the earlier keys the block's first run sees are d .. start - 1."""
    s = segment_ids_BS.shape[1]
    pos_S = jnp.arange(s)
    begins_BS = jnp.concatenate([jnp.ones_like(segment_ids_BS[:, :1], bool),
                                 segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
    last_begin_B = jnp.max(jnp.where(begins_BS & (pos_S < start), pos_S, 0), axis=1)
    prev_B = jax.lax.dynamic_index_in_dim(segment_ids_BS, jnp.maximum(start - 1, 0), axis=1, keepdims=False)
    here_B = jax.lax.dynamic_index_in_dim(segment_ids_BS, start, axis=1, keepdims=False)
    continues_B = (start > 0) & (prev_B == here_B)
    return jnp.where(continues_B, last_begin_B, start).astype(jnp.int32)


def _later_runs(q_BQHK, k_BQNK, v_BQNV, seqlens_BM, offsets_BM1, *, scale):
    """attention_cudnn's packed causal call on the block: each later run against its own keys, q, k and v padded to
    one head dim as XLA's packed offsets need (attention_cudnn)."""
    vd = v_BQNV.shape[-1]
    d = max(q_BQHK.shape[-1], vd)
    q, k, v = (attention_cudnn.pad_to(x, d) for x in (q_BQHK, k_BQNK, v_BQNV))
    return kernel_forward(q, k, v, seqlens_BM, seqlens_BM, offsets_BM1, offsets_BM1, fused.MaskType.PADDING_CAUSAL,
                          scale)[..., :vd]


def kernel_forward(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type, scale):
    """cuDNN's forward through XLA's binding (JAX's VJP): the packed call the trainer makes without CP."""
    return fused.dot_product_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, q_offsets=q_offsets,
                                       kv_offsets=kv_offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH")


def kernel_with_stats(q_BQHK, k_BSNK, v_BSNV, q_len_B, kv_len_B, causal: bool, scale):
    """A non-packed call's (output [B, Q, H, V], Stats [B, H, Q] float32)."""
    mask = fused.MaskType.PADDING_CAUSAL if causal else fused.MaskType.PADDING
    return fused.dot_product_attention(q_BQHK, k_BSNK, v_BSNV, q_seqlen=q_len_B, kv_seqlen=kv_len_B, scale=scale,
                                       mask_type=mask, qkv_layout="BTNH", return_residual=True)


def kernel_backward(q_BQHK, k_BSNK, v_BSNV, q_len_B, kv_len_B, causal: bool, scale, stats_BHQ, out_BQHV, dout_BQHV):
    """A non-packed call's backward kernel given the statistics and output to use as its residuals: (dq, dk, dv)."""
    mask = fused.MaskType.PADDING_CAUSAL if causal else fused.MaskType.PADDING
    none = jnp.zeros(0, q_BQHK.dtype)
    residuals = (q_BQHK, k_BSNK, v_BSNV, none, q_len_B, kv_len_B, none, none, none, none, (), stats_BHQ, out_BQHV)
    grads = fused._dot_product_attention_bwd_rule(
        scale, 42, 0.0, (False, False), mask, fused.AttentionLayout.BTNH.value, None, None,
        fused.check_cudnn_version(), False, residuals, dout_BQHV)
    return grads[:3]


def _roll(x_BS, shift_B, sign: int):
    """Each row of x rolled along its second axis by sign * shift (row's own shift)."""
    return jax.vmap(lambda x, s: jnp.roll(x, sign * s, axis=0))(x_BS, shift_B)


def _on_rolled(fn, k_BSNK, v_BSNV, doc_start_B):
    """fn(k, v, rolled) on the whole keys and values rolled so that each row's first document's start comes first
    (rolled True: fn rolls back what it returns by key), or, where every row's starts at 0 (one document a row, the
    common case at long context), on them as they are (rolled False): the copies skipped."""
    return jax.lax.cond(jnp.any(doc_start_B > 0),
                        lambda k, v: fn(_roll(k, doc_start_B, -1), _roll(v, doc_start_B, -1), True),
                        lambda k, v: fn(k, v, False), k_BSNK, v_BSNV)


def _first_run_parts(q_BQHK, k_BQNK, v_BQNV, first_B, doc_start_B, start):
    """The two calls' operands but the earlier keys and values (q, q_len, kv_len, causal), the run's own keys first,
    and where the earlier ones exist."""
    earlier_B = start - doc_start_B
    own = (q_BQHK, k_BQNK, v_BQNV, first_B, first_B, True)
    return own, (first_B, jnp.maximum(earlier_B, 1), False), earlier_B > 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _first_run(q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, scale):
    """The block's first run (rows < first_B): its own keys, causal, merged with its document's earlier keys."""
    return _first_run_fwd(q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, scale)[0]


def _first_run_fwd(q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, scale):
    own, before, has_before_B = _first_run_parts(q_BQHK, k_BQNK, v_BQNV, first_B, doc_start_B, start)
    out_own, stats_own = kernel_with_stats(*own, scale)
    out_before, stats_before = _on_rolled(lambda k, v, _: kernel_with_stats(q_BQHK, k, v, *before, scale),
                                          k_BSNK, v_BSNV, doc_start_B)
    rows_BQ = _in_first_run(first_B, q_BQHK.shape[1])
    # Rows past the run, and the earlier keys where there are none, take no part (whatever the kernel left there).
    lse_own_BQH = jnp.where(rows_BQ[..., None], stats_own.transpose(0, 2, 1), 0.0)
    lse_before_BQH = jnp.where((rows_BQ & has_before_B[:, None])[..., None], stats_before.transpose(0, 2, 1), -jnp.inf)
    lse_BQH = jnp.logaddexp(lse_own_BQH, lse_before_BQH)
    out = jnp.zeros(out_own.shape, jnp.float32)
    for part, lse_part in ((out_own, lse_own_BQH), (out_before, lse_before_BQH)):
        weight = jnp.exp(lse_part - lse_BQH)[..., None]
        out = out + jnp.where(weight > 0, weight * part.astype(jnp.float32), 0.0)
    out = out.astype(out_own.dtype)
    stats_BHQ = lse_BQH.transpose(0, 2, 1)
    return out, (q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, out, stats_BHQ)


def _first_run_bwd(scale, residuals, dout_BQHV):
    q_BQHK, k_BQNK, v_BQNV, k_BSNK, v_BSNV, first_B, doc_start_B, start, out, stats_BHQ = residuals
    own, before, has_before_B = _first_run_parts(q_BQHK, k_BQNK, v_BQNV, first_B, doc_start_B, start)
    rows_BQ = _in_first_run(first_B, q_BQHK.shape[1])
    dout = jnp.where(rows_BQ[..., None, None], dout_BQHV, 0).astype(dout_BQHV.dtype)
    dq_own, dk_own, dv_own = kernel_backward(*own, scale, stats_BHQ, out, dout)

    def backward(k, v, rolled):  # the earlier keys' gradients, in their places
        dq, dk, dv = kernel_backward(q_BQHK, k, v, *before, scale, stats_BHQ, out, dout)
        return (dq, *(_roll(d, doc_start_B, 1) for d in (dk, dv))) if rolled else (dq, dk, dv)
    dq_before, dk, dv = _on_rolled(backward, k_BSNK, v_BSNV, doc_start_B)
    keep_B = has_before_B[:, None, None, None]
    dq = dq_own + jnp.where(keep_B, dq_before, 0).astype(dq_own.dtype)
    dk, dv = (jnp.where(keep_B, d, 0).astype(d.dtype) for d in (dk, dv))
    return dq, dk_own, dv_own, dk, dv, None, None, None


_first_run.defvjp(_first_run_fwd, _first_run_bwd)

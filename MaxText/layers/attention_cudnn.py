"""`attention: cudnn_flash`: cuDNN's fused flash-attention kernel, called through JAX's own cuDNN binding
(jax._src.cudnn.fused_attention_stablehlo, JAX 0.12: its public jax.nn.dot_product_attention refuses V != K).

Shapes: B batch, L length, H query heads, N key/value heads (GQA: each serves H/N query heads; MLA: N = H),
K query/key head dim, V value head dim, M = max_segments(L) packed sequences per row.

What the binding does, read from its source and XLA's (stream_executor/cuda/cuda_dnn.cc):
  - layout BTNH; N < H key/value heads natively (GQA); a causal mask; the softmax scale given.
  - packed documents: per row, seqlens [B, M] and offsets [B, M + 1] (first token of each sequence, -1 in
    unused slots and in the last column). Each slot is one cuDNN sequence: causal from its own first token,
    blind to every other slot. The kernel computes no output or gradient for a token in no slot (JAX's own
    packed test masks them out: the buffer keeps whatever it held), so every token here is in a slot: a run
    of padding (segment 0) is a sequence of its own, and a padding token's output is causal attention over
    its own run: finite, and masked out of the loss by the trainer.
  - custom_vjp: the forward saves q, k, v, the output and float32 softmax statistics [B * M, H, L]; the
    backward is one kernel. Under a remat policy they are recomputed together: no checkpoint name reaches the
    statistics, which are residuals inside JAX's custom_vjp, so the attention output gets no name of its own.
  - custom partitioning: batch and heads may be split, length and head dim may not; q, k and v must carry
    one sharding, and each shard reads its own rows of seqlens/offsets, which must therefore be split like
    q's batch (all constrained below: an unsplit offsets array would hand shard 0's lengths to every shard).
  - XLA gives V and O the packed offsets of K and Q, which JAX scales by the q/k head dim, so with V != K (MLA)
    a packed row would read V and write O at the wrong strides. The kernel therefore sees V (or q and k)
    zero-padded to max(K, V) and its output is sliced back: exact (zero features add nothing to a logit or an
    output), for ~17% more attention FLOPs (forward and backward) at DeepSeek-V3's 192/128.
  - trace-time checks (cuDNN version, compute capability) query the GPU: the packed layout needs Hopper or
    newer; JAX's own packed-layout test needs cuDNN >= 9.6.

The bound M: a row holds at most L documents, but M = L would make the statistics [B * L, H, L] (48 GiB a
layer for DeepSeek-V3 at 6 x 4096), so M = min(L, MAX_SEGMENTS): the statistics are then no larger than the
bf16 output at V = 128. When L <= MAX_SEGMENTS the bound cannot be exceeded; beyond it, a batch in which
some row holds more than M runs takes `fallback` (the exact XLA chunked attention) for that layer instead,
through lax.cond: slower, never wrong. XLA reserves the fallback's working memory ([B, H,
attention_chunk_size, L] float32 scores) whether or not it runs.

Where there is no CUDA GPU, attention runs the fallback; lax.platform_dependent keeps the kernel for CUDA
lowerings and the fallback for others, so a CPU process inside cuda_trace_profile() (the preflight, tests)
lowers the kernel for CUDA and compiles the same step for CPU with the XLA path.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
from jax._src import xla_bridge
from jax._src.cudnn import fused_attention_stablehlo as fused
from jax.extend.core import subjaxprs

from MaxText.parallel.sharding import constrain

MAX_SEGMENTS = 64
MIN_CUDNN = 90600
MIN_SM = 90
# The NGC JAX image's cuDNN (as te_trace's stand-in reports it): what cuda_trace_profile answers by default.
PROFILE_CUDNN = 91500
_HEADS = ("activation_batch", "activation_length", "activation_heads", None)
_ROWS = ("activation_batch", None)

_profile: dict | None = None  # set inside cuda_trace_profile(): {"sm": 90, "cudnn": 91500}
_warned = False


def max_segments(length: int) -> int:
    """M, the packed sequences per row the kernel is given: min(L, MAX_SEGMENTS), at least 2 (packed mode)."""
    return max(2, min(length, MAX_SEGMENTS))


def packed_segments(segment_ids_BL, max_segs: int):
    """The kernel's packed form of each row's runs of equal segment id (documents, and runs of padding).

    Returns (seqlens_BM, offsets_BM1, runs_B) in int32: run r of a row starts at offsets[:, r] and holds
    seqlens[:, r] tokens; unused slots hold -1 in both, and offsets' last column is always -1. runs_B counts
    each row's runs; a row with more than max_segs has its later runs dropped here (the caller checks).
    """
    b, l = segment_ids_BL.shape
    start_BL = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]], axis=1)
    run_BL = jnp.cumsum(start_BL, axis=1, dtype=jnp.int32) - 1
    runs_B = run_BL[:, -1] + 1
    row_BL = jnp.broadcast_to(jnp.arange(b)[:, None], (b, l))
    # Runs past the bound (and, for offsets, every token but a run's first) scatter out of range: dropped.
    lengths_BM = jnp.zeros((b, max_segs), jnp.int32).at[row_BL, run_BL].add(1, mode="drop")
    first_BL = jnp.where(start_BL & (run_BL < max_segs), run_BL, max_segs + 1)
    offsets_BM1 = jnp.full((b, max_segs + 1), -1, jnp.int32).at[row_BL, first_BL].set(
        jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)), mode="drop")
    used_BM = jnp.arange(max_segs)[None, :] < runs_B[:, None]
    return jnp.where(used_BM, lengths_BM, -1), offsets_BM1, runs_B


def has_cuda() -> bool:
    """Whether this process's default backend is a CUDA GPU (JAX's own test in its capability check)."""
    return "cuda" in xla_bridge.get_backend().platform_version


def attention(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, *, scale: float, fallback, rules=None):
    """Causal attention within segments on cuDNN's kernel on CUDA, else fallback(q, k, v, segment_ids).

    fallback must compute the same function (attention.py passes chunked_attention); it also serves, on
    CUDA, the batches whose rows hold more than max_segments(L) runs."""
    cuda = functools.partial(on_cuda, scale=scale, fallback=fallback, rules=rules)
    return cuda_or(cuda, fallback, q_BLHK, k_BLNK, v_BLNV, segment_ids_BL)


def cuda_or(cuda, fallback, *args):
    """cuda(*args) where this process has a CUDA GPU, or inside cuda_trace_profile(): through lax.platform_dependent,
    so that a CUDA lowering carries the kernel and any other lowering fallback(*args); elsewhere fallback(*args),
    logged once. (attention here; attention_cudnn_cp.attend under context parallelism.)"""
    global _warned
    if _profile is None and not has_cuda():
        if not _warned:
            logging.warning("attention=cudnn_flash: no CUDA GPU in this process; attention runs XLA's chunked path")
            _warned = True
        return fallback(*args)
    return jax.lax.platform_dependent(*args, cuda=cuda, default=fallback)


def on_cuda(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL, *, scale, fallback, rules):
    """The CUDA branch: the kernel, or fallback for a batch with a row of more than M runs."""
    check_gpu(q_BLHK.dtype)
    length, vd = q_BLHK.shape[1], v_BLNV.shape[-1]
    m = max_segments(length)
    seqlens_BM, offsets_BM1, runs_B = packed_segments(segment_ids_BL, m)
    # One head dim for all three (see the module docstring), then the sharding the partitioner requires.
    d = max(q_BLHK.shape[-1], vd)
    q, k, v = (constrain(pad_to(x, d), _HEADS, rules) for x in (q_BLHK, k_BLNK, v_BLNV))
    seqlens_BM, offsets_BM1 = constrain(seqlens_BM, _ROWS, rules), constrain(offsets_BM1, _ROWS, rules)

    def kernel(q, k, v, seqlens_BM, offsets_BM1):
        out_BLHD = fused.dot_product_attention(
            q, k, v, q_seqlen=seqlens_BM, kv_seqlen=seqlens_BM, q_offsets=offsets_BM1, kv_offsets=offsets_BM1,
            scale=scale, mask_type=fused.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
        return out_BLHD[..., :vd]

    if m >= length:  # the bound cannot be exceeded
        return kernel(q, k, v, seqlens_BM, offsets_BM1)
    return jax.lax.cond(jnp.all(runs_B <= m), kernel,
                        lambda *_: fallback(q_BLHK, k_BLNK, v_BLNV, segment_ids_BL),
                        q, k, v, seqlens_BM, offsets_BM1)


def pad_to(x, d: int):
    """x with its last (head) dim zero-padded to d."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1]))) if x.shape[-1] < d else x


def check_gpu(dtype) -> None:
    """One line naming `attention` (or `dtype`) where this GPU or these activations cannot run the kernel."""
    version = fused.check_cudnn_version()
    if version < MIN_CUDNN or not fused.check_compute_capability(f"{MIN_SM // 10}.{MIN_SM % 10}"):
        sm = _profile["sm"] / 10 if _profile else jax.devices()[0].compute_capability
        raise ValueError(f"attention=cudnn_flash needs cuDNN >= 9.6 on a GPU of compute capability >= 9.0 "
                         f"(Hopper, Blackwell) for packed documents; here cuDNN {version}, compute capability "
                         f"{sm}: use attention=chunked")
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention=cudnn_flash: cuDNN's kernel takes bfloat16 or float16 activations, these "
                         f"are {jnp.dtype(dtype).name}: set dtype=bfloat16 or use attention=chunked")


@contextlib.contextmanager
def cuda_trace_profile(sm: int = MIN_SM, cudnn_version: int = PROFILE_CUDNN):
    """Trace and lower attention=cudnn_flash for CUDA in a process without a GPU (tests, MaxText.lowering):
    JAX's trace-time cuDNN queries answer as a GPU of compute capability sm / 10 with this cuDNN would, and
    attention() stages the kernel out even though this backend is not CUDA. Never used by a training run."""
    global _profile

    def at_least(capability: str) -> bool:
        major, minor = (int(x) for x in capability.split("."))
        return sm >= 10 * major + minor

    def equal(capability: str) -> bool:
        major, minor = (int(x) for x in capability.split("."))
        return sm == 10 * major + minor

    saved = (fused.check_cudnn_version, fused.check_compute_capability, fused.is_cuda_compute_capability_equal,
             _profile)
    fused.check_cudnn_version = lambda: cudnn_version
    fused.check_compute_capability, fused.is_cuda_compute_capability_equal = at_least, equal
    _profile = {"sm": sm, "cudnn": cudnn_version}
    try:
        yield
    finally:
        (fused.check_cudnn_version, fused.check_compute_capability, fused.is_cuda_compute_capability_equal,
         _profile) = saved


def kernel_calls(closed_jaxpr) -> int:
    """The cuDNN fused-attention operations (forward and backward) in a jaxpr and the jaxprs it holds, each
    distinct jaxpr counted once, as lowering emits it once: what the CUDA module partitions."""
    names = {fused._dot_product_attention_fwd_p_wrapper.name, fused._dot_product_attention_bwd_p_wrapper.name}
    seen, todo, count = set(), [closed_jaxpr.jaxpr], 0
    while todo:
        jaxpr = todo.pop()
        if id(jaxpr) in seen:
            continue
        seen.add(id(jaxpr))
        count += sum(eqn.primitive.name in names for eqn in jaxpr.eqns)
        todo.extend(subjaxprs(jaxpr))
    return count

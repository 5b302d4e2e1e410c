"""`attention: cudnn_flash` under context parallelism (MaxText/layers/attention_cudnn_cp.py).

CPU: a block of queries cut by its documents (its first run merged from two non-packed calls by their softmax
statistics, under its own VJP; its later runs in one packed call), run with reference kernels that follow the
reading of cuDNN the module states in cuDNN's place, gives dot_product's rows and q/k/v gradients: documents
that began on an earlier device, a block that starts a document, one-token documents, padding, the block at the
sequence's start, more documents than the packed call takes (the fallback); the whole context-parallel attention
with load balance on 4 and 2 devices alike; it lowers for CUDA on 8 devices with cuDNN's forward and backward
inside the per-device attention. GPU (marked `gpu`): cuDNN's kernel against dot_product in bf16.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fused

from MaxText.layers import attention_cudnn, attention_cudnn_cp
from MaxText.layers.attention import _attend, attention, dot_product_attention
from MaxText.parallel import sharding
from tests.test_attention_cudnn import reference_kernel
from tests.test_batch_split import MODEL
from tests.tiny import tiny_config


def _masks(q_len_B, kv_len_B, causal, t, s):
    """[B, T, S] keys each query sees and [B, T] rows inside q_seqlen, for a non-packed call."""
    rows_BT = jnp.arange(t)[None, :] < q_len_B[:, None]
    allowed = rows_BT[:, :, None] & (jnp.arange(s)[None, None, :] < kv_len_B[:, None, None])
    if causal:
        allowed = allowed & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None]
    return allowed, rows_BT


def _logits(q, k, scale):
    """[B, H, T, S] float32 scaled logits, each of the N key heads serving H/N query heads."""
    b, t, h, d = q.shape
    n = k.shape[2]
    logits = jnp.einsum("btngd,bsnd->bngts", q.astype(jnp.float32).reshape(b, t, n, h // n, d),
                        k.astype(jnp.float32)) * scale
    return logits.reshape(b, h, t, -1)


def reference_with_stats(q, k, v, q_len_B, kv_len_B, causal, scale):
    """A non-packed cuDNN call as the module reads it: (output, Stats [B, H, T] natural log-sum-exp); rows past
    q_seqlen hold NaN in both, so that a use of them shows."""
    allowed, rows_BT = _masks(q_len_B, kv_len_B, causal, q.shape[1], k.shape[1])
    logits = jnp.where(allowed[:, None], _logits(q, k, scale), -jnp.inf)
    lse_BHT = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.where(allowed[:, None], jnp.exp(logits - lse_BHT[..., None]), 0.0)
    b, t, h, _ = q.shape
    n = k.shape[2]
    out = jnp.einsum("bngts,bsnv->btngv", probs.reshape(b, n, h // n, t, -1), v.astype(jnp.float32))
    out = jnp.where(rows_BT[..., None, None], out.reshape(b, t, h, -1), jnp.nan).astype(q.dtype)
    return out, jnp.where(rows_BT[:, None], lse_BHT, jnp.nan)


def reference_backward(q, k, v, q_len_B, kv_len_B, causal, scale, stats_BHT, out, dout):
    """The flash backward given (stats, output) as residuals: P = exp(S - stats), dS = P (dO V^T - rowsum(dO O))."""
    allowed, _ = _masks(q_len_B, kv_len_B, causal, q.shape[1], k.shape[1])
    b, t, h, _ = q.shape
    n = k.shape[2]
    probs = jnp.where(allowed[:, None], jnp.exp(_logits(q, k, scale) - stats_BHT[..., None]), 0.0)  # [B, H, T, S]
    do = dout.astype(jnp.float32)
    v32 = jnp.repeat(v.astype(jnp.float32), h // n, axis=2)
    k32 = jnp.repeat(k.astype(jnp.float32), h // n, axis=2)
    dp = jnp.einsum("bthv,bshv->bhts", do, v32)
    delta = jnp.einsum("bthv,bthv->bht", do, jnp.where(allowed.any(-1)[..., None, None], out, 0).astype(jnp.float32))
    ds = jnp.where(allowed[:, None], probs * (dp - delta[..., None]), 0.0)
    dq = jnp.einsum("bhts,bshd->bthd", ds, k32) * scale
    dk = jnp.einsum("bhts,bthd->bshd", ds, q.astype(jnp.float32)) * scale
    dv = jnp.einsum("bhts,bthv->bshv", probs, do)
    group = lambda x: x.reshape(b, x.shape[1], n, h // n, -1).sum(3)  # noqa: E731
    return dq.astype(q.dtype), group(dk).astype(k.dtype), group(dv).astype(v.dtype)


@pytest.fixture
def reference_kernels(monkeypatch):
    """cuDNN's three entry points replaced by the references; counts the calls."""
    calls = {"packed": 0, "stats": 0, "backward": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    def packed(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type, scale):
        return reference_kernel(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, q_offsets=q_offsets,
                                kv_offsets=kv_offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH")

    monkeypatch.setattr(attention_cudnn_cp, "kernel_forward", count("packed", packed))
    monkeypatch.setattr(attention_cudnn_cp, "kernel_with_stats", count("stats", reference_with_stats))
    monkeypatch.setattr(attention_cudnn_cp, "kernel_backward", count("backward", reference_backward))
    return calls


S = 32
BLOCKS = {  # name: (segments of the whole row [2, S], block start, block length)
    "a document from an earlier device": ([[1] * 20 + [2] * 12, [1] * 5 + [2] * 27], 16, 8),
    "the block starts a document": ([[1] * 16 + [2] * 16, [1] * 3 + [2] * 13 + [3] * 16], 16, 8),
    "the sequence's first block": ([[1] * 3 + [2] * 29, [1] * 32], 0, 8),
    "one-token documents": ([list(range(1, S + 1)), [1] * 12 + list(range(2, 22))], 8, 8),
    "padding": ([[1] * 10 + [0] * 22, [1] * 6 + [0] * 4 + [2] * 7 + [0] * 15], 8, 8),
    "the last block, one document": ([[1] * 32, [1] * 2 + [2] * 30], 24, 8),
    "one document a row (no copies rolled)": ([[1] * 32, [1] * 32], 16, 8),
}


def _block_case(segments, start, q_len, heads=(4, 2), dims=(16, 8), length=S):
    h, n = heads
    kd, vd = dims
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, length, h, kd), jnp.bfloat16)
    k = jax.random.normal(kk, (2, length, n, kd), jnp.bfloat16)
    v = jax.random.normal(kv, (2, length, n, vd), jnp.bfloat16)
    segments = jnp.asarray(segments, jnp.int32)
    real = np.asarray(segments[:, start:start + q_len] != 0)[..., None, None]
    w = jax.random.normal(jax.random.key(9), (2, q_len, h, vd)) * real
    return q, k, v, segments, real, w


def _block_results(fn, q, k, v, w):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _assert_block_matches(case, got, want, real):
    for name, a, b in zip(("output", "d/dq", "d/dk", "d/dv"), want, got):
        if name == "output":
            a, b = np.where(real, a, 0), np.where(real, b, 0)
        assert np.isfinite(b).all(), f"{case}: {name} has non-finite values"
        np.testing.assert_allclose(b, a, rtol=0, atol=0.02 * np.abs(a).max() + 1e-6, err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", list(BLOCKS))
def test_a_block_cut_by_its_documents_is_dot_product(case, reference_kernels):
    """block_attention for the rows start .. start + Q - 1 with the reference kernels in cuDNN's place: outputs on
    real rows and q/k/v gradients equal dot_product's rows of the whole sequence (bf16 tolerances); a row of the
    first run taken from past q_seqlen, or a merge weight of a missing part, would be NaN."""
    segments, start, q_len = BLOCKS[case]
    q, k, v, segments, real, w = _block_case(segments, start, q_len)
    scale = 0.3
    no_fallback = lambda *_: pytest.fail("the fallback was taken")  # noqa: E731
    with attention_cudnn.cuda_trace_profile():
        got = _block_results(lambda q, k, v: attention_cudnn_cp.block_attention(
            q[:, start:start + q_len], jnp.int32(start), k, v, segments, scale=scale, fallback=no_fallback), q, k, v, w)
    # traced: the run's own keys once, the earlier ones in both branches of the roll's lax.cond
    assert reference_kernels["stats"] == 3 and reference_kernels["backward"] == 3, reference_kernels
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _block_results(lambda q, k, v: dot_product_attention(q, k, v, segments, scale=scale)[:, start:start + q_len],
                          *up, w)
    _assert_block_matches(case, got, want, real)


def test_a_block_with_more_documents_than_slots_takes_the_fallback(reference_kernels):
    """80 query rows (64 slots for the later runs): a row of 70 one-token documents sends the block to fallback,
    which gives dot_product's numbers; a block within the bound never calls it."""
    length, start, q_len = 160, 80, 80
    rows = [[1] * 100 + [2] * 60, [1] * 80 + list(range(2, 72)) + [72] * 10]
    q, k, v, segments, real, w = _block_case(rows, start, q_len, length=length)
    taken = []

    def fallback(q_BQHK, start_):
        taken.append(1)
        return _attend(q_BQHK, k, v, jax.lax.dynamic_slice_in_dim(segments, start_, q_len, axis=1), segments, start_,
                       0.3).astype(q_BQHK.dtype)

    def block(q, k, v):
        return attention_cudnn_cp.block_attention(q[:, start:start + q_len], jnp.int32(start), k, v, segments,
                                                  scale=0.3, fallback=fallback)
    with attention_cudnn.cuda_trace_profile():
        out = jax.jit(block)(q, k, v)
    assert taken, "the fallback was never traced"
    want = dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segments, scale=0.3)
    np.testing.assert_allclose(np.where(real, np.asarray(out, np.float32), 0),
                               np.where(real, want[:, start:start + q_len], 0), atol=0.03)


@pytest.mark.parametrize("devices,balance", [(4, True), (2, True), (4, False)])
def test_context_parallel_cudnn_gives_one_devices_attention(devices, balance, reference_kernels, monkeypatch):
    """attention=cudnn_flash split over `devices` context devices, each device's blocks on block_attention with the
    reference kernels (platform_dependent would pick the XLA branch on CPU): output and q/k/v gradients equal one
    device's dot_product (GQA; MLA's 16/8 head dims; three documents a row, one crossing every device boundary, and
    a padded tail)."""
    monkeypatch.setattr(attention_cudnn_cp, "attend", lambda q, start, k, v, seg, *, scale, fallback:
                        attention_cudnn_cp.block_attention(q, start, k, v, seg, scale=scale, fallback=fallback))
    b, length, h, n, kd, vd = 2, 32, 4, 2, 16, 8
    rng = np.random.default_rng(0)
    q, kk = (jnp.asarray(rng.normal(size=(b, length, heads, kd)), jnp.bfloat16) for heads in (h, n))
    v = jnp.asarray(rng.normal(size=(b, length, n, vd)), jnp.bfloat16)
    pos = np.arange(length)
    segments = np.repeat(np.where(pos < 11, 1, np.where(pos < 27, 2, 3))[None], b, 0)
    segments[-1, -5:] = 0
    segments = jnp.asarray(segments, jnp.int32)
    real = np.asarray(segments != 0)[:, :, None, None]
    w = jnp.asarray(rng.normal(size=(b, length, h, vd)), jnp.float32) * real
    cfg = tiny_config(*MODEL, "ici_fsdp_parallelism=1", f"ici_context_parallelism={devices}",
                      f"max_target_length={length}", f"per_device_batch_size={b / devices}")
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    split = functools.partial(attention, segment_ids_BL=segments, impl="cudnn_flash", chunk_size=4, scale=0.3,
                              rules=sharding.axis_rules(cfg), load_balance=balance)
    with jax.set_mesh(mesh), attention_cudnn.cuda_trace_profile():
        got = _block_results(split, q, kk, v, w)
    assert reference_kernels["stats"] >= 2, reference_kernels
    one = functools.partial(dot_product_attention, segment_ids_BL=segments, scale=0.3)
    want = _block_results(one, *(x.astype(jnp.float32) for x in (q, kk, v)), w)
    _assert_block_matches(f"{devices} devices, balance {balance}", got, want, real)


def test_lowers_for_cuda_inside_the_per_device_attention():
    """jit(value_and_grad) of attention=cudnn_flash on context 4 x fsdp 2, traced once: the CUDA lowering holds
    cuDNN's forward and backward (two blocks a device: 3 forward calls each, the two merged ones' backward kernels
    and the packed one's), no custom partitioning around them (they run per device, in shard_map); the CPU
    lowering of the same trace holds none."""
    cfg = tiny_config(*MODEL, "ici_fsdp_parallelism=2", "ici_context_parallelism=4", "max_target_length=32")
    mesh = sharding.create_mesh(cfg)
    rules = sharding.axis_rules(cfg)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "context"))
    args = [jax.ShapeDtypeStruct((8, 32, heads, d), jnp.bfloat16, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "context" if i == 0 else None)))
        for i, (heads, d) in enumerate(((4, 16), (2, 16), (2, 8)))]
    segments = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=spec)

    def loss(q, k, v, s):
        out = attention(q, k, v, s, impl="cudnn_flash", chunk_size=4, scale=0.3, rules=rules, load_balance=True)
        return jnp.sum(out.astype(jnp.float32))
    with jax.set_mesh(mesh), attention_cudnn.cuda_trace_profile():
        traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args, segments)
        cuda, cpu = traced.lower(lowering_platforms=("cuda",)).as_text(), traced.lower().as_text()
    fwd = re.findall(r"custom_call @__cudnn\$fmhaSoftmax\(", cuda)
    bwd = re.findall(r"custom_call @__cudnn\$fmhaSoftmaxBackward\(", cuda)
    assert len(fwd) >= 6 and len(bwd) >= 6, (len(fwd), len(bwd))
    assert "cudnn" not in cpu
    stats = re.findall(r"custom_call @__cudnn\$fmhaSoftmax\(.*?-> \((.*?)\)", cuda)
    assert any("tensor<4x4x4xf32>" in line for line in stats), stats[:3]  # non-packed Stats [B, H, Q]: 4 rows a device


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BLOCKS))
def test_cudnn_block_matches_dot_product_on_the_gpu(case):
    """On a CUDA GPU (Hopper or newer, cuDNN >= 9.6): block_attention on cuDNN's real kernels against dot_product's
    rows, forward and q/k/v gradients, bf16 tolerances: what the CPU tests assume of cuDNN's Stats and of its
    backward given merged residuals, measured."""
    if not attention_cudnn.has_cuda():
        pytest.skip("needs a CUDA GPU")
    segments, start, q_len = BLOCKS[case]
    q, k, v, segments, real, w = _block_case(segments, start, q_len, heads=(8, 2), dims=(192, 128))
    no_fallback = lambda *_: pytest.fail("the fallback was taken")  # noqa: E731
    got = _block_results(lambda q, k, v: attention_cudnn_cp.block_attention(
        q[:, start:start + q_len], jnp.int32(start), k, v, segments, scale=0.1, fallback=no_fallback), q, k, v, w)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _block_results(lambda q, k, v: dot_product_attention(q, k, v, segments, scale=0.1)[:, start:start + q_len],
                          *up, w)
    _assert_block_matches(case, got, want, real)


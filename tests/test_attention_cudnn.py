"""`attention: cudnn_flash` (MaxText/layers/attention_cudnn.py).

CPU: the packed tables it hands cuDNN rebuild attention_mask's mask exactly (adversarial layouts); on CPU it
computes dot_product's function, forward and gradients (and deepseek3-tiny's logits); its CUDA branch, run on
CPU with a reference kernel that follows the kernel's documented packed semantics standing in for cuDNN's,
computes it too (the GQA and MLA wiring, the head-dim padding, the fallback for rows with more documents than
the bound); it traces and lowers for CUDA on 8 devices with q, k, v and the row tables split like the trainer
splits them; its trace-time refusals are one line. GPU (marked `gpu`): cuDNN's kernel against dot_product in
bf16.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fused

from MaxText.parallel import sharding
from MaxText.layers import attention_cudnn
from MaxText.layers.attention import attention, attention_mask, dot_product_attention
from tests.tiny import tiny_config

L = 16
# Adversarial rows of length L (segment 0 is padding).
LAYOUTS = {
    "one document": [1] * L,
    "L one-token documents": list(range(1, L + 1)),
    "trailing padding": [1] * 5 + [2] * 3 + [0] * 8,
    "all padding": [0] * L,
    "padding between documents": [0, 0, 1, 1, 1, 0, 2, 2, 2, 2, 0, 3, 4, 4, 0, 0],
    "a one-token document last": [1] * (L - 1) + [2],
}


def kernel_mask(seqlens_BM, offsets_BM1, length):
    """What cuDNN's packed layout means ([B, L, L] and per-token slot counts [B, L]): slot s of a row holds
    tokens offsets[s] .. offsets[s] + seqlens[s] - 1 (unused slots are -1); query i sees key j when one slot
    holds both and j <= i (causal from the slot's first token)."""
    pos_L = jnp.arange(length)
    start_BM1 = offsets_BM1[:, :-1, None]
    in_slot_BML = (seqlens_BM[..., None] > 0) & (pos_L >= start_BM1) & (pos_L < start_BM1 + seqlens_BM[..., None])
    same_BLL = jnp.einsum("bmi,bmj->bij", in_slot_BML.astype(jnp.int32), in_slot_BML.astype(jnp.int32)) > 0
    return same_BLL & (pos_L[None, :] <= pos_L[:, None]), in_slot_BML.sum(1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_segments_rebuild_the_dense_mask(name):
    """Real queries see exactly attention_mask's keys; a padding query sees only its own padding run (never a
    real key, at least itself: a finite output); every token is in exactly one slot (the kernel writes it)."""
    segments = jnp.asarray([LAYOUTS[name]], jnp.int32)
    m = attention_cudnn.max_segments(L)
    seqlens, offsets, runs = attention_cudnn.packed_segments(segments, m)
    got, slots = (np.asarray(a) for a in kernel_mask(seqlens, offsets, L))
    want = np.asarray(attention_mask(segments, segments))
    real = np.asarray(segments != 0)
    np.testing.assert_array_equal(slots, np.ones_like(slots), err_msg=f"{name}: tokens not in exactly one slot")
    np.testing.assert_array_equal(got[real], want[real], err_msg=f"{name}: a real query's keys differ")
    row = np.asarray(segments[0])
    for i in np.flatnonzero(row == 0):  # a padding query: keys j <= i with only padding from j to i
        seen = np.flatnonzero(got[0, i])
        assert all((row[j:i + 1] == 0).all() for j in seen), f"{name}: padding query {i} sees {seen}"
    assert np.diagonal(got[0]).all(), f"{name}: a query does not see itself"
    # The sentinel format: -1 in unused slots and in offsets' last column, first tokens increasing.
    n = int(runs[0])
    s, o = np.asarray(seqlens[0]), np.asarray(offsets[0])
    assert (s[n:] == -1).all() and (o[n:] == -1).all() and o[-1] == -1, (name, s, o)
    assert o[0] == 0 and (np.diff(o[:n]) > 0).all() and s[:n].sum() == L, (name, s, o)


def test_packed_segments_count_rows_beyond_the_bound():
    """More runs than slots: runs_B says so (the caller then takes the fallback); the slots keep the first runs."""
    segments = jnp.asarray([list(range(1, L + 1)), [1] * 8 + [2] * 8], jnp.int32)
    seqlens, offsets, runs = attention_cudnn.packed_segments(segments, 4)
    np.testing.assert_array_equal(runs, [L, 2])
    np.testing.assert_array_equal(seqlens, [[1, 1, 1, 1], [8, 8, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 1, 2, 3, -1], [0, 8, -1, -1, -1]])
    assert attention_cudnn.max_segments(4096) == attention_cudnn.MAX_SEGMENTS and attention_cudnn.max_segments(1) == 2


# name: (L, H query heads, N key/value heads, K, V, scale); head dims multiples of 8 as the kernel wants.
CASES = {"gqa": (L, 4, 2, 8, 8, None), "mla": (L, 4, 4, 16, 8, 0.37)}


def _segments(length):
    """Row 0: documents of 5 and 3 tokens, then padding; row 1: documents of 4, 6 and the rest."""
    pos = np.arange(length)
    return jnp.asarray(np.stack([np.where(pos < 5, 1, np.where(pos < 8, 2, 0)),
                                 np.where(pos < 4, 1, np.where(pos < 10, 2, 3))]), jnp.int32)


def _qkv(length, h, n, kd, vd, dtype=jnp.float32, batch=2):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (batch, length, h, kd), dtype), jax.random.normal(kk, (batch, length, n, kd), dtype),
            jax.random.normal(kv, (batch, length, n, vd), dtype))


def _output_and_grads(attend, q, k, v, segments):
    """attend's output and d/dq, d/dk, d/dv of a random linear function of its real (non-padding) rows."""
    real = (segments != 0)[..., None, None]
    w = jax.random.normal(jax.random.key(9), (*segments.shape, q.shape[2], v.shape[-1])) * real

    def loss(q, k, v):
        out = attend(q, k, v, segments)
        return jnp.sum(out.astype(jnp.float32) * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


@pytest.mark.parametrize("case", list(CASES))
def test_on_cpu_it_is_dot_product(case):
    """Without a CUDA GPU, attention=cudnn_flash is the XLA (chunked) path: dot_product's outputs and q/k/v
    gradients to float32 rounding."""
    length, h, n, kd, vd, scale = CASES[case]
    args = (*_qkv(length, h, n, kd, vd), _segments(length))
    want = _output_and_grads(lambda *a: dot_product_attention(*a, scale=scale), *args)
    got = _output_and_grads(lambda *a: attention(*a, impl="cudnn_flash", chunk_size=4, scale=scale), *args)
    for name, a, b in zip(("output", "d/dq", "d/dk", "d/dv"), want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"{case}: cudnn_flash {name} vs dot_product")


def test_deepseek_on_cpu_gives_dot_product_logits():
    """The whole of deepseek3-tiny (MLA with YaRN's softmax scale) with attention=cudnn_flash on CPU: the logits
    of attention=dot_product (the wiring through MLA; GQA's is test_on_cpu_it_is_dot_product's)."""
    from flax import nnx

    from MaxText.layers.models import Transformer
    from tests.test_attention import MODELS

    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 64)
    segments = jnp.asarray([[1] * 9 + [2] * 7 + [0] * 16, [1] * 5 + [2] * 6 + [3] * 21], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
    logits = {}
    for impl in ("dot_product", "cudnn_flash"):
        m = Transformer(MODELS["deepseek3-tiny"](f"attention={impl}", "attention_chunk_size=8"), rngs=nnx.Rngs(0))
        logits[impl] = np.asarray(nnx.jit(lambda m, t, p, s: m(t, p, s)[0])(m, tokens, positions, segments))
    np.testing.assert_allclose(logits["cudnn_flash"], logits["dot_product"], rtol=2e-5, atol=2e-5)


def reference_kernel(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
                     kv_offsets=None, *, scale, mask_type, qkv_layout, **unused):
    """cuDNN's packed causal attention as documented, in float32: BTNH, N key/value heads serving H/N query
    heads each, one head dim for q, k and v (what XLA's packed offsets assume), tokens in no slot NaN."""
    assert qkv_layout == "BTNH" and mask_type == fused.MaskType.PADDING_CAUSAL and not unused, (qkv_layout, unused)
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], "packed cuDNN needs one head dim for q, k, v"
    assert (q_seqlen is kv_seqlen) and (q_offsets is kv_offsets) and bias is None and mask is None
    b, length, h, _ = query.shape
    allowed_BLL, slots_BL = kernel_mask(q_seqlen, q_offsets, length)
    n = key.shape[2]
    q = query.astype(jnp.float32).reshape(b, length, n, h // n, -1)
    logits = jnp.einsum("bqngk,bsnk->bngqs", q, key.astype(jnp.float32)) * scale
    # A token in no slot sees no key: its row is computed on zeros and dropped (no NaN reaches a gradient: the
    # kernel writes nothing for it, forward or backward); its output is NaN below.
    some_BL1 = allowed_BLL.any(-1, keepdims=True)[:, None, None]
    logits = jnp.where(some_BL1, jnp.where(allowed_BLL[:, None, None], logits, -jnp.inf), 0.0)
    probs = jnp.where(some_BL1, jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("bngqs,bsnv->bqngv", probs, value.astype(jnp.float32)).reshape(b, length, h, -1)
    return jnp.where((slots_BL > 0)[..., None, None], out, jnp.nan).astype(query.dtype)


CUDA_CASES = {  # name: (L, H, N, K, V, scale, segments [B, L])
    "gqa": (*CASES["gqa"], _segments(L)),
    "mla": (*CASES["mla"], _segments(L)),
    # L > MAX_SEGMENTS: the kernel with 64 slots; and a row of 70 documents, beyond them: the fallback.
    "mla 80 tokens": (80, 4, 4, 16, 8, 0.37, jnp.asarray([[1] * 30 + [2] * 40 + [0] * 10, [1] * 80], jnp.int32)),
    "gqa over the bound": (80, 4, 2, 8, 8, None, jnp.asarray([[1] * 80, list(range(1, 71)) + [71] * 10], jnp.int32)),
}


@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_the_cuda_branch_with_a_reference_kernel_is_dot_product(case, monkeypatch):
    """The CUDA branch run on CPU with reference_kernel in cuDNN's place: outputs on real rows and q/k/v
    gradients equal dot_product's (bf16 inputs, so bf16 tolerances); a token the tables left out would be NaN."""
    length, h, n, kd, vd, scale, segments = CUDA_CASES[case]
    q, k, v = _qkv(length, h, n, kd, vd, jnp.bfloat16)
    scale = kd ** -0.5 if scale is None else scale
    calls = []
    monkeypatch.setattr(fused, "dot_product_attention", lambda *a, **kw: calls.append(1) or reference_kernel(*a, **kw))
    fallback = lambda q, k, v, s: dot_product_attention(q, k, v, s, scale=scale)  # noqa: E731
    with attention_cudnn.cuda_trace_profile():
        got = _output_and_grads(lambda *a: attention_cudnn.on_cuda(*a, scale=scale, fallback=fallback, rules=None),
                                q, k, v, segments)
    assert calls, f"{case}: the kernel was never traced"
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _output_and_grads(lambda *a: dot_product_attention(*a, scale=scale), *up, segments)
    real = np.asarray(segments != 0)
    for name, a, b in zip(("output", "d/dq", "d/dk", "d/dv"), want, got):
        if name == "output":
            a, b = a[real], b[real]
        assert np.isfinite(b).all(), f"{case}: {name} has non-finite values"
        np.testing.assert_allclose(b, a, rtol=0, atol=0.02 * np.abs(a).max(), err_msg=f"{case}: {name}")


def _mesh_and_rules():
    """The trainer's mesh and logical rules, on the 8 test devices: batch over fsdp 4, heads over tensor 2."""
    cfg = tiny_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "ici_data_parallelism=1",
                      "ici_expert_parallelism=1")
    return sharding.create_mesh(cfg), sharding.axis_rules(cfg)


def _loss_and_grad(impl, rules, scale):
    def loss(q, k, v, s):
        return jnp.sum(attention(q, k, v, s, impl=impl, chunk_size=4, scale=scale, rules=rules).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _definitions(text):
    """SSA name -> the line that defines it, in a StableHLO module's text."""
    return {m.group(1): line for line in text.splitlines() if (m := re.match(r"\s*(%[\w#]+)(?::\d+)? = ", line))}


@pytest.mark.parametrize("case", list(CASES))
def test_lowers_for_cuda_on_8_devices(case):
    """jit(value_and_grad) through attention=cudnn_flash, traced once: the CUDA lowering holds cuDNN's forward
    and backward as partitioned ops whose q, k, v are pinned to [batch, -, heads, -] and whose row tables to
    [batch, -] of the trainer's mesh; the CPU lowering of the same trace holds neither. Unsharded, the
    lowering names cuDNN's targets, with V padded to K and float32 statistics for B x 16 slots."""
    length, h, n, kd, vd, scale = CASES[case]
    mesh, rules = _mesh_and_rules()
    batch = ("data", "fsdp", "expert")
    spec = jax.sharding.PartitionSpec(batch, None, "tensor", None)
    args = [jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
            for s in _qkv(length, h, n, kd, vd, batch=8)]
    args.append(jax.ShapeDtypeStruct((8, length), jnp.int32,
                                     sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch))))
    with jax.set_mesh(mesh), attention_cudnn.cuda_trace_profile():
        traced = _loss_and_grad("cudnn_flash", rules, scale).trace(*args)
        cuda, cpu = traced.lower(lowering_platforms=("cuda",)).as_text(), traced.lower().as_text()
    calls = [line for line in cuda.splitlines() if "custom_call @CustomSPMDPartitioning" in line]
    assert len(calls) == 2 == attention_cudnn.kernel_calls(traced.jaxpr), calls
    assert "cudnn" not in cpu and "CustomSPMDPartitioning" not in cpu
    defs = _definitions(cuda)
    operands = re.search(r"@CustomSPMDPartitioning\(([^)]*)\)", calls[0]).group(1).split(", ")
    rows = '{"data", "fsdp", "expert"}'  # the batch axes (data and expert are 1 here)
    heads = f'[{rows}, {{}}, {{"tensor"}}, {{}}]'
    for name, operand in zip(("q", "k", "v", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"), operands):
        line = defs[operand]
        if name == "bias":  # the kernel's unused bias: an empty array
            assert "tensor<0x" in line, line
            continue
        want = heads if name in "qkv" else f'[{rows}, {{}}]'
        assert "sdy.sharding_constraint" in line and want in line, f"{case}: {name} is not pinned to {want}: {line}"

    with attention_cudnn.cuda_trace_profile():  # one device: no partitioning, cuDNN's own custom calls
        local = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        text = _loss_and_grad("cudnn_flash", None, scale).trace(*local).lower(lowering_platforms=("cuda",)).as_text()
    fwd = [line for line in text.splitlines() if "custom_call @__cudnn$fmhaSoftmax(" in line]
    bwd = [line for line in text.splitlines() if "custom_call @__cudnn$fmhaSoftmaxBackward(" in line]
    assert len(fwd) == len(bwd) == 1, (fwd, bwd)
    stats = f"tensor<{8 * attention_cudnn.max_segments(length)}x{h}x{length}xf32>"  # [B * M, H, L]
    assert "PADDING_CAUSAL" in fwd[0] and stats in fwd[0], fwd[0]
    types = re.search(r"\} : \((.*)\) -> ", fwd[0]).group(1).split(", ")  # q, k, v, seqlens x2, offsets x2
    assert types[2] == f"tensor<8x{length}x{n}x{kd}xbf16>", f"{case}: V reaches cuDNN as {types[2]}, not padded to K"


def _trace_on_cuda(dtype, sm=90):
    q, k, v = (jax.ShapeDtypeStruct(x.shape, dtype) for x in _qkv(L, 4, 2, 8, 8))
    segments = jax.ShapeDtypeStruct((2, L), jnp.int32)
    with attention_cudnn.cuda_trace_profile(sm=sm):
        jax.eval_shape(lambda *a: attention_cudnn.on_cuda(*a, scale=0.3, fallback=None, rules=None), q, k, v, segments)


def test_refuses_in_one_line_what_the_kernel_cannot_take():
    """float32 activations name dtype; a pre-Hopper GPU names attention=chunked."""
    for dtype, sm, message in ((jnp.float32, 90, r"attention=cudnn_flash: .* set dtype=bfloat16 or use "
                                                 r"attention=chunked"),
                               (jnp.bfloat16, 80, r"attention=cudnn_flash needs .* compute capability 8.0: use "
                                                  r"attention=chunked")):
        with pytest.raises(ValueError) as e:
            _trace_on_cuda(dtype, sm)
        assert re.fullmatch(message, str(e.value).splitlines()[0]), str(e.value)  # JAX appends a traceback note
    _trace_on_cuda(jnp.bfloat16, sm=100)


# ------------------------------------------------------------------ GPU: pytest -m gpu tests/test_attention_cudnn.py

GPU_CASES = {  # name: (H, N, K, V, scale); DeepSeek-V3's MLA head dims
    "gqa": (8, 2, 64, 64, None),
    "mla": (4, 4, 192, 128, 0.1),
}
GPU_LENGTH = 256
GPU_LAYOUTS = {  # [B, 256] segment ids
    "packed with padding": [[1] * 100 + [2] * 60 + [3] * 40 + [0] * 56, [1] * 7 + [2] * 200 + [3] * 49],
    # 100 documents in row 1: beyond the 64 slots, the batch takes the fallback
    "over the bound": [[1] * 256, list(range(1, 101)) + [101] * 156],
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cudnn_flash_matches_dot_product_on_the_gpu(case, layout):
    """bf16 q, k, v: cudnn_flash's output on real rows and its q/k/v gradients against dot_product's in float32
    from the same inputs, to 2% (output) and 5% (gradients) of each tensor's largest value (bf16 probabilities
    and outputs; a wrong mask or stride is off by the whole value); cuDNN's kernel is in the compiled step."""
    h, n, kd, vd, scale = GPU_CASES[case]
    scale = kd ** -0.5 if scale is None else scale
    segments = jnp.asarray(GPU_LAYOUTS[layout], jnp.int32)
    q, k, v = _qkv(GPU_LENGTH, h, n, kd, vd, jnp.bfloat16)
    impl = lambda *a: attention(*a, impl="cudnn_flash", chunk_size=64, scale=scale)  # noqa: E731
    got = _output_and_grads(impl, q, k, v, segments)
    compiled = jax.jit(impl).lower(q, k, v, segments).compile().as_text()
    assert "__cudnn$fmhaSoftmax" in compiled, "cuDNN's kernel is not in the compiled step"
    want = _output_and_grads(lambda *a: dot_product_attention(*a, scale=scale),
                             *(x.astype(jnp.float32) for x in (q, k, v)), segments)
    real = np.asarray(segments != 0)
    for name, a, b in zip(("output", "d/dq", "d/dk", "d/dv"), want, got):
        if name == "output":
            a, b = a[real], b[real]
        assert np.isfinite(b).all(), f"{case}/{layout}: {name} has non-finite values"
        tolerance = (0.02 if name == "output" else 0.05) * np.abs(a).max()
        np.testing.assert_allclose(b, a, rtol=0, atol=tolerance, err_msg=f"{case}/{layout}: {name}")

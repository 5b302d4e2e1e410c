"""te_dropless stages on CPU: the 128-row aligned permutation, the kernel-set selection, and (marked `gpu`)
Transformer Engine's kernels against their pure-JAX references at TE's own tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.layers.moe import dispatch, te_kernels, te_runtime
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts
from tests.tiny import tiny_config

ALIGN = dispatch.ALIGN


@pytest.mark.parametrize("name,experts", [
    ("skewed with empty experts", np.array([0, 3, 3, 0, 3, 5, 3, 0, 0, 3] * 30)),
    ("all to one", np.full(200, 2)),
    ("with EP padding ids", np.array([1, 4, 0, 4, 4, 2, 4, 3] * 20)),  # id 4 == num_experts: padding
])
def test_aligned_permute_layout_and_round_trip(name, experts):
    num_experts = 6 if "EP" not in name else 4
    x = np.arange(experts.size * 3, dtype=np.float32).reshape(-1, 3) + 1.0
    x_RD, sizes_E, rows_S = dispatch.aligned_permute(jnp.asarray(x), jnp.asarray(experts, jnp.int32), num_experts)
    x_RD, sizes_E, rows_S = np.asarray(x_RD), np.asarray(sizes_E), np.asarray(rows_S)
    counts = np.bincount(experts[experts < num_experts], minlength=num_experts)
    np.testing.assert_array_equal(sizes_E, -(-counts // ALIGN) * ALIGN, err_msg=f"{name}: aligned sizes")
    assert x_RD.shape[0] == dispatch.aligned_buffer_rows(experts.size, num_experts) and x_RD.shape[0] % ALIGN == 0
    starts = np.concatenate([[0], np.cumsum(sizes_E)[:-1]])
    for e in range(num_experts):
        mine = np.flatnonzero(experts == e)
        # Group e occupies [start, start + count) in slot order; the rest of its aligned block is zeros.
        np.testing.assert_array_equal(rows_S[mine], starts[e] + np.arange(mine.size), err_msg=f"{name}: expert {e}")
        np.testing.assert_array_equal(x_RD[starts[e] + mine.size: starts[e] + sizes_E[e]], 0.0)
    padding = experts >= num_experts
    assert np.all(rows_S[padding] >= x_RD.shape[0]), f"{name}: padding ids must stay out of the buffer"
    back = np.asarray(dispatch.unpermute(jnp.asarray(x_RD), jnp.asarray(rows_S)))
    np.testing.assert_array_equal(back[~padding], x[~padding], err_msg=f"{name}: round trip")
    np.testing.assert_array_equal(back[padding], 0.0)


def test_kernel_sets_and_start_up_check():
    ref = tiny_config("moe_impl=te_dropless", "te_kernels=reference")
    assert te_kernels.kernels(ref) is te_kernels.REFERENCE
    te_runtime.check_available(ref)  # the references need nothing
    te_runtime.check_available(tiny_config("moe_impl=ragged"))  # other impls are not checked
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ConfigError, match="te_kernels=reference"):
            te_runtime.check_available(tiny_config("moe_impl=te_dropless"))


def test_te_options_are_validated():
    with pytest.raises(ConfigError, match="te_gmm_quantization"):
        tiny_config("moe_impl=ragged", "te_gmm_quantization=mxfp8")
    with pytest.raises(ConfigError, match="topk_routing_group"):
        tiny_config("moe_impl=te_dropless", "num_experts=8", "num_experts_per_tok=1", "n_routing_groups=4",
                    "topk_routing_group=2")


# ------------------------------------------------------------------------------------------- GPU only
# Run on an NVIDIA GPU with Transformer Engine installed: pytest -m gpu tests/test_te_dropless.py
# (MaxText.benchmarks.gpu_check runs them). TE's outputs are compared with references that do not go through
# TE: router.select_experts, and grouped GEMMs computed per group in float64 with numpy. Each check is a
# function of the kernel under test, so tests/test_gpu_kit.py can show on CPU that it fails on a wrong one
# and traces TE's calls through MaxText/planning/te_trace.py.
ROUTER_TOKENS = 2048
ROUTER_TOL = 1e-5  # TE's fused-router tolerance (fp32, atol = rtol)
# name: (config overrides, whether TE's fused_topk_with_score_function itself has the reference's semantics).
# TE weights softmax choices without renormalising (use_pre_softmax=True: top-k of the probabilities) and
# always renormalises sigmoid choices when K > 1; the other combinations are checked at our call site only.
ROUTER_CASES = {
    "softmax": (["num_experts=64", "num_experts_per_tok=8"], True),
    "softmax, 8 groups keep 4, scaled": (["num_experts=64", "num_experts_per_tok=8", "n_routing_groups=8",
                                          "topk_routing_group=4", "routed_scaling_factor=2.5"], True),
    "sigmoid with bias": (["num_experts=64", "num_experts_per_tok=6", "routed_score_func=sigmoid",
                           "routed_bias=true", "norm_topk_prob=true"], True),
    "DeepSeek-V3: sigmoid with bias, 8 groups keep 4, scaled": (
        ["num_experts=256", "num_experts_per_tok=8", "routed_score_func=sigmoid", "routed_bias=true",
         "norm_topk_prob=true", "n_routing_groups=8", "topk_routing_group=4", "routed_scaling_factor=2.5"], True),
    "softmax, norm_topk_prob (Mixtral, Qwen3)": (["num_experts=64", "num_experts_per_tok=8",
                                                  "norm_topk_prob=true"], False),
}


def router_case(name):
    """(cfg, logits_TE float32, bias_E float32 or None, whether TE's own router has these semantics)."""
    overrides, native = ROUTER_CASES[name]
    cfg = tiny_config("moe_impl=te_dropless", *overrides)
    rng = np.random.default_rng(0)  # numpy: the same inputs on every platform
    logits = rng.normal(size=(ROUTER_TOKENS, cfg.num_experts)).astype(np.float32)
    bias = (rng.normal(size=cfg.num_experts) * 0.05).astype(np.float32) if cfg.routed_bias else None
    return cfg, logits, bias, native


def te_router(logits_TE, bias_E, cfg):
    """TE's fused router with the config's semantics: (sparse probs [T, E], routing map bool [T, E])."""
    from transformer_engine.jax.router import fused_topk_with_score_function

    return fused_topk_with_score_function(
        logits_TE, topk=cfg.num_experts_per_tok, use_pre_softmax=cfg.routed_score_func == "softmax",
        num_groups=cfg.n_routing_groups or -1, group_topk=cfg.topk_routing_group or -1,
        scaling_factor=float(cfg.routed_scaling_factor), score_function=cfg.routed_score_func, expert_bias=bias_E)


def decision_margin(logits_TE, bias_E, cfg):
    """Per token, the smallest gap between a kept and a dropped candidate (expert group, then expert) in the
    reference's selection, relative to the best score, in float64."""
    s = np.asarray(logits_TE, np.float64)
    if cfg.routed_score_func == "softmax":
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-s))
    choice = s if bias_E is None else s + np.asarray(bias_E, np.float64)
    t, e = choice.shape
    k, gaps = cfg.num_experts_per_tok, []
    if cfg.n_routing_groups:
        g, keep = cfg.n_routing_groups, cfg.topk_routing_group
        group_score = -np.sort(-choice.reshape(t, g, e // g), -1)[..., :k // keep].sum(-1)
        order = np.argsort(-group_score, -1)
        ranked = np.take_along_axis(group_score, order, -1)
        gaps.append(ranked[:, keep - 1] - ranked[:, keep])
        kept = np.zeros((t, g), bool)
        np.put_along_axis(kept, order[:, :keep], True, -1)
        choice = np.where(np.repeat(kept, e // g, axis=1), choice, -np.inf)
    ranked = -np.sort(-choice, -1)
    gaps.append(ranked[:, k - 1] - ranked[:, k])
    return np.min(gaps, axis=0) / ranked[:, 0]


def dense_routing(experts_TK, weights_TK, num_experts):
    """(routing map bool [T, E], weights scattered to [T, E]) of a top-k choice."""
    experts_TK, weights_TK = np.asarray(experts_TK), np.asarray(weights_TK, np.float32)
    shape = (experts_TK.shape[0], num_experts)
    chosen, probs = np.zeros(shape, bool), np.zeros(shape, np.float32)
    np.put_along_axis(chosen, experts_TK, True, axis=1)
    np.put_along_axis(probs, experts_TK, weights_TK, axis=1)
    return chosen, probs


def check_routing(got_map, got_probs, logits, bias, cfg, label):
    """got_map / got_probs [T, E] against router.select_experts: the same experts per token (as sets) and the
    same weights, at TE's router tolerance. Tokens whose choice turns on a gap below 1e-5 of the best score
    are left out (XLA and TE's kernel round the scores differently in the last bits: either choice is right
    there); they must stay rare."""
    weights, experts = select_experts(expert_scores(jnp.asarray(logits), cfg.routed_score_func),
                                      None if bias is None else jnp.asarray(bias), cfg)
    want_map, want_probs = dense_routing(experts, weights, cfg.num_experts)
    clear = decision_margin(logits, bias, cfg) > 1e-5
    assert clear.mean() > 0.99, f"{label}: {np.sum(~clear)} of {clear.size} tokens are near ties; change the inputs"
    got_map, got_probs = np.asarray(got_map, bool)[clear], np.asarray(got_probs, np.float32)[clear]
    wrong = np.flatnonzero(np.any(got_map != want_map[clear], axis=1))
    assert wrong.size == 0, (f"{label}: chosen experts differ for {wrong.size} of {clear.sum()} tokens, e.g. token "
                             f"{wrong[0]}: got {np.flatnonzero(got_map[wrong[0]])}, want "
                             f"{np.flatnonzero(want_map[clear][wrong[0]])}")
    np.testing.assert_allclose(got_probs, want_probs[clear], rtol=ROUTER_TOL, atol=ROUTER_TOL,
                               err_msg=f"{label}: weights of the chosen experts")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ROUTER_CASES)
def test_te_router_matches_reference(name):
    """TE's own fused router (its probabilities are the weights, its routing map the choices) where its
    semantics are the reference's, and te_dropless's call site (te_kernels.kernels(cfg).topk) in every case."""
    cfg, logits, bias, native = router_case(name)
    if native:
        probs, routing_map = jax.jit(lambda l, b: te_router(l, b, cfg))(logits, bias)
        check_routing(routing_map, probs, logits, bias, cfg, f"{name}: TE fused_topk_with_score_function")
    topk = te_kernels.kernels(cfg).topk
    weights, experts = jax.jit(lambda l, b: topk(l, b, cfg))(logits, bias)
    check_routing(*dense_routing(experts, weights, cfg.num_experts), logits, bias, cfg,
                  f"{name}: te_kernels.kernels(cfg).topk")


GEMM_SIZES = (256, 0, 128, 512, 128, 0, 256, 768)  # multiples of 128 (MXFP8's V2 kernel needs it), two empty
GEMM_TAIL = 256  # rows past sum(sizes), zero as in te_dropless's buffers (a multiple of 128, like theirs)
GEMM_D, GEMM_F = 256, 512  # K and N of the GEMM, multiples of 128
# bf16: TE's dtype_tols. fp32: TE runs fp32 GEMMs in TF32 (10-bit mantissa, notes/te.md 13.2 item 7), so TE's
# fp32 tolerance (2.4e-5) cannot hold. Emulated on these inputs (operands rounded to TF32, products exact in
# float64) the normalised max error is 3.0-3.3e-4 with rounding to nearest and 7.5-7.8e-4 with truncation,
# against 2.3-2.5e-3 with operands rounded to bf16: 1.5e-3 admits TF32 either way and still tells an fp32
# GEMM from a bf16 one. FP8 emulated the same way (per-tensor current scaling; MXFP8: 32-element blocks with
# power-of-two scales) against the exact product of the bf16 inputs: e4m3 (3 mantissa bits, up to 6% per
# operand) gives 0.034 forward, e5m2 gradients (2 bits) 0.063 backward, MXFP8 (e4m3 both ways) 0.036-0.039.
# A wrong group, operand or scale is an O(1) error.
# name: (dtype, te_gmm_quantization, tolerances of (y, dx, dw), whether they are normalised max errors
# max|got - want| <= tol * max|want| (else atol = rtol = tol, elementwise))
GEMM_CASES = {
    "bf16": (jnp.bfloat16, "none", (3.9e-2,) * 3, False),
    "fp32 (TF32)": (jnp.float32, "none", (1.5e-3,) * 3, True),
    "fp8_current": (jnp.bfloat16, "fp8_current", (0.1, 0.15, 0.15), True),
    "mxfp8": (jnp.bfloat16, "mxfp8", (0.1,) * 3, True),
}


def gemm_inputs(dtype):
    """x [R + tail, D] (tail rows 0), w [E, D, F], sizes [E], cotangent [R + tail, F] (random on every row)."""
    rng = np.random.default_rng(1)
    rows = sum(GEMM_SIZES) + GEMM_TAIL
    x = rng.normal(size=(rows, GEMM_D))
    x[sum(GEMM_SIZES):] = 0.0
    # Each expert's weights at their own scale (0.25 to 2): a GEMM that applies one expert's FP8 scale to
    # another's weights is off by a factor of 2 or more, not by the few percent of equally scaled experts.
    magnitude = 2.0 ** (np.arange(len(GEMM_SIZES)) % 4 - 2)
    w = rng.normal(size=(len(GEMM_SIZES), GEMM_D, GEMM_F)) / np.sqrt(GEMM_D) * magnitude[:, None, None]
    ct = rng.normal(size=(rows, GEMM_F))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(GEMM_SIZES, jnp.int32), jnp.asarray(ct, dtype)


def gemm_vjp(grouped_gemm, x, w, sizes, ct, quantization):
    """(y, dx, dw) of grouped_gemm(x, w, sizes, quantization) with cotangent ct."""
    y, vjp = jax.vjp(lambda x, w: grouped_gemm(x, w, sizes, quantization), x, w)
    return (y, *vjp(ct))


def grouped_reference(x, w, sizes, ct):
    """(y, dx, dw) group by group in float64; rows past sum(sizes) get 0."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e], ct[rows] @ w[e].T, x[rows].T @ ct[rows]
        start += size
    return y, dx, dw


def check_grouped_gemm(grouped_gemm, case: str, label: str):
    """grouped_gemm's output and gradients (random cotangent) against grouped_reference on the real rows; on
    the padded tail, output and x-gradient exactly 0 (gmm.grouped_matmul's contract, which te_dropless's
    buffers rely on)."""
    dtype, quantization, tols, scaled = GEMM_CASES[case]
    x, w, sizes, ct = gemm_inputs(dtype)
    got = jax.jit(lambda *args: gemm_vjp(grouped_gemm, *args, quantization))(x, w, sizes, ct)
    got = [np.asarray(a, np.float32) for a in got]
    want = grouped_reference(x, w, sizes, ct)
    real = sum(GEMM_SIZES)
    for name, g, r, tol in zip(("y", "dx", "dw"), (got[0][:real], got[1][:real], got[2]),
                               (want[0][:real], want[1][:real], want[2]), tols):
        atol, rtol = (tol * np.max(np.abs(r)), 0.0) if scaled else (tol, tol)
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=f"{label}: {name}")
    for name, g in (("y", got[0]), ("dx", got[1])):
        np.testing.assert_array_equal(g[real:], 0.0, err_msg=f"{label}: {name} of the {GEMM_TAIL} rows past "
                                      "sum(group_sizes) must be 0 (whatever the cotangent there)")


def skip_unless_supported(quantization: str):
    """FP8 current scaling is checked from SM 9.0 (Hopper) on, MXFP8 on SM 10.x (Blackwell) only, NVFP4 from SM 10.0."""
    sm = te_runtime._compute_capability()
    if quantization == "fp8_current" and sm < 9.0:
        pytest.skip(f"te_gmm_quantization=fp8_current is checked on SM 9.x and later; this GPU is SM {sm}")
    if quantization == "mxfp8" and not 10.0 <= sm < 11.0:
        pytest.skip(f"te_gmm_quantization=mxfp8 needs SM 10.x (Blackwell); this GPU is SM {sm}")
    if quantization in te_kernels.NVFP4 and sm < 10.0:
        pytest.skip(f"NVFP4 needs SM 10.0 or later (Blackwell); this GPU is SM {sm}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GEMM_CASES)
def test_te_grouped_gemm_forward_and_backward_with_padded_tail(name):
    """te_dropless's call site of TE's grouped GEMM, te_kernels.kernels(cfg).grouped_gemm, forward and backward."""
    skip_unless_supported(GEMM_CASES[name][1])
    grouped_gemm = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).grouped_gemm
    check_grouped_gemm(grouped_gemm, name, f"TE grouped GEMM, {name}")


# TE's dense() (the API the dense layers' GEMMs go through under upstream's `quantization`), forward and both
# gradients with a bias, against float64. Tolerances as max|got - want| / max|want|: bf16 rounding; FP8 as the
# grouped GEMM's (e4m3 forward, e5m2 gradients; MXFP8 e4m3 both ways). Measured: none 2.6e-3, fp8_current
# 0.033 / 0.047 / 0.051 (y, dx, dw) at either SM, mxfp8 0.034 / 0.038 / 0.034; dbias (a float32 sum) 2.3e-3 (on
# CPU, TE's Python over MaxText/planning/te_reference.py's kernels). A scale read for the neighbouring block fails
# it (O(1) errors).
# NVFP4 measured on CPU (tests/test_nvfp4.py): y 0.12, dx 0.19, dw 0.21 (0.24 without the Hadamard transform).
DENSE_TOLERANCES = {"none": (1e-2,) * 3, "fp8_current": (0.1, 0.15, 0.15), "mxfp8": (0.1,) * 3,
                    "nvfp4": (0.2, 0.3, 0.35), "nvfp4_no_rht": (0.2, 0.3, 0.35)}


def dense_inputs(d: int = 96):
    """x [4, 32, d], w [d, 128], bias [128], cotangent [4, 32, 128]: normal values whose magnitude changes from
    one 32 x 32 tile to the next (2^-2 .. 2^1), so that a block scale read for the wrong block, or along the
    wrong axis, is off by a factor of 2 or more. (NVFP4's Hadamard transform takes widths of 128: d 128.)"""
    rng = np.random.default_rng(2)

    def tiled(*shape):
        r, c = np.indices(shape[-2:]) // 32
        return rng.normal(size=shape) * 2.0 ** ((r + 2 * c) % 4 - 2)

    return (jnp.asarray(tiled(4, 32, d), jnp.bfloat16), jnp.asarray(tiled(d, 128) / 8, jnp.bfloat16),
            jnp.asarray(rng.normal(size=128), jnp.bfloat16), jnp.asarray(tiled(4, 32, 128), jnp.bfloat16))


def check_dense(quantization: str, label: str):
    """TE's dense() with a bias and te_kernels' quantizer set for `quantization`, forward and gradients
    (dense_inputs), against float64 at DENSE_TOLERANCES."""
    te = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).te
    quantizers = te_kernels.quantizer_set(te, quantization, 1)
    x, w, b, ct = dense_inputs(128 if quantization in te_kernels.NVFP4 else 96)

    def forward_and_back(x, w, b, ct):  # jitted afresh per check: eager TE ops would keep a cached lowering
        y, vjp = jax.vjp(lambda *a: te["dense"].dense(*a, contracting_dims=((2,), (0,)), quantizer_set=quantizers),
                         x, w, b)
        return (y, *vjp(ct))

    got = [np.asarray(a, np.float64) for a in jax.jit(forward_and_back)(x, w, b, ct)]
    x, w, b, ct = (np.asarray(a, np.float64) for a in (x, w, b, ct))
    want = (x @ w + b, ct @ w.T, np.einsum("bsd,bsf->df", x, ct), ct.sum((0, 1)))
    for name, g, r, tol in zip(("y", "dx", "dw", "dbias"), got, want, (*DENSE_TOLERANCES[quantization], 1e-2)):
        np.testing.assert_allclose(g, r, rtol=0, atol=tol * np.max(np.abs(r)), err_msg=f"{label}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", DENSE_TOLERANCES)
def test_te_dense_matches_float64(quantization):
    """TE's dense GEMM as the dense layers call it under `quantization` (linear.dense_gemm: te_kernels' quantizer
    set), forward, both gradients and the bias gradient, at the tolerances the CPU run of TE's Python set."""
    skip_unless_supported(quantization)
    check_dense(quantization, f"TE dense on GPU, {quantization}")


def grouped_dense_as_called_before(x, w, sizes, quantization):
    """te_kernels._te_grouped_gemm without its empty-experts-last order: TE's grouped_dense called plainly."""
    te = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).te
    rows = x.shape[0]
    valid = (jnp.arange(rows) < jnp.sum(sizes))[:, None]
    y = te["dense"].grouped_dense(jnp.where(valid, x, 0), w, sizes.at[-1].add(rows - jnp.sum(sizes)),
                                  contracting_dims=((1,), (1,)),
                                  quantizer_set=te_kernels.quantizer_set(te, quantization, w.shape[0]))
    return jnp.where(valid, y, 0)


@pytest.mark.gpu
def test_te_tensor_scaled_gemm_misreads_scales_after_an_empty_expert():
    """TE 2.20's V1 grouped GEMM steps its tensor-scale pointers only past non-empty GEMMs (csrc/extensions/gemm.cpp)
    while the weights carry a scale per expert, so called plainly it computes every expert after an empty one with
    an earlier expert's weight scale (MaxText/planning/te_layouts.py). This expects that failure; when it passes, TE
    has fixed it and te_kernels._te_grouped_gemm's empty-experts-last order can go."""
    skip_unless_supported("fp8_current")
    with pytest.raises(AssertionError, match="fp8_current: y"):
        check_grouped_gemm(grouped_dense_as_called_before, "fp8_current", "fp8_current")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp32 (TF32)"])
def test_reference_grouped_gemm_on_gpu(name):
    """The reference kernel set's grouped GEMM (jax.lax.ragged_dot on a GPU, block_sparse on the CPU where the
    suite checks it) against the same float64 loop, at the same tolerances."""
    check_grouped_gemm(lambda x, w, sizes, quantization: grouped_matmul(x, w, sizes), name,
                       f"gmm.grouped_matmul on GPU, {name}")


@pytest.mark.gpu
def test_te_permutation_matches_aligned_permute():
    """TE's token_dispatch with 128-row alignment builds the buffer our aligned_permute builds (same aligned
    group sizes and buffer size, the same rows in every expert group, zero padding), and token_combine with
    the routing probabilities gives our unpermute + weighted combine."""
    pytest.importorskip("triton", reason="TE's token_dispatch runs Triton kernels")
    from transformer_engine.jax import permutation

    from MaxText.layers.moe.dispatch import aligned_permute, unpermute, weighted_sum as combine

    t, e, k, h = 512, 8, 2, 64
    scores = jax.random.gumbel(jax.random.key(0), (t, e)) - 1.5 * jnp.log1p(jnp.arange(e))  # skewed
    experts_TK = jnp.argsort(-scores, axis=1)[:, :k].astype(jnp.int32)
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32)
    routing_map = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=jnp.int32), axis=1)
    probs = jax.random.uniform(jax.random.key(2), (t, e)) * routing_map
    out, _, row_id_map, pad_offsets, tokens_per_expert = permutation.token_dispatch(
        x, routing_map, num_out_tokens=t * k, probs=probs, align_size=128)
    x_RD, sizes_E, rows_S = aligned_permute(jnp.repeat(x, k, axis=0), experts_TK.reshape(-1), e)
    np.testing.assert_array_equal(np.asarray(tokens_per_expert), np.asarray(sizes_E), err_msg="aligned group sizes")
    # TE's buffer: the worst case T*K + E*(A-1) rounded DOWN to a multiple of A (permutation.py); here 1920 rows,
    # where rounding up would give 2048.
    rows = (t * k + e * (ALIGN - 1)) // ALIGN * ALIGN
    assert out.shape == (rows, h), f"TE's token_dispatch buffer is {out.shape}, expected ({rows}, {h})"
    assert x_RD.shape == (rows, h), f"aligned_permute's buffer is {x_RD.shape}, TE's is ({rows}, {h})"
    start = 0
    for i, size in enumerate(np.asarray(sizes_E)):
        got, want = (np.asarray(a[start:start + size]) for a in (out, x_RD))
        np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)], err_msg=f"expert {i} rows")
        start += size
    np.testing.assert_array_equal(np.asarray(out[start:]), 0.0, err_msg="rows after the last group")
    y_te = permutation.token_combine(out, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
    weights_TK = jnp.take_along_axis(probs, experts_TK, axis=1)
    y_ref = combine(unpermute(x_RD, rows_S), weights_TK)
    np.testing.assert_allclose(np.asarray(y_te), np.asarray(y_ref), rtol=2.4e-5, atol=2.4e-5)

"""NVFP4 (`quantization=te_nvfp4` / `te_nvfp4_no_rht`) through Transformer Engine's own Python on CPU (marker
`te_trace`), its quantize, RHT-amax and GEMM kernels te_reference's: the format each copy is in, checked against
a NumPy statement of it (float32 arithmetic, ml_dtypes' E4M3 and E2M1 casts); stochastic rounding unbiased; TE's
dense() forward equal to the product of its NVFP4 operands and, with both gradients, within NVFP4's tolerance of
float64 (the GPU test's check); a broken kernel caught; deepseek3-tiny trained with NVFP4 dense GEMMs.

Found on the way: TE 2.20's own pure-JAX NVFP4 quantizer (NVTE_JAX_CUSTOM_CALLS=false) is no oracle: it rounds
the E4M3 block scales with lax.reduce_precision(4, 3), whose largest finite value is 240, so the blocks whose
scale lands in (240, 448] (the block holding the tensor's amax, always) get NaN scales; and its 2D scales are
tiled (jnp.tile) where each 16-row tile's scale must be repeated row by row. The references follow the C++
(core_nvfp4.cuh: static_cast to E4M3, to 448).
"""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from MaxText.layers.moe import te_kernels
from MaxText.planning import te_layouts, te_reference, te_trace
from tests import test_te_dropless as gpu_tests, test_te_trace as trace_tests
from tests.tiny import tiny_config

pytestmark = pytest.mark.te_trace

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def te(te_standin):
    """TE's modules at SM 100 (NVFP4 needs Blackwell), its primitives lowered to the references."""
    te_trace.set_sm(100)
    te_reference.install()
    yield te_kernels.kernels(tiny_config("moe_impl=te_dropless")).te
    te_reference.uninstall()
    te_trace.set_sm(90)


# ------------------------------------------------------------------------------------------- the format


def np_nvfp4(x2, amax, *, two_d=False, uniforms=None):
    """NumPy's NVFP4 of x2 [rows, cols] against the tensor amax (float32 arithmetic as the kernel's): the E2M1
    values [rows, cols] and the E4M3 block scales [rows, cols / 16] as float32."""
    f32 = np.float32
    x2 = np.asarray(x2, f32)
    amax = f32(amax)
    enc = f32(448 * 6) / amax if amax > 0 else f32(1)
    enc = f32(1) if enc == 0 or not np.isfinite(enc) else enc
    rows, cols = x2.shape
    blocks = np.abs(x2).reshape(rows, cols // 16, 16).max(axis=2)
    if two_d:
        blocks = np.repeat(blocks.reshape(rows // 16, 16, cols // 16).max(axis=1), 16, axis=0)
    dec = (blocks * (enc * f32(1 / 6))).astype(ml_dtypes.float8_e4m3fn).astype(f32)
    with np.errstate(divide="ignore"):  # an all-zero block: its factor the largest float32, its values 0
        factor = np.minimum(f32(1) / (dec * (f32(1) / enc)), np.finfo(f32).max)
    scaled = x2 * np.repeat(factor, 16, axis=1)
    if uniforms is not None:  # up with the probability of the distance past the lower neighbour
        mag = np.minimum(np.abs(scaled), 6)
        i = np.clip(np.searchsorted(E2M1_GRID, mag, side="right") - 1, 0, 6)
        low, high = E2M1_GRID[i], E2M1_GRID[i + 1]
        scaled = np.sign(scaled) * np.where(uniforms < (mag - low) / (high - low), high, low)
    return np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(f32), dec


def hadamard_rht(sign_vector):
    """The 16 x 16 random Hadamard matrix as TE's Python states it (quantize/hadamard.py): diag(signs) H / 4, bf16."""
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return (np.diag(sign_vector) @ h / 4).astype(ml_dtypes.bfloat16).astype(np.float32)


def _x():
    """[2, 64, 128] bf16: each 16-element block at its own scale (2^-6 .. 2^5), one block all zeros, one outlier."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 64, 128)) * 2.0 ** rng.integers(-6, 6, size=(2, 64, 8)).repeat(16, axis=2)
    x[0, 3, 16:32] = 0.0
    x[1, 40, 77] = 300.0
    return jnp.asarray(x, jnp.bfloat16)


QUANTIZERS = {"x (1D)": ("x", False), "weight (2D tiles)": ("kernel", False), "x with the RHT": ("x", True),
              "output gradient (stochastic rounding, RHT)": ("dgrad", True)}


@pytest.mark.parametrize("name", QUANTIZERS)
def test_nvfp4_copies_are_the_two_level_block_format(te, name):
    """TE's quantize with the product's quantizer (te_kernels.nvfp4_quantizer_set) gives, for each copy, exactly
    NumPy's NVFP4 of x (rowwise) and of x transposed (colwise; with the RHT, x transposed times the Hadamard matrix
    per 16 elements, against its own amax), the scales' padding unwritten, the tensor amax as the copy's amax."""
    from transformer_engine.jax.cpp_extensions.quantization import quantize  # noqa: PLC0415
    from transformer_engine.jax.quantize.hadamard import get_wgrad_sign_vector  # noqa: PLC0415

    which, rht = QUANTIZERS[name]
    qset = te_kernels.nvfp4_quantizer_set(te, rht=rht, sr_key=jax.random.key(5))
    quantizer = getattr(qset, which)
    x = _x()
    q = jax.jit(lambda x: quantize(x, quantizer))(x)
    x2 = np.asarray(x, np.float32).reshape(128, 128)
    sources = {"rowwise": (x2, q.rowwise_tensor, 2)}  # (the matrix, TE's copy, its flatten axis)
    colwise = x2.T
    if rht:
        colwise = (colwise.reshape(-1, 16) @ hadamard_rht(get_wgrad_sign_vector())).reshape(128, 128)
    sources["colwise"] = (colwise, q.colwise_tensor, 1)  # x transposed: [128, 2, 64]
    for copy, (source, tensor, axis) in sources.items():
        uniforms = None
        if quantizer.stochastic_rounding_rng_state is not None:
            key = te_reference._sr_key(quantizer.stochastic_rounding_rng_state)
            uniforms = np.asarray(jax.random.uniform(key, source.shape))
        amax = np.max(np.abs(source))
        np.testing.assert_allclose(np.asarray(tensor.amax).reshape(-1), [amax], rtol=1e-6, err_msg=f"{name} {copy}")
        want, scales = np_nvfp4(source, amax, two_d=which == "kernel", uniforms=uniforms)
        got = np.asarray(tensor.data.astype(jnp.float32)).reshape(source.shape)
        sinv = np.asarray(tensor.scale_inv.astype(jnp.float32))
        sinv = sinv.reshape(int(np.prod(sinv.shape[:axis])), -1)
        np.testing.assert_array_equal(sinv[:128, :8], scales, err_msg=f"{name}, {copy}: block scales")
        assert np.isnan(sinv[128:]).all() and np.isnan(sinv[:, 8:]).all(), f"{name}, {copy}: padding written"
        differ = got != want
        # The RHT's float32 sums may land a value on the other side of a rounding midpoint: one step, rarely.
        assert differ.mean() <= (2e-3 if rht else 0), f"{name}, {copy}: {differ.sum()} values differ"
        if rht:
            steps = np.abs(np.searchsorted(E2M1_GRID, np.abs(got[differ])) - np.searchsorted(E2M1_GRID,
                                                                                              np.abs(want[differ])))
            assert (steps <= 1).all(), f"{name}, {copy}: a value more than one E2M1 step off"


def test_stochastic_rounding_is_unbiased(te):
    """The output gradient's rounding (a new state per key) averages to the value, where rounding to nearest keeps
    its bias: the tensor's amax 6.0 makes every block's scale exactly 1, and the other values lie
    0.3 of a grid step past a grid point."""
    from transformer_engine.jax.cpp_extensions.quantization import quantize  # noqa: PLC0415

    values = np.array([0.65, 1.15, 1.65, 2.3, 3.3, 4.6, 0.15, 6.0] * 2)
    x = jnp.asarray(np.tile(values, (64, 8)), jnp.bfloat16)
    x2 = np.asarray(x, np.float64)

    @jax.jit
    def rounded(key):
        quantizer = te_kernels.nvfp4_quantizer_set(te, rht=False, sr_key=key).dgrad
        return quantize(x, quantizer).rowwise_tensor.data.astype(jnp.float32)

    draws = np.stack([np.asarray(rounded(jax.random.key(i))) for i in range(16)])
    grid = np.searchsorted(E2M1_GRID, x2, side="right") - 1  # each value's lower neighbour on the grid
    low, high = E2M1_GRID[grid], E2M1_GRID[np.minimum(grid + 1, 7)]
    assert ((draws == low) | (draws == high)).all(), "a value rounded past its two neighbours"
    nearest, _ = np_nvfp4(x2, 6.0)
    for v in np.unique(x2):  # each value's mean over its 1024 places and 16 keys
        at = x2 == v
        bias_sr, bias_nearest = abs(draws[:, at].mean() - v), abs(nearest[at].mean() - v)
        assert bias_sr < 0.02 and (v == 6.0 or bias_nearest > 0.14), (v, bias_sr, bias_nearest)


# ------------------------------------------------------------------------------------------- the dense GEMM


def _dense_forward(te, quantization):
    x, w, _, _ = gpu_tests.dense_inputs(128)
    quantizers = te_kernels.quantizer_set(te, quantization, 1)
    y = jax.jit(lambda x, w: te["dense"].dense(x, w, contracting_dims=((2,), (0,)), quantizer_set=quantizers))(x, w)
    return np.asarray(y, np.float64), np.asarray(x, np.float32), np.asarray(w, np.float32)


@pytest.mark.parametrize("quantization", te_kernels.NVFP4)
def test_nvfp4_dense_forward_is_the_product_of_its_nvfp4_operands(te, quantization):
    """TE's dense() forward under NVFP4 = x's rowwise NVFP4 (1D) times the weight's colwise NVFP4 (2D tiles), each
    dequantized by NumPy, in float64, to bf16's rounding: the kernels, the tensor scales as the GEMM's alpha and
    the operands TE's Python picks, together."""
    y, x, w = _dense_forward(te, quantization)
    x2 = x.reshape(-1, 128)
    xq, xs = np_nvfp4(x2, np.abs(x2).max())
    wq, ws = np_nvfp4(w.T, np.abs(w).max(), two_d=True)
    deq = [q * np.repeat(s, 16, axis=1) * amax / (448 * 6) for q, s, amax in
           ((xq, xs, np.abs(x2).max()), (wq, ws, np.abs(w).max()))]
    want = (deq[0].astype(np.float64) @ deq[1].T.astype(np.float64)).reshape(y.shape)
    np.testing.assert_allclose(y, want, rtol=0, atol=2 ** -8 * np.abs(want).max())
    assert np.abs(y - x.astype(np.float64) @ w).max() > 1e-2 * np.abs(want).max(), "no quantization happened"


@pytest.mark.parametrize("quantization", te_kernels.NVFP4)
def test_te_nvfp4_dense_matches_float64(te, quantization):
    """Forward, both gradients (the weight gradient's operands through the RHT for nvfp4) and the bias gradient
    within NVFP4's tolerances of float64: the GPU test's own check (tests/test_te_dropless.py check_dense)."""
    gpu_tests.check_dense(quantization, f"TE dense on CPU, SM 100, {quantization}")


def _nvfp4_gemm_without_alpha(lhs, lhs_sinv, rhs, rhs_sinv, bias, alpha, beta, **params):
    return te_reference.gemm(lhs, lhs_sinv, rhs, rhs_sinv, bias, jnp.ones_like(alpha), beta, **params)


def _nvfp4_quantize_scales_one_block_off(*args, **params):
    out = list(te_reference.quantize(*args, **params))
    out[2] = jnp.roll(out[2], 1, axis=-1)  # the rowwise scales: each block gets its neighbour's
    return tuple(out)


@pytest.mark.parametrize("name,kernel", [("GemmPrimitive", _nvfp4_gemm_without_alpha),
                                         ("BaseDBiasQuantizePrimitive", _nvfp4_quantize_scales_one_block_off)])
def test_a_broken_nvfp4_kernel_fails_the_checks(te, name, kernel):
    """The GEMM without its tensor scales, or scales read one block off: the forward check fails."""
    te_reference.install({name: kernel})
    try:
        with pytest.raises(AssertionError, match="Not equal to tolerance"):
            test_nvfp4_dense_forward_is_the_product_of_its_nvfp4_operands(te, "nvfp4")
    finally:
        te_reference.install()


# ------------------------------------------------------------------------------------------- training


def test_deepseek3_tiny_trains_with_nvfp4_dense_gemms(te, monkeypatch, tmp_path):
    """quantization=te_nvfp4 on deepseek3-tiny (emb 128: MLA's output projection and the dense MLP, 128 wide, take
    the Hadamard transform, the narrower projections run without it: checks.nvfp4_without_rht, which the run's
    first lines print) on data2_expert4 (TE partitions the stochastic-rounding state over every device): four
    steps whose losses track bf16 GEMMs'. Measured: 1.9% apart at most (fsdp2 alike)."""
    from MaxText.config import checks  # noqa: PLC0415
    from MaxText.config.load import load_config  # noqa: PLC0415
    from tests.test_te_reference import QUANTIZABLE_TINY, _quantized_vs_bf16  # noqa: PLC0415

    overrides, devices = trace_tests.MESHES["data2_expert4"]
    overrides = [*overrides, "base_emb_dim=128", "max_target_length=64"]
    cfg = load_config(["configs/base.yml", "model_name=deepseek3-tiny", "override_model_config=true",
                       "quantization=te_nvfp4", *QUANTIZABLE_TINY, "base_emb_dim=128", "max_target_length=64"])
    without = checks.nvfp4_without_rht(cfg)
    assert "MLA's output projection" not in without and "MLA's query down-projection" in without, without
    got, want = _quantized_vs_bf16(monkeypatch, tmp_path, "te_nvfp4", overrides, devices, 4)
    assert want[-1] < want[0], f"the bf16 run does not learn: {want}"
    np.testing.assert_allclose(got, want, rtol=4e-2, err_msg="losses, NVFP4 vs bf16 dense GEMMs")

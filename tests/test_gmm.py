"""grouped_matmul (both kernels) against a per-group loop reference: forward, gradients, padding rows,
no recompiles for new group sizes, remat + scan over layers, and shard_map bodies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe.gmm import grouped_matmul

KERNELS = ("ragged_dot", "block_sparse")
# Tolerances relative to the largest magnitude of the reference: f32 is tight, bf16 has an 8-bit mantissa.
TOL = {"float32": 2e-5, "bfloat16": 4e-2}


def reference_gmm(x_RD, w_EDF, group_sizes, ct_RF):
    """float64 numpy: y = x_g @ w_e per group g, dx_g = ct_g @ w_e^T, dw_e = x_g^T ct_g; padding rows 0."""
    x_RD, w_EDF, ct_RF = (np.asarray(a, np.float64) for a in (x_RD, w_EDF, ct_RF))
    y_RF, dx_RD, dw_EDF = np.zeros(ct_RF.shape), np.zeros(x_RD.shape), np.zeros(w_EDF.shape)
    start = 0
    for e, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        y_RF[rows] = x_RD[rows] @ w_EDF[e]
        dx_RD[rows] = ct_RF[rows] @ w_EDF[e].T
        dw_EDF[e] = x_RD[rows].T @ ct_RF[rows]
        start += size
    return y_RF, dx_RD, dw_EDF


def reference_gmm_jnp(x_RD, w_EDF, group_sizes):
    """The same forward in jnp (differentiable): every group's matmul on all rows, masked to its rows."""
    rows_R = jnp.arange(x_RD.shape[0])
    y_RF = jnp.zeros((x_RD.shape[0], w_EDF.shape[2]), jnp.float32)
    start = 0
    for e, size in enumerate(group_sizes):
        mine_R1 = ((rows_R >= start) & (rows_R < start + size))[:, None]
        y_RF += jnp.where(mine_R1, jnp.matmul(x_RD, w_EDF[e], precision=jax.lax.Precision.HIGHEST), 0.0)
        start += size
    return y_RF


def _inputs(seed, rows, d, f, num_experts, dtype):
    rng = np.random.default_rng(seed)
    x_RD = jnp.asarray(rng.normal(size=(rows, d)), dtype)
    w_EDF = jnp.asarray(rng.normal(size=(num_experts, d, f)) / np.sqrt(d), dtype)
    ct_RF = jnp.asarray(rng.normal(size=(rows, f)), jnp.float32)
    return x_RD, w_EDF, ct_RF


def _random_sizes(seed, total, num_experts):
    return np.random.default_rng(seed).multinomial(total, np.full(num_experts, 1.0 / num_experts)).tolist()


# name: (rows, D, F, group sizes, block_size); sizes summing to less than rows leave padding rows.
CASES = {
    "random_sizes": (300, 32, 48, _random_sizes(1, 300, 8), None),
    "random_sizes_block16": (300, 32, 48, _random_sizes(2, 300, 8), 16),
    "empty_groups": (200, 16, 24, [0, 70, 0, 130, 0], 64),
    "all_rows_first_group": (150, 16, 32, [150, 0, 0, 0], 64),
    "all_rows_last_group": (150, 16, 32, [0, 0, 0, 150], 64),
    "padding_rows": (300, 32, 16, [60, 0, 91, 60], 128),
    "multiples_of_128": (256, 16, 64, [128, 0, 128], 128),
    "multiples_of_128_block256": (256, 16, 64, [128, 128], 256),
    "one_expert_block_over_rows": (40, 64, 16, [33], 512),
}


@functools.partial(jax.jit, static_argnames=("kernel", "block_size"))
def _fwd_and_grads(x_RD, w_EDF, group_sizes_E, ct_RF, *, kernel, block_size):
    y_RF, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes_E, kernel=kernel, block_size=block_size),
                        x_RD, w_EDF)
    dx_RD, dw_EDF = vjp(ct_RF.astype(y_RF.dtype))
    return y_RF, dx_RD, dw_EDF


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_per_group_reference(kernel, case, dtype):
    """Forward and both gradients; padding rows' output and x-gradient exactly 0; results in x's dtype."""
    rows, d, f, sizes, block_size = CASES[case]
    x_RD, w_EDF, ct_RF = _inputs(list(CASES).index(case), rows, d, f, len(sizes), dtype)
    if dtype == "bfloat16":
        ct_RF = ct_RF.astype(jnp.bfloat16).astype(jnp.float32)   # the cotangent the kernel sees
    got = _fwd_and_grads(x_RD, w_EDF, jnp.asarray(sizes, jnp.int32), ct_RF, kernel=kernel, block_size=block_size)
    want = reference_gmm(x_RD.astype(jnp.float32), w_EDF.astype(jnp.float32), sizes, ct_RF)
    for name, g, wnt in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == jnp.dtype(dtype), f"{kernel}/{case}/{dtype}: {name} has dtype {g.dtype}"
        tol = TOL[dtype] * max(np.abs(wnt).max(), 1.0)
        np.testing.assert_allclose(np.asarray(g, np.float64), wnt, rtol=TOL[dtype], atol=tol,
                                   err_msg=f"{kernel}/{case}/{dtype}: {name}")
    total = sum(sizes)
    if total < rows:   # padding rows: exactly zero, not merely small
        np.testing.assert_array_equal(np.asarray(got[0][total:], np.float32), 0.0, err_msg=f"{kernel}/{case}: y pad")
        np.testing.assert_array_equal(np.asarray(got[1][total:], np.float32), 0.0, err_msg=f"{kernel}/{case}: dx pad")


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_finite_padding_rows_are_ignored(kernel):
    """A receive buffer's unused rows may hold anything: NaN in x or inf in the cotangent must not leak."""
    sizes = [20, 0, 37, 30]   # rows 87.. are padding
    x_RD, w_EDF, ct_RF = _inputs(7, 100, 16, 24, 4, "float32")
    got = _fwd_and_grads(x_RD.at[87:].set(jnp.nan), w_EDF, jnp.asarray(sizes, jnp.int32), ct_RF.at[87:].set(jnp.inf),
                         kernel=kernel, block_size=16)
    want = reference_gmm(x_RD, w_EDF, sizes, ct_RF)
    for name, g, wnt in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(g, wnt, rtol=2e-5, atol=2e-5 * np.abs(wnt).max(), err_msg=f"{kernel}: {name}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_new_group_sizes_do_not_recompile(kernel):
    """Group sizes are traced: four routings, one trace and one compiled program, each result right."""
    traces = []

    @jax.jit
    def fwd(x_RD, w_EDF, group_sizes_E):
        traces.append(1)   # runs only while tracing
        return grouped_matmul(x_RD, w_EDF, group_sizes_E, kernel=kernel, block_size=32)

    x_RD, w_EDF, ct_RF = _inputs(0, 100, 16, 8, 4, "float32")
    for sizes in ([25, 25, 25, 25], [0, 100, 0, 0], [3, 0, 40, 50], [0, 0, 0, 0]):
        y_RF = fwd(x_RD, w_EDF, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(y_RF, reference_gmm(x_RD, w_EDF, sizes, ct_RF)[0], rtol=2e-5, atol=2e-5,
                                   err_msg=f"{kernel}: sizes {sizes}")
    assert len(traces) == 1, f"{kernel}: traced {len(traces)} times for 4 group-size vectors"
    assert fwd._cache_size() == 1, f"{kernel}: {fwd._cache_size()} compiled programs"


@pytest.mark.parametrize("kernel", KERNELS)
def test_remat_inside_scan_over_layers(kernel):
    """Two layers h <- tanh(gmm(h, w_l)) under lax.scan with jax.checkpoint, as the model scans its layers."""
    sizes = [40, 0, 57, 23]   # 120 of 128 rows: the last 8 are padding
    x_RD, _, _ = _inputs(3, 128, 32, 32, 4, "float32")
    w_LEDF = jnp.asarray(np.random.default_rng(4).normal(size=(2, 4, 32, 32)) / np.sqrt(32), jnp.float32)
    group_sizes_E = jnp.asarray(sizes, jnp.int32)

    def loss(x_RD, w_LEDF, group_sizes_E, layer):
        def step(h_RD, w_EDF):
            return jnp.tanh(layer(h_RD, w_EDF, group_sizes_E)), None
        h_RD, _ = jax.lax.scan(jax.checkpoint(step), x_RD, w_LEDF)
        return jnp.sum(h_RD * jnp.cos(jnp.arange(h_RD.size, dtype=jnp.float32).reshape(h_RD.shape)))

    def kernel_layer(h, w, gs):
        return grouped_matmul(h, w, gs, kernel=kernel, block_size=32)

    got = jax.jit(jax.value_and_grad(lambda x, w, gs: loss(x, w, gs, kernel_layer), argnums=(0, 1)))(
        x_RD, w_LEDF, group_sizes_E)
    want = jax.value_and_grad(lambda x, w: loss(x, w, None, lambda h, w, _: reference_gmm_jnp(h, w, sizes)),
                              argnums=(0, 1))(x_RD, w_LEDF)
    for name, g, wnt in zip(("loss", "dx", "dw"), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, wnt, rtol=2e-5, atol=2e-5 * max(np.abs(wnt).max(), 1.0),
                                   err_msg=f"{kernel}: {name} under remat + scan")
    np.testing.assert_array_equal(got[1][0][120:], 0.0, err_msg=f"{kernel}: dx of padding rows under remat + scan")


@pytest.mark.parametrize("kernel", KERNELS)
def test_inside_shard_map(kernel):
    """Rows (and their group sizes) sharded over 8 devices with replicated weights, whose gradient is then
    summed over the shards; and replicated rows with weights sharded over F."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    rows, num_experts = 40, 4
    x_RD, w_EDF, ct_RF = _inputs(5, 8 * rows, 16, 24, num_experts, "float32")
    sizes_SE = np.random.default_rng(6).multinomial(33, np.full(num_experts, 0.25), size=8)   # 7 pad rows each

    def run(in_specs, out_spec, x_RD, w_EDF, group_sizes_E, ct_RF):
        body = jax.shard_map(lambda x, w, gs: grouped_matmul(x, w, gs, kernel=kernel, block_size=16),
                             mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        y_RF, vjp = jax.vjp(lambda x, w: body(x, w, group_sizes_E), x_RD, w_EDF)
        return (y_RF, *vjp(ct_RF))

    run = jax.jit(run, static_argnums=(0, 1))
    got = run((P("x"), P(), P("x")), P("x"), x_RD, w_EDF, jnp.asarray(sizes_SE.reshape(-1)), ct_RF)
    parts = [reference_gmm(x_RD[s * rows:(s + 1) * rows], w_EDF, sizes_SE[s], ct_RF[s * rows:(s + 1) * rows])
             for s in range(8)]
    want = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), sum(p[2] for p in parts))
    for name, g, wnt in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(g, wnt, rtol=2e-5, atol=1e-4, err_msg=f"{kernel}: rows sharded, {name}")

    got = run((P(), P(None, None, "x"), P()), P(None, "x"), x_RD, w_EDF, jnp.asarray(sizes_SE[0]), ct_RF)
    want = reference_gmm(x_RD, w_EDF, sizes_SE[0], ct_RF)
    for name, g, wnt in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(g, wnt, rtol=2e-5, atol=1e-4, err_msg=f"{kernel}: weights sharded, {name}")


def test_auto_picks_block_sparse_on_cpu():
    x_RD, w_EDF, _ = _inputs(0, 64, 8, 8, 2, "float32")
    jaxpr = str(jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, jnp.asarray([30, 30]), kernel="auto"))(x_RD, w_EDF))
    assert jax.default_backend() == "cpu"
    assert "ragged_dot" not in jaxpr and "while" in jaxpr, f"auto on CPU did not give block_sparse:\n{jaxpr}"


def test_unknown_kernel_is_a_value_error_naming_the_choices():
    x_RD, w_EDF, _ = _inputs(0, 8, 4, 4, 2, "float32")
    with pytest.raises(ValueError, match=r"'megablox'.*auto, ragged_dot, block_sparse"):
        grouped_matmul(x_RD, w_EDF, jnp.asarray([4, 4]), kernel="megablox")

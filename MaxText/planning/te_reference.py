"""Reference kernels behind Transformer Engine's primitives: TE's own Python executes on CPU.

te_trace puts a stand-in in place of TE's compiled extension, so TE's Python traces but stops at its first
FFI call. `install()` then registers, for the CPU platform, a pure-JAX lowering of TE's inner primitives:
everything TE does in Python around them (custom VJPs, quantizer sets, scale bookkeeping, partitioning
rules, group-size handling) runs for real, and each kernel computes what TE's C++ computes, read from its
sources (the transformer_engine_jax 2.20.2 sdist, csrc/extensions: gemm.cpp GroupedGemmFFI, quantization.cpp
GroupedQuantizeFFI; TE main @ d0067d0 common/fused_router for the router). Each reference returns exactly
the avals TE's abstract eval promises (checked), fills what the kernel leaves unwritten with NaN, and turns
a condition on which the kernel raises (sum(group_sizes) != rows on the V1 path) into an all-NaN result, so
no misuse passes unseen in the numbers.

Primitives without a reference keep TE's own lowering and stop at "No FFI handler registered", as under
te_trace alone. For the tests only (the preflight's lowering keeps te_trace's FFI stop), never for a
training run.

Kernels covered (TE primitive -> reference):
    GroupedGemmPrimitive (V1 nvte_multi_tensor_gemm, V2 nvte_grouped_gemm): no scaling, tensor scaling
        (delayed, current) and MXFP8 (1x32 blocks, E8M0 scales)
    GroupedQuantizePrimitive (V1 GroupedQuantizeFFI; V2 nvte_group_quantize, MXFP8 at SM 100 with 128-row
        multiples): tensor scaling and MXFP8, rowwise / colwise / both
    GroupedGemmCopySizesPrimitive: the group sizes themselves
    GemmPrimitive (GemmV2FFI, nvte_cublas_gemm_v2): the dense GEMM, no scaling, tensor scaling, MXFP8, NVFP4
        (alpha: the tensor scales), bias
    BaseDBiasQuantizePrimitive (DBiasQuantizeFFI; DBiasQuantizePrimitive and QuantizePrimitive bind it): tensor
        scaling and MXFP8, rowwise / colwise / both, the bias gradient; NVFP4 1D and 2D (TE main @ d0067d0
        jax/csrc/extensions/quantization.cpp, common/cast/nvfp4), with the Hadamard transform on the colwise copy
        and stochastic rounding
    RHTAmaxCalculationPrimitive (nvte_hadamard_transform_amax): the amax and the post-RHT amax
The layouts the references read and write, as TE's C++ and Python lay out grouped operands and their
scales (with what that costs, such as TE 2.20's tensor-scale misread after an empty expert): te_layouts.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.planning import te_layouts as layouts, te_trace

REFERENCES = {}  # TE primitive class name -> reference(*operands, **params) -> outputs (TE's avals)


def reference(name: str):
    def register(fn):
        REFERENCES[name] = fn
        return fn
    return register


def install(overrides: dict | None = None) -> None:
    """Registers every reference (or `overrides[name]` in its place: the mutation tests) as the CPU lowering
    of its TE primitive; the rest keep TE's lowering. te_trace.install must have run. Process-wide, like
    JAX's lowering table; `uninstall` goes back to TE's lowerings."""
    from jax.interpreters import mlir  # noqa: PLC0415

    if te_trace.installed() is None:
        raise RuntimeError("te_reference: call te_trace.install(sm) first (TE's Python over the stand-in)")
    chosen = {**REFERENCES, **(overrides or {})}

    def rule(cls):
        fn = chosen.get(cls.__name__)
        return None if fn is None else mlir.lower_fun(_checked(cls, fn), cls.multiple_results)

    te_trace.register_cpu_lowerings(rule)


def uninstall() -> None:
    """TE's own lowerings on CPU again (compiling stops at the first FFI call)."""
    te_trace.register_cpu_lowerings()


def _checked(cls, fn):
    """fn, held to the avals of cls.abstract for the same operands and parameters. A reference returns the
    outputs that carry values; the ones after them are scratch workspaces the kernel uses, given as zeros."""

    def lowered(*args, **params):
        want = cls.abstract(*(jax.typeof(a) for a in args), **params)
        wants = tuple(want) if cls.multiple_results else (want,)
        got = fn(*args, **params)
        outs = tuple(got) if cls.multiple_results else (got,)
        outs += tuple(jnp.zeros(w.shape, w.dtype) for w in wants[len(outs):])
        for i, (o, w) in enumerate(zip(outs, wants, strict=True)):
            if (tuple(o.shape), o.dtype) != (tuple(w.shape), w.dtype):
                raise AssertionError(f"te_reference {cls.__name__} output {i}: {o.shape} {o.dtype}, TE's abstract "
                                     f"eval says {w.shape} {w.dtype}")
        return outs if cls.multiple_results else outs[0]

    return functools.wraps(fn)(lowered)


def _sm() -> int:
    return te_trace.installed().sm


def _nan(shape, dtype):
    """What an unwritten buffer holds, as far as a test can tell: NaN (0 for types without one)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.full(shape, jnp.nan, dtype)
    return jnp.zeros(shape, dtype)


# ------------------------------------------------------------------------------------------- grouped GEMM


def _scaling(scaling_mode) -> str:
    from transformer_engine.jax.quantize import ScalingMode  # noqa: PLC0415

    mode = ScalingMode(scaling_mode)
    if mode == ScalingMode.NO_SCALING:
        return "none"
    if mode.is_tensor_scaling():
        return "tensor"
    if mode == ScalingMode.MXFP8_1D_SCALING:
        return "mxfp8"
    if mode.is_nvfp4_scaling:
        return "nvfp4"
    raise NotImplementedError(f"te_reference: no reference for {mode}")


@reference("GroupedGemmCopySizesPrimitive")
def copy_sizes(group_sizes, *, num_gemms):
    del num_gemms
    return group_sizes


@reference("GroupedGemmPrimitive")
def grouped_gemm(lhs, lhs_sinv, rhs, rhs_sinv, bias, lhs_first, lhs_last, rhs_first, rhs_last, out_first, out_last,
                 *extra, lhs_is_trans, rhs_is_trans, scaling_mode, out_dtype, has_bias, use_async_d2h_group_sizes,
                 use_v2_ffi, lhs_axis_boundary, rhs_axis_boundary, out_shape, lhs_left_size, lhs_right_size,
                 rhs_left_size, rhs_right_size):
    """GroupedGemmFFI (V1) and the V2 graph-safe GEMM: out = op(lhs_g) @ op(rhs_g) per group, in float32.

    V1 (gemm.cpp GroupedGemmFFI): k = lhs_is_trans ? lhs_left : lhs_right. Ragged rhs (the weight gradient):
    group g's lhs block is [k_g, m] (lhs_is_trans) or [m, k_g], its rhs block [n, k_g] (rhs_is_trans) or
    [k_g, n], each stored contiguously, out[g] = [m, n]. Otherwise lhs is [m_g, k] rows, rhs [G, n, k] or
    [G, k, n], out [M, n]. sum(group sizes) must be the ragged extent (else it raises: all-NaN here), an
    empty group's output is zeroed, FP8 on SM < 100 must be NT. Tensor scales: te_layouts.py.
    V2 (nvte_grouped_gemm): the same products; the groups may stop short of the buffer (rows past them are
    not written: NaN), alpha scales each group. MXFP8 (both paths): each operand dequantized from its 32-element
    blocks (te_layouts.py), the contraction in float32; V1 moves the block-scale pointers past empty GEMMs too.
    """
    del bias, out_first, out_last, lhs_axis_boundary, rhs_axis_boundary, use_async_d2h_group_sizes
    if has_bias:
        raise NotImplementedError("te_reference: grouped GEMM bias")
    scaling = _scaling(scaling_mode)
    fp8 = jnp.dtype(lhs.dtype).itemsize == 1
    if not use_v2_ffi and fp8 and _sm() < 100 and not (not lhs_is_trans and rhs_is_trans):
        raise ValueError("te_reference: for SM90 and FP8 input only NT GEMM is supported (TE's GroupedGemmFFI "
                         f"check), got lhs_is_trans={lhs_is_trans}, rhs_is_trans={rhs_is_trans}")
    rhs_ragged = rhs_first.size > 0 or rhs_last.size > 0
    sizes = next(s for s in (lhs_first, lhs_last, rhs_first, rhs_last) if s.size > 0).astype(jnp.int32)
    num_gemms = sizes.shape[0]
    k = lhs_left_size if lhs_is_trans else lhs_right_size
    m = lhs_right_size if lhs_is_trans else lhs_left_size
    hi = jax.lax.Precision.HIGHEST
    if rhs_ragged:
        n = rhs_left_size if rhs_is_trans else rhs_right_size
        a, b = _ragged_k_operands(lhs, lhs_sinv, rhs, rhs_sinv, sizes, (k, m, n), lhs_is_trans, rhs_is_trans, scaling)
        g_of_k = layouts.group_of_rows(sizes, k)
        # Rows past the groups are not read (V2: the groups may stop short of the buffer, as TE's fused MoE block
        # leaves NCCL EP's uninitialized tail there): where, not a multiply by the one-hot, so garbage stays out.
        a, b = (jnp.where((g_of_k < num_gemms)[:, None], v, 0.0) for v in (a, b))
        onehot = (g_of_k[:, None] == jnp.arange(num_gemms)[None, :]).astype(jnp.float32)
        out = jnp.einsum("km,kn,kg->gmn", a, b, onehot, precision=hi)
        ragged_extent = k
    else:
        n = rhs_left_size // num_gemms if rhs_is_trans else rhs_right_size
        if lhs_is_trans:
            raise NotImplementedError("te_reference: grouped GEMM with a transposed ragged-row lhs")
        a, w = _ragged_m_operands(lhs, lhs_sinv, rhs, rhs_sinv, sizes, (m, k, n), rhs_is_trans, scaling)
        g_of_row = layouts.group_of_rows(sizes, m)
        gc = jnp.minimum(g_of_row, num_gemms - 1)
        per_group = jnp.einsum("mk,gkn->mgn", a, w, precision=hi)
        out = jnp.take_along_axis(per_group, gc[:, None, None], axis=1)[:, 0, :]
        out = jnp.where((g_of_row < num_gemms)[:, None], out, jnp.nan)  # rows past the groups: not written
        ragged_extent = m
    if use_v2_ffi:
        alpha = extra[0].astype(jnp.float32)
        alpha_g = jnp.broadcast_to(alpha, (num_gemms,))
        out = out * (alpha_g[:, None, None] if rhs_ragged else alpha_g[gc][:, None])
    else:
        out = jnp.where(jnp.sum(sizes) == ragged_extent, out, jnp.nan)  # V1 raises on this
    return (out.astype(out_dtype).reshape(out_shape),)  # the workspaces: _checked


def _ragged_k_operands(lhs, lhs_sinv, rhs, rhs_sinv, sizes, kmn, lhs_is_trans, rhs_is_trans, scaling):
    """A ragged contraction (the weight gradient): the float32 [k, m] and [k, n] matrices the operands stand for,
    their k rows group after group."""
    k, m, n = kmn
    if scaling == "mxfp8":  # both operands' colwise copies (x's order), blocks down the ragged k rows
        if not lhs_is_trans or rhs_is_trans:
            raise NotImplementedError("te_reference: MXFP8 grouped GEMM with a ragged rhs in this layout")
        return (layouts.mx_dequantize(lhs, lhs_sinv, sizes, k, m, colwise=True),
                layouts.mx_dequantize(rhs, rhs_sinv, sizes, k, n, colwise=True))
    a = lhs.reshape(k, m) if lhs_is_trans else layouts.block_transposed_rows(lhs, sizes, k, m)
    b = layouts.block_transposed_rows(rhs, sizes, k, n) if rhs_is_trans else rhs.reshape(k, n)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if scaling == "tensor":  # both operands quantized with these group sizes: compacted scales on both
        j = layouts.compacted_index(sizes)[jnp.minimum(layouts.group_of_rows(sizes, k), sizes.shape[0] - 1)]
        a, b = a * lhs_sinv[j][:, None], b * rhs_sinv[j][:, None]
    return a, b


def _ragged_m_operands(lhs, lhs_sinv, rhs, rhs_sinv, sizes, mkn, rhs_is_trans, scaling):
    """Ragged rows (forward, data gradient): the float32 [m, k] rows and [G, k, n] experts the operands stand for."""
    m, k, n = mkn
    num_gemms = sizes.shape[0]
    if scaling == "mxfp8":  # lhs rowwise (blocks along k); each expert's weights blocked along k too
        a = layouts.mx_dequantize(lhs, lhs_sinv, sizes, m, k, colwise=False)
        rows_e, cols_e = (n, k) if rhs_is_trans else (k, n)
        w = layouts.mx_dequantize(rhs, rhs_sinv, jnp.full((num_gemms,), rows_e, jnp.int32), num_gemms * rows_e, cols_e,
                           colwise=not rhs_is_trans)
    else:
        a, w = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    a = a.reshape(m, k)
    w = w.reshape(num_gemms, n, k).transpose(0, 2, 1) if rhs_is_trans else w.reshape(num_gemms, k, n)
    if scaling == "tensor":
        # lhs: quantized with these group sizes (compacted). rhs: quantized per expert (all present), read with
        # the pointer that the V1 loop advances only past non-empty GEMMs.
        index = layouts.compacted_index(sizes)
        a = a * lhs_sinv[index[jnp.minimum(layouts.group_of_rows(sizes, m), num_gemms - 1)]][:, None]
        w = w * rhs_sinv[index][:, None, None]
    return a, w


# ------------------------------------------------------------------------------------------- grouped quantize


@reference("GroupedQuantizePrimitive")
def grouped_quantize(x, scale, group_sizes, *, out_dtype, scaling_mode, q_layout, flatten_axis, scale_dtype):
    """GroupedQuantizeFFI (V1), tensor scaling: group g's rows (group_sizes[g] x the non-group dims before
    flatten_axis) cast as x * scale[g] to the FP8 type, saturating; rowwise data in x's order, colwise data
    each group's block transposed; scale_inv = 1 / scale and amax = max|x| of each non-empty group, compacted
    (te_layouts.py), the rest unwritten. The colwise scale_inv is not written (TE's Python reads the rowwise
    one for tensor scaling). sum(group_sizes) must be the rows or x's first dim (else it raises: all NaN)."""
    eff = flatten_axis if flatten_axis >= 0 else flatten_axis + x.ndim
    rows, cols = int(np.prod(x.shape[:eff])), int(np.prod(x.shape[eff:]))
    unit = int(np.prod(x.shape[1:eff])) if eff > 1 else 1
    sizes = group_sizes.astype(jnp.int32)
    row_sizes = sizes * unit
    if _scaling(scaling_mode) == "mxfp8":
        return _grouped_quantize_mxfp8(x, sizes, row_sizes, rows, cols, out_dtype=out_dtype, scaling_mode=scaling_mode,
                                       q_layout=q_layout, flatten_axis=flatten_axis)
    if _scaling(scaling_mode) != "tensor":
        raise NotImplementedError("te_reference: grouped quantize without scaling")
    num_groups = sizes.shape[0]
    g = jnp.minimum(layouts.group_of_rows(row_sizes, rows), num_groups - 1)
    x2 = x.reshape(rows, cols).astype(jnp.float32)
    fp8_max = float(jnp.finfo(out_dtype).max)
    q = jnp.clip(x2 * scale[g][:, None], -fp8_max, fp8_max).astype(out_dtype)
    ok = (jnp.sum(sizes) == rows) | (jnp.sum(sizes) == x.shape[0])
    q = jnp.where(ok, q, jnp.nan).astype(out_dtype)
    nonempty = sizes > 0
    slot = jnp.where(nonempty, layouts.compacted_index(sizes), num_groups)  # empty groups write nothing
    scale_inv = _nan((num_groups,), jnp.float32).at[slot].set(1.0 / scale, mode="drop")
    group_amax = jax.ops.segment_max(jnp.max(jnp.abs(x2), axis=1), g, num_segments=num_groups)
    amax = _nan((num_groups,), jnp.float32).at[slot].set(group_amax, mode="drop")
    rowwise = q.reshape(-1) if q_layout.has_rowwise else _nan((1,), out_dtype)
    colwise = layouts.to_block_transposed(q, row_sizes) if q_layout.has_colwise else _nan((1,), out_dtype)
    row_sinv = scale_inv.astype(scale_dtype) if q_layout.has_rowwise else _nan((1,), scale_dtype)
    col_sinv = _nan((num_groups,), scale_dtype) if q_layout.has_colwise else _nan((1,), scale_dtype)
    return rowwise, colwise, row_sinv, col_sinv, amax  # the workspace: _checked


def _grouped_quantize_mxfp8(x, sizes, row_sizes, rows, cols, *, out_dtype, scaling_mode, q_layout, flatten_axis):
    """Grouped MXFP8 quantize, V1 (GroupedQuantizeFFI, one nvte_quantize per non-empty group) or V2
    (nvte_group_quantize; TE's Python picks it at SM 100 when every dimension is a multiple of 128): the data in
    x's order, E8M0 block scales in the grouped, padded, GEMM-ready layout (te_layouts.py), a 32-multiple of rows in
    every group for the colwise copy and cols a multiple of 32 (else the kernel raises: all NaN here). The amax
    output is written for tensor scaling only (NaN). V1: sum(group_sizes) must be the rows or x's first dim; V2:
    rows past the groups are not written (NaN), nor their scales."""
    from transformer_engine.jax.cpp_extensions.quantization import GroupedQuantizePrimitive  # noqa: PLC0415
    from transformer_engine.jax.quantize import ScalingMode  # noqa: PLC0415

    v2 = GroupedQuantizePrimitive._use_v2_kernel(scaling_mode, x.shape, flatten_axis)
    row_room, col_room = (int(np.prod(shape)) for shape in ScalingMode(scaling_mode).get_grouped_scale_shape_2x(
        x.shape, sizes.shape[0], is_padded=True, flatten_axis=flatten_axis))
    x2 = x.reshape(rows, cols).astype(jnp.float32)
    # V1 checks that the groups fill the buffer; V2 (GroupedQuantizeV2FFI) does not: its groups may stop short,
    # the rows past them neither read nor written (as TE's fused MoE block leaves NCCL EP's tail).
    ok = (v2 | (jnp.sum(sizes) == rows) | (jnp.sum(sizes) == x.shape[0])) & (cols % layouts.MX_BLOCK == 0)
    if q_layout.has_colwise:
        ok &= jnp.all(row_sizes % layouts.MX_BLOCK == 0) & (rows % layouts.MX_BLOCK == 0)
    x2 = jnp.where(ok & (jnp.arange(rows) < jnp.sum(row_sizes))[:, None], x2, jnp.nan)
    unwritten_data, unwritten_scales = _nan((1,), out_dtype), _nan((1,), jnp.float8_e8m0fnu)
    rowwise, row_sinv = (layouts.mx_quantize(x2, row_sizes, out_dtype, False, row_room, v2) if q_layout.has_rowwise
                         else (unwritten_data, unwritten_scales))
    colwise, col_sinv = (layouts.mx_quantize(x2, row_sizes, out_dtype, True, col_room, v2) if q_layout.has_colwise
                         else (unwritten_data, unwritten_scales))
    return rowwise, colwise, row_sinv, col_sinv, _nan((sizes.shape[0],), jnp.float32)  # the workspace: _checked


# ------------------------------------------------------------------------------------------- dense GEMM


def _dense_operand(data, scale_inv, scaling: str, flatten_axis: int, colwise: bool):
    """The float32 array a dense GEMM operand stands for: as is, times its tensor scale_inv, or MXFP8 blocks
    (the swizzled scales GemmPrimitive's impl hands its kernel: one group, layouts.mx_scale_positions' layout)."""
    if scaling == "none":
        return data.astype(jnp.float32)
    if scaling == "tensor":
        return data.astype(jnp.float32) * scale_inv.reshape(-1)[0]
    rows, cols = int(np.prod(data.shape[:flatten_axis])), int(np.prod(data.shape[flatten_axis:]))
    one_group = jnp.array([rows], jnp.int32)
    return layouts.mx_dequantize(data, scale_inv, one_group, rows, cols, colwise).reshape(data.shape)


def _nvfp4_gemm(lhs, lhs_sinv, lhs_c, rhs, rhs_sinv, rhs_c):
    """lhs . rhs of two NVFP4 operands before alpha: each [free, contracting] times its blocks' scales (the 16-element
    blocks run along the contracting dims, which TE's Python puts last in both: NVFP4 GEMMs are TN)."""
    def blocks(data, sinv, contract):
        axis = data.ndim - len(contract)
        if tuple(contract) != tuple(range(axis, data.ndim)):
            raise NotImplementedError(f"te_reference: NVFP4 GEMM contracting dims {contract} not last of {data.shape}")
        data2 = data.reshape(int(np.prod(data.shape[:axis])), -1)
        return layouts.nv_blocks(data2, sinv.reshape(int(np.prod(sinv.shape[:axis])), -1))

    a, b = blocks(lhs, lhs_sinv, lhs_c), blocks(rhs, rhs_sinv, rhs_c)
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*lhs.shape[:lhs.ndim - len(lhs_c)], *rhs.shape[:rhs.ndim - len(rhs_c)])


@reference("GemmPrimitive")
def gemm(lhs, lhs_sinv, rhs, rhs_sinv, bias, alpha, beta, *, out_dtype, contracting_dims, scaling_mode,
         use_split_accumulator, transpose_batch_sequence, sequence_dim, is_outer, collective_op):
    """GemmV2FFI (gemm.cpp, nvte_cublas_gemm_v2): out = lhs . rhs over contracting_dims (lhs's free dims, then
    rhs's), in float32, plus the bias when one is given. NVFP4: alpha (the two tensor scales) times the product of
    the operands' blocks (beta, 0 here, adds the unwritten output: ignored).
    The operands are dequantized as they are handed over: tensor scaling by their one scale_inv, MXFP8 by the
    blocks along the contracting dims (the lhs's colwise copy when it contracts its leading dims, the rhs's
    when it contracts its trailing ones; gemm.py GemmPrimitive.impl). No collective GEMM."""
    from transformer_engine.jax.cpp_extensions.gemm import _get_gemm_layout, sanitize_dims  # noqa: PLC0415

    del use_split_accumulator, transpose_batch_sequence, sequence_dim, is_outer, beta
    if not collective_op.is_none:
        raise NotImplementedError("te_reference: collective (all-gather / reduce-scatter) GEMM")
    scaling = _scaling(scaling_mode)
    lhs_c, rhs_c = (tuple(sanitize_dims(a.ndim, d)) for a, d in zip((lhs, rhs), contracting_dims))
    if scaling == "nvfp4":
        out = _nvfp4_gemm(lhs, lhs_sinv, lhs_c, rhs, rhs_sinv, rhs_c) * alpha.reshape(-1)[0]
        if bias.size > 0:
            out = out + bias.astype(jnp.float32)
        return (out.astype(out_dtype),)
    lhs_t, rhs_t = _get_gemm_layout((lhs.ndim, rhs.ndim), (lhs_c, rhs_c))
    a = _dense_operand(lhs, lhs_sinv, scaling, max(lhs_c) + 1 if lhs_t else min(lhs_c), colwise=lhs_t)
    b = _dense_operand(rhs, rhs_sinv, scaling, min(rhs_c) if rhs_t else max(rhs_c) + 1, colwise=not rhs_t)
    out = jax.lax.dot_general(a, b, ((lhs_c, rhs_c), ((), ())), precision=jax.lax.Precision.HIGHEST)
    if bias.size > 0:
        out = out + bias.astype(jnp.float32)
    return (out.astype(out_dtype),)  # the workspace: _checked


@reference("BaseDBiasQuantizePrimitive")  # DBiasQuantizePrimitive and QuantizePrimitive bind its inner primitive
def quantize(x, scale, amax, sr_rng_state, post_rht_amax, rht_matrix, *, out_dtype, scaling_mode, q_layout,
             flatten_axis, scale_dtype, is_dbias, is_outer, stochastic_rounding, use_rht):
    """DBiasQuantizeFFI (nvte_quantize / nvte_quantize_dbias) on x seen as [rows, cols] split at flatten_axis.
    Tensor scaling: x * scale cast (saturating), the colwise copy transposed at flatten_axis where TE's layout
    says so, scale_inv = 1 / scale in the rowwise buffer (the colwise one unwritten), amax = max(amax, max|x|).
    MXFP8: layouts.mx_quantize in the dense layout, amax passed through. dbias: x summed over the rows, in x's dtype.
    NVFP4: _nvfp4_quantize."""
    from transformer_engine.jax.quantize import ScalingMode  # noqa: PLC0415

    mode, scaling = ScalingMode(scaling_mode), _scaling(scaling_mode)
    if scaling == "nvfp4":
        return _nvfp4_quantize(x, amax, sr_rng_state, post_rht_amax, rht_matrix, mode=mode, out_dtype=out_dtype,
                               q_layout=q_layout, flatten_axis=flatten_axis, scale_dtype=scale_dtype,
                               is_outer=is_outer, stochastic_rounding=stochastic_rounding, use_rht=use_rht)
    eff = flatten_axis % x.ndim
    rows, cols = int(np.prod(x.shape[:eff])), int(np.prod(x.shape[eff:]))
    x2 = x.reshape(rows, cols).astype(jnp.float32)
    row_shape, col_shape = mode.get_scale_shape_2x(x.shape, is_padded=not is_outer, flatten_axis=flatten_axis,
                                                   broadcast_2d_scale_shape_to_1d=True)
    col_data_shape = x.shape[eff:] + x.shape[:eff] if mode.is_colwise_transposed else x.shape
    if scaling == "tensor":
        fp8_max = float(jnp.finfo(out_dtype).max)
        q = jnp.clip(x2 * scale.reshape(-1)[0], -fp8_max, fp8_max).astype(out_dtype)
        row = (q, jnp.full(row_shape, 1.0 / scale.reshape(-1)[0], jnp.float32).astype(scale_dtype))
        col = (q.T if mode.is_colwise_transposed else q, _nan(col_shape, scale_dtype))
        new_amax = jnp.maximum(amax, jnp.max(jnp.abs(x2)))
    elif scaling == "mxfp8":
        row, col = (layouts.mx_quantize(x2, None, out_dtype, colwise, int(np.prod(shape)), False, plain=True)
                    for colwise, shape in ((False, row_shape), (True, col_shape)))
        new_amax = amax
    else:
        raise NotImplementedError("te_reference: quantize without scaling")
    # TE's abstract eval keeps the rowwise scale_inv's shape without a rowwise copy (tensor scaling writes its
    # one scale_inv there for either copy); a missing copy is one unwritten element.
    rowwise = row[0].reshape(x.shape) if q_layout.has_rowwise else _nan((1,), out_dtype)
    row_sinv = (row[1].reshape(row_shape) if q_layout.has_rowwise or scaling == "tensor"
                else _nan(row_shape, scale_dtype))
    colwise, col_sinv = ((col[0].reshape(col_data_shape), col[1].reshape(col_shape)) if q_layout.has_colwise
                         else (_nan((1,), out_dtype), _nan((1,), scale_dtype)))
    dbias = jnp.sum(x2, axis=0).astype(x.dtype).reshape(x.shape[eff:]) if is_dbias else _nan((1,), x.dtype)
    return rowwise, colwise, row_sinv, col_sinv, new_amax, dbias  # the workspace: _checked


RHT_SIZE = 16  # the random Hadamard transform's block: 16 consecutive elements of a row


def _sr_key(sr_rng_state):
    """A JAX key from this shard's stochastic-rounding state (its first 4 uint32s; TE's partitioner hands each
    shard its own row) as TE's pure-JAX quantizer makes it (quantizer.py NVFP4Quantizer), which then draws one
    uniform per element of each copy. The GPU kernel draws its bits with Philox from the same state: the same
    probabilities, not the same bits."""
    words = sr_rng_state.reshape(-1)[:4]
    return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(words[:2]), words[2]), words[3])


def _nvfp4_quantize(x, amax, sr_rng_state, post_rht_amax, rht_matrix, *, mode, out_dtype, q_layout, flatten_axis,
                    scale_dtype, is_outer, stochastic_rounding, use_rht):
    """DBiasQuantizeFFI for NVFP4 (quantization.cpp; layouts.nv_quantize): the rowwise copy against `amax` (TE's
    Python computes it first); the colwise copy is x transposed at flatten_axis, against the same amax, or with
    use_rht (nvte_hadamard_transform_cast_fusion_columnwise) each 16 consecutive elements of its rows (x's
    columns) times the 16 x 16 RHT matrix, against the post-RHT amax. 2D scaling (weights): 16 x 16 tiles.
    Stochastic rounding where asked. The amax comes back as given (the FFI aliases it); no dbias (TE's Python
    computes NVFP4's in JAX)."""
    eff = flatten_axis % x.ndim
    rows, cols = int(np.prod(x.shape[:eff])), int(np.prod(x.shape[eff:]))
    x2 = x.reshape(rows, cols).astype(jnp.float32)
    row_shape, col_shape = mode.get_scale_shape_2x(x.shape, is_padded=not is_outer, flatten_axis=flatten_axis,
                                                   broadcast_2d_scale_shape_to_1d=True)
    two_d = mode.name == "NVFP4_2D_SCALING"

    def padded(shape, axis):
        return int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))

    key = _sr_key(sr_rng_state) if stochastic_rounding else None

    rowwise, row_sinv = _nan((1,), out_dtype), _nan(row_shape, scale_dtype)
    colwise, col_sinv = _nan((1,), out_dtype), _nan((1,), scale_dtype)
    if q_layout.has_rowwise:
        data, scales = layouts.nv_quantize(x2, amax, padded(row_shape, eff), out_dtype, scale_dtype, two_d=two_d,
                                           sr_key=key)
        rowwise, row_sinv = data.reshape(x.shape), scales.reshape(row_shape)
    if q_layout.has_colwise:
        source, col_amax = x2.T, amax
        if use_rht:
            source = (source.reshape(-1, RHT_SIZE) @ rht_matrix.astype(jnp.float32)).reshape(cols, rows)
            col_amax = post_rht_amax
        data, scales = layouts.nv_quantize(source, col_amax, padded(col_shape, x.ndim - eff), out_dtype, scale_dtype,
                                           two_d=two_d, sr_key=key)
        colwise, col_sinv = data.reshape(x.shape[eff:] + x.shape[:eff]), scales.reshape(col_shape)
    return rowwise, colwise, row_sinv, col_sinv, amax, _nan((1,), x.dtype)  # the workspace: _checked


@reference("RHTAmaxCalculationPrimitive")
def rht_amax(x, *, amax_scope, transpose_batch_sequence, rht_matrix_random_sign_mask_t, produce_regular_amax,
             flatten_axis):
    """The RHT amax kernel (nvte_hadamard_transform_amax): max|x| (when asked; else 0) and the largest magnitude of x
    transposed at flatten_axis with each 16 consecutive elements of a row times the RHT matrix: the 16 x 16
    Hadamard matrix / 4 with row i negated where bit i of the sign mask is set, rounded to bf16 as TE's Python
    hands it to the quantize kernel (quantize/hadamard.py)."""
    del amax_scope, transpose_batch_sequence
    eff = flatten_axis % x.ndim
    x2 = x.reshape(int(np.prod(x.shape[:eff])), -1).astype(jnp.float32)
    h = np.array([[1.0]])
    while h.shape[0] < RHT_SIZE:
        h = np.block([[h, h], [h, -h]])
    signs = np.array([-1.0 if rht_matrix_random_sign_mask_t >> i & 1 else 1.0 for i in range(RHT_SIZE)])
    matrix = jnp.asarray(signs[:, None] * h / np.sqrt(RHT_SIZE), jnp.bfloat16).astype(jnp.float32)
    post = jnp.max(jnp.abs(x2.T.reshape(-1, RHT_SIZE) @ matrix)).reshape(1)
    regular = jnp.max(jnp.abs(x2)).reshape(1) if produce_regular_amax else jnp.zeros((1,), jnp.float32)
    return regular, post


# ------------------------------------------------------------------------------------------- fused router

SIGMOID, SOFTMAX, SQRTSOFTPLUS = 0, 1, 2  # TE's score_function codes (JAXX_Score_Function)
EPSILON = 1e-20  # fused_router/utils.h


def _topk_mask(scores, k: int):
    """Boolean [..., E] of the k largest scores of each row (the lower index first on a tie, as a stable sort)."""
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    return jnp.zeros(scores.shape, bool).at[(*jnp.indices(order.shape)[:-1], order)].set(True)


def _unpack(routing_map, num_experts: int):
    """The bool [..., E] routing map, from TE's BYTEMAP (bool) or BITMAP_U8 (experts packed LSB-first, 8 a byte)."""
    if routing_map.dtype == jnp.bool_:
        return routing_map
    bits = (routing_map[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(*routing_map.shape[:-1], -1)[..., :num_experts].astype(bool)


@reference("FusedTopkWithScoreFunctionFwdPrimitive")
def router_forward(logits, expert_bias, *, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                   score_function, compute_aux_scores, routing_map_format):
    """fused_topk_with_score_function_forward (fused_router/fused_topk_with_score_function.cu), per token:
    scores = softmax(logits) (pre-softmax), logits (post-softmax), sigmoid or sqrt(softplus); the bias (sigmoid,
    sqrtsoftplus) added for the choice only; with groups, each group scored by the sum of its top k/group_topk
    and the top group_topk groups kept; the top k chosen; post-softmax takes the softmax over the k chosen
    logits; sigmoid / sqrtsoftplus weights are divided by their sum (+1e-20) when k > 1; probs = scaling_factor
    x weight at the chosen experts, 0 elsewhere. intermediate: the softmax (pre: over all experts; post: over the
    chosen, -inf elsewhere), the sigmoid, or the logits (sqrtsoftplus)."""
    if compute_aux_scores:
        raise NotImplementedError("te_reference: the router's aux-loss scores")
    x = logits.astype(jnp.float32)
    e = x.shape[-1]
    if score_function == SOFTMAX:
        scores = jax.nn.softmax(x, axis=-1) if use_pre_softmax else x
    elif score_function == SIGMOID:
        scores = jax.nn.sigmoid(x)
    else:
        scores = jnp.sqrt(jax.nn.softplus(x))
    biased = scores
    if expert_bias.size == e and score_function != SOFTMAX:
        biased = scores + expert_bias.astype(jnp.float32)
    if group_topk > 0:
        per_group = biased.reshape(*x.shape[:-1], num_groups, e // num_groups)
        group_score = jnp.sum(jax.lax.top_k(per_group, topk // group_topk)[0], axis=-1)
        keep = jnp.repeat(_topk_mask(group_score, group_topk), e // num_groups, axis=-1)
        chosen = _topk_mask(jnp.where(keep, biased, -jnp.inf), topk)
    else:
        chosen = _topk_mask(biased, topk)
    if score_function == SOFTMAX and not use_pre_softmax:
        weights = jax.nn.softmax(jnp.where(chosen, x, -jnp.inf), axis=-1)
        intermediate = jnp.where(chosen, weights, -jnp.inf)
    else:
        weights = scores
        intermediate = x if score_function == SQRTSOFTPLUS else scores
    weights = jnp.where(chosen, weights, 0.0)
    if score_function != SOFTMAX and topk > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + EPSILON)
    probs = (scaling_factor * weights).astype(logits.dtype)
    if int(routing_map_format) == 1:  # BITMAP_U8
        padded = jnp.pad(chosen, [(0, 0)] * (chosen.ndim - 1) + [(0, -e % 8)])
        packed = padded.reshape(*chosen.shape[:-1], -1, 8).astype(jnp.uint8) << jnp.arange(8, dtype=jnp.uint8)
        routing_map = jnp.sum(packed, axis=-1, dtype=jnp.uint8)
    else:
        routing_map = chosen
    return probs, routing_map, intermediate.astype(jnp.float32)


@reference("FusedTopkWithScoreFunctionBwdPrimitive")
def router_backward(routing_map, intermediate, grad_probs, *, topk, use_pre_softmax, scaling_factor,
                    score_function, compute_aux_scores, routing_map_format):
    """fused_topk_with_score_function_backward: the gradient of router_forward's probs with the choice held,
    from its intermediate: through scaling_factor, the k > 1 normalisation (sigmoid, sqrtsoftplus), the softmax
    (post: over the chosen; pre: over all, the unchosen receiving no gradient) and the score function."""
    del routing_map_format  # the map's dtype says which (_unpack)
    if compute_aux_scores:
        raise NotImplementedError("te_reference: the router's aux-loss scores")
    act = intermediate.astype(jnp.float32)
    chosen = _unpack(routing_map, act.shape[-1])
    g = grad_probs.astype(jnp.float32) * scaling_factor
    if score_function == SOFTMAX:
        g = jnp.where(chosen, g, 0.0)
        y = jnp.where(chosen, act, 0.0) if not use_pre_softmax else act
        grad = y * (g - jnp.sum(g * y, axis=-1, keepdims=True))
        grad = jnp.where(chosen, grad, 0.0) if not use_pre_softmax else grad
    else:
        def weights(v):
            w = jnp.where(chosen, v, 0.0)
            return w / (jnp.sum(w, axis=-1, keepdims=True) + EPSILON) if topk > 1 else w

        if score_function == SIGMOID:
            _, vjp = jax.vjp(weights, act)
            grad = vjp(g)[0] * act * (1.0 - act)
        else:
            _, vjp = jax.vjp(lambda x: weights(jnp.sqrt(jax.nn.softplus(x))), act)
            grad = vjp(g)[0]
    return grad.astype(grad_probs.dtype)

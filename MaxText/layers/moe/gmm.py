"""Grouped matrix multiply, the core of dropless MoE: y[r] = x[r] @ w[group(r)].

Layout. The R rows of x_RD are sorted by group: rows [0, gs[0]) use w[0], the next gs[1] rows use w[1], and
so on (R rows, E groups, D in, F out; gs = group_sizes_E). Rows at index >= sum(gs) are padding: they may
hold anything (even NaN), and their outputs and x-gradients are exactly 0, so a caller can hand over a
static worst-case buffer. The group sizes are a traced int32 array: new routings reuse the compiled program.

Why CPU needs its own kernel. XLA:CPU has no grouped kernel: `jax.lax.ragged_dot` lowers there to one dense
dot over a masked [E, R, D] copy of x, i.e. E times the useful FLOPs and memory: 13% of a dense matmul's
speed at E=8, 7% at E=16 (notes/jax_cpu.md sections 1-2), and 784 MiB of temporaries for an
8192x512 @ 8x512x1024 fwd+bwd, against 6 MiB for the kernel here. The `block_sparse` kernel pads every
group (virtually) to a multiple of Z rows and runs one [Z, D] x [D, F] matmul per block with a dynamic expert
index, looping over only the blocks that hold real rows. A custom VJP does the backward in one loop too,
accumulating dW[e] += x_b^T dy_b in place; JAX's own transpose of such a loop would carry a full [E, D, F]
cotangent per block, which the notes measured as slow.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

KERNELS = ("auto", "ragged_dot", "block_sparse")
# Backends where lax.ragged_dot lowers to a native grouped GEMM.
NATIVE_BACKENDS = ("gpu", "tpu", "cuda", "rocm")
# Rows per block of the block_sparse kernel. Small blocks waste less: a group's last block is on average
# half padding, E*Z/2 rows in all (at E=32, Z=512 that doubles the work of 8192 rows). Large blocks make each
# matmul more efficient and the loop shorter. Median fwd+bwd as a fraction of a dense matmul of the same
# useful FLOPs (8192 rows, D=512, F=1024, Zipf-1.0 loads, 2 CPU cores, 15-21 interleaved runs), Z=128/256/512:
#   E=8 f32 78/79/76%, E=32 f32 62/54/40%, E=8 bf16 84/84/75%.
# 128 ties 256 with few experts and wins with many (small groups, where padding dominates); 64 is no better
# (E=32: 56% vs 60% for 128; E=64: 52% vs 50%).
# Rerun with `python -m MaxText.benchmarks.grouped_matmul`.
DEFAULT_BLOCK_SIZE = 128


def grouped_matmul(x_RD, w_EDF, group_sizes_E, *, kernel: str = "auto", block_size: int | None = None):
    """y_RF[r] = x_RD[r] @ w_EDF[e] for the rows r of group e (rows sorted by group); padding rows get 0.

    Args:
      x_RD: [R, D] rows sorted by group; rows at index >= sum(group_sizes_E) are padding.
      w_EDF: [E, D, F] one weight matrix per group; cast to x's dtype (its gradient comes back in its own).
      group_sizes_E: [E] int rows per group, traced (new sizes do not recompile); empty groups allowed.
      kernel: "ragged_dot" (jax.lax.ragged_dot, native on GPU/TPU, an E-times dense fallback on CPU),
        "block_sparse" (the CPU kernel described in the module docstring), or "auto" (ragged_dot on
        GPU/TPU backends, block_sparse elsewhere).
      block_size: rows per block of block_sparse (default DEFAULT_BLOCK_SIZE); ignored by ragged_dot, so
        one setting serves every backend under kernel="auto".

    Returns:
      y_RF in x's dtype, accumulated in float32. Differentiable w.r.t. x and w; group sizes get no gradient.
    """
    if kernel not in KERNELS:
        raise ValueError(f"grouped_matmul: unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if x_RD.ndim != 2 or w_EDF.ndim != 3 or group_sizes_E.shape != w_EDF.shape[:1] or x_RD.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"grouped_matmul: expected x [R, D], w [E, D, F], group_sizes [E]; got x {x_RD.shape}, "
                         f"w {w_EDF.shape}, group_sizes {group_sizes_E.shape}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"grouped_matmul: block_size must be a positive number of rows, got {block_size}")
    if kernel == "auto":
        kernel = "ragged_dot" if jax.default_backend() in NATIVE_BACKENDS else "block_sparse"
    w_EDF = w_EDF.astype(x_RD.dtype)
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if kernel == "ragged_dot":
        y_RF = lax.ragged_dot(x_RD, w_EDF, group_sizes_E, preferred_element_type=jnp.float32)
        return y_RF.astype(x_RD.dtype)
    num_rows = x_RD.shape[0]
    if num_rows == 0:
        return jnp.zeros((0, w_EDF.shape[2]), x_RD.dtype)
    # A block never needs more rows than the array has; this also keeps the Z-row window inside x.
    block = min(block_size or DEFAULT_BLOCK_SIZE, num_rows)
    # Inside shard_map the kernel's loop carries mix x, w and the sizes, so all three must vary over the
    # same mesh axes. Casting here (outside the custom VJP) lets JAX's transpose of the cast psum the
    # gradient of an input that was replicated.
    vma = _vma(x_RD) | _vma(w_EDF) | _vma(group_sizes_E)
    x_RD, w_EDF, group_sizes_E = (cast_varying(a, vma) for a in (x_RD, w_EDF, group_sizes_E))
    return _block_sparse(x_RD, w_EDF, group_sizes_E, block)


def _vma(a) -> frozenset:
    """The shard_map mesh axes `a` varies over (empty outside shard_map)."""
    aval = jax.typeof(a)
    # JAX 0.12 keeps them in aval.manual_axis_type.varying; earlier releases called them aval.vma.
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def cast_varying(a, axes: frozenset):
    missing = tuple(sorted(axes - _vma(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


class BlockLayout(NamedTuple):
    """Which rows each block covers. Block i multiplies rows [start_I[i], end_I[i]) by w[expert_I[i]];
    blocks [0, num_blocks) hold real rows, the rest of the static-length tables are unused."""
    num_blocks: jax.Array   # int32 scalar, traced
    expert_I: jax.Array
    start_I: jax.Array
    end_I: jax.Array


def block_layout(group_sizes_E, num_rows: int, block: int) -> BlockLayout:
    """Split every group into ceil(size / block) blocks of `block` rows (the last one partly padding).

    In a buffer where every group is padded to a multiple of `block`, this is the block -> expert map; the
    buffer itself is never built (the kernel slices x directly). Its static length is the worst case,
    round_up(R + E*(block-1), block) / block blocks; group sizes are clipped so they fit in R rows.
    """
    num_experts = group_sizes_E.shape[0]
    end_E = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_E, 0)), num_rows).astype(jnp.int32)
    start_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_E[:-1]])
    blocks_E = (end_E - start_E + block - 1) // block
    blocks_end_E = jnp.cumsum(blocks_E)
    max_blocks = -(-(num_rows + num_experts * (block - 1)) // block)
    n_I = jnp.arange(max_blocks, dtype=jnp.int32)
    # Unused tail blocks get expert E-1 (clipped) and an empty row range; the loops never reach them.
    expert_I = jnp.minimum(jnp.searchsorted(blocks_end_E, n_I, side="right"), num_experts - 1).astype(jnp.int32)
    start_I = start_E[expert_I] + (n_I - (blocks_end_E - blocks_E)[expert_I]) * block
    end_I = jnp.where(n_I < blocks_end_E[-1], end_E[expert_I], 0)
    return BlockLayout(blocks_end_E[-1], expert_I, start_I, end_I)


def _window(layout: BlockLayout, n, num_rows: int, block: int):
    """Block n's Z-row window of the unpadded array: its first row and the mask of rows it owns.

    The window starts at the block's first row, moved back where it would run past the end of the array;
    rows of the window outside [start, end) belong to a neighbouring group (or are padding) and are masked.
    """
    start, end = layout.start_I[n], layout.end_I[n]
    first = jnp.minimum(start, num_rows - block)
    rows_Z = first + jnp.arange(block, dtype=jnp.int32)
    return first, ((rows_Z >= start) & (rows_Z < end))[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_sparse(x_RD, w_EDF, group_sizes_E, block: int):
    """The block_sparse kernel on validated inputs (same dtype, int32 sizes, 1 <= block <= R)."""
    return _block_sparse_fwd(x_RD, w_EDF, group_sizes_E, block)[0]


def _dot_f32(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _block_sparse_fwd(x_RD, w_EDF, group_sizes_E, block):
    num_rows = x_RD.shape[0]
    layout = block_layout(group_sizes_E, num_rows, block)

    def one_block(n, y_RF):
        first, mine_Z1 = _window(layout, n, num_rows, block)
        x_ZD = lax.dynamic_slice_in_dim(x_RD, first, block)
        w_DF = lax.dynamic_index_in_dim(w_EDF, layout.expert_I[n], keepdims=False)
        y_ZF = _dot_f32(x_ZD, w_DF, ((1,), (0,))).astype(y_RF.dtype)
        # Rows the block does not own keep what their own block wrote (or 0), whatever the loop order.
        y_ZF = jnp.where(mine_Z1, y_ZF, lax.dynamic_slice_in_dim(y_RF, first, block))
        return lax.dynamic_update_slice_in_dim(y_RF, y_ZF, first, 0)

    # A loop with a traced trip count runs only the blocks that hold real rows: padding costs nothing.
    y_RF = cast_varying(jnp.zeros((num_rows, w_EDF.shape[2]), x_RD.dtype), _vma(x_RD))
    y_RF = lax.fori_loop(0, layout.num_blocks, one_block, y_RF)
    return y_RF, (x_RD, w_EDF, group_sizes_E)


def _block_sparse_bwd(block, residuals, dy_RF):
    x_RD, w_EDF, group_sizes_E = residuals
    num_rows = x_RD.shape[0]
    # Recomputed rather than saved: a few integer ops on E- and R/Z-sized arrays.
    layout = block_layout(group_sizes_E, num_rows, block)

    def one_block(n, carry):
        dx_RD, dw_EDF = carry
        first, mine_Z1 = _window(layout, n, num_rows, block)
        expert = layout.expert_I[n]
        # Both operands of x_b^T dy_b are masked: 0 * (an inf or NaN in a padding row) would still be NaN.
        x_ZD = jnp.where(mine_Z1, lax.dynamic_slice_in_dim(x_RD, first, block), 0)
        dy_ZF = jnp.where(mine_Z1, lax.dynamic_slice_in_dim(dy_RF, first, block), 0)
        w_DF = lax.dynamic_index_in_dim(w_EDF, expert, keepdims=False)
        dx_ZD = _dot_f32(dy_ZF, w_DF, ((1,), (1,))).astype(dx_RD.dtype)
        dx_ZD = jnp.where(mine_Z1, dx_ZD, lax.dynamic_slice_in_dim(dx_RD, first, block))
        dx_RD = lax.dynamic_update_slice_in_dim(dx_RD, dx_ZD, first, 0)
        # In place: dW[e] += x_b^T dy_b.
        dw_DF = lax.dynamic_index_in_dim(dw_EDF, expert, keepdims=False) + _dot_f32(x_ZD, dy_ZF, ((0,), (0,)))
        return dx_RD, lax.dynamic_update_index_in_dim(dw_EDF, dw_DF, expert, 0)

    # dW accumulates in float32 across blocks of the same expert; one cast at the end.
    init = (cast_varying(jnp.zeros_like(x_RD), _vma(x_RD)),
            cast_varying(jnp.zeros(w_EDF.shape, jnp.float32), _vma(x_RD)))
    dx_RD, dw_EDF = lax.fori_loop(0, layout.num_blocks, one_block, init)
    return dx_RD, dw_EDF.astype(w_EDF.dtype), None


_block_sparse.defvjp(_block_sparse_fwd, _block_sparse_bwd)

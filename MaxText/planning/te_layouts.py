"""How Transformer Engine's kernels lay out grouped operands and their scales, for te_reference.py's kernels.

Facts (C++ only, or only partly readable from TE's Python):
    * tensor-scaled colwise data is each group's [rows_g, cols] block transposed, the blocks back to back;
    * tensor-scaled scale_inv (and amax) hold one entry per NON-EMPTY group, in order: the quantizer does
      not advance its scale_inv pointer for an empty group, and the V1 GEMM advances both operands' scale
      pointers only for a non-empty GEMM. The weights' scale_inv (quantized per expert, no empty group)
      is read with that same pointer, so after an empty group the V1 GEMM reads a previous expert's
      weight scale (gemm.cpp: "If is_empty_gemm, scale_inv does not have the corresponding value, do not
      move the pointers"). The references do what the C++ does; the tests show what that costs.
    * MXFP8 data is in x's own [rows, cols] order for both copies: rowwise scales one per 32 elements along
      cols, colwise one per 32 rows (quantization.cpp: only tensor scaling transposes the colwise copy). Each
      non-empty group's scales are a [rows_g, cols/32] (rowwise) or [rows_g/32, cols] (colwise) matrix padded
      to TE's 128 x 4 alignment (misc.cpp get_block_scale_shape), the groups' padded blocks back to back, in
      the layout the GEMM consumes ("pre-swizzled": the quantize kernels write it, the GEMM reads it as is).
      The grouped swizzle happens in TE's CUDA kernels; the reference uses the 128 x 4 tile layout that TE's
      Python itself applies for the dense GEMM (gemm.py swizzled_scale: [rows/128, 4, 32, cols/4, 4] ->
      [rows/128, cols/4, 32, 4, 4]; colwise on the transposed matrix), which is cuBLAS's documented layout.
      For the grouped path what the tests prove is the round trip (quantize -> GEMM) through TE's Python.
    * A dense MXFP8 quantize writes its scales as the plain padded matrix (TE's Python swizzles them in
      GemmPrimitive.impl before the kernel); tensor scaling's colwise copy is x transposed at flatten_axis
      where TE's ScalingMode says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_of_rows(group_sizes, rows: int):
    """Group index of each of `rows` rows laid out group after group; rows past the groups get G."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def compacted_index(group_sizes):
    """For each group, its index among the non-empty groups (where TE's tensor scales for it are)."""
    nonempty = (group_sizes > 0).astype(jnp.int32)
    return jnp.cumsum(nonempty) - nonempty


def _block_transposed_index(group_sizes, rows: int, cols: int):
    """[rows, cols] flat positions of a [rows, cols] matrix (groups of rows one after another) when TE stores
    each group's rows as one [cols, rows_g] block, the blocks back to back (rows past the groups as one more)."""
    sizes = group_sizes.astype(jnp.int32)
    g = group_of_rows(sizes, rows)
    sizes_t = jnp.concatenate([sizes, jnp.array([rows], jnp.int32) - jnp.sum(sizes, keepdims=True)])
    starts = jnp.cumsum(sizes_t) - sizes_t
    r = jnp.arange(rows)[:, None]
    c = jnp.arange(cols)[None, :]
    return starts[g][:, None] * cols + c * sizes_t[g][:, None] + (r - starts[g][:, None])


def block_transposed_rows(flat, group_sizes, rows: int, cols: int):
    """The [rows, cols] matrix stored as per-group transposed blocks (_block_transposed_index) in `flat`."""
    return flat.reshape(-1)[_block_transposed_index(group_sizes, rows, cols)]


def to_block_transposed(matrix, group_sizes):
    """A [rows, cols] matrix as per-group transposed blocks, flat (the inverse of block_transposed_rows)."""
    rows, cols = matrix.shape
    index = _block_transposed_index(group_sizes, rows, cols)
    return jnp.zeros((rows * cols,), matrix.dtype).at[index.reshape(-1)].set(matrix.reshape(-1))


# ------------------------------------------------------------------------------------------- MXFP8 blocks

MX_BLOCK = 32  # elements sharing one E8M0 scale
E8M0_BIAS, E8M0_NAN = 127, 255


def _up(a, b):
    return (a + b - 1) // b * b


def e8m0_exponent(amax, fp8_max: float):
    """The power of two each block is divided by, as TE chooses it: amax / fp8_max rounded UP to a power of two
    (so the block's largest element lands at or just below the FP8 maximum), an all-zero block 2^-127; the
    exponent clamped to E8M0's range (-127 .. 127)."""
    ratio = amax.astype(jnp.float32) / fp8_max
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    up = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two stays
    return jnp.clip(jnp.where(ratio > 0, up, -E8M0_BIAS), -E8M0_BIAS, E8M0_BIAS).astype(jnp.int32)


def _mx_tile_position(r, c, cols_padded):
    """Flat position of element (r, c) of a scale matrix with cols_padded (a multiple of 4) columns in cuBLAS's
    block-scaling layout: 128 x 4 tiles, row-major over tiles, each tile's 512 bytes as [32][4 row quarters][4]."""
    tile = (r // 128) * (cols_padded // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def mx_scale_positions(row_sizes, rows: int, cols: int, colwise: bool):
    """[rows, cols // 32] (rowwise) or [rows // 32, cols] (colwise) flat positions of each block's scale in the
    grouped scale buffer (the module doc): each group's matrix padded to 128 x 4 (colwise: its transpose, [cols,
    rows_g / 32]), the groups' padded matrices back to back, empty groups taking no room. Also the buffer size
    the groups use."""
    sizes = row_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    if colwise:
        blocks_g = sizes // MX_BLOCK
        padded_cols_g = _up(blocks_g, 4)  # per group, the transposed matrix's columns
        room_g = padded_cols_g * _up(cols, 128)
        offsets = jnp.cumsum(room_g) - room_g
        b = jnp.arange(rows // MX_BLOCK)[:, None]
        g = jnp.minimum(group_of_rows(sizes, rows)[b[:, 0] * MX_BLOCK], sizes.shape[0] - 1)[:, None]
        local_block = b - starts[g] // MX_BLOCK
        c = jnp.arange(cols)[None, :]
        return offsets[g] + _mx_tile_position(c, local_block, padded_cols_g[g]), jnp.sum(room_g)
    cols_padded = _up(cols // MX_BLOCK, 4)
    room_g = _up(sizes, 128) * cols_padded
    offsets = jnp.cumsum(room_g) - room_g
    r = jnp.arange(rows)[:, None]
    g = jnp.minimum(group_of_rows(sizes, rows), sizes.shape[0] - 1)[:, None]
    c = jnp.arange(cols // MX_BLOCK)[None, :]
    return offsets[g] + _mx_tile_position(r - starts[g], c, cols_padded), jnp.sum(room_g)


def mx_plain_positions(rows: int, cols: int, colwise: bool):
    """[rows, cols // 32] (rowwise) or [rows // 32, cols] (colwise) positions of the block scales in a dense
    quantize's scale tensor: the plain row-major matrix padded to 128 x 4 (colwise 4 x 128), as TE's Python
    reads it (get_scale_shape, is_padded) and swizzles it itself before the GEMM (gemm.py swizzled_scale)."""
    if colwise:
        return jnp.arange(rows // MX_BLOCK)[:, None] * _up(cols, 128) + jnp.arange(cols)[None, :]
    return jnp.arange(rows)[:, None] * _up(cols // MX_BLOCK, 4) + jnp.arange(cols // MX_BLOCK)[None, :]


def mx_quantize(x2, row_sizes, out_dtype, colwise: bool, buffer_size: int, zero_all: bool, plain: bool = False):
    """x2 [rows, cols] in MXFP8: (data [rows * cols] in x2's order, the E8M0 scale buffer [buffer_size]). The
    grouped kernels zero the scale bytes the groups use (V2: the whole buffer); the rest is unwritten (NaN).
    plain: one matrix in a dense quantize's layout (mx_plain_positions), its padding unwritten."""
    rows, cols = x2.shape
    fp8_max = float(jnp.finfo(out_dtype).max)
    blocks = (x2.reshape(rows // MX_BLOCK, MX_BLOCK, cols) if colwise
              else x2.reshape(rows, cols // MX_BLOCK, MX_BLOCK))
    exponent = e8m0_exponent(jnp.max(jnp.abs(blocks), axis=1 if colwise else 2), fp8_max)
    inverse = jnp.ldexp(jnp.float32(1), -exponent)  # 2^127 at most; 2^-127 itself would be flushed to 0 on CPU
    q = jnp.clip(blocks * (inverse[:, None, :] if colwise else inverse[:, :, None]), -fp8_max, fp8_max)
    if plain:
        positions, used = mx_plain_positions(rows, cols, colwise), 0
    else:
        positions, used = mx_scale_positions(row_sizes, rows, cols, colwise)
        live = jnp.arange(rows) < jnp.sum(row_sizes)  # rows past the groups write no scale
        positions = jnp.where(live[::MX_BLOCK, None] if colwise else live[:, None], positions, buffer_size)
    fill = jnp.where(zero_all | (jnp.arange(buffer_size) < used), 0, E8M0_NAN).astype(jnp.uint8)
    scales = fill.at[positions.reshape(-1)].set((exponent + E8M0_BIAS).astype(jnp.uint8).reshape(-1), mode="drop")
    return q.astype(out_dtype).reshape(-1), jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)


def mx_dequantize(data, scale_inv, row_sizes, rows: int, cols: int, colwise: bool):
    """The float32 [rows, cols] matrix an MXFP8 operand stands for: data (x's order) times each block's 2^e read
    from the grouped scale buffer at mx_scale_positions (a NaN byte, unwritten, gives NaN)."""
    positions, _ = mx_scale_positions(row_sizes, rows, cols, colwise)
    byte = jax.lax.bitcast_convert_type(scale_inv, jnp.uint8).reshape(-1)[positions]
    factor = jnp.where(byte == E8M0_NAN, jnp.nan, jnp.ldexp(jnp.float32(1), byte.astype(jnp.int32) - E8M0_BIAS))
    factor = jnp.repeat(factor, MX_BLOCK, axis=0 if colwise else 1)
    return data.reshape(rows, cols).astype(jnp.float32) * factor


# ------------------------------------------------------------------------------------------- NVFP4 blocks
# (TE main @ d0067d0, common/cast/nvfp4/core_nvfp4.cuh and quantize_transpose_nvfp4.cuh; jax/csrc/extensions/
# quantization.cpp.) Two levels: a float32 tensor scale S_enc = 448 * 6 / amax (1 where amax is 0 or the quotient
# 0; at most float32's max) from the amax TE's Python hands in (the post-RHT amax for an RHT'd colwise copy), and
# per 16 elements along the matrix's last dim (a 16 x 16 tile with 2D scaling, for weights) an E4M3 decode scale
# S_dec_b = block_amax * (S_enc / 6) cast to E4M3; the elements are multiplied by 1 / (S_dec_b / S_enc) and cast to
# E2M1 (round to nearest even, saturating at 6; stochastic rounding for gradients). Scales are the plain matrix,
# one per block of 16 along the last dim (2D: repeated for each of the tile's 16 rows), padded to 128 x 4; the
# GEMM swizzles them in its own kernel. The colwise copy is x transposed at flatten_axis, quantized the same way.

NV_BLOCK = 16
FP4_MAX, E4M3_MAX = 6.0, 448.0


def nv_tensor_scale(amax):
    """S_enc from a (1,) amax: 448 * 6 / amax, at most float32's max, 1 where amax is 0 or S_enc underflows."""
    amax = amax.reshape(-1)[0].astype(jnp.float32)
    enc = jnp.minimum(E4M3_MAX * FP4_MAX / amax, jnp.finfo(jnp.float32).max)
    return jnp.where((amax == 0) | (enc == 0), jnp.float32(1), enc)


def fp4_round_stochastic(scaled, key):
    """Each |value| rounded down or up to its neighbours on E2M1's grid (0, .5, 1, 1.5, 2, 3, 4, 6) with the
    probability of the other neighbour's distance, so that the rounding is unbiased; past 6 it stays 6."""
    grid = jnp.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)
    mag = jnp.minimum(jnp.abs(scaled), FP4_MAX)
    i = jnp.clip(jnp.searchsorted(grid, mag, side="right") - 1, 0, grid.size - 2)
    low, high = grid[i], grid[i + 1]
    up = jax.random.uniform(key, scaled.shape) < (mag - low) / (high - low)
    return jnp.sign(scaled) * jnp.where(up, high, low)


def nv_quantize(x2, amax, padded: tuple[int, int], out_dtype, scale_dtype, *, two_d: bool, sr_key=None):
    """x2 [rows, cols] in NVFP4 against the tensor amax `amax`: (data [rows, cols], the E4M3 scale matrix [rows,
    cols / 16] in the top-left corner of a `padded` [rows', cols'] buffer whose rest is unwritten: NaN)."""
    rows, cols = x2.shape
    enc = nv_tensor_scale(amax)
    blocks = jnp.abs(x2).reshape(rows, cols // NV_BLOCK, NV_BLOCK).max(axis=2)
    if two_d:  # one amax per 16 x 16 tile, repeated over its rows
        tiles = blocks.reshape(rows // NV_BLOCK, NV_BLOCK, cols // NV_BLOCK).max(axis=1)
        blocks = jnp.repeat(tiles, NV_BLOCK, axis=0)
    dec = jnp.minimum(blocks * (enc * (1 / FP4_MAX)), jnp.finfo(jnp.float32).max).astype(scale_dtype)
    factor = jnp.minimum(1 / (dec.astype(jnp.float32) * (1 / enc)), jnp.finfo(jnp.float32).max)
    scaled = x2 * jnp.repeat(factor, NV_BLOCK, axis=1)
    if sr_key is not None:
        scaled = fp4_round_stochastic(scaled, sr_key)
    data = jnp.clip(scaled, -FP4_MAX, FP4_MAX).astype(out_dtype)
    scales = jnp.full(padded, jnp.nan, scale_dtype).at[:rows, :cols // NV_BLOCK].set(dec)
    return data, scales


def nv_blocks(data2, scales2):
    """An NVFP4 operand [rows, cols] as float32 before its tensor scale: data times its blocks' E4M3 scales (the
    scale matrix's top-left [rows, cols / 16]). The GEMM takes the two tensor scales as alpha = the product of
    the operands' amax / (6 * 448) (cpp_extensions/gemm.py _get_nvfp4_tensor_scale_inv): 1 / S_enc each."""
    rows, cols = data2.shape
    dec = scales2[:rows, :cols // NV_BLOCK].astype(jnp.float32)
    return data2.astype(jnp.float32) * jnp.repeat(dec, NV_BLOCK, axis=1)

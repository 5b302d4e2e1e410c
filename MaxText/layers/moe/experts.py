"""The grouped expert FFN: SwiGLU of every expert over its rows of a dispatcher's buffer, through a kernel
set's grouped GEMM (te_kernels.py: gmm.grouped_matmul, block-sparse on CPU and `ragged_dot` on GPU, or TE's
grouped_dense)."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name


class ExpertWeights(NamedTuple):
    wi_0_EDF: jax.Array
    wi_1_EDF: jax.Array
    wo_EFD: jax.Array


@jax.named_scope("moe_grouped_gemm")
def expert_ffn(x_RD, group_sizes_E, w: ExpertWeights, gemm):
    """silu(x @ wi_0) * (x @ wi_1) @ wo for each contiguous expert group, in x's dtype; rows past
    sum(group_sizes) come out as 0. `gemm(x_RD, w_EDF, group_sizes_E)` is the kernel set's grouped GEMM."""
    dt = x_RD.dtype
    gate = checkpoint_name(gemm(x_RD, w.wi_0_EDF.astype(dt), group_sizes_E), "moe_mlpwi_0")
    up = checkpoint_name(gemm(x_RD, w.wi_1_EDF.astype(dt), group_sizes_E), "moe_mlpwi_1")
    h = jax.nn.silu(gate) * up
    return checkpoint_name(gemm(h, w.wo_EFD.astype(dt), group_sizes_E), "moe_mlpwo")

"""Dispatchers: token-slots into an expert-major buffer and back. One interface, four implementations.

    x_RD, group_sizes_E, handle = dispatcher.dispatch(x_TD, routing)   # routing: .experts_TK, .weights_TK
    y_RD = experts.expert_ffn(x_RD, group_sizes_E, weights, gemm)      # rows of expert e: group e of the buffer
    y_TD = dispatcher.combine(y_RD, handle)                            # y_t = sum_k weight_tk * y_(t,k)

The buffer's R rows hold the groups of experts 0, 1, ... in order; rows past sum(group_sizes_E) are padding
and must come out of the expert FFN as 0. Every handle has `overflow`: this device's real token-slots that
got no expert output (0 unless a bounded EP buffer overflowed). Expert ids >= the dispatcher's num_experts
are empty slots (an EP receive buffer's padding): they take no row and combine to 0.

    LocalSort    here: slots sorted by expert, groups back to back (moe_impl=ragged)
    AlignedSort  here: every group starts on a 128-row boundary, its size rounded up to 128, as TE's
                 grouped GEMM and NCCL EP lay tokens out (moe_impl=te_dropless)
    ExpertParallel (ep.py)  each token travels to the devices holding its experts, one row per device, and
                 a LocalSort or AlignedSort of the received rows runs there
    NcclEp (nccl_ep.py)     TE's NCCL EP: ep_dispatch / ep_combine over the global arrays
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ALIGN = 128  # rows per expert group: TE's MXFP8 grouped GEMM and NCCL EP both need 128-row groups


class Selection(NamedTuple):
    """A router's choices for the tokens of one device (Routing carries the same two fields)."""
    experts_TK: jax.Array   # int32 expert ids; ids >= the dispatcher's num_experts are empty slots
    weights_TK: jax.Array   # combine weights (0 for empty slots)


@jax.named_scope("moe_combine")
def weighted_sum(out_SD, weights_TK):
    """y_t = sum_k weight_tk * out_(t,k), accumulated in float32, in out's dtype."""
    t, k = weights_TK.shape
    out_TKD = out_SD.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", out_TKD, weights_TK.astype(jnp.float32)).astype(out_SD.dtype)


class SortHandle(NamedTuple):
    order_S: jax.Array      # the stable sort of the slots by expert
    order_R: jax.Array      # its first `max_slots` entries: the slots in the buffer, one per row
    weights_TK: jax.Array
    overflow: jax.Array


class LocalSort(NamedTuple):
    """Slots sorted by expert into R = max_slots rows (default: every slot), groups back to back. Slot s is
    (token s // K, choice s % K) and reads x's row s // K: no copy of x per choice. A max_slots below the
    slots counts at least the real ones (the empty slots sort last and are left out)."""
    num_experts: int
    max_slots: int | None = None

    @jax.named_scope("moe_dispatch")
    def dispatch(self, x_TD, routing):
        k = routing.experts_TK.shape[1]
        experts_S = routing.experts_TK.reshape(-1)
        order_S = jnp.argsort(experts_S, stable=True)
        group_sizes_E = jnp.sum(jax.nn.one_hot(experts_S, self.num_experts, dtype=jnp.int32), axis=0)
        order_R = order_S[:self.max_slots]
        handle = SortHandle(order_S, order_R, routing.weights_TK, jnp.zeros((), jnp.int32))
        return x_TD[order_R // k], group_sizes_E, handle

    @jax.named_scope("moe_combine")
    def combine(self, y_RD, h: SortHandle):
        s = h.order_S.shape[0]
        if h.order_R.shape[0] == s:
            y_SD = y_RD[jnp.argsort(h.order_S)]
        else:
            y_SD = jnp.zeros((s,) + y_RD.shape[1:], y_RD.dtype).at[h.order_R].set(y_RD)
        return weighted_sum(y_SD, h.weights_TK)


def aligned_buffer_rows(slots: int, num_experts: int, align: int = ALIGN) -> int:
    """Static rows that hold `slots` rows in groups padded to `align`, TE's token_dispatch buffer size
    (permutation.py). The padded groups add up to at most slots + E*(align-1) rows and to a multiple of
    `align`, hence to at most that bound rounded DOWN to a multiple of `align`."""
    return (slots + num_experts * (align - 1)) // align * align


@jax.named_scope("moe_dispatch")
def aligned_permute(x_TD, experts_S, num_experts: int, align: int = ALIGN, rows_per_input: int = 1,
                    max_slots: int | None = None):
    """Slots -> expert-major buffer with `align`-row-aligned groups; slot s reads row s // rows_per_input of x_TD
    (tokens, or an EP buffer's received rows). The buffer is sized for `max_slots` real slots (static; default:
    all of them).

    Returns (x_RD, group_sizes_E, rows_S): the buffer (padding rows 0), each group's size rounded up to
    `align` (TE's aligned counts), and the buffer row of every slot. Slots whose id is >= num_experts
    (empty slots of an EP buffer) get row R (out of range) and stay out of the buffer.
    """
    s = experts_S.shape[0]
    rows = aligned_buffer_rows(s if max_slots is None else max_slots, num_experts, align)
    counts_E = jnp.sum(jax.nn.one_hot(experts_S, num_experts, dtype=jnp.int32), axis=0)
    sizes_E = (counts_E + align - 1) // align * align
    order_S = jnp.argsort(experts_S, stable=True)
    sorted_e = experts_S[order_S]
    real = sorted_e < num_experts
    e = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(s) - (jnp.cumsum(counts_E) - counts_E)[e]  # position inside its expert group
    rows_sorted = jnp.where(real, (jnp.cumsum(sizes_E) - sizes_E)[e] + rank, rows)
    rows_S = jnp.zeros((s,), jnp.int32).at[order_S].set(rows_sorted.astype(jnp.int32))
    x_SD = x_TD[jnp.arange(s) // rows_per_input] if rows_per_input > 1 else x_TD
    x_RD = jnp.zeros((rows,) + x_SD.shape[1:], x_SD.dtype).at[rows_S].set(x_SD, mode="drop")
    return x_RD, sizes_E, rows_S


@jax.named_scope("moe_combine")
def unpermute(out_RD, rows_S):
    """The buffer rows back in slot order; slots outside the buffer read 0."""
    return jnp.take(out_RD, rows_S, axis=0, mode="fill", fill_value=0)


class AlignedHandle(NamedTuple):
    rows_S: jax.Array       # each slot's buffer row (R for empty slots)
    weights_TK: jax.Array
    overflow: jax.Array


class AlignedSort(NamedTuple):
    """TE's layout: slots sorted by expert into aligned_buffer_rows(max_slots) rows, every group starting on
    an `align`-row boundary with its size rounded up to `align` (zero rows); group sizes are the rounded ones."""
    num_experts: int
    max_slots: int | None = None
    align: int = ALIGN

    def dispatch(self, x_TD, routing):
        k = routing.experts_TK.shape[1]
        x_RD, sizes_E, rows_S = aligned_permute(x_TD, routing.experts_TK.reshape(-1), self.num_experts, self.align,
                                                rows_per_input=k, max_slots=self.max_slots)
        return x_RD, sizes_E, AlignedHandle(rows_S, routing.weights_TK, jnp.zeros((), jnp.int32))

    def combine(self, y_RD, h: AlignedHandle):
        return weighted_sum(unpermute(y_RD, h.rows_S), h.weights_TK)

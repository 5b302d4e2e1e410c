"""Expert-parallel dispatch and combine, inside shard_map over the mesh axis `expert`.

Each of the N devices on the axis holds E/N experts. A token's K choices are grouped by destination device:
with `ep_dedup` (the default) the token travels once to each device that holds any of its experts, as one row
carrying up to J = min(K, E/N) (local expert id, router weight) pairs; without it, once per choice (J = 1).
The receiver expands each row into its J slots, runs its experts, sums each row's slot outputs weighted by
the router (in float32) and sends one row back; the sender adds up a token's returning rows. Under
group-limited routing (DeepSeek-V3: 8 groups, keep 4) at EP 8 a token reaches about 4 devices instead of
sending 8 copies: half the all-to-all rows each way, and receive buffers of T rows per peer, not T * J.

Dispatch sorts this device's rows by destination, keeping their token order within each destination, and
sends each destination its contiguous chunk; combine returns every processed row to the row it came from.
The exchange is `jax.lax.ragged_all_to_all` where the platform has it (GPU, TPU). XLA:CPU has no ragged
all-to-all, so there the same exchange, with the same arguments and result, runs as one `all_to_all` of
fixed per-peer buffers (`capacity` rows each). Buffers default to the dropless worst case; a smaller
ragged_buffer_factor shrinks them, and the slots of the rows that do not fit are counted as overflow and
contribute nothing: they are never dropped silently. Overflow order: a device's last tokens (in batch
order) to a full peer, whichever of its experts they chose, so no expert is starved because of its id.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


class Capacity(NamedTuple):
    """Static per-peer buffer sizes: `rows` a device may send one peer, carrying at most `slots` slots."""
    rows: int
    slots: int


class Dispatch(NamedTuple):
    x_RD: jax.Array             # rows received from all peers, [N * capacity.rows, D]; padding rows are 0
    payload_RP: jax.Array       # the per-row float32 payload received alongside; padding rows hold `fill`
    order_S: jax.Array          # the sort of this device's rows by destination device (stable: token order)
    counts_NN: jax.Array        # rows each device wanted to send each device, [src, dst]
    sent_NN: jax.Array          # rows that fitted in the buffers, [src, dst]
    kept_S: jax.Array           # bool: this device's row s was sent (it has a destination and fitted)
    capacity: Capacity


class RankRows(NamedTuple):
    """A device's tokens as rows to send: row (t, p) goes to device dest_TP[t, p] (N: nothing to send) and
    carries J (local expert, weight) slots; empty slots hold local expert E/N and weight 0."""
    dest_TP: jax.Array     # int32 [T, P]
    local_TPJ: jax.Array   # int32 [T, P, J]
    weights_TPJ: jax.Array  # [T, P, J], the router weights' dtype


def peer_capacity(tokens: int, top_k: int, num_experts: int, num_local_experts: int, factor,
                  dedup: bool = True) -> Capacity:
    """What one device may send one peer. Slots: the dropless worst case tokens * min(K, E/N) (a token's K
    experts are distinct), or with a factor the balanced share tokens*K/N times the factor, capped there; the
    receiver's grouped GEMMs take N x slots rows either way. Rows: one per token at most with dedup (and
    never more than the slots), one per slot without."""
    slots = tokens * min(top_k, num_local_experts)
    if factor is not None:
        peers = num_experts // num_local_experts
        slots = max(1, min(slots, math.ceil(tokens * top_k / peers * factor)))
    return Capacity(min(tokens, slots) if dedup else slots, slots)


def rank_rows(experts_TK, weights_TK, num_local_experts: int, num_peers: int, dedup: bool) -> RankRows:
    """Groups each token's K choices by the device holding the expert (global id e lives on e // E_local).
    With dedup: P = min(K, N) rows per token, its distinct devices in increasing order, each with the choices
    there in choice order. Without: P = K rows of one slot each (row k is choice k)."""
    t, k = experts_TK.shape
    dest_TK = (experts_TK // num_local_experts).astype(jnp.int32)
    local_TK = (experts_TK % num_local_experts).astype(jnp.int32)
    if not dedup:
        return RankRows(dest_TK, local_TK[:, :, None], weights_TK[:, :, None])
    p, j = min(k, num_peers), min(k, num_local_experts)  # K distinct experts: at most min(K, E/N) on a device
    same_TKK = dest_TK[:, :, None] == dest_TK[:, None, :]
    earlier_KK = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k2]: k2 < k
    slot_TK = jnp.sum(same_TKK & earlier_KK, axis=2)  # earlier choices on the same device
    first_TK = slot_TK == 0
    row_TK = jnp.sum(first_TK[:, None, :] & (dest_TK[:, None, :] < dest_TK[:, :, None]), axis=2)  # devices below
    t_T1 = jnp.arange(t)[:, None]
    dest_TP = jnp.full((t, p), num_peers, jnp.int32).at[t_T1, row_TK].set(dest_TK)
    local_TPJ = jnp.full((t, p, j), num_local_experts, jnp.int32).at[t_T1, row_TK, slot_TK].set(local_TK)
    weights_TPJ = jnp.zeros((t, p, j), weights_TK.dtype).at[t_T1, row_TK, slot_TK].set(weights_TK)
    return RankRows(dest_TP, local_TPJ, weights_TPJ)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def native_ragged_all_to_all() -> bool:
    """Whether this backend compiles ragged-all-to-all (XLA:CPU does not)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                    max_send: int):
    """jax.lax.ragged_all_to_all semantics: rows operand[input_offsets[p] : + send_sizes[p]] go to peer p
    and land in its `output` at output_offsets[p]; recv_sizes[p] rows arrive from peer p. `max_send`
    bounds every send size (the emulation's static per-peer buffer)."""
    if native_ragged_all_to_all():
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    n = input_offsets.shape[0]
    i = jnp.arange(max_send)
    send_ok = i[None, :] < send_sizes[:, None]
    rows = jnp.take(operand, jnp.where(send_ok, input_offsets[:, None] + i[None, :], 0), axis=0)
    rows = jnp.where(send_ok.reshape(send_ok.shape + (1,) * (operand.ndim - 1)), rows, 0)
    received = jax.lax.all_to_all(rows, axis_name, 0, 0, tiled=True)  # received[p] = peer p's rows for me
    # Where each peer placed its chunk in my output: the output_offsets it computed for me.
    landing = jax.lax.all_to_all(output_offsets[:, None], axis_name, 0, 0, tiled=True)[:, 0]
    recv_ok = i[None, :] < recv_sizes[:, None]
    target = jnp.where(recv_ok, landing[:, None] + i[None, :], output.shape[0])  # out of range -> dropped
    return output.at[target.reshape(-1)].set(received.reshape((n * max_send,) + operand.shape[1:]), mode="drop")


@jax.named_scope("moe_dispatch")
def dispatch(x_TD, dest_S, payload_SP, slots_S, *, rows_per_token: int, num_peers: int, axis_name: str,
             capacity: Capacity, fill: float = 0.0) -> Dispatch:
    """Sends row s (input row s // rows_per_token of x, and payload row s, carrying slots_S[s] slots) to device
    dest_S[s]; rows whose dest is num_peers are not sent. Per peer, rows fit in (destination, row) order while
    both the peer's row and slot budgets hold; the rest are not sent."""
    n = num_peers
    me = jax.lax.axis_index(axis_name)
    s = dest_S.shape[0]
    order_S = jnp.argsort(dest_S, stable=True)  # by destination, then row (token-major) order; unsent last
    dest_sorted = dest_S[order_S]
    to_N = jax.nn.one_hot(dest_sorted, n, dtype=jnp.int32)  # [S, N]; unsent rows: all 0
    counts_N = jnp.sum(to_N, axis=0)
    start_S = _exclusive_cumsum(counts_N)[jnp.minimum(dest_sorted, n - 1)]
    slots_sorted = slots_S[order_S]
    slots_through = jnp.cumsum(slots_sorted) - _exclusive_cumsum(slots_sorted)[start_S]  # in its chunk, inclusive
    fits = (dest_sorted < n) & (jnp.arange(s) - start_S < capacity.rows) & (slots_through <= capacity.slots)
    kept_S = jnp.zeros((s,), bool).at[order_S].set(fits)
    sent_N = jnp.sum(to_N * fits[:, None], axis=0)  # the budgets only ever cut a suffix of a peer's chunk
    both = jax.lax.all_gather(jnp.stack([counts_N, sent_N]), axis_name)  # [src, 2, dst]
    counts_NN, sent_NN = both[:, 0], both[:, 1]
    args = dict(input_offsets=_exclusive_cumsum(counts_N), send_sizes=sent_N,
                output_offsets=_exclusive_cumsum(sent_NN, axis=0)[me], recv_sizes=sent_NN[:, me],
                axis_name=axis_name, max_send=capacity.rows)
    rows = n * capacity.rows
    x_RD = ragged_exchange(x_TD[order_S // rows_per_token], jnp.zeros((rows,) + x_TD.shape[1:], x_TD.dtype), **args)
    payload_RP = ragged_exchange(payload_SP[order_S], jnp.full((rows,) + payload_SP.shape[1:], fill, payload_SP.dtype),
                                 **args)
    return Dispatch(checkpoint_name(x_RD, "moe_dispatch"), payload_RP, order_S, counts_NN, sent_NN, kept_S, capacity)


@jax.named_scope("moe_combine")
def combine(out_RD, d: Dispatch, *, axis_name: str):
    """Returns each processed row to the row it came from, in the rows' original order [S, D]; rows that were
    not sent are 0."""
    me = jax.lax.axis_index(axis_name)
    slots = d.order_S.shape[0]
    back = ragged_exchange(
        out_RD, jnp.zeros((slots,) + out_RD.shape[1:], out_RD.dtype),
        input_offsets=_exclusive_cumsum(d.sent_NN[:, me]), send_sizes=d.sent_NN[:, me],
        output_offsets=_exclusive_cumsum(d.counts_NN, axis=1)[:, me], recv_sizes=d.sent_NN[me],
        axis_name=axis_name, max_send=d.capacity.rows)
    return back[jnp.argsort(d.order_S)]


def expert_parallel_moe(x_TD, experts_TK, weights_TK, slot_ffn, *, num_experts: int, num_local_experts: int,
                        axis_name: str, buffer_factor, dedup: bool):
    """The dropless MoE over this device's E/N experts. `slot_ffn(x_RD, local_S, rows_per_input, max_slots)
    -> out_SD` runs slot s (input row s // rows_per_input, local expert local_S[s]; ids >= E/N are empty slots,
    output 0) through its expert, in a buffer of `max_slots` rows (at least the real slots). Returns (y_TD,
    slots of this device that did not fit a peer's buffer)."""
    t, k = experts_TK.shape
    n = num_experts // num_local_experts
    rows = rank_rows(experts_TK, weights_TK, num_local_experts, n, dedup)
    p, j = rows.local_TPJ.shape[1:]
    slots_S = jnp.sum(rows.local_TPJ < num_local_experts, axis=2).reshape(-1)
    # One exchange for both payloads: the ids travel as float32 (exact below 2**24), beside the weights.
    payload_SP = jnp.concatenate([rows.local_TPJ.reshape(t * p, j).astype(jnp.float32),
                                  rows.weights_TPJ.reshape(t * p, j).astype(jnp.float32)], axis=1)
    capacity = peer_capacity(t, k, num_experts, num_local_experts, buffer_factor, dedup)
    d = dispatch(x_TD, rows.dest_TP.reshape(-1), payload_SP, slots_S, rows_per_token=p, num_peers=n,
                 axis_name=axis_name, capacity=capacity, fill=float(num_local_experts))
    r = d.x_RD.shape[0]
    local_RJ = d.payload_RP[:, :j].astype(jnp.int32)
    weights_RJ = jnp.where(local_RJ < num_local_experts, d.payload_RP[:, j:], 0.0)
    out_SD = slot_ffn(d.x_RD, local_RJ.reshape(-1), j, min(r * j, n * capacity.slots))
    with jax.named_scope("moe_combine"):
        y_RD = jnp.einsum("rjd,rj->rd", out_SD.reshape(r, j, -1).astype(jnp.float32), weights_RJ)
    back_SD = combine(y_RD.astype(x_TD.dtype), d, axis_name=axis_name)
    y_TD = jnp.sum(back_SD.reshape(t, p, -1).astype(jnp.float32), axis=1).astype(x_TD.dtype)
    return y_TD, jnp.sum(jnp.where(d.kept_S, 0, slots_S))

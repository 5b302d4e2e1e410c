"""The expert-parallel dispatcher (dispatch.py's interface), inside shard_map over the mesh axis `expert`.

Each of the N devices on the axis holds E/N experts. A token's K choices are grouped by destination device:
with `ep_dedup` (the default) the token travels once to each device that holds any of its experts, as one row
carrying up to J = min(K, E/N) (local expert id, router weight) pairs; without it, once per choice (J = 1).
The receiver expands each row into its J slots, runs its experts, sums each row's slot outputs weighted by
the router (in float32) and sends one row back; the sender adds up a token's returning rows. Under
group-limited routing (DeepSeek-V3: 8 groups, keep 4) at EP 8 a token reaches about 4 devices instead of
sending 8 copies: half the all-to-all rows each way, and receive buffers of T rows per peer, not T * J.

send_rows sorts this device's rows by destination, keeping their token order within each destination, and
sends each destination its contiguous chunk; send_back returns every processed row to the row it came from.
ExpertParallel.dispatch is rank_rows, send_rows and the receiver's local dispatch; its combine is the local
combine, send_back and the sum of each token's rows.
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

from MaxText.layers.moe.dispatch import Selection


class Capacity(NamedTuple):
    """Static per-peer buffer sizes: `rows` a device may send one peer, carrying at most `slots` slots."""
    rows: int
    slots: int


class Exchange(NamedTuple):
    """What send_rows received, and what send_back needs to return the rows."""
    x_XD: jax.Array             # rows received from all peers, [N * capacity.rows, D]; padding rows are 0
    payload_XW: jax.Array       # the per-row float32 payload received alongside; padding rows hold `fill`
    order_U: jax.Array          # the sort of this device's rows by destination device (stable: token order)
    counts_NN: jax.Array        # rows each device wanted to send each device, [src, dst]
    sent_NN: jax.Array          # rows that fitted in the buffers, [src, dst]
    kept_U: jax.Array           # bool: this device's row u was sent (it has a destination and fitted)
    capacity: Capacity


class RankRows(NamedTuple):
    """A device's tokens as rows to send: row (t, q) goes to device dest_TQ[t, q] (N: nothing to send) and
    carries J (local expert, weight) slots; empty slots hold local expert E/N and weight 0."""
    dest_TQ: jax.Array     # int32 [T, Q]
    local_TQJ: jax.Array   # int32 [T, Q, J]
    weights_TQJ: jax.Array  # [T, Q, J], the router weights' dtype


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


def worst_case_chunks(tokens: int, chunks: int, top_k: int, num_experts: int, num_local_experts: int, factor) -> int:
    """moe_dropless_fallback=layer: the fewest token chunks a layer's worst-case branch can run in, one after another,
    with no chunk's worst-case buffer larger than a bounded chunk's (`chunks` of them, factor `factor`); at least
    `chunks`, and one token each where even a token's worst case is larger."""
    bounded = peer_capacity(-(-tokens // chunks), top_k, num_experts, num_local_experts, factor).slots
    fit = bounded // peer_capacity(1, top_k, num_experts, num_local_experts, None).slots  # tokens a chunk may hold
    return tokens if fit == 0 else min(tokens, max(chunks, -(-tokens // fit)))


def rank_rows(experts_TK, weights_TK, num_local_experts: int, num_peers: int, dedup: bool) -> RankRows:
    """Groups each token's K choices by the device holding the expert (global id e lives on e // E_local).
    With dedup: Q = min(K, N) rows per token, its distinct devices in increasing order, each with the choices
    there in choice order. Without: Q = K rows of one slot each (row k is choice k)."""
    t, k = experts_TK.shape
    dest_TK = (experts_TK // num_local_experts).astype(jnp.int32)
    local_TK = (experts_TK % num_local_experts).astype(jnp.int32)
    if not dedup:
        return RankRows(dest_TK, local_TK[:, :, None], weights_TK[:, :, None])
    q, j = min(k, num_peers), min(k, num_local_experts)  # K distinct experts: at most min(K, E/N) on a device
    same_TKK = dest_TK[:, :, None] == dest_TK[:, None, :]
    earlier_KK = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k2]: k2 < k
    slot_TK = jnp.sum(same_TKK & earlier_KK, axis=2)  # earlier choices on the same device
    first_TK = slot_TK == 0
    row_TK = jnp.sum(first_TK[:, None, :] & (dest_TK[:, None, :] < dest_TK[:, :, None]), axis=2)  # devices below
    t_T1 = jnp.arange(t)[:, None]
    dest_TQ = jnp.full((t, q), num_peers, jnp.int32).at[t_T1, row_TK].set(dest_TK)
    local_TQJ = jnp.full((t, q, j), num_local_experts, jnp.int32).at[t_T1, row_TK, slot_TK].set(local_TK)
    weights_TQJ = jnp.zeros((t, q, j), weights_TK.dtype).at[t_T1, row_TK, slot_TK].set(weights_TK)
    return RankRows(dest_TQ, local_TQJ, weights_TQJ)


def row_payload(rows: RankRows) -> jax.Array:
    """The per-row payload sent beside x, [U, 2J]: the slots' local expert ids as float32 (exact below 2**24) beside
    their weights, so that one exchange carries both."""
    u, q, j = rows.local_TQJ.shape
    return jnp.concatenate([rows.local_TQJ.reshape(u * q, j).astype(jnp.float32),
                            rows.weights_TQJ.reshape(u * q, j).astype(jnp.float32)], axis=1)


def received_pairs(payload_XW, j: int, none: int) -> Selection:
    """The (local expert id, weight) pairs each received row carries; empty pairs hold id `none` and weight 0."""
    ids_XJ = payload_XW[:, :j].astype(jnp.int32)
    return Selection(ids_XJ, jnp.where(ids_XJ < none, payload_XW[:, j:], 0.0))


def sum_rows(back_UD, rows_per: int, dtype):
    """Each source's returning rows (rows_per of them, in order) added up in float32, in `dtype`."""
    u = back_UD.shape[0] // rows_per
    with jax.named_scope("moe_combine"):
        return jnp.sum(back_UD.reshape(u, rows_per, -1).astype(jnp.float32), axis=1).astype(dtype)


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
def send_rows(x_TD, dest_U, payload_UW, slots_U, *, rows_per_token: int, num_peers: int, axis_name: str,
              capacity: Capacity, fill: float = 0.0, senders: int | None = None) -> Exchange:
    """Sends row u (input row u // rows_per_token of x, and payload row u, carrying slots_U[u] slots) to device
    dest_U[u] (its position on the axis, of num_peers); rows whose dest is num_peers are not sent. Per peer, rows
    fit in (destination, row) order while both the peer's row and slot budgets hold; the rest are not sent. The
    receive buffer holds `senders` (default: all) peers' budgets: an exchange inside groups of devices (two_hop.py)
    passes its group's size."""
    n = num_peers
    me = jax.lax.axis_index(axis_name)
    u = dest_U.shape[0]
    order_U = jnp.argsort(dest_U, stable=True)  # by destination, then row (token-major) order; unsent last
    dest_sorted = dest_U[order_U]
    to_UN = jax.nn.one_hot(dest_sorted, n, dtype=jnp.int32)  # unsent rows: all 0
    counts_N = jnp.sum(to_UN, axis=0)
    start_U = _exclusive_cumsum(counts_N)[jnp.minimum(dest_sorted, n - 1)]
    slots_sorted = slots_U[order_U]
    slots_through = jnp.cumsum(slots_sorted) - _exclusive_cumsum(slots_sorted)[start_U]  # in its chunk, inclusive
    fits = (dest_sorted < n) & (jnp.arange(u) - start_U < capacity.rows) & (slots_through <= capacity.slots)
    kept_U = jnp.zeros((u,), bool).at[order_U].set(fits)
    sent_N = jnp.sum(to_UN * fits[:, None], axis=0)  # the budgets only ever cut a suffix of a peer's chunk
    both = jax.lax.all_gather(jnp.stack([counts_N, sent_N]), axis_name)  # [src, 2, dst]
    counts_NN, sent_NN = both[:, 0], both[:, 1]
    args = dict(input_offsets=_exclusive_cumsum(counts_N), send_sizes=sent_N,
                output_offsets=_exclusive_cumsum(sent_NN, axis=0)[me], recv_sizes=sent_NN[:, me],
                axis_name=axis_name, max_send=capacity.rows)
    rows = (senders or n) * capacity.rows
    x_XD = ragged_exchange(x_TD[order_U // rows_per_token], jnp.zeros((rows,) + x_TD.shape[1:], x_TD.dtype), **args)
    payload_XW = ragged_exchange(payload_UW[order_U], jnp.full((rows,) + payload_UW.shape[1:], fill, payload_UW.dtype),
                                 **args)
    return Exchange(checkpoint_name(x_XD, "moe_dispatch"), payload_XW, order_U, counts_NN, sent_NN, kept_U, capacity)


@jax.named_scope("moe_combine")
def send_back(y_XD, ex: Exchange, *, axis_name: str):
    """Returns each processed row to the row it came from, in the rows' original order [U, D]; rows that were
    not sent are 0."""
    me = jax.lax.axis_index(axis_name)
    u = ex.order_U.shape[0]
    back = ragged_exchange(
        y_XD, jnp.zeros((u,) + y_XD.shape[1:], y_XD.dtype),
        input_offsets=_exclusive_cumsum(ex.sent_NN[:, me]), send_sizes=ex.sent_NN[:, me],
        output_offsets=_exclusive_cumsum(ex.counts_NN, axis=1)[:, me], recv_sizes=ex.sent_NN[me],
        axis_name=axis_name, max_send=ex.capacity.rows)
    return back[jnp.argsort(ex.order_U)]


class EpHandle(NamedTuple):
    exchange: Exchange
    local: object           # the receiver's dispatcher (LocalSort | AlignedSort) and its handle
    local_handle: object
    rows_per_token: int     # Q
    overflow: jax.Array     # slots of this device that did not fit a peer's buffer


class ExpertParallel(NamedTuple):
    """This device holds experts [me * E/N, (me + 1) * E/N). dispatch sends each token's rows (rank_rows) to
    their devices and lays the received rows' slots out for the local experts with `local` (dispatch.LocalSort
    or dispatch.AlignedSort, sized for the buffer's real slots); combine weights each received row's slot
    outputs there (float32), returns one row per (token, device) and adds up each token's rows."""
    num_experts: int
    num_local_experts: int
    local: type
    axis_name: str = "expert"
    buffer_factor: float | None = None
    dedup: bool = True

    def overflows(self, routing):
        """Whether this device's rows would overflow a peer's buffer in dispatch (some row not fitting its
        destination's row or slot budget), computed from the routing alone, before any exchange."""
        t, k = routing.experts_TK.shape
        n = self.num_experts // self.num_local_experts
        rows = rank_rows(routing.experts_TK, routing.weights_TK, self.num_local_experts, n, self.dedup)
        slots_U = jnp.sum(rows.local_TQJ < self.num_local_experts, axis=2).reshape(-1)
        to_UN = jax.nn.one_hot(rows.dest_TQ.reshape(-1), n, dtype=jnp.int32)  # unsent rows: all 0
        capacity = peer_capacity(t, k, self.num_experts, self.num_local_experts, self.buffer_factor, self.dedup)
        return (jnp.any(jnp.sum(to_UN, axis=0) > capacity.rows)
                | jnp.any(jnp.sum(to_UN * slots_U[:, None], axis=0) > capacity.slots))

    def dispatch(self, x_TD, routing):
        experts_TK, weights_TK = routing.experts_TK, routing.weights_TK
        t, k = experts_TK.shape
        e_local = self.num_local_experts
        n = self.num_experts // e_local
        rows = rank_rows(experts_TK, weights_TK, e_local, n, self.dedup)
        q, j = rows.local_TQJ.shape[1:]
        slots_U = jnp.sum(rows.local_TQJ < e_local, axis=2).reshape(-1)
        capacity = peer_capacity(t, k, self.num_experts, e_local, self.buffer_factor, self.dedup)
        ex = send_rows(x_TD, rows.dest_TQ.reshape(-1), row_payload(rows), slots_U, rows_per_token=q, num_peers=n,
                       axis_name=self.axis_name, capacity=capacity, fill=float(e_local))
        x = ex.x_XD.shape[0]
        local = self.local(e_local, max_slots=min(x * j, n * capacity.slots))
        x_RD, group_sizes_E, local_handle = local.dispatch(ex.x_XD, received_pairs(ex.payload_XW, j, e_local))
        overflow = jnp.sum(jnp.where(ex.kept_U, 0, slots_U))
        return x_RD, group_sizes_E, EpHandle(ex, local, local_handle, q, overflow)

    def combine(self, y_RD, h: EpHandle):
        y_XD = h.local.combine(y_RD, h.local_handle)
        return sum_rows(send_back(y_XD, h.exchange, axis_name=self.axis_name), h.rows_per_token, y_RD.dtype)

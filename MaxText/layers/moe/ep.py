"""Expert-parallel dispatch and combine, inside shard_map over the mesh axis `expert`.

Each of the N devices on the axis holds E/N experts. Dispatch sorts this device's token-slots by destination
device, keeping their token order within each destination, and sends each destination its contiguous chunk;
the receiver regroups what arrives by local expert. Combine sends every processed row back to the slot it
came from.

The exchange is `jax.lax.ragged_all_to_all` where the platform has it (GPU, TPU). XLA:CPU has no
ragged all-to-all, so there the same exchange, with the same arguments and result, runs as one
`all_to_all` of fixed per-peer buffers (`capacity` rows each). Buffers default to the dropless worst
case; a smaller ragged_buffer_factor shrinks them, and the slots that do not fit are counted as
overflow and contribute nothing: they are never dropped silently. Overflow order: the slots of a device's
last tokens (in batch order) to a full peer, whichever of its experts they chose, so no expert is starved
because of its id.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


class Dispatch(NamedTuple):
    x_RD: jax.Array             # rows received from all peers, [N * capacity, D]; padding rows are 0
    local_expert_R: jax.Array   # int32 local expert of each received row; num_local_experts on padding
    payload_R: jax.Array | None  # the optional per-slot payload (e.g. router weights), received alongside
    order_S: jax.Array          # the sort of this device's slots by destination device (stable: token order)
    counts_NN: jax.Array        # slots each device wanted to send each device, [src, dst]
    sent_NN: jax.Array          # what fitted in the buffers: min(counts, capacity)
    overflow: jax.Array         # int32 slots of this device that did not fit
    capacity: int               # rows per peer (static)


def peer_capacity(tokens: int, top_k: int, num_experts: int, num_local_experts: int, factor) -> int:
    """Rows one device may send to one peer. The dropless worst case is tokens * min(K, E/N): a token's K
    experts are distinct. With a factor: the balanced share tokens*K/N times the factor, capped there."""
    worst = tokens * min(top_k, num_local_experts)
    if factor is None:
        return worst
    peers = num_experts // num_local_experts
    return max(1, min(worst, math.ceil(tokens * top_k / peers * factor)))


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
def dispatch(x_SD, experts_S, *, num_experts: int, num_local_experts: int, axis_name: str, capacity: int,
             payload_S=None) -> Dispatch:
    """Sends every slot (and its payload row, if given) to the device holding its expert (global id e
    lives on device e // E_local)."""
    n = num_experts // num_local_experts
    me = jax.lax.axis_index(axis_name)
    # By destination, then slot (token-major) order: when a peer's buffer is full, the slots of this device's
    # last tokens overflow, whichever of the peer's experts they chose. (Sorting by expert id would make the
    # peer's highest-id experts lose every overflow, step after step.)
    order_S = jnp.argsort(experts_S // num_local_experts, stable=True)
    experts_sorted = experts_S[order_S]
    counts_N = jnp.sum(jax.nn.one_hot(experts_sorted // num_local_experts, n, dtype=jnp.int32), axis=0)
    sent_N = jnp.minimum(counts_N, capacity)
    counts_NN = jax.lax.all_gather(counts_N, axis_name)  # [src, dst]
    sent_NN = jnp.minimum(counts_NN, capacity)
    args = dict(input_offsets=_exclusive_cumsum(counts_N), send_sizes=sent_N,
                output_offsets=_exclusive_cumsum(sent_NN, axis=0)[me], recv_sizes=sent_NN[:, me],
                axis_name=axis_name, max_send=capacity)
    rows = n * capacity
    x_RD = checkpoint_name(ragged_exchange(x_SD[order_S], jnp.zeros((rows,) + x_SD.shape[1:], x_SD.dtype), **args),
                           "moe_dispatch")
    local_R = ragged_exchange((experts_sorted % num_local_experts)[:, None],
                              jnp.full((rows, 1), num_local_experts, jnp.int32), **args)[:, 0]
    payload_R = None if payload_S is None else ragged_exchange(
        payload_S[order_S], jnp.zeros((rows,) + payload_S.shape[1:], payload_S.dtype), **args)
    overflow = jnp.sum(counts_N - sent_N)
    return Dispatch(x_RD, local_R, payload_R, order_S, counts_NN, sent_NN, overflow, capacity)


@jax.named_scope("moe_combine")
def combine(out_RD, d: Dispatch, *, axis_name: str):
    """Returns each processed row to its slot, in the slots' original order [S, D]; overflowed slots are 0."""
    me = jax.lax.axis_index(axis_name)
    slots = d.order_S.shape[0]
    back = ragged_exchange(
        out_RD, jnp.zeros((slots,) + out_RD.shape[1:], out_RD.dtype),
        input_offsets=_exclusive_cumsum(d.sent_NN[:, me]), send_sizes=d.sent_NN[:, me],
        output_offsets=_exclusive_cumsum(d.counts_NN, axis=1)[:, me], recv_sizes=d.sent_NN[me],
        axis_name=axis_name, max_send=d.capacity)
    return back[jnp.argsort(d.order_S)]

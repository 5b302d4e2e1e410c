"""The expert-parallel exchange in two hops (ep_two_hop), inside shard_map over the mesh axis `expert` when that axis
spans slices (dcn_expert_parallelism > 1): the network carries one row per (token, destination slice), NVLink
the fan-out inside the slice, as NCCL EP's high-throughput kernels and DeepEP do.

The N devices of the axis are `nodes` slices of `node` devices each; device p sits in slice p // node at position
p % node (sharding.device_grid: the DCN part of an axis is its major part). A slice holds E / nodes experts.

    hop 1  each token's choices grouped by slice (ep.rank_rows at slice granularity): one row per destination slice,
           carrying its (slice-local expert id, weight) pairs, sent to the device at the sender's own position in
           that slice (between slices: the sender's "rail");
    hop 2  the receiving device (the relay) groups each received row's pairs by device inside its slice: one row per
           destination device, carrying its (local expert id, weight) pairs;
    then   the experts run on the rows' slots (the local dispatcher: LocalSort or AlignedSort), each row returns its
           router-weighted sum to the relay, which adds up each hop-1 row's returns and sends one row back per
           (token, slice); the sender adds up its token's rows.

The same result as ep.ExpertParallel (the sums in another order). Buffers: hop 1 per (sender, slice) the balanced
T*K/nodes slots times ragged_buffer_factor, hop 2 per (relay, device) T*K/node times it, or the dropless worst
cases (hop_capacities); the slots that do not fit are counted as overflow where they are cut (a token's own slice
for hop 1, the relay for hop 2), never dropped silently.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.layers.moe.ep import (Capacity, Exchange, peer_capacity, rank_rows, received_pairs, row_payload, send_back,
                                  send_rows, sum_rows)


class TwoHopHandle(NamedTuple):
    first: Exchange
    second: Exchange
    local: object
    local_handle: object
    rows_per_token: int     # hop 1 rows per token
    rows_per_row: int       # hop 2 rows per hop-1 row
    overflow: jax.Array     # slots this device cut: of its own tokens in hop 1, of the rows it relays in hop 2


def hop_capacities(tokens: int, top_k: int, num_experts: int, num_local_experts: int, node: int, factor):
    """(hop 1's per destination slice, hop 2's per destination device) budgets for `tokens` per device."""
    n = num_experts // num_local_experts
    per_slice = num_experts // (n // node)
    first = peer_capacity(tokens, top_k, num_experts, per_slice, factor)
    received = (n // node) * first.rows  # hop 1's receive buffer: a row per (token, slice) from each slice
    slots = received * min(top_k, per_slice, num_local_experts)  # each row's pairs on one device, at most
    if factor is not None:
        slots = max(1, min(slots, math.ceil(tokens * top_k / node * factor)))
    return first, Capacity(min(received, slots), slots)


class TwoHop(NamedTuple):
    """ExpertParallel's interface (dispatch, combine) over two hops; `node` devices of the axis per slice."""
    num_experts: int
    num_local_experts: int
    node: int
    local: type
    axis_name: str = "expert"
    buffer_factor: float | None = None

    def _geometry(self):
        n = self.num_experts // self.num_local_experts
        me = jax.lax.axis_index(self.axis_name)
        return n, n // self.node, self.num_experts // (n // self.node), me // self.node, me % self.node

    def dispatch(self, x_TD, routing):
        n, nodes, per_slice, my_slice, my_position = self._geometry()
        t, k = routing.experts_TK.shape
        first_cap, second_cap = hop_capacities(t, k, self.num_experts, self.num_local_experts, self.node,
                                               self.buffer_factor)
        with jax.named_scope("hop1"):
            rows = rank_rows(routing.experts_TK, routing.weights_TK, per_slice, nodes, True)
            q1, j1 = rows.local_TQJ.shape[1:]
            slots_U = jnp.sum(rows.local_TQJ < per_slice, axis=2).reshape(-1)
            dest_U = jnp.where(rows.dest_TQ < nodes, rows.dest_TQ * self.node + my_position, n).reshape(-1)
            first = send_rows(x_TD, dest_U, row_payload(rows), slots_U, rows_per_token=q1, num_peers=n,
                              axis_name=self.axis_name, capacity=first_cap, fill=float(per_slice), senders=nodes)
            lost = jnp.sum(jnp.where(first.kept_U, 0, slots_U))
        with jax.named_scope("hop2"):
            pairs = received_pairs(first.payload_XW, j1, per_slice)
            rows = rank_rows(pairs.experts_TK, pairs.weights_TK, self.num_local_experts, self.node, True)
            q2, j2 = rows.local_TQJ.shape[1:]
            # a row of empty pairs (a buffer's padding, a row's unused pairs) has no destination and no slot
            slots_U = jnp.where(rows.dest_TQ < self.node, jnp.sum(rows.local_TQJ < self.num_local_experts, axis=2),
                                0).reshape(-1)
            dest_U = jnp.where(rows.dest_TQ < self.node, my_slice * self.node + rows.dest_TQ, n).reshape(-1)
            second = send_rows(first.x_XD, dest_U, row_payload(rows), slots_U, rows_per_token=q2, num_peers=n,
                               axis_name=self.axis_name, capacity=second_cap, fill=float(self.num_local_experts),
                               senders=self.node)
            lost = lost + jnp.sum(jnp.where(second.kept_U, 0, slots_U))
        x = second.x_XD.shape[0]
        local = self.local(self.num_local_experts, max_slots=min(x * j2, self.node * second_cap.slots))
        received = received_pairs(second.payload_XW, j2, self.num_local_experts)
        x_RD, group_sizes_E, local_handle = local.dispatch(second.x_XD, received)
        return x_RD, group_sizes_E, TwoHopHandle(first, second, local, local_handle, q1, q2, lost)

    def combine(self, y_RD, h: TwoHopHandle):
        y_XD = h.local.combine(y_RD, h.local_handle)
        y_X1D = sum_rows(send_back(y_XD, h.second, axis_name=self.axis_name), h.rows_per_row, y_RD.dtype)
        return sum_rows(send_back(y_X1D, h.first, axis_name=self.axis_name), h.rows_per_token, y_RD.dtype)

    def overflows(self, routing):
        """Whether this device's rows would overflow a hop's budget, from the routing alone: hop 1 from its tokens;
        hop 2, any relay's, from every device's (rows per slice and device, all-gathered: N x N counts)."""
        n, nodes, per_slice, _, _ = self._geometry()
        t, k = routing.experts_TK.shape
        first_cap, second_cap = hop_capacities(t, k, self.num_experts, self.num_local_experts, self.node,
                                               self.buffer_factor)
        device_TK = routing.experts_TK // self.num_local_experts  # the device on the axis holding each choice
        on_TN = jnp.any(jax.nn.one_hot(device_TK, n, dtype=jnp.int32) > 0, axis=1)  # token t has a slot on device
        slots_TN = jnp.sum(jax.nn.one_hot(device_TK, n, dtype=jnp.int32), axis=1)
        rows_S = jnp.sum(jnp.any(on_TN.reshape(t, nodes, self.node), axis=2), axis=0)  # hop-1 rows per slice
        over = jnp.any(rows_S > first_cap.rows) | jnp.any(jnp.sum(slots_TN, 0).reshape(nodes, self.node).sum(1)
                                                           > first_cap.slots)
        # hop 2: device s's rows reach relay (slice m, position s % node), which sends each to the devices of m
        counts = jax.lax.all_gather(jnp.stack([jnp.sum(on_TN, 0), jnp.sum(slots_TN, 0)]), self.axis_name)
        relay = counts.reshape(nodes, self.node, 2, nodes, self.node).sum(0)  # [position, 2, slice, device]
        return over | jnp.any(relay[:, 0] > second_cap.rows) | jnp.any(relay[:, 1] > second_cap.slots)


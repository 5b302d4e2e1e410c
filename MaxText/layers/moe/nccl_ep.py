"""The NCCL EP dispatcher (dispatch.py's interface): Transformer Engine's ep_dispatch and ep_combine.

Unlike the other dispatchers it acts on the global arrays, outside shard_map: TE partitions its NCCL EP ops
itself (their leading dim split over the batch axes, `expert` innermost). dispatch returns each rank's
receive buffer, [N, R, D] with R = recv_capacity_per_rank rows, whose expert groups NCCL EP already aligns
to 128 rows (its token_counts are the aligned sizes), and group sizes [N, E/N]; the grouped expert FFN runs
per rank in between (MeshLayout.run over the leading dim); combine weights each row by the router weight
that travelled with it (NCCL EP's combine is an unweighted sum) and returns every token's sum.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.layers.moe.dispatch import ALIGN
from MaxText.layers.moe.te_runtime import bootstrapped_capacity, tokens_per_ep_rank


def overflow_rows(total_N1, recv_cap: int):
    """Receive rows over capacity, over all ranks, from NCCL EP's per-rank pre-drop totals (float32)."""
    return jnp.sum(jnp.maximum(total_N1 - recv_cap, 0)).astype(jnp.float32)


class NcclHandle(NamedTuple):
    handle_mem: jax.Array     # NCCL EP's routing state, per rank
    counts_NE: jax.Array      # the aligned group sizes NCCL EP reported
    weights_NR: jax.Array     # float32 router weight of every received row (0 past the last group)
    overflow: jax.Array       # receive rows over capacity, over all ranks
    tokens: int               # the global token count, T


class NcclEp(NamedTuple):
    """te: TE's modules (te_runtime.import_te, or a stand-in); cfg: the run's config; layout: the MeshLayout."""
    te: dict
    cfg: object
    layout: object

    def _layer(self):
        return self.te["ep"].EpLayerConfig(top_k=self.cfg.num_experts_per_tok,
                                           dispatch_output_per_expert_alignment=ALIGN)

    @jax.named_scope("moe_dispatch")
    def dispatch(self, x_TD, routing):
        mesh, layout = jax.sharding.get_abstract_mesh(), self.layout
        tokens_per_rank = tokens_per_ep_rank({axis: mesh.shape[axis] for axis in layout.batch}, x_TD.shape[0])
        # The capacity NCCL EP was bootstrapped with (te_runtime.ep_recv_capacity of the run's batch), never one
        # recomputed from this call's tokens: its buffers were sized then.
        recv_cap = bootstrapped_capacity(self.te, self.cfg, tokens_per_rank, layout.num_ep, x_TD.shape[-1])
        # TE's ep_prepare/ep_dispatch partitioning folds only `expert` into a replicated leading dim: a token
        # array left to the partitioner would send T/ep rows per rank and overrun the send buffer sized at
        # bootstrap for T/ranks. Pin all three to the batch axes, `expert` innermost, as TE's moe.py does.
        experts_TK, x_bf16_TD, weights_TK = (jax.lax.with_sharding_constraint(a, P(layout.batch)) for a in (
            routing.experts_TK, x_TD.astype(jnp.bfloat16), routing.weights_TK.astype(jnp.float32)))
        recv_NRD, recv_w_NR, handle_mem, counts_NE, total_N1 = self.te["ep"].ep_dispatch(
            self._layer(), experts_TK, x_bf16_TD, weights_TK, recv_cap)
        recv_NRD = checkpoint_name(recv_NRD, "moe_dispatch")
        # NCCL EP zero-fills the padding between expert groups but leaves the rows past the last group
        # uninitialized (TE moe.py, tests/jax/test_multi_process_ep.py). The last group takes them as slack
        # (TE's V1 grouped GEMM wants sum(group_sizes) == rows): zero them and their weights first, or they
        # reach that expert's output, its weight gradient and any FP8 scale. Groups are cut at the buffer's
        # end, should NCCL EP report pre-drop sizes after an overflow.
        sizes_NE = jnp.diff(jnp.minimum(jnp.cumsum(counts_NE, axis=1), recv_cap), axis=1, prepend=0)
        valid_NR = jnp.arange(recv_cap)[None, :] < jnp.sum(sizes_NE, axis=1, keepdims=True)
        x_NRD = jnp.where(valid_NR[:, :, None], recv_NRD, jnp.zeros((), recv_NRD.dtype))
        # Overflow in receive rows over capacity (NCCL EP's demand includes each group's 128-row padding): an
        # upper bound on the token copies dropped, exact when whole padded groups are cut.
        overflow = overflow_rows(total_N1, recv_cap)
        handle = NcclHandle(handle_mem, counts_NE, jnp.where(valid_NR, recv_w_NR, 0.0), overflow, x_TD.shape[0])
        return x_NRD, sizes_NE, handle

    @jax.named_scope("moe_combine")
    def combine(self, y_NRD, h: NcclHandle):
        weighted_NRD = (y_NRD.astype(jnp.float32) * h.weights_NR[:, :, None]).astype(y_NRD.dtype)
        # num_local_tokens is the GLOBAL token count (TE moe.py passes the global (B, S)); ep_combine's
        # partitioning splits it over the ranks.
        return self.te["ep"].ep_combine(self._layer(), h.handle_mem, h.counts_NE, weighted_NRD,
                                        num_local_tokens=h.tokens)

"""The MoE layer module: router gate, selection bias and expert weights, computed by the impl `moe_impl` names."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from MaxText.layers.mlp import MLP
from MaxText.layers.moe import dense, dropless, te_block, te_kernels
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.layout import merge_batch, mesh_layout, slice_scope
from MaxText.layers.moe.router import Choice, choose, float32_logits, routing_stats
from MaxText.layers.params import fan_in_init, param
from MaxText.parallel.sharding import constrain


class MoeBias(nnx.Variable):
    """The aux-loss-free routing bias: state, not a parameter. The optimizer never sees it; the train step
    moves it by routed_bias_update_rate from the measured load, and checkpoints save it."""


# moe_impl -> moe_ffn(x_TD, routing, ExpertWeights, cfg, rules) -> (y_TD, {"overflow": real token-slots that got
# no expert output, over all devices}): dense's capacity drops, the dropless impls' EP buffer overflow.
MOE_FFNS = {"dense": dense.moe_ffn, "ragged": dropless.moe_ffn, "te_dropless": dropless.moe_ffn}


def _pooled(parts: list, rows: int):
    """The parts' per-token arrays, [rows * L, ...] each, as one for the whole batch, in its row order (merge_batch):
    every device's tokens stay on it, where concatenating the parts all-gathered them (the split H100 step gathered
    7.4 GiB of expert choices a GPU)."""
    if len(parts) == 1:
        return parts[0]
    return merge_batch(tuple(p.reshape(rows, -1, *p.shape[1:]) for p in parts)).reshape(-1, *parts[0].shape[1:])


class MoeBlock(nnx.Module):
    """Routed experts. Weight names, shapes and logical axes are the same under every moe_impl, so one
    checkpoint restores under any of them."""

    def __init__(self, cfg, *, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.base_emb_dim, cfg.base_moe_mlp_dim
        self.gate = param(rngs, fan_in_init(0, 1), (d, e), ("embed", None), weight_dtype)
        self.wi_0 = param(rngs, fan_in_init(1, 2, 0), (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.wi_1 = param(rngs, fan_in_init(1, 2, 0), (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.wo = param(rngs, fan_in_init(1, 2, 0), (e, f, d), ("exp", "mlp", "embed"), weight_dtype)
        if cfg.routed_bias:
            self.bias = MoeBias(jnp.zeros((e,), jnp.float32), out_sharding=(None,), eager_sharding=False)
        if cfg.shared_experts:
            self.shared_experts = MLP(d, cfg.shared_experts * f, dtype=dtype, weight_dtype=weight_dtype, rules=rules,
                                      rngs=rngs, quantization=cfg.quantization)
        self.cfg = cfg
        self.rules = rules

    def __call__(self, x_BLD, segment_ids_BL=None):
        """Returns y_BLD and this layer's stats: lb_loss, z_loss, load_E, entropy, bias_abs_mean,
        overflow (real token-slots that got no expert output), dropped_fraction (overflow / real slots) and, with
        moe_dropless_fallback=layer, fallback (1 when the layer took its worst-case buffers).
        Tokens with segment id 0 are padding: routed, but no load (see router.route). A split batch
        (use_batch_split_schedule: x_BLD and segment_ids_BL tuples of parts) gives a tuple of outputs and the
        stats of all parts together, as one batch would."""
        if isinstance(x_BLD, tuple):
            return self.parts(x_BLD, segment_ids_BL)
        (y_BLD,), stats = self.parts((x_BLD,), (segment_ids_BL,))
        return y_BLD, stats

    def parts(self, xs_BLD: tuple, segment_ids: tuple):
        """The parts of a batch side by side: each routes, dispatches, runs its experts and combines on its own
        (under the name scope batch_split<k>: MaxText.planning.overlap reads that no part's exchange waits for
        another's compute); the losses and statistics pool every part's choices."""
        cfg = self.cfg
        bias = self.bias[...] if cfg.routed_bias else None
        # te_dropless selects with its kernel set's top-k (TE's fused router, or the reference: the same choice as
        # route's own, computed from the logits again). te_moe_block: TE's fused block routes inside; choosing
        # here, on the block's own logits with the same top-k, gives what it does not return (load, losses,
        # statistics; te_block.py).
        topk = te_kernels.kernels(cfg).topk if cfg.moe_impl == "te_dropless" else None
        logits = te_block.gate_logits if cfg.te_moe_block else float32_logits
        weights = ExpertWeights(self.wi_0[...], self.wi_1[...], self.wo[...])
        if len(xs_BLD) > 1 and MOE_FFNS[cfg.moe_impl] is dropless.moe_ffn and not cfg.te_moe_block:
            # gathered over FSDP once for all the parts (each part's shard_map gathered its own: twice the traffic)
            weights = mesh_layout(self.rules).gather_once(weights, xs_BLD[0].dtype)
        ys, choices, valids = [], [], []
        overflow = fallback = jnp.zeros((), jnp.float32)
        for k, (x_BLD, segment_ids_BL) in enumerate(zip(xs_BLD, segment_ids, strict=True)):
            with slice_scope("batch_split", k, len(xs_BLD)):
                b, l, d = x_BLD.shape
                # DeepSeek's shared experts: every token, no routing. Nothing here depends on the routed path nor
                # it on this, so XLA's scheduler is free to run these GEMMs while the dispatch's all-to-all is in
                # flight.
                shared_BLD = self.shared_experts(x_BLD) if cfg.shared_experts else None
                x_TD = x_BLD.reshape(b * l, d)
                valid_T = None if segment_ids_BL is None else segment_ids_BL.reshape(-1) != 0
                choice = choose(x_TD, self.gate[...], bias, cfg, topk=topk, logits=logits)
                if cfg.te_moe_block:
                    y_TD, impl_stats = te_block.moe_ffn(x_BLD, self.gate[...], bias, weights, cfg, self.rules)
                else:
                    y_TD, impl_stats = MOE_FFNS[cfg.moe_impl](x_TD, routing_stats(choice, cfg, valid_T), weights, cfg,
                                                              self.rules)
                y_BLD = constrain(y_TD.reshape(b, l, d), ("activation_batch", "activation_length", "activation_embed"),
                                  self.rules)
                ys.append(y_BLD if shared_BLD is None else y_BLD + shared_BLD)
            choices.append(choice)
            valids.append(valid_T)
            overflow = overflow + jnp.asarray(impl_stats["overflow"], jnp.float32)
            fallback = fallback + impl_stats.get("fallback", 0.0)
        rows = xs_BLD[0].shape[0]  # each part's
        pooled = Choice(*(_pooled(fields, rows) for fields in zip(*choices)))
        valid_T = None if valids[0] is None else _pooled(valids, rows)
        routing = routing_stats(pooled, cfg, valid_T)
        stats = {"lb_loss": routing.lb_loss, "z_loss": routing.z_loss, "load_E": routing.load_E,
                 "entropy": routing.entropy,
                 "bias_abs_mean": jnp.mean(jnp.abs(bias)) if bias is not None else jnp.zeros((), jnp.float32)}
        slots = (pooled.experts_TK.shape[0] if valid_T is None else jnp.sum(valid_T)) * cfg.num_experts_per_tok
        stats.update(overflow=overflow, dropped_fraction=overflow / jnp.maximum(slots, 1))
        if cfg.moe_dropless_fallback == "layer":  # the parts of the batch that took the worst-case buffers
            stats["fallback"] = fallback
        return tuple(ys), stats

    def moe_load(self, load_E) -> dict:
        """This layer's load in the shape of its MoeBias state (routed_bias=true)."""
        return {"bias": load_E}

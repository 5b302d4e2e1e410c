"""Decoder layers, layer stacks (scanned or unrolled) and the remat policy that wraps each layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.schema import REMAT_TENSOR_NAMES
from MaxText.layers.attention import Attention
from MaxText.layers.attention_mla import MLA
from MaxText.layers.linear import gather_once
from MaxText.layers.mlp import MLP
from MaxText.layers.moe.block import MoeBlock
from MaxText.layers.moe.layout import merge_batch, slice_scope, split_batch
from MaxText.layers.norms import RMSNorm


def apply_split(layer_fn, parts: int, x_BLD, positions_BL, segment_ids_BL):
    """layer_fn(x, positions, segment_ids) -> (x, stats) on the batch split in `parts` (whole when 1), merged after."""
    if parts == 1:
        return layer_fn(x_BLD, positions_BL, segment_ids_BL)
    x, stats = layer_fn(*(split_batch(a, parts) for a in (x_BLD, positions_BL, segment_ids_BL)))
    return merge_batch(x), stats


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) with a dense MLP or routed experts."""

    def __init__(self, cfg, *, moe: bool, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        d, eps = cfg.base_emb_dim, cfg.normalization_layer_epsilon
        self.pre_self_attention_norm = RMSNorm(d, epsilon=eps, **kw)
        attention = MLA if cfg.attention_type == "mla" else Attention
        self.self_attention = attention(cfg, rules=rules, **kw)
        self.post_self_attention_norm = RMSNorm(d, epsilon=eps, **kw)
        if moe:
            self.moe = MoeBlock(cfg, rules=rules, **kw)
        else:
            self.mlp = MLP(d, cfg.base_mlp_dim, rules=rules, quantization=cfg.quantization, **kw)
        self.is_moe = moe

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        """Returns the new residual stream and this layer's MoE stats ({} for a dense layer). A split batch
        (split_batch: tuples of parts) gives a tuple of parts, each part's layer under the name scope
        batch_split<k>, and the MoE stats of all parts together."""
        if isinstance(x_BLD, tuple):
            return self.parts(x_BLD, positions_BL, segment_ids_BL)
        (x_BLD,), stats = self.parts((x_BLD,), (positions_BL,), (segment_ids_BL,))
        return x_BLD, stats

    def parts(self, xs_BLD: tuple, positions: tuple, segment_ids: tuple):
        with gather_once(len(xs_BLD)):  # the parts share each dense weight's FSDP gather (the experts': MoeBlock.parts)
            return self._layer(xs_BLD, positions, segment_ids)

    def _layer(self, xs_BLD: tuple, positions: tuple, segment_ids: tuple):
        xs, normed = [], []
        for k, (x_BLD, positions_BL, segment_ids_BL) in enumerate(zip(xs_BLD, positions, segment_ids, strict=True)):
            with slice_scope("batch_split", k, len(xs_BLD)):
                h = self.self_attention(self.pre_self_attention_norm(x_BLD), positions_BL, segment_ids_BL)
                xs.append(x_BLD + h)
                normed.append(self.post_self_attention_norm(xs[-1]))
        if self.is_moe:
            hs, stats = self.moe(tuple(normed), tuple(segment_ids))  # each part under its scope there
        else:
            hs, stats = [], {}
            for k, n in enumerate(normed):
                with slice_scope("batch_split", k, len(normed)):
                    hs.append(self.mlp(n))
        return tuple(x + h for x, h in zip(xs, hs, strict=True)), stats

    def moe_load(self, load_E) -> dict:
        """This MoE layer's load in the shape of its MoeBias state."""
        return {"moe": self.moe.moe_load(load_E)}

    def decode(self, x_BTD, start, cache: dict):
        """The layer on T new tokens at positions start.. of every row, attention through its KV cache (the
        attention's decode); (x, new cache)."""
        h, cache = self.self_attention.decode(self.pre_self_attention_norm(x_BTD), start, cache)
        x_BTD = x_BTD + h
        normed = self.post_self_attention_norm(x_BTD)
        if self.is_moe:
            (h,), _ = self.moe((normed,), (jnp.ones(x_BTD.shape[:2], jnp.int32),))
        else:
            h = self.mlp(normed)
        return x_BTD + h, cache


def remat_policy(cfg):
    """jax.checkpoint policy for remat_policy; None means no rematerialisation at all."""
    policies = jax.checkpoint_policies
    if cfg.remat_policy == "none":
        return None
    if cfg.remat_policy == "full":
        return policies.nothing_saveable
    if cfg.remat_policy == "minimal":
        return policies.save_only_these_names(*REMAT_TENSOR_NAMES)
    saved = [n for n in REMAT_TENSOR_NAMES if cfg[n] == "device"]
    offloaded = [n for n in REMAT_TENSOR_NAMES if cfg[n] == "offload"]
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
        offload_src="device", offload_dst="pinned_host")


def call_remat(layer: DecoderLayer, x_BLD, positions_BL, segment_ids_BL, policy, remat: bool):
    """One layer under the remat policy outside a scan: an unrolled LayerStack's layers, an MTP depth's."""
    if not remat:
        return layer(x_BLD, positions_BL, segment_ids_BL)
    graphdef, state = nnx.split(layer)
    apply = jax.checkpoint(lambda s, x: nnx.merge(graphdef, s)(x, positions_BL, segment_ids_BL), policy=policy)
    return apply(state, x_BLD)


class LayerStack(nnx.Module):
    """`count` identical layers. Scanned: one layer module whose params carry a leading `layers` axis,
    applied by lax.scan (one compiled layer body). Unrolled: attributes layers_0 ... layers_{n-1}."""

    def __init__(self, cfg, count: int, *, moe: bool, scan: bool, rngs: nnx.Rngs, **kw):
        self.count, self.scan = count, scan
        make = lambda r: DecoderLayer(cfg, moe=moe, rngs=r, **kw)  # noqa: E731
        if scan:
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_stacked(r):
                return make(r)
            self.layers = make_stacked(rngs)
        else:
            for i in range(count):
                setattr(self, f"layers_{i}", make(rngs))

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, policy, remat: bool):
        """Returns x and the per-layer stats stacked on a leading axis of size `count`."""

        if self.scan:
            graphdef, state = nnx.split(self.layers)

            def apply(s, x):
                return nnx.merge(graphdef, s)(x, positions_BL, segment_ids_BL)

            if remat:  # inside a scan CSE cannot merge the recomputation away, so it need not be prevented
                apply = jax.checkpoint(apply, policy=policy, prevent_cse=False)
            return jax.lax.scan(lambda x, s: apply(s, x), x_BLD, state)
        per_layer = []
        for i in range(self.count):
            x_BLD, stats = call_remat(getattr(self, f"layers_{i}"), x_BLD, positions_BL, segment_ids_BL, policy, remat)
            per_layer.append(stats)
        return x_BLD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)

    def decode(self, x_BTD, start, cache: dict):
        """DecoderLayer.decode through every layer, the cache stacked on a leading layer axis; (x, new cache)."""
        if self.scan:
            graphdef, state = nnx.split(self.layers)

            def one(x, layer):
                s, c = layer
                return nnx.merge(graphdef, s).decode(x, start, c)

            return jax.lax.scan(one, x_BTD, (state, cache))
        caches = []
        for i in range(self.count):
            x_BTD, c = getattr(self, f"layers_{i}").decode(x_BTD, start, jax.tree.map(lambda a: a[i], cache))
            caches.append(c)
        return x_BTD, jax.tree.map(lambda *cs: jnp.stack(cs), *caches)

    def moe_load(self, load_LE) -> dict:
        """The stacked per-layer load [count, E] in the shape of this stack's MoeBias state: the scanned layer's
        one [count, E] bias takes it whole, unrolled layer i row i."""
        if self.scan:
            return {"layers": self.layers.moe_load(load_LE)}
        return {f"layers_{i}": getattr(self, f"layers_{i}").moe_load(load_LE[i]) for i in range(self.count)}

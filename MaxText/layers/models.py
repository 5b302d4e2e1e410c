"""The decoder-only Transformer: embed -> dense layers -> MoE layers -> norm -> logits."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from MaxText.config.load import batch_parts, layer_counts
from MaxText.layers.attention import Attention
from MaxText.layers.attention_mla import MLA
from MaxText.layers.decoder import LayerStack, apply_split, remat_policy
from MaxText.layers.embed import Embed
from MaxText.layers.moe.router import bias_update
from MaxText.layers.mtp import MultiTokenPrediction
from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import dtype_of


class Transformer(nnx.Module):
    """Layers 0 .. first_num_dense_layers-1 have a dense MLP; the rest routed experts (when num_experts > 1)."""

    def __init__(self, cfg, rules=None, *, rngs: nnx.Rngs):
        cfg = ml_collections.FrozenConfigDict(cfg)  # hashable: module attributes end up in the graphdef
        kw = dict(dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype), rules=rules, rngs=rngs)
        moe = cfg.num_experts > 1
        num_dense, num_moe = layer_counts(cfg)
        self.token_embedder = Embed(cfg, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
        if num_dense:
            self.dense_layers = LayerStack(cfg, num_dense, moe=False, scan=cfg.scan_layers, **kw)
        if num_moe:
            self.moe_layers = LayerStack(cfg, num_moe, moe=True, scan=cfg.scan_layers, **kw)
        self.decoder_norm = RMSNorm(cfg.base_emb_dim, epsilon=cfg.normalization_layer_epsilon,
                                    dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
        if cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(cfg, moe=moe, **kw)
        self.num_dense, self.num_moe = num_dense, num_moe
        self.batch_parts = batch_parts(cfg)
        self.remat = cfg.remat_policy != "none"
        self.policy = remat_policy(cfg) if self.remat else None

    def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None):
        """float32 logits [B, L, V] and MoE stats per MoE layer ({} for a dense model)."""
        h_BLD, stats = self.hidden(tokens_BL, positions_BL, segment_ids_BL)
        return self.logits(h_BLD), stats

    def logits(self, h_BLD):
        return self.token_embedder.logits(self.decoder_norm(h_BLD))

    def hidden(self, tokens_BL, positions_BL=None, segment_ids_BL=None):
        """The final hidden state before the decoder norm [B, L, D], and the MoE stats."""
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
        if segment_ids_BL is None:
            segment_ids_BL = jnp.ones_like(tokens_BL)

        def stacks(x, positions_BL, segment_ids_BL):
            if self.num_dense:
                x, _ = self.dense_layers(x, positions_BL, segment_ids_BL, self.policy, self.remat)
            stats = {}
            if self.num_moe:
                x, stats = self.moe_layers(x, positions_BL, segment_ids_BL, self.policy, self.remat)
            return x, stats

        # use_batch_split_schedule: split once, every layer runs the parts side by side, merged at the end
        return apply_split(stacks, self.batch_parts, self.token_embedder(tokens_BL), positions_BL, segment_ids_BL)


    def decode(self, tokens_BT, start, cache: dict):
        """float32 logits [B, T, V] of T new tokens at positions start .. start + T - 1 of every row, each attending
        the cached positions before it and itself, and the cache with theirs written in (init_cache's tree). The
        prefill is a decode of the whole prompt at start 0; each step after it one token. No MTP head."""
        x = self.token_embedder(tokens_BT)
        new = {}
        for name in ("dense_layers", "moe_layers"):
            if name in cache:
                x, new[name] = getattr(self, name).decode(x, start, cache[name])
        return self.logits(x), new


def init_cache(cfg, batch: int, length: int) -> dict:
    """Zeros for every layer's KV cache of `batch` rows and `length` positions, in the activation dtype, each stack's
    stacked on a leading layer axis: {"dense_layers": ..., "moe_layers": ...} as the model has them."""
    shapes = (MLA if cfg.attention_type == "mla" else Attention).cache_shapes(cfg, batch, length)
    num_dense, num_moe = layer_counts(cfg)
    return {name: {k: jnp.zeros((count, *shape), dtype_of(cfg.dtype)) for k, shape in shapes.items()}
            for name, count in (("dense_layers", num_dense), ("moe_layers", num_moe)) if count}


def moe_load(model: Transformer, load_LE, mtp_load_KE=None) -> dict:
    """The MoE layers' load (stats["load_E"], one row per MoE layer) and the MTP depths' in the shape of the
    model's MoeBias state (nnx.to_pure_dict(nnx.state(model, MoeBias)), which exists with routed_bias: then
    every MoE block has a bias): each module maps its own children."""
    tree = {}
    if model.num_moe:
        tree["moe_layers"] = model.moe_layers.moe_load(load_LE)
    if getattr(model, "mtp", None) is not None and mtp_load_KE is not None:
        tree["mtp"] = model.mtp.moe_load(mtp_load_KE)
    return tree


def update_moe_bias(aux: dict, load: dict, rate: float) -> dict:
    """Moves every MoE routing bias by its own layer's load: `load` is moe_load's tree, in the shape of `aux`
    (the model's MoeBias state as a pure dict). A bias without a load, or a load without a bias, raises."""
    return jax.tree.map(lambda bias, load_E: bias_update(bias, load_E, rate), aux, load)

"""Multi-Token Prediction (DeepSeek-V3): extra depths that predict tokens further ahead.

Depth k (1..mtp_num_layers) combines the previous depth's hidden state at position i (depth 0: the main
model's final hidden state, before its norm) with the embedding of token i+k, through RMSNorms and a
[2D, D] projection, runs one decoder layer, and predicts token i+k+1 with the main model's output head.
Embedding and head are shared with the main model. Positions whose target lies past the sequence or in
another document are masked. The loss is the mean over depths, scaled by mtp_loss_scaling_factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config.load import batch_parts
from MaxText.layers.decoder import DecoderLayer, apply_split, call_remat, remat_policy
from MaxText.layers.losses import cross_entropy
from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import fan_in_init, param


def shift_left(x_BL, k: int, fill=0):
    """x[:, i + k] at position i; the last k positions get `fill`."""
    return jnp.concatenate([x_BL[:, k:], jnp.full(x_BL[:, :k].shape, fill, x_BL.dtype)], axis=1)


class MTPDepth(nnx.Module):
    def __init__(self, cfg, *, moe: bool, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        d, eps = cfg.base_emb_dim, cfg.normalization_layer_epsilon
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(d, epsilon=eps, **kw)
        self.embedding_norm = RMSNorm(d, epsilon=eps, **kw)
        self.projection = param(rngs, fan_in_init(0, 1), (2 * d, d), (None, "embed"), weight_dtype)
        self.layer = DecoderLayer(cfg, moe=moe, rules=rules, **kw)
        self.final_norm = RMSNorm(d, epsilon=eps, **kw)
        self.dtype = dtype
        self.remat = cfg.remat_policy != "none"
        self.policy = remat_policy(cfg) if self.remat else None
        self.batch_parts = batch_parts(cfg)  # the depth's layer takes the batch in parts too (NCCL EP's one size)

    def __call__(self, h_BLD, next_embedding_BLD, positions_BL, segment_ids_BL):
        joined = jnp.concatenate([self.hidden_norm(h_BLD), self.embedding_norm(next_embedding_BLD)], axis=-1)
        h_BLD = joined @ self.projection[...].astype(self.dtype)

        def layer(x, positions, segment_ids):
            return call_remat(self.layer, x, positions, segment_ids, self.policy, self.remat)

        return apply_split(layer, self.batch_parts, h_BLD, positions_BL, segment_ids_BL)

    def moe_load(self, load_E) -> dict:
        return {"layer": self.layer.moe_load(load_E)}


class MultiTokenPrediction(nnx.Module):
    """mtp_num_layers sequential depths (attributes mtp_1, mtp_2, ...)."""

    def __init__(self, cfg, *, moe: bool, dtype, weight_dtype, rules, rngs: nnx.Rngs):
        self.depths = cfg.mtp_num_layers
        self.tiles = cfg.num_vocab_tiling
        for k in range(1, self.depths + 1):
            setattr(self, f"mtp_{k}", MTPDepth(cfg, moe=moe, dtype=dtype, weight_dtype=weight_dtype, rules=rules,
                                               rngs=rngs))

    def __call__(self, h_BLD, batch, embedder):
        """(mean cross-entropy over depths, per-depth MoE stats stacked on a leading axis ({} if dense))."""
        inputs, targets, segments = batch["inputs"], batch["targets"], batch["inputs_segmentation"]
        losses, per_depth = [], []
        for k in range(1, self.depths + 1):
            depth = getattr(self, f"mtp_{k}")
            h_BLD, stats = depth(h_BLD, embedder(shift_left(inputs, k)), batch["inputs_position"], segments)
            # Target of position i at depth k is token i+k+1: targets[i+k], inside the same document.
            target_k = shift_left(targets, k)
            real = (shift_left(batch["targets_segmentation"], k) != 0) & (shift_left(segments, k) == segments)
            weights = real.astype(jnp.float32)
            losses.append(cross_entropy(h_BLD, target_k, weights,
                                        lambda h, depth=depth: embedder.logits(depth.final_norm(h)), self.tiles))
            per_depth.append(stats)
        return jnp.mean(jnp.stack(losses)), jax.tree.map(lambda *xs: jnp.stack(xs), *per_depth)

    def moe_load(self, load_KE) -> dict:
        """The per-depth load [depths, E] in the shape of the depths' MoeBias state, depth k row k - 1."""
        return {f"mtp_{k}": getattr(self, f"mtp_{k}").moe_load(load_KE[k - 1]) for k in range(1, self.depths + 1)}

"""Token cross-entropy from hidden states, optionally in tiles so the [tokens, V] logits never exist whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(h_BLD, targets_BL, weights_BL, logits_fn, tiles: int = 1):
    """Weighted token-mean cross-entropy of logits_fn(h) (float32 logits) against integer targets.

    With tiles > 1 (`num_vocab_tiling`, MaxText's name) the B*L tokens go through logits_fn and the loss
    in that many tiles, each rematerialised in the backward: only one tile's float32 logits and softmax
    exist at a time, instead of all of them being kept from the forward for the backward.
    """
    denominator = jnp.maximum(jnp.sum(weights_BL), 1.0)
    if tiles == 1:
        xent_BL = optax.softmax_cross_entropy_with_integer_labels(logits_fn(h_BLD), targets_BL)
        return jnp.sum(xent_BL * weights_BL) / denominator
    b, l, d = h_BLD.shape
    tokens = b * l
    size = -(-tokens // tiles)
    pad = size * tiles - tokens  # padded tokens carry weight 0

    def tile(x, fill=0):
        # Tile i takes tokens i, i + tiles, i + 2 tiles, ...: every device's block of tokens splits evenly over
        # the tiles, so each tile stays split over the same devices as the batch. (Contiguous tiles would put
        # a tile's tokens on 1/tiles of the devices, and the partitioner would instead split the logits'
        # contraction dim and all-reduce float32 [tokens, V] partial logits for every tile.)
        x = x.reshape(tokens, *x.shape[2:])
        x = jnp.concatenate([x, jnp.full((pad, *x.shape[1:]), fill, x.dtype)]) if pad else x
        return jnp.swapaxes(x.reshape(size, tiles, *x.shape[1:]), 0, 1)

    @jax.checkpoint
    def tile_loss(args):
        h_TD, targets_T, weights_T = args
        xent_T = optax.softmax_cross_entropy_with_integer_labels(logits_fn(h_TD[None])[0], targets_T)
        return jnp.sum(xent_T * weights_T)

    sums = jax.lax.map(tile_loss, (tile(h_BLD), tile(targets_BL), tile(weights_BL)))
    return jnp.sum(sums) / denominator

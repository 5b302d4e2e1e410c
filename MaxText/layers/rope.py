"""Rotary position embeddings (RoPE)."""

from __future__ import annotations

import jax.numpy as jnp


def rope_frequencies(head_dim: int, max_timescale: float):
    """Inverse wavelengths theta^(-2i/d) for the head_dim/2 rotated feature pairs."""
    return 1.0 / (max_timescale ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x_BLHK, positions_BL, max_timescale: float):
    """Rotates feature pairs (x[i], x[i + K/2]) by position * frequency_i (the 'half' layout)."""
    k = x_BLHK.shape[-1]
    angles_BLk = positions_BL[..., None].astype(jnp.float32) * rope_frequencies(k, max_timescale)
    sin, cos = jnp.sin(angles_BLk)[:, :, None, :], jnp.cos(angles_BLk)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)

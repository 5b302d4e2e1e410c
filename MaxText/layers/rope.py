"""Rotary position embeddings (RoPE), with YaRN frequency scaling for context extension (DeepSeek-V3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, max_timescale: float):
    """Inverse wavelengths theta^(-2i/d) for the head_dim/2 rotated feature pairs."""
    return 1.0 / (max_timescale ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def _pair_with_rotations(rotations: float, rope_dim: int, max_timescale: float, original_max_position: int) -> float:
    """The (fractional) pair index i whose frequency theta^(-2i/d) turns `rotations` times over
    original_max_position positions: solves original_max_position / (2 pi theta^(2i/d)) = rotations for i."""
    return rope_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(max_timescale))


def yarn_frequencies(rope_dim: int, max_timescale: float, factor: float, original_max_position: int,
                     beta_fast: float, beta_slow: float):
    """YaRN's 'NTK-by-parts' inverse wavelengths for the rope_dim/2 pairs (float32 [rope_dim/2]).

    Pair i's base frequency theta^(-2i/d) turns r_i = original_max_position * freq_i / (2 pi) times over the
    original context. Pairs with r_i > beta_fast (high frequency, small i) keep their frequency (they
    "extrapolate": their wavelength is short, so longer contexts add no unseen angles); pairs with
    r_i < beta_slow (low frequency, large i) are divided by `factor` (position interpolation). In between,
    DeepSeek-V3's convention: the ramp is linear in the pair index, from low = floor(i at beta_fast) to
    high = ceil(i at beta_slow), clamped to [0, rope_dim - 1] (DeepSeek bounds by the full dim, not dim/2):
        ramp_i = clip((i - low) / (high - low), 0, 1)      # 0 on the fast side, 1 on the slow side
        keep_i = 1 - ramp_i                                # DeepSeek's `smooth`: weight of the original
        freq_i = (freq_i / factor) * (1 - keep_i) + freq_i * keep_i
    With factor == 1 both terms are the base frequency, so this is plain RoPE.
    """
    low = max(math.floor(_pair_with_rotations(beta_fast, rope_dim, max_timescale, original_max_position)), 0)
    high = min(math.ceil(_pair_with_rotations(beta_slow, rope_dim, max_timescale, original_max_position)),
               rope_dim - 1)
    if low == high:
        high += 0.001  # the ramp becomes a step instead of dividing by zero
    base = rope_frequencies(rope_dim, max_timescale)
    ramp = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp
    return (base / factor) * (1.0 - keep) + base * keep


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature coefficient 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_frequencies_for(cfg, rope_dim: int):
    """The inverse wavelengths [rope_dim/2] that cfg.rope_type (default | yarn) asks for."""
    if cfg.rope_type == "yarn":
        return yarn_frequencies(rope_dim, cfg.rope_max_timescale, cfg.rope_factor,
                                cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow)
    return rope_frequencies(rope_dim, cfg.rope_max_timescale)


def apply_rope(x_BLHK, positions_BL, max_timescale: float | None = None, frequencies_K2=None,
               interleave: bool = False, scale: float = 1.0):
    """Rotates feature pairs (x[i], x[i + K/2]) by position * frequency_i (the 'half' layout), or with
    `interleave` the pairs (x[2i], x[2i + 1]) in place (DeepSeek's release; MaxText's rope_interleave), and
    multiplies the rotated features by `scale` (YaRN's attention factor, on cos and sin as transformers has it).

    The frequencies are rope_frequencies(K, max_timescale) unless `frequencies_K2` [K/2] is given
    (e.g. from rope_frequencies_for, for YaRN); pass exactly one of the two.
    """
    k = x_BLHK.shape[-1]
    assert (max_timescale is None) != (frequencies_K2 is None), "pass max_timescale or frequencies_K2, not both"
    if frequencies_K2 is None:
        frequencies_K2 = rope_frequencies(k, max_timescale)
    assert frequencies_K2.shape == (k // 2,), (frequencies_K2.shape, k)
    angles_BLk = positions_BL[..., None].astype(jnp.float32) * frequencies_K2.astype(jnp.float32)
    sin, cos = jnp.sin(angles_BLk)[:, :, None, :], jnp.cos(angles_BLk)[:, :, None, :]
    x = x_BLHK.astype(jnp.float32)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if scale != 1.0:
        out = out * scale
    return out.astype(x_BLHK.dtype)


def interleaved(cfg) -> bool:
    """Whether this config rotates interleaved pairs: rope_interleave, which (as in MaxText) applies to YaRN."""
    return cfg.rope_type == "yarn" and cfg.rope_interleave


def attention_factor(cfg) -> float:
    """The factor on the rotated query and key features: rope_attention_factor under YaRN, else 1."""
    return float(cfg.rope_attention_factor) if cfg.rope_type == "yarn" else 1.0


def static_rope_frequencies(cfg, rope_dim: int) -> tuple:
    """rope_frequencies_for as a hashable tuple of floats, for a module attribute: it depends on the config
    only, and evaluating it eagerly keeps modules constructible inside jit."""
    with jax.ensure_compile_time_eval():
        return tuple(np.asarray(rope_frequencies_for(cfg, rope_dim), np.float32).tolist())

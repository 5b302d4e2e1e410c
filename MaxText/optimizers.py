"""Optax optimizer: AdamW with linear warmup and cosine decay, after global-norm gradient clipping."""

from __future__ import annotations

import optax


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to cosine_learning_rate_final_fraction of it."""
    total = cfg.learning_rate_schedule_steps or cfg.steps
    warmup = int(cfg.warmup_steps_fraction * total)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup, decay_steps=max(total, warmup + 1),
        end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction)


def optimizer(cfg) -> optax.GradientTransformation:
    """clip_by_global_norm (when gradient_clipping_threshold is set) -> AdamW."""
    # mu_dtype: Adam's first moment in another dtype than the weights (DeepSeek-V3 and NVIDIA's reference keep
    # it in bf16: a quarter of fp32 AdamW's optimizer memory); the second moment stays in the weights' dtype.
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.adam_weight_decay, mu_dtype=cfg.mu_dtype)
    if cfg.gradient_clipping_threshold is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)

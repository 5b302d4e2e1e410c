"""Optax optimizer: AdamW with a warmup-cosine or warmup-stable-decay schedule, after global-norm gradient clipping."""

from __future__ import annotations

import optax


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then to cosine_learning_rate_final_fraction of it either by cosine
    decay over the rest (lr_schedule_type=cosine) or, warmup-stable-decay (wsd), held at the peak and decayed
    over the last wsd_decay_steps_fraction, linearly or by a cosine (wsd_decay_style). DeepSeek-V3's
    published schedule is wsd with a cosine decay. Past learning_rate_schedule_steps the final value holds."""
    total = cfg.learning_rate_schedule_steps or cfg.steps
    warmup = int(cfg.warmup_steps_fraction * total)
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.cosine_learning_rate_final_fraction
    if cfg.lr_schedule_type == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=max(total, warmup + 1), end_value=end)
    decay = int(cfg.wsd_decay_steps_fraction * total)
    stable = max(total - warmup - decay, 0)
    if cfg.wsd_decay_style == "cosine":
        decay_fn = optax.cosine_decay_schedule(peak, max(decay, 1), alpha=end / peak if peak else 0.0)
    else:
        decay_fn = optax.linear_schedule(peak, end, max(decay, 1))
    return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)), optax.constant_schedule(peak),
                                 decay_fn], [warmup, warmup + stable])


def optimizer(cfg) -> optax.GradientTransformation:
    """clip_by_global_norm (when gradient_clipping_threshold is set) -> AdamW."""
    # mu_dtype: Adam's first moment in another dtype than the weights (DeepSeek-V3 and NVIDIA's reference keep
    # it in bf16: a quarter of fp32 AdamW's optimizer memory); the second moment stays in the weights' dtype.
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.adam_weight_decay, mu_dtype=cfg.mu_dtype)
    if cfg.gradient_clipping_threshold is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)

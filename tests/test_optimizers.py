"""The learning-rate schedules: warmup-cosine and warmup-stable-decay (DeepSeek-V3's), against their definitions."""

import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.step.optimizers import learning_rate_schedule
from tests.tiny import tiny_config


def _lr(cfg, steps):
    schedule = learning_rate_schedule(cfg)
    return np.array([float(schedule(s)) for s in steps])


def test_deepseek_v3_schedule_warmup_stable_cosine_decay():
    """DeepSeek-V3 (tech report 4.2): linear warmup to 2.2e-4 over 2K steps, held, cosine decay to 2.2e-5."""
    total, warmup, decay = 10_000, 2_000, 3_000
    cfg = tiny_config("learning_rate=2.2e-4", f"learning_rate_schedule_steps={total}", "lr_schedule_type=wsd",
                      f"warmup_steps_fraction={warmup / total}", f"wsd_decay_steps_fraction={decay / total}",
                      "wsd_decay_style=cosine", "cosine_learning_rate_final_fraction=0.1")
    steps = np.array([0, 1000, 2000, 4000, 6999, 7000, 8500, 10_000, 12_000])
    cosine = 2.2e-5 + (2.2e-4 - 2.2e-5) * 0.5 * (1 + np.cos(np.pi * np.clip(steps - 7000, 0, decay) / decay))
    want = np.where(steps < warmup, 2.2e-4 * steps / warmup, np.where(steps < 7000, 2.2e-4, cosine))
    np.testing.assert_allclose(_lr(cfg, steps), want, rtol=1e-5, err_msg=str(steps))


def test_wsd_linear_decay_and_the_cosine_default():
    cfg = tiny_config("learning_rate=1.0", "learning_rate_schedule_steps=100", "lr_schedule_type=wsd",
                      "warmup_steps_fraction=0.1", "wsd_decay_steps_fraction=0.2", "cosine_learning_rate_final_fraction=0.0")
    np.testing.assert_allclose(_lr(cfg, [5, 10, 50, 80, 90, 100, 150]), [0.5, 1, 1, 1, 0.5, 0, 0], atol=1e-6)
    cfg = tiny_config("learning_rate=1.0", "learning_rate_schedule_steps=100", "warmup_steps_fraction=0.1",
                      "cosine_learning_rate_final_fraction=0.0")
    np.testing.assert_allclose(_lr(cfg, [5, 10, 55, 100]), [0.5, 1, 0.5, 0], atol=1e-6)


def test_wsd_phases_must_fit_the_schedule():
    with pytest.raises(ConfigError, match="exceed 1"):
        tiny_config("lr_schedule_type=wsd", "warmup_steps_fraction=0.5", "wsd_decay_steps_fraction=0.6")
    with pytest.raises(ConfigError, match="wsd_decay_style=exp is not one of"):
        tiny_config("wsd_decay_style=exp")

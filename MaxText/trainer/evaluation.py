"""Evaluation during training: eval_steps batches of the eval split, read once and kept on device, and the
token-weighted mean cross-entropy of a state over them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.data import make_data
from MaxText.step.train_step import jit_eval_step


def whole_split(data) -> list:
    """eval_steps=-1: this process's eval batches up to the first one that is padding on every process (the
    eval stream pads after one pass over its split), so that all processes run the same number."""
    batches = []
    while True:
        batch = next(data)
        done = not np.any(batch["targets_segmentation"])
        if jax.process_count() > 1:
            done = bool(np.all(multihost_utils.process_allgather(np.int32(done))))
        if done:
            return batches
        batches.append(batch)


class Evaluator:
    """eval_steps batches of eval_split, read once and kept on device (they are the same every time), and the
    token-weighted mean cross-entropy of a state over them."""

    def __init__(self, cfg, spec, batch_sharding, global_batch: int):
        data = make_data(cfg, global_batch, jax.process_index(), jax.process_count(), split="eval")
        local = [next(data) for _ in range(cfg.eval_steps)] if cfg.eval_steps != -1 else whole_split(data)
        self.batches = [jax.make_array_from_process_local_data(batch_sharding, batch) for batch in local]
        self.step = jit_eval_step(cfg, spec, batch_sharding)

    def __call__(self, state) -> dict:
        sums = jax.device_get([self.step(state, batch) for batch in self.batches])
        loss_sum, tokens = sum(s["loss_sum"] for s in sums), sum(s["tokens"] for s in sums)
        loss = float(loss_sum / max(tokens, 1.0))
        record = {"eval_loss": loss, "eval_perplexity": float(np.exp(loss)), "eval_tokens": int(tokens)}
        if "moe_overflow" in sums[0]:  # per MoE layer, over all eval batches
            overflow = np.sum([s["moe_overflow"] for s in sums], axis=0)
            slots = max(float(sum(s["moe_slots"] for s in sums)), 1.0)
            record.update(eval_moe_overflow=overflow.tolist(), eval_moe_dropped_fraction=(overflow / slots).tolist())
        return record

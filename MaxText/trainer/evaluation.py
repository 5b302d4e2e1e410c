"""Evaluation during training: eval_steps batches of the eval split, read once and kept on device, and the
token-weighted mean cross-entropy of a state over them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.config.load import with_buffer
from MaxText.data import make_data
from MaxText.step.state import with_config
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
    token-weighted mean cross-entropy of a state over them. The MoE receive buffers are eval_ragged_buffer_factor's
    (unset: ragged_buffer_factor's); with moe_dropless_fallback=step a batch that overflowed them is evaluated again
    with the worst-case buffers, as upstream MaxText does."""

    def __init__(self, cfg, spec, batch_sharding, global_batch: int):
        data = make_data(cfg, global_batch, jax.process_index(), jax.process_count(), split="eval")
        local = [next(data) for _ in range(cfg.eval_steps)] if cfg.eval_steps != -1 else whole_split(data)
        self.batches = [jax.make_array_from_process_local_data(batch_sharding, batch) for batch in local]
        bounded = with_buffer(cfg, cfg.eval_ragged_buffer_factor or cfg.ragged_buffer_factor)
        self.step = jit_eval_step(bounded, spec if bounded is cfg else with_config(spec, bounded), batch_sharding)
        self.worst = None
        if cfg.moe_dropless_fallback == "step" and bounded.ragged_buffer_factor is not None:
            worst = with_buffer(cfg, None)
            self.worst = jit_eval_step(worst, with_config(spec, worst), batch_sharding)

    def __call__(self, state) -> dict:
        sums = jax.device_get([self.step(state, batch) for batch in self.batches])
        rerun = [i for i, s in enumerate(sums) if self.worst is not None and np.sum(s["moe_overflow"]) > 0]
        for i in rerun:
            sums[i] = jax.device_get(self.worst(state, self.batches[i]))
        loss_sum, tokens = sum(s["loss_sum"] for s in sums), sum(s["tokens"] for s in sums)
        loss = float(loss_sum / max(tokens, 1.0))
        record = {"eval_loss": loss, "eval_perplexity": float(np.exp(loss)), "eval_tokens": int(tokens)}
        if "moe_overflow" in sums[0]:  # per MoE layer, over all eval batches
            overflow = np.sum([s["moe_overflow"] for s in sums], axis=0)
            slots = max(float(sum(s["moe_slots"] for s in sums)), 1.0)
            record.update(eval_moe_overflow=overflow.tolist(), eval_moe_dropped_fraction=(overflow / slots).tolist())
        if self.worst is not None:
            record["eval_moe_rerun_batches"] = len(rerun)
        if "moe_fallback" in sums[0]:  # moe_dropless_fallback=layer: layers that took the worst-case buffers
            record["eval_moe_dropless_fallback_layers"] = float(np.sum([s["moe_fallback"] for s in sums]))
        return record

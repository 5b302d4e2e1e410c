"""The compiled programs a run's train steps go through, and which one runs each step.

Without moe_dropless_fallback=step there is one, the train step. With it (upstream MaxText's meaning), a step first
runs with the configured bounded receive buffers (ragged_buffer_factor); when any MoE layer overflowed, that program
returns the state it was given, unchanged, and the worst-case-buffer program runs the same step again on the same
batch (load.worst_case_program: remat_policy=full, so that it needs little more memory than the bounded one): nothing
is dropped and the step's result is a worst-case run's. retry_dropless_first_steps=N runs the first N
steps after a (re)start with the worst-case program directly, or, with first_phase_ragged_buffer_factor, first tries
them with that larger bound. Each program is compiled once: the worst-case one before the first step, so that a
program that cannot compile or fit stops the run at its start, not at its first overflow.

Knowing whether a step overflowed takes the host a wait for the step (one flag) before it dispatches the next.
"""

from __future__ import annotations

import jax

from MaxText.config.load import with_buffer, worst_case_program
from MaxText.step.state import with_config
from MaxText.step.train_step import jit_train_step


class StepPrograms:
    """programs(step, state, batch) -> (state, metrics) for 0-based `step`; with moe_dropless_fallback=step the
    metrics count the steps rerun so far (moe_step_replays)."""

    def __init__(self, cfg, spec, batch_sharding, start: int, log):
        self.cfg, self.start, self.log = cfg, start, log
        self.step_mode = cfg.moe_dropless_fallback == "step"
        self.attempt = jit_train_step(cfg, spec, batch_sharding, rollback=self.step_mode)
        self.worst = self.first = None
        self.replays, self.compiled = 0, False
        if self.step_mode:
            worst = worst_case_program(cfg)
            self.worst = jit_train_step(worst, with_config(spec, worst), batch_sharding)
            if cfg.first_phase_ragged_buffer_factor:
                first = with_buffer(cfg, cfg.first_phase_ragged_buffer_factor)
                self.first = jit_train_step(first, with_config(spec, first), batch_sharding, rollback=True)

    def __call__(self, step: int, state, batch):
        if not self.step_mode:
            return self.attempt(state, batch)
        if not self.compiled:
            self.worst, self.compiled = self.worst.lower(state, batch).compile(), True
            self.log("moe_dropless_fallback=step: compiled the program that reruns a step which overflowed (worst-case "
                     "buffers, ragged_buffer_factor=null, under remat_policy=full)")
        first_phase = step - self.start < self.cfg.retry_dropless_first_steps
        if first_phase and self.first is None:
            state, metrics = self.worst(state, batch)
        else:
            bounded = self.first if first_phase else self.attempt
            state, metrics = bounded(state, batch)
            if bool(jax.device_get(metrics.pop("moe_overflowed"))):
                self.replays += 1
                factor = self.cfg.first_phase_ragged_buffer_factor if first_phase else self.cfg.ragged_buffer_factor
                self.log(f"step {step + 1}: an MoE layer overflowed its receive buffer (ragged_buffer_factor={factor}); "
                         f"the step was undone and runs again with the worst-case buffers (replay {self.replays})")
                state, metrics = self.worst(state, batch)
        return state, {**metrics, "moe_step_replays": self.replays}

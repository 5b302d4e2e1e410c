"""`profiler: xplane`: a JAX trace of a few steps, for XProf or TensorBoard's profile plugin.

MaxText's keys: tracing starts after `skip_first_n_steps_for_profiler` steps of this run (so compilation
and warm-up stay out) and covers `profiler_steps` steps; the trace lands under <run>/tensorboard/plugins/
profile/<time>/ on every process. The MoE stages are named scopes (moe_route, moe_dispatch,
moe_grouped_gemm, moe_combine), so their device time reads directly off the trace.
"""

from __future__ import annotations

import os


class Profiler:
    """Starts and stops the trace around the configured steps of the train loop."""

    def __init__(self, cfg, run_dir: str, first_step: int, log):
        self.enabled = cfg.profiler == "xplane"
        self.start_step = first_step + cfg.skip_first_n_steps_for_profiler
        self.stop_step = self.start_step + cfg.profiler_steps
        self.directory = os.path.join(run_dir, "tensorboard")
        self.log, self.active = log, False

    def before_step(self, step: int) -> None:
        """Called before dispatching step `step` (0-based: it produces state step + 1)."""
        if self.enabled and step == self.start_step and not self.active:
            import jax

            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, step: int, state) -> None:
        """Called after dispatching step `step`; stops once the last traced step has finished."""
        if self.active and step + 1 >= self.stop_step:
            self.stop(state)

    def stop(self, state=None) -> None:
        if not self.active:
            return
        import jax

        if state is not None:
            jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
        jax.profiler.stop_trace()
        self.active = False
        self.log(f"profile of steps {self.start_step + 1}..{self.stop_step} written under "
                 f"{self.directory}/plugins/profile")

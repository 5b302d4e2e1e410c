"""Where a run starts: its newest checkpoint that restores (with the input position saved beside it), else
load_full_state_path or load_parameters_path, else a fresh init.
"""

from __future__ import annotations

import jax

from MaxText.config.errors import ConfigError
from MaxText.config.storage import describe
from MaxText.data.records import DataError
from MaxText.step.state import create_state
from MaxText.trainer import checkpointing


def input_position(saved, step: int, log):
    """This process's input position from a checkpoint's saved positions; None (the input stream restarts)
    when there are none or they were written by a different number of processes."""
    if saved is None:
        log(f"warning: the checkpoint of step {step} holds no input position; the input stream restarts from its "
            "beginning")
        return None
    if saved["process_count"] != jax.process_count():
        log(f"warning: the checkpoint of step {step} holds input positions for {saved['process_count']} processes "
            f"and this run has {jax.process_count()}; the input stream restarts from its beginning")
        return None
    return saved["positions"][jax.process_index()]


class Resumed:
    """An input stream resumed at a checkpoint's position, its first batch already read (a position the
    pipeline cannot resume from fails while the checkpoint is restored, not at the first step); state() is the
    position before that batch until it is taken."""

    def __init__(self, data):
        self.data, self.began = data, data.state()
        self.first = next(data)

    def __next__(self):
        if self.first is None:
            return next(self.data)
        batch, self.first = self.first, None
        return batch

    def state(self):
        return self.began if self.first is not None else self.data.state()


def initial_state(cfg, mesh, spec, checkpointer, log, make_input):
    """(state, input stream) from this run's newest readable checkpoint whose input position the pipeline can
    resume, else load_full_state_path (with its input position when saved beside it) or load_parameters_path
    (input from its beginning), else a fresh init. make_input(position) makes the stream (position None: from
    its beginning)."""
    def resumed(step, restored):
        state, saved_input = restored
        position = input_position(saved_input, step, log)
        try:
            return state, (Resumed(make_input(position)) if position is not None else make_input(None))
        except (ConfigError, DataError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the pipeline makes of a position it could not have saved
            raise ValueError(f"its input position cannot be resumed: {describe(e)}") from None

    latest = checkpointer.restore_latest(spec.abstract, log, resume=resumed, fatal=(DataError,))
    if latest is not None:
        step, (state, data) = latest
        log(f"resuming from {checkpointer.directory}/{step}")
        return state, data
    if cfg.load_full_state_path:
        log(f"loading the full state from {cfg.load_full_state_path}")
        state, saved_input = checkpointing.load_full_state(cfg.load_full_state_path, spec.abstract, cfg)
        try:
            return resumed(int(state["step"]), (state, saved_input))
        except DataError:
            raise
        except ValueError as e:
            raise ConfigError(f"load_full_state_path={cfg.load_full_state_path}: {e}; give a checkpoint this "
                              "input pipeline wrote") from None
    state = create_state(cfg, mesh, spec)
    if cfg.load_parameters_path:
        params, bias = checkpointing.load_params(cfg.load_parameters_path, spec.abstract["params"], cfg,
                                                 spec.abstract.get("nnx_aux"))
        state["params"] = params
        if bias is not None:
            state["nnx_aux"] = bias
        log("loaded the params" + (" and the MoE routing biases" if bias is not None else "")
            + f" of {cfg.load_parameters_path} (step 0"
            + ("; the checkpoint holds no routing bias: it starts at zero" if "nnx_aux" in spec.abstract
               and bias is None else "") + ")")
    return state, make_input(None)

"""Orbax checkpoints under <base_output_directory>/<run_name>/checkpoints/<step>/items (MaxText's layout).

Start-up order, as in MaxText: an existing checkpoint of this run (auto-resume) first; else
load_parameters_path (params only, step 0) or load_full_state_path (everything); else a fresh init.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp
from etils import epath

from MaxText.config import ConfigError

ITEM = "items"


class Checkpointer:
    """A CheckpointManager for this run's checkpoint directory, saving the whole train state as `items`."""

    def __init__(self, cfg, checkpoint_dir: str):
        self.enabled = cfg.enable_checkpointing
        self.period = cfg.checkpoint_period
        self.directory = checkpoint_dir
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_num_checkpoints_to_keep,
            enable_async_checkpointing=cfg.async_checkpointing,
            create=True,
        )
        # Opened even when saving is off, so that a run can still resume from what is there.
        self.manager = ocp.CheckpointManager(epath.Path(checkpoint_dir), options=options, item_names=(ITEM,)) \
            if self.enabled or os.path.isdir(checkpoint_dir) else None

    def latest_step(self):
        return self.manager.latest_step() if self.manager else None

    def due(self, step: int, *, last: bool) -> bool:
        """Whether step is saved: multiples of checkpoint_period and the last step (once)."""
        return self.enabled and (last or step % self.period == 0) and step != self.latest_step()

    def save(self, step: int, state) -> None:
        self.manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(state)}), force=True)

    def restore(self, step: int, abstract_state):
        args = ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract_state)})
        return self.manager.restore(step, args=args)[ITEM]

    def close(self):
        """Waits for any async save to finish."""
        if self.manager:
            self.manager.wait_until_finished()
            self.manager.close()


def _item_dir(path: str, key: str) -> str:
    path = os.path.abspath(path)  # Orbax's OCDBT store needs absolute paths
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path} does not exist; point it at a checkpoint's item directory, "
                          "e.g. <run>/checkpoints/<step>/items")
    if os.path.isdir(os.path.join(path, ITEM)):  # accept .../checkpoints/<step> too
        path = os.path.join(path, ITEM)
    return path


def load_full_state(path: str, abstract_state):
    """The whole train state (step, params, optimizer) from an item directory."""
    path = _item_dir(path, "load_full_state_path")
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract_state)


def load_params(path: str, abstract_params):
    """Only the params of a saved train state (the optimizer state on disk is not read)."""
    path = _item_dir(path, "load_parameters_path")
    restore_args = ocp.checkpoint_utils.construct_restore_args({"params": abstract_params})
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args=restore_args, partial_restore=True))
    return restored["params"]


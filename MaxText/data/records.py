"""What every input pipeline shares: the batch's arrays, the saved input position, the document column, the
files of a glob, and DataError for a document met mid-run that cannot be used.
"""

from __future__ import annotations

from MaxText.config.errors import ConfigError, shown

class DataError(ValueError):
    """A document the pipeline cannot use, met while reading (what the start-up checks cannot see without reading
    every record): the message names the file, the row and the key to change. The trainer stops on it in one
    line, exit status 2, after checkpointing the last completed step."""


def resume_position(state, keys: tuple[str, ...], pipeline: str) -> dict[str, int]:
    """A saved input position `state` as {key: int} for the pipeline's keys, each a whole number of at least
    0; else ValueError saying why it cannot be resumed (a checkpoint's position well-formed as JSON but not one
    the pipeline could have written: the trainer then restores the checkpoint before it)."""
    bad = (not isinstance(state, dict) and "not a mapping") or next(
        (f"{k}={shown(state.get(k))}" for k in keys if type(state.get(k)) is not int or state[k] < 0), None)
    if bad:
        raise ValueError(f"the input position {shown(state)} cannot be resumed by {pipeline} ({bad}: it needs "
                         f"{', '.join(keys)}, each a whole number of at least 0)")
    return {k: state[k] for k in keys}


# The arrays of every pipeline's batch, each [rows, L] int32 (the first four in the order packing fills them).
BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")


def abstract_batch(global_batch: int, seq_len: int, sharding=None) -> dict:
    """The global batch as ShapeDtypeStructs (optionally with their sharding): what the train step is traced
    and compiled on without data."""
    import jax
    import jax.numpy as jnp

    return {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def text_column(cfg, split: str = "train") -> str:
    """The feature (column) holding each document: train_data_columns (eval: eval_data_columns), upstream's
    keys, a list of one name here (a bare name is taken as that list)."""
    key = "train_data_columns" if split == "train" else "eval_data_columns"
    columns = cfg[key]
    columns = [columns] if isinstance(columns, str) else list(columns)
    if len(columns) != 1 or not isinstance(columns[0], str) or not columns[0]:
        raise ConfigError(f"{key}={columns}: documents are read from one column here; give one name, e.g. "
                          f"{key}=[text]")
    return columns[0]


def glob_files(patterns: str, base: str | None = None) -> tuple[list[str], str | None]:
    """The files of comma-separated globs (relative ones under `base`; ~ expanded), absolute, sorted and
    deduplicated; and the first pattern that matched no file (None when each matched)."""
    import glob
    import os

    files, unmatched = set(), None
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        full = os.path.join(base or "", os.path.expanduser(pattern))
        found = [f for f in glob.glob(full, recursive=True) if os.path.isfile(f)]
        unmatched = unmatched or (None if found else full)
        files.update(os.path.abspath(f) for f in found)
    return sorted(files), unmatched

"""Orbax item directories read and written one slice at a time, through TensorStore, for the converters.

Items reads any Orbax PyTree item directory (OCDBT or not, zarr3 or zarr, as its _METADATA says: this trainer's
checkpoints, upstream MaxText's, the converters' output) array by array, a layer or an expert at a time.
create_items writes Orbax's non-OCDBT layout of a tree whose arrays are then filled slice by slice, so that a
conversion holds about one slice in memory, not the model. The converters that write a step (to_maxtext,
from_upstream, to_upstream) share their command-line paths (split_paths) and the step's all-or-nothing writing
(new_step_dir, write_step, save_shapes).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import NamedTuple

import ml_dtypes
import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.checks import remote_path_error
from MaxText.config.storage import check_output, read_json_file, shown_path


class Items:
    """The arrays of one Orbax item directory, by dot-joined tree path."""

    def __init__(self, path: str, key: str):
        meta_path = os.path.join(path, "_METADATA")
        if not os.path.isfile(meta_path):
            what = "does not exist" if not os.path.exists(path) else "is a file" if not os.path.isdir(path) else (
                "has no _METADATA")
            raise ConfigError(f"{key}={shown_path(path)} is not an Orbax item directory ({what}); give "
                              "<run>/checkpoints/<step>/items")
        meta = read_json_file(meta_path, "; the checkpoint is damaged", limit=80)
        if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata", {}), dict):
            raise ConfigError(f"{shown_path(meta_path)} holds a {type(meta).__name__}, not a JSON object with a "
                              "tree_metadata mapping; the checkpoint is damaged (or not Orbax's)")
        self.path, self.key = path, key
        self.ocdbt, self.zarr3 = bool(meta.get("use_ocdbt")), bool(meta.get("use_zarr3"))
        try:
            self.names = [".".join(str(k["key"]) for k in entry.get("key_metadata", ()))
                          for entry in meta.get("tree_metadata", {}).values()]
        except (AttributeError, KeyError, TypeError):
            raise ConfigError(f"{shown_path(meta_path)}: its tree_metadata is not Orbax's (entries with "
                              "key_metadata); the checkpoint is damaged") from None
        self._open = {}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def array(self, name: str):
        """The TensorStore of one array (opened once; reading it reads only the chunks asked for)."""
        import tensorstore as ts

        if name not in self._open:
            if self.ocdbt:
                kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": self.path}, "path": name}
            else:
                kvstore = {"driver": "file", "path": os.path.join(self.path, name)}
            try:
                self._open[name] = ts.open({"driver": "zarr3" if self.zarr3 else "zarr", "kvstore": kvstore,
                                            "open": True}, read=True).result()
            except Exception as e:  # noqa: BLE001 - TensorStore's errors are long: one line of the first
                raise ConfigError(f"{self.key}={shown_path(self.path)}: array {name} cannot be read "
                                  f"({str(e).splitlines()[0][:160]})") from None
        return self._open[name]

    def shape(self, name: str) -> tuple:
        return tuple(self.array(name).shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.array(name).dtype.numpy_dtype)

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return np.asarray(self.array(name)[index].read().result())


class ArrayOut(NamedTuple):
    """One array of a tree to write: its tree path, full shape, dtype, and chunk shape (a chunk per slice)."""

    key: tuple
    shape: tuple
    dtype: np.dtype
    chunk: tuple


ZARR_DTYPES = {np.dtype(np.float32): "<f4", np.dtype(np.float16): "<f2", np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def create_items(item_dir: str, arrays: list[ArrayOut]) -> dict:
    """Orbax's (non-OCDBT, zarr) layout of the tree, every array created full size and empty; returns
    {dot-joined path: TensorStore} to fill. Orbax writes the tree's structure with one-element stand-ins, then each
    array is recreated by TensorStore and the shapes in Orbax's metadata are set to the real ones."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorstore as ts

    for a in arrays:
        if np.dtype(a.dtype) not in ZARR_DTYPES:
            raise ConfigError(f"array {'.'.join(a.key)} is {np.dtype(a.dtype)}, which is not a parameter dtype here "
                              f"({', '.join(str(d) for d in ZARR_DTYPES)})")
    stand_ins = {}
    for a in arrays:
        node = stand_ins
        for k in a.key[:-1]:
            node = node.setdefault(k, {})
        node[a.key[-1]] = jnp.zeros((1,) * len(a.shape), a.dtype)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as checkpointer:
        checkpointer.save(item_dir, args=ocp.args.PyTreeSave(stand_ins))
    del stand_ins
    out = {}
    for a in arrays:
        name = ".".join(a.key)
        out[name] = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(item_dir, name)},
                             "metadata": {"shape": list(a.shape), "chunks": list(a.chunk),
                                          "dtype": ZARR_DTYPES[np.dtype(a.dtype)], "compressor": None,
                                          "dimension_separator": "."}},
                            create=True, delete_existing=True).result()
    shapes = {".".join(a.key): list(a.shape) for a in arrays}
    chunks = {".".join(a.key): list(a.chunk) for a in arrays}
    meta_path = os.path.join(item_dir, "_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    for entry in meta["tree_metadata"].values():
        entry["value_metadata"]["write_shape"] = shapes[".".join(str(k["key"]) for k in entry["key_metadata"])]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    for path in glob.glob(os.path.join(item_dir, "array_metadatas", "*")):
        with open(path) as f:
            info = json.load(f)
        for entry in info.get("array_metadatas", []):
            m = entry["array_metadata"]
            m["write_shape"], m["chunk_shape"] = shapes[m["param_name"]], chunks[m["param_name"]]
        with open(path, "w") as f:
            json.dump(info, f)
    return out


def split_paths(argv: list[str], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """({key: value} of the path keys, the rest for load_config); each required one present and local."""
    found, rest = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in required + optional:
            found[key] = value
        else:
            rest.append(arg)
    for key in required:
        if not found.get(key):
            raise ConfigError(f"{key}=<directory> is required")
        error = remote_path_error(key, found[key], "the converters read and write")
        if error:
            raise ConfigError(error)
    return found, rest


def new_step_dir(out_dir: str, key: str = "base_output_directory") -> str:
    """<out>/0 (absolute), refused when it exists, and the output directory checked (storage.check_output) before
    any work, so that nothing is converted in vain."""
    step_dir = os.path.join(check_output(key, out_dir), "0")
    if os.path.lexists(step_dir):
        raise ConfigError(f"{shown_path(step_dir)} exists already; choose another {key}")
    return step_dir


def write_step(step_dir: str, write) -> None:
    """write(partial) fills a temporary <out>/.0.partial, renamed to step_dir when it returns; removed otherwise,
    so the step directory appears complete or not at all."""
    partial = os.path.join(os.path.dirname(step_dir), ".0.partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        write(partial)
        os.replace(partial, step_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def save_shapes(directory: str, shapes: dict[tuple, tuple]) -> None:
    """The shapes-only manifest of a converted step ({tree path: shape} as this trainer's checkpoints record
    them), which the trainer checks a config against before restoring."""
    import orbax.checkpoint as ocp

    manifest = {"arrays": {"".join(f"['{k}']" for k in key): {"shape": list(shape)} for key, shape in shapes.items()}}
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        checkpointer.save(directory, args=ocp.args.JsonSave(manifest))

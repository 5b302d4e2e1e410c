"""Orbax item directories read and written one slice at a time, through TensorStore, for the converters.

Items reads any Orbax PyTree item directory (OCDBT or not, zarr3 or zarr, as its _METADATA says: this trainer's
checkpoints, upstream MaxText's, the converters' output) array by array, a layer or an expert at a time.
create_items writes Orbax's non-OCDBT layout of a tree whose arrays are then filled slice by slice, so that a
conversion holds about one slice in memory, not the model.
"""

from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

import ml_dtypes
import numpy as np

from MaxText.config import ConfigError


class Items:
    """The arrays of one Orbax item directory, by dot-joined tree path."""

    def __init__(self, path: str, key: str):
        meta_path = os.path.join(path, "_METADATA")
        if not os.path.isfile(meta_path):
            raise ConfigError(f"{key}={path} is not an Orbax item directory (no _METADATA); give "
                              "<run>/checkpoints/<step>/items")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{meta_path} is not valid JSON ({str(e)[:80]}); the checkpoint is damaged") from None
        self.path, self.key = path, key
        self.ocdbt, self.zarr3 = bool(meta.get("use_ocdbt")), bool(meta.get("use_zarr3"))
        self.names = [".".join(str(k["key"]) for k in entry.get("key_metadata", ()))
                      for entry in meta.get("tree_metadata", {}).values()]
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
                raise ConfigError(f"{self.key}={self.path}: array {name} cannot be read "
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

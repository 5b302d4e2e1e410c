"""Hugging Face checkpoint directories in the safetensors format, each tensor read only when asked for.

The format: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the tensors' bytes (offsets relative to the end
of the header). The `safetensors` package's numpy interface cannot return bfloat16 or float8 tensors (numpy
has neither; ml_dtypes does), which DeepSeek-V3's release is made of, so this module reads the file itself:
the headers up front, then one tensor's bytes per get() (np.fromfile at its offset; not a memory map, whose
touched pages would stay in the process's resident set for the whole conversion).

A directory holds one `model.safetensors`, or shards named by `model.safetensors.index.json`'s weight_map, or
(without an index) any number of `*.safetensors` files.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.storage import read_json_file, shown_path

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
FP8_BLOCK = 128  # DeepSeek-V3's release: one float32 weight_scale_inv per 128 x 128 block of each FP8 weight


def _header(path: str) -> tuple[dict, int]:
    """(header JSON, offset of the data section) of one file; ConfigError when it is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2 ** 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error, RecursionError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        raise ConfigError(f"{shown_path(path)} is not a readable safetensors file ({reason})") from None
    bad = "a JSON object" if not isinstance(header, dict) else next(
        (f"tensor {shown_path(name)} with dtype, shape and data_offsets" for name, entry in header.items()
         if name != "__metadata__" and not _well_formed(entry)), None)
    if bad:
        raise ConfigError(f"{shown_path(path)} is not a readable safetensors file (its header is not {bad})")
    return header, 8 + size


def _well_formed(entry) -> bool:
    """A header entry: {"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}."""
    ints = lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)  # noqa: E731
    return (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and ints(entry.get("shape"))
            and ints(entry.get("data_offsets")) and len(entry["data_offsets"]) == 2
            and entry["data_offsets"][0] <= entry["data_offsets"][1])


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory by name: get(name) reads one from its file."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            data = read_json_file(index)
            if not isinstance(data, dict):
                raise ConfigError(f"{shown_path(index)} is not valid JSON (not a JSON object)")
            weight_map = data.get("weight_map", {})
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{shown_path(index)}: weight_map is not a mapping of tensor name to file name")
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ConfigError(f"hf_model_path={shown_path(directory)} holds no *.safetensors files")
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                missing = next(t for t, f in weight_map.items() if f == name)
                raise ConfigError(f"{shown_path(path)} is missing (model.safetensors.index.json puts "
                                  f"{shown_path(missing)} there)")
            header, start = _header(path)
            tensors = {t: e for t, e in header.items() if t != "__metadata__"}
            end = start + max((e["data_offsets"][1] for e in tensors.values()), default=0)
            if os.path.getsize(path) < end:
                raise ConfigError(f"{shown_path(path)} is truncated: its header needs {end} bytes and the file has "
                                  f"{os.path.getsize(path)}")
            self.entries.update({t: (path, e, start) for t, e in tensors.items()})
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.entries))
            if absent:
                raise ConfigError(f"{absent[0]} is listed in model.safetensors.index.json but is in none of its "
                                  f"files ({len(absent)} such tensors)")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def _entry(self, name: str):
        if name not in self.entries:
            raise ConfigError(f"tensor {shown_path(name)} is not in {shown_path(self.directory)}")
        return self.entries[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (its dtype and shape), read from its file."""
        path, entry, start = self._entry(name)
        if entry["dtype"] not in DTYPES:
            raise ConfigError(f"tensor {shown_path(name)} in {shown_path(path)} has dtype "
                              f"{shown_path(entry['dtype'])}, which is not supported")
        dtype = np.dtype(DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConfigError(f"tensor {shown_path(name)} in {shown_path(path)}: {end - begin} bytes do not hold "
                              f"{entry['dtype']} {list(shape)}")
        return np.fromfile(path, dtype, count=math.prod(shape), offset=start + begin).reshape(shape)

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """A weight's shape, its FP8 block scales checked (from the headers; nothing read)."""
        shape = self.shape(name)
        if self._entry(name)[1]["dtype"] == "F8_E4M3":
            scale = name + "_scale_inv"
            if scale not in self:
                raise ConfigError(f"tensor {name} is float8 but {scale} (its 128x128 block scales) is missing")
            _check_blocks(name, shape, self.shape(scale))
        return shape

    def weight(self, name: str) -> np.ndarray:
        """A weight as float32: FP8 weights multiplied by their `<name>_scale_inv` blocks (DeepSeek's release)."""
        self.weight_shape(name)  # the block scales are there and fit, before any data is read
        w = self.get(name)
        if w.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            return dequantize_fp8(w, self.get(name + "_scale_inv"), name)
        return np.asarray(w, np.float32)


def _check_blocks(name: str, shape: tuple, scale_shape: tuple) -> None:
    """ConfigError unless the scales of weight `name` are one per FP8_BLOCK x FP8_BLOCK block of its shape."""
    want = tuple(-(-n // FP8_BLOCK) for n in shape)
    if tuple(scale_shape) != want:
        raise ConfigError(f"tensor {name}_scale_inv is {list(scale_shape)}; {name} {list(shape)} needs {list(want)} "
                          f"(one per {FP8_BLOCK}x{FP8_BLOCK} block)")


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, name: str = "weight") -> np.ndarray:
    """float32 w x scale_inv, one scale per FP8_BLOCK x FP8_BLOCK block (the last blocks may be partial)."""
    _check_blocks(name, w.shape, scale_inv.shape)
    rows, cols = w.shape
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return np.asarray(w, np.float32) * scale


def write_file(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """One safetensors file of `tensors` (any dtype in DTYPES), written tensor by tensor."""
    header, offset = {}, 0
    for name, array in tensors.items():
        size = array.size * array.dtype.itemsize
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())

"""Export this trainer's parameters as a Hugging Face checkpoint directory:

    python -m MaxText.utils.ckpt_conversion.to_huggingface configs/base.yml model_name=... \\
        load_parameters_path=<items> base_output_directory=<hf_out> [hf_dtype=bfloat16|float32|fp8] \\
        [hf_shard_gb=5] [hf_tokenizer_path=<hf dir>]

Writes <hf_out>/config.json and model-0000i-of-0000n.safetensors shards with model.safetensors.index.json,
in the layout of the family's released checkpoints (the family from decoder_block, else from the model keys:
MLA -> deepseek_v3 (deepseek_v2 without the routing bias), qk_norm -> qwen3_moe, otherwise mixtral). The
routing biases go out as e_score_correction_bias, the MTP depths as layers num_hidden_layers + i (with the
copies of the embedding and head DeepSeek's release carries). hf_dtype=fp8 writes DeepSeek's block format:
every Linear of attention, MLPs and experts as float8_e4m3fn with a float32 weight_scale_inv per 128x128
block (the block's max |w| / 448); norms, embedding, head and router stay bfloat16.
hf_tokenizer_path copies that directory's tokenizer files (tokenizer.json, tokenizer_config.json, ...) in.
The directory is written under a temporary name and renamed when complete; one that exists is refused.
Upstream MaxText's flags work too (upstream_flags.TO_HUGGINGFACE): --hf_model_path=<dir> is hf_tokenizer_path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import NamedTuple

import ml_dtypes
import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config, tool_main
from MaxText.config.checks import remote_path_error
from MaxText.config.storage import check_output, shown_path
from MaxText.utils.ckpt_conversion.families import DeepSeek, family_of, placements, to_theirs
from MaxText.utils.ckpt_conversion import upstream_flags
from MaxText.utils.ckpt_conversion.safetensors_io import FP8_BLOCK, write_file

HF_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "fp8": ml_dtypes.float8_e4m3fn}
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_KINDS = ("linear", "heads_in", "heads_out", "experts", "mtp_projection")
NOT_FP8 = ("lm_head.weight", ".gate.weight")  # DeepSeek's release keeps the head and the routers in bf16


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv per FP8_BLOCK block) with w ~= weight x scale_inv."""
    rows, cols = w.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    padded = np.zeros((blocks[0] * FP8_BLOCK, blocks[1] * FP8_BLOCK), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(blocks[0], FP8_BLOCK, blocks[1], FP8_BLOCK)
    scale = np.abs(tiles).max(axis=(1, 3)) / FP8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def hf_tensors(cfg, family, tree: dict, dtype: str) -> dict[str, np.ndarray]:
    """{Hugging Face name: array} of the saved tree, in the release's layout and dtype."""
    out = {}

    def put(name, array, kind):
        array = np.asarray(array, np.float32)
        if dtype == "fp8" and kind in FP8_KINDS and array.ndim == 2 and not name.endswith(NOT_FP8):
            out[name], out[name + "_scale_inv"] = quantize_fp8(array)
        else:
            out[name] = array.astype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16)

    for place in placements(cfg, family):
        node = tree
        for k in place.key:
            node = node[k]
        array = np.asarray(node)
        layers = list(array) if place.stacked else [array]
        for prefix, part in zip(place.prefixes, layers):
            if place.rule.kind == "experts":
                for e in range(cfg.num_experts):
                    put(prefix + place.rule.theirs.format(e=e), part[e].T, "experts")
            else:
                put(prefix + place.rule.theirs, to_theirs(place.rule, part), place.rule.kind)
    for depth in range(1, cfg.mtp_num_layers + 1):  # DeepSeek's release: each MTP layer carries these copies
        p = f"model.layers.{cfg.base_num_decoder_layers + depth - 1}"
        out[f"{p}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
        if "lm_head.weight" in out:
            out[f"{p}.shared_head.head.weight"] = out["lm_head.weight"]
    return out


def write_directory(directory: str, config: dict, tensors: dict[str, np.ndarray], shard_bytes: int) -> None:
    """config.json, safetensors shards of at most shard_bytes (one tensor may exceed it alone) and the index."""
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(directory, file), shard, {"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}, f,
                  indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files of a Hugging Face directory (hf_tokenizer_path, upstream's --hf_model_path) to bundle
    with the export; none when unset."""
    if not directory:
        return []
    found = [os.path.join(directory, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, f))]
    if not any(os.path.basename(f).startswith("tokenizer") for f in found):
        raise ConfigError(f"hf_tokenizer_path={shown_path(directory)} holds no tokenizer.json, tokenizer_config.json "
                          "or tokenizer.model to bundle; give the Hugging Face directory of the model's tokenizer")
    return found


class _Options(NamedTuple):
    dtype: str
    shard_bytes: int
    out_dir: str
    tokenizer: list
    cfg: object
    family: object


def _options(argv: list[str], log) -> _Options:
    """The export's arguments, every one checked before any work (one line naming the argument otherwise)."""
    opts, rest = {"hf_dtype": "bfloat16", "hf_shard_gb": "5", "hf_tokenizer_path": ""}, []
    out_dir = None
    for arg in upstream_flags.normalize(list(argv), upstream_flags.TO_HUGGINGFACE, "to_huggingface", log):
        key, sep, value = arg.partition("=")
        if sep and key in opts:
            opts[key] = value
        elif sep and key == "base_output_directory":
            out_dir = value
        else:
            rest.append(arg)
    if opts["hf_dtype"] not in HF_DTYPES:
        raise ConfigError(f"hf_dtype={opts['hf_dtype']} is not one of {', '.join(HF_DTYPES)}")
    try:
        shard_bytes = int(float(opts["hf_shard_gb"]) * 2 ** 30)
    except ValueError:
        raise ConfigError(f"hf_shard_gb={opts['hf_shard_gb']} is not a number") from None
    if not out_dir:
        raise ConfigError("base_output_directory=<directory> is required (the Hugging Face directory to write)")
    error = remote_path_error("base_output_directory", out_dir, "the converters read and write")
    if error:
        raise ConfigError(error)
    out_dir = check_output("base_output_directory", out_dir)  # before any work: a file, unwritable, too long
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"base_output_directory={shown_path(out_dir)} exists and is not empty; choose a new "
                          "directory")
    tokenizer = tokenizer_files(opts["hf_tokenizer_path"])
    cfg = load_config(rest)
    if not cfg.load_parameters_path:
        raise ConfigError("load_parameters_path=<run>/checkpoints/<step>/items is required (the params to export)")
    family = family_of(cfg)
    if opts["hf_dtype"] == "fp8" and not isinstance(family, DeepSeek):
        raise ConfigError("hf_dtype=fp8 is DeepSeek's release format; use bfloat16 or float32 for this family")
    return _Options(opts["hf_dtype"], shard_bytes, out_dir, tokenizer, cfg, family)


def _saved_tree(cfg, config: dict) -> dict:
    """The params (and routing biases) of load_parameters_path on this host, as numpy."""
    # here, not at the top: JAX and the model load only after the inputs pass their checks (a mistake is one line
    # without JAX's start-up)
    import jax

    from MaxText.trainer import checkpointing
    from MaxText.planning import plan
    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    spec = state_spec(cfg, plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES}))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), spec.abstract)
    params, bias = checkpointing.load_params(cfg.load_parameters_path, local["params"], cfg, local.get("nnx_aux"))
    if cfg.routed_bias and bias is None:
        raise ConfigError(f"load_parameters_path={shown_path(cfg.load_parameters_path)} holds no routing bias, "
                          f"which {config['model_type']} needs (e_score_correction_bias)")
    return {"params": jax.device_get(params), **({"nnx_aux": jax.device_get(bias)} if bias is not None else {})}


def export(argv: list[str], log=print) -> str:
    """Runs the export; returns the directory written (staged beside it, so a failure leaves no partial copy)."""
    opts = _options(argv, log)
    cfg, out_dir = opts.cfg, opts.out_dir
    config = opts.family.hf_config(cfg)
    tensors = hf_tensors(cfg, opts.family, _saved_tree(cfg, config), opts.dtype)
    config["torch_dtype"] = "float32" if opts.dtype == "float32" else "bfloat16"
    if opts.dtype == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    staging = out_dir + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        write_directory(staging, config, tensors, opts.shard_bytes)
        for path in opts.tokenizer:
            shutil.copy(path, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk or Ctrl-C mid-write leaves nothing behind
        raise
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty, checked above
    os.replace(staging, out_dir)
    total = sum(a.nbytes for a in tensors.values())
    log(f"exported {cfg.load_parameters_path} as {config['model_type']} ({opts.dtype}, {len(tensors)} tensors, "
        f"{total / 2 ** 30:.2f} GiB) to {out_dir}")
    return out_dir


def main(argv=None) -> int:
    return tool_main(export, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())

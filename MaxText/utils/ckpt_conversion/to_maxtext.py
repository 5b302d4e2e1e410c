"""Import a Hugging Face checkpoint directory as this trainer's parameters:

    python -m MaxText.utils.ckpt_conversion.to_maxtext configs/base.yml hf_model_path=<dir> \\
        base_output_directory=<out> [model_name=...] [key=value ...]

Reads `<dir>/config.json` and its safetensors (sharded with an index or not; no network): model_type
deepseek_v3 (DeepSeek's FP8 release as it is: float8 weights times their 128x128 weight_scale_inv blocks),
deepseek_v2, mixtral, qwen3_moe. Writes

    <out>/model.yml           the model keys derived from config.json (usable as model_name=<out>/model.yml)
    <out>/0/items             the params, and the MoE routing biases (DeepSeek's e_score_correction_bias),
                              as Orbax writes them (MaxText's layout; load_parameters_path=<out>/0/items)
    <out>/0/checksums         each array's shape and checksum (the trainer checks shapes against it)

With model_name naming a built-in model, config.json must agree with it (the first differing key is named).
Every tensor of the directory must have a place in the model and every parameter a tensor; anything else
is one line naming the tensor, and nothing is written. The MTP layer of DeepSeek's release
(model.layers.<num_hidden_layers>) is imported when the config keeps mtp_num_layers, skipped (with a line)
when it is 0.

Memory: this version assembles each parameter (all layers of a scanned stack) in host memory, then writes the
whole tree with Orbax: peak memory is about twice the float32 model. Streaming layer by layer is not done yet.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import yaml

from MaxText.config import ConfigError, load_config, tool_main
from MaxText.utils.ckpt_conversion.families import FAMILIES, Placement, placements, to_ours
from MaxText.utils.ckpt_conversion.safetensors_io import Checkpoint

# Tensors a release carries that have no parameter of their own here.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _split_argv(argv: list[str]) -> tuple[str, str, list[str]]:
    """(hf_model_path, base_output_directory, the rest for load_config)."""
    found, rest = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("hf_model_path", "base_output_directory"):
            found[key] = value
        else:
            rest.append(arg)
    for key in ("hf_model_path", "base_output_directory"):
        if not found.get(key):
            raise ConfigError(f"{key}=<directory> is required")
    return found["hf_model_path"], found["base_output_directory"], rest


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"hf_model_path={hf_dir} has no config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({str(e)[:120]})") from None
    if hf.get("model_type") not in FAMILIES:
        raise ConfigError(f"{path}: model_type={hf.get('model_type')!r} is not one this trainer imports "
                          f"({', '.join(FAMILIES)})")
    return hf


def check_agrees(cfg, keys: dict, model_name: str) -> None:
    """ConfigError naming the first model key where config.json and the built-in model file differ."""
    for key, value in keys.items():
        ours = cfg[key]
        same = np.isclose(ours, value, rtol=1e-6) if isinstance(value, float) and ours is not None else ours == value
        if not same:
            raise ConfigError(f"config.json gives {key}={value} but model_name={model_name} has {key}={ours}; drop "
                              "model_name to import under the derived model.yml, or fix the directory")


class Reader:
    """Hugging Face tensors as float32 (FP8 dequantized), with the names read recorded."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.used, self.last = ckpt, set(), ""

    def __call__(self, name: str) -> np.ndarray:
        self.used.update((name, name + "_scale_inv"))
        self.last = name
        return self.ckpt.weight(name)


def _layer_array(place: Placement, prefix: str, read: Reader, cfg) -> np.ndarray:
    """One layer's (or the model's) parameter of a placement, in this trainer's layout."""
    rule = place.rule
    if rule.kind != "experts":
        return to_ours(rule, lambda name: read(prefix + name))
    experts = []
    for e in range(cfg.num_experts):
        experts.append(read(prefix + rule.theirs.format(e=e)).T)
        if experts[-1].shape != experts[0].shape:
            raise ConfigError(f"tensor {read.last} is {list(experts[-1].T.shape)}, unlike "
                              f"{prefix + rule.theirs.format(e=0)} ({list(experts[0].T.shape)})")
    return np.stack(experts)


def _mtp_copies(cfg, ckpt: Checkpoint, read: Reader) -> None:
    """The release's MTP layers carry copies of the embedding and head: checked equal to the main ones."""
    for depth in range(1, cfg.mtp_num_layers + 1):
        p = f"model.layers.{cfg.base_num_decoder_layers + depth - 1}"
        for copy, main in ((f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
                           (f"{p}.shared_head.head.weight", "lm_head.weight")):
            if copy in ckpt and main in ckpt:
                if ckpt.shape(copy) != ckpt.shape(main) or not np.array_equal(read(copy), read(main)):
                    raise ConfigError(f"tensor {copy} differs from {main}; this trainer's MTP shares the main model's")


def build(cfg, ckpt: Checkpoint, family, abstract: dict, log) -> dict:
    """The saved tree {"params", "nnx_aux"?} as numpy arrays in the leaves' dtypes, every leaf from a tensor."""
    import jax

    sources = {place.key: place for place in placements(cfg, family)}
    read = Reader(ckpt)
    tree, missing = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        place = sources.pop(key, None)
        if place is None:
            missing.append(jax.tree_util.keystr(path))
            continue
        want = tuple(leaf.shape[1:]) if place.stacked else tuple(leaf.shape)
        parts = []
        for prefix in place.prefixes:
            parts.append(_layer_array(place, prefix, read, cfg))
            if tuple(parts[-1].shape) != want:
                raise ConfigError(f"tensor {read.last} gives {jax.tree_util.keystr(path)} the shape "
                                  f"{list(parts[-1].shape)} but this config needs {list(want)}; check the model keys "
                                  "against config.json")
        node = tree
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = np.asarray(np.stack(parts) if place.stacked else parts[0], leaf.dtype)
    if missing:
        raise ConfigError(f"parameter {missing[0]} has no rule here ({len(missing)} such)")
    _mtp_copies(cfg, ckpt, read)
    unused = [n for n in ckpt.names() if n not in read.used and not n.endswith(IGNORED_SUFFIXES)]
    if cfg.mtp_num_layers == 0:
        mtp_prefix = f"model.layers.{cfg.base_num_decoder_layers}."
        skipped = [n for n in unused if n.startswith(mtp_prefix)]
        if skipped:
            log(f"not imported: the MTP layer ({mtp_prefix}*, {len(skipped)} tensors), as mtp_num_layers=0")
        unused = [n for n in unused if not n.startswith(mtp_prefix)]
    if unused:
        raise ConfigError(f"tensor {unused[0]} has no place in this model ({len(unused)} such); check model_name and "
                          "the model keys against config.json")
    return tree


def convert(argv: list[str], log=print) -> str:
    """Runs the import; returns the item directory written."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from MaxText import plan, sharding
    from MaxText.checkpointing import CHECKSUMS, ITEM, state_manifest
    from MaxText.state import state_spec

    hf_dir, out_dir, rest = _split_argv(argv)
    hf = read_hf_config(hf_dir)
    ckpt = Checkpoint(hf_dir)
    family = FAMILIES[hf["model_type"]]()
    keys = family.model_keys(hf)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "0")):
        raise ConfigError(f"{out_dir}/0 exists already; choose another base_output_directory")
    config_args = [a for a in rest if a.endswith((".yml", ".yaml")) and "=" not in a][:1]
    overrides = [a for a in rest if a not in config_args]
    named = next((a.split("=", 1)[1] for a in overrides if a.startswith("model_name=")), None)
    model_yml = os.path.join(out_dir, "model.yml")
    with tempfile.TemporaryDirectory() as staging:  # nothing is written under out_dir before all is read
        if named:
            cfg = load_config(config_args + overrides)
            check_agrees(cfg, keys, named)
        else:
            staged = os.path.join(staging, "model.yml")
            with open(staged, "w") as f:
                f.write(f"# Derived from {os.path.abspath(hf_dir)}/config.json ({hf['model_type']}) by "
                        "MaxText.utils.ckpt_conversion.to_maxtext\n")
                yaml.safe_dump(keys, f, sort_keys=False)
            cfg = load_config(config_args + [f"model_name={staged}"] + overrides)
        mesh = plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES})
        spec = state_spec(cfg, mesh)
        abstract = {"params": spec.abstract["params"]}
        if "nnx_aux" in spec.abstract:
            abstract["nnx_aux"] = spec.abstract["nnx_aux"]
        tree = build(cfg, ckpt, family, abstract, log)
        os.makedirs(out_dir, exist_ok=True)
        if not named:
            shutil.copy(staged, model_yml)
    arrays = jax.tree.map(jax.numpy.asarray, tree)
    with ocp.CheckpointManager(epath.Path(out_dir), item_names=(ITEM, CHECKSUMS)) as manager:
        manager.save(0, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(arrays),
                                                   CHECKSUMS: ocp.args.JsonSave(state_manifest(arrays))}))
        manager.wait_until_finished()
    item = os.path.join(out_dir, "0", ITEM)
    log(f"imported {hf_dir} ({hf['model_type']}) into {item}"
        + (f"; model keys in {model_yml}" if not named else "")
        + (" with the MoE routing biases" if "nnx_aux" in tree else ""))
    return item


def main(argv=None) -> int:
    return tool_main(convert, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())

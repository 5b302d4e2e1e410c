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

from MaxText.config import ConfigError, layer_counts, load_config
from MaxText.utils.ckpt_conversion.families import FAMILIES
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


def tensors_by_path(cfg, family) -> dict[tuple, callable]:
    """{path in the saved tree: () -> array in this trainer's layout} for every params and nnx_aux leaf."""
    num_dense, num_moe = layer_counts(cfg)
    prefix = lambda i: f"model.layers.{i}"  # noqa: E731
    out = {("params", "token_embedder", "embedding"): lambda: family.vector("model.embed_tokens.weight"),
           ("params", "decoder_norm", "scale"): lambda: family.vector("model.norm.weight")}
    if not cfg.logits_via_embedding:
        out[("params", "token_embedder", "logits_dense")] = lambda: family.linear("lm_head.weight")
    stacks = [("dense_layers", num_dense, 0, False), ("moe_layers", num_moe, num_dense, True)]
    for stack, count, first, moe in stacks:
        if not count:
            continue
        groups = [("params", family.layer(cfg, prefix, moe))] + ([("nnx_aux", family.bias(cfg, prefix))] if moe else [])
        for root, mapping in groups:
            for rel, tensor in mapping.items():
                rel = tuple(rel.split("."))
                if cfg.scan_layers:  # a list: one callable per layer, stacked by build()
                    out[(root, stack, "layers", *rel)] = [lambda tensor=tensor, i=first + j: tensor(i)
                                                          for j in range(count)]
                else:
                    for j in range(count):
                        out[(root, stack, f"layers_{j}", *rel)] = lambda tensor=tensor, i=first + j: tensor(i)
    if cfg.mtp_num_layers:
        n = cfg.base_num_decoder_layers
        mtp = lambda i: f"model.layers.{n + i - 1}"  # noqa: E731 - depth i (1-based) is layer n + i - 1
        d = cfg.base_emb_dim
        for depth in range(1, cfg.mtp_num_layers + 1):
            base = ("mtp", f"mtp_{depth}")
            p = mtp(depth)
            out[("params", *base, "embedding_norm", "scale")] = lambda p=p: family.vector(f"{p}.enorm.weight")
            out[("params", *base, "hidden_norm", "scale")] = lambda p=p: family.vector(f"{p}.hnorm.weight")
            out[("params", *base, "final_norm", "scale")] = lambda p=p: family.vector(f"{p}.shared_head.norm.weight")
            # eh_proj [D, 2D] takes [embedding, hidden]; ours [2D, D] takes [hidden, embedding].
            out[("params", *base, "projection")] = lambda p=p: np.concatenate(
                [family.linear(f"{p}.eh_proj.weight")[d:], family.linear(f"{p}.eh_proj.weight")[:d]])
            for root, mapping in (("params", family.layer(cfg, mtp, True)), ("nnx_aux", family.bias(cfg, mtp))):
                for rel, tensor in mapping.items():
                    out[(root, *base, "layer", *rel.split("."))] = lambda tensor=tensor, depth=depth: tensor(depth)
    return out


def _mtp_extras(cfg, ckpt: Checkpoint, family) -> list[str]:
    """The release's MTP layer copies of the embedding and head: checked equal to the main ones, then counted used."""
    names = []
    for depth in range(1, cfg.mtp_num_layers + 1):
        p = f"model.layers.{cfg.base_num_decoder_layers + depth - 1}"
        for copy, main in ((f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
                           (f"{p}.shared_head.head.weight", "lm_head.weight")):
            if copy in ckpt:
                if ckpt.shape(copy) != ckpt.shape(main) or not np.array_equal(family.w(copy), family.w(main)):
                    raise ConfigError(f"tensor {copy} differs from {main}; this trainer's MTP shares the main model's")
                names.append(copy)
    return names


def build(cfg, ckpt: Checkpoint, family, abstract: dict, log) -> dict:
    """The saved tree {"params", "nnx_aux"?} as numpy arrays in the leaves' dtypes, every leaf from a tensor."""
    import jax

    sources = tensors_by_path(cfg, family)
    tree, missing = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        if key not in sources:
            missing.append(".".join(map(str, key)))
            continue
        source, name = sources.pop(key), ".".join(map(str, key))
        layers = source if isinstance(source, list) else [source]
        want = tuple(leaf.shape[1:]) if isinstance(source, list) else tuple(leaf.shape)
        parts = []
        for layer in layers:
            part = layer()
            if tuple(part.shape) != want:
                raise ConfigError(f"tensor {family.last} gives {name} the shape {list(part.shape)} but this config needs "
                                  f"{list(want)}; check the model keys against config.json")
            parts.append(part)
        array = np.stack(parts) if isinstance(source, list) else parts[0]
        node = tree
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = np.asarray(array, leaf.dtype)
    if missing:
        raise ConfigError(f"parameter {missing[0]} has no tensor in the directory ({len(missing)} such)")
    used = family.used | set(_mtp_extras(cfg, ckpt, family))
    unused = [n for n in ckpt.names() if n not in used and not n.endswith(IGNORED_SUFFIXES)]
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
    family = FAMILIES[hf["model_type"]](ckpt)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        convert(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

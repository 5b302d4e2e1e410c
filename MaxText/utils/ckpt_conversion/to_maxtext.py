"""Import a Hugging Face checkpoint directory as this trainer's parameters:

    python -m MaxText.utils.ckpt_conversion.to_maxtext configs/base.yml hf_model_path=<dir> \\
        base_output_directory=<out> [model_name=...] [hf_ignore_fields=a,b] [key=value ...]

Reads `<dir>/config.json` as transformers reads it, in the released checkpoints' schema (transformers 4:
rope_theta, rope_scaling) or transformers 5's (rope_parameters, renamed fields); a field missing takes the
default of the family's transformers config class. A field that may change the model and is not understood,
or two spellings that disagree, is one line naming the field (hf_ignore_fields=<f1>,<f2> accepts fields you
know leave the function alone); the fields that do not change it are named in one log line. Then its
safetensors (sharded with an index or not; no network): model_type deepseek_v3 (DeepSeek's FP8 release as it is: float8 weights times their 128x128 weight_scale_inv blocks),
deepseek_v2, mixtral, qwen3_moe. Writes

    <out>/model.yml           the model keys derived from config.json (usable as model_name=<out>/model.yml)
    <out>/0/items             the params, and the MoE routing biases (DeepSeek's e_score_correction_bias),
                              as Orbax writes them (MaxText's layout; load_parameters_path=<out>/0/items)
    <out>/0/checksums         each array's shape and checksum (the trainer checks shapes against it)

With model_name naming a built-in model, config.json must agree with it (the first differing key is named).
Every tensor of the directory must have a place in the model and every parameter a tensor; anything else
is one line naming the tensor, and nothing is written. The MTP layer of DeepSeek's release
(model.layers.<num_hidden_layers>) is imported when the config keeps mtp_num_layers, skipped (with a line)
when it is 0, or when the checkpoint holds none (transformers saves DeepSeek-V3 without it).

Upstream MaxText's flags work too (upstream_flags.TO_MAXTEXT): --hf_model_path=<dir>, --save_dtype=bfloat16
(weight_dtype, the dtype written; float32 by default here, upstream's default is bfloat16), and the loading
options that change nothing here (--lazy_load_tensors, --eager_load_method, --revision, ...), with a log line.

Check an import against transformers with MaxText.utils.ckpt_conversion.check before training from it.

Memory: every name and shape is checked from the headers first (nothing written before); then the params are
written tensor by tensor (write_items), so the host holds about the largest single tensor, not the model
(python -m MaxText.benchmarks.ckpt_conversion measures it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import NamedTuple

import numpy as np
import yaml

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config, tool_main
from MaxText.utils.ckpt_conversion import upstream_flags
from MaxText.config.storage import read_json_file, shown_path
from MaxText.utils.ckpt_conversion.families import (FAMILIES, Placement, model_family, placements,
                                                    to_ours)
from MaxText.utils.ckpt_conversion.orbax_io import (ArrayOut, create_items, new_step_dir, save_shapes,
                                                     split_paths, write_step)
from MaxText.utils.ckpt_conversion.safetensors_io import Checkpoint

# Tensors a release carries that have no parameter of their own here.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _split_argv(argv: list[str]) -> tuple[str, str, list[str], list[str]]:
    """(hf_model_path, base_output_directory, hf_ignore_fields, the rest for load_config)."""
    found, rest = split_paths(argv, ("hf_model_path", "base_output_directory"), ("hf_ignore_fields",))
    ignore = [f for f in found.get("hf_ignore_fields", "").split(",") if f]
    return found["hf_model_path"], found["base_output_directory"], ignore, rest


def read_hf_config(hf_dir: str, key: str = "hf_model_path") -> dict:
    """config.json of a Hugging Face checkpoint directory, of a family this trainer imports; one line otherwise."""
    if not os.path.exists(hf_dir):
        raise ConfigError(f"{key}={shown_path(hf_dir)} does not exist; give the Hugging Face checkpoint directory "
                          "(config.json and *.safetensors)")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"{key}={shown_path(hf_dir)} is a file, not a directory; give the Hugging Face checkpoint "
                          "directory that holds config.json")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={shown_path(hf_dir)} is not a Hugging Face checkpoint directory (no config.json); "
                          "give the directory that holds config.json and *.safetensors")
    hf = read_json_file(path)
    if not isinstance(hf, dict):
        raise ConfigError(f"{shown_path(path)} holds a {type(hf).__name__}, not a JSON object; give a Hugging Face "
                          "config.json")
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(f"{shown_path(path)}: model_type={shown_path(repr(model_type))} is not one this trainer "
                          f"imports ({', '.join(FAMILIES)})")
    return hf


def check_family(cfg, model_type: str, model_name: str, hf_dir: str) -> None:
    """ConfigError when the model of `cfg` (model_name) is not of config.json's family."""
    built = model_family(cfg)
    if FAMILIES.get(built) is not FAMILIES[model_type]:
        raise ConfigError(f"{shown_path(os.path.join(hf_dir, 'config.json'))} is a {model_type} checkpoint but "
                          f"model_name={shown_path(model_name)} builds a {built} model; give the model file of that "
                          "checkpoint (the import's <out>/model.yml), or drop model_name")


def _without_absent_mtp(keys: dict, ckpt: Checkpoint, log) -> dict:
    """transformers' DeepseekV3ForCausalLM has no MTP layer, so a checkpoint it saved holds none although its
    config.json keeps num_nextn_predict_layers: such a checkpoint imports without MTP, with a line saying so."""
    depth = keys.get("mtp_num_layers", 0)
    prefix = f"model.layers.{keys.get('base_num_decoder_layers')}."
    if depth and not any(n.startswith(prefix) for n in ckpt.names()):
        log(f"config.json has num_nextn_predict_layers={depth} but the checkpoint holds no MTP layer ({prefix}*, as "
            "transformers saves DeepSeek-V3): imported with mtp_num_layers=0")
        keys = {**keys, "mtp_num_layers": 0}
    return keys


def check_agrees(cfg, keys: dict, model_name: str) -> None:
    """ConfigError naming the first model key where config.json and the built-in model file differ."""
    for key, value in keys.items():
        ours = cfg[key]
        same = np.isclose(ours, value, rtol=1e-6) if isinstance(value, float) and ours is not None else ours == value
        if not same:
            raise ConfigError(f"config.json gives {key}={value} but model_name={model_name} has {key}={ours}; drop "
                              "model_name to import under the derived model.yml, or fix the directory")


def _shape(place: Placement, prefix: str, ckpt: Checkpoint, cfg) -> tuple:
    """This trainer's shape of one layer's parameter, from the stored shapes alone (no data read)."""
    rule = place.rule
    if rule.kind == "experts":
        names = _names(place, prefix, cfg)
        shapes = [ckpt.weight_shape(n) for n in names]
        for name, shape in zip(names, shapes):
            if shape != shapes[0]:
                raise ConfigError(f"tensor {name} is {list(shape)}, unlike {names[0]} ({list(shapes[0])})")
        return (cfg.num_experts, *shapes[0][::-1])
    shape = ckpt.weight_shape(prefix + rule.theirs)
    if rule.kind == "vector":
        return shape
    if len(shape) != 2:
        raise ConfigError(f"tensor {prefix + rule.theirs} is {list(shape)}, not a matrix")
    out, inp = shape
    if rule.kind in ("heads_in", "heads_out") and (out if rule.kind == "heads_in" else inp) % rule.heads:
        raise ConfigError(f"tensor {prefix + rule.theirs} is {list(shape)}, which does not split into "
                          f"{rule.heads} heads")
    if rule.kind == "heads_in":
        return inp, rule.heads, out // rule.heads
    if rule.kind == "heads_out":
        return rule.heads, inp // rule.heads, out
    return inp, out  # linear, mtp_projection


def _names(place: Placement, prefix: str, cfg) -> list[str]:
    rule = place.rule
    if rule.kind == "experts":
        return [prefix + rule.theirs.format(e=e) for e in range(cfg.num_experts)]
    return [prefix + rule.theirs]


def _mtp_copies(cfg, ckpt: Checkpoint) -> set[str]:
    """The release's MTP layers carry copies of the embedding and head: checked equal to the main ones."""
    copies = set()
    for depth in range(1, cfg.mtp_num_layers + 1):
        p = f"model.layers.{cfg.base_num_decoder_layers + depth - 1}"
        for copy, main in ((f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
                           (f"{p}.shared_head.head.weight", "lm_head.weight")):
            if copy in ckpt and main in ckpt:
                if ckpt.shape(copy) != ckpt.shape(main) or not np.array_equal(ckpt.weight(copy), ckpt.weight(main)):
                    raise ConfigError(f"tensor {copy} differs from {main}; this trainer's MTP shares the main model's")
                copies.add(copy)
    return copies


class Leaf(NamedTuple):
    key: tuple          # path in the saved tree
    place: Placement
    shape: tuple        # the leaf's full shape
    dtype: np.dtype


def plan_leaves(cfg, ckpt: Checkpoint, family, abstract: dict, log) -> list[Leaf]:
    """Every leaf of the saved tree with its source, checked against the stored shapes and names before anything
    is read or written: a parameter without a tensor, a tensor without a place, a shape that differs."""
    import jax

    sources = {place.key: place for place in placements(cfg, family)}
    leaves, used = [], set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        place = sources.pop(key, None)
        if place is None:
            raise ConfigError(f"parameter {jax.tree_util.keystr(path)} has no rule here")
        want = tuple(leaf.shape[1:]) if place.stacked else tuple(leaf.shape)
        for prefix in place.prefixes:
            got = _shape(place, prefix, ckpt, cfg)
            if got != want:
                raise ConfigError(f"tensor {_names(place, prefix, cfg)[0]} gives {jax.tree_util.keystr(path)} "
                                  f"the shape {list(got)} but this config needs {list(want)}; check the model keys "
                                  "against config.json")
            for name in _names(place, prefix, cfg):
                used.update((name, name + "_scale_inv"))
        leaves.append(Leaf(key, place, tuple(leaf.shape), np.dtype(leaf.dtype)))
    used |= _mtp_copies(cfg, ckpt)
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
    return leaves


def write_items(item_dir: str, leaves: list[Leaf], ckpt: Checkpoint, cfg) -> None:
    """The saved tree in Orbax's layout (orbax_io.create_items), filled one layer of one parameter at a time (a
    chunk per layer, and per expert). Peak memory: the largest single tensor (with its float32 copy): the embedding
    or the head, not the model, nor a layer's stacked experts (written expert by expert)."""
    arrays = []
    for leaf in leaves:
        lead = (1,) * (int(leaf.place.stacked) + int(leaf.place.rule.kind == "experts"))
        arrays.append(ArrayOut(leaf.key, leaf.shape, leaf.dtype, (*lead, *leaf.shape[len(lead):])))
    stores = create_items(item_dir, arrays)
    for leaf in leaves:
        array = stores[".".join(leaf.key)]
        for j, prefix in enumerate(leaf.place.prefixes):
            layer = array[j] if leaf.place.stacked else array
            if leaf.place.rule.kind == "experts":  # expert by expert: at most one expert's weight in memory
                for e, expert in enumerate(_names(leaf.place, prefix, cfg)):
                    layer[e].write(np.asarray(ckpt.weight(expert).T, leaf.dtype)).result()
            else:
                part = to_ours(leaf.place.rule, lambda name: ckpt.weight(prefix + name))  # noqa: B023 - called here
                layer.write(np.asarray(part, leaf.dtype)).result()


def convert(argv: list[str], log=print) -> str:
    """Runs the import; returns the item directory written."""
    hf_dir, out_dir, ignore, rest = _split_argv(upstream_flags.normalize(list(argv), upstream_flags.TO_MAXTEXT,
                                                                         "to_maxtext", log, bare=True))
    step_dir = new_step_dir(out_dir)  # the output checked before any work
    out_dir = os.path.dirname(step_dir)
    hf = read_hf_config(hf_dir)
    ckpt = Checkpoint(hf_dir)
    family = FAMILIES[hf["model_type"]]()
    keys = family.model_keys(hf, log, ignore)
    keys = _without_absent_mtp(keys, ckpt, log)

    # here, not at the top: JAX and the model load only after the inputs pass their checks (a mistake is one line
    # without JAX's start-up)
    from MaxText.planning import plan
    from MaxText.parallel import sharding
    from MaxText.trainer.checkpointing import CHECKSUMS, ITEM
    from MaxText.step.state import state_spec

    config_args = [a for a in rest if a.endswith((".yml", ".yaml")) and "=" not in a][:1]
    overrides = [a for a in rest if a not in config_args]
    named = next((a.split("=", 1)[1] for a in overrides if a.startswith("model_name=")), None)
    model_yml = os.path.join(out_dir, "model.yml")
    with tempfile.TemporaryDirectory() as staging:
        if named:
            cfg = load_config(config_args + overrides)
            check_family(cfg, hf["model_type"], named, hf_dir)
            check_agrees(cfg, keys, named)
        else:
            # A model key on the command line changes what is imported (mtp_num_layers=0 drops the MTP layer):
            # model.yml records it, so that it describes the checkpoint written beside it.
            chosen = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0] in keys}
            for key, value in chosen.items():
                log(f"model.yml: {key}={value} from the command line, not config.json's {keys[key]!r}")
                keys[key] = yaml.safe_load(value)
            overrides = [a for a in overrides if a.split("=", 1)[0] not in chosen]
            staged = os.path.join(staging, "model.yml")
            with open(staged, "w") as f:
                f.write(f"# Derived from {os.path.abspath(hf_dir)}/config.json ({hf['model_type']}) by "
                        "MaxText.utils.ckpt_conversion.to_maxtext\n")
                yaml.safe_dump(keys, f, sort_keys=False)
            cfg = load_config(config_args + [f"model_name={staged}"] + overrides)
        spec = state_spec(cfg, plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES}))
        abstract = {"params": spec.abstract["params"]}
        if "nnx_aux" in spec.abstract:
            abstract["nnx_aux"] = spec.abstract["nnx_aux"]
        leaves = plan_leaves(cfg, ckpt, family, abstract, log)  # every check before anything is written

        def write(partial):
            write_items(os.path.join(partial, ITEM), leaves, ckpt, cfg)
            save_shapes(os.path.join(partial, CHECKSUMS), {leaf.key: leaf.shape for leaf in leaves})
            if not named:
                shutil.copy(staged, model_yml)

        write_step(step_dir, write)
    item = os.path.join(step_dir, ITEM)
    log(f"imported {hf_dir} ({hf['model_type']}) into {item}"
        + (f"; model keys in {model_yml}" if not named else "")
        + (" with the MoE routing biases" if "nnx_aux" in abstract else ""))
    return item


def main(argv=None) -> int:
    return tool_main(convert, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())

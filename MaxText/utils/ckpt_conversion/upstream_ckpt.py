"""This trainer's parameter tree against upstream MaxText 0.2.5's, and the streaming copy between them, used by
from_upstream (upstream -> here) and to_upstream (here -> upstream).

Upstream's Orbax items hold params/params/<tree> (its Linen-shaped layout, which its NNX trainer also writes) and,
for DeepSeek, the routing biases under nnx_aux/model/<tree>; a params-only item (params/<tree>) reads the same.
The weights have the same layout in both trainers (kernels [in, ..., out], experts [experts, in, out]); what
differs is the names and, for scanned layers, the layer axis: axis 0 here, axis param_scan_axis (upstream's key,
at its default 1) in upstream's params and axis 0 in its nnx_aux. Names, upstream against here:

    decoder.decoder_norm, decoder.logits_dense.kernel, token_embedder.embedding
                                              decoder_norm, token_embedder.logits_dense, token_embedder.embedding
    decoder.layers | dense_layers | moe_layers (scanned), decoder.layers_<j> | dense_layers_<j> | moe_layers_<j>
                                              <dense|moe>_layers.layers (scanned), <dense|moe>_layers.layers_<j>
    pre_ / post_self_attention_layer_norm     pre_ / post_self_attention_norm
    self_attention.query | key | value | out .kernel, wq_a, wq_b, wkv_a, wkv_b .kernel
                                              self_attention.wq | wk | wv | wo (out for MLA), wq_a, ...
    mlp.wi_0 | wi_1 | wo .kernel              mlp.wi_0 | wi_1 | wo
    <block>.gate.kernel, <block>.wi_0 | wi_1 | wo, <block>.gate.bias (nnx_aux), <shared>.wi_0 ... .kernel
                                              moe.gate, moe.wi_0 | wi_1 | wo, moe.bias (nnx_aux), moe.shared_experts.*
    mtp_block.mtp_layer_<k>.mtp_<k>_embedding_norm | _hidden_state_norm | _final_norm | _projection.kernel
                                              mtp.mtp_<k>.embedding_norm | hidden_norm | final_norm | projection
    mtp_block.mtp_layer_<k>.mtp_<k>_transformer_layer.*
                                              mtp.mtp_<k>.layer.*

with <block> MoeBlock_0 (mixtral), moe_block (qwen3_moe), DeepSeekMoeBlock_0.MoeBlock_0 (deepseek; <shared>
DeepSeekMoeBlock_0.shared_experts). Upstream's MTP projection takes [embedding, hidden], this one [hidden, embedding]:
its two input halves swap. Upstream's Mixtral attention does not scale its logits by 1/sqrt(head_dim): its query
kernel carries that factor (T5's convention, upstream's attentions.init_query_w), so here the query kernel is
upstream's x sqrt(head_dim) (Qwen3 scales in the attention, as MLA does, in both trainers: no factor).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.config.storage import shown_path
from MaxText.utils.ckpt_conversion.families import DECODER_BLOCKS, placements
from MaxText.utils.ckpt_conversion.orbax_io import (ArrayOut, Items, create_items, new_step_dir, save_shapes,
                                                     split_paths, write_step)

BLOCKS = {"mixtral": ("MoeBlock_0", None), "qwen3_moe": ("moe_block", None),
          "deepseek": ("DeepSeekMoeBlock_0.MoeBlock_0", "DeepSeekMoeBlock_0.shared_experts")}
ROOTS = ("params.params.", "params.")          # a training checkpoint's, a params-only one's
AUX_ROOT = "nnx_aux.model."
# The layer axis of upstream's scanned params: its param_scan_axis, at its default (a checkpoint written with
# another value fails the shape check, naming the array).
SCAN_AXIS = 1
KERNELS = {"wq": "query", "wk": "key", "wv": "value", "wo": "out", "out": "out", "wq_a": "wq_a", "wq_b": "wq_b",
           "wkv_a": "wkv_a", "wkv_b": "wkv_b"}
MTP_NAMES = {"embedding_norm": "embedding_norm", "hidden_norm": "hidden_state_norm", "final_norm": "final_norm",
             "projection": "projection"}


class Slot(NamedTuple):
    """One layer (or all) of an array: its dot-joined name, the layer's index along `axis` (None: the whole
    array)."""

    name: str
    layer: int | None
    axis: int


class Pair(NamedTuple):
    ours: Slot
    theirs: Slot
    experts: int         # > 0: copied expert by expert (axis 0 of the layer), this many
    swap_halves: bool    # the MTP projection
    scale: float = 1.0   # ours = upstream's x scale (the query kernel of upstream's unscaled attention)


def _check_config(cfg) -> tuple[str, str | None]:
    if cfg.decoder_block not in BLOCKS:
        raise ConfigError(f"decoder_block={cfg.decoder_block}: upstream MaxText's parameter tree is known here for "
                          f"decoder_block {', '.join(BLOCKS)} (set the model's decoder_block, as upstream's model "
                          "files do)")
    if cfg.num_experts <= 1:
        raise ConfigError("only MoE models convert (num_experts > 1)")
    block, shared = BLOCKS[cfg.decoder_block]
    if cfg.decoder_block != "deepseek" and (cfg.first_num_dense_layers or cfg.shared_experts):
        raise ConfigError(f"decoder_block={cfg.decoder_block} has no dense layers nor shared experts in upstream "
                          "MaxText; set first_num_dense_layers=0 shared_experts=0")
    return block, shared


def _layer_name(suffix: str, block: str, shared: str | None) -> str:
    """Upstream's name of one parameter of a decoder layer, from this trainer's (e.g. self_attention.wq)."""
    parts = suffix.split(".")
    if parts[0] in ("pre_self_attention_norm", "post_self_attention_norm"):
        return parts[0].replace("_norm", "_layer_norm") + "." + ".".join(parts[1:])
    if parts[0] == "self_attention" and len(parts) == 2:
        return f"self_attention.{KERNELS[parts[1]]}.kernel"
    if parts[0] == "mlp":
        return f"{suffix}.kernel"
    if parts[0] == "moe":
        if parts[1] == "shared_experts":
            return f"{shared}.{parts[2]}.kernel"
        return {"gate": f"{block}.gate.kernel", "bias": f"{block}.gate.bias"}.get(parts[1], f"{block}.{parts[1]}")
    return suffix  # norms inside attention (query_norm, key_norm, q_norm, kv_norm)


def pairs(cfg, upstream_scanned: bool, root: str) -> list[Pair]:
    """Every array of this config's saved tree ({params, nnx_aux}), layer by layer, with its place in upstream's
    (scanned or not; `root` its params prefix)."""
    block, shared = _check_config(cfg)
    family = DECODER_BLOCKS[cfg.decoder_block]()
    query_scale = float(np.sqrt(cfg.head_dim)) if cfg.decoder_block == "mixtral" else 1.0
    out = []
    for place in placements(cfg, family):
        key = place.key
        aux = key[0] == "nnx_aux"
        top = AUX_ROOT if aux else root
        experts = cfg.num_experts if place.rule.kind == "experts" else 0
        ours_name = ".".join(key)
        if key[1] in ("dense_layers", "moe_layers"):
            suffix = ".".join(key[3:])
            theirs = _layer_name(suffix, block, shared)
            stack = key[1] if cfg.decoder_block == "deepseek" else "layers"
            count = len(place.prefixes)
            if place.stacked:
                ours_slots = [Slot(ours_name, j, 0) for j in range(count)]
            else:
                ours_slots = [Slot(ours_name, None, 0)]
            first = 0 if place.stacked else int(key[2].split("_")[1])
            scale = query_scale if suffix == "self_attention.wq" else 1.0
            for j, ours in zip(range(first, first + count), ours_slots):
                if upstream_scanned:
                    slot = Slot(f"{top}decoder.{stack}.{theirs}", j, 0 if aux else SCAN_AXIS)
                else:
                    slot = Slot(f"{top}decoder.{stack}_{j}.{theirs}", None, 0)
                out.append(Pair(ours, slot, experts, False, scale))
        elif key[1] == "mtp":
            k = key[2].split("_")[1]
            base = f"{top}mtp_block.mtp_layer_{k}.mtp_{k}_"
            if key[3] == "layer":
                theirs = base + "transformer_layer." + _layer_name(".".join(key[4:]), block, shared)
            else:
                theirs = base + MTP_NAMES[key[3]] + "." + ".".join(key[4:] or ("kernel",))
            out.append(Pair(Slot(ours_name, None, 0), Slot(theirs, None, 0), experts, key[3] == "projection"))
        else:
            theirs = {"token_embedder.embedding": "token_embedder.embedding", "decoder_norm.scale":
                      "decoder.decoder_norm.scale", "token_embedder.logits_dense": "decoder.logits_dense.kernel"}
            out.append(Pair(Slot(ours_name, None, 0), Slot(top + theirs[".".join(key[1:])], None, 0), False, False))
    return out


def upstream_layout(items: Items) -> tuple[str, bool]:
    """(params prefix, scanned) of an upstream item directory; one line when it is not upstream's tree."""
    for root in ROOTS:
        names = [n for n in items.names if n.startswith(root + "decoder.")]
        if names:
            scanned = any(re.match(re.escape(root) + r"decoder\.(layers|dense_layers|moe_layers)\.", n) for n in names)
            return root, scanned
    ours = any(n.startswith("params.token_embedder.") for n in items.names)
    raise ConfigError(f"load_parameters_path={shown_path(items.path)} is not upstream MaxText's parameter tree (no "
                      "params/params/decoder/...)" + ("; it is this trainer's: load it directly" if ours else ""))


def _index(slot: Slot, expert: int | None) -> tuple:
    """TensorStore's index of a slot (and of one expert, axis 0 of the layer)."""
    index = [slice(None)] * (slot.axis + 1)
    if slot.layer is not None:
        index[slot.axis] = slot.layer
    if expert is not None:
        at = 1 if slot.layer is not None and slot.axis == 0 else 0
        index = index + [slice(None)] * 2
        index[at] = expert
    return tuple(index)


def _swap_halves(a: np.ndarray) -> np.ndarray:
    d = a.shape[0] // 2
    return np.concatenate([a[d:], a[:d]])


def _sides(to_upstream: bool):
    return ((lambda p: p.ours), (lambda p: p.theirs)) if to_upstream else ((lambda p: p.theirs), (lambda p: p.ours))


def upstream_family(items: Items, root: str) -> str | None:
    """The decoder_block whose MoE block names (BLOCKS) upstream's tree holds; None when it holds none of them."""
    layers = re.compile(re.escape(root) + r"decoder\.(?:layers|dense_layers|moe_layers)(?:_\d+)?\.(.+)")
    found = {m.group(1) for m in map(layers.match, items.names) if m}
    for block in ("deepseek", "qwen3_moe", "mixtral"):  # DeepSeek's MoeBlock_0 lies inside DeepSeekMoeBlock_0
        if any(name.startswith(BLOCKS[block][0] + ".") for name in found):
            return block
    return None


def check_upstream_family(cfg, items: Items, root: str) -> None:
    """ConfigError when upstream's checkpoint holds another family's MoE layers than this config builds."""
    theirs = upstream_family(items, root)
    if theirs is not None and cfg.decoder_block in BLOCKS and theirs != cfg.decoder_block:
        raise ConfigError(f"load_parameters_path={shown_path(items.path)} holds upstream's {theirs} layers "
                          f"({BLOCKS[theirs][0]}) but decoder_block={cfg.decoder_block} here; use the model keys it "
                          "was written with (its model_name and command-line keys)")


def target_arrays(source: Items, pairs_: list[Pair], to_upstream: bool) -> list[ArrayOut]:
    """The arrays the copy writes (shapes from the source's, chunked by layer and expert), read from the source's
    metadata alone; every source array named must exist."""
    src, dst = _sides(to_upstream)
    groups: dict[str, list[Pair]] = {}
    for p in pairs_:
        groups.setdefault(dst(p).name, []).append(p)
    arrays = []
    for name, group in groups.items():
        first_src, first_dst = src(group[0]), dst(group[0])
        if first_src.name not in source:
            raise ConfigError(f"load_parameters_path={shown_path(source.path)} holds no {first_src.name}; use the "
                              "model keys it "
                              "was written with (model_name, scan_layers, mtp_num_layers and the keys of its command "
                              "line)")
        shape = list(source.shape(first_src.name))
        if first_src.layer is not None:
            del shape[first_src.axis]
        chunk = list(shape)
        if first_dst.layer is not None:
            shape.insert(first_dst.axis, len(group))
            chunk.insert(first_dst.axis, 1)
        if group[0].experts:
            chunk[1 if first_dst.layer is not None and first_dst.axis == 0 else 0] = 1
        arrays.append(ArrayOut(tuple(name.split(".")), tuple(shape), source.dtype(first_src.name), tuple(chunk)))
    return arrays


def copy(source: Items, pairs_: list[Pair], to_upstream: bool, item_dir: str, arrays: list[ArrayOut]) -> None:
    """Writes the target tree of `pairs_` (its `arrays`, from target_arrays) from `source`, a layer of one array at
    a time, experts one by one."""
    src, dst = _sides(to_upstream)
    stores = create_items(item_dir, arrays)
    for p in pairs_:
        for e in range(p.experts) if p.experts else [None]:
            part = source.read(src(p).name, _index(src(p), e))
            if p.swap_halves:
                part = _swap_halves(part)
            if p.scale != 1.0:
                part = (part * (1 / p.scale if to_upstream else p.scale)).astype(part.dtype)
            stores[dst(p).name][_index(dst(p), e)].write(part).result()


def _paths(argv: list[str]) -> tuple[str, str, list[str]]:
    """(load_parameters_path, <out>/0 (refused when it exists), the rest for load_config)."""
    found, rest = split_paths(argv, ("load_parameters_path", "base_output_directory"))
    return found["load_parameters_path"], new_step_dir(found["base_output_directory"]), rest


def abstract_tree(cfg) -> dict[str, tuple]:
    """{dot-joined name: shape} of this config's saved params and routing biases."""
    # here, not at the top: JAX and the model load only after the inputs pass their checks (a mistake is one line
    # without JAX's start-up)
    import jax

    from MaxText.planning import plan
    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    spec = state_spec(cfg, plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES}))
    out = {}
    for root in ("params", "nnx_aux"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(spec.abstract.get(root, {}))[0]:
            out[".".join((root, *(str(getattr(k, "key", k)) for k in path)))] = tuple(leaf.shape)
    return out


def from_upstream(argv: list[str], log=print) -> str:
    """Upstream MaxText's items -> this trainer's (<out>/0/items and checksums); returns the items written."""
    # here, not at the top: JAX and the model load only after the inputs pass their checks (a mistake is one line
    # without JAX's start-up)
    from MaxText.trainer.checkpointing import CHECKSUMS, ITEM

    path, step_dir, rest = _paths(argv)
    cfg = load_config(rest)
    source = Items(path, "load_parameters_path")
    root, scanned = upstream_layout(source)
    check_upstream_family(cfg, source, root)
    pairs_ = pairs(cfg, scanned, root)
    if cfg.routed_bias and not any(p.theirs.name in source for p in pairs_ if p.ours.name.startswith("nnx_aux.")):
        log(f"{path} holds no routing biases (nnx_aux/model/...gate/bias): imported without them, so they restart "
            "at zero")
        pairs_ = [p for p in pairs_ if not p.ours.name.startswith("nnx_aux.")]
    wanted = abstract_tree(cfg)
    used = {p.theirs.name for p in pairs_}
    unused = [n for n in source.names if n.startswith(root) and n not in used
              and not (root == "params." and n.startswith("params.params."))]
    mtp = [n for n in unused if n.startswith(root + "mtp_block.")]
    if mtp and not cfg.mtp_num_layers:
        log(f"not imported: upstream's MTP block ({len(mtp)} arrays), as mtp_num_layers=0")
        unused = [n for n in unused if n not in mtp]
    if unused:
        raise ConfigError(f"array {unused[0]} of {shown_path(path)} has no place in this model ({len(unused)} such); "
                          "use the model keys it was written with")

    arrays = target_arrays(source, pairs_, False)
    for a in arrays:  # every shape checked before anything is written
        name = ".".join(a.key)
        if wanted.get(name) != tuple(a.shape):
            raise ConfigError(f"{shown_path(path)} gives {name} the shape {list(a.shape)} but this config needs "
                              f"{list(wanted.get(name, ()))}; use the model keys it was written with")

    def write(partial):
        copy(source, pairs_, False, os.path.join(partial, ITEM), arrays)
        save_shapes(os.path.join(partial, CHECKSUMS), {a.key: a.shape for a in arrays})

    write_step(step_dir, write)
    item = os.path.join(step_dir, ITEM)
    log(f"imported upstream MaxText's {'scanned' if scanned else 'unscanned'} {path} into {item} "
        f"(scan_layers={str(cfg.scan_layers).lower()})")
    return item


def to_upstream(argv: list[str], log=print) -> str:
    """This trainer's items -> upstream MaxText's (<out>/0/items); returns the items written."""
    path, step_dir, rest = _paths(argv)
    cfg = load_config(rest)
    source = Items(path, "load_parameters_path")
    if any(n.startswith(ROOTS[0] + "decoder.") for n in source.names):
        raise ConfigError(f"load_parameters_path={shown_path(path)} is upstream MaxText's tree already")
    pairs_ = pairs(cfg, bool(cfg.scan_layers), ROOTS[0])
    if cfg.routed_bias and not any(p.ours.name in source for p in pairs_ if p.ours.name.startswith("nnx_aux.")):
        log(f"{path} holds no routing biases (nnx_aux): exported without them")
        pairs_ = [p for p in pairs_ if not p.ours.name.startswith("nnx_aux.")]
    wanted = abstract_tree(cfg)
    for p in pairs_:
        if p.ours.name in source and source.shape(p.ours.name) != wanted[p.ours.name]:
            raise ConfigError(f"{shown_path(path)} holds {p.ours.name} as {list(source.shape(p.ours.name))} but this "
                              f"config needs {list(wanted[p.ours.name])}; use the config it was written with")
    arrays = target_arrays(source, pairs_, True)  # every source array present, before anything is written
    write_step(step_dir, lambda partial: copy(source, pairs_, True, os.path.join(partial, "items"), arrays))
    item = os.path.join(step_dir, "items")
    log(f"exported {path} as upstream MaxText's {'scanned' if cfg.scan_layers else 'unscanned'} tree into {item} "
        "(upstream: load_parameters_path=" + item + ")")
    return item


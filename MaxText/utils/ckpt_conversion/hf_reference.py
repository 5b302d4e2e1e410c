"""transformers' own float32 logits of token rows for a Hugging Face checkpoint directory.

    <python with transformers and torch> MaxText/utils/ckpt_conversion/hf_reference.py \\
        --hf_dir DIR --tokens rows.npy --out logits.npy [--stream | --generate N]

DIR holds config.json and safetensors (one model.safetensors, or shards listed by model.safetensors.index.json).
rows.npy is an integer array [B, L] of token ids; logits.npy gets transformers' logits [B, L, V] as float32, the
model built by AutoModelForCausalLM (deepseek_v3, deepseek_v2, mixtral, qwen3_moe, any causal LM transformers
knows) from local files only, computed in float32 whatever the stored dtype, with transformers' eager attention
and eager experts (the plain definitions in its modelling files, no kernel choice involved). --generate N writes
instead transformers' greedy continuation of each row, N token ids [B, N] (model.generate with its own KV cache).

DeepSeek's FP8 release form (config.json quantization_config {"quant_method": "fp8", "weight_block_size": [128,
128], ...}; each quantized weight W float8_e4m3fn [out, in] with a float32 W_scale_inv [ceil(out/128),
ceil(in/128)]) is dequantized here, W times its block's scale (edge blocks partial), and loaded into the model
built without the quantization: transformers' FP8 path needs a GPU, and on CPU it falls back to bfloat16.

--stream keeps memory to about one decoder layer, for checkpoints larger than host memory (DeepSeek-V3 671B):
the model is built without memory (meta device) and run by transformers' own forward, unchanged; each of its
stages (the embedding, each decoder layer, the final norm, the head) is read from the safetensors by name (FP8
dequantized) just before it runs on all the rows, through transformers' own weight renaming and expert fusion,
and freed right after. The result equals the mode without --stream. Memory is one stage in float32 (a
DeepSeek-V3 MoE layer is about 46 GB) and, while transformers fuses a layer's experts, briefly up to about twice
that; plus the activations of all the rows.

Checkpoint tensors the model does not hold (e.g. DeepSeek's MTP layer model.layers.<num_hidden_layers>.*, which
transformers' DeepseekV3ForCausalLM does not build) are skipped, as transformers does, and named in one stderr
line. A tensor the model needs but the checkpoint lacks is an error (transformers would initialise it randomly).

Errors (no such directory, not a checkpoint, a config or weights transformers cannot read, bad token rows) are
one line on stderr and exit status 2.

This script runs in an interpreter with transformers and torch (the repository's .venv-hf, made by
scripts/setup_hf.sh): it imports nothing from the MaxText package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

FP8_SCALE_SUFFIX = "_scale_inv"
# The plain definitions in transformers' modelling files: the same numbers whatever kernels this torch has.
IMPLEMENTATIONS = dict(attn_implementation="eager", experts_implementation="eager")


class InputError(Exception):
    """A problem with the inputs, reported as one stderr line and exit status 2."""


def log(message: str) -> None:
    print(f"hf_reference: {message}", file=sys.stderr, flush=True)


# ---- the checkpoint's files ----

class Checkpoint:
    """The safetensors of a checkpoint directory, read tensor by tensor by name as float32 (FP8 blocks dequantized)."""

    def __init__(self, hf_dir: str, fp8_block: tuple[int, int] | None):
        self.hf_dir = hf_dir
        self.fp8_block = fp8_block
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(f"{index} has no weight_map")
            self.file_of = dict(weight_map)
        elif os.path.isfile(single):
            self.file_of = {name: "model.safetensors" for name in self._keys("model.safetensors")}
        else:
            raise InputError(f"{hf_dir} is not a safetensors checkpoint (no model.safetensors or "
                             "model.safetensors.index.json)")
        for file in sorted(set(self.file_of.values())):
            if not os.path.isfile(os.path.join(hf_dir, file)):
                raise InputError(f"{hf_dir}: the index names {file}, which is not there")
        self._open = {}
        # In FP8 form a weight's scale is read with the weight, so the scales are not tensors of their own.
        scales = {n for n in self.file_of if fp8_block and n.endswith(FP8_SCALE_SUFFIX)
                  and n[:-len(FP8_SCALE_SUFFIX)] in self.file_of}
        self.names = sorted(n for n in self.file_of if n not in scales)
        self.quantized = {n[:-len(FP8_SCALE_SUFFIX)] for n in scales}

    def _safe_open(self, file: str):
        from safetensors import safe_open

        path = os.path.join(self.hf_dir, file)
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors' own error type: a truncated or foreign file
            raise InputError(f"cannot read {path}: {_one_line(e)}") from None

    def _keys(self, file: str) -> list[str]:
        with self._safe_open(file) as f:
            return list(f.keys())

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = self._safe_open(file)
        return self._open[file]

    def _raw(self, name: str):
        return self._handle(self.file_of[name]).get_tensor(name)

    def read(self, name: str):
        """The tensor `name` as float32 (integer tensors as they are), dequantized when it is an FP8 weight."""
        import torch

        t = self._raw(name)
        if name in self.quantized:
            return dequantize_fp8(t, self._raw(name + FP8_SCALE_SUFFIX), self.fp8_block, name)
        return t.to(torch.float32) if t.is_floating_point() else t

    def state_dict(self) -> dict:
        return {name: self.read(name) for name in self.names}


def dequantize_fp8(weight, scale_inv, block: tuple[int, int], name: str):
    """W (float8 [out, in]) times the float32 scale of its [block[0], block[1]] block; the last blocks of each axis
    may be partial, so the scale grid is [ceil(out/block[0]), ceil(in/block[1])]."""
    import torch

    if weight.ndim != 2:
        raise InputError(f"{name}: an FP8 weight must be 2-D, it is {list(weight.shape)}")
    out_dim, in_dim = weight.shape
    grid = (-(-out_dim // block[0]), -(-in_dim // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise InputError(f"{name}{FP8_SCALE_SUFFIX} is {list(scale_inv.shape)}; a {list(weight.shape)} weight in "
                         f"{block[0]}x{block[1]} blocks needs {list(grid)}")
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.to(torch.float32) * scale[:out_dim, :in_dim]


# ---- the config ----

def load_config(hf_dir: str):
    """transformers' config of DIR (either config schema, as transformers reads it), with DeepSeek's FP8
    quantization_config taken out; returns (config, FP8 block size or None)."""
    from transformers import AutoConfig

    if not os.path.isdir(hf_dir):
        raise InputError(f"{hf_dir} is not a directory")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise InputError(f"{hf_dir} is not a Hugging Face checkpoint (no config.json)")
    try:
        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True, **IMPLEMENTATIONS)
    except Exception as e:  # transformers raises many kinds; all mean it cannot read this config
        raise InputError(f"transformers cannot read {hf_dir}/config.json: {_one_line(e)}") from None
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return config, None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "fp8":
        raise InputError(f"{hf_dir}: quantization {quant.get('quant_method')!r} is not supported here (only "
                         "DeepSeek's FP8 block form, quant_method fp8)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise InputError(f"{hf_dir}: quantization_config.weight_block_size {block!r} is not two block sizes")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise InputError(f"{hf_dir}: FP8 format {quant.get('fmt')!r} is not supported (only e4m3)")
    # Built without it, the model is plain float32; the weights are dequantized as they are read.
    del config.quantization_config
    log(f"FP8 checkpoint: dequantizing its {block[0]}x{block[1]} blocks to float32 here (transformers' FP8 path "
        "needs a GPU)")
    return config, (block[0], block[1])


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def _skipped(names) -> str:
    """A short account of checkpoint tensors the model does not hold: their distinct layer prefixes."""
    prefixes = sorted({".".join(n.split(".")[:3]) if n.startswith("model.layers.") else n for n in names})
    shown = ", ".join(f"{p}.*" if p.startswith("model.layers.") else p for p in prefixes[:4])
    return shown + (f" and {len(prefixes) - 4} more" if len(prefixes) > 4 else "")


# ---- the whole model at once ----

def whole_model(hf_dir: str, config, checkpoint: Checkpoint):
    """transformers' from_pretrained in float32; for FP8 the dequantized tensors are handed to it as a state dict."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    kwargs = dict(config=config, dtype=torch.float32, local_files_only=True, output_loading_info=True,
                  **IMPLEMENTATIONS)
    try:
        if checkpoint.fp8_block:
            # transformers takes a state dict in place of the files (never with them), through the model's own
            # class: the Auto class needs a path.
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            model, info = model_class.from_pretrained(None, state_dict=checkpoint.state_dict(), **kwargs)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    except Exception as e:
        raise InputError(f"transformers cannot load {hf_dir}: {_one_line(e)}") from None
    if info.get("missing_keys"):
        raise InputError(f"{hf_dir} lacks tensors the model needs: {sorted(info['missing_keys'])[:5]}")
    if info.get("mismatched_keys"):
        raise InputError(f"{hf_dir}: tensors of the wrong shape: {sorted(info['mismatched_keys'])[:3]}")
    if info.get("unexpected_keys"):  # named as transformers renames them (experts fused: fewer than on disk)
        log(f"skipped checkpoint tensors the model does not hold: {_skipped(info['unexpected_keys'])} "
            f"({len(info['unexpected_keys'])} after transformers' renaming)")
    return model.eval()


# ---- one stage at a time ----

class Streamer:
    """Runs transformers' model with each stage's weights present only while that stage runs.

    The model is built on the meta device; forward pre-hooks on each stage read its tensors from the checkpoint
    and load them through transformers' own loader (its renamings, e.g. Mixtral's block_sparse_moe, and expert
    fusion into gate_up_proj), and forward hooks put them back on the meta device. transformers' own forward runs
    unchanged in between, so its rotary embedding, causal mask and layer calls are its own."""

    def __init__(self, config, checkpoint: Checkpoint):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.checkpoint = checkpoint
        try:
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except Exception as e:
            raise InputError(f"transformers cannot build the model of {checkpoint.hf_dir}: {_one_line(e)}") from None
        self._rebuild_buffers()
        self.mapping = get_model_conversion_mapping(self.model)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        expected = self.model.state_dict()  # names and shapes only: every tensor is on the meta device
        self.stages = dict(_stages(self.model))
        covered = {k for path, m in self.stages.items() for k in _names(path, m)}
        if covered != set(expected):
            raise InputError(f"cannot stream {type(self.model).__name__}: tensors outside its stages "
                             f"{sorted(set(expected) - covered)[:5]}")
        # Each checkpoint tensor goes to the stage that holds its (renamed) target, as from_pretrained would put it.
        self.sources = {path: [] for path in self.stages}
        self.target_of, self.by_target = {}, {}
        skipped = []
        for name in checkpoint.names:
            target, _ = rename_source_key(name, renamings, converters, self.model.base_model_prefix, expected)
            path = _stage_of(target, self.stages)
            if path is None or target not in expected:
                skipped.append(name)
            else:
                self.sources[path].append(name)
                self.target_of[name] = target
                self.by_target.setdefault(target, []).append(name)
        if skipped:
            log(f"skipped checkpoint tensors the model does not hold: {_skipped(skipped)} ({len(skipped)} tensors)")
        # {target: source} of tied tensors (a head tied to the embedding): transformers loads the source and ties.
        self.tied = dict(getattr(self.model, "all_tied_weights_keys", None) or {})
        self.started = time.time()
        for path, module in self.stages.items():
            module.register_forward_pre_hook(lambda m, args, path=path: self._load(path, m))
            module.register_forward_hook(_free)

    def _rebuild_buffers(self):
        """Buffers that are not saved (the rotary embedding's inv_freq) are computed at construction, so on the
        meta device they are empty: build those modules again on the CPU, from the same config."""
        import torch

        for path, module in list(self.model.named_modules()):
            persistent = set(module.state_dict(keep_vars=True))
            lost = [n for n, b in module.named_buffers(recurse=False) if b.is_meta and n not in persistent]
            if not lost:
                continue
            if not type(module).__name__.endswith("RotaryEmbedding") or not hasattr(module, "config"):
                raise InputError(f"cannot stream: {path} has buffers {lost} that only its constructor computes")
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            parent, _, child = path.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, fresh)

    def _load(self, path: str, module):
        import torch
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        tied = {n: self.tied[n] for n in _names(path, module) if n in self.tied}
        tensors = {}
        for name in self.sources[path]:
            if self.target_of[name] not in tied:  # transformers ties these to their source instead
                tensors[name] = self.checkpoint.read(name)
        for target, source in tied.items():
            origin = self.by_target.get(source, [])
            if len(origin) != 1:
                raise InputError(f"cannot stream: {target} is tied to {source}, which the checkpoint holds as "
                                 f"{len(origin)} tensors")
            tensors[target] = self.checkpoint.read(origin[0])
        load_config = LoadStateDictConfig(dtype=torch.float32, weight_mapping=self.mapping, device_map={"": "cpu"})
        info, _ = convert_and_load_state_dict_in_model(self.model, tensors, load_config)
        del tensors
        if info.mismatched_keys or info.conversion_errors:
            raise InputError(f"{self.checkpoint.hf_dir}: {path} does not load: "
                             f"{sorted(info.mismatched_keys)[:3] or info.conversion_errors}")
        missing = [n for n in _names(path, module) if _get(self.model, n).is_meta]
        if missing:
            raise InputError(f"{self.checkpoint.hf_dir} lacks tensors the model needs: {missing[:5]}")
        log(f"{path} loaded ({time.time() - self.started:.1f}s)")

    def __call__(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _stages(model, prefix: str = ""):
    """(path, module) of the model's stages in their order: each element of a ModuleList (the decoder layers), and
    every other child holding tensors (embedding, final norm, head); the base model is looked into."""
    from torch import nn
    from transformers import PreTrainedModel

    for name, child in model.named_children():
        path = prefix + name
        if isinstance(child, nn.ModuleList):
            for i, layer in enumerate(child):
                yield f"{path}.{i}", layer
        elif isinstance(child, PreTrainedModel):
            yield from _stages(child, path + ".")
        elif child.state_dict():
            yield path, child


def _names(path: str, module) -> list[str]:
    return [f"{path}.{k}" for k in module.state_dict(keep_vars=True)]


def _free(module, args, output):
    """Forward hook: the stage has run, its tensors go back to the meta device (returns None: output unchanged)."""
    module.to("meta")


def _stage_of(name: str, stages: dict) -> str | None:
    return next((p for p in stages if name.startswith(p + ".")), None)


def _get(model, name: str):
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


# ---- the command ----

def read_tokens(path: str, vocab_size: int) -> np.ndarray:
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read token rows {path}: {_one_line(e)}") from None
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer) or rows.size == 0:
        raise InputError(f"{path} must hold integer token rows [B, L], it is {rows.dtype} {list(rows.shape)}")
    if rows.min() < 0 or rows.max() >= vocab_size:
        raise InputError(f"{path} has token ids outside [0, {vocab_size}): {int(rows.min())}..{int(rows.max())}")
    return rows


def reference_logits(hf_dir: str, rows: np.ndarray | None = None, tokens: str | None = None,
                     stream: bool = False) -> np.ndarray:
    """transformers' float32 logits [B, L, V] of the token rows (an array, or an .npy path in `tokens`)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # what matters is reported here, in one line each
    transformers.utils.logging.disable_progress_bar()
    config, fp8_block = load_config(hf_dir)
    checkpoint = Checkpoint(hf_dir, fp8_block)
    vocab_size = config.get_text_config().vocab_size
    if rows is None:
        rows = read_tokens(tokens, vocab_size)
    run = Streamer(config, checkpoint) if stream else whole_model(hf_dir, config, checkpoint)
    input_ids = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    with torch.no_grad():
        logits = run(input_ids) if stream else run(input_ids=input_ids, use_cache=False).logits
    return logits.to(torch.float32).numpy()


def reference_greedy(hf_dir: str, tokens: str, steps: int) -> np.ndarray:
    """transformers' own greedy continuation [B, steps] (int32) of the token rows: model.generate with its KV cache,
    no sampling, exactly `steps` tokens (an EOS does not stop it), in float32."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config, fp8_block = load_config(hf_dir)
    checkpoint = Checkpoint(hf_dir, fp8_block)
    rows = read_tokens(tokens, config.get_text_config().vocab_size)
    model = whole_model(hf_dir, config, checkpoint)
    input_ids = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps, use_cache=True, pad_token_id=0)
    return out[:, rows.shape[1]:].numpy().astype(np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf_reference.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_dir", required=True, help="the checkpoint directory (config.json + safetensors)")
    parser.add_argument("--tokens", required=True, help=".npy of integer token rows [B, L]")
    parser.add_argument("--out", required=True, help="where to write the float32 logits [B, L, V] (.npy)")
    parser.add_argument("--stream", action="store_true",
                        help="one stage (embedding, decoder layer, norm, head) in memory at a time")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="write transformers' greedy continuation of each row, N token ids [B, N], instead")
    args = parser.parse_args(argv)
    try:
        # Before the work, which can take hours for a large checkpoint.
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise InputError(f"cannot write {args.out}: its directory does not exist")
        if args.generate is not None:
            if args.stream or args.generate < 1:
                raise InputError("--generate N takes N >= 1 and the whole model (not --stream)")
            np.save(args.out, reference_greedy(args.hf_dir, args.tokens, args.generate))
            return 0
        logits = reference_logits(args.hf_dir, tokens=args.tokens, stream=args.stream)
        np.save(args.out, logits)
    except InputError as e:
        log(f"error: {e}")
        return 2
    except Exception as e:  # transformers or torch failing on this checkpoint: one line, not a traceback
        log(f"error: {type(e).__name__}: {_one_line(e)}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

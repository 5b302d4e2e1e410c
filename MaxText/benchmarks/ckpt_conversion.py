"""Peak host memory of a Hugging Face import against the checkpoint's size:

    python -m MaxText.benchmarks.ckpt_conversion [--layers 8 --experts 64 --dim 1024 --fp8 --upstream --json PATH]

Writes a synthetic DeepSeek-V3-layout checkpoint (bf16, or DeepSeek's FP8 blocks with --fp8) into a temporary
directory, imports it with MaxText.utils.ckpt_conversion.to_maxtext in a child process, and reports the child's
peak resident memory (from after its imports) beside the checkpoint's bytes, the float32 model's bytes and the
largest single tensor (the embedding: what the streaming import holds at once), plus the child's resident memory
once its imports are done (the Python/JAX baseline). With --upstream, the import is then exported to upstream
MaxText's tree (to_upstream) and that export imported back (from_upstream), each in its own child, measured the
same way (the streaming copy of upstream_ckpt: one layer of one array, expert by expert). Linux only (/proc).
Prints a table and one JSON line; never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

from MaxText.benchmarks import emit
from MaxText.utils.ckpt_conversion.safetensors_io import FP8_BLOCK, write_file

GIB = 2 ** 30
# The child resets its peak-RSS mark once its imports are done (Linux: /proc/self/clear_refs), so neither the
# imports nor the parent it was forked from count in the peak it reports (VmHWM, in KiB).
CHILD = """
import importlib, sys
tool = importlib.import_module("MaxText.utils.ckpt_conversion." + sys.argv[1])
import jax, orbax.checkpoint, tensorstore
def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
code = tool.main(sys.argv[2:])
print("RSS", base, status("VmHWM"))
sys.exit(code)
"""


def synthetic_release(directory: str, layers: int, experts: int, dim: int, fp8: bool, seed: int = 0) -> dict:
    """A DeepSeek-V3-layout checkpoint (one dense layer, then MoE; one file per layer); returns its config."""
    rng = np.random.default_rng(seed)
    heads, q_rank, kv_rank, nope, rope, v = 8, dim // 4, dim // 8, 64, 32, 64
    inter, moe_inter, vocab = 2 * dim, dim // 2, 32000
    config = {"model_type": "deepseek_v3", "hidden_size": dim, "num_attention_heads": heads, "q_lora_rank": q_rank,
              "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
              "intermediate_size": inter, "moe_intermediate_size": moe_inter, "n_routed_experts": experts,
              "num_experts_per_tok": min(8, experts // 2), "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "num_hidden_layers": layers, "vocab_size": vocab,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc",
              "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
              "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}

    def linear(out, inp):
        w = rng.standard_normal((out, inp), np.float32) * inp ** -0.5
        if not fp8:
            return {"": w.astype(ml_dtypes.bfloat16)}
        scale = np.full((-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)), np.abs(w).max() / 448, np.float32)
        return {"": (w / scale[0, 0]).astype(ml_dtypes.float8_e4m3fn), "_scale_inv": scale}

    def put(tensors, name, parts):
        tensors.update({name + suffix: a for suffix, a in parts.items()})

    ones = lambda n: np.ones(n, ml_dtypes.bfloat16)  # noqa: E731
    weight_map = {}

    def write(file, tensors):  # one file at a time: the parent stays small
        write_file(os.path.join(directory, file), tensors)
        weight_map.update({n: file for n in tensors})

    head = {"model.embed_tokens.weight": rng.standard_normal((vocab, dim), np.float32).astype(ml_dtypes.bfloat16),
            "model.norm.weight": ones(dim), "lm_head.weight": (rng.standard_normal((vocab, dim), np.float32)
                                                              * dim ** -0.5).astype(ml_dtypes.bfloat16)}
    write("model-head.safetensors", head)
    del head
    for i in range(layers):
        p, t = f"model.layers.{i}", {}
        t[f"{p}.input_layernorm.weight"] = ones(dim)
        t[f"{p}.post_attention_layernorm.weight"] = ones(dim)
        t[f"{p}.self_attn.q_a_layernorm.weight"] = ones(q_rank)
        t[f"{p}.self_attn.kv_a_layernorm.weight"] = ones(kv_rank)
        for name, shape in (("q_a_proj", (q_rank, dim)), ("q_b_proj", (heads * (nope + rope), q_rank)),
                            ("kv_a_proj_with_mqa", (kv_rank + rope, dim)), ("kv_b_proj", (heads * (nope + v), kv_rank)),
                            ("o_proj", (dim, heads * v))):
            put(t, f"{p}.self_attn.{name}.weight", linear(*shape))
        if i == 0:
            for name, shape in (("gate_proj", (inter, dim)), ("up_proj", (inter, dim)), ("down_proj", (dim, inter))):
                put(t, f"{p}.mlp.{name}.weight", linear(*shape))
        else:
            t[f"{p}.mlp.gate.weight"] = (rng.standard_normal((experts, dim), np.float32) * dim ** -0.5).astype(
                ml_dtypes.bfloat16)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = np.zeros(experts, np.float32)
            for e in ["shared_experts"] + [f"experts.{x}" for x in range(experts)]:
                for name, shape in (("gate_proj", (moe_inter, dim)), ("up_proj", (moe_inter, dim)),
                                    ("down_proj", (dim, moe_inter))):
                    put(t, f"{p}.mlp.{e}.{name}.weight", linear(*shape))
        write(f"model-{i:05d}.safetensors", t)
        del t
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return {"config": config, "largest_tensor_bytes": vocab * dim * 4}  # the embedding (and head), float32


def _child(tool: str, *argv: str) -> tuple[int, int]:
    """(resident KiB after imports, peak resident KiB) of one conversion tool run in a child process."""
    child = subprocess.run([sys.executable, "-c", CHILD, tool, *argv], capture_output=True, text=True,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if child.returncode:
        raise SystemExit(f"{tool} failed:\n{child.stdout[-2000:]}{child.stderr[-2000:]}")
    base_kib, peak_kib = (int(x) for x in child.stdout.split("RSS ")[-1].split())
    return base_kib, peak_kib


def _bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m MaxText.benchmarks.ckpt_conversion", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--fp8", action="store_true", help="DeepSeek's FP8 block format instead of bf16")
    p.add_argument("--upstream", action="store_true", help="also export to upstream MaxText's tree and back")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, out = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
        os.makedirs(hf_dir)
        made = synthetic_release(hf_dir, args.layers, args.experts, args.dim, args.fp8)
        size = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir))
        base_kib, peak_kib = _child("to_maxtext", "configs/base.yml", f"hf_model_path={hf_dir}",
                                    f"base_output_directory={out}", "dtype=float32")
        written = _bytes(out)
        result = {"checkpoint_bytes": size, "format": "fp8" if args.fp8 else "bf16", "float32_model_bytes": written,
                  "largest_tensor_bytes": made["largest_tensor_bytes"], "baseline_rss_bytes": base_kib * 1024,
                  "peak_rss_bytes": peak_kib * 1024}
        rows = [("checkpoint (" + result["format"] + ")", size), ("written (float32 params)", written),
                ("largest single tensor (float32)", result["largest_tensor_bytes"]),
                ("child RSS after imports", result["baseline_rss_bytes"]), ("child peak RSS", result["peak_rss_bytes"]),
                ("peak RSS above the baseline", result["peak_rss_bytes"] - result["baseline_rss_bytes"])]
        if args.upstream:
            keys = ["configs/base.yml", f"model_name={out}/model.yml", "dtype=float32"]
            for tool, source, target in (("to_upstream", f"{out}/0/items", "upstream"),
                                         ("from_upstream", f"{tmp}/upstream/0/items", "back")):
                base_kib, peak_kib = _child(tool, *keys, f"load_parameters_path={source}",
                                            f"base_output_directory={tmp}/{target}")
                result[tool] = {"written_bytes": _bytes(os.path.join(tmp, target)),
                                "baseline_rss_bytes": base_kib * 1024, "peak_rss_bytes": peak_kib * 1024}
                rows += [(f"{tool}: written", result[tool]["written_bytes"]),
                         (f"{tool}: peak RSS above the baseline", (peak_kib - base_kib) * 1024)]
    for name, value in rows:
        print(f"{name:<42} {value / GIB:8.2f} GiB")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

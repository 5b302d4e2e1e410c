"""Tiny random checkpoints written by Hugging Face transformers itself, with transformers' own logits.

    <python with transformers and torch> tests/hf_written.py OUT_DIR

For each case, OUT_DIR/<case>/ holds the checkpoint as transformers 5 writes it (config.json, safetensors, one file
or sharded with model.safetensors.index.json), rows.npy (int32 [2, 12] token ids, vocabulary 64, fixed seed) and
logits.npy (float32 [2, 12, 64]: transformers' model in eval mode, float32, eager attention and experts, on those
rows). OUT_DIR/cases.json maps each case to a one-line description.

The models come from transformers' own config classes. transformers' default init (std 0.02) gives nearly uniform
logits and near-ties in routing, so every weight is overwritten with seeded values of a sensible scale, and the
routing of the rows is checked to have a clear margin everywhere (a tie would make the logits depend on rounding).

This file runs in its own interpreter (the repository's .venv-hf, or HF_PYTHON): it imports nothing from the
project, only numpy, torch, transformers and safetensors.
"""

import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB, BATCH, LENGTH = 64, 2, 12
ROWS_SEED = 1234
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ROUTING_MARGIN = 1e-3  # the least gap at a routing decision (a logit or a score): far above float32 noise
V4_EQUAL = 1e-6  # a v4-schema config must give the same logits as the v5 one it was rewritten from
# The implementations that are the plain definitions in each modelling file (no kernel choice involved).
IMPLEMENTATIONS = dict(attn_implementation="eager", experts_implementation="eager")

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, max_position_embeddings=32,
              tie_word_embeddings=False)
MIXTRAL = dict(COMMON, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
               num_local_experts=4, num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 5000.0})
QWEN3 = dict(COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2,
             head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
# intermediate_size 160 (the one dense layer) spans two FP8 blocks of 128 with a partial edge block, so a reader
# that derives the block size from the scale grid (160 / 2 = 80) instead of weight_block_size is caught.
DEEPSEEK = dict(COMMON, intermediate_size=160, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=4,
                q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
DEEPSEEK_MSCALE0 = {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 8,
                    "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
DEEPSEEK_PLAIN = {"rope_type": "default", "rope_theta": 10000.0}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# The four DeepSeek cases share their weights. With ~100 routing decisions per forward, some seeds come within
# ROUTING_MARGIN of a tie somewhere; seed 6 does not in any of the four.
DEEPSEEK_SEED = 6
# The transformers versions the released configs of each family were written with (what a v4 config says).
V4_VERSION = {"mixtral": "4.36.0", "qwen3_moe": "4.51.0", "deepseek_v3": "4.46.3"}


def token_rows() -> np.ndarray:
    """The fixed int32 [BATCH, LENGTH] token rows every case is run on."""
    return np.random.default_rng(ROWS_SEED).integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)


def _is_router(name: str) -> bool:
    return name.endswith("mlp.gate.weight")


def randomize(model: torch.nn.Module, seed: int, router_std: float) -> None:
    """Overwrites every parameter (and DeepSeek's e_score_correction_bias) with seeded values of a sensible scale:
    matrices normal / sqrt(fan_in), norm weights 1 + 0.1 normal, the embedding std 1, routers std `router_std`,
    the correction bias 0.1 normal."""
    gen = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for name, t in tensors:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name:
                value = noise
            elif _is_router(name):
                value = router_std * noise
            elif t.ndim == 1:
                value = 1.0 + 0.1 * noise if "norm" in name else 0.1 * noise
            else:  # [.., out, in] in transformers' layout: the last axis is the one a matmul sums over
                value = noise / math.sqrt(t.shape[-1])
            t.copy_(value.to(t.dtype))


def build(config_cls, model_cls, seed: int, router_std: float, **fields):
    """A model of transformers' class from its config class, randomized, float32, eval mode."""
    config = config_cls(**fields, **IMPLEMENTATIONS)
    torch.manual_seed(seed)  # transformers' own init runs first; make it reproducible too
    model = model_cls(config).to(torch.float32).eval()
    randomize(model, seed, router_std)
    return model


def logits_of(model, rows: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(rows).long()).logits
    return out.to(torch.float32).numpy()


class RoutingMargins:
    """Records, while a model runs, the least gap at every routing decision its routers make, so a case whose
    routing is near a tie (and so depends on rounding) fails here instead of confusing a comparison later."""

    def __init__(self, model):
        self.least = math.inf
        self.handles = [m.register_forward_hook(self._hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]

    def _hook(self, module, inputs, output):
        logits = output[0].detach().to(torch.float64)
        k = module.top_k
        if hasattr(module, "e_score_correction_bias"):  # DeepSeek: sigmoid scores, group-limited choice
            scores = logits.sigmoid() + module.e_score_correction_bias.to(torch.float64)
            groups = scores.view(len(scores), module.num_group, -1)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            self._gap(group_scores, module.topk_group)
            chosen = group_scores.topk(module.topk_group, dim=-1).indices
            candidates = torch.gather(groups, 1, chosen[..., None].expand(-1, -1, groups.shape[-1]))
            self._gap(candidates.reshape(len(scores), -1), k)
        else:  # softmax routers: the order of the logits is the order of the probabilities
            self._gap(logits, k)

    def _gap(self, values, k):
        if values.shape[-1] > k:
            top = values.sort(dim=-1, descending=True).values
            self.least = min(self.least, float((top[:, k - 1] - top[:, k]).min()))

    def close(self):
        for h in self.handles:
            h.remove()


def checked_logits(model, rows, case):
    margins = RoutingMargins(model)
    logits = logits_of(model, rows)
    margins.close()
    if margins.least < ROUTING_MARGIN:
        raise SystemExit(f"hf_written: {case}: routing has a near tie (least margin {margins.least:.2e})")
    return logits, margins.least


def plain_inv_freq(rope_theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def check_yarn(model, rope_theta, dim, case, expect_attention_factor):
    """The YaRN ramp must change some frequency at these tiny dims, and transformers' attention_factor (applied
    to cos and sin) must be what the case is about."""
    rotary = model.model.rotary_emb
    changed = int((~torch.isclose(rotary.inv_freq, plain_inv_freq(rope_theta, dim))).sum())
    if changed == 0:
        raise SystemExit(f"hf_written: {case}: the YaRN ramp changes no frequency at these dims")
    if not math.isclose(rotary.attention_scaling, expect_attention_factor, rel_tol=1e-9):
        raise SystemExit(f"hf_written: {case}: attention_factor {rotary.attention_scaling}, expected "
                         f"{expect_attention_factor}")
    return changed


def save(model, directory, shard: bool):
    """save_pretrained as transformers writes it; `shard` splits it into several files with an index."""
    model.save_pretrained(directory, **({"max_shard_size": "64KB"} if shard else {}))


def read_checkpoint(directory) -> dict:
    """Every tensor of a checkpoint directory by name (all shards)."""
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def write_case(out_dir, case, rows, logits):
    np.save(os.path.join(out_dir, case, "rows.npy"), rows)
    np.save(os.path.join(out_dir, case, "logits.npy"), logits.astype(np.float32))


# ---- DeepSeek's FP8 block release form ----

def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn [out, in] and its float32 scale_inv [ceil(out/128), ceil(in/128)] (max |w| / 448 per block,
    the edge blocks partial), so that w ~ fp8 * scale_inv blockwise."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    for r in range(rows):
        for c in range(cols):
            block = w[r * FP8_BLOCK:(r + 1) * FP8_BLOCK, c * FP8_BLOCK:(c + 1) * FP8_BLOCK]
            scale_inv[r, c] = block.abs().max().clamp(min=1e-12) / FP8_MAX
    q = (w / expand_blocks(scale_inv, w.shape)).to(torch.float8_e4m3fn)
    return q, scale_inv


def expand_blocks(scale_inv: torch.Tensor, shape) -> torch.Tensor:
    """The per-block scales as a full [out, in] tensor (edge blocks cut to the weight's shape)."""
    full = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return full[:shape[0], :shape[1]]


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * expand_blocks(scale_inv, q.shape)


def is_quantized_in_release(name: str, t: torch.Tensor) -> bool:
    """The Linear weights DeepSeek ships in FP8: attention, dense MLPs, experts, shared experts (and in the MTP
    layer its eh_proj), not the embedding, the head, norms or the router."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and t.ndim == 2
            and not _is_router(name) and not name.endswith(("embed_tokens.weight", "shared_head.head.weight")))


def write_fp8(src_dir, dst_dir, extra: dict | None = None) -> dict:
    """Writes the checkpoint of `src_dir` (plus `extra` tensors) in the FP8 release form into dst_dir; returns the
    dequantized tensors of the main model (what the FP8 file means)."""
    os.makedirs(dst_dir, exist_ok=True)
    tensors = dict(read_checkpoint(src_dir), **(extra or {}))
    stored, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized_in_release(name, t):
            q, scale_inv = fp8_quantize(t.to(torch.float32))
            stored[name], stored[f"{name}_scale_inv"] = q, scale_inv
            value = fp8_dequantize(q, scale_inv)
        else:
            stored[name] = value = t
        if extra is None or name not in extra:
            dequantized[name] = value
    save_file({k: v.contiguous() for k, v in stored.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = FP8_CONFIG
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return dequantized


def model_from_tensors(src_dir, tensors: dict):
    """transformers' model of src_dir/config.json with these checkpoint tensors, loaded by transformers' own
    from_pretrained (its renamings and expert fusion) from a scratch directory."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(src_dir, "config.json"), tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True,
                                                    **IMPLEMENTATIONS).eval()


def mtp_layer(config: dict, main: dict, seed: int) -> dict:
    """The MTP layer DeepSeek's releases carry as model.layers.<num_hidden_layers>.* (embedding, enorm, hnorm,
    eh_proj, shared_head, and one MoE decoder layer) in the checkpoint's names: its embedding and head are copies of
    the main model's (`main`: the checkpoint's tensors), as in the releases, the rest seeded random. transformers'
    DeepseekV3ForCausalLM does not build it."""
    gen = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    e, f = config["n_routed_experts"], config["moe_intermediate_size"]
    heads = config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    shapes = {
        "embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (config["q_lora_rank"], h),
        "self_attn.q_a_layernorm.weight": (config["q_lora_rank"],),
        "self_attn.q_b_proj.weight": (heads * qk, config["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa.weight": (config["kv_lora_rank"] + config["qk_rope_head_dim"], h),
        "self_attn.kv_a_layernorm.weight": (config["kv_lora_rank"],),
        "self_attn.kv_b_proj.weight": (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]),
                                       config["kv_lora_rank"]),
        "self_attn.o_proj.weight": (h, heads * config["v_head_dim"]),
        "mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
        "mlp.shared_experts.gate_proj.weight": (f * config["n_shared_experts"], h),
        "mlp.shared_experts.up_proj.weight": (f * config["n_shared_experts"], h),
        "mlp.shared_experts.down_proj.weight": (h, f * config["n_shared_experts"]),
    }
    for j in range(e):
        shapes.update({f"mlp.experts.{j}.gate_proj.weight": (f, h), f"mlp.experts.{j}.up_proj.weight": (f, h),
                       f"mlp.experts.{j}.down_proj.weight": (h, f)})
    prefix = f"model.layers.{config['num_hidden_layers']}."
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[prefix + name] = 1 + 0.1 * noise if len(shape) == 1 and "norm" in name else (
            0.1 * noise if len(shape) == 1 else noise / math.sqrt(shape[-1]))
    out[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    out[prefix + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    return out


# ---- the v4-era config schema of the released checkpoints ----

def as_v4(config: dict) -> dict:
    """config.json in the schema released checkpoints carry (transformers 4): top-level rope_theta and
    rope_scaling (null, or {"type": ...}) instead of rope_parameters, Qwen3-MoE's num_experts instead of
    num_local_experts, DeepSeek's topk_method and scoring_func, torch_dtype instead of dtype; without the fields
    transformers 5 derives and writes (DeepSeek's head_dim and qk_head_dim, Mixtral's head_dim)."""
    c = dict(config)
    family = c["model_type"]
    rope = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    c["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    c["torch_dtype"] = c.pop("dtype")
    c["transformers_version"] = V4_VERSION[family]
    if family == "qwen3_moe":
        c["num_experts"] = c.pop("num_local_experts")
    if family == "deepseek_v3":
        c.update(topk_method="noaux_tc", scoring_func="sigmoid")
        c.pop("head_dim", None)
        c.pop("qk_head_dim", None)
    if family == "mixtral":
        c.pop("head_dim", None)
    return c


def write_v4(out_dir, case, rows, reference) -> None:
    """OUT/<case>_v4: the same files with config.json rewritten to the v4 schema, read back by transformers 5;
    its logits must equal the v5 checkpoint's."""
    src, dst = os.path.join(out_dir, case), os.path.join(out_dir, f"{case}_v4")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for name in ("rows.npy", "logits.npy"):
        os.remove(os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        config = as_v4(json.load(f))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, local_files_only=True,
                                                 **IMPLEMENTATIONS).eval()
    logits = logits_of(model, rows)
    diff = float(np.abs(logits - reference).max())
    if diff > V4_EQUAL:
        raise SystemExit(f"hf_written: {case}_v4: transformers 5 reads the v4 config differently (max |diff| {diff})")
    write_case(out_dir, f"{case}_v4", rows, logits)


def main(argv) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out_dir = argv[0]
    os.makedirs(out_dir, exist_ok=True)
    transformers.logging.set_verbosity_error()  # e.g. the unexpected MTP keys of one case; checked here instead
    transformers.utils.logging.disable_progress_bar()
    rows = token_rows()
    cases, started = {}, time.time()

    def record(case, description, logits, note=""):
        cases[case] = description
        write_case(out_dir, case, rows, logits)
        p = torch.softmax(torch.from_numpy(logits), -1).max(-1).values.mean()
        print(f"{case}: {description} [mean top-token probability {p:.2f}{note}]", flush=True)

    def fresh(case):
        path = os.path.join(out_dir, case)
        shutil.rmtree(path, ignore_errors=True)
        return path

    # Softmax routers (Mixtral, Qwen3-MoE): std 1 makes the top-k clear. DeepSeek's sigmoid saturates at std 1
    # (float32 sigmoid is exactly 1.0 past ~17, a tie), so its router is std 0.5.
    models = {}
    model = build(MixtralConfig, MixtralForCausalLM, 1, 1.0, **MIXTRAL)
    save(model, fresh("mixtral"), shard=False)
    models["mixtral"], margin = checked_logits(model, rows, "mixtral")
    record("mixtral", "MixtralConfig, 4 experts top-2, rope_theta 5000 (inside rope_parameters)", models["mixtral"],
           f", routing margin {margin:.1e}")

    model = build(Qwen3MoeConfig, Qwen3MoeForCausalLM, 2, 1.0, **QWEN3)
    save(model, fresh("qwen3_moe"), shard=True)
    models["qwen3_moe"], margin = checked_logits(model, rows, "qwen3_moe")
    record("qwen3_moe", "Qwen3MoeConfig, 8 experts top-2, norm_topk_prob, num_local_experts; sharded with an index",
           models["qwen3_moe"], f", routing margin {margin:.1e}")

    model = build(Qwen3MoeConfig, Qwen3MoeForCausalLM, 3, 1.0, **dict(QWEN3, rope_parameters=QWEN3_YARN))
    changed = check_yarn(model, 10000.0, 8, "qwen3_moe_yarn", 0.1 * math.log(4.0) + 1.0)
    save(model, fresh("qwen3_moe_yarn"), shard=False)
    logits, margin = checked_logits(model, rows, "qwen3_moe_yarn")
    record("qwen3_moe_yarn", "Qwen3-MoE with YaRN factor 4 over 8 original positions (attention_factor "
           "0.1 ln 4 + 1 on cos/sin)", logits, f", {changed}/4 frequencies scaled, routing margin {margin:.1e}")

    deepseek_cases = [
        ("deepseek_v3_yarn", DEEPSEEK_YARN, True, "DeepSeek-V3 MLA, YaRN factor 4 mscale = mscale_all_dim = 1 "
         "(softmax scale times mscale^2), interleaved rope; 1 dense + 2 MoE layers, 8 experts in 2 groups, "
         "sharded with an index", 1.0),
        ("deepseek_v3_plain", DEEPSEEK_PLAIN, True, "DeepSeek-V3 without rope scaling, interleaved rope "
         "(transformers' default layout)", None),
        ("deepseek_v3_halves", DEEPSEEK_PLAIN, False, "DeepSeek-V3 without rope scaling, rope_interleave false "
         "(rotate-half layout)", None),
        ("deepseek_v3_yarn_mscale0", DEEPSEEK_MSCALE0, True, "DeepSeek-V3 YaRN with mscale 0.707 and no "
         "mscale_all_dim (attention_factor 0.1 ln 4 + 1 on cos/sin, softmax scale untouched)",
         0.1 * math.log(4.0) + 1.0),
    ]
    # One seed for all four: the same weights, so the cases differ only in their rotary embedding.
    for case, rope, interleave, description, attention_factor in deepseek_cases:
        model = build(DeepseekV3Config, DeepseekV3ForCausalLM, DEEPSEEK_SEED, 0.5,
                      **dict(DEEPSEEK, rope_parameters=rope, rope_interleave=interleave))
        note = ""
        if attention_factor is not None:
            note = f", {check_yarn(model, 10000.0, 8, case, attention_factor)}/4 frequencies scaled"
        qk_scale = (DEEPSEEK["qk_nope_head_dim"] + DEEPSEEK["qk_rope_head_dim"]) ** -0.5
        expect_scale = qk_scale * (0.1 * math.log(4.0) + 1.0) ** 2 if rope.get("mscale_all_dim") else qk_scale
        if not math.isclose(model.model.layers[0].self_attn.scaling, expect_scale, rel_tol=1e-9):
            raise SystemExit(f"hf_written: {case}: softmax scale {model.model.layers[0].self_attn.scaling}")
        save(model, fresh(case), shard=case == "deepseek_v3_yarn")
        models[case], margin = checked_logits(model, rows, case)
        record(case, description, models[case], f"{note}, routing margin {margin:.1e}")

    src = os.path.join(out_dir, "deepseek_v3_yarn")
    dequantized = write_fp8(src, fresh("deepseek_v3_fp8"))
    logits, margin = checked_logits(model_from_tensors(src, dequantized), rows, "deepseek_v3_fp8")
    record("deepseek_v3_fp8", "deepseek_v3_yarn's weights in DeepSeek's FP8 block release form (float8_e4m3fn, "
           "float32 weight_scale_inv per 128x128 block); logits of the dequantized weights", logits,
           f", routing margin {margin:.1e}")

    with open(os.path.join(src, "config.json")) as f:
        mtp = mtp_layer(json.load(f), read_checkpoint(src), seed=99)
    write_fp8(src, fresh("deepseek_v3_fp8_mtp"), extra=mtp)
    record("deepseek_v3_fp8_mtp", "deepseek_v3_fp8 plus the MTP layer as releases carry it (model.layers.3.*, "
           "which transformers does not build and skips); same logits", logits)

    for case in ("mixtral", "qwen3_moe", "deepseek_v3_yarn"):
        write_v4(out_dir, case, rows, models[case])
        cases[f"{case}_v4"] = (f"{case}'s files with config.json in the released v4 schema (rope_theta, rope_scaling, "
                               "torch_dtype, ...), read back by transformers 5")
        print(f"{case}_v4: {cases[f'{case}_v4']} [logits equal to {case}'s within {V4_EQUAL}]", flush=True)

    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(cases, f, indent=2)
    print(f"{len(cases)} cases in {out_dir} ({time.time() - started:.1f}s, transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

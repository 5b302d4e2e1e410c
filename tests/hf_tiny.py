"""Tiny Hugging Face checkpoints written by the tests (config.json + safetensors through numpy; FP8 blocks through
ml_dtypes), and an independent float64 numpy forward pass of each family as its published modelling code defines
it, reading those same tensors."""

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

D, H, N, K, F, E, TOPK, V, LAYERS = 32, 4, 2, 8, 48, 4, 2, 64, 3
ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_safetensors(path, tensors):
    """The format, written here independently of the product's reader: u64 header size, JSON header, bytes."""
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def write_checkpoint(directory, config, tensors, shards=2):
    """config.json and the tensors in `shards` files with an index (or one model.safetensors)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_safetensors(os.path.join(directory, file), {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def as_v5(config):
    """The config in transformers 5's schema: rope_theta and rope_scaling inside rope_parameters, Qwen3-MoE's
    num_experts as num_local_experts, torch_dtype as dtype."""
    c = dict(config)
    rope = dict(c.pop("rope_scaling", None) or {})
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = c.pop("rope_theta", 10000.0)
    c["rope_parameters"] = rope
    if "num_experts" in c:
        c["num_local_experts"] = c.pop("num_experts")
    return c


def rope_of(config):
    """(theta, scaling dict or None) of a config in either schema (the tests' own reading)."""
    if "rope_parameters" in config:
        rope = dict(config["rope_parameters"])
        theta = rope.pop("rope_theta")
        return theta, (rope if rope.get("rope_type") == "yarn" else None)
    return config.get("rope_theta", 10000.0), config.get("rope_scaling")


def _temperature(factor, m=1.0):
    return 0.1 * m * math.log(factor) + 1 if factor > 1 else 1.0


def rotary(config, dim):
    """(inverse frequencies [dim/2], factor on cos and sin, softmax-scale factor) as transformers computes them:
    YaRN's attention_factor is mscale's over mscale_all_dim's temperature when both are set, else the plain
    temperature; DeepSeek's softmax scale takes mscale_all_dim's temperature squared."""
    theta, yarn = rope_of(config)
    if not yarn:
        return theta ** (-np.arange(0, dim, 2) / dim), 1.0, 1.0
    f = yarn["factor"]
    inv = _yarn_inv_freq(dim, theta, f, yarn["original_max_position_embeddings"], yarn.get("beta_fast", 32),
                         yarn.get("beta_slow", 1))
    m, m_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    a = _temperature(f, m) / _temperature(f, m_all) if m and m_all else _temperature(f)
    return inv, a, (_temperature(f, m_all) ** 2 if m_all else 1.0)


def _rand(rng, *shape, scale=None):
    scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mixtral_or_qwen3(family: str, seed=0, dtype=np.float32, theta=10000.0, yarn=None):
    """(config.json, tensors) of a tiny Mixtral or Qwen3-MoE (transformers 4's schema; as_v5 gives 5's);
    yarn: a rope_scaling dict."""
    rng = np.random.default_rng(seed)
    cfg = {"model_type": family, "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": N, "head_dim": K,
           "num_hidden_layers": LAYERS, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": theta,
           "num_experts_per_tok": TOPK, "hidden_act": "silu", "tie_word_embeddings": False, "rope_scaling": yarn}
    if family == "mixtral":
        cfg.update(intermediate_size=F, num_local_experts=E, sliding_window=None)
    else:
        cfg.update(moe_intermediate_size=F, intermediate_size=2 * F, num_experts=E, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    t = {"model.embed_tokens.weight": _rand(rng, V, D, scale=1.0), "model.norm.weight": 1 + _rand(rng, D, scale=0.1),
         "lm_head.weight": _rand(rng, V, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": 1 + _rand(rng, D, scale=0.1),
                  f"{p}.post_attention_layernorm.weight": 1 + _rand(rng, D, scale=0.1),
                  f"{p}.self_attn.q_proj.weight": _rand(rng, H * K, D), f"{p}.self_attn.k_proj.weight": _rand(rng, N * K, D),
                  f"{p}.self_attn.v_proj.weight": _rand(rng, N * K, D), f"{p}.self_attn.o_proj.weight": _rand(rng, D, H * K)})
        if family == "qwen3_moe":
            t[f"{p}.self_attn.q_norm.weight"] = 1 + _rand(rng, K, scale=0.1)
            t[f"{p}.self_attn.k_norm.weight"] = 1 + _rand(rng, K, scale=0.1)
            t[f"{p}.mlp.gate.weight"] = _rand(rng, E, D, scale=1.0)
            for e in range(E):
                t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = _rand(rng, F, D)
                t[f"{p}.mlp.experts.{e}.up_proj.weight"] = _rand(rng, F, D)
                t[f"{p}.mlp.experts.{e}.down_proj.weight"] = _rand(rng, D, F)
        else:
            t[f"{p}.block_sparse_moe.gate.weight"] = _rand(rng, E, D, scale=1.0)
            for e in range(E):
                t[f"{p}.block_sparse_moe.experts.{e}.w1.weight"] = _rand(rng, F, D)
                t[f"{p}.block_sparse_moe.experts.{e}.w3.weight"] = _rand(rng, F, D)
                t[f"{p}.block_sparse_moe.experts.{e}.w2.weight"] = _rand(rng, D, F)
    return cfg, {n: a.astype(dtype) for n, a in t.items()}


# ------------------------------------------------------------------------------------------ reference forward

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _rope_half(x, inv):
    """Llama-family rotate_half: x [L, heads, K], pairs (x[i], x[i + K/2]) at position * inv[i]."""
    k = x.shape[-1]
    ang = np.arange(x.shape[0])[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : k // 2], x[..., k // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(config, tensors, tokens):
    """float64 logits [L, V] of one token row through a Mixtral or Qwen3-MoE, from the Hugging Face tensors."""
    g = {n: np.asarray(a, np.float64) for n, a in tensors.items()}
    qwen = config["model_type"] == "qwen3_moe"
    eps = config["rms_norm_eps"]
    inv, factor, _ = rotary(config, K)
    x = g["model.embed_tokens.weight"][tokens]
    length = len(tokens)
    causal = np.tril(np.ones((length, length), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms(x, g[f"{p}.input_layernorm.weight"], eps)
        q = (h @ g[f"{p}.self_attn.q_proj.weight"].T).reshape(length, H, K)
        k = (h @ g[f"{p}.self_attn.k_proj.weight"].T).reshape(length, N, K)
        v = (h @ g[f"{p}.self_attn.v_proj.weight"].T).reshape(length, N, K)
        if qwen:
            q, k = _rms(q, g[f"{p}.self_attn.q_norm.weight"], eps), _rms(k, g[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = factor * _rope_half(q, inv), factor * _rope_half(k, inv)
        heads = []
        for head in range(H):
            kv = head // (H // N)
            s = q[:, head] @ k[:, kv].T / math.sqrt(K)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads, -1) @ g[f"{p}.self_attn.o_proj.weight"].T
        h = _rms(x, g[f"{p}.post_attention_layernorm.weight"], eps)
        gate = g[f"{p}.mlp.gate.weight"] if qwen else g[f"{p}.block_sparse_moe.gate.weight"]
        logits = h @ gate.T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(length):
            top = np.argsort(-probs[t], kind="stable")[:TOPK]
            w = probs[t, top]
            if not qwen or config.get("norm_topk_prob"):
                w = w / w.sum()
            for e, we in zip(top, w):
                if qwen:
                    e_p = f"{p}.mlp.experts.{e}"
                    a, b, c = (g[f"{e_p}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                else:
                    e_p = f"{p}.block_sparse_moe.experts.{e}"
                    a, b, c = (g[f"{e_p}.{n}.weight"] for n in ("w1", "w3", "w2"))
                out[t] += we * ((_silu(h[t] @ a.T) * (h[t] @ b.T)) @ c.T)
        x = x + out
    return _rms(x, g["model.norm.weight"], eps) @ g["lm_head.weight"].T


# ------------------------------------------------------------------------------------------- DeepSeek-V3

DS = dict(hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
          qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
          num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
          num_hidden_layers=3, vocab_size=V, routed_scaling_factor=2.5, norm_topk_prob=True)
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj", "eh_proj")


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
ROPES = {"yarn": (YARN, True), "plain": (None, True), "halves": (None, False), "yarn_halves": (YARN, False),
         "yarn_mscale0": ({**{k: v for k, v in YARN.items() if k != "mscale_all_dim"}, "mscale": 0.707}, True)}


def deepseek_v3(seed=0, fp8=False, mtp=True, rope="yarn"):
    """(config.json, tensors) of a tiny DeepSeek-V3 in its release layout: YaRN, group-limited sigmoid routing with
    e_score_correction_bias, a shared expert, one dense layer first, the MTP layer as layer num_hidden_layers. With
    fp8, every linear of attention, MLPs, experts and eh_proj is float8_e4m3fn with a float32 weight_scale_inv
    per 128x128 block (as released). rope: a key of ROPES (the scaling and whether pairs are interleaved)."""
    rng = np.random.default_rng(seed)
    c = dict(DS)
    c.update(model_type="deepseek_v3", rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
             scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1 if mtp else 0,
             tie_word_embeddings=False, attention_bias=False, rope_interleave=ROPES[rope][1],
             rope_scaling=ROPES[rope][0])
    d, h = c["hidden_size"], c["num_attention_heads"]
    qk, nope, rope, vd = 12, 8, 4, 8
    t = {"model.embed_tokens.weight": _rand(rng, V, d, scale=1.0), "model.norm.weight": 1 + _rand(rng, d, scale=0.1),
         "lm_head.weight": _rand(rng, V, d)}

    def layer(i, moe):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": 1 + _rand(rng, d, scale=0.1),
                  f"{p}.post_attention_layernorm.weight": 1 + _rand(rng, d, scale=0.1),
                  f"{p}.self_attn.q_a_proj.weight": _rand(rng, 16, d),
                  f"{p}.self_attn.q_a_layernorm.weight": 1 + _rand(rng, 16, scale=0.1),
                  f"{p}.self_attn.q_b_proj.weight": _rand(rng, h * qk, 16),
                  f"{p}.self_attn.kv_a_proj_with_mqa.weight": _rand(rng, 16 + rope, d),
                  f"{p}.self_attn.kv_a_layernorm.weight": 1 + _rand(rng, 16, scale=0.1),
                  f"{p}.self_attn.kv_b_proj.weight": _rand(rng, h * (nope + vd), 16),
                  f"{p}.self_attn.o_proj.weight": _rand(rng, d, h * vd)})
        if not moe:
            t.update({f"{p}.mlp.gate_proj.weight": _rand(rng, 48, d), f"{p}.mlp.up_proj.weight": _rand(rng, 48, d),
                      f"{p}.mlp.down_proj.weight": _rand(rng, d, 48)})
            return
        t[f"{p}.mlp.gate.weight"] = _rand(rng, 8, d, scale=1.0)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = (rng.standard_normal(8) * 0.1).astype(np.float32)
        for e in range(8):
            t.update({f"{p}.mlp.experts.{e}.gate_proj.weight": _rand(rng, 16, d),
                      f"{p}.mlp.experts.{e}.up_proj.weight": _rand(rng, 16, d),
                      f"{p}.mlp.experts.{e}.down_proj.weight": _rand(rng, d, 16)})
        t.update({f"{p}.mlp.shared_experts.gate_proj.weight": _rand(rng, 16, d),
                  f"{p}.mlp.shared_experts.up_proj.weight": _rand(rng, 16, d),
                  f"{p}.mlp.shared_experts.down_proj.weight": _rand(rng, d, 16)})

    for i in range(c["num_hidden_layers"]):
        layer(i, i >= c["first_k_dense_replace"])
    if mtp:
        n = c["num_hidden_layers"]
        layer(n, True)
        p = f"model.layers.{n}"
        t.update({f"{p}.enorm.weight": 1 + _rand(rng, d, scale=0.1), f"{p}.hnorm.weight": 1 + _rand(rng, d, scale=0.1),
                  f"{p}.eh_proj.weight": _rand(rng, d, 2 * d), f"{p}.shared_head.norm.weight": 1 + _rand(rng, d, scale=0.1),
                  f"{p}.shared_head.head.weight": t["lm_head.weight"].copy(),
                  f"{p}.embed_tokens.weight": t["model.embed_tokens.weight"].copy()})
    if fp8:
        for name in [n for n in t if n.split(".")[-2] in FP8_LINEARS]:
            w = t[name]
            blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            scale = rng.uniform(0.5, 2.0, blocks).astype(np.float32) * np.abs(w).max() / 448
            full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
            t[name] = (w / full).astype(ml_dtypes.float8_e4m3fn)
            t[name + "_scale_inv"] = scale
    return c, t


def dequantized(tensors):
    """The release's tensors as float32 values: FP8 weights times their block scales."""
    out = {}
    for name, a in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            s = tensors[name + "_scale_inv"]
            a = a.astype(np.float64) * np.repeat(np.repeat(s, 128, 0), 128, 1)[: a.shape[0], : a.shape[1]]
        out[name] = np.asarray(a, np.float64)
    return out


def _yarn_inv_freq(dim, base, factor, original, beta_fast, beta_slow):
    """Hugging Face's _compute_yarn_parameters inverse frequencies (truncated correction range)."""
    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    interpolation = extrapolation / factor
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _rope_interleave(x, inv_freq):
    """HF apply_rotary_pos_emb_interleave: de-interleave [x0, x2, ..., x1, x3, ...], then rotate_half."""
    length, _, d = x.shape
    x = x.reshape(length, -1, d // 2, 2).transpose(0, 1, 3, 2).reshape(length, -1, d)
    ang = np.arange(length)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def deepseek_reference_logits(config, tensors, tokens):
    """float64 logits [L, V] of one token row through DeepSeek-V3 as its published code defines it."""
    g = dequantized(tensors)
    c, eps = config, config["rms_norm_eps"]
    h, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    inv_freq, factor, softmax = rotary(c, rope)
    scale = (nope + rope) ** -0.5 * softmax
    rotate = _rope_interleave if c.get("rope_interleave", True) else _rope_half
    x = g["model.embed_tokens.weight"][tokens]
    length = len(tokens)
    causal = np.tril(np.ones((length, length), bool))

    def mlp(p, y):
        return (_silu(y @ g[f"{p}.gate_proj.weight"].T) * (y @ g[f"{p}.up_proj.weight"].T)) @ g[f"{p}.down_proj.weight"].T

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = _rms(x, g[f"{p}.input_layernorm.weight"], eps)
        a = f"{p}.self_attn"
        q = _rms(y @ g[f"{a}.q_a_proj.weight"].T, g[f"{a}.q_a_layernorm.weight"], eps) @ g[f"{a}.q_b_proj.weight"].T
        q = q.reshape(length, h, nope + rope)
        ckv = y @ g[f"{a}.kv_a_proj_with_mqa.weight"].T
        kv = (_rms(ckv[:, : c["kv_lora_rank"]], g[f"{a}.kv_a_layernorm.weight"], eps) @ g[f"{a}.kv_b_proj.weight"].T)
        kv = kv.reshape(length, h, nope + vd)
        q_pe = factor * rotate(q[..., nope:], inv_freq)
        k_pe = factor * rotate(ckv[:, None, c["kv_lora_rank"]:], inv_freq)
        qq = np.concatenate([q[..., :nope], q_pe], -1)
        kk = np.concatenate([kv[..., :nope], np.repeat(k_pe, h, 1)], -1)
        heads = []
        for head in range(h):
            s = np.where(causal, qq[:, head] @ kk[:, head].T * scale, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ kv[:, head, nope:])
        x = x + np.concatenate(heads, -1) @ g[f"{a}.o_proj.weight"].T
        y = _rms(x, g[f"{p}.post_attention_layernorm.weight"], eps)
        if i < c["first_k_dense_replace"]:
            x = x + mlp(f"{p}.mlp", y)
            continue
        scores = 1 / (1 + np.exp(-(y @ g[f"{p}.mlp.gate.weight"].T)))
        choice = scores + g[f"{p}.mlp.gate.e_score_correction_bias"]
        e, groups = c["n_routed_experts"], c["n_group"]
        out = mlp(f"{p}.mlp.shared_experts", y)
        for t_ in range(length):
            per_group = choice[t_].reshape(groups, e // groups)
            group_score = np.sort(per_group, -1)[:, -2:].sum(-1)
            kept = np.argsort(-group_score, kind="stable")[: c["topk_group"]]
            masked = np.full(e, -np.inf)
            for gi in kept:
                masked[gi * (e // groups):(gi + 1) * (e // groups)] = per_group[gi]
            top = np.argsort(-masked, kind="stable")[: c["num_experts_per_tok"]]
            w = scores[t_, top]
            w = w / w.sum() * c["routed_scaling_factor"]
            for ex, we in zip(top, w):
                out[t_] += we * mlp(f"{p}.mlp.experts.{ex}", y[t_])
        x = x + out
    return _rms(x, g["model.norm.weight"], eps) @ g["lm_head.weight"].T

"""The Hugging Face model families this trainer imports: their config.json read as this trainer's model keys,
and each of their tensors' place (and layout) in this trainer's parameters.

Layouts: a Hugging Face Linear weight is [out, in] and is transposed; per-head projections are split into
[in, heads, head_dim] (outputs [heads, head_dim, out]); routed experts, one tensor per expert there, are
stacked on a leading expert axis here; layers are stacked on a leading axis when scan_layers is true.
Rotary layouts need no permutation: Mixtral and Qwen3 rotate the halves (x[i], x[i + K/2]) as rope_type
default does here, and DeepSeek's release rotates interleaved pairs, which rope_interleave (true, with
rope_type yarn) does here. DeepSeek's MTP projection eh_proj takes [embedding, hidden]; this trainer's takes
[hidden, embedding], so its two input halves swap.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from MaxText.config import ConfigError

Tensor = Callable[[int], np.ndarray]  # layer index -> array in this trainer's layout


def _require(hf: dict, key: str, ok, what: str) -> None:
    if key in hf and not ok(hf[key]):
        raise ConfigError(f"config.json: {key}={hf[key]!r} is not supported ({what})")


def _rope_keys(hf: dict) -> dict:
    """rope_theta and rope_scaling (none or YaRN) as this trainer's keys."""
    keys = {"rope_max_timescale": float(hf.get("rope_theta", 10000.0))}
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise ConfigError(f"config.json: rope_scaling of type {kind!r} is not supported (none or yarn)")
        mscale, mscale_all = float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
        if mscale_all and mscale_all != mscale:
            raise ConfigError(f"config.json: rope_scaling mscale={mscale} and mscale_all_dim={mscale_all} differ; this "
                              "trainer scales the softmax by YaRN's temperature with one mscale")
        keys.update(rope_type="yarn", rope_factor=float(scaling["factor"]), mscale=mscale,
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                    beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)))
    return keys


class Family:
    """One model_type: model_keys(config.json) -> this trainer's model keys; tensors(cfg) -> {our path: Tensor}."""

    decoder_block = ""
    experts = "mlp.experts"

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.used: set[str] = set()
        self.last = ""  # the tensor read last, for error lines

    # ---- reading, with the names used recorded
    def w(self, name: str) -> np.ndarray:
        """A Linear weight as float32 [out, in] (FP8 dequantized)."""
        self.used.update((name, name + "_scale_inv"))
        self.last = name
        return self.ckpt.weight(name)

    def linear(self, name: str) -> np.ndarray:  # [out, in] -> [in, out]
        return self.w(name).T

    def heads_in(self, name: str, heads: int) -> np.ndarray:  # [heads * k, in] -> [in, heads, k]
        w = self.w(name)
        return w.reshape(heads, w.shape[0] // heads, w.shape[1]).transpose(2, 0, 1)

    def heads_out(self, name: str, heads: int) -> np.ndarray:  # [out, heads * k] -> [heads, k, out]
        w = self.w(name)
        return w.reshape(w.shape[0], heads, w.shape[1] // heads).transpose(1, 2, 0)

    def vector(self, name: str) -> np.ndarray:
        self.used.add(name)
        self.last = name
        return np.asarray(self.ckpt.get(name), np.float32)

    # ---- layers
    def attention(self, cfg, p: str) -> dict[str, Callable]:
        h, n = cfg.base_num_query_heads, cfg.base_num_kv_heads
        out = {"self_attention.wq": lambda i: self.heads_in(f"{p(i)}.self_attn.q_proj.weight", h),
               "self_attention.wk": lambda i: self.heads_in(f"{p(i)}.self_attn.k_proj.weight", n),
               "self_attention.wv": lambda i: self.heads_in(f"{p(i)}.self_attn.v_proj.weight", n),
               "self_attention.wo": lambda i: self.heads_out(f"{p(i)}.self_attn.o_proj.weight", h)}
        if cfg.qk_norm:
            out["self_attention.query_norm.scale"] = lambda i: self.vector(f"{p(i)}.self_attn.q_norm.weight")
            out["self_attention.key_norm.scale"] = lambda i: self.vector(f"{p(i)}.self_attn.k_norm.weight")
        return out

    def expert_names(self, p: str, e: int) -> tuple[str, str, str]:
        """(gate, up, down) weight names of routed expert e of a layer prefix."""
        return tuple(f"{p}.{self.experts}.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))

    def gate_name(self, p: str) -> str:
        return f"{p}.mlp.gate.weight"

    def layer(self, cfg, p: Callable[[int], str], moe: bool) -> dict[str, Callable]:
        """{path within a decoder layer: Tensor} for a dense or MoE layer whose Hugging Face prefix is p(i)."""
        out = {"pre_self_attention_norm.scale": lambda i: self.vector(f"{p(i)}.input_layernorm.weight"),
               "post_self_attention_norm.scale": lambda i: self.vector(f"{p(i)}.post_attention_layernorm.weight"),
               **self.attention(cfg, p)}
        if not moe:
            for ours, theirs in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
                out[f"mlp.{ours}"] = lambda i, t=theirs: self.linear(f"{p(i)}.mlp.{t}.weight")
            return out
        e = cfg.num_experts
        out["moe.gate"] = lambda i: self.linear(self.gate_name(p(i)))
        for k, ours in enumerate(("wi_0", "wi_1", "wo")):
            out[f"moe.{ours}"] = lambda i, k=k: self.stack([self.expert_names(p(i), x)[k] for x in range(e)])
        if cfg.shared_experts:
            for ours, theirs in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
                out[f"moe.shared_experts.{ours}"] = lambda i, t=theirs: self.linear(f"{p(i)}.mlp.shared_experts.{t}.weight")
        return out

    def bias(self, cfg, p: Callable[[int], str]) -> dict[str, Callable]:
        return {}

    def stack(self, names: list[str]) -> np.ndarray:
        """The experts' weights (transposed) on a leading axis; ConfigError naming the first shaped unlike the first."""
        arrays = []
        for name in names:
            arrays.append(self.linear(name))
            if arrays[-1].shape != arrays[0].shape:
                raise ConfigError(f"tensor {name} is {list(arrays[-1].T.shape)}, unlike {names[0]} "
                                  f"({list(arrays[0].T.shape)})")
        return np.stack(arrays)

    def model_keys(self, hf: dict) -> dict:
        raise NotImplementedError


class Mixtral(Family):
    decoder_block = "mixtral"
    experts = "block_sparse_moe.experts"

    def expert_names(self, p, e):
        return tuple(f"{p}.{self.experts}.{e}.{n}.weight" for n in ("w1", "w3", "w2"))

    def gate_name(self, p):
        return f"{p}.block_sparse_moe.gate.weight"

    def model_keys(self, hf):
        _require(hf, "sliding_window", lambda v: v is None, "sliding-window attention is not built here")
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        d, h = hf["hidden_size"], hf["num_attention_heads"]
        return {"decoder_block": "mixtral", "base_emb_dim": d, "base_num_query_heads": h,
                "base_num_kv_heads": hf.get("num_key_value_heads", h), "head_dim": hf.get("head_dim") or d // h,
                "base_mlp_dim": hf["intermediate_size"], "base_moe_mlp_dim": hf["intermediate_size"],
                "base_num_decoder_layers": hf["num_hidden_layers"], "first_num_dense_layers": 0,
                "vocab_size": hf["vocab_size"], "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
                "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-5)), "qk_norm": False,
                "attention_type": "mha", "num_experts": hf["num_local_experts"],
                "num_experts_per_tok": hf["num_experts_per_tok"], "norm_topk_prob": True,
                "routed_score_func": "softmax", "shared_experts": 0, **_rope_keys(hf)}


class Qwen3Moe(Family):
    decoder_block = "qwen3_moe"

    def model_keys(self, hf):
        _require(hf, "use_sliding_window", lambda v: not v, "sliding-window attention is not built here")
        _require(hf, "decoder_sparse_step", lambda v: v == 1, "every layer is MoE here")
        _require(hf, "mlp_only_layers", lambda v: not v, "dense layers are the first ones here")
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        d, h = hf["hidden_size"], hf["num_attention_heads"]
        return {"decoder_block": "qwen3_moe", "base_emb_dim": d, "base_num_query_heads": h,
                "base_num_kv_heads": hf.get("num_key_value_heads", h), "head_dim": hf.get("head_dim") or d // h,
                "base_mlp_dim": hf.get("intermediate_size", hf["moe_intermediate_size"]),
                "base_moe_mlp_dim": hf["moe_intermediate_size"], "base_num_decoder_layers": hf["num_hidden_layers"],
                "first_num_dense_layers": 0, "vocab_size": hf["vocab_size"],
                "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
                "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "qk_norm": True,
                "attention_type": "mha", "num_experts": hf["num_experts"],
                "num_experts_per_tok": hf["num_experts_per_tok"], "norm_topk_prob": bool(hf.get("norm_topk_prob")),
                "routed_score_func": "softmax", "shared_experts": 0, **_rope_keys(hf)}


class DeepSeek(Family):
    """deepseek_v3 (and deepseek_v2, the same layout with softmax, device-limited routing and no bias)."""

    decoder_block = "deepseek"

    def attention(self, cfg, p):
        h = cfg.base_num_query_heads
        a = lambda i, n: f"{p(i)}.self_attn.{n}"  # noqa: E731
        out = {"self_attention.wkv_a": lambda i: self.linear(a(i, "kv_a_proj_with_mqa.weight")),
               "self_attention.kv_norm.scale": lambda i: self.vector(a(i, "kv_a_layernorm.weight")),
               "self_attention.wkv_b": lambda i: self.heads_in(a(i, "kv_b_proj.weight"), h),
               "self_attention.out": lambda i: self.heads_out(a(i, "o_proj.weight"), h)}
        if cfg.q_lora_rank:
            out.update({"self_attention.wq_a": lambda i: self.linear(a(i, "q_a_proj.weight")),
                        "self_attention.q_norm.scale": lambda i: self.vector(a(i, "q_a_layernorm.weight")),
                        "self_attention.wq_b": lambda i: self.heads_in(a(i, "q_b_proj.weight"), h)})
        else:
            out["self_attention.wq"] = lambda i: self.heads_in(a(i, "q_proj.weight"), h)
        return out

    def bias(self, cfg, p):
        if not cfg.routed_bias:
            return {}
        return {"moe.bias": lambda i: self.vector(f"{p(i)}.mlp.gate.e_score_correction_bias")}

    def model_keys(self, hf):
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        _require(hf, "attention_bias", lambda v: not v, "attention projections have no bias here")
        method = hf.get("topk_method", "noaux_tc" if hf.get("model_type") == "deepseek_v3" else "greedy")
        _require(hf, "topk_method", lambda v: v in ("noaux_tc", "group_limited_greedy", "greedy"),
                 "noaux_tc, group_limited_greedy or greedy")
        groups = hf.get("n_group") or 1
        keys = {"decoder_block": "deepseek", "attention_type": "mla", "base_emb_dim": hf["hidden_size"],
                "base_num_query_heads": hf["num_attention_heads"], "base_num_kv_heads": hf["num_attention_heads"],
                "head_dim": hf["qk_nope_head_dim"], "base_mlp_dim": hf["intermediate_size"],
                "base_moe_mlp_dim": hf["moe_intermediate_size"], "base_num_decoder_layers": hf["num_hidden_layers"],
                "first_num_dense_layers": hf.get("first_k_dense_replace", 0), "vocab_size": hf["vocab_size"],
                "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
                "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
                "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
                "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                "v_head_dim": hf["v_head_dim"], "num_experts": hf["n_routed_experts"],
                "num_experts_per_tok": hf["num_experts_per_tok"], "shared_experts": hf.get("n_shared_experts") or 0,
                "routed_score_func": hf.get("scoring_func", "softmax"), "norm_topk_prob": bool(hf.get("norm_topk_prob")),
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "routed_bias": method == "noaux_tc", "mtp_num_layers": hf.get("num_nextn_predict_layers", 0) or 0,
                "n_routing_groups": groups if groups > 1 and method != "greedy" else None,
                "topk_routing_group": hf.get("topk_group") if groups > 1 and method != "greedy" else None,
                "routing_group_score": "max" if method == "group_limited_greedy" else "topk_sum", **_rope_keys(hf)}
        if "rope_type" not in keys:
            raise ConfigError("config.json: a DeepSeek model without YaRN rope_scaling is not supported (its rotary "
                              "pairs are interleaved, which this trainer rotates with rope_type yarn)")
        keys["rope_interleave"] = bool(hf.get("rope_interleave", True))  # DeepSeek's release: interleaved pairs
        return keys


FAMILIES = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe, "deepseek_v3": DeepSeek, "deepseek_v2": DeepSeek}

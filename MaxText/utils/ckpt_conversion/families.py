"""The Hugging Face model families this trainer imports and exports: their config.json as this trainer's model
keys (and back), and one table of rules placing each of their tensors in this trainer's parameters, read in
one direction by to_maxtext and in the other by to_huggingface.

Layouts: a Hugging Face Linear weight is [out, in] and is transposed; per-head projections are split into
[in, heads, head_dim] (outputs [heads, head_dim, out]); routed experts, one tensor per expert there, are
stacked on a leading expert axis here; layers are stacked on a leading axis when scan_layers is true.
Rotary layouts need no permutation: Mixtral and Qwen3 rotate the halves (x[i], x[i + K/2]) as rope_type
default does here, and DeepSeek's release rotates interleaved pairs, which rope_interleave (true, with
rope_type yarn) does here. DeepSeek's MTP projection eh_proj takes [embedding, hidden]; this trainer's takes
[hidden, embedding], so its two input halves swap.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import numpy as np

from MaxText.config import ConfigError


class Rule(NamedTuple):
    """One parameter: its path in a layer (or the model) here, its Hugging Face name under the layer's prefix
    ("{e}" standing for the expert), and the layout change between them."""

    ours: str
    theirs: str
    kind: str          # vector | linear | heads_in | heads_out | experts | mtp_projection
    heads: int = 0     # heads_in / heads_out: the head count


def to_ours(rule: Rule, read) -> np.ndarray:
    """The parameter from Hugging Face tensors; read(name) gives one as float32 [out, in] (or a vector)."""
    if rule.kind == "experts":
        raise AssertionError("experts are stacked by the caller")
    a = read(rule.theirs)
    if rule.kind == "vector":
        return a
    if rule.kind == "linear":
        return a.T
    if rule.kind == "heads_in":  # [heads * k, in] -> [in, heads, k]
        return a.reshape(rule.heads, a.shape[0] // rule.heads, a.shape[1]).transpose(2, 0, 1)
    if rule.kind == "heads_out":  # [out, heads * k] -> [heads, k, out]
        return a.reshape(a.shape[0], rule.heads, a.shape[1] // rule.heads).transpose(1, 2, 0)
    if rule.kind == "mtp_projection":  # [D, 2D] over [embedding, hidden] -> [2D, D] over [hidden, embedding]
        t, d = a.T, a.shape[0]
        return np.concatenate([t[d:], t[:d]])
    raise AssertionError(rule.kind)


def to_theirs(rule: Rule, a: np.ndarray) -> np.ndarray:
    """The inverse of to_ours for one parameter (not experts)."""
    if rule.kind == "vector":
        return a
    if rule.kind == "linear":
        return a.T
    if rule.kind == "heads_in":
        return a.transpose(1, 2, 0).reshape(a.shape[1] * a.shape[2], a.shape[0])
    if rule.kind == "heads_out":
        return a.transpose(2, 0, 1).reshape(a.shape[2], a.shape[0] * a.shape[1])
    if rule.kind == "mtp_projection":
        d = a.shape[1]
        return np.concatenate([a[d:], a[:d]]).T
    raise AssertionError(rule.kind)


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


def _rope_config(cfg) -> dict:
    out = {"rope_theta": float(cfg.rope_max_timescale), "rope_scaling": None}
    if cfg.rope_type == "yarn":  # transformers checks the context length against factor x the original
        out["max_position_embeddings"] = int(round(cfg.original_max_position_embeddings * cfg.rope_factor))
        out["rope_scaling"] = {"type": "yarn", "factor": cfg.rope_factor, "mscale": cfg.mscale,
                               "mscale_all_dim": cfg.mscale, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                               "original_max_position_embeddings": cfg.original_max_position_embeddings}
    return out


class Family(abc.ABC):
    """One model_type: config.json <-> model keys, and the rules of a decoder layer and of the whole model."""

    model_type = ""
    expert_names = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight")
    gate = "mlp.gate.weight"

    def attention(self, cfg) -> list[Rule]:
        h, n = cfg.base_num_query_heads, cfg.base_num_kv_heads
        rules = [Rule("self_attention.wq", "self_attn.q_proj.weight", "heads_in", h),
                 Rule("self_attention.wk", "self_attn.k_proj.weight", "heads_in", n),
                 Rule("self_attention.wv", "self_attn.v_proj.weight", "heads_in", n),
                 Rule("self_attention.wo", "self_attn.o_proj.weight", "heads_out", h)]
        if cfg.qk_norm:
            rules += [Rule("self_attention.query_norm.scale", "self_attn.q_norm.weight", "vector"),
                      Rule("self_attention.key_norm.scale", "self_attn.k_norm.weight", "vector")]
        return rules

    def layer(self, cfg, moe: bool) -> list[Rule]:
        """The params of a dense or MoE decoder layer."""
        rules = [Rule("pre_self_attention_norm.scale", "input_layernorm.weight", "vector"),
                 Rule("post_self_attention_norm.scale", "post_attention_layernorm.weight", "vector"),
                 *self.attention(cfg)]
        mlp = [("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")]
        if not moe:
            return rules + [Rule(f"mlp.{ours}", f"mlp.{theirs}.weight", "linear") for ours, theirs in mlp]
        rules += [Rule("moe.gate", self.gate, "linear")]
        rules += [Rule(f"moe.{ours}", name, "experts") for (ours, _), name in zip(mlp, self.expert_names)]
        if cfg.shared_experts:
            rules += [Rule(f"moe.shared_experts.{ours}", f"mlp.shared_experts.{theirs}.weight", "linear")
                      for ours, theirs in mlp]
        return rules

    def bias(self, cfg) -> list[Rule]:
        """The routing biases of an MoE layer (nnx_aux)."""
        return []

    @abc.abstractmethod
    def model_keys(self, hf: dict) -> dict:
        """config.json as this trainer's model keys."""

    @abc.abstractmethod
    def hf_config(self, cfg) -> dict:
        """This config as the family's config.json."""


def _mha_keys(hf: dict) -> dict:
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return {"base_emb_dim": d, "base_num_query_heads": h, "base_num_kv_heads": hf.get("num_key_value_heads", h),
            "head_dim": hf.get("head_dim") or d // h, "base_num_decoder_layers": hf["num_hidden_layers"],
            "first_num_dense_layers": 0, "vocab_size": hf["vocab_size"], "attention_type": "mha",
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
            "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "num_experts_per_tok":
            hf["num_experts_per_tok"], "routed_score_func": "softmax", "shared_experts": 0, **_rope_keys(hf)}


def _mha_config(cfg) -> dict:
    return {"hidden_size": cfg.base_emb_dim, "num_attention_heads": cfg.base_num_query_heads,
            "num_key_value_heads": cfg.base_num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": cfg.base_num_decoder_layers, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.normalization_layer_epsilon, "tie_word_embeddings": bool(cfg.logits_via_embedding),
            "num_experts_per_tok": cfg.num_experts_per_tok, "hidden_act": "silu", **_rope_config(cfg)}


class Mixtral(Family):
    model_type = "mixtral"
    expert_names = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                    "block_sparse_moe.experts.{e}.w2.weight")
    gate = "block_sparse_moe.gate.weight"

    def model_keys(self, hf):
        _require(hf, "sliding_window", lambda v: v is None, "sliding-window attention is not built here")
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        return {"decoder_block": "mixtral", **_mha_keys(hf), "base_mlp_dim": hf["intermediate_size"],
                "base_moe_mlp_dim": hf["intermediate_size"], "qk_norm": False, "num_experts": hf["num_local_experts"],
                "norm_topk_prob": True}

    def hf_config(self, cfg):
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_mha_config(cfg),
                "intermediate_size": cfg.base_moe_mlp_dim, "num_local_experts": cfg.num_experts, "sliding_window": None}


class Qwen3Moe(Family):
    model_type = "qwen3_moe"

    def model_keys(self, hf):
        _require(hf, "use_sliding_window", lambda v: not v, "sliding-window attention is not built here")
        _require(hf, "decoder_sparse_step", lambda v: v == 1, "every layer is MoE here")
        _require(hf, "mlp_only_layers", lambda v: not v, "dense layers are the first ones here")
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        return {"decoder_block": "qwen3_moe", **_mha_keys(hf),
                "base_mlp_dim": hf.get("intermediate_size", hf["moe_intermediate_size"]),
                "base_moe_mlp_dim": hf["moe_intermediate_size"], "qk_norm": True, "num_experts": hf["num_experts"],
                "norm_topk_prob": bool(hf.get("norm_topk_prob"))}

    def hf_config(self, cfg):
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_mha_config(cfg),
                "intermediate_size": cfg.base_mlp_dim, "moe_intermediate_size": cfg.base_moe_mlp_dim,
                "num_experts": cfg.num_experts, "norm_topk_prob": bool(cfg.norm_topk_prob), "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_sliding_window": False, "attention_bias": False}


class DeepSeek(Family):
    """deepseek_v3 (and deepseek_v2, the same layout with softmax, device-limited routing and no bias)."""

    model_type = "deepseek_v3"

    def attention(self, cfg):
        h = cfg.base_num_query_heads
        rules = [Rule("self_attention.wkv_a", "self_attn.kv_a_proj_with_mqa.weight", "linear"),
                 Rule("self_attention.kv_norm.scale", "self_attn.kv_a_layernorm.weight", "vector"),
                 Rule("self_attention.wkv_b", "self_attn.kv_b_proj.weight", "heads_in", h),
                 Rule("self_attention.out", "self_attn.o_proj.weight", "heads_out", h)]
        if cfg.q_lora_rank:
            return rules + [Rule("self_attention.wq_a", "self_attn.q_a_proj.weight", "linear"),
                            Rule("self_attention.q_norm.scale", "self_attn.q_a_layernorm.weight", "vector"),
                            Rule("self_attention.wq_b", "self_attn.q_b_proj.weight", "heads_in", h)]
        return rules + [Rule("self_attention.wq", "self_attn.q_proj.weight", "heads_in", h)]

    def bias(self, cfg):
        return [Rule("moe.bias", "mlp.gate.e_score_correction_bias", "vector")] if cfg.routed_bias else []

    def model_keys(self, hf):
        _require(hf, "hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        _require(hf, "attention_bias", lambda v: not v, "attention projections have no bias here")
        _require(hf, "topk_method", lambda v: v in ("noaux_tc", "group_limited_greedy", "greedy"),
                 "noaux_tc, group_limited_greedy or greedy")
        method = hf.get("topk_method", "noaux_tc" if hf.get("model_type") == "deepseek_v3" else "greedy")
        grouped = (hf.get("n_group") or 1) > 1 and method != "greedy"
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
                "routed_score_func": hf.get("scoring_func", "softmax"),
                "norm_topk_prob": bool(hf.get("norm_topk_prob")),
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "routed_bias": method == "noaux_tc", "mtp_num_layers": hf.get("num_nextn_predict_layers", 0) or 0,
                "n_routing_groups": hf["n_group"] if grouped else None,
                "topk_routing_group": hf.get("topk_group") if grouped else None,
                "routing_group_score": "max" if method == "group_limited_greedy" else "topk_sum", **_rope_keys(hf)}
        if "rope_type" not in keys:
            raise ConfigError("config.json: a DeepSeek model without YaRN rope_scaling is not supported (its rotary "
                              "pairs are interleaved, which this trainer rotates with rope_type yarn)")
        keys["rope_interleave"] = bool(hf.get("rope_interleave", True))  # DeepSeek's release: interleaved pairs
        return keys

    def hf_config(self, cfg):
        if cfg.rope_type != "yarn" or not cfg.rope_interleave:
            raise ConfigError("a DeepSeek export needs rope_type=yarn with rope_interleave=true (the rotary layout of "
                              "DeepSeek's modelling code)")
        method = ("noaux_tc" if cfg.routed_bias else
                  "group_limited_greedy" if cfg.n_routing_groups and cfg.routing_group_score == "max" else "greedy")
        v3 = cfg.routed_bias
        return {"architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v3" if v3 else "deepseek_v2", "hidden_size": cfg.base_emb_dim,
                "num_attention_heads": cfg.base_num_query_heads, "num_key_value_heads": cfg.base_num_query_heads,
                "intermediate_size": cfg.base_mlp_dim, "moe_intermediate_size": cfg.base_moe_mlp_dim,
                "num_hidden_layers": cfg.base_num_decoder_layers, "first_k_dense_replace": cfg.first_num_dense_layers,
                "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.normalization_layer_epsilon,
                "tie_word_embeddings": bool(cfg.logits_via_embedding), "q_lora_rank": cfg.q_lora_rank or None,
                "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
                "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
                "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "n_shared_experts": cfg.shared_experts, "scoring_func": cfg.routed_score_func,
                "norm_topk_prob": bool(cfg.norm_topk_prob), "routed_scaling_factor": cfg.routed_scaling_factor,
                "topk_method": method, "n_group": cfg.n_routing_groups or 1, "topk_group": cfg.topk_routing_group or 1,
                "num_nextn_predict_layers": cfg.mtp_num_layers, "hidden_act": "silu", "attention_bias": False,
                "rope_interleave": True, **_rope_config(cfg)}


FAMILIES = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe, "deepseek_v3": DeepSeek, "deepseek_v2": DeepSeek}
DECODER_BLOCKS = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe, "deepseek": DeepSeek}


def top_level(cfg) -> list[Rule]:
    """The params outside the decoder layers (paths from the params root; names from the checkpoint root)."""
    rules = [Rule("token_embedder.embedding", "model.embed_tokens.weight", "vector"),
             Rule("decoder_norm.scale", "model.norm.weight", "vector")]
    if not cfg.logits_via_embedding:
        rules.append(Rule("token_embedder.logits_dense", "lm_head.weight", "linear"))
    return rules


def mtp_rules() -> list[Rule]:
    """An MTP depth's own params (paths under mtp.mtp_<depth>; names under its layer prefix)."""
    return [Rule("embedding_norm.scale", "enorm.weight", "vector"), Rule("hidden_norm.scale", "hnorm.weight", "vector"),
            Rule("final_norm.scale", "shared_head.norm.weight", "vector"),
            Rule("projection", "eh_proj.weight", "mtp_projection")]


class Placement(NamedTuple):
    """Where one leaf of the saved tree {"params", "nnx_aux"} comes from: a rule applied under each of
    `prefixes` (Hugging Face layer prefixes), stacked on a leading axis when `stacked` (scanned layers)."""

    key: tuple
    rule: Rule
    prefixes: tuple
    stacked: bool


def placements(cfg, family: Family) -> list[Placement]:
    """Every leaf of the saved tree, with its source, for this config (scanned or not, MTP depths included)."""
    from MaxText.config import layer_counts

    out = [Placement(("params", *r.ours.split(".")), r, ("",), False) for r in top_level(cfg)]
    num_dense, num_moe = layer_counts(cfg)
    for stack, count, first, moe in (("dense_layers", num_dense, 0, False), ("moe_layers", num_moe, num_dense, True)):
        if not count:
            continue
        prefixes = [f"model.layers.{first + j}." for j in range(count)]
        for root, rules in (("params", family.layer(cfg, moe)), ("nnx_aux", family.bias(cfg) if moe else [])):
            for r in rules:
                if cfg.scan_layers:
                    out.append(Placement((root, stack, "layers", *r.ours.split(".")), r, tuple(prefixes), True))
                else:
                    out += [Placement((root, stack, f"layers_{j}", *r.ours.split(".")), r, (p,), False)
                            for j, p in enumerate(prefixes)]
    for depth in range(1, cfg.mtp_num_layers + 1):
        prefix = (f"model.layers.{cfg.base_num_decoder_layers + depth - 1}.",)
        base = ("mtp", f"mtp_{depth}")
        out += [Placement(("params", *base, *r.ours.split(".")), r, prefix, False) for r in mtp_rules()]
        for root, rules in (("params", family.layer(cfg, True)), ("nnx_aux", family.bias(cfg))):
            out += [Placement((root, *base, "layer", *r.ours.split(".")), r, prefix, False) for r in rules]
    return out

"""The Hugging Face model families this trainer imports and exports: their config.json as this trainer's model
keys (and back), and one table of rules placing each of their tensors in this trainer's parameters, read in
one direction by to_maxtext and in the other by to_huggingface.

Layouts: a Hugging Face Linear weight is [out, in] and is transposed; per-head projections are split into
[in, heads, head_dim] (outputs [heads, head_dim, out]); routed experts, one tensor per expert there, are
stacked on a leading expert axis here; layers are stacked on a leading axis when scan_layers is true.
Rotary layouts need no permutation: Mixtral and Qwen3 rotate the halves (x[i], x[i + K/2]) as rope_type
default does here, and DeepSeek rotates interleaved pairs (rope_interleave, true in its release and in
transformers' default), which rope_interleave does here under rope_type yarn: a DeepSeek model without YaRN
imports as rope_type yarn with rope_factor 1 (every frequency as it is), the same function. DeepSeek's MTP
projection eh_proj takes [embedding, hidden]; this trainer's takes [hidden, embedding], so its two input
halves swap.
"""

from __future__ import annotations

import abc
import json
from typing import NamedTuple

import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.load import layer_counts
from MaxText.utils.ckpt_conversion.hf_config import Fields, rope_config, rope_keys
from MaxText.utils.ckpt_conversion.safetensors_io import FP8_BLOCK


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


def _no_quantization_but_fp8_blocks(f: Fields) -> None:
    """quantization_config: only DeepSeek's FP8 block form (read by safetensors_io.Checkpoint.weight) is
    understood; any other would leave weights read as they are stored."""
    q = f.hf.get("quantization_config")
    f.mark("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or \
            list(q.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK]:
        raise ConfigError(f"config.json: quantization_config={json.dumps(q)[:80]} is not understood here (DeepSeek's "
                          f"FP8 blocks: quant_method fp8, fmt e4m3, weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}])")


def _silu_no_bias(f: Fields) -> None:
    f.need("hidden_act", lambda v: v == "silu", "the MLPs and experts are SwiGLU here")
    f.need("attention_bias", lambda v: not v, "attention projections have no bias here")


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

    defaults: dict = {}          # transformers' config class defaults for the fields read (5.24)
    aliases: dict = {}           # field -> its other spellings (transformers 4 and 5, attribute_map)
    ignored: frozenset = frozenset()  # the family's own fields that do not change the function

    def schema(self, model_type: str) -> tuple[dict, dict]:
        """(defaults, aliases) of this model_type's transformers config class."""
        return self.defaults, self.aliases

    def fields(self, hf: dict, ignore=()) -> Fields:
        model_type = hf.get("model_type", self.model_type)
        defaults, aliases = self.schema(model_type)
        return Fields(hf, model_type, defaults, aliases, self.ignored, frozenset(ignore))

    def model_keys(self, hf: dict, log=lambda *_: None, ignore=()) -> dict:
        """config.json as this trainer's model keys: every field read as transformers reads it, or refused."""
        f = self.fields(hf, ignore)
        keys = self.read(f, log)
        _no_quantization_but_fp8_blocks(f)
        f.finish(log)
        return keys

    @abc.abstractmethod
    def read(self, f: Fields, log) -> dict:
        """The model keys from the fields (each read through f, so that f knows what was understood)."""

    @abc.abstractmethod
    def hf_config(self, cfg) -> dict:
        """This config as the family's config.json, readable by transformers 4 and 5 alike."""


_MHA_DEFAULTS = {"head_dim": None, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False}


def _mha_keys(f: Fields, log) -> dict:
    d, h = f["hidden_size"], f["num_attention_heads"]
    return {"base_emb_dim": d, "base_num_query_heads": h, "base_num_kv_heads": f["num_key_value_heads"] or h,
            "head_dim": f["head_dim"] or d // h, "base_num_decoder_layers": f["num_hidden_layers"],
            "first_num_dense_layers": 0, "vocab_size": f["vocab_size"], "attention_type": "mha",
            "logits_via_embedding": bool(f["tie_word_embeddings"]),
            "normalization_layer_epsilon": float(f["rms_norm_eps"]), "num_experts_per_tok": f["num_experts_per_tok"],
            "routed_score_func": "softmax", "shared_experts": 0,
            **rope_keys(f, mla=False, interleave=False, log=log)}


def _mha_config(cfg) -> dict:
    if cfg.rope_type == "yarn" and cfg.rope_interleave:
        raise ConfigError("this family rotates the halves (x[i], x[i + K/2]); export with rope_interleave=false")
    return {"hidden_size": cfg.base_emb_dim, "num_attention_heads": cfg.base_num_query_heads,
            "num_key_value_heads": cfg.base_num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": cfg.base_num_decoder_layers, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.normalization_layer_epsilon, "tie_word_embeddings": bool(cfg.logits_via_embedding),
            "num_experts_per_tok": cfg.num_experts_per_tok, "hidden_act": "silu", **rope_config(cfg, mla=False)}


class Mixtral(Family):
    model_type = "mixtral"
    expert_names = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                    "block_sparse_moe.experts.{e}.w2.weight")
    gate = "block_sparse_moe.gate.weight"
    defaults = {**_MHA_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": None,
                "num_experts_per_tok": 2, "num_local_experts": 8, "rope_theta": 1e6}
    aliases = {"num_local_experts": ("num_experts",)}

    def read(self, f, log):
        f.need("sliding_window", lambda v: v is None, "sliding-window attention is not built here")
        f.need("hidden_act", lambda v: v == "silu", "the experts are SwiGLU here")
        # Mixtral's router always renormalises its top-k softmax weights
        return {"decoder_block": "mixtral", **_mha_keys(f, log), "base_mlp_dim": f["intermediate_size"],
                "base_moe_mlp_dim": f["intermediate_size"], "qk_norm": False, "num_experts": f["num_local_experts"],
                "norm_topk_prob": True}

    def hf_config(self, cfg):
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_mha_config(cfg),
                "intermediate_size": cfg.base_moe_mlp_dim, "num_local_experts": cfg.num_experts, "sliding_window": None}


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    defaults = {**_MHA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False,
                "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                "num_local_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None, "rope_theta": 10000.0}
    aliases = {"num_local_experts": ("num_experts",)}
    # read by transformers only with use_sliding_window, and for dense layers
    ignored = frozenset({"sliding_window", "max_window_layers", "intermediate_size"})

    def read(self, f, log):
        f.need("use_sliding_window", lambda v: not v, "sliding-window attention is not built here")
        f.need("decoder_sparse_step", lambda v: v == 1, "every layer is MoE here")
        f.need("mlp_only_layers", lambda v: not v, "dense layers are the first ones here")
        _silu_no_bias(f)
        # intermediate_size sizes transformers' dense layers only (mlp_only_layers, decoder_sparse_step): none here
        moe_dim = f["moe_intermediate_size"]
        return {"decoder_block": "qwen3_moe", **_mha_keys(f, log), "base_mlp_dim": moe_dim,
                "base_moe_mlp_dim": moe_dim, "qk_norm": True, "num_experts": f["num_local_experts"],
                "norm_topk_prob": bool(f["norm_topk_prob"])}

    def hf_config(self, cfg):
        # num_experts is transformers 4's name, num_local_experts transformers 5's: both, equal
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_mha_config(cfg),
                "intermediate_size": cfg.base_mlp_dim, "moe_intermediate_size": cfg.base_moe_mlp_dim,
                "num_experts": cfg.num_experts, "num_local_experts": cfg.num_experts,
                "norm_topk_prob": bool(cfg.norm_topk_prob), "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": False, "attention_bias": False}


_DEEPSEEK_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6,
                      "tie_word_embeddings": False, "rope_theta": 10000.0, "moe_layer_freq": 1}


class DeepSeek(Family):
    """deepseek_v3, and deepseek_v2 (the same layout with softmax, device-limited routing and no bias). Where
    transformers' class fixes what DeepSeek's own code reads from the file (V3: sigmoid scores, noaux_tc
    routing; V2: no norm_topk_prob), a file asking otherwise is refused: the two readers would disagree."""

    model_type = "deepseek_v3"
    V3 = {**_DEEPSEEK_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1,
          "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
          "rope_interleave": True, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    V2 = {**_DEEPSEEK_DEFAULTS, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
          "num_hidden_layers": 32, "num_attention_heads": 32, "first_k_dense_replace": 0, "kv_lora_rank": 512,
          "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None, "topk_method": "greedy",
          "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
          "max_position_embeddings": 2048, "mlp_bias": False, "rope_interleave": True, "scoring_func": "softmax",
          "num_nextn_predict_layers": 0}
    ignored = frozenset({"num_key_value_heads", "head_dim", "qk_head_dim"})  # MLA: unused or derived

    def schema(self, model_type):
        if model_type == "deepseek_v3":
            return self.V3, {"n_routed_experts": ("num_local_experts",),
                             "num_nextn_predict_layers": ("num_mtp_layers",)}
        return self.V2, {"n_routed_experts": ("num_experts",)}

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

    def _routing(self, f: Fields) -> dict:
        v3 = f.model_type == "deepseek_v3"
        if v3:
            f.need("topk_method", lambda v: v == "noaux_tc", "transformers' DeepseekV3 routes by noaux_tc only")
            f.need("scoring_func", lambda v: v == "sigmoid", "transformers' DeepseekV3 scores by sigmoid only")
            method = "noaux_tc"
        else:
            method = f.need("topk_method", lambda v: v in ("greedy", "group_limited_greedy"),
                            "transformers' DeepseekV2 routes by greedy or group_limited_greedy")
            f.need("scoring_func", lambda v: v == "softmax", "transformers' DeepseekV2 scores by softmax only")
            f.need("norm_topk_prob", lambda v: not v, "transformers' DeepseekV2 does not renormalise the top-k weights "
                   "while DeepSeek's own code does")
            f.need("mlp_bias", lambda v: not v, "the MLPs have no bias here")
        groups = f["n_group"] or 1
        grouped = groups > 1 and method != "greedy"
        experts_per_tok = f["num_experts_per_tok"]
        if experts_per_tok is None:
            raise ConfigError("config.json has no num_experts_per_tok, which transformers' DeepseekV2 needs")
        return {"num_experts": f["n_routed_experts"], "num_experts_per_tok": experts_per_tok,
                "shared_experts": f["n_shared_experts"] or 0,
                "routed_score_func": "sigmoid" if v3 else "softmax", "norm_topk_prob": bool(v3 and f["norm_topk_prob"]),
                "routed_scaling_factor": float(f["routed_scaling_factor"]), "routed_bias": v3,
                "n_routing_groups": groups if grouped else None,
                "topk_routing_group": f["topk_group"] if grouped else None,
                "routing_group_score": "topk_sum" if v3 else "max"}

    def read(self, f, log):
        _silu_no_bias(f)
        f.need("moe_layer_freq", lambda v: v == 1, "every layer after first_k_dense_replace is MoE here")
        v3 = f.model_type == "deepseek_v3"
        interleave = f["rope_interleave"]
        if not v3 and not interleave:
            raise ConfigError("config.json: rope_interleave=false, which transformers' DeepseekV2 does not read (it "
                              "always rotates interleaved pairs); fix the file")
        heads = f["num_attention_heads"]
        return {"decoder_block": "deepseek", "attention_type": "mla", "base_emb_dim": f["hidden_size"],
                "base_num_query_heads": heads, "base_num_kv_heads": heads, "head_dim": f["qk_nope_head_dim"],
                "base_mlp_dim": f["intermediate_size"], "base_moe_mlp_dim": f["moe_intermediate_size"],
                "base_num_decoder_layers": f["num_hidden_layers"],
                "first_num_dense_layers": f["first_k_dense_replace"] or 0, "vocab_size": f["vocab_size"],
                "logits_via_embedding": bool(f["tie_word_embeddings"]),
                "normalization_layer_epsilon": float(f["rms_norm_eps"]), "q_lora_rank": f["q_lora_rank"] or 0,
                "kv_lora_rank": f["kv_lora_rank"], "qk_nope_head_dim": f["qk_nope_head_dim"],
                "qk_rope_head_dim": f["qk_rope_head_dim"], "v_head_dim": f["v_head_dim"], **self._routing(f),
                "mtp_num_layers": (f["num_nextn_predict_layers"] or 0) if v3 else 0,
                **rope_keys(f, mla=True, interleave=bool(interleave), log=log)}

    def hf_config(self, cfg):
        method = ("noaux_tc" if cfg.routed_bias else
                  "group_limited_greedy" if cfg.n_routing_groups and cfg.routing_group_score == "max" else "greedy")
        v3 = cfg.routed_bias
        if not v3 and not (cfg.rope_type == "yarn" and cfg.rope_interleave):
            raise ConfigError("a DeepSeek-V2 export needs rope_interleave=true under rope_type=yarn (transformers' "
                              "DeepseekV2 always rotates interleaved pairs)")
        if v3 and cfg.routed_score_func != "sigmoid":
            raise ConfigError("a DeepSeek-V3 export needs routed_score_func=sigmoid (transformers' DeepseekV3)")
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
                **({"num_nextn_predict_layers": cfg.mtp_num_layers} if v3 else {}), "hidden_act": "silu",
                "attention_bias": False, "rope_interleave": bool(cfg.rope_type == "yarn" and cfg.rope_interleave),
                **rope_config(cfg, mla=True)}


FAMILIES = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe, "deepseek_v3": DeepSeek, "deepseek_v2": DeepSeek}
DECODER_BLOCKS = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe, "deepseek": DeepSeek}


def family_of(cfg):
    """The family (an instance) of the model a config builds; ConfigError for a model of none of them."""
    if cfg.num_experts <= 1:
        raise ConfigError("only MoE models export (num_experts > 1): mixtral, qwen3_moe, deepseek_v3/v2")
    if cfg.decoder_block in DECODER_BLOCKS:
        return DECODER_BLOCKS[cfg.decoder_block]()
    if cfg.decoder_block is not None:
        raise ConfigError(f"decoder_block={cfg.decoder_block} has no Hugging Face export here")
    return DeepSeek() if cfg.attention_type == "mla" else Qwen3Moe() if cfg.qk_norm else Mixtral()


def model_family(cfg) -> str:
    """The model_type of the family a config builds (DeepSeek's: deepseek_v3 with the routing bias, else
    deepseek_v2), as to_huggingface picks it; words for a model of none of them (for error lines)."""
    try:
        family = family_of(cfg)
    except ConfigError:
        return "dense (num_experts=1)" if cfg.num_experts <= 1 else f"decoder_block={cfg.decoder_block}"
    if isinstance(family, DeepSeek):
        return "deepseek_v3" if cfg.routed_bias else "deepseek_v2"
    return family.model_type


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

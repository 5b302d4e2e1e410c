"""config.json read the way Hugging Face transformers reads it, and nothing read wrongly in silence.

Two schemas are in use: the released checkpoints' (transformers 4: top-level `rope_theta`, `rope_scaling`,
Qwen3-MoE's `num_experts`) and transformers 5's (`rope_parameters` holding `rope_theta` and the scaling,
`num_local_experts`, `dtype`). `Fields` reads either: a field missing takes the default of the family's
transformers config class (as transformers does: MixtralConfig's rope_theta is 1e6, DeepseekV3Config's
routed_scaling_factor 2.5), two spellings of one field must agree, and every field of the file must be read,
be one that does not change the function (`GENERIC_IGNORED` or a family's own list, named in one log line),
or be named by the user in hf_ignore_fields; anything else is a one-line error naming the field.

RoPE (`rope_keys`), as transformers' modeling_rope_utils computes it: plain, or YaRN with its ramp
(beta_fast, beta_slow, original_max_position_embeddings; factor defaulting to max_position_embeddings over
it) and its attention factor on cos and sin (given, or mscale / mscale_all_dim's ratio of
0.1 ln(factor) + 1 when both are set, else 0.1 ln(factor) + 1), and for DeepSeek's attention the softmax
scale times (0.1 mscale_all_dim ln(factor) + 1)^2. Other kinds (linear, dynamic, llama3, longrope) are
refused.
"""

from __future__ import annotations

import json
import math

from MaxText.config.errors import ConfigError
from MaxText.config.storage import shown_path
from MaxText.layers.rope import yarn_mscale

# Fields of transformers' PreTrainedConfig (4 and 5) and the releases that never change the logits of a token
# row: names, dtype hints, token ids, caches, initialisation, training-only losses and noise, parallel sizes.
GENERIC_IGNORED = frozenset(
    "architectures auto_map _name_or_path name_or_path transformers_version torch_dtype dtype use_cache "
    "initializer_range bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id "
    "output_hidden_states output_attentions return_dict chunk_size_feed_forward is_encoder_decoder id2label "
    "label2id problem_type tokenizer_class output_router_logits router_aux_loss_coef aux_loss_alpha seq_aux "
    "ep_size attention_dropout router_jitter_noise pretraining_tp use_bfloat16 torchscript tie_encoder_decoder "
    "is_decoder add_cross_attention pruned_heads max_position_embeddings _attn_implementation "
    "_attn_implementation_autoset".split())

ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
               "original_max_position_embeddings")
_YARN_KEYS = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate"}
_KIND_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_MISSING = object()


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


class Fields:
    """One config.json under a family's defaults and aliases; records what was read."""

    def __init__(self, hf: dict, model_type: str, defaults: dict, aliases: dict | None = None,
                 ignored: frozenset = frozenset(), user_ignored: frozenset = frozenset()):
        self.hf, self.model_type, self.defaults = hf, model_type, defaults
        self.aliases = aliases or {}
        self.ignored = GENERIC_IGNORED | ignored | user_ignored | {"model_type"}
        self.used: set[str] = set()

    def spellings(self, name: str) -> tuple:
        return (name, *self.aliases.get(name, ()))

    def __getitem__(self, name: str):
        present = [(s, self.hf[s]) for s in self.spellings(name) if s in self.hf]
        self.used.update(s for s, _ in present)
        for s, v in present[1:]:
            if not _same(v, present[0][1]):
                first, other = shown_path(repr(present[0][1])), shown_path(repr(v))
                raise ConfigError(f"config.json: {present[0][0]}={first} and {s}={other} disagree (two spellings of "
                                  "one field); fix the file")
        if present:
            return present[0][1]
        value = self.defaults.get(name, _MISSING)
        if value is _MISSING:
            raise ConfigError(f"config.json has no {name}, which {self.model_type} needs")
        return value

    def need(self, name: str, ok, what: str):
        """The field's value, or a ConfigError saying what this trainer builds instead."""
        value = self[name]
        if not ok(value):
            raise ConfigError(f"config.json: {name}={shown_path(repr(value))} is not supported ({what})")
        return value

    def mark(self, *names: str) -> None:
        self.used.update(names)

    def finish(self, log) -> None:
        """ConfigError on the first field neither read nor known not to change the function; one log line
        naming the ignored fields present."""
        unknown = [k for k in self.hf if k not in self.used and k not in self.ignored]
        if unknown:
            raise ConfigError(f"config.json: field {unknown[0]}={_show(self.hf[unknown[0]])} is not understood by "
                              f"this importer for {self.model_type} ({len(unknown)} such) and may change the model; "
                              "if it does not, pass hf_ignore_fields=" + ",".join(unknown))
        skipped = sorted(k for k in self.hf if k not in self.used and k != "model_type")
        if skipped:
            log(f"config.json: not used (no effect on the model's function): {', '.join(skipped)}")


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _scaling_dict(f: Fields) -> dict:
    """The one rotary dict transformers 5 ends with: rope_scaling (the v4 spelling) wins over rope_parameters in
    transformers; here the two must agree where both are given."""
    params, scaling = f.hf.get("rope_parameters"), f.hf.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json: {name}={_show(value)} is not a mapping")
    params, scaling = dict(params or {}), dict(scaling or {})
    if params and not (_KIND_KEYS | _YARN_KEYS) & set(params):
        raise ConfigError(f"config.json: rope_parameters={_show(params)} is per layer type; one rotary embedding "
                          "for every layer is built here")
    if params and scaling:
        for key in sorted((set(params) | set(scaling)) - {"rope_theta", "rope_type", "type"}):
            if not _same(params.get(key), scaling.get(key)):
                raise ConfigError(f"config.json: rope_scaling.{key}={_show(scaling.get(key))} and "
                                  f"rope_parameters.{key}={_show(params.get(key))} disagree; fix the file")
    merged = {**params, **scaling}
    kinds = {v for d in (params, scaling) for k, v in d.items() if k in ("rope_type", "type")}
    if len(kinds) > 1:
        raise ConfigError(f"config.json: the rotary type is given as {' and '.join(sorted(map(str, kinds)))}; fix "
                          "the file")
    merged["rope_type"] = kinds.pop() if kinds else "default"
    thetas = [(n, v) for n, v in (("rope_theta", f.hf.get("rope_theta")), ("rope_parameters.rope_theta",
              params.get("rope_theta")), ("rope_scaling.rope_theta", scaling.get("rope_theta"))) if v is not None]
    for n, v in thetas[1:]:
        if not _same(v, thetas[0][1]):
            raise ConfigError(f"config.json: {thetas[0][0]}={thetas[0][1]} and {n}={v} disagree; fix the file")
    merged["rope_theta"] = float(thetas[0][1]) if thetas else float(f.defaults["rope_theta"])
    return merged


def rope_keys(f: Fields, mla: bool, interleave: bool, log) -> dict:
    """The rotary embedding of config.json as this trainer's keys (rope_type, rope_max_timescale and YaRN's)."""
    rope = _scaling_dict(f)
    f.mark(*ROPE_FIELDS)
    partial = [v for v in (f.hf.get("partial_rotary_factor"), rope.get("partial_rotary_factor")) if v is not None]
    if any(float(v) != 1.0 for v in partial):
        raise ConfigError(f"config.json: partial_rotary_factor={partial[0]} is not built here (RoPE on every "
                          "feature of the rotary part)")
    kind = rope["rope_type"]
    keys = {"rope_max_timescale": rope["rope_theta"]}  # rope_interleave is read under rope_type yarn only
    if kind == "default":
        extra = sorted(set(rope) - _KIND_KEYS)
        if extra:
            log(f"config.json: rotary fields {', '.join(extra)} have no effect under rope_type default (as in "
                "transformers)")
        if interleave:  # interleaved pairs are rotated under rope_type yarn here; factor 1 keeps every frequency
            keys.update(rope_type="yarn", rope_factor=1.0, rope_attention_factor=1.0, rope_interleave=True,
                        **({"mscale": 0.0} if mla else {}))
        else:
            keys["rope_type"] = "default"
        return keys
    if kind != "yarn":
        raise ConfigError(f"config.json: a rotary embedding of type {kind!r} is not built here (default or yarn)")
    unknown = sorted(set(rope) - _KIND_KEYS - _YARN_KEYS)
    if unknown:
        raise ConfigError(f"config.json: rotary field {unknown[0]}={_show(rope[unknown[0]])} is not understood "
                          "here (YaRN's fields: " + ", ".join(sorted(_YARN_KEYS)) + ")")
    if rope.get("truncate", True) is not True:
        raise ConfigError("config.json: YaRN with truncate=false (an unrounded ramp) is not built here")
    top = f.hf.get("original_max_position_embeddings")
    original = rope.get("original_max_position_embeddings")
    if top is not None and original is not None and top != original:
        raise ConfigError(f"config.json: original_max_position_embeddings={top} and its rotary copy {original} "
                          "disagree; fix the file")
    original = int(top if top is not None else original if original is not None else f["max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else f["max_position_embeddings"] / original
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor, 1.0))
    keys.update(rope_type="yarn", rope_interleave=interleave, rope_factor=factor,
                original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                rope_attention_factor=float(attention))
    if mla:  # DeepSeek's attention: softmax scale x (0.1 mscale_all_dim ln(factor) + 1)^2, none without it
        keys["mscale"] = float(mscale_all or 0.0)
    return keys


def rope_config(cfg, mla: bool) -> dict:
    """This config's rotary embedding in both schemas at once (top-level rope_theta and rope_scaling for
    transformers 4 and DeepSeek's own code, rope_parameters for transformers 5), so every reader reads the same."""
    theta = float(cfg.rope_max_timescale)
    plain = cfg.rope_type != "yarn" or (cfg.rope_factor == 1.0 and cfg.rope_attention_factor == 1.0)
    if plain:
        return {"rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": theta}}
    factor, attention = float(cfg.rope_factor), float(cfg.rope_attention_factor)
    scaling = {"rope_type": "yarn", "type": "yarn", "factor": factor, "beta_fast": float(cfg.beta_fast),
               "beta_slow": float(cfg.beta_slow), "attention_factor": attention,
               "original_max_position_embeddings": int(cfg.original_max_position_embeddings)}
    if mla:
        # DeepSeek's own code derives the cos/sin factor from mscale / mscale_all_dim and ignores attention_factor:
        # choose mscale so that its ratio is this config's factor.
        m_all = float(cfg.mscale)
        scaling["mscale_all_dim"] = m_all
        scaling["mscale"] = ((attention * yarn_mscale(factor, m_all) - 1) / (0.1 * math.log(factor)) if factor > 1
                             else 1.0)
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": theta},
            # transformers checks the context length against factor x the original
            "max_position_embeddings": int(round(cfg.original_max_position_embeddings * factor))}

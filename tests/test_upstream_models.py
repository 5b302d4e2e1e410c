"""Upstream MaxText 0.2.5's own MoE model files, loaded by path: each gives upstream's model or stops in one line.

tests/data/maxtext-0.2.5/models holds every model file of the maxtext-0.2.5 wheel that sets num_experts, as
shipped (see its README). The reference for a loadable file is a closed-form parameter count over upstream's
own view of the config: its base.yml defaults (MaxText/maxtext_0.2.5_defaults.json) with the model file's
keys over them, which is how upstream merges a model file. The model this trainer builds from the same file
(abstract parameters, nothing allocated) must have exactly that many parameters; released models also
match their published totals.
"""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from MaxText.config import upstream
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.planning.plan import parameter_counts

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "maxtext-0.2.5", "models")

# Loadable files and the published total of the released model each describes (None: no release).
# DeepSeek-V3's 671.03B excludes its MTP module (upstream's file sets no mtp_num_layers) and the 14,848
# selection biases, which are buffers, not parameters. Mixtral-8x22B's file has v0.3's 32768-token vocabulary.
BUILT = {
    "mixtral-8x7b": 46.70e9, "mixtral-8x22b": 140.63e9, "qwen3-30b-a3b": 30.53e9, "qwen3-30b-a3b-base": 30.53e9,
    "qwen3-235b-a22b": 235.09e9, "qwen3-480b-a35b": 480.15e9, "deepseek2-16b": 15.71e9, "deepseek2-236b": 235.74e9,
    "deepseek3-671b": 671.03e9, "kimi-k2-1t": 1026.41e9, "deepseek3-test": None, "deepseek3-tiny": None,
}
# The rest, each with what its one-line refusal names.
REFUSED = {
    "deepseek-custom": "use_indexer=true", "deepseek3.2-671b": "use_indexer=true",
    "deepseek3-671b-2dfsdp": "mesh_axes=", "deepseek3-671b-batchsplit": "shard_mode=explicit",
    "deepseek4-284b": "decoder_block=deepseek4", "deepseek4-tiny": "decoder_block=deepseek4",
    "envy-switch-base": "decoder_block=envy", "envy-switch-large": "decoder_block=envy",
    "envy-switch-xxl": "decoder_block=envy", "envy-test": "decoder_block=envy", "gemma4-26b": "decoder_block=gemma4",
    "gpt-oss-120b": "decoder_block=gpt_oss", "gpt-oss-20b": "decoder_block=gpt_oss",
    "llama4-17b-128e": "decoder_block=llama4", "llama4-17b-16e": "decoder_block=llama4",
    "qwen3-custom-30b-a3b": "decoder_block=qwen3_custom_moe", "qwen3-next-80b-a3b": "decoder_block=qwen3_next",
    "qwen3-omni-30b-a3b": "multimodal", "qwen3-vl-30b-a3b": "use_multimodal=true",
    "qwen3.5-35b-a3b": "decoder_block=qwen3_5", "qwen3.5-35b-a3b-fp8": "decoder_block=qwen3_5",
    "qwen3.5-397b-a17b": "decoder_block=qwen3_5", "qwen3.5-397b-a17b-fp8": "decoder_block=qwen3_5",
}


def path_of(name: str) -> str:
    return os.path.join(MODELS, f"{name}.yml")


def upstream_view(name: str) -> dict:
    """The config as upstream merges it: its base.yml defaults, then the model file."""
    with open(path_of(name)) as f:
        return dict(upstream.upstream_defaults(), **yaml.safe_load(f))


def closed_form_count(u: dict) -> int:
    """Parameters of upstream's decoder from its config keys: embedding, output head, final norm, and per layer
    attention (GQA with optional QK norm, or MLA with optional low-rank query), two norms, and a SwiGLU MLP
    (dense) or router + routed experts + shared experts (MoE)."""
    d, v = u["base_emb_dim"], u["vocab_size"]
    if u["attention_type"] == "mla":
        rope, nope, vh, heads = u["qk_rope_head_dim"], u["qk_nope_head_dim"], u["v_head_dim"], u["base_num_query_heads"]
        qr, kvr = u["q_lora_rank"], u["kv_lora_rank"]
        q = d * qr + qr + qr * heads * (nope + rope) if qr else d * heads * (nope + rope)
        attn = q + d * (kvr + rope) + kvr + kvr * heads * (nope + vh) + heads * vh * d
    else:
        hd, heads, kv = u["head_dim"], u["base_num_query_heads"], u["base_num_kv_heads"]
        attn = d * hd * (heads + 2 * kv) + heads * hd * d + (2 * hd if u["use_qk_norm"] else 0)
    dense_mlp = 3 * d * u["base_mlp_dim"]
    e, f = u["num_experts"], u["base_moe_mlp_dim"]
    moe_mlp = d * e + e * 3 * d * f + 3 * d * f * u["shared_experts"]
    layers, first_dense = u["base_num_decoder_layers"], u["first_num_dense_layers"]
    body = layers * (attn + 2 * d) + first_dense * dense_mlp + (layers - first_dense) * moe_mlp
    return v * d * (1 if u["logits_via_embedding"] else 2) + d + body


def test_every_shipped_moe_model_file_is_covered():
    shipped = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(MODELS, "*.yml"))}
    assert shipped == set(BUILT) | set(REFUSED)


# Whether upstream's router renormalises the k chosen weights, by the model's family (its moe.py: Mixtral and Qwen3
# take the softmax over the top-k logits whatever norm_topk_prob says, DeepSeek renormalises sigmoid scores, not
# DeepSeek-V2's softmax ones), checked against the logits of upstream's own checkpoints in test_upstream_ckpt.
RENORMALISED = {"mixtral": True, "qwen3": True, "deepseek2": False, "deepseek3": True, "kimi": True}


@pytest.mark.parametrize("name", sorted(BUILT))
def test_upstream_model_file_gives_upstreams_parameter_count(name):
    cfg = load_config([f"model_name={path_of(name)}", "hardware=cpu"])
    assert cfg.norm_topk_prob is RENORMALISED[name.split("-")[0]], name
    counts = parameter_counts(cfg)
    assert counts.total == closed_form_count(upstream_view(name)), (name, counts.total)
    if BUILT[name] is not None:
        assert abs(counts.total - BUILT[name]) < 0.005e9, (name, counts.total)  # published to 10M parameters


def test_upstreams_base_yml_with_a_model_name_trains_that_model(tmp_path):
    """The bug this fixes: upstream's base.yml (every model key set) as the config, with model_name, gave the
    dense default model, because the config file was applied over the model file."""
    path = tmp_path / "base.yml"
    path.write_text(yaml.safe_dump(dict(upstream.upstream_defaults(), hardware="cpu")))
    cfg = load_config([str(path), f"model_name={path_of('mixtral-8x7b')}"])
    assert parameter_counts(cfg).total == closed_form_count(upstream_view("mixtral-8x7b")) == 46_702_792_704
    assert cfg.norm_topk_prob is True  # base.yml's norm_topk_prob: false is a default upstream's Mixtral ignores


@pytest.mark.parametrize("key", ["norm_topk_prob=false", "routed_score_func=sigmoid"])
def test_a_routing_that_upstreams_block_would_not_build_stops_in_one_line(key):
    with pytest.raises(ConfigError, match=f"decoder_block=mixtral routes as {key.split('=')[0]}=.*remove"):
        load_config([f"model_name={path_of('mixtral-8x7b')}", "hardware=cpu", key])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_upstream_model_file_this_trainer_does_not_build_stops_in_one_line(name):
    with pytest.raises(ConfigError) as info:
        load_config([f"model_name={path_of(name)}", "hardware=cpu"])
    message = str(info.value)
    assert REFUSED[name] in message and "\n" not in message and "unknown key" not in message, message

"""Tiny configs shared by the tests: small enough that a train step compiles in a few seconds."""

from MaxText.config import load_config

TINY = [
    "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=64",
    "base_moe_mlp_dim=32", "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=64",
    "num_experts=4", "num_experts_per_tok=2", "max_target_length=16", "dtype=float32", "enable_tensorboard=false",
]


def tiny_config(*overrides):
    """The tiny MoE decoder (1 dense + 2 MoE layers, E=4, K=2, float32) with extra key=value overrides."""
    return load_config(TINY + list(overrides))

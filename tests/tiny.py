"""Tiny configs shared by the tests: small enough that a train step compiles in a few seconds."""

from MaxText.config.load import load_config

TINY = [
    "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=64",
    "base_moe_mlp_dim=32", "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=64",
    "num_experts=4", "num_experts_per_tok=2", "max_target_length=16", "dtype=float32", "enable_tensorboard=false",
    "dataset_type=synthetic", "eval_interval=-1", "per_device_batch_size=2",
]


def args(*parts) -> list:
    """key=value lists joined, a later value replacing an earlier one of the same key (the trainer refuses a
    key given twice on its command line)."""
    merged = {}
    for part in parts:
        for arg in ([part] if isinstance(part, str) else part):
            merged[arg.split("=", 1)[0]] = arg
    return list(merged.values())


def tiny_config(*overrides):
    """The tiny MoE decoder (1 dense + 2 MoE layers, E=4, K=2, float32) with extra key=value overrides."""
    return load_config(args(TINY, overrides))


def train_records(cfg, devices=None, log=lambda *_: None) -> list[dict]:
    """Trains cfg (quietly, unless given a log) and returns the records this run appended to its metrics.jsonl."""
    import json
    import os

    from MaxText.trainer.loop import train

    path = os.path.join(os.path.abspath(cfg.base_output_directory), cfg.run_name, "metrics", "metrics.jsonl")
    before = sum(1 for _ in open(path)) if os.path.exists(path) else 0
    train(cfg, log=log, devices=devices)
    with open(path) as f:
        return [json.loads(line) for line in f][before:]


def losses(records):
    """The `loss` of each record, as an array."""
    import numpy as np

    return np.array([r["loss"] for r in records])

"""Shipped model configs build the published architectures (counted on abstract params: nothing allocated)."""

import glob
import math
import os

import pytest

from MaxText.parallel import sharding
from MaxText.config.parse import CONFIG_DIR
from MaxText.config.load import global_batch_size, load_config
from MaxText.planning.plan import parameter_counts

# name: (total parameters, active parameters per token), as published (model cards and reports). DeepSeek-V3's
# 671B excludes its Multi-Token Prediction module (test_deepseek3_with_mtp covers the ~685B with it).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "deepseek3-671b": (671e9, 37e9), "qwen3-30b-a3b": (30.5e9, 3.3e9),
             "mixtral-8x22b": (141e9, 39e9), "qwen3-235b-a22b": (235e9, 22e9), "qwen3-480b-a35b": (480e9, 35e9),
             "deepseek2-236b": (236e9, 21e9), "deepseek2-16b": (15.7e9, 2.4e9), "kimi-k2-1t": (1.04e12, 32.6e9)}
NO_MTP = {"deepseek3-671b": ["mtp_num_layers=0", "override_model_config=true"]}
# Where a publisher counts otherwise, stated: DeepSeek-V2-Lite's 2.4B active leaves out the embedding table
# (2.66B with it; 2.45B without, which is what is compared); Kimi K2's report gives 1.04T, while its
# config.json's shapes add up to 1.026T (every matrix counted here: 60 MoE layers of 384 x 3 x 7168 x 2048,
# 61 MLA attentions, one dense MLP, embedding and head), 1.3% apart.
WITHOUT_EMBEDDING = {"deepseek2-16b"}
TOTAL_TOLERANCE = {"kimi-k2-1t": 0.015}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published(name):
    cfg = load_config([f"model_name={name}", *NO_MTP.get(name, [])])
    total, active, _, _ = parameter_counts(cfg)
    if name in WITHOUT_EMBEDDING:
        active -= cfg.vocab_size * cfg.base_emb_dim
    want_total, want_active = PUBLISHED[name]
    assert abs(total / want_total - 1) < TOTAL_TOLERANCE.get(name, 0.01), \
        f"{name}: {total / 1e9:.2f}B total, published {want_total / 1e9}B"
    assert abs(active / want_active - 1) < 0.025, f"{name}: {active / 1e9:.2f}B active, published {want_active / 1e9}B"


def test_deepseek3_with_mtp():
    """With its MTP depth (one more MoE layer plus the [2D, D] projection; embedding and head shared) the
    model holds ~683B parameters: the published checkpoint's ~685B also stores a copy of embedding and head."""
    total = parameter_counts(load_config(["model_name=deepseek3-671b"])).total
    assert abs(total / 685e9 - 1) < 0.01, f"{total / 1e9:.1f}B"


RECIPES = sorted(glob.glob(os.path.join(CONFIG_DIR, "gpu", "*.yml")))


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_gpu_recipe_loads_and_fills_its_device_count(recipe):
    """Each recipe names its GPU count last in its file name; its mesh must use exactly that many, with the
    expert axis inside the routed-expert count and the global batch splitting over the data axes."""
    devices = int(os.path.basename(recipe)[:-4].rsplit("-", 1)[1])
    cfg = load_config([recipe])
    shape = sharding.mesh_shape(cfg, devices)
    assert math.prod(shape[a] for a in ("data", "fsdp", "context", "expert", "tensor")) == devices, shape
    assert cfg.moe_impl == "te_dropless" and cfg.remat_policy == "custom"
    if "nvidia" in os.path.basename(recipe):  # NVIDIA's published settings: MoE wi_0/wi_1 offloaded, its flags
        assert cfg.moe_mlpwi_0 == "offload" and cfg.moe_mlpwi_1 == "offload"
    else:  # under context parallelism value_proj is the whole sequence's on every GPU: recomputed, not offloaded
        assert cfg.query_proj == "offload" and cfg.value_proj == ("remat" if shape["context"] > 1 else "offload")
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in cfg.xla_flags
    batch = global_batch_size(cfg, devices)
    assert batch % (shape["data"] * shape["fsdp"] * shape["expert"]) == 0, batch


@pytest.mark.parametrize("name", ["deepseek2-tiny", "kimi-k2-tiny"])
def test_new_family_tiny_variants_train_alike_under_dense_and_ragged(name, tmp_path):
    """The tiny variant of each family added with upstream's model names (DeepSeek-V2: softmax routing within
    device groups scored by their best expert, no bias, MLA without a low-rank query; Kimi K2: V3's layout at
    many experts in one group) trains on CPU on fsdp 2 x expert 4, with the same losses under the dense
    (no cap) and the ragged impls."""
    import numpy as np

    from tests.tiny import train_records

    def run(impl):
        return train_records(load_config([
            f"model_name={name}", "dtype=float32", "max_target_length=32", "steps=3", "log_period=1",
            "enable_checkpointing=false", "enable_tensorboard=false", "ici_fsdp_parallelism=2",
            "ici_expert_parallelism=4", "per_device_batch_size=1", "dataset_type=synthetic", "eval_interval=-1",
            f"base_output_directory={tmp_path}", f"run_name={impl}", f"moe_impl={impl}"]))

    dense, ragged = run("dense"), run("ragged")
    assert len(dense) == 3 and np.all(np.isfinite([r["loss"] for r in dense]))
    np.testing.assert_allclose([r["loss"] for r in ragged], [r["loss"] for r in dense], rtol=2e-4)

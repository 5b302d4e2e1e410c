"""Shipped model configs build the published architectures (counted on abstract params: nothing allocated)."""

import glob
import math
import os

import pytest

from MaxText import sharding
from MaxText.config import CONFIG_DIR, global_batch_size, load_config
from MaxText.plan import parameter_counts

# name: (total parameters, active parameters per token), as published. DeepSeek-V3's 671B excludes its
# Multi-Token Prediction module (test_deepseek3_with_mtp covers the ~685B with it).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "deepseek3-671b": (671e9, 37e9), "qwen3-30b-a3b": (30.5e9, 3.3e9)}
NO_MTP = {"deepseek3-671b": ["mtp_num_layers=0"]}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published(name):
    total, active, _, _ = parameter_counts(load_config([f"model_name={name}", *NO_MTP.get(name, [])]))
    want_total, want_active = PUBLISHED[name]
    assert abs(total / want_total - 1) < 0.01, f"{name}: {total / 1e9:.2f}B total, published {want_total / 1e9}B"
    assert abs(active / want_active - 1) < 0.02, f"{name}: {active / 1e9:.2f}B active, published {want_active / 1e9}B"


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
    assert math.prod(shape[a] for a in ("data", "fsdp", "expert", "tensor")) == devices, shape
    assert cfg.moe_impl == "te_dropless" and cfg.remat_policy == "custom"
    if "nvidia" in os.path.basename(recipe):  # NVIDIA's published settings: MoE wi_0/wi_1 offloaded, its flags
        assert cfg.moe_mlpwi_0 == "offload" and cfg.moe_mlpwi_1 == "offload"
    else:
        assert cfg.query_proj == "offload" and cfg.value_proj == "offload"
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in cfg.xla_flags
    batch = global_batch_size(cfg, devices)
    assert batch % (shape["data"] * shape["fsdp"] * shape["expert"]) == 0, batch

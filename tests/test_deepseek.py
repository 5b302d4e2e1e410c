"""deepseek3-tiny (MLA, YaRN, shared experts, group-limited sigmoid routing with bias updates, MTP) trains
on CPU under every moe_impl, and the three give the same losses."""


import numpy as np
import pytest

from MaxText.config import load_config
from tests.tiny import train_records

IMPLS = {"dense": ["moe_impl=dense"], "ragged": ["moe_impl=ragged"],
         "te_dropless": ["moe_impl=te_dropless", "te_kernels=reference"]}


def run(tmp_path, impl):
    cfg = load_config(["model_name=deepseek3-tiny", "dtype=float32", "max_target_length=32", "steps=4",
                       "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false",
                       "ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "per_device_batch_size=1",
                       "routed_bias_update_rate=0.01", "dataset_type=synthetic", "eval_interval=-1",
                       f"base_output_directory={tmp_path}", f"run_name={impl}",
                       *IMPLS[impl]])
    return train_records(cfg)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ds"), "dense")


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
def test_deepseek3_tiny_losses_agree_across_impls(impl, tmp_path, dense):
    records = run(tmp_path, impl)
    for key in ("loss", "lm_loss", "mtp_loss"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in dense], rtol=2e-4,
                                   err_msg=f"{impl} {key}")
    assert records[-1]["moe_bias_abs_mean"][0] > 0, "the routing bias must move"
    assert max(max(r["moe_overflow"]) for r in records) == 0

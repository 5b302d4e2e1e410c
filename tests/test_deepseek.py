"""deepseek3-tiny (MLA, YaRN, shared experts, group-limited sigmoid routing with bias updates, MTP) trains
on CPU under every moe_impl, and the three give the same losses."""


import numpy as np
import pytest

from MaxText.config.load import load_config
from tests.tiny import train_records

IMPLS = {"dense": ["moe_impl=dense"], "ragged": ["moe_impl=ragged"],
         "te_dropless": ["moe_impl=te_dropless", "te_kernels=reference"]}


def run(tmp_path, impl):
    cfg = load_config(["model_name=deepseek3-tiny", "override_model_config=true", "dtype=float32",
                       "max_target_length=32", "steps=4", "log_period=1", "enable_checkpointing=false",
                       "enable_tensorboard=false",
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


def test_every_router_counts_its_drops_in_training_and_evaluation(tmp_path):
    """ragged with receive buffers at half the balanced load: the slots that do not fit are counted in every
    MoE layer, the MTP depth's included (its stats used to reach only the losses and the bias), with one
    meaning across impls (dropped_fraction = dropped slots / real slots; ragged used to report 0 beside a
    positive overflow), and in evaluation too (eval_step used to discard them)."""
    cfg = load_config(["model_name=deepseek3-tiny", "override_model_config=true", "dtype=float32",
                       "max_target_length=32", "steps=2", "log_period=1", "enable_checkpointing=false",
                       "enable_tensorboard=false",
                       "ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "per_device_batch_size=1",
                       "dataset_type=synthetic", "eval_interval=2", "eval_steps=1", "moe_impl=ragged",
                       "ragged_buffer_factor=0.5", f"base_output_directory={tmp_path}", "run_name=drops"])
    records = train_records(cfg)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    slots = 8 * 32 * cfg.num_experts_per_tok  # tokens of the global batch x K
    for r in train:
        overflow, dropped = np.asarray(r["moe_overflow"]), np.asarray(r["moe_dropped_fraction"])
        assert len(overflow) == 3 + 1, "three decoder MoE layers, then the MTP depth"
        assert overflow[-1] > 0 and np.all(overflow > 0), overflow
        np.testing.assert_allclose(dropped, overflow / slots, rtol=1e-6)
    assert len(evals) == 1 and len(evals[0]["eval_moe_overflow"]) == 3, evals
    np.testing.assert_allclose(evals[0]["eval_moe_dropped_fraction"], np.asarray(evals[0]["eval_moe_overflow"]) / slots,
                               rtol=1e-6)
    assert min(evals[0]["eval_moe_overflow"]) > 0
    # The report of this run (MTP and eval: it used to crash) draws every plot, naming decoder layers and the depth
    from MaxText.trainer import report

    paths = report.write_report(str(tmp_path / "drops"), log=lambda *_: None)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["loss.png", "throughput.png", "expert_load.png", "moe_balance.png"]
    run_config = report.read_run_config(str(tmp_path / "drops" / "metrics" / "config.yml"))
    assert report.layer_names(run_config, 4) == ["decoder layer 1", "decoder layer 2", "decoder layer 3", "MTP depth 1"]

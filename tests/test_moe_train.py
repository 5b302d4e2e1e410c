"""Training with each MoE implementation: same losses, checkpoints interchangeable, bias state kept."""

import os
import subprocess
import sys

import numpy as np
import pytest

from MaxText.config.load import load_config
from tests.tiny import TINY, args, losses, train_records

EP_MESH = ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "per_device_batch_size=1"]
IMPLS = {"dense": ["moe_impl=dense"], "ragged": ["moe_impl=ragged"],
         "te_dropless": ["moe_impl=te_dropless", "te_kernels=reference"]}


def run(tmp_path, *overrides):
    return train_records(load_config(args(TINY, EP_MESH, [f"base_output_directory={tmp_path}", "log_period=1"],
                                          overrides)))


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dense")
    return tmp, run(tmp, "run_name=dense", "steps=10", "checkpoint_period=5", *IMPLS["dense"])


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
def test_dropless_impls_train_to_the_dense_losses(impl, tmp_path, dense_run):
    """Ten steps from the same seed on fsdp 2 x expert 4: dense (no cap), ragged and te_dropless (reference
    kernels) compute the same function, so their losses agree."""
    records = run(tmp_path, f"run_name={impl}", "steps=10", "enable_checkpointing=false", *IMPLS[impl])
    np.testing.assert_allclose(losses(records), losses(dense_run[1]), rtol=2e-4, err_msg=impl)
    assert all(max(r["moe_overflow"]) == 0 for r in records), "dropless buffers must not overflow"
    assert np.asarray(records[-1]["moe_expert_load"]).shape == (2, 4), "expert load per MoE layer and expert"


def test_checkpoint_restores_under_another_impl(tmp_path, dense_run):
    """A checkpoint written under dense continues under ragged with the losses dense would have had."""
    source, records = dense_run
    continued = run(tmp_path, "run_name=switch", "steps=10", *IMPLS["ragged"],
                    f"load_full_state_path={source}/dense/checkpoints/5/items")
    assert [r["step"] for r in continued] == list(range(6, 11))
    np.testing.assert_allclose(losses(continued), losses(records)[5:], rtol=2e-4)


def test_routing_bias_moves_and_survives_resume(tmp_path):
    """Aux-loss-free balancing: the bias leaves zero, is saved beside the params, and a resumed run equals
    the uninterrupted one (which needs the restored bias)."""
    bias = ["routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.01", "norm_topk_prob=true",
            "learning_rate_schedule_steps=6", *IMPLS["ragged"]]
    full = run(tmp_path, "run_name=full", "steps=6", "enable_checkpointing=false", *bias)
    assert full[-1]["moe_bias_abs_mean"][0] > 0, full[-1]["moe_bias_abs_mean"]
    first = run(tmp_path, "run_name=split", "steps=3", *bias)
    second = run(tmp_path, "run_name=split", "steps=6", *bias)
    np.testing.assert_allclose(losses(first + second), losses(full), rtol=1e-5)
    np.testing.assert_allclose(second[-1]["moe_bias_abs_mean"], full[-1]["moe_bias_abs_mean"], rtol=1e-5)


def test_te_dropless_without_gpu_is_one_line_exit_2():
    """On a machine without an NVIDIA GPU, te_kernels=auto stops at start-up naming the way out."""
    proc = subprocess.run([sys.executable, "-m", "MaxText.train", "moe_impl=te_dropless", "steps=1"],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "moe_impl=te_dropless" in lines[0] and "te_kernels=reference" in lines[0], lines


def test_gradient_accumulation_is_the_same_update_as_the_whole_batch(tmp_path):
    """gradient_accumulation_steps=N takes each step's batch in N micro-batches and makes the update one step over
    the whole batch makes: the same losses, gradient norms and (aux-loss-free) routing biases, step after step,
    also with expert parallelism. (The load-balance loss, a product of two batch means, is per micro-batch, as
    upstream's; it is off here, its default.)"""
    common = [*EP_MESH[:2], "per_device_batch_size=4", "routed_score_func=sigmoid", "routed_bias=true",
              "routed_bias_update_rate=0.01", "norm_topk_prob=true", *IMPLS["ragged"], "steps=2",
              "enable_checkpointing=false", "load_balance_loss_weight=0", "learning_rate_schedule_steps=2"]
    whole = run(tmp_path, "run_name=whole", *common)
    accumulated = run(tmp_path, "run_name=accumulated", "gradient_accumulation_steps=4", *common)
    np.testing.assert_allclose(losses(accumulated), losses(whole), rtol=2e-5)
    for key in ("grad_norm", "lm_loss"):
        np.testing.assert_allclose([r[key] for r in accumulated], [r[key] for r in whole], rtol=2e-4, err_msg=key)
    for key in ("moe_expert_load", "moe_bias_abs_mean"):
        np.testing.assert_allclose(accumulated[-1][key], whole[-1][key], rtol=2e-4, atol=1e-7, err_msg=key)


def test_gradient_accumulation_must_split_each_shard():
    from MaxText.parallel import sharding
    from MaxText.config.errors import ConfigError

    cfg = load_config(args(TINY, ["per_device_batch_size=2", "gradient_accumulation_steps=4"]))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 must divide each data shard's 2 rows"):
        sharding.create_mesh(cfg)  # refused as the mesh is made (parallel/checks.py)

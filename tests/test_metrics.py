"""Model FLOPs, MFU peaks, and what the metrics writers put in JSONL, TensorBoard and on the console."""

import json

import numpy as np
import pytest

from MaxText.planning import flops
from MaxText.trainer import metrics
from MaxText.config.load import load_config
from tests.tiny import tiny_config


def test_model_flops_per_token_counts_each_matmul():
    """Tiny config: 1 dense + 2 MoE layers, D=32, H=4, N=2, K=8 head dim, L=16, V=64, F=64, E=4, top-2 of F=32."""
    cfg = tiny_config()
    d, h, n, k, length, v = 32, 4, 2, 8, 16, 64
    attention = 2 * d * (h * k) + 2 * 2 * d * (n * k) + 2 * (h * k) * d + 2 * h * k * length  # causal QK^T + AV
    dense_mlp = 3 * 2 * d * 64
    moe = 2 * d * 4 + 2 * 3 * 2 * d * 32  # router + two active experts
    forward = 3 * attention + dense_mlp + 2 * moe + 2 * d * v
    assert flops.model_flops_per_token(cfg) == pytest.approx(3 * forward)


@pytest.mark.parametrize("kind,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA GH200 480GB", 989.0),
                                       ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("cpu", None),
                                       ("TPU v5 lite", None)])
def test_peak_table(kind, peak):
    assert flops.peak_tflops(kind) == peak


def test_throughput_and_mfu():
    cfg = tiny_config()
    tps, tflops, mfu = flops.throughput(cfg, tokens_per_step=4096, num_devices=8, step_time_s=0.5, peak=1000.0)
    assert tps == 4096 / 0.5 / 8
    assert tflops == pytest.approx(flops.model_flops_per_token(cfg) * tps / 1e12)
    assert mfu == pytest.approx(tflops / 1000.0)
    assert flops.throughput(cfg, 4096, 8, 0.5, None)[2] is None


class FakeTensorBoard:
    def __init__(self, logdir):
        self.logdir, self.scalars, self.histograms = logdir, {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)

    def add_histogram(self, tag, values, step):
        self.histograms[tag] = (np.asarray(values), step)

    def flush(self):
        pass

    def close(self):
        pass


def test_writer_jsonl_and_tensorboard_layout(tmp_path, monkeypatch):
    """Scalars stay scalars; a per-layer list [L] becomes <key>/layer_<i> scalars and a per-layer,
    per-expert list [L, E] one histogram per layer."""
    import tensorboardX

    made = []
    monkeypatch.setattr(tensorboardX, "SummaryWriter",
                        lambda logdir, **kwargs: made.append(FakeTensorBoard(logdir)) or made[-1])
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
    load = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    record = writer.write(7, {"loss": np.float32(2.5), "moe_overflow": np.array([0.0, 3.0]),
                              "moe_expert_load": load, "mfu": None})
    writer.close()
    with open(tmp_path / "metrics" / "metrics.jsonl") as f:
        assert json.loads(f.read()) == record == {"step": 7, "loss": 2.5, "moe_overflow": [0.0, 3.0],
                                                  "moe_expert_load": load.tolist(), "mfu": None}
    tb = made[0]
    assert tb.logdir == str(tmp_path / "tensorboard")
    # upstream's tag and step count (the first update is its step 0); keys upstream has no tag for keep theirs
    assert tb.scalars == {"learning/loss": (2.5, 6), "moe_overflow/layer_0": (0.0, 6), "moe_overflow/layer_1": (3.0, 6)}
    assert sorted(tb.histograms) == ["moe_expert_load/layer_0", "moe_expert_load/layer_1"]
    np.testing.assert_array_equal(tb.histograms["moe_expert_load/layer_1"][0], load[1])


def test_tensorboard_tags_are_upstreams():
    """The record keys upstream MaxText has a tag for go out under its tag (its metric_logger's names)."""
    tags = metrics.tensorboard_scalars({"step": 1, "loss": 1.0, "step_time_s": 0.5, "eval_loss": 2.0,
                                        "tokens_per_s_per_device": 10.0, "learning_rate": 1e-3, "mfu": None,
                                        "moe_load_max_over_mean": [1.5, 2.5], "moe_router_entropy": [1.0, 1.1]})
    assert tags == {"learning/loss": 1.0, "perf/step_time_seconds": 0.5, "eval/avg_loss": 2.0,
                    "perf/per_device_tokens_per_sec": 10.0, "learning/current_learning_rate": 1e-3,
                    "moe_load_max_over_mean": [1.5, 2.5], "moe_router_entropy": [1.0, 1.1],
                    "learning/moe_max_load_ratio": 2.5, "learning/moe_max_load_ratio_mean": 2.0}


def test_console_line_summarises_moe_layers():
    line = metrics.console_line({"step": 3, "loss": 1.5, "step_time_s": 0.25, "mfu": None,
                                 "moe_load_max_over_mean": [1.2, 2.5], "moe_dropped_fraction": [0.1, 0.3],
                                 "moe_overflow": [1.0, 2.0]})
    assert line.startswith("completed step: 3, seconds: 0.250")
    assert "loss: 1.5000" in line and "max/mean expert load: 2.50" in line
    assert "dropped: 0.200" in line and "overflow: 3" in line and "MFU" not in line


def test_mla_and_mtp_flops():
    """deepseek3-tiny: MLA projections with a low-rank query, scores over qk = nope + rope, values of v dims,
    and one MTP depth (projection, a MoE layer, the output projection)."""
    cfg = load_config(["model_name=deepseek3-tiny", "max_target_length=16"])
    d, h, rq, rkv, nope, rope, v, length = 64, 4, 32, 16, 16, 8, 16, 16
    attention = 2 * (d * rq + rq * h * (nope + rope) + d * (rkv + rope) + rkv * h * (nope + v) + h * v * d) \
        + 2 * h * (nope + rope + v) * length / 2
    assert flops.attention_flops_per_token(cfg) == pytest.approx(attention)
    moe = 2 * d * 16 + (4 + 1) * 2 * 3 * d * 32
    forward = 4 * attention + 2 * 3 * d * 128 + 3 * moe + 2 * d * 512
    mtp = 2 * 2 * d * d + attention + moe + 2 * d * 512
    assert flops.model_flops_per_token(cfg) == pytest.approx(3 * (forward + mtp))

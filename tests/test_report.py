"""The run report: which records it reads (last record per step wins), the expert-load matrix behind the
heatmap, the PNGs it writes for MoE and dense runs, and its one-line CLI errors."""

import json
import struct

import numpy as np
import pytest

from MaxText.trainer import report

LOG_PERIOD, EXPERTS = 5, 4
# Token-slots per expert in the 2 MoE layers: layer 0's expert 2 and layer 1's expert 0 are hot.
SKEW_LE = np.array([[100.0, 100.0, 500.0, 300.0], [700.0, 100.0, 100.0, 100.0]])


def train_record(step: int, loss: float, mfu, load_LE=SKEW_LE) -> dict:
    """A record with every key MaxText.train logs for an MoE run with moe_impl=dense (no MTP)."""
    mean_L = load_LE.mean(axis=-1)
    return {"step": step, "loss": loss, "lm_loss": loss - 0.03, "moe_aux_loss": 0.03, "moe_z_loss": 0.0,
            "grad_norm": 0.9, "learning_rate": 1e-3, "moe_expert_load": load_LE.tolist(),
            "moe_load_max_over_mean": (load_LE.max(axis=-1) / np.maximum(mean_L, 1e-9)).tolist(),
            "moe_load_min": load_LE.min(axis=-1).tolist(), "moe_load_max": load_LE.max(axis=-1).tolist(),
            "moe_router_entropy": [1.2, 1.1], "moe_dropped_fraction": [0.01, 0.02], "moe_overflow": [0.0, 0.0],
            "moe_bias_abs_mean": [0.0, 0.0], "step_time_s": 1.9, "tokens_per_s_per_device": 500.0 + step,
            "tflops_per_device": 0.002 + step * 1e-5, "mfu": mfu}


def eval_record(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_perplexity": float(np.exp(loss)), "eval_tokens": 8192}


# A run that crashed after logging step 15 with its newest checkpoint at step 10 and was resumed: the resumed
# run logs step 15 again (other numbers: a different load) and carries on to 20.
STALE_LOAD_LE = SKEW_LE[:, ::-1]
MOE_LINES = [
    train_record(5, 5.2, None), train_record(10, 3.0, None), eval_record(10, 3.1),
    train_record(15, 9.9, 0.30, STALE_LOAD_LE),
    train_record(15, 2.5, 0.31), train_record(20, 2.2, 0.32), eval_record(20, 2.4),
]


def write_run(root, records, name="run") -> str:
    metrics = root / name / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(root / name)


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails unless the file starts with the PNG signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_train_step_logs_the_keys_the_report_reads():
    """The hand-built records above carry exactly the keys a real MoE train step logs (metrics from
    train_step's traced output, throughput from the loop), so the report reads what real runs write."""
    import functools

    import jax

    from MaxText.parallel import sharding
    from MaxText.data.records import abstract_batch
    from MaxText.step.state import state_spec
    from MaxText.step.train_step import train_step
    from tests.tiny import tiny_config

    cfg = tiny_config()
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    batch = abstract_batch(16, cfg.max_target_length)
    with jax.set_mesh(mesh):
        _, metrics = jax.eval_shape(functools.partial(train_step, graphdef=spec.graphdef, cfg=cfg, tx=spec.tx),
                                    spec.abstract, batch)
    logged = {"step", *metrics, "step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu"}
    assert set(train_record(5, 1.0, None)) == logged
    assert metrics["moe_expert_load"].shape == (2, 4), "moe_expert_load is [MoE layers, experts]"


def test_last_record_of_a_step_wins(tmp_path):
    train, evals = report.read_records(write_run(tmp_path, MOE_LINES) + "/metrics/metrics.jsonl")
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["step"] for r in evals] == [10, 20], "eval records are kept apart from train records of a step"
    assert train[2]["loss"] == 2.5, "step 15 must come from the resumed run (the later line)"


def test_expert_load_matrix_shows_the_hot_expert(tmp_path):
    train, _ = report.read_records(write_run(tmp_path, MOE_LINES) + "/metrics/metrics.jsonl")
    steps, share_LES = report.expert_load_matrix(train)
    np.testing.assert_array_equal(steps, [5, 10, 15, 20])
    assert share_LES.shape == (2, EXPERTS, 4)
    np.testing.assert_allclose(share_LES.sum(axis=1), 1.0, err_msg="shares of a layer at a step sum to 1")
    np.testing.assert_array_equal(share_LES.argmax(axis=1), [[2] * 4, [0] * 4],
                                  err_msg="hot expert per layer and step (the stale step-15 record had them "
                                          "reversed)")
    np.testing.assert_allclose(share_LES[:, :, 2], SKEW_LE / SKEW_LE.sum(axis=1, keepdims=True))


def test_expert_load_matrix_of_a_layer_with_no_tokens_is_zero():
    steps, share_LES = report.expert_load_matrix([train_record(1, 1.0, None, np.zeros((2, EXPERTS)))])
    np.testing.assert_array_equal(share_LES, np.zeros((2, EXPERTS, 1)))


def test_moe_run_writes_all_plots(tmp_path, capsys):
    run_dir = write_run(tmp_path, MOE_LINES)
    assert report.main([run_dir]) == 0
    out = capsys.readouterr().out.splitlines()
    names = ["loss.png", "throughput.png", "expert_load.png", "moe_balance.png"]
    assert out == [f"{run_dir}/metrics/{name}" for name in names]
    for path in out:
        width, height = png_size(path)
        assert width >= 600 and height >= 250, f"{path}: {width}x{height}"


def test_dense_run_writes_loss_and_throughput_only(tmp_path):
    dense = [{k: v for k, v in r.items() if not k.startswith("moe_")} for r in MOE_LINES]
    notes = []
    paths = report.write_report(write_run(tmp_path, dense), out_dir=str(tmp_path / "plots"), log=notes.append)
    assert paths == [str(tmp_path / "plots" / "loss.png"), str(tmp_path / "plots" / "throughput.png")]
    assert all(png_size(p)[0] >= 600 for p in paths)
    assert len(notes) == 1 and "expert_load.png" in notes[0]


@pytest.mark.parametrize("case,content,message", [
    ("no run directory", None, "does not exist"),
    ("no metrics file", "", "metrics.jsonl does not exist"),
    ("empty metrics file", "\n", "is empty"),
    ("truncated line", json.dumps(train_record(5, 1.0, None)) + '\n\n{"step": 10, "lo', "line 3: not JSON"),
    ("no step", json.dumps({"loss": 1.0}) + "\n", "line 1: not a metrics record"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, case, content, message):
    run_dir = tmp_path / "run"
    if content is not None:
        (run_dir / "metrics").mkdir(parents=True)
        if content:
            (run_dir / "metrics" / "metrics.jsonl").write_text(content)
    assert report.main([str(run_dir)]) == 2, case
    captured = capsys.readouterr()
    assert captured.out == "", case
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (case, captured.err)

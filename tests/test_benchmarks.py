"""The benchmark commands run on CPU and report consistent rows (their speed is never asserted)."""

import json

import numpy as np

from MaxText.benchmarks import train_step
from tests.tiny import TINY, args


def test_train_step_benchmark_reports_each_impl(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = train_step.main(["configs/base.yml", *TINY, "ici_expert_parallelism=4", "--impls", "dense,ragged",
                              "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert [r["impl"] for r in result["rows"]] == ["dense", "ragged"]
    for r in result["rows"]:
        assert r["step_s"] > 0 and r["compile_s"] > 0 and r["tokens_per_s_per_device"] > 0, r
        assert r["mfu"] is None, "no known peak for a CPU"
    # Uncapped dense and dropless ragged compute the same function: the same loss after the same steps.
    np.testing.assert_allclose(result["rows"][0]["loss"], result["rows"][1]["loss"], rtol=1e-5)
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split()[:3] == ["moe_impl", "compile", "s"] and json.loads(printed[-1]) == json.loads(
        out.read_text())


def test_train_step_benchmark_config_error_is_one_line(capsys):
    assert train_step.main(["configs/base.yml", *args(TINY, ["num_experts_per_tok=5"]), "--impls", "dense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_gpu_check_refuses_a_machine_without_nvidia_gpu(capsys, tmp_path):
    """The kit's GPU mode stops with one line on a CPU (its --smoke mode was run by hand: see the README)."""
    import os
    import subprocess

    from MaxText.benchmarks import gpu_check

    assert gpu_check.main(["--json", str(tmp_path / "gc.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no NVIDIA GPU") and err.count("\n") == 1, err
    env = dict(os.environ, PATH="/usr/bin:/bin")  # no nvidia-smi on this PATH
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: no NVIDIA GPU"), result.stderr

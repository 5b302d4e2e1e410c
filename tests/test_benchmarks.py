"""The benchmark commands run on CPU and report consistent rows (their speed is never asserted)."""

import json

import numpy as np

from MaxText.benchmarks import train_step
from tests.tiny import TINY, args


def test_train_step_benchmark_reports_each_impl(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = train_step.main(["configs/base.yml", *TINY, "ici_expert_parallelism=4", "--impls",
                              "dense,ragged:ep_dedup=false", "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert [r["impl"] for r in result["rows"]] == ["dense", "ragged:ep_dedup=false"]
    for r in result["rows"]:
        assert r["step_s"] > 0 and r["compile_s"] > 0 and r["tokens_per_s_per_device"] > 0, r
        assert r["mfu"] is None, "no known peak for a CPU"
    # Uncapped dense and dropless ragged (here one row per chosen expert) compute the same function: the same loss.
    for r in result["rows"][1:]:
        np.testing.assert_allclose(r["loss"], result["rows"][0]["loss"], rtol=1e-5, err_msg=r["impl"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split()[:3] == ["moe_impl", "compile", "s"] and json.loads(printed[-1]) == json.loads(
        out.read_text())


def test_moe_layer_ep_benchmark_compares_the_dispatches(capsys):
    """--ep 8 with DeepSeek-style group-limited routing: one row per chosen expert sends K rows per token; one
    row per device sends each token's distinct devices (at most the kept groups, here 4 of 8), and the receive
    buffers and the compiled module's all-to-all bytes shrink with it."""
    from MaxText.benchmarks import moe_layer

    result = moe_layer.main(["--ep", "8", "--tokens", "256", "--dim", "16", "--hidden", "16", "--repeats", "1"])
    per_choice, per_device = result["ep_rows"]
    assert (per_choice["ep_dedup"], per_device["ep_dedup"]) == (False, True)
    assert per_choice["rows_per_token"] == 8
    assert 1 <= per_device["rows_per_token"] <= 4, per_device
    ratio = per_device["rows_per_token"] / per_choice["rows_per_token"]
    np.testing.assert_allclose(per_device["ragged_bytes_per_device"] / per_choice["ragged_bytes_per_device"], ratio)
    assert per_device["receive_rows_per_device"] * 8 == per_choice["receive_rows_per_device"]
    assert per_device["hlo_all_to_all_bytes_per_device"] < per_choice["hlo_all_to_all_bytes_per_device"] / 4
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["EP", "rows", "per"]


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


def test_gpu_check_names_what_is_missing_and_installs_nothing(tmp_path):
    """On a GPU machine whose Python lacks the kit's packages, gpu_check.sh names them (requirements.txt's pins) and
    how to bring them, with network or without, and never runs pip (the machine may have no network)."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    calls = tmp_path / "calls"
    # A CUDA jax for the script's first question; then the real Python without its site-packages (-S): a
    # Python that has nothing the kit imports. Anything else (pip) is recorded and fails.
    (bin_dir / "python").write_text(f"""#!/bin/sh
echo "$@" >> {calls}
case "$1" in
  -c) case "$2" in *default_backend*) exit 0;; *) exec {sys.executable} -S "$@";; esac;;
  scripts/kit_missing.py) exec {sys.executable} -S "$@";;
  *) exit 99;;
esac
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=str(bin_dir / "python"))
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    pins = {line.split("#")[0].strip() for line in open("requirements.txt")}
    for name in ("flax", "optax", "orbax-checkpoint", "ml-collections", "pytest"):
        pin = next(p for p in pins if p.startswith(name + "=="))
        assert pin in result.stderr, (pin, result.stderr)
    assert "pip install --no-index --find-links wheels/" in result.stderr, result.stderr
    assert "transformer-engine" not in result.stderr and "tensorflow" not in result.stderr, result.stderr
    ran = calls.read_text().splitlines()
    assert all(line.split()[0] in ("-c", "scripts/kit_missing.py") for line in ran), ran


def test_input_benchmark_reports_each_pipeline(tmp_path, capsys):
    """Every pipeline reads the generated corpus (TFDS, ArrayRecord by the converter, Parquet) in full rows, and
    resumes at the start and at the end of its epoch."""
    from MaxText.benchmarks import input as input_benchmark

    out = tmp_path / "input.json"
    input_benchmark.main(["--documents", "200", "--files", "2", "--length", "64", "--batch", "2", "--batches", "2",
                          "--repeats", "1", "--grain_workers", "0", "--pretokenized", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["pipeline"] for r in result["rows"]] == ["tfds", "grain (0 workers)", "grain, token ids (0 workers)",
                                                       "hf"]
    for r in result["rows"]:
        assert r["tokens_per_s"] > 0 and r["first_batch_s"] > 0, r
        assert r["resume_start_s"] > 0 and r["resume_end_s"] > 0 and r["resume_end_document"] == 190, r
        assert r["tokens_per_batch"] == 2 * 64, f"{r['pipeline']}: a training batch is never padded"
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split()[:2] == ["pipeline", "tokens/s"] and json.loads(printed[-1]) == result

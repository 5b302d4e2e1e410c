"""Multi-process training for real: two processes on this machine (4 CPU devices each, gloo collectives)
started by scripts/launch.sh --local 2, through jax.distributed, against one process with 8 devices."""

import json
import os
import subprocess
import sys

import numpy as np

from MaxText.config import load_config
from tests.tiny import TINY, losses, train_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_processes_train_together_like_one(tmp_path):
    """Same global batch (each process builds its own rows), same mesh size: the same losses; process 0
    alone writes metrics; the checkpoint holds both processes' input positions."""
    args = TINY + [f"base_output_directory={tmp_path}", "steps=4", "checkpoint_period=2", "log_period=1",
                   "learning_rate_schedule_steps=4"]
    one = losses(train_records(load_config(args + ["run_name=one"])))

    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), "--local", "2",
                             os.path.join(ROOT, "configs", "base.yml"), *args, "run_name=two"],
                            env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "mesh {'data': 1, 'fsdp': 8, 'expert': 1, 'tensor': 1}" in out, out
    with open(tmp_path / "two" / "metrics" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4], "process 0, and only it, logs each step once"
    # Cross-process all-reduces (gloo) may add in another order than one process's: float32 rounding.
    np.testing.assert_allclose(losses(records), one, rtol=2e-5)
    with open(tmp_path / "two" / "checkpoints" / "4" / "input" / "metadata") as f:
        assert json.load(f) == {"process_count": 2, "positions": [{"batches": 4}, {"batches": 4}]}

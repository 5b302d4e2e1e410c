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


def test_two_processes_each_read_their_own_shard_of_a_grain_corpus(tmp_path):
    """Real files across processes: two processes train on ArrayRecord files through Grain (with its default
    worker process each) and checkpoint the position each reached; each is exactly where that process's shard,
    read in this process, is after the same batches. (Every pipeline's shards are disjoint and cover the split:
    tests/test_data.py.)"""
    from MaxText.data import make_data
    from tests import corpora
    from tests.tiny import args as merged

    corpus = str(tmp_path / "corpus")
    corpora.write("grain", corpus)
    source = [a for a in corpora.config_args("grain", corpus) if not a.startswith("grain_worker_count=")]
    argv = merged(TINY, source, ["vocab_size=259", f"base_output_directory={tmp_path}", "steps=2",
                                 "checkpoint_period=2", "learning_rate_schedule_steps=2", "run_name=two"])
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), "--local", "2",
                             os.path.join(ROOT, "configs", "base.yml"), *argv],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "two" / "checkpoints" / "2" / "input" / "metadata") as f:
        saved = json.load(f)
    cfg = load_config(argv + ["grain_worker_count=0"])
    global_batch = 8 * int(cfg.per_device_batch_size)
    want = []
    for p in range(2):
        it = make_data(cfg, global_batch, p, 2)
        next(it), next(it)
        want.append(it.state())
    assert saved == {"process_count": 2, "positions": want}, saved
    assert want[0] != want[1]

"""Multi-process training for real: two processes on this machine (4 CPU devices each, gloo collectives)
started by scripts/launch.sh --local 2, through jax.distributed, against one process with 8 devices."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
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
    assert "mesh {'data': 1, 'fsdp': 8, 'context': 1, 'expert': 1, 'tensor': 1}" in out, out
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
    tests/test_data.py.) The two are started as upstream MaxText's GPU launch starts them: JAX_COORDINATOR_IP,
    JAX_COORDINATOR_PORT, NNODES and NODE_RANK, one process per node with every device it sees (4 here); the
    test above starts them with scripts/launch.sh's variables."""
    from MaxText.data import make_data
    from tests import corpora
    from tests.tiny import args as merged

    corpus = str(tmp_path / "corpus")
    corpora.write("grain", corpus)
    source = [a for a in corpora.config_args("grain", corpus) if not a.startswith("grain_worker_count=")]
    argv = merged(TINY, source, ["vocab_size=259", f"base_output_directory={tmp_path}", "steps=2",
                                 "checkpoint_period=2", "learning_rate_schedule_steps=2", "run_name=two"])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COORDINATOR_IP="127.0.0.1",
               JAX_COORDINATOR_PORT=str(_free_port()), NNODES="2",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    procs = [subprocess.Popen([sys.executable, "-m", "MaxText.train", *argv], cwd=ROOT, env=dict(env, NODE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "mesh {'data': 1, 'fsdp': 8, 'context': 1, 'expert': 1, 'tensor': 1}" in outs[0], outs[0]
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


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env, needle", [
    ({"JAX_COORDINATOR_IP": "10.0.0.1", "NNODES": "2", "NODE_RANK": "0"}, "JAX_COORDINATOR_PORT unset"),
    ({"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "1234", "NNODES": "2", "NODE_RANK": "2"},
     "NODE_RANK=2 must be in [0, NNODES=2)"),
    ({"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "x", "NNODES": "2", "NODE_RANK": "0"},
     "JAX_COORDINATOR_PORT='x' must be a whole number"),
    ({"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "1234", "NNODES": "2", "NODE_RANK": "0",
      "JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "set one of the two"),
])
def test_inconsistent_launch_variables_stop_in_one_line_before_jax(env, needle):
    from MaxText.parallel.distributed import launch_kwargs
    with pytest.raises(ConfigError, match=re.escape(needle)):
        launch_kwargs(env)
    result = subprocess.run([sys.executable, "-m", "MaxText.train", "steps=1"], cwd=ROOT, capture_output=True,
                            text=True, env=dict(os.environ, **env), timeout=120) if needle.startswith("NODE") else None
    if result is not None:
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and needle in result.stderr, result


def test_launch_variables_read_as_jax_distributed_arguments():
    from MaxText.parallel.distributed import launch_kwargs, process_count
    up = {"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "1234", "NNODES": "4", "NODE_RANK": "3"}
    assert launch_kwargs(up) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    ours = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert launch_kwargs(dict(up, **ours)) == launch_kwargs(up), "both, agreeing, are fine"
    assert process_count(up) == 4 and process_count({"SLURM_NTASKS": "16"}) == 16 and process_count({}) == 1

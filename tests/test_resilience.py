"""Stopping cleanly: a non-finite step is never checkpointed, and SIGTERM checkpoints and exits 0."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from MaxText import checkpointing
from MaxText.config import load_config
from MaxText.state import state_spec
from MaxText.train import NonFiniteError, main, train
from tests.tiny import TINY


def test_non_finite_loss_stops_and_only_finite_states_are_saved(tmp_path, capsys):
    """An absurd learning rate blows the weights up within a few steps: the run stops naming the step, and
    every checkpoint it left holds finite parameters."""
    args = TINY + [f"base_output_directory={tmp_path}", "run_name=nan", "steps=30", "checkpoint_period=1",
                   "learning_rate=1e38", "warmup_steps_fraction=0", "gradient_clipping_threshold=null",
                   "async_checkpointing=false"]
    assert main(args) == 1
    err = capsys.readouterr().err  # tqdm's progress bar, then the error
    err = err[err.index("error: step "):]
    assert "stopping" in err and err.count("\n") == 1, err
    cfg = load_config(args)
    mesh_devices = jax.devices()
    from MaxText import sharding

    spec = state_spec(cfg, sharding.create_mesh(cfg, mesh_devices))
    ckpt = checkpointing.Checkpointer(cfg, os.path.join(tmp_path, "nan", "checkpoints"))
    steps = ckpt.manager.all_steps()
    assert steps, "no checkpoint before the blow-up: raise steps or the learning rate"
    bad_step = int(err.split()[2].rstrip(":"))
    assert max(steps) < bad_step, (steps, bad_step)
    for step in steps:
        params = ckpt.restore(step, spec.abstract)["params"]
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params)), f"checkpoint {step}"
    ckpt.close()
    with pytest.raises(NonFiniteError):  # the library call raises the same error
        train(load_config(args[:-3] + ["run_name=nan2", "learning_rate=1e38", "async_checkpointing=false"]),
              log=lambda *_: None)


def test_sigterm_checkpoints_at_the_next_step_and_exits_0(tmp_path):
    """A scheduler's SIGTERM mid-run: exit 0 with a checkpoint at the step it stopped after; a rerun resumes
    from exactly there."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    args = [sys.executable, "-m", "MaxText.train", *TINY, f"base_output_directory={tmp_path}", "run_name=term",
            "steps=100000", "checkpoint_period=100000", "log_period=1"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "term" / "metrics" / "metrics.jsonl"
    deadline = time.time() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM: stopped after step" in out, out
    stopped = int(out.split("SIGTERM: stopped after step ")[1].split()[0])
    assert sorted(os.listdir(tmp_path / "term" / "checkpoints")) == [str(stopped)], out
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged[-1] == stopped, (logged, stopped)  # every step up to the checkpoint was finished and logged

    cfg = load_config(TINY + [f"base_output_directory={tmp_path}", "run_name=term", f"steps={stopped + 1}",
                              "log_period=1"])
    lines = []
    train(cfg, log=lines.append)
    assert any(f"resuming from {tmp_path}/term/checkpoints/{stopped}" in line for line in lines), lines

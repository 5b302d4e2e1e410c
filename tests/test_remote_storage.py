"""gs:// outputs and checkpoints, against a local GCS emulator (tests/gcs_emulator.py): a run in a bucket trains,
resumes from it and is loaded from it exactly as a local one, and no local "gs:" folder ever appears."""

import json
import os
import uuid

import jax
import numpy as np
import pytest

from MaxText.trainer import checkpointing
from MaxText.parallel import sharding
from MaxText.config import storage
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.step.state import state_spec
from MaxText.trainer.loop import train
from tests.gcs_emulator import BUCKET, emulator
from tests.tiny import TINY, args, losses, train_records

SPLIT = ["log_period=1", "checkpoint_period=2", "learning_rate_schedule_steps=4", "max_num_checkpoints_to_keep=5"]


@pytest.fixture(scope="module")
def bucket():
    """gs://bkt/<unique>: a fresh prefix, so that nothing staged by an earlier session's run of the same URL on
    this host can meet it."""
    with emulator():
        yield f"gs://{BUCKET}/{uuid.uuid4().hex[:8]}"


def remote_records(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (storage.path(run_dir) / storage.METRICS).read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(bucket, tmp_path_factory):
    """The same 4 steps: in one go on local disk, and in a bucket as 2 steps then a rerun to 4 (which resumes
    from the bucket's step-2 checkpoint). Run from an empty working directory."""
    local = tmp_path_factory.mktemp("local")
    cwd = tmp_path_factory.mktemp("cwd")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        whole = train_records(load_config(args(TINY, SPLIT, [f"base_output_directory={local}", "run_name=r",
                                                              "steps=4"])))
        remote = [args(TINY, SPLIT, [f"base_output_directory={bucket}", "run_name=r", f"steps={steps}",
                                     "enable_tensorboard=true"]) for steps in (2, 4)]
        logs = []
        for argv in remote:
            train(load_config(argv), log=logs.append)
    finally:
        os.chdir(before)
    return {"local": f"{local}/r", "remote": f"{bucket}/r", "whole": whole, "cwd": cwd, "logs": logs}


def test_a_run_in_a_bucket_resumes_from_it_with_the_losses_of_an_uninterrupted_local_run(runs):
    records = remote_records(runs["remote"])
    assert [r["step"] for r in records] == [1, 2, 3, 4], "the rerun appends to the bucket's metrics.jsonl"
    np.testing.assert_allclose(losses(records), losses(runs["whole"]), rtol=1e-6)
    assert any(line.startswith(f"resuming from {runs['remote']}/checkpoints/2") for line in runs["logs"]), runs["logs"]

    run = storage.path(runs["remote"])
    for step in (2, 4):  # Orbax's marker of a finished step in a bucket
        assert (run / "checkpoints" / str(step) / "commit_success.txt").exists(), step
    assert (run / "metrics" / "config.yml").exists()
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2, "one events file per run"
    assert os.listdir(runs["cwd"]) == [], "nothing local is made from the URL (no 'gs:' folder)"
    staged = storage.staging_dir(runs["remote"], 0)
    assert os.listdir(staged) == [".lock"], "the staging directory is emptied once everything is in the bucket"


def test_checkpoints_in_a_bucket_load_bit_for_bit(runs):
    """load_parameters_path and load_full_state_path given as gs:// read the same arrays as the local run's."""
    cfg = load_config(TINY)
    abstract = state_spec(cfg, sharding.create_mesh(cfg)).abstract
    remote, _ = checkpointing.load_params(f"{runs['remote']}/checkpoints/4/items", abstract["params"])
    local, _ = checkpointing.load_params(f"{runs['local']}/checkpoints/4/items", abstract["params"])
    jax.tree.map(np.testing.assert_array_equal, remote, local)
    state, position = checkpointing.load_full_state(f"{runs['remote']}/checkpoints/2", abstract)
    assert int(state["step"]) == 2 and position == {"process_count": 1, "positions": [{"batches": 2}]}, position
    with pytest.raises(ConfigError, match=r"load_parameters_path=gs://.*/checkpoints/3 does not exist"):
        checkpointing.load_params(f"{runs['remote']}/checkpoints/3", abstract["params"])


def test_the_report_reads_and_writes_a_run_in_a_bucket(runs):
    from MaxText.trainer.report import write_report

    paths = write_report(runs["remote"], log=lambda *_: None)
    assert paths[0] == f"{runs['remote']}/metrics/loss.png" and len(paths) == 4, paths
    for png in paths:
        assert storage.path(png).read_bytes().startswith(b"\x89PNG"), png


def test_a_bucket_that_cannot_be_written_stops_the_run_in_one_line(bucket, tmp_path, monkeypatch):
    """A missing bucket is a start-up error naming the checkpoint directory, and is not created."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(args(TINY, ["base_output_directory=gs://no-such-bucket/runs", "run_name=r", "steps=1"]))
    with pytest.raises(ConfigError) as error:
        train(cfg, log=lambda *_: None)
    message = str(error.value)
    assert message.startswith("cannot write checkpoints to gs://no-such-bucket/runs/r/checkpoints: ")
    assert "\n" not in message and len(message) < 500, message
    assert not storage.path("gs://no-such-bucket").exists() and os.listdir(tmp_path) == []


def test_what_cannot_reach_a_bucket_says_so_in_one_line(monkeypatch, tmp_path):
    """gs:// without gcsfs names the package; the checkpoint converters read and write local paths only."""
    import importlib.util

    from MaxText.config.checks import remote_path_error
    from MaxText.utils.ckpt_conversion.orbax_io import split_paths

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    assert "needs gcsfs" in remote_path_error("base_output_directory", "gs://b/runs")
    with pytest.raises(ConfigError, match=r"^base_output_directory=gs://b/out is a gs:// URL; the converters read "
                                          r"and write local paths only: mount the bucket \(gcsfuse\)"):
        split_paths(["base_output_directory=gs://b/out"], ("base_output_directory",))

"""One trainer per run directory (MaxText/trainer/run_lock.py), automatic run names that cannot collide, and names
that cannot lead out of their directories."""

import os
import signal
import subprocess
import sys
import time

import pytest

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.trainer.run_lock import RunLock, automatic_run_name
from tests.tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_holder_is_refused_with_the_first_named(tmp_path):
    with RunLock(str(tmp_path / "run")):
        with pytest.raises(ConfigError, match=rf"in use by another trainer \(host .*, pid {os.getpid()}, since ") as e:
            RunLock(str(tmp_path / "run")).__enter__()
        assert "\n" not in str(e.value)
    with RunLock(str(tmp_path / "run")):  # released on exit
        pass


def test_the_os_releases_the_lock_of_a_killed_trainer(tmp_path):
    """SIGKILL leaves no cleanup behind; the lock goes with the process (the lock file stays, harmlessly)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from MaxText.trainer.run_lock import RunLock; "
                               f"RunLock({str(tmp_path)!r}).__enter__(); print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid},"):
            RunLock(str(tmp_path)).__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(str(tmp_path)):
        pass


def test_a_trainer_on_a_locked_run_directory_exits_2_before_writing(tmp_path):
    """`python -m MaxText.train` on a run directory another trainer holds: exit 2, one `error:` line, nothing
    written into the directory (two runs used to interleave metrics and overwrite each other's checkpoints)."""
    run_dir = tmp_path / "shared"
    argv = [*TINY, f"base_output_directory={tmp_path}", "run_name=shared", "steps=2"]
    with RunLock(str(run_dir)):
        done = subprocess.run([sys.executable, "-m", "MaxText.train", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "in use by another trainer" in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert sorted(os.listdir(run_dir)) == [".lock"], os.listdir(run_dir)


def test_automatic_run_names_are_unique_within_a_second():
    names = {automatic_run_name() for _ in range(200)}
    assert len(names) == 200 and all(n.startswith(time.strftime("run_%Y")) for n in names)


@pytest.mark.parametrize("override,message", [
    ("run_name=../elsewhere", "run_name=../elsewhere must be a plain name"),
    ("run_name=a/b", "run_name=a/b must be a plain name"),
    ("run_name=.hidden", "run_name=.hidden must be a plain name"),
    ("run_name=" + "x" * 300, "must be a plain name"),
    ("model_name=../../configs/base", "is not a name under configs/models/"),
    ("model_name=/nowhere/model.yml", "model_name=/nowhere/model.yml: no such file"),
])
def test_names_cannot_leave_their_directories(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config([override])
    assert len(str(e.value)) < 400, "an error line stays short whatever the input"


def test_model_name_takes_an_explicit_yml_path(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("base_emb_dim: 48\nbase_num_query_heads: 4\nbase_num_kv_heads: 2\nhead_dim: 12\n")
    assert load_config([f"model_name={path}"]).base_emb_dim == 48

"""Upstream MaxText's `python -m maxtext.trainers.pre_train.train`:
runs `python -m MaxText.train` with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("MaxText.train", run_name="__main__", alter_sys=True)

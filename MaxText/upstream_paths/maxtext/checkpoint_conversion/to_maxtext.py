"""Upstream MaxText's `python -m maxtext.checkpoint_conversion.to_maxtext`:
runs `python -m MaxText.utils.ckpt_conversion.to_maxtext` with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("MaxText.utils.ckpt_conversion.to_maxtext", run_name="__main__", alter_sys=True)

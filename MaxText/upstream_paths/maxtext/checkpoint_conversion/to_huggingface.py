"""Upstream MaxText's `python -m maxtext.checkpoint_conversion.to_huggingface`:
runs `python -m MaxText.utils.ckpt_conversion.to_huggingface` with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("MaxText.utils.ckpt_conversion.to_huggingface", run_name="__main__", alter_sys=True)

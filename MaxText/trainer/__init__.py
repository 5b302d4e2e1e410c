"""Running: checkpoints (Orbax), metrics and their writers, the profiler, the run lock, the forward
command and the run report. The training loop itself is MaxText/train.py.
"""

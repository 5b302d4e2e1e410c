"""Running: the training loop (loop: set-up, steps, step logging), where a run starts (resume), evaluation,
signals, checkpoints (Orbax), metrics and their writers, the profiler, the run lock, the forward command and the
run report. MaxText/train.py is the command around the loop.
"""

"""The pure step, jittable and free of I/O: the train state created sharded (state), the train and eval
steps (train_step) and the optimizer and its schedule (optimizers).
"""

"""`dataset_type=synthetic`: a token process a model can learn, generated on the fly.

Each sequence follows a fixed random permutation of the vocabulary (the next token is perm[token])
with probability 0.8 and is uniform otherwise, so the best achievable loss is about
H = -0.8 ln 0.8 - 0.2 ln(0.2/V) (1.75 nats at V=512) against ln V (6.24) for a model that knows nothing.
Batch i is a pure function of (data_shuffle_seed, split, i), so the iterator's state is just i: resuming
reads exactly the batches an uninterrupted run would have read. The eval split is a second stream of the
same process (a different seed).
"""

from __future__ import annotations

import numpy as np

from MaxText.data.records import resume_position

FOLLOW_PROBABILITY = 0.8


class SyntheticData:
    """Global batches of `global_batch` sequences; each process materialises only its own rows."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        self.vocab, self.length, self.seed = cfg.vocab_size, cfg.max_target_length, cfg.data_shuffle_seed
        self.stream = 0 if split == "train" else 1
        self.next_index = resume_position(state, ("batches",), "dataset_type=synthetic")["batches"] if state else 0
        self.global_batch = global_batch
        rows = global_batch // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.perm = np.random.default_rng([self.seed, 2**31]).permutation(self.vocab).astype(np.int32)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self.next_index += 1
        return self.batch(self.next_index - 1)

    def state(self) -> dict:
        return {"batches": self.next_index}

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch number `index`."""
        rng = np.random.default_rng([self.seed, index] if self.stream == 0 else [self.seed, index, 1])
        shape = (self.global_batch, self.length + 1)
        follow = rng.random(shape) < FOLLOW_PROBABILITY
        noise = rng.integers(0, self.vocab, shape, dtype=np.int32)
        seq = np.empty(shape, np.int32)
        seq[:, 0] = noise[:, 0]
        for i in range(1, shape[1]):
            seq[:, i] = np.where(follow[:, i], self.perm[seq[:, i - 1]], noise[:, i])
        seq = seq[self.rows]
        b, length = seq.shape[0], self.length
        ones = np.ones((b, length), np.int32)
        return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "inputs_position": np.broadcast_to(
            np.arange(length, dtype=np.int32), (b, length)).copy(), "inputs_segmentation": ones,
            "targets_segmentation": ones.copy()}

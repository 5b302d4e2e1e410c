"""One tiny corpus (TRAIN_DOCS as "train", EVAL_DOCS as "validation") written in each document pipeline's format,
three files per split, and the config that reads it: the shared data tests run every pipeline on the same
documents.

  tfds   a TFDS dataset (maxtext_test_docs, feature "text") prepared in a data dir
  grain  ArrayRecord files <split>-0000i-of-00003.array_record of tf.train.Example records (bytes feature "text")
  hf     Parquet files <split>-0000i-of-00003.parquet (string column "text")
"""

from __future__ import annotations

import os

import numpy as np

from tests.tiny import tiny_config

L = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
PIPELINES = ("tfds", "grain", "hf")
SHARDS = 3


def make_documents(n: int, seed: int) -> list[str]:
    """n distinct documents of 3 to ~80 bytes (most longer than a row of L), one empty, one non-ASCII."""
    rng = np.random.default_rng(seed)
    docs = [f"d{seed}.{i} " + " ".join(rng.choice(WORDS, rng.integers(0, 12))) for i in range(n - 2)]
    return docs + ["", f"héllo wörld ✓ naïve {seed}"]


TRAIN_DOCS, EVAL_DOCS = make_documents(30, 0), make_documents(8, 1)
SPLITS = {"train": TRAIN_DOCS, "validation": EVAL_DOCS}


def shards(docs: list, n: int = SHARDS) -> list[list]:
    """docs cut into n consecutive runs (their concatenation is docs)."""
    cuts = np.linspace(0, len(docs), n + 1).astype(int)
    return [docs[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def example_bytes(value, column: str = "text") -> bytes:
    """A serialized tf.train.Example with `column` = value: UTF-8 text (str) or token ids (ints)."""
    import tensorflow as tf

    if isinstance(value, str):
        feature = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode("utf-8")]))
    else:
        feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in value]))
    return tf.train.Example(features=tf.train.Features(feature={column: feature})).SerializeToString()


def write_array_record(path: str, records: list[bytes]) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()


def write_parquet(path: str, values: list, column: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: values}), path)


def shard_paths(root: str, split: str, suffix: str, n: int = SHARDS) -> list[str]:
    return [os.path.join(root, f"{split}-{i:05d}-of-{n:05d}.{suffix}") for i in range(n)]


def write(kind: str, root: str, column: str = "text") -> None:
    """SPLITS in `kind`'s format under root (column: the feature name, grain and hf)."""
    os.makedirs(root, exist_ok=True)
    if kind == "tfds":
        from MaxText.data import tfds_data

        # Three files per split, so that file shuffling and interleaving are part of every test.
        tfds_data.prepare_documents("MaxtextTestDocs", SPLITS, root, SHARDS)
        return
    for split, docs in SPLITS.items():
        for path, part in zip(shard_paths(root, split, "array_record" if kind == "grain" else "parquet"),
                              shards(docs)):
            if kind == "grain":
                write_array_record(path, [example_bytes(d, column) for d in part])
            else:
                write_parquet(path, part, column)


def config_args(kind: str, root: str) -> list[str]:
    """The key=value arguments that read the corpus written by write(kind, root)."""
    common = ["vocab_size=259", f"max_target_length={L}"]
    if kind == "tfds":
        return ["dataset_type=tfds", "dataset_name=maxtext_test_docs", f"dataset_path={root}", *common]
    if kind == "grain":
        return ["dataset_type=grain", f"grain_train_files={root}/train-*.array_record",
                f"grain_eval_files={root}/validation-*.array_record", "grain_worker_count=0",
                "grain_worker_count_eval=0", *common]
    return ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={root}/train-*.parquet",
            f"hf_eval_files={root}/validation-*.parquet", *common]


class Corpus:
    """SPLITS written for one pipeline: config(*overrides) reads them."""

    def __init__(self, kind: str, root: str):
        self.kind, self.root = kind, root
        write(kind, root)

    def config(self, *overrides):
        return tiny_config(*config_args(self.kind, self.root), *overrides)

    def __repr__(self):
        return f"Corpus({self.kind})"

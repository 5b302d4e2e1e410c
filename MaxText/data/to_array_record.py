"""Moves a corpus once into the ArrayRecord files that `dataset_type=grain` reads.

    python -m MaxText.data.to_array_record <source> <out_dir> [--split train] [--column text]
        [--tokenizer_path P] [--records_per_shard N] [--data_dir D] [--overwrite]

<source> is a TFDS dataset name (name[/config][:version], prepared in --data_dir, default the tfds pipeline's
data dir; never downloaded) or a Parquet glob (several: comma-separated; it must end in .parquet or hold a
glob character). The documents of --split (TFDS: the split read; both: the files' name prefix, without any
[...] slice) are written in the source's order as `<out_dir>/<split>-00000-of-000NN.array_record`, each record
a tf.train.Example whose feature --column holds the document: the text as bytes, or with --tokenizer_path its
token ids as int64 (no BOS/EOS: the packer adds them), so that training skips tokenizing. A document that is
already token ids stays so.

Shards are written under `<name>.partial` and renamed once all of them are complete: a crash never leaves a
file that the grain pipeline would take for a shard, nor part of the split under the final names. out_dir
must not already hold files of the split (--overwrite deletes them, once the source has opened); other
splits may share it. User errors print one line `error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

import numpy as np

from MaxText.config.errors import ConfigError, error_line
from MaxText.data.records import glob_files
from MaxText.config.storage import check_output, shown_path

SHARD_NAME = "{split}-{index:05d}-of-{count:05d}.array_record"
PARTIAL = ".partial"  # suffix of a shard being written


class UserError(Exception):
    """A mistake in the command line or its source: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ sources


def is_parquet(source: str) -> bool:
    """A Parquet glob ends in .parquet or holds a glob character; TFDS names do neither."""
    return any(p.strip().endswith(".parquet") or set("*?[") & set(p) for p in source.split(","))


def parquet_files(source: str) -> list[str]:
    """The sorted, deduplicated files of the comma-separated globs; UserError for a glob matching none."""
    paths, unmatched = glob_files(source)
    if unmatched or not paths:
        raise UserError(f"no file matches {shown_path(unmatched or source)}")
    return paths


def parquet_source(source: str, column: str) -> tuple[int, object]:
    """(number of documents, an iterator over them) of the Parquet files' `column`."""
    import pyarrow.parquet as pq

    files = []
    for path in parquet_files(source):
        try:
            file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a file that is not Parquet
            raise UserError(f"{shown_path(path)} is not a readable Parquet file ({type(e).__name__})") from None
        if column not in file.schema_arrow.names:
            raise UserError(f"{shown_path(path)} has no column {shown_path(repr(column))} (it has "
                            f"{shown_path(', '.join(file.schema_arrow.names))}); "
                            f"name the document column with --column")
        files.append(file)

    def documents():
        for file in files:
            for batch in file.iter_batches(columns=[column], batch_size=1024):
                yield from batch.column(0).to_pylist()

    return sum(f.metadata.num_rows for f in files), documents()


def tfds_source(name: str, split: str, column: str, data_dir: str | None) -> tuple[int, object]:
    """(number of documents, an iterator over them) of a prepared TFDS split's feature `column`, in the split's
    order. Nothing is downloaded."""
    import ml_collections

    from MaxText.data import python_stdlib, tfds_data  # first: tfds_data quiets TensorFlow's C++ log lines

    import tensorflow_datasets as tfds

    try:
        builder = tfds_data.open_builder(ml_collections.ConfigDict({"dataset_name": name, "dataset_path": data_dir}))
    except ConfigError as e:  # the trainer's own check, whose message names its keys (dataset_path: --data_dir)
        raise UserError(f"{shown_path(name)} is neither a Parquet glob nor a TFDS dataset prepared here ({e}); check "
                        "the name or --data_dir") from None
    if column not in builder.info.features:
        raise UserError(f"TFDS dataset {shown_path(name)} has no feature {shown_path(repr(column))} (it has "
                        f"{', '.join(builder.info.features)}); name the document feature with --column")
    try:
        count = builder.info.splits[split].num_examples
    except (KeyError, ValueError):
        raise UserError(f"TFDS dataset {shown_path(name)} has no split {shown_path(split)} (it has "
                        f"{', '.join(builder.info.splits)}); set --split") from None
    with python_stdlib.quiet_tfds():
        ds = builder.as_dataset(split=split, shuffle_files=False,
                                decoders=tfds.decode.PartialDecoding({column: True}))
    return count, (example[column] for example in ds.as_numpy_iterator())


# ------------------------------------------------------------------------------------------ records


def load_text_tokenizer(path: str):
    """The tokenizer of a tokenizer file (tokenizer.load_tokenizer's formats and checks, no BOS/EOS needed)."""
    # here, not at the top: the tokenizer libraries and Grain (optional, heavy) load only for the inputs that need them
    import ml_collections

    from MaxText.data.tokenizer import load_tokenizer

    settings = ml_collections.ConfigDict({"tokenizer_path": path, "vocab_size": 2**31 - 1, "add_bos": False,
                                          "add_eos": False})
    try:
        return load_tokenizer(settings)
    except ConfigError as e:
        raise UserError(str(e).replace("tokenizer_path=", "--tokenizer_path ", 1)) from None


def example_bytes(document, column: str, tokenizer) -> bytes:
    """One record: a tf.train.Example with `column` as the text's UTF-8 bytes, or as int64 token ids (with a
    tokenizer, or when the document already is ids)."""
    # here, not at the top: the tokenizer libraries and Grain (optional, heavy) load only for the inputs that need them
    from MaxText.data.grain_data import Example

    example = Example()
    feature = example.features.feature[column]
    if document is None:  # a null in a Parquet column: an empty document, skipped by the packer
        document = b""
    if isinstance(document, str):
        document = document.encode("utf-8")
    if isinstance(document, bytes) and tokenizer is None:
        feature.bytes_list.value.append(document)
    else:
        if isinstance(document, bytes):
            document = tokenizer.encode(document.decode("utf-8", errors="replace"))
        feature.int64_list.value.extend(np.asarray(document, np.int64).tolist())
    return example.SerializeToString(deterministic=True)


# ------------------------------------------------------------------------------------------ writing


def split_files(out_dir: str, prefix: str) -> list[str]:
    """The files of this split already in out_dir: shards, complete or partial."""
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), f"{glob.escape(prefix)}-*")))


def write_shards(documents, count: int, out_dir: str, prefix: str, column: str, tokenizer,
                 records_per_shard: int) -> list[str]:
    """Writes `count` documents as ceil(count / records_per_shard) shards; returns their paths."""
    from array_record.python.array_record_module import ArrayRecordWriter

    shards = max(1, math.ceil(count / records_per_shard))
    paths, documents = [], iter(documents)
    for index in range(shards):
        path = os.path.join(out_dir, SHARD_NAME.format(split=prefix, index=index, count=shards))
        # group_size:1: each record its own chunk, what Grain's random access by index wants.
        writer = ArrayRecordWriter(path + PARTIAL, "group_size:1")
        if not writer.ok():
            raise UserError(f"cannot write {shown_path(path + PARTIAL)}")
        for _ in range(records_per_shard if index + 1 < shards else count - index * records_per_shard):
            document = next(documents, StopIteration)
            if document is StopIteration:
                raise UserError(f"the source ended after {index * records_per_shard} documents although it "
                                f"announced {count}")
            writer.write(example_bytes(document, column, tokenizer))
        writer.close()
        paths.append(path)
    for path in paths:  # only now that every shard is whole: a glob never matches part of an interrupted run
        os.replace(path + PARTIAL, path)
    return paths


def convert(args) -> str:
    """Runs one conversion; returns the summary to print."""
    prefix = args.split.split("[")[0]
    check_output("out_dir", args.out_dir)  # before any work: a file, beneath one, unwritable, too long
    existing = split_files(args.out_dir, prefix) if os.path.isdir(args.out_dir) else []
    if existing and not args.overwrite:
        raise UserError(f"{shown_path(args.out_dir)} already holds {len(existing)} file(s) of split {prefix} "
                        f"({os.path.basename(existing[0])}, ...); choose another out_dir or pass --overwrite")
    if args.records_per_shard < 1:
        raise UserError(f"--records_per_shard {args.records_per_shard}: must be at least 1")
    tokenizer = load_text_tokenizer(args.tokenizer_path) if args.tokenizer_path else None
    if is_parquet(args.source):
        count, documents = parquet_source(args.source, args.column)
    else:
        count, documents = tfds_source(args.source, args.split, args.column, args.data_dir)
    if count == 0:
        raise UserError(f"{shown_path(args.source)} holds no documents in split {shown_path(args.split)}")
    for path in existing:  # only once the source has opened: a failed run leaves the old files alone
        os.remove(path)
    os.makedirs(args.out_dir, exist_ok=True)
    paths = write_shards(documents, count, args.out_dir, prefix, args.column, tokenizer, args.records_per_shard)
    size = sum(os.path.getsize(p) for p in paths)
    use = ["dataset_type=grain", f"{'grain_train_files' if prefix == 'train' else 'grain_eval_files'}="
           f"{os.path.join(args.out_dir, prefix)}-*.array_record"]
    if args.column != "text":
        use.append(f"{'train' if prefix == 'train' else 'eval'}_data_columns=[{args.column}]")
    if tokenizer:
        use.append(f"tokenizer_path={args.tokenizer_path}")
    kind = f"token ids of {args.tokenizer_path}" if tokenizer else "text"
    shards = f"{len(paths)} shard{'s' * (len(paths) != 1)}"
    return f"wrote {count} records ({kind}) in {shards}, {size} bytes, to {args.out_dir}\nuse: {' '.join(use)}"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m MaxText.data.to_array_record",
                                description="Writes a TFDS split or Parquet files as ArrayRecord shards for "
                                            "dataset_type=grain.")
    p.add_argument("source", help="a TFDS dataset name (prepared in --data_dir) or a Parquet glob")
    p.add_argument("out_dir", help="the directory the shards are written to")
    p.add_argument("--split", default="train", help="TFDS split read; both: the shards' name prefix")
    p.add_argument("--column", default="text", help="the feature or column holding each document (also the "
                                                    "feature written)")
    p.add_argument("--tokenizer_path", default=None, help="pre-tokenize with this SentencePiece .model or "
                                                          "tokenizer.json: records hold int64 token ids")
    p.add_argument("--records_per_shard", type=int, default=100_000, help="records per ArrayRecord file")
    p.add_argument("--data_dir", default=None, help="TFDS data dir (default: the tfds pipeline's)")
    p.add_argument("--overwrite", action="store_true", help="delete the split's files already in out_dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        print(convert(args))
    except (UserError, ConfigError) as e:  # ConfigError: storage.check_output's
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

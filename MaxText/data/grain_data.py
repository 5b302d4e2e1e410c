"""`dataset_type=grain`: ArrayRecord files read through Grain, tokenized and packed into full rows.

Reading. `grain_train_files` (eval: `grain_eval_files`) is a glob, or several comma-separated; the matching
files, sorted and deduplicated, are one sequence of records numbered across them. Each record is a serialized
tf.train.Example whose feature train_data_columns (eval: eval_data_columns; one name) holds the document: a
bytes_list of one UTF-8 text (tokenized by tokenizer_path) or an int64_list of token ids already tokenized
(checked against vocab_size). `python -m MaxText.data.to_array_record` writes such files from a TFDS dataset
or Parquet files. Local paths only; nothing is downloaded.

Sharding. Process p of n owns records p, p + n, p + 2n, ... (Grain slicing): the processes' shards are
disjoint and together hold every record once.

Order. Epoch e reads this process's shard in a permutation seeded by epoch_seed(data_shuffle_seed, e, p)
(Grain's index_shuffle: a position maps to its record without building the permutation). The eval stream
reads its shard once in the order of epoch EVAL_EPOCH.

Workers. With grain_worker_count > 0 (eval: grain_worker_count_eval) that many child processes read, parse
and tokenize (Grain's mp_prefetch, round-robin over the positions: the same batches for any worker count);
the training process only packs. 0 does it all in the training process. The train stream is one Grain
pipeline across epochs, so workers start once per iterator, not once per epoch.

Resuming at state {"epoch": e, "document": d, ...} starts the pipeline at position d of epoch e's order
without reading the positions before it: a resume near the end of an epoch costs what one at its start does.

Packing, the eval stream's padding and the state: MaxText/data/packing.py.
"""

from __future__ import annotations

import sys

import grain
import numpy as np
from absl import flags
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from MaxText.config.errors import ConfigError
from MaxText.data.records import glob_files, text_column
from MaxText.data.packing import PackedDocuments, epoch_seed
from MaxText.data.tokenizer import load_tokenizer

# Grain's threads reading and tokenizing in each worker (or in the training process with 0 workers), and the
# documents each may read ahead.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=256)
SMALL_ARRAYS_COPIED = grain.experimental.DatasetOptions(min_shm_size=1 << 20)  # bytes
FILES_KEY = {"train": "grain_train_files", "eval": "grain_eval_files"}


def example_class():
    """tf.train.Example (the fields of tensorflow/core/example/{example,feature}.proto, wire-compatible) built
    in a private descriptor pool: Grain's worker processes parse records without importing TensorFlow, which
    would cost each of them seconds."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="maxtext_moe/tf_example.proto", package="tensorflow",
                                              syntax="proto3")

    def message(name, *fields, parent=file):
        msg = (parent.message_type if parent is file else parent.nested_type).add(name=name)
        for field_name, number, kind, type_name, label in fields:
            field = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".tensorflow.{type_name}"
        return msg

    one, many = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("BytesList", ("value", 1, F.TYPE_BYTES, None, many))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, None, many))
    message("Int64List", ("value", 1, F.TYPE_INT64, None, many))
    feature = message("Feature", ("bytes_list", 1, F.TYPE_MESSAGE, "BytesList", one),
                      ("float_list", 2, F.TYPE_MESSAGE, "FloatList", one),
                      ("int64_list", 3, F.TYPE_MESSAGE, "Int64List", one))
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, "Features.FeatureEntry", many))
    entry = message("FeatureEntry", ("key", 1, F.TYPE_STRING, None, one),
                    ("value", 2, F.TYPE_MESSAGE, "Feature", one), parent=features)
    entry.options.map_entry = True
    message("Example", ("features", 1, F.TYPE_MESSAGE, "Features", one))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


Example = example_class()


def document_of(record: bytes, column: str):
    """The document in one record: UTF-8 bytes (a text) or an int64 array (token ids). ValueError when the
    record has no such feature, or one of another kind."""
    feature = Example.FromString(record).features.feature
    if column not in feature:
        raise ValueError(f"a record has no feature {column!r} (it has {', '.join(sorted(feature)) or 'none'})")
    kind = feature[column].WhichOneof("kind")
    if kind == "int64_list":
        return np.array(feature[column].int64_list.value, np.int64)
    texts = feature[column].bytes_list.value
    if kind not in ("bytes_list", None) or len(texts) > 1:
        raise ValueError(f"feature {column!r} of a record holds {len(texts) or 'a float_list of'} values; one text "
                         f"(bytes) or token ids (int64) are expected")
    return texts[0] if texts else b""


class Tokenize(grain.transforms.Map):
    """Record (a serialized tf.train.Example) -> its document's tokens, int32 for a text and int64 as stored
    for token ids (PackedDocuments checks those against vocab_size). Runs in Grain's workers: the tokenizer
    travels to them pickled."""

    def __init__(self, column: str, tokenizer):
        self.column, self.tokenizer = column, tokenizer

    def map(self, record: bytes) -> np.ndarray:
        document = document_of(record, self.column)  # its ValueError reaches PackedDocuments: a DataError there
        if isinstance(document, bytes):
            return self.tokenizer.encode(document.decode("utf-8", errors="replace"))
        return document


class EpochOrder(grain.MapDataset):
    """Element k: position k % n of epoch first_epoch + k // n in this process's shard (n records), each epoch
    shuffled by epoch_seed(seed, epoch, process_index). Element k costs one index_shuffle, whatever k is."""

    def __init__(self, shard: grain.MapDataset, first_epoch: int, seed: int, process_index: int, length: int):
        super().__init__(shard)
        self.first_epoch, self.seed, self.process_index, self.length = first_epoch, seed, process_index, length

    def __len__(self) -> int:
        return self.length

    def __str__(self) -> str:
        return f"EpochOrder(first_epoch={self.first_epoch})"

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.slice(k)
        n = len(self._parent)
        epoch, position = divmod(k, n)
        seed = epoch_seed(self.seed, self.first_epoch + epoch, self.process_index)
        return self._parent[grain.experimental.index_shuffle(position, max_index=n - 1, seed=seed, rounds=4)]


def matching_files(cfg, key: str) -> list[str]:
    """The sorted, deduplicated files of cfg[key]'s comma-separated globs; ConfigError for a glob matching none."""
    paths, unmatched = glob_files(cfg[key])
    if unmatched or not paths:
        raise ConfigError(f"{key}={cfg[key]}: no file matches {unmatched or cfg[key]!r}; point it at ArrayRecord "
                          f"files (python -m MaxText.data.to_array_record writes them)")
    return paths


def open_file(key: str, path: str):
    """An open ArrayRecordReader of one file of cfg[key]; ConfigError (naming key and file) for a file that is
    not ArrayRecord or holds no records."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(path, "readahead_buffer_size:0")
    if not reader.ok():  # ArrayRecordReader does not raise on a missing or foreign file; it reads 0 records
        raise ConfigError(f"{key}: {path} is not a readable ArrayRecord file; rewrite it with python -m "
                          f"MaxText.data.to_array_record or remove it from {key}")
    if reader.num_records() == 0:
        reader.close()
        raise ConfigError(f"{key}: {path} holds no records; remove the empty shard from {key}")
    return reader


def check_record(cfg, split: str, path: str, record: bytes) -> None:
    """ConfigError unless the record is a tf.train.Example holding the split's column (text_column) as a text or
    as token ids below vocab_size."""
    key, column_key = FILES_KEY[split], f"{split}_data_columns"
    column = text_column(cfg, split)
    try:
        features = Example.FromString(record).features.feature
    except DecodeError:
        raise ConfigError(f"{key}: the records of {path} are not tf.train.Example protos; write the files with "
                          f"python -m MaxText.data.to_array_record") from None
    if column not in features or features[column].WhichOneof("kind") not in ("bytes_list", "int64_list"):
        have = ", ".join(f"{k} ({v.WhichOneof('kind') or 'empty'})" for k, v in sorted(features.items()))
        raise ConfigError(f"{column_key}=[{column}]: the first record of {path} has no text (bytes) or token-id "
                          f"(int64) feature {column!r}; it has {have or 'no features'}; set {column_key} to the "
                          f"feature that holds the document")
    ids = features[column].int64_list.value
    if ids and max(ids) >= cfg.vocab_size:
        raise ConfigError(f"{key}: {path} holds token id {max(ids)} >= vocab_size={cfg.vocab_size}: it was "
                          f"pre-tokenized for another vocabulary; convert it again with tokenizer_path="
                          f"{cfg.tokenizer_path}, or set tokenizer_path and vocab_size to the ones it was made with")


def check_file_type(cfg) -> None:
    """ConfigError unless grain_file_type is arrayrecord (the one format read here)."""
    if cfg.grain_file_type != "arrayrecord":
        raise ConfigError(f"grain_file_type={cfg.grain_file_type}: dataset_type=grain reads ArrayRecord files only; "
                          f"for Parquet use dataset_type=hf hf_path=parquet hf_train_files=<glob>, or convert once "
                          f"with python -m MaxText.data.to_array_record")


def check_files(cfg, split: str) -> None:
    """The split's files key is set and its files are non-empty ArrayRecord files whose first records pass
    check_record."""
    key = FILES_KEY[split]
    if cfg[key] is None:
        raise ConfigError(f"{key} is not set: evaluation (eval_interval={cfg.eval_interval}) reads those files; "
                          f"set {key} to their glob, or eval_interval=-1")
    for path in matching_files(cfg, key):
        reader = open_file(key, path)
        record = reader.read([0])[0]
        reader.close()
        check_record(cfg, split, path, record)


def validate(cfg) -> None:
    """Tokenizer, file type and files are there and readable (ConfigError naming key and file otherwise); the
    eval files are checked only when evaluation is on."""
    load_tokenizer(cfg)
    check_file_type(cfg)
    check_files(cfg, "train")
    if cfg.eval_interval != -1:
        check_files(cfg, "eval")


class GrainData(PackedDocuments):
    """The grain pipeline: PackedDocuments over this process's shard of ArrayRecord files."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        super().__init__(cfg, global_batch, process_index, process_count, split=split, state=state)
        check_file_type(cfg)
        self.key = FILES_KEY[split]
        if cfg[self.key] is None:
            raise ConfigError(f"{self.key} is not set: dataset_type=grain reads the {split} documents from "
                              f"ArrayRecord files; set it to their glob")
        self.pattern, self.paths = cfg[self.key], matching_files(cfg, self.key)
        self.ends = []  # each file's first record number after it, counted across the files
        for path in self.paths:
            reader = open_file(self.key, path)
            self.ends.append((self.ends[-1] if self.ends else 0) + reader.num_records())
            reader.close()
        source = grain.sources.ArrayRecordDataSource(self.paths)
        self.shard = grain.MapDataset.source(source)[process_index::process_count]
        self.tokenize = Tokenize(text_column(cfg, split), self.tokenizer)
        self.workers = cfg.grain_worker_count if self.train else cfg.grain_worker_count_eval
        self.stream, self.stream_at = None, None  # the open pipeline and the (epoch, position) it reads next

    def source_name(self) -> str:
        return f"{self.key}={self.pattern} ({len(self.paths)} files)"

    @property
    def files_key(self) -> str:
        return self.key

    def locate(self, epoch: int, document: int) -> str:
        """The file and record of document `document` of epoch `epoch`'s order (EpochOrder's map, then the
        shard's slicing and the files' record counts)."""
        import bisect

        n, seed = len(self.shard), epoch_seed(self.seed, self.order_epoch(epoch), self.process_index)
        index = self.process_index + self.process_count * grain.experimental.index_shuffle(
            document % n, max_index=n - 1, seed=seed, rounds=4)
        f = bisect.bisect_right(self.ends, index)
        return f"{self.paths[f]}, record {index - (self.ends[f - 1] if f else 0)}"

    def where(self) -> str:
        return f"{self.key}: {self.locate(self.epoch, self.document)}"

    def epoch_records(self, epoch: int, skip: int = 0):
        """The tokens of this process's documents in epoch `epoch`'s order, from position `skip` on. Reads
        on from the open pipeline when it is at (epoch, skip), as it is when the previous epoch ended."""
        n = len(self.shard)
        for position in range(skip, n):
            if self.stream_at != (epoch, position):
                self.open(epoch, position)
            tokens = next(self.stream)
            self.stream_at = (epoch, position + 1) if position + 1 < n else (epoch + 1, 0)
            yield tokens

    def open(self, epoch: int, position: int) -> None:
        """A pipeline from position `position` of epoch `epoch` on: epoch after epoch in training, to the end of
        the epoch in eval. Starting at a later position reads nothing before it."""
        self.close()
        length = sys.maxsize if self.train else len(self.shard)
        order = EpochOrder(self.shard, epoch, self.seed, self.process_index, length)
        dataset = order[position:].map(self.tokenize).to_iter_dataset(READ_OPTIONS)
        if self.workers > 0:
            if not flags.FLAGS.is_parsed():
                # Grain 0.2.18 reads an absl flag when it starts workers, which raises unless the program parsed
                # its flags (google/grain#1355); the trainer has its own command line, so the defaults stand.
                flags.FLAGS.mark_as_parsed()
            # Documents are small: pickled through the worker's queue they cost less than a shared-memory block
            # each, and nothing is left in /dev/shm when an iterator is dropped with documents in flight.
            dataset = grain.experimental.WithOptionsIterDataset(dataset, SMALL_ARRAYS_COPIED)
            dataset = dataset.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=self.workers))
        self.stream, self.stream_at = iter(dataset), (epoch, position)

    def close(self) -> None:
        """Stops the open pipeline (and its worker processes)."""
        if self.stream is not None and hasattr(self.stream, "close"):
            self.stream.close()
        self.stream, self.stream_at = None, None

"""`dataset_type=tfds`: a prepared TensorFlow Datasets dataset, tokenized and packed into full rows.

Reading. The data dir is `dataset_path`, or default_data_dir(). Nothing is downloaded at run time: a dataset
must already be prepared there, except `python_stdlib` (MaxText/data/python_stdlib.py), which is built from
local files the first time. Each process reads only its own part of the split, tfds.even_splits(split,
process_count)[process_index], and only the "text" feature of each record.

Order. The train stream is endless, epoch after epoch. Epoch e reads this process's part with its files
shuffled and then a SHUFFLE_BUFFER-document shuffle buffer, both seeded by (data_shuffle_seed, e,
process_index), under tf.data's deterministic options: the same seed gives the same batches, run after run.
The eval stream reads its split once, in one fixed shuffled order (seeded as epoch EVAL_EPOCH), so that
eval_steps batches sample the whole split and are the same every time, and then returns all-padding
batches (tokens 0, segment 0) so that every process can run the same number of eval steps.

Packing. A document of tokens t becomes the sequence s = [BOS] + t + [EOS] (BOS only with add_bos, EOS only
with add_eos) and the (input, target) pairs (s[i], s[i+1]): with both, inputs = [BOS] + t and targets =
t + [EOS]; without BOS the first token is never a target; without EOS the last token is never an input.
Documents with no tokens (or no pair) are skipped. The pairs of consecutive documents fill rows of exactly
max_target_length; a document longer than the rest of a row continues at the start of the next row. Within a
row the pieces are segments 1, 2, 3...: inputs_segmentation = targets_segmentation = the piece's number and
inputs_position counts 0, 1, ... from the start of each piece (a piece continued from the previous row starts
again at 0). Nothing is padded or dropped in training.

Resuming. state() = {"epoch": e, "document": d, "offset": k}: the next pair is pair k of document d (its
index in epoch e's order, empty documents counted) of epoch e, for this process. An iterator made with that
state rebuilds epoch e's order and skips d records at the tf.data level before anything is tokenized, so
resuming costs reading (not tokenizing) the skipped records of the current epoch.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is first imported: no C++ INFO lines

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from MaxText.config import ConfigError  # noqa: E402
from MaxText.data import BATCH_KEYS, python_stdlib  # noqa: E402  (python_stdlib registers its builder)
from MaxText.data.tokenizer import load_tokenizer  # noqa: E402

try:
    tf.config.set_visible_devices([], "GPU")  # the accelerators belong to JAX; TF only reads files
except RuntimeError:  # TF already initialised its devices elsewhere in this process
    pass

SHUFFLE_BUFFER = 1024  # documents; on top of the shuffled file order
EVAL_EPOCH = 2**31 - 1  # the "epoch" whose order the eval stream reads
KEYS = BATCH_KEYS


def default_data_dir() -> str:
    """$XDG_CACHE_HOME (or ~/.cache) /maxtext_moe/tensorflow_datasets."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "maxtext_moe", "tensorflow_datasets")


def data_dir(cfg) -> str:
    """cfg.dataset_path, or default_data_dir()."""
    return cfg.dataset_path or default_data_dir()


def open_builder(cfg) -> tfds.core.DatasetBuilder:
    """The prepared builder of cfg.dataset_name in data_dir(cfg) (python_stdlib: built when missing), with a
    "text" feature. Never touches the network."""
    name, root = cfg.dataset_name, data_dir(cfg)
    fix = (f"nothing is downloaded at run time; prepare it with `tfds build {name} --data_dir {root}` on a "
           f"machine with network, or set dataset_path to the data dir that holds it")
    if name == "python_stdlib":
        builder = python_stdlib.build(root)
    else:
        try:
            with python_stdlib.quiet_tfds():
                builder = tfds.builder(name, data_dir=root, try_gcs=False)
                prepared = builder.is_prepared()
        except tfds.core.registered.DatasetNotFoundError:
            raise ConfigError(f"dataset_name={name}: TFDS has no such dataset and none is prepared in dataset_path "
                              f"{root}; check the name ({fix})") from None
        except (ValueError, AssertionError) as e:  # an unknown config or version in name/config:version
            reason = (str(e).splitlines() or [type(e).__name__])[0].rstrip(" :")
            raise ConfigError(f"dataset_name={name} in dataset_path {root}: {reason[:300]}") from None
        if not prepared:
            raise ConfigError(f"dataset_name={name} is not prepared in dataset_path {root}; {fix}")
    if "text" not in builder.info.features:
        raise ConfigError(f"dataset_name={name} has no 'text' feature (it has {', '.join(builder.info.features)}); "
                          f"use a text dataset")
    return builder


def check_split(cfg, builder, key: str) -> None:
    """ConfigError unless cfg[key] (train_split or eval_split) names a split of the builder."""
    try:
        builder.info.splits[cfg[key]]
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={cfg[key]}: dataset {cfg.dataset_name} has splits {', '.join(builder.info.splits)}; "
                          f"set {key} to one of them (TFDS slicing such as train[:90%] works too)") from None


def validate(cfg) -> None:
    """Tokenizer, dataset and splits are there (ConfigError naming key and path otherwise); python_stdlib is
    built when missing. The eval split is checked only when evaluation is on."""
    load_tokenizer(cfg)
    builder = open_builder(cfg)
    check_split(cfg, builder, "train_split")
    if cfg.eval_interval != -1:
        check_split(cfg, builder, "eval_split")


def epoch_seed(seed: int, epoch: int, process_index: int) -> int:
    """The shuffle seed of one epoch of one process."""
    return int(np.random.SeedSequence([seed % 2**32, epoch, process_index]).generate_state(1)[0])


class TfdsData:
    """This process's rows of each global batch: dicts of [global_batch // process_count, max_target_length]
    int32 arrays (see the module docstring for order, packing and state). `state=` resumes the eval stream in
    the same way, though a fresh eval iterator is what gives the same eval batches every time."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
        self.tokenizer = load_tokenizer(cfg)
        self.builder = open_builder(cfg)
        self.train = split == "train"
        key = "train_split" if self.train else "eval_split"
        check_split(cfg, self.builder, key)
        self.split = tfds.even_splits(cfg[key], n=process_count)[process_index]
        self.rows, self.length = global_batch // process_count, cfg.max_target_length
        self.seed, self.process_index = cfg.data_shuffle_seed, process_index
        self.bos = [self.tokenizer.bos_id] if cfg.add_bos else []
        self.eos = [self.tokenizer.eos_id] if cfg.add_eos else []
        state = state or {"epoch": 0, "document": 0, "offset": 0}
        self.epoch, self.document, self.offset = int(state["epoch"]), int(state["document"]), int(state["offset"])
        self.pairs = None  # (inputs, targets) of document self.document once read
        self.records = None  # this epoch's texts, positioned after self.document (or at it while pairs is None)
        self.opened_at, self.found_in_epoch, self.exhausted = 0, False, False

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = {k: np.zeros((self.rows, self.length), np.int32) for k in KEYS}
        for r in range(self.rows):
            self.fill_row(*(batch[k][r] for k in KEYS[:4]))
        batch["targets_segmentation"][:] = batch["inputs_segmentation"]
        return batch

    def state(self) -> dict:
        """Where the next batch starts, for this process (JSON-able)."""
        return {"epoch": self.epoch, "document": self.document, "offset": self.offset}

    def fill_row(self, inputs_L, targets_L, position_L, segment_L) -> None:
        """Writes the next max_target_length pairs into the (zeroed) row arrays; at the end of the eval split
        the rest stays padding."""
        filled, segment = 0, 0
        while filled < self.length and (pairs := self.current_pairs()) is not None:
            n = min(self.length - filled, len(pairs[0]) - self.offset)
            segment += 1
            inputs_L[filled:filled + n] = pairs[0][self.offset:self.offset + n]
            targets_L[filled:filled + n] = pairs[1][self.offset:self.offset + n]
            position_L[filled:filled + n] = np.arange(n)
            segment_L[filled:filled + n] = segment
            filled, self.offset = filled + n, self.offset + n
            if self.offset == len(pairs[0]):
                self.pairs, self.document, self.offset = None, self.document + 1, 0

    def current_pairs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (inputs, targets) of the document being emitted, reading on past empty documents and (train)
        into the next epoch; None once the eval split is used up."""
        while self.pairs is None and not self.exhausted:
            if self.records is None:
                self.records = self.epoch_texts(self.epoch, skip=self.document)
                self.opened_at, self.found_in_epoch = self.document, False
            text = next(self.records, None)
            if text is None:
                self.records = None
                if not self.train:
                    self.exhausted = True
                elif self.opened_at == 0 and not self.found_in_epoch:
                    raise ValueError(f"split {self.split} of dataset {self.builder.info.full_name} has no document "
                                     f"with tokens for process {self.process_index}")
                else:
                    self.epoch, self.document = self.epoch + 1, 0
            elif (pairs := self.document_pairs(text)) is None:
                self.document += 1
            else:
                self.pairs, self.found_in_epoch = pairs, True
        return self.pairs

    def document_pairs(self, text: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """(inputs, targets) of one document: [BOS] + tokens + [EOS] shifted by one; None when empty."""
        tokens = self.tokenizer.encode(text.decode("utf-8", errors="replace"))
        if len(tokens) == 0:
            return None
        seq = np.concatenate([np.asarray(self.bos, np.int32), tokens, np.asarray(self.eos, np.int32)])
        return (seq[:-1], seq[1:]) if len(seq) > 1 else None

    def epoch_texts(self, epoch: int, skip: int = 0):
        """An iterator over the texts (bytes) of this process's documents in epoch `epoch`'s order, from
        document number `skip` on."""
        # Eval reads the same sample every time: a fixed order, drawn once with its own seed (a split is often
        # sorted, e.g. by file, and eval_steps batches may cover only part of it).
        seed = epoch_seed(self.seed, epoch if self.train else EVAL_EPOCH, self.process_index)
        options = tf.data.Options()
        options.deterministic = True
        read_config = tfds.ReadConfig(shuffle_seed=seed, try_autocache=False, options=options)
        with python_stdlib.quiet_tfds():
            ds = self.builder.as_dataset(split=self.split, shuffle_files=True, read_config=read_config,
                                         decoders=tfds.decode.PartialDecoding({"text": True}))
        ds = ds.map(lambda example: example["text"])
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=False)
        # The skipped records are read (and pass through the shuffle buffer) but are not tokenized.
        return ds.skip(skip).prefetch(64).with_options(options).as_numpy_iterator()

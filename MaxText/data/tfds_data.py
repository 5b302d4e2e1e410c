"""`dataset_type=tfds`: a prepared TensorFlow Datasets dataset, tokenized and packed into full rows.

Reading. The data dir is `dataset_path`, or python_stdlib.default_data_dir(). Nothing is downloaded at run time: a dataset
must already be prepared there, except `python_stdlib` (MaxText/data/python_stdlib.py), which is built from
local files the first time. Each process reads only its own part of the split, tfds.even_splits(split,
process_count)[process_index], and only the text feature of each record (train_data_columns / eval_data_columns,
upstream's keys; default "text").

Order. Epoch e reads this process's part with its files shuffled and then a SHUFFLE_BUFFER-document shuffle
buffer, both seeded by (data_shuffle_seed, e, process_index), under tf.data's deterministic options: the same
seed gives the same batches, run after run.

Packing, the eval stream's padding and the state: MaxText/data/packing.py.

Resuming at state {"epoch": e, "document": d, ...} rebuilds epoch e's order and skips d records at the
tf.data level before anything is tokenized: it costs reading (not tokenizing) the skipped records of the
current epoch, so it grows with the position in the epoch (grain's does not).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is first imported: no C++ INFO lines

import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from MaxText.config.errors import ConfigError  # noqa: E402
from MaxText.data import python_stdlib  # noqa: E402  (python_stdlib registers its builder)
from MaxText.data.records import text_column  # noqa: E402
from MaxText.data.packing import PackedDocuments, epoch_seed  # noqa: E402
from MaxText.data.tokenizer import load_tokenizer  # noqa: E402

try:
    tf.config.set_visible_devices([], "GPU")  # the accelerators belong to JAX; TF only reads files
except RuntimeError:  # TF already initialised its devices elsewhere in this process
    pass

SHUFFLE_BUFFER = 1024  # documents; on top of the shuffled file order


def data_dir(cfg) -> str:
    """cfg.dataset_path, or python_stdlib.default_data_dir()."""
    return cfg.dataset_path or python_stdlib.default_data_dir()


def open_builder(cfg) -> tfds.core.DatasetBuilder:
    """The prepared builder of cfg.dataset_name in data_dir(cfg) (python_stdlib: built when missing). Never
    touches the network."""
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
    return builder


def check_column(cfg, builder, split: str) -> str:
    """The text column of `split` ("train" or "eval"), which the builder must have (ConfigError otherwise)."""
    column = text_column(cfg, split)
    if column not in builder.info.features:
        key = "train_data_columns" if split == "train" else "eval_data_columns"
        raise ConfigError(f"{key}=[{column}]: dataset_name={cfg.dataset_name} has no feature {column!r} (it has "
                          f"{', '.join(builder.info.features)}); name its text feature")
    return column


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
    check_column(cfg, builder, "train")
    if cfg.eval_interval != -1:
        check_split(cfg, builder, "eval_split")
        check_column(cfg, builder, "eval")


class TfdsData(PackedDocuments):
    """The tfds pipeline: PackedDocuments over a prepared TFDS split."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        super().__init__(cfg, global_batch, process_index, process_count, split=split, state=state)
        self.builder = open_builder(cfg)
        key = "train_split" if self.train else "eval_split"
        check_split(cfg, self.builder, key)
        self.column = check_column(cfg, self.builder, split)
        self.split = tfds.even_splits(cfg[key], n=process_count)[process_index]

    def source_name(self) -> str:
        return f"split {self.split} of dataset {self.builder.info.full_name}"

    def epoch_records(self, epoch: int, skip: int = 0):
        """The texts (bytes) of this process's documents in epoch `epoch`'s order, from document `skip` on."""
        seed = epoch_seed(self.seed, epoch, self.process_index)
        options = tf.data.Options()
        options.deterministic = True
        read_config = tfds.ReadConfig(shuffle_seed=seed, try_autocache=False, options=options)
        with python_stdlib.quiet_tfds():
            ds = self.builder.as_dataset(split=self.split, shuffle_files=True, read_config=read_config,
                                         decoders=tfds.decode.PartialDecoding({self.column: True}))
        ds = ds.map(lambda example: example[self.column])
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=False)
        # The skipped records are read (and pass through the shuffle buffer) but are not tokenized.
        return ds.skip(skip).prefetch(64).with_options(options).as_numpy_iterator()


_DOCUMENT_BUILDERS: dict[str, type] = {}


def prepare_documents(class_name: str, splits: dict[str, list[str]], data_dir: str, num_shards: int) -> None:
    """Prepares {split: texts} as the TFDS dataset of a builder class named class_name (TFDS's name: its snake
    case), feature "text", num_shards files per split, in data_dir: test corpora and benchmarks made in memory.
    The class is defined (and registered with TFDS) once per name."""
    if class_name not in _DOCUMENT_BUILDERS:
        def split_generators(self, dl_manager):
            return {split: ((i, {"text": doc}) for i, doc in enumerate(docs)) for split, docs in self.splits.items()}

        _DOCUMENT_BUILDERS[class_name] = type(class_name, (tfds.core.GeneratorBasedBuilder,), {
            "VERSION": tfds.core.Version("1.0.0"), "__module__": __name__,
            "code_path": None,  # no checksums to look up (see python_stdlib.PythonStdlib)
            "_info": lambda self: tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text()})),
            "_split_generators": split_generators, "_generate_examples": None})
    builder = _DOCUMENT_BUILDERS[class_name](data_dir=data_dir)
    builder.splits = splits
    with python_stdlib.quiet_tfds():
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=num_shards))

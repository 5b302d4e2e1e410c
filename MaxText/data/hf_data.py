"""`dataset_type=hf`: local Parquet, JSON (lines), Arrow or text files read by Hugging Face `datasets` in
streaming mode, tokenized and packed into full rows.

Reading. hf_path is a `datasets` loader of local files (parquet, json, arrow, text) or a local directory of such
files; when it is unset, the extension of hf_train_files names the loader. A split's files are hf_train_files /
hf_eval_files (globs, comma-separated; relative ones are under hf_data_dir or the hf_path directory), or else the
split train_split / hf_eval_split that `datasets` finds in hf_path / hf_data_dir by its file-naming conventions
(train-*.parquet, validation-*.parquet, ...). Each file is opened as a streaming dataset, load_dataset(hf_path,
name=hf_name, data_dir=hf_data_dir, data_files=<the file>, streaming=True): its rows are read a batch at a time and
nothing is converted into an Arrow cache. Nothing is fetched from the Hugging Face Hub: HF_DATASETS_OFFLINE and
HF_HUB_OFFLINE are set before `datasets` is imported, an hf_path that is neither a loader nor a directory is
refused, and only files found on disk are passed on. `datasets` writes lock files into its cache dir even when
streaming; that dir is a temporary one here, removed at exit, so a run writes nothing under ~/.cache.

Sharding. With F files (sorted by path) and n processes, the first F - F % n files are dealt out whole (file i to
process i % n); each of the last F % n files is read by every process, which keeps the rows whose index in the file
is its process_index modulo n. The processes' documents are disjoint and together the split, also when F < n. A
file read by every process costs each of them reading all of it: a file count that is a multiple of the process
count reads every byte once.

Order. Epoch e of process p, seeded by epoch_seed(data_shuffle_seed, e, p): p's parts of files in a shuffled order,
INTERLEAVE of them read in turn, one record each, through a SHUFFLE_BUFFER-document shuffle buffer. The same seed
gives the same batches, run after run. (The order is built here rather than with datasets' split_dataset_by_node
and IterableDataset.shuffle: those split between nodes after shuffling, so the nodes' parts are disjoint only when
every node shuffles with the same seed.)

Documents. The column's value: text, or a list of token ids that is passed on as ids (checked against
vocab_size). A null value is an empty document: counted as a record in the state, never packed. Packing, the eval
stream's padding and the state: MaxText/data/packing.py.

Resuming at {"epoch": e, "document": d, ...} rebuilds epoch e's order and reads and drops its first d records
before anything is tokenized: it costs reading d records, so it grows linearly with the position in the epoch (and
falls back to nothing at each epoch boundary). There is no shortcut: the shuffle buffer's content at record d
depends on every record read before it. (datasets' own IterableDataset.state_dict() does not save the buffer's
content, so it does not resume exactly.) Grain's pipeline resumes in constant time.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import tempfile
from typing import NamedTuple

# Read by `datasets` and `huggingface_hub` when they are imported: never look anything up on the Hub.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import datasets  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.config.errors import ConfigError  # noqa: E402
from MaxText.data.records import glob_files, text_column  # noqa: E402
from MaxText.data.packing import PackedDocuments, epoch_seed  # noqa: E402
from MaxText.data.tokenizer import load_tokenizer  # noqa: E402

LOADERS = ("parquet", "json", "arrow", "text")  # datasets' loaders of local files that hf_path may name
EXTENSIONS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow", ".txt": "text"}
SHUFFLE_BUFFER = 1024  # documents; on top of the shuffled file order
INTERLEAVE = 8  # files read in turn
READ_BATCH = 1024  # rows per read from a file
CHECK_ROWS = 64  # rows of each file that validate() looks at


@functools.cache
def cache_dir() -> tempfile.TemporaryDirectory:
    """This process's directory for datasets' lock files (removed at exit): not ~/.cache/huggingface."""
    return tempfile.TemporaryDirectory(prefix="maxtext_hf_")


class Source(NamedTuple):
    """The files of one split and how to open each."""

    where: str  # the keys that name the files, for messages
    key: str  # the key an error about a file names
    files: list[str]  # absolute paths, sorted
    column_key: str  # train_data_columns or eval_data_columns
    column: str
    path: str  # hf_path, or the loader the files' extension names
    loader: str | None  # the loader that reads the files (None: a directory of files of several kinds)
    name: str | None
    data_dir: str | None
    split: str

    def dataset(self, file: str, column_only: bool = False, rows: int = READ_BATCH) -> datasets.IterableDataset:
        """One file as a streaming dataset (no Arrow cache is written); column_only: only the column."""
        options = {}
        if self.loader == "parquet":
            # Decode `rows` rows at a time (of only the column) rather than whole row groups of every column:
            # INTERLEAVE files are open at once, and validate() looks at only a few rows of each.
            options = {"batch_size": rows, **({"columns": [self.column]} if column_only else {})}
        dataset = datasets.load_dataset(self.path, name=self.name, data_dir=self.data_dir,
                                        data_files={self.split: [file]}, split=self.split, streaming=True,
                                        cache_dir=cache_dir().name, **options)
        return dataset.select_columns([self.column]) if column_only else dataset


def local_path(cfg) -> str | None:
    """cfg.hf_path when it is a loader of local files or a directory (user-expanded); ConfigError otherwise."""
    path = cfg.hf_path
    if path is None or path in LOADERS:
        return path
    if os.path.isdir(os.path.expanduser(path)):
        return os.path.expanduser(path)
    raise ConfigError(f"hf_path={path} is neither a loader of local files ({', '.join(LOADERS)}) nor a directory: "
                      f"dataset_type=hf reads only local files, never the Hugging Face Hub; download the files and "
                      f"set e.g. hf_path=parquet hf_train_files=/data/c4/train-*.parquet")


def base_dir(cfg) -> str | None:
    """The directory relative file globs are under: hf_data_dir (within an hf_path directory), or hf_path."""
    root = cfg.hf_path if cfg.hf_path not in LOADERS else None
    root = os.path.expanduser(root) if root else None
    if cfg.hf_data_dir is None:
        return root
    base = os.path.join(root or "", os.path.expanduser(cfg.hf_data_dir))
    if not os.path.isdir(base):
        raise ConfigError(f"hf_data_dir={cfg.hf_data_dir}: {base} is not a directory; set hf_data_dir to the "
                          f"directory of the files")
    return base


def matching_files(cfg, key: str) -> list[str]:
    """The files cfg[key] names (comma-separated globs), sorted; ConfigError for a glob that matches none."""
    files, unmatched = glob_files(cfg[key], base_dir(cfg))
    if unmatched:
        raise ConfigError(f"{key}={cfg[key]}: no file matches {unmatched}; check the path (dataset_type=hf reads "
                          f"local files only)")
    if not files:
        raise ConfigError(f"{key}={cfg[key]!r} names no file; set it to a glob such as /data/c4/train-*.parquet")
    return files


def split_files(cfg, path: str, split_key: str, files_key: str) -> list[str]:
    """The files of split cfg[split_key] that `datasets` finds in hf_path / hf_data_dir."""
    where = f"hf_path={cfg.hf_path}" + (f" hf_data_dir={cfg.hf_data_dir}" if cfg.hf_data_dir else "")
    base_dir(cfg)  # a ConfigError when hf_data_dir is not a directory
    try:
        builder = datasets.load_dataset_builder(path, name=cfg.hf_name, data_dir=cfg.hf_data_dir,
                                                cache_dir=cache_dir().name)
    except (FileNotFoundError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{where}: {reason[:300]}; name the files with {files_key}=...") from None
    splits = {str(k): v for k, v in (builder.config.data_files or {}).items()}
    if cfg[split_key] not in splits:
        raise ConfigError(f"{split_key}={cfg[split_key]}: {where} has splits {', '.join(splits) or '(none)'}; set "
                          f"{split_key} to one of them or name the files with {files_key}=...")
    return sorted(os.path.abspath(str(f)) for f in splits[cfg[split_key]])


def source(cfg, train: bool) -> Source:
    """The train or eval split of cfg: files found and checked to exist, loader and column named."""
    files_key, split_key, column_key = (("hf_train_files", "train_split", "train_data_columns") if train else
                                        ("hf_eval_files", "hf_eval_split", "eval_data_columns"))
    column = text_column(cfg, "train" if train else "eval")
    path = local_path(cfg)
    if cfg[files_key] is not None:
        files, split = matching_files(cfg, files_key), "train" if train else "validation"
        where, key = f"{files_key}={cfg[files_key]}", files_key
    elif path is None:
        raise ConfigError(f"{files_key} and hf_path are not set: dataset_type=hf reads local files you name, e.g. "
                          f"{files_key}=/data/c4/{'train' if train else 'validation'}-*.parquet"
                          + ("" if train else " (or set eval_interval=-1)"))
    elif cfg[split_key] is None:
        raise ConfigError(f"{files_key} and {split_key} are not set: evaluation (eval_interval={cfg.eval_interval}) "
                          f"reads the files {files_key} names or the split {split_key} of hf_path={cfg.hf_path}; "
                          f"set one, or eval_interval=-1")
    else:
        split = cfg[split_key]
        files = split_files(cfg, path, split_key, files_key)
        where = key = f"split {split} of hf_path={cfg.hf_path}"
    loaders = {EXTENSIONS.get(os.path.splitext(f)[1].lower()) for f in files}
    loader = path if path in LOADERS else loaders.pop() if len(loaders) == 1 else None
    if path is None:
        if loader is None:
            suffixes = sorted({os.path.splitext(f)[1] or "(none)" for f in files})
            raise ConfigError(f"hf_path is not set and the files of {files_key} end in {', '.join(suffixes)}: set "
                              f"hf_path to their loader ({', '.join(LOADERS)})")
        path = loader
    return Source(where, key, files, column_key, column, path, loader, cfg.hf_name, cfg.hf_data_dir, split)


def check_files(src: Source, vocab_size: int) -> None:
    """Every file of src can be read, has rows, and has the column, holding text or token ids < vocab_size (its
    first CHECK_ROWS rows are looked at); ConfigError naming the file otherwise."""
    for file in src.files:
        try:
            batch = next(iter(src.dataset(file, rows=CHECK_ROWS).iter(batch_size=CHECK_ROWS)), None)
        except Exception as e:  # whatever the loader raises on a file it cannot parse (pyarrow, json, ...)
            reason = (str(e).splitlines() or [""])[0][:200]
            raise ConfigError(f"{src.key}: {file} has no rows or is not a {src.path} file ({type(e).__name__}: "
                              f"{reason}); remove it or write it again") from None
        if batch is None:
            raise ConfigError(f"{src.key}: {file} has no rows; remove it or write it again")
        if src.column not in batch:
            raise ConfigError(f"{src.column_key}=[{src.column}]: {file} has no column {src.column!r} (its columns: "
                              f"{', '.join(batch)}); set {src.column_key} to the one holding the documents")
        values = [v for v in batch[src.column] if v is not None]
        if all(isinstance(v, str) for v in values):
            continue
        if not all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise ConfigError(f"{src.column_key}=[{src.column}]: column {src.column!r} of {file} holds "
                              f"{', '.join(kinds)}, not text or lists of token ids; name the column of the documents")
        top = max((max(v) for v in values if v), default=0)
        if top >= vocab_size or min((min(v) for v in values if v), default=0) < 0:
            raise ConfigError(f"{src.column_key}=[{src.column}]: {file} holds token id {top} outside "
                              f"vocab_size={vocab_size}; it was tokenized with another tokenizer (or set vocab_size)")


def validate(cfg) -> None:
    """Tokenizer, files, columns and their first rows are there and fit (ConfigError naming key and file
    otherwise). The eval files are checked only when evaluation is on."""
    load_tokenizer(cfg)
    check_files(source(cfg, train=True), cfg.vocab_size)
    if cfg.eval_interval != -1:
        check_files(source(cfg, train=False), cfg.vocab_size)


def process_parts(file_count: int, process_index: int, process_count: int) -> list[tuple[int, int, int]]:
    """This process's parts of the files, (file, stride, phase): the rows of the file whose index is phase
    modulo stride. Whole files dealt out in turn; the F % n files left over are shared row by row."""
    whole = file_count - file_count % process_count
    return ([(f, 1, 0) for f in range(process_index, whole, process_count)]
            + [(f, process_count, process_index) for f in range(whole, file_count)])


END = object()


def interleaved(streams, cycle: int):
    """One record from each of `cycle` streams in turn; a finished stream's place goes to the next one."""
    pending = iter(streams)
    active = collections.deque(itertools.islice(pending, cycle))
    while active:
        stream = active.popleft()
        record = next(stream, END)
        if record is END:
            active.extend(itertools.islice(pending, 1))
        else:
            yield record
            active.append(stream)


def random_slots(rng: np.random.Generator, size: int):
    """Endless uniform draws from range(size), made in blocks (one call per draw would cost more than the
    record)."""
    while True:
        yield from rng.integers(size, size=4096).tolist()


def shuffled(records, size: int, rng: np.random.Generator):
    """A shuffle buffer of `size` records: each record read takes the place of a random one, which is emitted;
    at the end the rest come out in a random order."""
    buffer, slots = [], random_slots(rng, size)
    for record in records:
        if len(buffer) < size:
            buffer.append(record)
            continue
        i = next(slots)
        buffer[i], record = record, buffer[i]
        yield record
    rng.shuffle(buffer)
    yield from buffer


def document(value):
    """A column value as a record: text as it is, token ids as an array, null as an empty document."""
    if value is None:
        return ""
    return value if isinstance(value, str) else np.asarray(value, np.int64)


class HfData(PackedDocuments):
    """The hf pipeline: PackedDocuments over local files read by `datasets`."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        super().__init__(cfg, global_batch, process_index, process_count, split=split, state=state)
        self.src = source(cfg, self.train)
        self.parts = process_parts(len(self.src.files), process_index, process_count)

    def source_name(self) -> str:
        return f"{self.src.where} ({len(self.src.files)} files)"

    @property
    def files_key(self) -> str:
        return self.src.key

    def where(self) -> str:
        if self.here is None:
            return super().where()
        file_index, row = self.here
        return f"{self.src.key}: {self.src.files[file_index]}, row {row}"

    def part_records(self, file_index: int, stride: int, phase: int):
        """The column's values of the rows of one file whose index is phase modulo stride, as (record, (file
        index, row)) pairs."""
        row = 0
        for batch in self.src.dataset(self.src.files[file_index], column_only=True).iter(batch_size=READ_BATCH):
            values = batch[self.src.column]
            first = (phase - row) % stride
            for k, value in enumerate(values[first::stride]):
                yield document(value), (file_index, row + first + k * stride)
            row += len(values)

    def epoch_records(self, epoch: int, skip: int = 0):
        """This process's records in epoch `epoch`'s order, from record `skip` on (the skipped ones are read,
        not tokenized)."""
        rng = np.random.default_rng(epoch_seed(self.seed, epoch, self.process_index))
        parts = [self.parts[i] for i in rng.permutation(len(self.parts))]
        records = interleaved((self.part_records(*part) for part in parts), INTERLEAVE)
        return itertools.islice(shuffled(records, SHUFFLE_BUFFER, rng), skip, None)

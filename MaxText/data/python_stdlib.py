"""`dataset_name=python_stdlib`: this interpreter's standard-library sources as a TFDS dataset, built locally.

The `.py` files under `sysconfig.get_paths()["stdlib"]` (site-packages, dist-packages and __pycache__ left
out), read as UTF-8 with undecodable bytes replaced, cut into documents of whole top-level statements of at least
DOCUMENT_CHARS characters (cut only between top-level statements, found by `ast`, so each piece
compiles); features {"text", "path"}. Why cut: the files run to 100+ KB, and whole files would fill every row of
a small run's batches from one file for hundreds of steps; blocks let the shuffle mix many files per batch.
A file (all its documents) goes to "validation" when zlib.crc32(its relative path) % 50 == 0 and to "train"
otherwise, so the split never depends on the file count or the walk order. The sources differ between
Python versions, so the builder config is named after the interpreter (e.g. `py3_12_1`) and each Python
builds its own copy. Nothing is downloaded: the build reads local files only.

    python -m MaxText.data.python_stdlib [--data_dir DIR]

builds it when missing and prints each split's documents and bytes, and the unigram entropy of the train
targets under the byte-level tokenizer: the loss of a model that knows only byte frequencies, the number a
training run's loss should go well below.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import math
import os
import re
import sys
import sysconfig
import time
import warnings
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is first imported: no C++ INFO lines

import numpy as np  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from MaxText.config.errors import ConfigError  # noqa: E402
from MaxText.data.tokenizer import ByteTokenizer  # noqa: E402

VALIDATION_MODULUS = 50  # one file in ~50 is held out
DOCUMENT_CHARS = 2000  # a document ends at the first top-level block boundary after this many characters
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
INTERPRETER_CONFIG = "py" + "_".join(str(v) for v in sys.version_info[:3])


def relative_sources(root: str) -> list[str]:
    """The `.py` files under root as sorted '/'-separated relative paths, skipping EXCLUDED_DIRS."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel_dir == "." else os.path.join(rel_dir, name).replace(os.sep, "/"))
    return sorted(found)


def documents(text: str) -> list[str]:
    """text cut into runs of whole top-level statements (a decorated definition with its decorators) of at
    least DOCUMENT_CHARS characters, the last possibly shorter; "".join(documents(text)) == text, and each
    piece compiles if text does. Text that does not parse stays one document."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of old code (invalid escapes) are not ours to fix
            body = ast.parse(text).body
    except (SyntaxError, ValueError):  # e.g. Python 2 test data
        return [text] if text else []
    starts = sorted({min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
                     for node in body[1:]})
    lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)  # ast's line breaks; not str.splitlines'
    docs, start = [], 0
    for cut in starts + [len(lines)]:
        piece = "".join(lines[start:cut])
        if cut == len(lines) or len(piece) >= DOCUMENT_CHARS:
            docs.append(piece)
            start = cut
    return [d for d in docs if d]


def split_of(relative_path: str) -> str:
    """'validation' or 'train', a pure function of the path."""
    return "validation" if zlib.crc32(relative_path.encode()) % VALIDATION_MODULUS == 0 else "train"


# Run as `python -m`, this file is `__main__`; only the importable copy registers the name python_stdlib.
class PythonStdlib(tfds.core.GeneratorBasedBuilder, skip_registration=__name__ == "__main__"):
    """The standard-library `.py` files of the running interpreter, in documents of top-level blocks."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {"1.0.0": "One document per .py file; validation = crc32(path) % 50 == 0.",
                     "2.0.0": "Files cut into documents of whole top-level blocks (>= 2000 characters)."}
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=INTERPRETER_CONFIG,
                                               description=f"Python {sys.version.split()[0]} standard library")]
    # The directory read at build time; tests point it at a small tree.
    stdlib_root: str = sysconfig.get_paths()["stdlib"]
    # TFDS looks next to a builder's code for the checksums of its downloads; there are none, and finding the
    # code of a builder inside a package needs `importlib_resources`, which TFDS does not require (not installed here).
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description=__doc__.splitlines()[0],
            features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "path": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        paths = relative_sources(self.stdlib_root)
        return {split: self._generate_examples([p for p in paths if split_of(p) == split])
                for split in ("train", "validation")}

    def _generate_examples(self, paths):
        for rel in paths:
            with open(os.path.join(self.stdlib_root, rel), encoding="utf-8", errors="replace") as f:
                for i, doc in enumerate(documents(f.read())):
                    yield f"{rel}:{i}", {"text": doc, "path": rel}


@contextlib.contextmanager
def quiet_tfds():
    """Without TFDS's chatter: absl lines below ERROR (e.g. "Variant folder ... has no dataset_info.json" on
    probing a dataset that is not there yet) and its build banners on stdout. Also turns TFDS's progress bars
    off for the process (TFDS offers no way to restore them)."""
    tfds.disable_progress_bar()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logger.setLevel(level)


def build(data_dir: str, log=print) -> PythonStdlib:
    """The builder over data_dir, prepared: built (with one log line) only when not there yet. The processes
    of a multi-process job on one machine build it once: the others wait on a file lock, then find it built."""
    import fcntl

    builder = PythonStdlib(data_dir=data_dir)
    with quiet_tfds():
        prepared = builder.is_prepared()
    if prepared:
        return builder
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, ".python_stdlib.lock")
    try:  # never through a symlink, never truncating
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot open the dataset build lock {path}: {e.strerror} (it is never followed as a "
                          "symlink); remove it") from None
    with os.fdopen(fd) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builder = PythonStdlib(data_dir=data_dir)  # looks again: another process may have built it meanwhile
        with quiet_tfds():
            prepared = builder.is_prepared()
        if not prepared:
            log(f"building the python_stdlib dataset from {builder.stdlib_root} into {builder.data_dir}")
            with quiet_tfds():
                builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


def default_data_dir() -> str:
    """$XDG_CACHE_HOME (or ~/.cache) /maxtext_moe/tensorflow_datasets."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "maxtext_moe", "tensorflow_datasets")


def summary(builder: tfds.core.DatasetBuilder) -> dict:
    """Documents and UTF-8 bytes per split; the train split's byte-level target tokens (bytes plus one EOS per
    non-empty document, as the default add_bos/add_eos pipeline emits them) and their unigram entropy in
    nats/token."""
    tokenizer = ByteTokenizer()
    out = {}
    for split in builder.info.splits:
        documents, size = 0, 0
        counts = np.zeros(tokenizer.vocab_size, np.int64)
        for example in builder.as_dataset(split=split).as_numpy_iterator():
            text = example["text"]
            documents += 1
            size += len(text)
            if split == "train" and text:
                counts += np.bincount(tokenizer.encode_bytes(text), minlength=tokenizer.vocab_size)
                counts[tokenizer.eos_id] += 1
        out[split] = {"documents": documents, "bytes": size}
        if split == "train":
            p = counts[counts > 0] / counts.sum()
            out[split].update(target_tokens=int(counts.sum()), unigram_entropy=float(-(p * np.log(p)).sum()))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m MaxText.data.python_stdlib", description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=None, help=f"TFDS data dir (default {default_data_dir()})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    builder = build(args.data_dir or default_data_dir())
    with quiet_tfds():
        stats = summary(builder)
    print(f"{builder.info.full_name} in {builder.data_dir} (ready in {time.perf_counter() - start:.1f} s)")
    for split, s in stats.items():
        print(f"{split}: {s['documents']} documents, {s['bytes']} bytes")
        if "unigram_entropy" in s:
            print(f"{split}: {s['target_tokens']} byte-level target tokens, unigram entropy "
                  f"{s['unigram_entropy']:.4f} nats/token (uniform over 259 ids: {math.log(259):.4f})")
    return 0


if __name__ == "__main__":
    from MaxText.data import python_stdlib  # the registered copy of this module

    sys.exit(python_stdlib.main())

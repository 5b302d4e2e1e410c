"""Tokens/s of each document pipeline, and what resuming costs at the start and at the end of an epoch:

    python -m MaxText.benchmarks.input [--documents 20000 --files 8 --batch 8 --length 2048 --batches N
        --repeats 3 --pipelines tfds,grain,hf --grain_workers 0,1 --tokenizer_path P --pretokenized --json PATH]

Generates a corpus in a temporary directory: --documents documents of seeded random words with C4-like lengths
(lognormal bytes, median ~1.2 KB, mean ~2 KB), in --files files, written three ways: a TFDS dataset
(maxtext_bench_docs) prepared in a data dir, ArrayRecord shards converted from it by MaxText.data.to_array_record
(what a user runs), and Parquet files. Each pipeline is made as the trainer makes it (load_config of
configs/base.yml with dataset_type=..., eval_interval=-1; MaxText.data.make_data), one process, global batch
--batch rows of --length tokens:

  tokens/s      over --batches batches after the first (default: one epoch of byte-level tokens)
  first batch   seconds from making the pipeline's first iterator to its first batch: one-time costs included
                (tf.data graph, `datasets` loader, Grain worker start-up)
  resume        seconds from making an iterator with state {"epoch": 0, "document": d, "offset": 0} to its first
                batch, best of --repeats: d = 0 (start of the epoch) and d = documents - 10 (its end). tfds and hf
                read the d skipped records again; grain indexes straight to d.

Grain is measured once per --grain_workers count (its own row each); --pretokenized adds grain over ArrayRecord
holding token ids (converted with --tokenizer_path, or from Parquet of byte-level ids without one). The Parquet
files have row groups of ROW_GROUP rows. Prints a table and one JSON line; never part of the test suite's timing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import sys
import tempfile
import time

import numpy as np

from MaxText.benchmarks import emit
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config

DATASET = "maxtext_bench_docs"  # the TFDS name; the tests' builder is maxtext_test_docs
MEDIAN_BYTES, SIGMA = 1200, 1.0  # lognormal document lengths: mean = median * exp(sigma^2 / 2) ~ 2 KB
# Rows per Parquet row group (~2 MB). A reader decodes whole row groups: with pyarrow's default (one group per
# file here) the hf pipeline's first batch decodes every file in full (measured: ~1.7x its first-batch time at
# 100000 documents).
ROW_GROUP = 1000
END_MARGIN = 10  # "end of the epoch": this many documents before it


def make_documents(n: int, seed: int = 0) -> list[str]:
    """n documents of random lowercase words (Zipf-like frequencies over 5000 made-up words), C4-like lengths."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, k)) for k in rng.integers(2, 11, 5000)]
    lengths = np.clip(rng.lognormal(math.log(MEDIAN_BYTES), SIGMA, n), 50, 100_000).astype(int)
    weights = 1 / np.arange(1, len(vocab) + 1)
    words = rng.choice(len(vocab), int(lengths.sum() / 5) + 1000, p=weights / weights.sum())
    text = " ".join(vocab[w] for w in words)
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    return [text[a:b].strip() or "x" for a, b in zip(cuts[:-1], cuts[1:])]


def convert(argv: list[str]) -> None:
    """MaxText.data.to_array_record.main(argv), quietly; RuntimeError with its message when it fails."""
    from MaxText.data import to_array_record

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = to_array_record.main(argv)
    if code:
        raise RuntimeError(f"to_array_record {' '.join(argv)}: {err.getvalue().strip()}")


def write_corpus(docs: list[str], root: str, files: int, tokenizer_path: str | None, pretokenized: bool) -> dict:
    """docs as TFDS (root/tfds), ArrayRecord (root/grain, and root/grain_ids with pretokenized) and Parquet
    (root/hf), `files` files each; returns the seconds each took."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from MaxText.data import tfds_data

    seconds, per_file = {}, math.ceil(len(docs) / files)
    start = time.perf_counter()
    tfds_data.prepare_documents("MaxtextBenchDocs", {"train": docs}, f"{root}/tfds", files)
    seconds["tfds"] = time.perf_counter() - start
    start = time.perf_counter()
    convert([DATASET, f"{root}/grain", "--data_dir", f"{root}/tfds", "--records_per_shard", str(per_file)])
    seconds["array_record"] = time.perf_counter() - start
    start = time.perf_counter()
    os.makedirs(f"{root}/hf")
    for i in range(files):
        pq.write_table(pa.table({"text": docs[i * per_file:(i + 1) * per_file]}),
                       f"{root}/hf/train-{i:05d}-of-{files:05d}.parquet", row_group_size=ROW_GROUP)
    seconds["parquet"] = time.perf_counter() - start
    if pretokenized:
        start = time.perf_counter()
        if tokenizer_path:
            convert([DATASET, f"{root}/grain_ids", "--data_dir", f"{root}/tfds", "--records_per_shard",
                     str(per_file), "--tokenizer_path", tokenizer_path])
        else:  # the converter takes no byte-level tokenizer; it passes token ids it is given through as they are
            from MaxText.data.tokenizer import ByteTokenizer

            os.makedirs(f"{root}/ids")
            byte_level = ByteTokenizer()
            for i in range(files):
                ids = [byte_level.encode(d) for d in docs[i * per_file:(i + 1) * per_file]]
                offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int32)
                column = pa.ListArray.from_arrays(offsets, np.concatenate(ids).astype(np.int64))
                pq.write_table(pa.table({"text": column}), f"{root}/ids/train-{i:05d}.parquet")
            convert([f"{root}/ids/train-*.parquet", f"{root}/grain_ids", "--records_per_shard", str(per_file)])
        seconds["array_record_ids"] = time.perf_counter() - start
    return seconds


def first_batch(cfg, batch: int, state: dict | None):
    """(seconds from making an iterator at `state` to its first batch, the iterator, the batch)."""
    from MaxText.data import make_data

    # A resuming trainer is a fresh process: no earlier iterator's garbage (measured: an hf iterator left alive
    # makes the next one's first batch ~3x slower).
    gc.collect()
    start = time.perf_counter()
    it = make_data(cfg, batch, state=state)
    out = next(it)
    return time.perf_counter() - start, it, out


def close(it) -> None:
    """Stops an iterator's workers (grain's), if it has any."""
    if hasattr(it, "close"):
        it.close()


def measure(cfg, batch: int, batches: int, repeats: int, documents: int) -> dict:
    """One pipeline's row (see the module docstring)."""
    def tokens(b):  # segment 0 is padding (none in training)
        return int((b["inputs_segmentation"] > 0).sum())

    first_s, it, out = first_batch(cfg, batch, None)
    first_tokens, timed_tokens = tokens(out), 0
    start = time.perf_counter()
    for _ in range(batches):
        timed_tokens += tokens(next(it))
    elapsed = time.perf_counter() - start
    close(it)
    del it
    row = {"tokens_per_s": timed_tokens / elapsed, "tokens_per_batch": (first_tokens + timed_tokens) / (batches + 1),
           "first_batch_s": first_s}
    for name, d in (("start", 0), ("end", max(0, documents - END_MARGIN))):
        times = []
        for _ in range(repeats):
            seconds, it, _ = first_batch(cfg, batch, {"epoch": 0, "document": d, "offset": 0})
            close(it)
            del it
            times.append(seconds)
        row[f"resume_{name}_s"], row[f"resume_{name}_document"] = min(times), d
    row["end_start_ratio"] = row["resume_end_s"] / row["resume_start_s"]
    return row


def pipeline_args(kind: str, root: str, workers: int = 0) -> list[str]:
    """The key=value arguments that read the corpus under root with one pipeline."""
    if kind == "tfds":
        return ["dataset_type=tfds", f"dataset_name={DATASET}", f"dataset_path={root}/tfds"]
    if kind in ("grain", "grain_ids"):
        return ["dataset_type=grain", f"grain_train_files={root}/{kind}/train-*.array_record",
                f"grain_worker_count={workers}"]
    return ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={root}/hf/train-*.parquet"]


def format_table(result: dict) -> str:
    head = (f"{'pipeline':<32} {'tokens/s':>11} {'first batch s':>14} {'resume start s':>15} {'resume end s':>13} "
            f"{'end/start':>10}")
    lines = [f"{result['documents']} documents ({result['corpus_bytes'] / 2**20:.0f} MiB) in {result['files']} files; "
             f"batch {result['global_batch']} x {result['max_target_length']}, {result['batches']} batches measured; "
             f"tokenizer {result['tokenizer']}", head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['pipeline']:<32} {r['tokens_per_s']:>11,.0f} {r['first_batch_s']:>14.3f} "
                     f"{r['resume_start_s']:>15.3f} {r['resume_end_s']:>13.3f} {r['end_start_ratio']:>10.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict | int:
    p = argparse.ArgumentParser(prog="python -m MaxText.benchmarks.input", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=20000, help="documents generated")
    p.add_argument("--files", type=int, default=8, help="files (shards) of each format")
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--length", type=int, default=2048, help="max_target_length (tokens per row)")
    p.add_argument("--batches", type=int, default=None, help="batches timed after the first (default: one epoch "
                                                              "of byte-level tokens)")
    p.add_argument("--repeats", type=int, default=3, help="resumes timed at each position (the best is kept)")
    p.add_argument("--pipelines", default="tfds,grain,hf", help="comma-separated dataset types")
    p.add_argument("--grain_workers", default="0,1", help="comma-separated grain_worker_count values, a row each")
    p.add_argument("--tokenizer_path", default=None, help="a SentencePiece .model or tokenizer.json (default: "
                                                          "the byte-level tokenizer)")
    p.add_argument("--pretokenized", action="store_true", help="also grain over ArrayRecord of token ids")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated corpus")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    pipelines = [k.strip() for k in a.pipelines.split(",") if k.strip()]
    if unknown := [k for k in pipelines if k not in ("tfds", "grain", "hf")]:
        print(f"error: --pipelines {a.pipelines}: unknown {', '.join(unknown)}; choose from tfds, grain, hf",
              file=sys.stderr)
        return 2
    workers = [int(w) for w in a.grain_workers.split(",") if w.strip()]
    docs = make_documents(a.documents, a.seed)
    corpus_bytes = sum(len(d.encode()) for d in docs)
    # Byte level with BOS and EOS: a document of n bytes is n + 1 (input, target) pairs.
    batches = a.batches if a.batches is not None else max(1, (corpus_bytes + len(docs)) // (a.batch * a.length))
    try:
        from MaxText.data import pipeline_module, validate
        from MaxText.data.to_array_record import UserError, load_text_tokenizer

        try:
            vocab = load_text_tokenizer(a.tokenizer_path).vocab_size if a.tokenizer_path else 259
        except UserError as e:
            raise ConfigError(str(e)) from None
        common = ["eval_interval=-1", f"vocab_size={vocab}", f"max_target_length={a.length}",
                  *([f"tokenizer_path={a.tokenizer_path}"] if a.tokenizer_path else [])]
        for kind in pipelines:  # imported before anything is timed
            pipeline_module(kind)
        runs = []  # (row name, corpus, grain workers)
        for kind in pipelines:
            if kind != "grain":
                runs.append((kind, kind, 0))
                continue
            for w in workers:
                runs.append((f"grain ({w} worker{'s' * (w != 1)})", "grain", w))
            if a.pretokenized:
                for w in workers:
                    runs.append((f"grain, token ids ({w} worker{'s' * (w != 1)})", "grain_ids", w))
        rows = []
        with tempfile.TemporaryDirectory(prefix="maxtext_input_bench_") as root:
            prepare_s = write_corpus(docs, root, a.files, a.tokenizer_path, a.pretokenized and "grain" in pipelines)
            for name, kind, w in runs:
                cfg = load_config(["configs/base.yml", *pipeline_args(kind, root, w), *common])
                validate(cfg)
                row = measure(cfg, a.batch, batches, a.repeats, len(docs))
                rows.append({"pipeline": name, "dataset_type": cfg.dataset_type, "grain_workers":
                             w if cfg.dataset_type == "grain" else None, "pretokenized": kind == "grain_ids", **row})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"documents": len(docs), "files": a.files, "corpus_bytes": corpus_bytes, "global_batch": a.batch,
              "max_target_length": a.length, "batches": batches, "repeats": a.repeats,
              "tokenizer": a.tokenizer_path or "byte-level", "prepare_s": prepare_s, "rows": rows}
    print(format_table(result))
    emit(result, a.json)
    return result


if __name__ == "__main__":
    out = main()
    raise SystemExit(out if isinstance(out, int) else 0)

"""The hf pipeline's own behaviour (the shared suite in tests/test_data.py runs it on Parquet files too): Parquet,
JSON lines and Arrow files of the same documents give the same batches, by loader name, by extension and as a
directory; pre-tokenized and null values; process shares of any file count; its one-line errors; no network and
nothing written under ~/.cache."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from MaxText.config.errors import ConfigError
from MaxText.data import make_data, validate
from MaxText.data.records import BATCH_KEYS
from MaxText.data.hf_data import HfData, process_parts
from MaxText.data.tokenizer import ByteTokenizer
from tests.corpora import L, SPLITS, TRAIN_DOCS, shard_paths, shards, write_parquet
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = {"parquet": "parquet", "json": "jsonl", "arrow": "arrow"}


def write_split(path: str, values: list, column: str = "text") -> None:
    """values as one file in the format its extension names."""
    if path.endswith(".parquet"):
        write_parquet(path, values, column)
    elif path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({column: v, "n": i}) + "\n" for i, v in enumerate(values))
    else:
        table = pa.table({column: values})
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=4)


def write_corpus(root: str, loader: str, splits=SPLITS, column: str = "text") -> str:
    os.makedirs(root, exist_ok=True)
    for split, docs in splits.items():
        for path, part in zip(shard_paths(root, split, SUFFIXES[loader]), shards(docs)):
            write_split(path, part, column)
    return root


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """SPLITS as Parquet, JSON lines and Arrow files, three per split; and pre-tokenized as Parquet."""
    roots = {loader: write_corpus(str(tmp_path_factory.mktemp(loader)), loader) for loader in SUFFIXES}
    tok = ByteTokenizer()
    ids = {split: [tok.encode(d).tolist() if d else None for d in docs] for split, docs in SPLITS.items()}
    roots["ids"] = write_corpus(str(tmp_path_factory.mktemp("ids")), "parquet", ids, column="ids")
    return roots


def files_args(root: str, suffix: str = "parquet") -> list[str]:
    return [f"hf_train_files={root}/train-*.{suffix}", f"hf_eval_files={root}/validation-*.{suffix}"]


def config(*overrides):
    return tiny_config("dataset_type=hf", "vocab_size=259", f"max_target_length={L}", *overrides)


def batches_and_states(cfg, n: int, split: str = "train"):
    it = make_data(cfg, 4, split=split)
    out = []
    for _ in range(n):
        out.append(next(it))
        out.append(it.state())
    return out


def assert_same(got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, dict) and "epoch" in w:
            assert g == w, f"{what}: state after batch {i // 2} is {g}, not {w}"
            continue
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(g[k], w[k], err_msg=f"{what}: batch {i // 2} {k} differs")


def test_formats_and_ways_of_naming_files_give_the_same_batches(corpora, no_network):
    """Parquet, JSON lines and Arrow; the loader named, inferred from the extension, or hf_path a directory
    whose train-*/validation-* files datasets finds itself: the same documents give the same batches."""
    want = batches_and_states(config("hf_path=parquet", *files_args(corpora["parquet"])), 12)  # ~1.5 epochs
    want_eval = batches_and_states(config("hf_path=parquet", *files_args(corpora["parquet"])), 4, "eval")
    for loader, suffix in SUFFIXES.items():
        for named in (f"hf_path={loader}", "hf_path=null"):
            cfg = config(named, *files_args(corpora[loader], suffix), "eval_interval=10")
            validate(cfg)
            assert_same(batches_and_states(cfg, 12), want, f"{loader} files, {named}")
            assert_same(batches_and_states(cfg, 4, "eval"), want_eval, f"{loader} eval files, {named}")
    cfg = config(f"hf_path={corpora['parquet']}", "hf_eval_split=validation", "eval_interval=10")
    validate(cfg)
    assert_same(batches_and_states(cfg, 12), want, "hf_path=<directory>")
    assert_same(batches_and_states(cfg, 4, "eval"), want_eval, "hf_path=<directory> hf_eval_split=validation")
    cfg = config("hf_path=parquet", f"hf_data_dir={corpora['parquet']}", "hf_train_files=train-*.parquet")
    assert_same(batches_and_states(cfg, 12), want, "hf_data_dir + relative hf_train_files")


def test_pre_tokenized_ids_and_nulls_pack_like_text(corpora):
    """A list<int64> column is packed as the ids it holds; a null value is an empty document (skipped, but
    counted in the state like the empty text it replaces)."""
    text = config("hf_path=parquet", *files_args(corpora["parquet"]))
    ids = config("hf_path=parquet", *files_args(corpora["ids"]), "train_data_columns=[ids]",
                 "eval_data_columns=[ids]", "eval_interval=10")
    validate(ids)
    it = HfData(ids, 4)
    records = [record for record, _ in it.epoch_records(0)]
    arrays = [r for r in records if isinstance(r, np.ndarray) and r.dtype == np.int64]
    assert len(arrays) == len(records) - 1 and all(len(r) for r in arrays), "ids are not int arrays"
    assert [r for r in records if len(r) == 0] == [""], "the null is not one empty document"
    assert_same(batches_and_states(ids, 12), batches_and_states(text, 12), "pre-tokenized column")
    assert_same(batches_and_states(ids, 4, "eval"), batches_and_states(text, 4, "eval"), "pre-tokenized eval")


@pytest.mark.parametrize("files", range(1, 8))
def test_process_parts_are_disjoint_and_cover_every_row(files):
    rows = [5 + 3 * f for f in range(files)]
    for n in range(1, 5):
        seen = [(f, r) for p in range(n) for f, stride, phase in process_parts(files, p, n)
                for r in range(phase, rows[f], stride)]
        assert sorted(seen) == [(f, r) for f in range(files) for r in range(rows[f])], \
            f"{files} files over {n} processes: rows lost or read twice"
        whole = sum(stride == 1 for p in range(n) for _, stride, _ in process_parts(files, p, n))
        assert whole == files - files % n, f"{files} files over {n} processes: {whole} read whole"


def test_more_processes_than_files(corpora):
    """Four processes over three files: every file shared row by row; the documents still split exactly."""
    cfg = config("hf_path=parquet", *files_args(corpora["parquet"]))
    located = [list(HfData(cfg, 4, p, 4).epoch_records(0)) for p in range(4)]
    docs = [[d for d, _ in part] for part in located]
    assert sorted(d for part in docs for d in part) == sorted(TRAIN_DOCS), "the processes' documents are not the split"
    assert all(docs), "a process got no documents"
    import pyarrow.parquet as pq  # each record's (file, row), as error messages name it, is where it is

    it = HfData(cfg, 4)
    columns = [pq.read_table(f).column("text").to_pylist() for f in it.src.files]
    assert all(columns[f][row] == d for part in located for d, (f, row) in part), "a record's (file, row) is wrong"


# ----------------------------------------------------------------------------------------------- errors


def one_line_error(match, fn, *args) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value), f"ConfigError is not one line: {e.value!r}"
    return str(e.value)


def test_missing_files_and_directories(corpora, tmp_path, no_network):
    root = corpora["parquet"]
    msg = one_line_error(r"hf_train_files=.*: no file matches", validate,
                         config("hf_path=parquet", f"hf_train_files={root}/train-*.parquet,{tmp_path}/x-*.parquet"))
    assert f"{tmp_path}/x-*.parquet" in msg, msg
    msg = one_line_error("hf_eval_files=.*: no file matches", validate, config(
        "hf_path=parquet", f"hf_train_files={root}/train-*.parquet", f"hf_eval_files={tmp_path}/v*.parquet",
        "eval_interval=10"))
    assert f"{tmp_path}/v*.parquet" in msg, msg
    validate(config("hf_path=parquet", f"hf_train_files={root}/train-*.parquet",
                    f"hf_eval_files={tmp_path}/v*.parquet", "eval_interval=-1"))  # no eval: not looked for
    one_line_error(f"hf_data_dir={tmp_path}/nowhere: .* is not a directory", validate,
                   config("hf_path=parquet", f"hf_data_dir={tmp_path}/nowhere", "hf_train_files=*.parquet"))
    one_line_error(r"train_split=nope: hf_path=.* has splits train, validation", validate,
                   config(f"hf_path={root}", "train_split=nope"))
    one_line_error(r"hf_path=.*: .*data files; name the files with hf_train_files", validate,
                   config(f"hf_path={tmp_path}"))
    one_line_error("hf_eval_files and hf_eval_split are not set", validate,
                   config(f"hf_path={root}", "eval_interval=10"))


def test_hub_names_are_refused(no_network):
    msg = one_line_error("hf_path=allenai/c4 is neither a loader of local files", validate,
                         config("hf_path=allenai/c4"))
    assert "never the Hugging Face Hub" in msg, msg


def test_extension_without_a_loader(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    one_line_error(r"hf_path is not set and the files of hf_train_files end in \.csv", validate,
                   config(f"hf_train_files={tmp_path}/*.csv"))


@pytest.mark.parametrize("suffix", ["parquet", "jsonl", "arrow"])
def test_empty_file_is_named(corpora, tmp_path, suffix):
    loader = {"jsonl": "json"}.get(suffix, suffix)
    root = write_corpus(str(tmp_path), loader)
    empty = os.path.join(root, f"train-00009-of-00009.{suffix}")
    if suffix == "jsonl":
        open(empty, "w").close()
    else:
        write_split(empty, pa.array([], pa.string()))
    msg = one_line_error("hf_train_files: .* has no rows", validate, config(*files_args(root, suffix)))
    assert empty in msg, msg


def test_wrong_column_lists_the_columns(corpora):
    msg = one_line_error(r"train_data_columns=\[body\]: .*train-00000-of-00003.jsonl has no column 'body' "
                         r"\(its columns: text, n\)", validate,
                         config(*files_args(corpora["json"], "jsonl"), "train_data_columns=[body]"))
    assert "set train_data_columns" in msg, msg
    one_line_error(r"train_data_columns=\[n\]: column 'n' of .* holds int, not text or lists of token ids", validate,
                   config(*files_args(corpora["json"], "jsonl"), "train_data_columns=[n]"))


def test_token_ids_beyond_the_vocabulary(corpora, tmp_path):
    """Ids written by the byte-level tokenizer, read with a 3-token tokenizer and vocab_size=100."""
    import tokenizers

    validate(config(*files_args(corpora["ids"]), "train_data_columns=[ids]", "vocab_size=259"))
    path = str(tmp_path / "tokenizer.json")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(path)
    msg = one_line_error(r"train_data_columns=\[ids\]: .*train-00000-of-00003.parquet holds token id \d+ outside "
                         r"vocab_size=100", validate,
                         config(*files_args(corpora["ids"]), "train_data_columns=[ids]", "vocab_size=100",
                                f"tokenizer_path={path}"))
    assert "tokenized with another tokenizer" in msg, msg


# ----------------------------------------------------------------------------------------------- isolation


def test_no_network_and_nothing_written_under_home(corpora, tmp_path):
    """A fresh process (so that `datasets` reads HOME, XDG_CACHE_HOME and HF_HOME when it is imported) with
    sockets refused validates and reads both splits; it leaves its homes and its temporary dir empty."""
    homes = {k: tmp_path / k for k in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TMPDIR")}
    for d in homes.values():
        d.mkdir()
    script = textwrap.dedent(f"""
        import socket

        def refuse(*args, **kwargs):
            raise AssertionError(f"network access attempted: {{args}}")

        socket.socket.connect = refuse
        socket.create_connection = refuse
        from MaxText.data import make_data, validate
        from tests.tiny import tiny_config

        cfg = tiny_config("dataset_type=hf", "vocab_size=259", "max_target_length=16", "eval_interval=10",
                          "hf_path={corpora['parquet']}", "hf_eval_split=validation")
        validate(cfg)
        for split in ("train", "eval"):
            it = make_data(cfg, 4, split=split)
            for _ in range(12):
                next(it)
        print("read")
    """)
    env = {**os.environ, **{k: str(v) for k, v in homes.items()}, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "read" in done.stdout, done.stderr[-3000:]
    for key, d in homes.items():
        left = [os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs]
        left += [os.path.relpath(os.path.join(r, s), d) for r, ss, _ in os.walk(d) for s in ss]
        assert not left, f"the run left {left[:5]} under {key}"

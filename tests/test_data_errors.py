"""What only the data can reveal is still one line: a document the pipeline cannot use, met in the middle of a run
(past the records the start-up checks read), stops the trainer with one `error:` line naming the file, the row
and the key to change, exit status 2, after checkpointing the last completed step; fixing the data and rerunning
resumes as if nothing had happened. These used to be a ValueError traceback mid-run, with nothing saved."""

import json
import os

import grain
import numpy as np
import pyarrow.parquet as pq
import pytest

from MaxText.data.packing import epoch_seed
from MaxText.train import main
from tests.corpora import example_bytes, write_array_record, write_parquet
from tests.tiny import TINY, args, losses

RECORDS, DOC = 120, 15  # pre-tokenized documents of 15 ids: 16 pairs each (BOS/EOS added), a row of L=16 each
BAD_AT = 50  # the bad document's place in epoch 0's order: read during step 4 (16 rows a step on 8 devices)
GRAIN = ["dataset_type=grain", "vocab_size=320", "grain_worker_count=0", "learning_rate_schedule_steps=8",
         "checkpoint_period=1000", "log_period=1"]


def good(i: int) -> list[int]:
    return [(3 + 7 * i + j) % 300 + 3 for j in range(DOC)]


def grain_file(path, bad_record: bytes | None = None) -> tuple[str, int]:
    """RECORDS pre-tokenized documents in one ArrayRecord file; with bad_record, the one read at BAD_AT is it.
    Returns (path, the bad record's number in the file)."""
    index = grain.experimental.index_shuffle(BAD_AT, max_index=RECORDS - 1, seed=epoch_seed(0, 0, 0), rounds=4)
    records = [example_bytes(good(i), "ids") for i in range(RECORDS)]
    if bad_record is not None:
        records[index] = bad_record
    write_array_record(str(path), records)
    return str(path), index


def run(argv, capsys) -> tuple[int, list[str], str]:
    """main(argv): (exit status, its error lines, all of stderr)."""
    code = main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


def grain_args(tmp_path, path, name, *extra) -> list[str]:
    return args(TINY, GRAIN, [f"grain_train_files={path}", "train_data_columns=[ids]",
                              f"base_output_directory={tmp_path}", f"run_name={name}"], list(extra))


def metrics(tmp_path, name) -> list[dict]:
    with open(tmp_path / name / "metrics" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_an_id_outside_the_vocabulary_mid_run_stops_in_one_line_after_a_checkpoint(tmp_path, capsys):
    """Document BAD_AT holds id 400 >= vocab_size=320 (the start-up check reads each file's first record only): the
    run stops in step 4 naming the file and record, with step 3 checkpointed; with the record fixed, a rerun resumes
    from step 3 and its losses are those of an uninterrupted run on the fixed file (the input position saved is the
    one before the batch that was given up)."""
    path, index = grain_file(tmp_path / "ids.array_record", example_bytes([5, 400, 6], "ids"))
    code, errors, err = run(grain_args(tmp_path, path, "oov", "steps=8"), capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    line = errors[0]
    assert f"grain_train_files: {path}, record {index}: a pre-tokenized document holds id 400 outside " \
           "vocab_size=320" in line and "set vocab_size and tokenizer_path" in line, line
    assert f"stopped after step 3, saved in {tmp_path}/oov/checkpoints/3" in line, line
    assert len(line) < 1000, len(line)
    assert sorted(os.listdir(tmp_path / "oov" / "checkpoints")) == ["3"]
    assert [r["step"] for r in metrics(tmp_path, "oov")] == [1, 2, 3]

    # Rerun on the same data: the resume reads that batch first and stops on it the same way, before any step; the
    # checkpoint is not taken for damaged (an older one would meet the same document) and nothing is lost.
    code, again, err = run(grain_args(tmp_path, path, "oov", "steps=8"), capsys)
    assert code == 2 and len(again) == 1 and "Traceback" not in err, err[-2000:]
    assert again[0].startswith(line[:line.index("; stopped after")]) and "warning: checkpoint" not in err, again
    assert sorted(os.listdir(tmp_path / "oov" / "checkpoints")) == ["3"]
    assert [r["step"] for r in metrics(tmp_path, "oov")] == [1, 2, 3]

    grain_file(path)  # the record fixed: the run resumes at step 3 and reads on from the batch it gave up
    assert main(grain_args(tmp_path, path, "oov", "steps=6")) == 0
    capsys.readouterr()
    assert main(grain_args(tmp_path, path, "whole", "steps=6")) == 0
    np.testing.assert_allclose(losses(metrics(tmp_path, "oov")), losses(metrics(tmp_path, "whole")), rtol=1e-6)


def test_a_record_a_worker_process_cannot_read_is_one_line(tmp_path, capsys):
    """A record without the text column, parsed in a Grain worker process (grain_worker_count=1): the worker's
    error reaches the user as the same kind of line, naming the file and record."""
    path, index = grain_file(tmp_path / "ids.array_record", example_bytes("a text under another name", "body"))
    code, errors, err = run(grain_args(tmp_path, path, "worker", "steps=8", "grain_worker_count=1"), capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"grain_train_files: {path}, record {index}: " in errors[0] and "has no feature 'ids'" in errors[0], \
        errors[0]
    assert "stopped after step 3" in errors[0] and len(errors[0]) < 1000, errors[0]


def test_a_shard_of_empty_documents_is_one_line_before_the_first_step(tmp_path, capsys):
    """Every record an empty text (its first record passes the start-up check): nothing to train on is one line at
    the first batch, nothing saved."""
    path = str(tmp_path / "empty.array_record")
    write_array_record(path, [example_bytes("", "text")] * 5)
    argv = args(TINY, GRAIN, [f"grain_train_files={path}", f"base_output_directory={tmp_path}", "run_name=empty",
                              "steps=3"])
    code, errors, err = run(argv, capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "has no document with tokens" in errors[0] and "stopped before step 1" in errors[0], errors[0]
    assert not os.path.exists(tmp_path / "empty" / "checkpoints") or not os.listdir(tmp_path / "empty" /
                                                                                     "checkpoints")


def test_a_parquet_row_past_the_checked_ones_is_named_by_file_and_row(tmp_path, capsys):
    """dataset_type=hf: the start-up check reads each file's first rows; a later row of token ids beyond the
    vocabulary is named by its file and row, and checkpointing off says so in the same line."""
    rows = [good(i) for i in range(RECORDS)]
    rows[100] = [5, 999]
    path = str(tmp_path / "train.parquet")
    write_parquet(path, rows, "ids")
    assert pq.read_table(path).column("ids").to_pylist()[100] == [5, 999]
    argv = args(TINY, GRAIN, ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={path}",
                              "train_data_columns=[ids]", f"base_output_directory={tmp_path}", "run_name=hf",
                              "steps=20", "enable_checkpointing=false"])
    code, errors, err = run(argv, capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"hf_train_files: {path}, row 100: a pre-tokenized document holds id 999" in errors[0], errors[0]
    assert "(enable_checkpointing=false: not saved)" in errors[0], errors[0]


def test_the_position_is_unchanged_by_a_batch_given_up(tmp_path):
    """The pipeline itself: a batch that meets bad data raises DataError and leaves state() where the batch began,
    and the next call tries the same documents again (here still bad: the same error)."""
    from MaxText.data import make_data
    from MaxText.data.records import DataError
    from tests.tiny import tiny_config

    path, index = grain_file(tmp_path / "ids.array_record", example_bytes([5, 400], "ids"))
    cfg = tiny_config(*GRAIN, f"grain_train_files={path}", "train_data_columns=[ids]")
    data = make_data(cfg, 16)
    states = [data.state()]
    with pytest.raises(DataError) as first:
        for _ in range(8):
            next(data)
            states.append(data.state())
    assert data.state() == states[-1] and len(states) == 4, (data.state(), states)
    with pytest.raises(DataError) as again:
        next(data)
    assert str(again.value) == str(first.value) and f"record {index}" in str(first.value)

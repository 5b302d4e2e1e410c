"""The document pipelines (tfds, grain, hf), one set of tests run on each over the same tiny corpus
(tests/corpora.py): packing against an obviously-right reference packer, per-process sharding, seeded order,
exact resumption (across epochs too), eval padding, the three tokenizers, the errors a user can cause; then
tfds's own errors and the python_stdlib builder on a small fake standard library."""

import collections
import io
import json
import sys
import zlib

import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.data import make_data, python_stdlib, tfds_data, validate
from MaxText.data.records import BATCH_KEYS as KEYS
from MaxText.data.tfds_data import TfdsData
from MaxText.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.corpora import EVAL_DOCS, L, PIPELINES, TRAIN_DOCS, Corpus, config_args, make_documents, write  # noqa: F401
from tests.tiny import tiny_config

@pytest.fixture(scope="module", params=PIPELINES)
def corpus(request, tmp_path_factory) -> Corpus:
    """The shared tiny corpus written for each document pipeline in turn: every test taking it runs on tfds,
    grain and hf."""
    return Corpus(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The corpus as a TFDS dataset (for the tfds-only tests)."""
    root = str(tmp_path_factory.mktemp("tfds"))
    write("tfds", root)
    return root


def config(data_dir, *overrides):
    """The tfds corpus in data_dir."""
    return tiny_config(*config_args("tfds", data_dir), *overrides)


def records(it, epoch: int):
    """A pipeline's records of epoch `epoch`'s order, without the (file, row) a pipeline may pair them with."""
    for record in it.epoch_records(epoch):
        yield record[0] if isinstance(record, tuple) else record


def texts(it, epoch: int) -> list[str]:
    """The documents of epoch `epoch` of a pipeline's stream, in order, as text (pre-tokenized ones decoded)."""
    out = []
    for record in records(it, it.order_epoch(epoch)):
        if isinstance(record, bytes):
            record = record.decode("utf-8", errors="replace")
        out.append(record if isinstance(record, str) else it.tokenizer.decode(record))
    return out


def take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def reference_rows(token_docs, bos: list, eos: list) -> dict[str, np.ndarray]:
    """Obviously-right packing: every document's pairs in one stream, cut every L; only full rows."""
    inputs, targets, doc = [], [], []
    for i, tokens in enumerate(token_docs):
        seq = bos + list(tokens) + eos
        if len(tokens) and len(seq) > 1:
            inputs += seq[:-1]
            targets += seq[1:]
            doc += [i] * (len(seq) - 1)
    segment, position = [], []
    for j in range(len(doc)):
        new = j % L == 0 or doc[j] != doc[j - 1]
        segment.append(1 if j % L == 0 else segment[-1] + new)
        position.append(0 if new else position[-1] + 1)
    rows = len(doc) // L
    out = {k: np.array(v[:rows * L], np.int32).reshape(rows, L) for k, v in (
        ("inputs", inputs), ("targets", targets), ("inputs_position", position), ("inputs_segmentation", segment))}
    out["targets_segmentation"] = out["inputs_segmentation"]
    return out


def stacked(batches) -> dict[str, np.ndarray]:
    """The rows of consecutive batches, in stream order."""
    return {k: np.concatenate([b[k] for b in batches]) for k in KEYS}


def recovered_documents(rows, tokenizer, bos=1) -> list[str]:
    """The texts of the documents in packed rows, read from the inputs alone: a document starts at its BOS and
    its pieces in later rows continue it. Only with add_bos."""
    docs = []
    for r in range(len(rows["inputs"])):
        seg_L, in_L = rows["inputs_segmentation"][r], rows["inputs"][r]
        for s in range(1, seg_L.max() + 1):
            piece = in_L[seg_L == s]
            if piece[0] == bos:
                docs.append(list(piece[1:]))
            else:
                assert s == 1 and docs, f"row {r} segment {s} neither starts a document nor continues one: {piece}"
                docs[-1] += list(piece)
    return [tokenizer.decode(d) for d in docs]


def nonempty(docs):
    return collections.Counter(d for d in docs if d)


def one_line_error(match, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), f"ConfigError is not one line: {e.value!r}"
    return str(e.value)


# ----------------------------------------------------------------------------------------------- packing
# Every test taking `corpus` runs once per document pipeline (tfds, grain, hf) on the same documents.


@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (False, True), (True, False), (False, False)])
def test_packing_matches_reference(corpus, add_bos, add_eos):
    cfg = corpus.config(f"add_bos={add_bos}", f"add_eos={add_eos}")
    it = make_data(cfg, global_batch=2)
    tokenizer = load_tokenizer(cfg)
    order = texts(it, 0)
    assert nonempty(order) == nonempty(TRAIN_DOCS), "epoch 0 is not the train split"
    want = reference_rows([tokenizer.encode(t) for t in order], [1] * add_bos, [2] * add_eos)
    got = stacked(take(it, len(want["inputs"]) // 2))
    for k in KEYS:
        np.testing.assert_array_equal(got[k], want[k][:len(got[k])], err_msg=f"{corpus}: {k} (add_bos={add_bos}, "
                                      f"add_eos={add_eos}) differs from the reference packing")


def epoch_rows(it) -> dict[str, np.ndarray]:
    """The rows of the batches an iterator returns while its state is in epoch 0."""
    batches = []
    while it.state()["epoch"] == 0:
        batches.append(next(it))
    return stacked(batches)


def test_packing_recovers_every_document_once(corpus):
    rows = epoch_rows(make_data(corpus.config(), 4))
    assert rows["inputs"].shape[1] == L and (rows["inputs_segmentation"] > 0).all(), "train rows hold padding"
    np.testing.assert_array_equal(rows["targets_segmentation"], rows["inputs_segmentation"])
    docs = recovered_documents(rows, ByteTokenizer())
    epoch0 = docs[:len(nonempty(TRAIN_DOCS))]
    assert collections.Counter(epoch0) == nonempty(TRAIN_DOCS), f"{corpus}: epoch 0 lost, repeated or altered documents"
    seg, pos, inp, tgt = (rows[k] for k in ("inputs_segmentation", "inputs_position", "inputs", "targets"))
    starts = np.ones_like(seg, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    np.testing.assert_array_equal(pos == 0, starts, err_msg="positions do not restart exactly at each segment")
    same = ~starts[:, 1:]
    np.testing.assert_array_equal(tgt[:, :-1][same], inp[:, 1:][same], err_msg="targets are not inputs shifted")
    assert (inp[:, 1:][starts[:, 1:]] == 1).all(), "a segment that starts inside a row does not start with BOS"
    ends_inside = seg[:, :-1] != seg[:, 1:]
    assert (tgt[:, :-1][ends_inside] == 2).all(), "a segment that ends inside a row does not end with EOS"


def test_process_shards_are_disjoint_and_cover_the_split(corpus):
    cfg = corpus.config()
    seen = []
    for p in range(2):
        it = make_data(cfg, 4, p, 2)
        rows = epoch_rows(it)
        assert rows["inputs"].shape[1:] == (L,) and next(it)["inputs"].shape == (2, L), f"process {p} rows"
        docs = recovered_documents(rows, ByteTokenizer())
        seen.append(collections.Counter(docs[:len(nonempty(texts(it, 0)))]))
    assert not set(seen[0]) & set(seen[1]), f"{corpus}: both processes read {set(seen[0]) & set(seen[1])}"
    assert seen[0] + seen[1] == nonempty(TRAIN_DOCS), f"{corpus}: the two processes' documents are not the split"


# ----------------------------------------------------------------------------------------------- order


def test_seeded_order(corpus):
    a, b = (make_data(corpus.config(), 8) for _ in range(2))
    for i, (x, y) in enumerate(zip(take(a, 12), take(b, 12))):  # ~1.3 epochs
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"{corpus} batch {i} {k}: same seed, different batches")
    other = make_data(corpus.config("data_shuffle_seed=1"), 2)
    assert texts(other, 0) != texts(a, 0), f"{corpus}: data_shuffle_seed does not change the order"
    assert texts(a, 1) != texts(a, 0), f"{corpus}: epoch 1 repeats epoch 0's order"


def test_resume_continues_exactly(corpus):
    cfg = corpus.config()
    it = make_data(cfg, 8)
    states, batches = [it.state()], []
    for _ in range(30):  # ~3 epochs
        batches.append(next(it))
        states.append(it.state())
    mid_document = [i for i, s in enumerate(states[:-4]) if s["offset"] > 0]
    across_epochs = [i for i, s in enumerate(states[:-4]) if s["epoch"] == 0 and states[i + 1]["epoch"] == 1]
    later_epoch = [i for i, s in enumerate(states[:-4]) if s["epoch"] == 1]
    assert mid_document and across_epochs and later_epoch, f"cut points not covered: {states}"
    cuts = {0, mid_document[0], across_epochs[0], later_epoch[0], later_epoch[-1]}
    for cut in sorted(cuts):
        state = json.loads(json.dumps(states[cut]))
        resumed = make_data(cfg, 8, state=state)
        for i in range(cut, cut + 4):
            got = next(resumed)
            for k in KEYS:
                np.testing.assert_array_equal(got[k], batches[i][k],
                                              err_msg=f"{corpus} resumed at {states[cut]}: batch {i} {k} differs")
            assert resumed.state() == states[i + 1], f"{corpus} resumed at {states[cut]}: state after batch {i}"


# ----------------------------------------------------------------------------------------------- eval


def test_eval_is_fixed_then_padding(corpus):
    cfg = corpus.config()
    runs = [stacked(take(make_data(cfg, 2, split="eval"), 12)) for _ in range(2)]
    for k in KEYS:
        np.testing.assert_array_equal(runs[0][k], runs[1][k], err_msg=f"{corpus}: eval {k} differs between "
                                                                      "constructions")
    rows = runs[0]
    used = rows["inputs_segmentation"] > 0
    n = used.sum()
    assert used.reshape(-1)[:n].all() and not used.reshape(-1)[n:].any(), "eval padding is not all at the end"
    for k in KEYS:
        assert not rows[k].reshape(-1)[n:].any(), f"eval padding has non-zero {k}"
    full_rows = n // L
    assert full_rows < len(rows["inputs"]) - 1, "12 eval batches did not exhaust the split; the test needs more"
    docs = recovered_documents({k: v[:full_rows + 1] for k, v in rows.items()}, ByteTokenizer())
    assert collections.Counter(docs) == nonempty(EVAL_DOCS), f"{corpus}: eval did not read the validation split once"


def test_eval_steps_minus_one_reads_the_whole_split_once(corpus):
    """eval_steps=-1 (MaxText's "the whole eval split"): the evaluator takes batches up to the first all-padding
    one: every eval document once, no padding batch."""
    from MaxText.trainer.evaluation import whole_split

    batches = whole_split(make_data(corpus.config("eval_steps=-1"), 2, split="eval"))
    assert batches and all(b["targets_segmentation"].any() for b in batches)
    docs = recovered_documents(stacked(batches), ByteTokenizer())
    assert collections.Counter(docs) == nonempty(EVAL_DOCS), f"{corpus}: eval_steps=-1 did not read the split once"


# ----------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓ 𝄞'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 3 and ids.max() < tok.vocab_size, f"ids out of range: {ids}"
    assert len(ids) == len(text.encode()), "not one id per UTF-8 byte"
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text


def sentencepiece_model(tmp_path) -> str:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter([d for d in TRAIN_DOCS if d]), model_writer=model,
                                             vocab_size=64, model_type="bpe", character_coverage=1.0,
                                             hard_vocab_limit=False, minloglevel=2)
    path = tmp_path / "tiny.model"
    path.write_bytes(model.getvalue())
    return str(path)


def test_sentencepiece_tokenizer_packs(corpus, tmp_path):
    cfg = corpus.config(f"tokenizer_path={sentencepiece_model(tmp_path)}")
    tok = load_tokenizer(cfg)
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size <= 64
    assert_round_trip_and_packing(cfg, tok, f"{corpus} SentencePiece")


def assert_round_trip_and_packing(cfg, tok, name):
    """tok decodes its own encoding, and the pipeline packs its ids like the reference packer."""
    assert tok.decode(tok.encode(TRAIN_DOCS[0])) == TRAIN_DOCS[0]
    it = make_data(cfg, 2)
    # A pipeline that tokenizes while it reads (grain) hands over token arrays; the others, text.
    tokens = [r if not isinstance(r, (str, bytes)) else tok.encode(r if isinstance(r, str) else r.decode())
              for r in records(it, 0)]
    want = reference_rows(tokens, [tok.bos_id], [tok.eos_id])
    got = stacked(take(it, 2))
    for k in KEYS:
        np.testing.assert_array_equal(got[k], want[k][:4], err_msg=f"{name} packing: {k}")


def hf_tokenizer(tmp_path, specials=("<unk>", "<s>", "</s>")) -> str:
    import tokenizers

    words = sorted({w for d in TRAIN_DOCS for w in d.split()})
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate([*specials, *words])}, unk_token=specials[0])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def test_hugging_face_tokenizer_packs(corpus, tmp_path):
    cfg = corpus.config(f"tokenizer_path={hf_tokenizer(tmp_path)}")
    tok = load_tokenizer(cfg)
    assert (tok.bos_id, tok.eos_id) == (1, 2), f"<s>/</s> not found: {tok.bos_id}, {tok.eos_id}"
    assert_round_trip_and_packing(cfg, tok, f"{corpus} Hugging Face")


def test_hugging_face_tokenizer_without_bos(data_dir, tmp_path):
    path = hf_tokenizer(tmp_path, specials=("<unk>",))
    one_line_error(r"add_bos=true but tokenizer_path=.*tokenizer.json has no BOS", load_tokenizer,
                   config(data_dir, f"tokenizer_path={path}"))
    tok = load_tokenizer(config(data_dir, f"tokenizer_path={path}", "add_bos=false", "add_eos=false"))
    assert tok.bos_id is None and tok.eos_id is None


# ----------------------------------------------------------------------------------------------- errors


def test_default_data_dir(data_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert python_stdlib.default_data_dir() == "/cache/maxtext_moe/tensorflow_datasets"
    assert tfds_data.data_dir(config("null")) == "/cache/maxtext_moe/tensorflow_datasets"
    assert tfds_data.data_dir(config(data_dir)) == data_dir


def test_unprepared_dataset_errors(data_dir, tmp_path, no_network):
    missing = tmp_path / "nowhere"
    msg = one_line_error("dataset_name=maxtext_test_docs is not prepared", validate, config(missing))
    assert str(missing) in msg and "nothing is downloaded" in msg, msg
    msg = one_line_error("dataset_name=mnist is not prepared", validate,
                         config(tmp_path, "dataset_name=mnist"))
    assert f"tfds build mnist --data_dir {tmp_path}" in msg, msg
    one_line_error("dataset_name=no_such_dataset_xyz: TFDS has no such dataset", validate,
                   config(tmp_path, "dataset_name=no_such_dataset_xyz"))


# What points each pipeline at files that are not there, and the key its error must name.
MISSING = {"tfds": ("dataset_path={missing}", "dataset_name=maxtext_test_docs"),
           "grain": ("grain_train_files={missing}/train-*.array_record", "grain_train_files="),
           "hf": ("hf_train_files={missing}/train-*.parquet", "hf_train_files=")}


def test_missing_files_error_in_one_line(corpus, tmp_path, no_network):
    override, key = MISSING[corpus.kind]
    missing = tmp_path / "nowhere"
    msg = one_line_error(key, validate, corpus.config(override.format(missing=missing)))
    assert str(missing) in msg, f"{corpus}: the error does not name the path: {msg}"


def test_wrong_text_column_errors_in_one_line(corpus):
    msg = one_line_error(r"train_data_columns=\[body\]", validate, corpus.config("train_data_columns=[body]"))
    assert "text" in msg, f"{corpus}: the error does not list the columns there are: {msg}"
    one_line_error(r"eval_data_columns=\[body\]", validate, corpus.config("eval_data_columns=[body]",
                                                                          "eval_interval=10"))
    validate(corpus.config("eval_data_columns=[body]", "eval_interval=-1"))  # no eval: its column is not needed
    one_line_error("documents are read from one column", validate, corpus.config("train_data_columns=[text,body]"))


def test_tokenizer_errors(corpus, tmp_path):
    missing = tmp_path / "missing.model"
    one_line_error(f"tokenizer_path={missing} does not exist", validate, corpus.config(f"tokenizer_path={missing}"))
    other = tmp_path / "vocab.txt"
    other.write_text("a\n")
    one_line_error("unknown tokenizer format", load_tokenizer, corpus.config(f"tokenizer_path={other}"))
    one_line_error(r"vocab_size=64 is smaller than the 259 ids .*; set vocab_size >= 259", validate,
                   corpus.config("vocab_size=64"))


def test_empty_shard_errors_in_one_line(corpus, tmp_path):
    """A file of the split with no records (an interrupted conversion, say) is named, not silently read past."""
    if corpus.kind == "tfds":
        pytest.skip("TFDS writes and checks its own shards")
    import shutil

    root = tmp_path / "corpus"
    shutil.copytree(corpus.root, root)
    suffix = "array_record" if corpus.kind == "grain" else "parquet"
    empty = root / f"train-00003-of-00003.{suffix}"
    if corpus.kind == "grain":
        from tests.corpora import write_array_record
        write_array_record(str(empty), [])
    else:
        from tests.corpora import write_parquet
        write_parquet(str(empty), [])
    moved = Corpus.__new__(Corpus)
    moved.kind, moved.root = corpus.kind, str(root)
    msg = one_line_error("", validate, moved.config())
    assert str(empty) in msg, f"{corpus}: the error does not name the empty file: {msg}"


def test_split_errors(data_dir):
    one_line_error(r"train_split=nope: dataset maxtext_test_docs has splits train, validation", validate,
                   config(data_dir, "train_split=nope"))
    one_line_error("eval_split=nope", validate, config(data_dir, "eval_split=nope", "eval_interval=10"))
    validate(config(data_dir, "eval_split=nope", "eval_interval=-1"))  # no eval: its split is not needed
    validate(config(data_dir, "train_split=train[:50%]", "eval_interval=10"))


# ----------------------------------------------------------------------------------------------- python_stdlib


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A 7-file standard library (two of them in validation) plus files the builder must leave out."""
    root = tmp_path / "lib"
    names = [f"mod{i}.py" for i in range(400)]
    val = [n for n in names if zlib.crc32(n.encode()) % 50 == 0][:2]
    files = {n: f"x = {i}\n" for i, n in enumerate(val + names[:4])}
    files["pkg/sub/deep.py"] = "def f():\n    return 'ünïcode'\n"
    for rel, text in {**files, "site-packages/a.py": "skip", "pkg/__pycache__/b.py": "skip",
                      "notes.txt": "skip"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "bad_bytes.py").write_bytes(b"s = '\xff'\n")
    files["bad_bytes.py"] = "s = '\ufffd'\n"
    monkeypatch.setattr(python_stdlib.PythonStdlib, "stdlib_root", str(root))
    return files


def test_python_stdlib_builder(fake_stdlib, tmp_path):
    assert set(python_stdlib.relative_sources(str(tmp_path / "lib"))) == set(fake_stdlib)
    data = str(tmp_path / "data")
    logged = []
    builder = python_stdlib.build(data, log=logged.append)
    assert len(logged) == 1 and "building the python_stdlib dataset" in logged[0], logged
    python_stdlib.build(data, log=logged.append)
    assert len(logged) == 1, f"rebuilt although prepared: {logged}"
    assert builder.builder_config.name.startswith("py3_")
    for split in ("train", "validation"):
        got = {e["path"].decode(): e["text"].decode() for e in builder.as_dataset(split=split).as_numpy_iterator()}
        want = {p: t for p, t in fake_stdlib.items() if python_stdlib.split_of(p) == split}
        assert got == want, f"{split} split"
    stats = python_stdlib.summary(builder)
    train = [t for p, t in fake_stdlib.items() if python_stdlib.split_of(p) == "train"]
    counts = np.bincount(np.concatenate([ByteTokenizer().encode(t) for t in train] + [[2] * len(train)]))
    p = counts[counts > 0] / counts.sum()
    np.testing.assert_allclose(stats["train"]["unigram_entropy"], -(p * np.log(p)).sum(), rtol=1e-9)
    want = {"train": len(train), "validation": len(fake_stdlib) - len(train)}
    assert {k: v["documents"] for k, v in stats.items()} == want and want["validation"] > 0, stats

    cfg = tiny_config("dataset_type=tfds", "dataset_name=python_stdlib", f"dataset_path={data}", "vocab_size=259",
                      "max_target_length=8")
    validate(cfg)
    it = make_data(cfg, 2)
    rows = stacked(take(it, 8))
    docs = recovered_documents({k: v[:-1] for k, v in rows.items()}, ByteTokenizer())
    assert set(docs[:-1]) <= set(train), f"decoded rows are not the train sources: {docs}"
    for doc in docs[:-1]:
        compile(doc, "<doc>", "exec")


def test_real_stdlib_listing():
    paths = python_stdlib.relative_sources(python_stdlib.PythonStdlib.stdlib_root)
    assert "os.py" in paths and "json/decoder.py" in paths and paths == sorted(paths)
    excluded = [p for p in paths if set(p.split("/")) & set(python_stdlib.EXCLUDED_DIRS)]
    assert not excluded, f"excluded directories listed: {excluded[:5]}"
    assert python_stdlib.INTERPRETER_CONFIG == "py" + "_".join(map(str, sys.version_info[:3]))


def test_stdlib_files_are_cut_between_top_level_statements():
    """Each piece is whole top-level statements (decorators stay with their definition), at least
    DOCUMENT_CHARS long but the last, and compiles; the pieces join back to the file. Unparsable text
    (Python 2) stays whole."""
    root = python_stdlib.PythonStdlib.stdlib_root
    for rel in ("os.py", "argparse.py", "email/message.py", "dataclasses.py"):
        with open(f"{root}/{rel}", encoding="utf-8") as f:
            text = f.read()
        docs = python_stdlib.documents(text)
        assert "".join(docs) == text, rel
        assert len(docs) > 3 and all(len(d) >= python_stdlib.DOCUMENT_CHARS for d in docs[:-1]), (rel, len(docs))
        for i, doc in enumerate(docs):
            compile(doc, f"{rel} piece {i}", "exec")
    decorated = f"x = '{'a' * 2500}'\n" + "@property\n\n@staticmethod\ndef f():\n    return 1\n"
    docs = python_stdlib.documents(decorated)
    assert len(docs) == 2 and docs[1].startswith("@property"), docs[1][:40]
    assert python_stdlib.documents("print 'python 2'\n" * 300) == ["print 'python 2'\n" * 300]


def test_python_stdlib_concurrent_builds_build_once(fake_stdlib, tmp_path):
    """Processes of one job starting together (threads here: the file lock excludes them the same way)
    build the dataset once; every one gets the prepared dataset."""
    import threading

    data, logged, builders = str(tmp_path / "data"), [], []
    threads = [threading.Thread(target=lambda: builders.append(python_stdlib.build(data, log=logged.append)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(logged) == 1, logged
    assert len(builders) == 3 and all(b.is_prepared() for b in builders)

"""Every command's mistakes are one line: the converters (MaxText/utils/ckpt_conversion: to_maxtext, to_huggingface,
to_upstream, from_upstream, check), MaxText.forward, MaxText.plan, MaxText.preflight, MaxText.report and
MaxText.data.to_array_record exit 2 with a single `error:` line on stderr, no traceback, for an input that is
missing, a directory where a file is needed (or the other way round), a file of garbage, a checkpoint of another
family, and an output path that is a file, lies beneath one or is on a filesystem that takes no new file; and
they write nothing (the test's directory is the same byte for byte afterwards). A value of 100,000 characters
gives a line of at most 1000 that says the value's size. Each command runs in-process through its own main()."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from MaxText.trainer import forward, report
from MaxText import plan as plan_command
from MaxText.planning import preflight
from MaxText.data import to_array_record
from MaxText.utils.ckpt_conversion import check, from_upstream, to_huggingface, to_maxtext, to_upstream
from tests import hf_tiny
from tests.tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM = os.path.join(ROOT, "tests", "data", "maxtext-0.2.5")
COMMON = ["configs/base.yml", "dtype=float32", "enable_tensorboard=false", "dataset_type=synthetic",
          "max_target_length=16"]
HUGE = "h" * 100_000
LINE_LIMIT = 1000
BERT = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Good inputs, made once and only read by the cases: a tiny Mixtral Hugging Face directory and its import."""
    base = tmp_path_factory.mktemp("inputs")
    config, tensors = hf_tiny.mixtral_or_qwen3("mixtral")
    hf_tiny.write_checkpoint(base / "hf", config, tensors)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        items = to_maxtext.convert([*COMMON, f"hf_model_path={base / 'hf'}", f"base_output_directory={base / 'ours'}"],
                                   log=lambda *_: None)
    finally:
        os.chdir(cwd)
    return {"hf": str(base / "hf"), "items": items, "model": str(base / "ours" / "model.yml")}


def _upstream(case: str) -> tuple[list[str], str]:
    """(this trainer's keys for an upstream-written case, its item directory)."""
    with open(os.path.join(UPSTREAM, "checkpoints", "cases.json")) as f:
        keys = json.load(f)[case]["keys"]
    keys = [f"model_name={UPSTREAM}/models/{k.split('=', 1)[1]}.yml" if k.startswith("model_name=") else k
            for k in keys]
    return [*[a for a in COMMON if not a.startswith("dtype=")], *keys], os.path.join(UPSTREAM, "checkpoints", case,
                                                                                    "0", "items")


# ---------------------------------------------------------------------------------------------- inputs written


def _config_json(name, content):
    """A directory <tmp>/<name> holding config.json: a dict as JSON, or raw bytes."""
    def write(p):
        os.makedirs(os.path.join(p.tmp, name))
        raw = content if isinstance(content, bytes) else json.dumps(content).encode()
        with open(os.path.join(p.tmp, name, "config.json"), "wb") as f:
            f.write(raw)
    return write


def _hf_copy_with_index(raw: bytes):
    """<tmp>/hf: the good checkpoint with model.safetensors.index.json replaced by `raw`."""
    def write(p):
        shutil.copytree(p.hf, os.path.join(p.tmp, "hf"))
        with open(os.path.join(p.tmp, "hf", "model.safetensors.index.json"), "wb") as f:
            f.write(raw)
    return write


def _metadata(raw: bytes):
    """<tmp>/items: an item directory whose _METADATA is `raw`."""
    def write(p):
        os.makedirs(os.path.join(p.tmp, "items"))
        with open(os.path.join(p.tmp, "items", "_METADATA"), "wb") as f:
            f.write(raw)
    return write


def _file(name, raw: bytes):
    def write(p):
        with open(os.path.join(p.tmp, name), "wb") as f:
            f.write(raw)
    return write


def _rows(p):
    np.save(os.path.join(p.tmp, "rows.npy"), np.arange(8, dtype=np.int32).reshape(2, 4))


def _rows_and_dir(p):
    _rows(p)
    os.makedirs(os.path.join(p.tmp, "out.npy"))


def _run_dir(p):
    """<tmp>/run: a run directory with two train records."""
    os.makedirs(os.path.join(p.tmp, "run", "metrics"))
    with open(os.path.join(p.tmp, "run", "metrics", "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')


def _garbage_metrics(p):
    os.makedirs(os.path.join(p.tmp, "run", "metrics"))
    with open(os.path.join(p.tmp, "run", "metrics", "metrics.jsonl"), "wb") as f:
        f.write(b'{"step": 1, "loss": 3.0}\n\xff\xfe\x00\x9c garbage\n')


def _parquet(p):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one document", "another"]}), os.path.join(p.tmp, "docs.parquet"))


def _none(p):
    pass


# ---------------------------------------------------------------------------------------------- the cases

def _tm(p, *args):
    return [*COMMON, *args]


def _th(p, *args):
    return [*COMMON, f"model_name={p.model}", f"load_parameters_path={p.items}", *args]


def _up(p, *args):
    return [*COMMON, f"model_name={p.model}", f"load_parameters_path={p.items}", *args]


def _ck(p, *args, model=None):
    return [*COMMON, f"model_name={model or p.model}", f"load_parameters_path={p.items}", f"hf_model_path={p.hf}",
            *args]


def _fu(case, *args):
    keys, items = _upstream(case)
    return [*keys, f"load_parameters_path={items}", *args]


def _fw(p, *args):
    return [*TINY, *args]


OUT = "base_output_directory"

# (label, command's main, writes its inputs, argv of p, phrase the line holds (formatted with p), output that must
# not appear afterwards (formatted with p; None: the output is the test's existing file, checked byte for byte))
CASES = [
    # MaxText.utils.ckpt_conversion.to_maxtext: Hugging Face -> this trainer
    ("hf import: directory missing", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.tmp}/nope", f"{OUT}={p.tmp}/out"),
     "hf_model_path={tmp}/nope does not exist", "{tmp}/out"),
    ("hf import: a file for the directory", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.file}", f"{OUT}={p.tmp}/out"),
     "hf_model_path={file} is a file, not a directory", "{tmp}/out"),
    ("hf import: config.json of garbage bytes", to_maxtext.main, _config_json("bad", b"\xff\xfe\x00garbage"),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/bad", f"{OUT}={p.tmp}/out"),
     "{tmp}/bad/config.json is not valid JSON", "{tmp}/out"),
    ("hf import: config.json not an object", to_maxtext.main, _config_json("list", b"[1, 2, 3]"),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/list", f"{OUT}={p.tmp}/out"),
     "{tmp}/list/config.json holds a list, not a JSON object", "{tmp}/out"),
    ("hf import: config.json nested past the parser", to_maxtext.main, _config_json("deep", b"[" * 100_000),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/deep", f"{OUT}={p.tmp}/out"),
     "{tmp}/deep/config.json is not valid JSON", "{tmp}/out"),
    ("hf import: BERT's config.json", to_maxtext.main, _config_json("bert", BERT),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/bert", f"{OUT}={p.tmp}/out"),
     "model_type='bert' is not one this trainer imports (mixtral, qwen3_moe, deepseek_v3, deepseek_v2)",
     "{tmp}/out"),
    ("hf import: model_type not a string", to_maxtext.main, _config_json("typed", {**BERT, "model_type": ["mixtral"]}),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/typed", f"{OUT}={p.tmp}/out"),
     "model_type=['mixtral'] is not one this trainer imports", "{tmp}/out"),
    ("hf import: a 100000-character model_type", to_maxtext.main, _config_json("huge", {**BERT, "model_type": HUGE}),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/huge", f"{OUT}={p.tmp}/out"),
     "(100002 characters) is not one this trainer imports", "{tmp}/out"),
    ("hf import: index of garbage bytes", to_maxtext.main, _hf_copy_with_index(b"\x00\xffnot json"),
     lambda p: _tm(p, f"hf_model_path={p.tmp}/hf", f"{OUT}={p.tmp}/out"),
     "{tmp}/hf/model.safetensors.index.json is not valid JSON", "{tmp}/out"),
    ("hf import: Mixtral under a Qwen3 model_name", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.hf}", f"{OUT}={p.tmp}/out", "model_name=qwen3-tiny"),
     "config.json is a mixtral checkpoint but model_name=qwen3-tiny builds a qwen3_moe model", "{tmp}/out"),
    ("hf import: output is a file", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.hf}", f"{OUT}={p.file}"),
     "base_output_directory={file} is a file, not a directory", None),
    ("hf import: output beneath a file", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.hf}", f"{OUT}={p.file}/out"),
     "base_output_directory={file}/out lies beneath {file}, which is a file", "{file}/out"),
    ("hf import: output on /proc", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.hf}", f"{OUT}=/proc/maxtext_out"),
     "base_output_directory=/proc/maxtext_out: cannot write in /proc", "/proc/maxtext_out"),
    ("hf import: a 100000-character path", to_maxtext.main, _none,
     lambda p: _tm(p, f"hf_model_path={p.tmp}/{HUGE}", f"{OUT}={p.tmp}/out"),
     "({huge_len} characters) does not exist", "{tmp}/out"),
    # to_huggingface: this trainer -> Hugging Face
    ("hf export: output is a file", to_huggingface.main, _none, lambda p: _th(p, f"{OUT}={p.file}"),
     "base_output_directory={file} is a file, not a directory", None),
    ("hf export: output on /sys", to_huggingface.main, _none, lambda p: _th(p, f"{OUT}=/sys/maxtext_hf"),
     "base_output_directory=/sys/maxtext_hf: cannot write in /sys", "/sys/maxtext_hf"),
    ("hf export: a 100000-character output name", to_huggingface.main, _none,
     lambda p: _th(p, f"{OUT}={p.tmp}/{HUGE}"), "a name in it is 100000 bytes long", None),
    # to_upstream: this trainer -> upstream MaxText
    ("upstream export: output beneath a file", to_upstream.main, _none, lambda p: _up(p, f"{OUT}={p.file}/out"),
     "base_output_directory={file}/out lies beneath {file}, which is a file", "{file}/out"),
    ("upstream export: _METADATA of garbage bytes", to_upstream.main, _metadata(b"\xff\x00garbage"),
     lambda p: [*COMMON, f"model_name={p.model}", f"load_parameters_path={p.tmp}/items", f"{OUT}={p.tmp}/out"],
     "{tmp}/items/_METADATA is not valid JSON", "{tmp}/out"),
    ("upstream export: _METADATA not an object", to_upstream.main, _metadata(b'"a string"'),
     lambda p: [*COMMON, f"model_name={p.model}", f"load_parameters_path={p.tmp}/items", f"{OUT}={p.tmp}/out"],
     "{tmp}/items/_METADATA holds a str, not a JSON object", "{tmp}/out"),
    # from_upstream: upstream MaxText -> this trainer
    ("upstream import: output is a file", from_upstream.main, _none,
     lambda p: _fu("mixtral_scanned", f"{OUT}={p.file}"), "base_output_directory={file} is a file, not a directory",
     None),
    ("upstream import: Mixtral under Qwen3's keys", from_upstream.main, _none,
     lambda p: [*_upstream("qwen3_moe_scanned")[0], f"load_parameters_path={_upstream('mixtral_scanned')[1]}",
                f"{OUT}={p.tmp}/out"],
     "holds upstream's mixtral layers (MoeBlock_0) but decoder_block=qwen3_moe here", "{tmp}/out"),
    # check: the parity check against transformers (reads only)
    ("parity check: hf_model_path missing", check.main, _none,
     lambda p: [*COMMON, f"model_name={p.model}", f"load_parameters_path={p.items}", f"hf_model_path={p.tmp}/nope"],
     "hf_model_path={tmp}/nope does not exist", None),
    ("parity check: Mixtral against a Qwen3 model", check.main, _none, lambda p: _ck(p, model="qwen3-tiny"),
     "config.json is a mixtral checkpoint but model_name=qwen3-tiny builds a qwen3_moe model", None),
    ("parity check: check_tokens of garbage", check.main, _file("rows.npy", b"\x93NUMPY garbage"),
     lambda p: _ck(p, f"check_tokens={p.tmp}/rows.npy"), "{tmp}/rows.npy: cannot read it as an .npy array", None),
    # MaxText.forward
    ("forward: --tokens missing", forward.main, _none, lambda p: _fw(p, "--tokens", f"{p.tmp}/nope.npy"),
     "--tokens {tmp}/nope.npy: cannot read it", None),
    ("forward: --tokens a directory", forward.main, _none, lambda p: _fw(p, "--tokens", p.tmp),
     "--tokens {tmp}: cannot read it", None),
    ("forward: --logits_out a directory", forward.main, _rows_and_dir,
     lambda p: _fw(p, "--tokens", f"{p.tmp}/rows.npy", "--logits_out", f"{p.tmp}/out.npy"),
     "--logits_out={tmp}/out.npy is a directory", None),
    ("forward: --logits_out beneath a file", forward.main, _rows,
     lambda p: _fw(p, "--tokens", f"{p.tmp}/rows.npy", "--logits_out", f"{p.file}/out.npy"),
     "--logits_out={file}/out.npy lies beneath {file}, which is a file", "{file}/out.npy"),
    ("forward: a 100000-character --tokens", forward.main, _none, lambda p: _fw(p, "--tokens", f"{p.tmp}/{HUGE}"),
     "({huge_len} characters): cannot read it", None),
    # MaxText.plan
    ("plan: --collectives missing", plan_command.main, _none, lambda p: ["configs/base.yml", f"--collectives={p.tmp}/nope"],
     "--collectives={tmp}/nope: not the JSON of", None),
    ("plan: --collectives of garbage bytes", plan_command.main, _file("low.json", b"\xff\xfe\x00\x01"),
     lambda p: ["configs/base.yml", f"--collectives={p.tmp}/low.json"], "--collectives={tmp}/low.json: not the JSON",
     None),
    ("plan: a 100000-character config path", plan_command.main, _none, lambda p: [f"{p.tmp}/{HUGE}.yml"],
     "({huge_len_yml} characters) does not exist", None),
    ("plan: a 100000-character --collectives", plan_command.main, _none,
     lambda p: ["configs/base.yml", f"--collectives={p.tmp}/{HUGE}"], "({huge_len} characters): not the JSON", None),
    # MaxText.preflight
    ("preflight: recipe missing", preflight.main, _none, lambda p: [f"{p.tmp}/nope.yml", "--no-lowering"],
     "config file {tmp}/nope.yml does not exist", None),
    ("preflight: recipe of garbage bytes", preflight.main, _file("bad.yml", b"\xff\xfe\x00garbage"),
     lambda p: [f"{p.tmp}/bad.yml", "--no-lowering"], "config file {tmp}/bad.yml is not UTF-8 text", None),
    ("preflight: a 100000-character recipe path", preflight.main, _none,
     lambda p: [f"{p.tmp}/{HUGE}.yml", "--no-lowering"], "({huge_len_yml} characters) does not exist", None),
    ("preflight: a 100000-digit --tasks-per-node", preflight.main, _none,
     lambda p: ["configs/base.yml", "--tasks-per-node", "9" * 100_000], "(100000 characters)", None),
    # MaxText.report
    ("report: run directory missing", report.main, _none, lambda p: [f"{p.tmp}/nope"],
     "run directory {tmp}/nope does not exist", None),
    ("report: run directory is a file", report.main, _none, lambda p: [p.file],
     "run directory {file} is a file, not a directory", None),
    ("report: metrics.jsonl of garbage bytes", report.main, _garbage_metrics, lambda p: [f"{p.tmp}/run"],
     "{tmp}/run/metrics/metrics.jsonl, line 2: not UTF-8 text", None),
    ("report: --out is a file", report.main, _run_dir, lambda p: [f"{p.tmp}/run", "--out", p.file],
     "--out={file} is a file, not a directory", None),
    ("report: --out on /sys", report.main, _run_dir, lambda p: [f"{p.tmp}/run", "--out", "/sys/maxtext_report"],
     "--out=/sys/maxtext_report: cannot write in /sys", "/sys/maxtext_report"),
    ("report: a 100000-character run directory", report.main, _none, lambda p: [f"{p.tmp}/{HUGE}"],
     "({huge_len} characters) does not exist", None),
    # MaxText.data.to_array_record
    ("to_array_record: no such Parquet file", to_array_record.main, _none,
     lambda p: [f"{p.tmp}/nope.parquet", f"{p.tmp}/out"], "no file matches {tmp}/nope.parquet", "{tmp}/out"),
    ("to_array_record: Parquet of garbage bytes", to_array_record.main, _file("bad.parquet", b"PAR1 garbage"),
     lambda p: [f"{p.tmp}/bad.parquet", f"{p.tmp}/out"], "{tmp}/bad.parquet is not a readable Parquet file",
     "{tmp}/out"),
    ("to_array_record: out_dir is a file", to_array_record.main, _parquet,
     lambda p: [f"{p.tmp}/docs.parquet", p.file], "out_dir={file} is a file, not a directory", None),
    ("to_array_record: out_dir beneath a file", to_array_record.main, _parquet,
     lambda p: [f"{p.tmp}/docs.parquet", f"{p.file}/out"], "out_dir={file}/out lies beneath {file}, which is a file",
     "{file}/out"),
    ("to_array_record: out_dir on /proc", to_array_record.main, _parquet,
     lambda p: [f"{p.tmp}/docs.parquet", "/proc/maxtext_records"], "out_dir=/proc/maxtext_records: cannot write in",
     "/proc/maxtext_records"),
    ("to_array_record: a 100000-character source", to_array_record.main, _none,
     lambda p: [f"{p.tmp}/{HUGE}.parquet", f"{p.tmp}/out"], "({huge_len_parquet} characters)", "{tmp}/out"),
]


def _tree(root: str) -> dict:
    """{relative path: bytes of a file, or None for a directory} of everything under root."""
    out = {}
    for where, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(where, d), root)] = None
        for f in files:
            with open(os.path.join(where, f), "rb") as fh:
                out[os.path.relpath(os.path.join(where, f), root)] = fh.read()
    return out


@pytest.mark.parametrize("label,main,setup,argv,phrase,output", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_writes_nothing(label, main, setup, argv, phrase, output, made, tmp_path,
                                                          capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    tmp = str(tmp_path)
    p = SimpleNamespace(tmp=tmp, file=f"{tmp}/afile", huge_len=len(f"{tmp}/{HUGE}"),
                        huge_len_parquet=len(f"{tmp}/{HUGE}.parquet"), huge_len_yml=len(f"{tmp}/{HUGE}.yml"), **made)
    with open(p.file, "wb") as f:
        f.write(b"a file the user keeps\n")
    setup(p)
    before, made_before, root_before = _tree(tmp), _tree(os.path.dirname(made["hf"])), set(os.listdir(ROOT))
    beside = set(os.listdir(os.path.dirname(tmp)))  # <tmp>.partial, <tmp>.npy: written next to the test's directory
    code = main(argv(p))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (label, code, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), (label, err[-2000:])
    assert len(lines[0]) <= LINE_LIMIT, (label, len(lines[0]), lines[0][:300])
    assert phrase.format(**vars(p)) in lines[0], (label, lines[0][:LINE_LIMIT])
    assert _tree(tmp) == before, (label, "something was written", sorted(set(_tree(tmp)) ^ set(before)))
    assert _tree(os.path.dirname(made["hf"])) == made_before and set(os.listdir(ROOT)) == root_before, label
    assert set(os.listdir(os.path.dirname(tmp))) == beside, (label, set(os.listdir(os.path.dirname(tmp))) ^ beside)
    if output is not None:
        assert not os.path.lexists(output.format(**vars(p))), (label, output)


def test_the_table_covers_every_command():
    commands = {c[1] for c in CASES}
    assert commands == {to_maxtext.main, to_huggingface.main, to_upstream.main, from_upstream.main, check.main,
                        forward.main, plan_command.main, preflight.main, report.main, to_array_record.main}
    for kind in ("missing", "a file for", "garbage", "output is a file", "beneath a file", "100000"):
        assert any(kind in c[0] for c in CASES), kind

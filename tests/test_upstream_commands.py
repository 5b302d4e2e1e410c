"""Upstream MaxText's command forms: its module paths (maxtext.trainers.pre_train.train,
maxtext.checkpoint_conversion.to_maxtext / to_huggingface, through MaxText/upstream_paths and the .pth file
scripts/setup.sh writes), the older `python MaxText/train.py` form, and the converters' flags."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.utils.ckpt_conversion import upstream_flags
from tests import hf_tiny
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv, cwd=ROOT):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("form", [
    ["-m", "maxtext.trainers.pre_train.train", "src/maxtext/configs/base.yml"],
    [os.path.join(ROOT, "MaxText", "train.py"), "MaxText/configs/base.yml"],
], ids=["module path", "script path"])
def test_upstreams_training_commands_run_the_trainer(tmp_path, form):
    """Upstream's module path and its older script form, from any working directory, run `python -m MaxText.train`
    on the same arguments: its help, and its checks (a typo stops either as ours would). tests/test_train.py trains
    through python -m MaxText.train itself."""
    result = run([form[0], form[1], "--help"] if form[0] == "-m" else [form[0], "--help"], cwd=tmp_path)
    assert result.returncode == 0 and "Training entry point" in result.stdout, result.stdout + result.stderr
    result = run([*form, "stepz=1"], cwd=tmp_path)
    assert result.returncode == 2 and "unknown key 'stepz'" in result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("module, ours", [
    ("maxtext.checkpoint_conversion.to_maxtext", "Import a Hugging Face checkpoint"),
    ("maxtext.checkpoint_conversion.to_huggingface", "Export this trainer's parameters"),
])
def test_upstreams_converter_paths_are_ours(module, ours):
    result = run(["-m", module, "--help"])
    assert result.returncode == 0 and ours in result.stdout, result.stdout + result.stderr
    result = run(["-m", module, "--no_such_flag=1"])
    assert result.returncode == 2 and "--no_such_flag is not a flag of" in result.stderr, result.stderr


def test_converter_flags_read_as_this_converters_arguments():
    lines = []
    got = upstream_flags.normalize(["base.yml", "--hf_model_path=/hf", "--save_dtype", "bfloat16",
                                    "--lazy_load_tensors", "--eager_load_method=safetensors", "revision=main",
                                    "scan_layers=true"], upstream_flags.TO_MAXTEXT, "to_maxtext", lines.append,
                                   bare=True)
    assert got == ["base.yml", "hf_model_path=/hf", "weight_dtype=bfloat16", "scan_layers=true"], got
    assert sum("has no effect here" in line for line in lines) == 3, lines
    with pytest.raises(ConfigError, match="--save_dtype=float8_e4m3fn is not supported"):
        upstream_flags.normalize(["--save_dtype=float8_e4m3fn"], upstream_flags.TO_MAXTEXT, "to_maxtext", print)
    with pytest.raises(ConfigError, match="--hf_model_path needs a value"):
        upstream_flags.normalize(["--hf_model_path"], upstream_flags.TO_MAXTEXT, "to_maxtext", print)
    got = upstream_flags.normalize(["--override_model_architecture", "--hf_model_path", "/tok", "hf_model_path=x"],
                                   upstream_flags.TO_HUGGINGFACE, "to_huggingface", print)
    assert got == ["hf_tokenizer_path=/tok", "hf_model_path=x"], "to_huggingface takes its flags with dashes only"


def test_an_import_and_export_with_upstreams_flags(tmp_path):
    """to_maxtext --hf_model_path=<dir> --save_dtype=bfloat16 writes bfloat16 params of the release; to_huggingface
    --hf_model_path=<dir> bundles that directory's tokenizer files with the export."""
    from MaxText.utils.ckpt_conversion import to_huggingface, to_maxtext
    from tests.test_ckpt_conversion import COMMON, _params

    config, tensors = hf_tiny.mixtral_or_qwen3("mixtral")
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    hf_tiny.write_checkpoint(hf_dir, config, tensors)
    (hf_dir / "tokenizer.json").write_text('{"model": {}}')
    item = to_maxtext.convert(["configs/base.yml", f"--hf_model_path={hf_dir}", "--save_dtype=bfloat16",
                               f"base_output_directory={out}", *COMMON], log=lambda *_: None)
    (zarray,) = glob.glob(f"{item}/*token_embedder.embedding/.zarray")
    assert json.loads(open(zarray).read())["dtype"] == "bfloat16", "written in the dtype --save_dtype names"
    params, _ = _params(item, f"{out}/model.yml", "weight_dtype=bfloat16")
    embed = np.asarray(params["token_embedder"]["embedding"], np.float32)
    np.testing.assert_allclose(embed, tensors["model.embed_tokens.weight"], rtol=1e-2)
    hf_out = tmp_path / "hf_out"
    to_huggingface.export(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON,
                           "weight_dtype=bfloat16", f"base_output_directory={hf_out}", "--hf_model_path", str(hf_dir)],
                          log=lambda *_: None)
    assert (hf_out / "tokenizer.json").read_text() == '{"model": {}}'

"""Against Hugging Face transformers itself: checkpoints that transformers saves (tests/hf_written.py, in its own
interpreter) import with transformers' logits; exports load in transformers with this trainer's logits; the parity
command agrees. transformers and torch are not requirements here: these tests run with the interpreter named by
HF_PYTHON, or the repository's .venv-hf (bash scripts/setup_hf.sh), and skip when there is neither."""

import json
import os
import subprocess

import numpy as np
import pytest

from MaxText.trainer import forward
from MaxText.config.load import load_config
from MaxText.utils.ckpt_conversion import check, to_huggingface, to_maxtext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["dtype=float32", "enable_tensorboard=false", "dataset_type=synthetic", "max_target_length=16"]
TOL = dict(rtol=2e-4, atol=2e-4)


def _hf_python():
    for python in (os.environ.get("HF_PYTHON"), os.path.normpath(check.REPO_HF_PYTHON)):
        if python and os.path.exists(python) and check._has_transformers(python):
            return python
    return None


HF_PYTHON = _hf_python()
pytestmark = pytest.mark.skipif(HF_PYTHON is None, reason="no interpreter with transformers and torch (HF_PYTHON or "
                                                          ".venv-hf from scripts/setup_hf.sh)")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{case: directory} of the checkpoints transformers saved, each with rows.npy and transformers' logits.npy."""
    out = tmp_path_factory.mktemp("hf_written")
    subprocess.run([HF_PYTHON, os.path.join(ROOT, "tests", "hf_written.py"), str(out)], check=True, capture_output=True,
                   text=True, cwd=ROOT)
    cases = json.loads((out / "cases.json").read_text())
    return {case: out / case for case in cases}


def _import(tmp_path, hf_dir):
    out = tmp_path / "imported"
    lines = []
    item = to_maxtext.convert(["configs/base.yml", f"hf_model_path={hf_dir}", f"base_output_directory={out}", *COMMON],
                              log=lines.append)
    return item, f"{out}/model.yml", lines


def _ours(item, model_yml, rows, *extra):
    cfg = load_config(["configs/base.yml", f"model_name={model_yml}", f"load_parameters_path={item}", *COMMON, *extra])
    return np.asarray(forward.model_and_params(cfg, log=lambda *_: None)(rows.astype(np.int32)))


CASES = ["mixtral", "qwen3_moe", "qwen3_moe_yarn", "deepseek_v3_yarn", "deepseek_v3_plain", "deepseek_v3_halves",
         "deepseek_v3_yarn_mscale0", "deepseek_v3_fp8", "deepseek_v3_fp8_mtp", "mixtral_v4", "qwen3_moe_v4",
         "deepseek_v3_yarn_v4"]


@pytest.mark.parametrize("case", CASES)
def test_checkpoints_transformers_saved_import_with_its_logits(tmp_path, written, case):
    """Every kind transformers 5 writes (and the released v4 schema, read back by transformers 5): the imported
    model's logits equal transformers' own on the same rows."""
    hf_dir = written[case]
    item, model_yml, _ = _import(tmp_path, hf_dir)
    rows = np.load(hf_dir / "rows.npy")
    theirs = np.load(hf_dir / "logits.npy")
    ours = _ours(item, model_yml, rows, "ici_fsdp_parallelism=2", "ici_expert_parallelism=4")
    np.testing.assert_allclose(ours, theirs, **TOL, err_msg=case)


def _reference(hf_dir, rows, tmp_path, stream=False):
    np.save(tmp_path / "rows.npy", rows)
    out = tmp_path / "theirs.npy"
    subprocess.run([HF_PYTHON, check.REFERENCE, "--hf_dir", str(hf_dir), "--tokens", str(tmp_path / "rows.npy"),
                    "--out", str(out), *(["--stream"] if stream else [])], check=True, capture_output=True, text=True)
    return np.load(out)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe_yarn", "deepseek_v3_yarn", "deepseek_v3_halves"])
def test_exports_load_in_transformers_with_our_logits(tmp_path, written, case):
    """import -> export (float32): transformers loads the export (its config.json carries both schemas) and, layer by
    layer too (--stream), computes this trainer's logits."""
    item, model_yml, _ = _import(tmp_path, written[case])
    hf_out = tmp_path / "exported"
    to_huggingface.export(["configs/base.yml", f"model_name={model_yml}", f"load_parameters_path={item}", *COMMON,
                           f"base_output_directory={hf_out}", "hf_dtype=float32"], log=lambda *_: None)
    exported = json.loads((hf_out / "config.json").read_text())
    assert "rope_theta" in exported and "rope_scaling" in exported and "rope_parameters" in exported
    rows = np.load(written[case] / "rows.npy")
    ours = _ours(item, model_yml, rows)
    np.testing.assert_allclose(_reference(hf_out, rows, tmp_path), ours, **TOL, err_msg=case)
    np.testing.assert_allclose(_reference(hf_out, rows, tmp_path, stream=True), ours, **TOL, err_msg=f"{case} stream")


def test_parity_command_passes_an_import_and_fails_a_wrong_one(tmp_path, written, capsys):
    hf_dir = written["deepseek_v3_yarn"]
    item, model_yml, _ = _import(tmp_path, hf_dir)
    argv = ["configs/base.yml", f"model_name={model_yml}", f"load_parameters_path={item}", *COMMON,
            f"hf_model_path={hf_dir}", f"hf_python={HF_PYTHON}", "check_rows=2", "check_length=12"]
    assert check.main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS: max relative logit error" in out, out
    # A wrong rotary base (over the model file's, which the config refuses unless overridden): the check must catch it.
    assert check.main(argv + ["rope_max_timescale=5000", "override_model_config=true"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: max relative logit error" in out, out


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe_yarn", "deepseek_v3_yarn"])
def test_imports_decode_transformers_greedy_tokens(tmp_path, written, case):
    """An imported checkpoint continued by MaxText.decode (greedy, its KV cache: GQA's keys and values, MLA's
    compressed latent) gives the tokens transformers' own model.generate gives (greedy, its cache), row for row."""
    from MaxText.trainer import decode

    item, model_yml, _ = _import(tmp_path, written[case])
    rows = np.load(written[case] / "rows.npy")[:, :8]
    steps = 8
    np.save(tmp_path / "prompts.npy", rows)
    subprocess.run([HF_PYTHON, check.REFERENCE, "--hf_dir", str(written[case]), "--tokens",
                    str(tmp_path / "prompts.npy"), "--out", str(tmp_path / "theirs.npy"), "--generate", str(steps)],
                   check=True, capture_output=True, text=True)
    common = [a for a in COMMON if not a.startswith("max_target_length=")]
    cfg = load_config(["configs/base.yml", f"model_name={model_yml}", f"load_parameters_path={item}", *common,
                       f"max_prefill_predict_length={rows.shape[1]}", f"max_target_length={rows.shape[1] + steps - 1}"])
    ours = decode.generator(cfg, log=lambda *_: None)(rows.astype(np.int32))
    theirs = np.load(tmp_path / "theirs.npy")
    assert theirs.shape == (rows.shape[0], steps) and len(np.unique(theirs)) > steps, theirs  # not one token over
    np.testing.assert_array_equal(ours, theirs, err_msg=case)

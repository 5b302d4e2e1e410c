"""Against upstream MaxText 0.2.5's own checkpoints: tests/data/maxtext-0.2.5/checkpoints holds five that upstream's
trainer wrote on CPU (tests/upstream_written.py: Mixtral scanned and not, Qwen3-MoE, DeepSeek-V3 with a dense
layer, shared expert, routing biases and MTP, scanned and not), each with upstream's own logits. They import here
with those logits (also into the other scan_layers layout), export back to upstream's tree array for array, and
a checkpoint of upstream's given where this trainer's is expected stops in one line.

With upstream's interpreter (MAXTEXT_PYTHON, or the repository's .venv-maxtext from scripts/setup_maxtext.sh),
the live tests also load this trainer's exports in upstream's own model (same logits) and import a checkpoint
upstream writes during the test; without one they skip."""

import json
import os
import subprocess

import numpy as np
import pytest

from MaxText.trainer import checkpointing, forward
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.utils.ckpt_conversion import from_upstream, to_upstream, upstream_ckpt
from MaxText.utils.ckpt_conversion.orbax_io import Items

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "maxtext-0.2.5")
WRITTEN = os.path.join(DATA, "checkpoints")
CASES = json.load(open(os.path.join(WRITTEN, "cases.json")))
COMMON = ["enable_tensorboard=false", "dataset_type=synthetic", "max_target_length=16"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _keys(case, scan=None):
    """This trainer's command line for a case: upstream's keys, its model file by path, scan_layers as asked."""
    out = []
    for key in CASES[case]["keys"]:
        name, _, value = key.partition("=")
        if name == "model_name":
            key = f"model_name={DATA}/models/{value}.yml"
        elif name == "scan_layers" and scan is not None:
            key = f"scan_layers={scan}"
        out.append(key)
    return ["configs/base.yml", *out, *COMMON]


def _items(case):
    return os.path.join(WRITTEN, case, "0", "items")


def _import(tmp_path, case, scan=None, name="ours"):
    out = tmp_path / name
    item = upstream_ckpt.from_upstream([*_keys(case, scan), f"load_parameters_path={_items(case)}",
                                        f"base_output_directory={out}"], log=lambda *_: None)
    return item


def _logits(case, item, scan=None):
    cfg = load_config([*_keys(case, scan), f"load_parameters_path={item}"])
    rows = np.load(os.path.join(WRITTEN, case, "rows.npy"))
    return np.asarray(forward.model_and_params(cfg, log=lambda *_: None)(rows))


def _mtp_loss(case, item, scan=None):
    """This trainer's MTP loss (per-token mean over the depths) of the case's rows, against upstream_written's
    targets (the next tokens, wrapping round)."""
    import jax
    from flax import nnx

    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    cfg = load_config([*_keys(case, scan), f"load_parameters_path={item}"])
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    params, aux = checkpointing.load_params(item, spec.abstract["params"], cfg, spec.abstract.get("nnx_aux"))
    rows = np.tile(np.load(os.path.join(WRITTEN, case, "rows.npy")), (4, 1))  # a row per device; the same mean
    ones = np.ones_like(rows)
    batch = {"inputs": rows, "targets": np.roll(rows, -1, axis=1), "inputs_position": np.cumsum(ones, 1) - 1,
             "inputs_segmentation": ones, "targets_segmentation": ones}
    with jax.set_mesh(mesh):
        model = nnx.merge(spec.graphdef, params, aux)
        hidden = model.hidden(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])[0]
        return float(model.mtp(hidden, batch, model.token_embedder)[0])


@pytest.mark.parametrize("case, scan", [("mixtral_unscanned", "true"), ("qwen3_moe_scanned", None),
                                        ("deepseek3_scanned", "false")])
def test_upstream_checkpoints_import_with_upstream_logits(tmp_path, case, scan):
    """Upstream's own checkpoint, imported (Mixtral's and DeepSeek's into the other layout), gives upstream's own
    logits on the same rows: names, layer axes, Mixtral's unscaled query, routing biases, group routing; and for
    DeepSeek upstream's MTP loss (the MTP block's names and its projection's input halves)."""
    item = _import(tmp_path, case, scan)
    theirs = np.load(os.path.join(WRITTEN, case, "logits.npy"))
    np.testing.assert_allclose(_logits(case, item, scan), theirs, **TOL, err_msg=case)
    if "mtp_loss" in CASES[case]:
        np.testing.assert_allclose(_mtp_loss(case, item, scan), CASES[case]["mtp_loss"], **TOL)


def _upstream_arrays(items: Items) -> dict:
    """The params and routing biases of an upstream item directory (not its optimizer or RNG state)."""
    names = [n for n in items.names if n.startswith("params.") or n.endswith(".gate.bias")]
    return {n: items.read(n) for n in names}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exports_are_upstreams_tree_array_for_array(tmp_path, case):
    """Imported and exported again, every param and routing bias of upstream's checkpoint comes back under its own
    name, shape and values (MTP projection halves, Mixtral's query scale and the layer axes undone exactly)."""
    ours = _import(tmp_path, case)
    back = upstream_ckpt.to_upstream([*_keys(case), f"load_parameters_path={ours}",
                                      f"base_output_directory={tmp_path / 'back'}"], log=lambda *_: None)
    original = _upstream_arrays(Items(_items(case), "original"))
    exported = _upstream_arrays(Items(back, "exported"))
    assert sorted(exported) == sorted(original)
    if "deepseek" in case:
        assert any(n.startswith("nnx_aux.model.decoder.moe_layers") for n in exported)
    for name, array in original.items():
        np.testing.assert_allclose(exported[name], array, rtol=1e-6, atol=0, err_msg=name)


def test_upstream_checkpoints_given_as_ours_stop_in_one_line(tmp_path):
    """load_parameters_path names the converter; a full-state load or a resume of upstream's train state says it
    does not resume here and how to start from its params; the converters refuse the wrong tree."""
    items = _items("mixtral_scanned")
    with pytest.raises(ConfigError, match="from_upstream"):
        checkpointing.load_params(items, None)
    with pytest.raises(ConfigError, match="does not resume here.*from_upstream"):
        checkpointing.load_full_state(items, None)
    with pytest.raises(ConfigError, match="run's checkpoint.*does not resume here"):
        checkpointing.refuse_upstream_state(items, f"the run's checkpoint {os.path.dirname(items)}")
    ours = _import(tmp_path, "mixtral_scanned")
    with pytest.raises(ConfigError, match="this trainer's: load it directly"):
        upstream_ckpt.from_upstream([*_keys("mixtral_scanned"), f"load_parameters_path={ours}",
                                     f"base_output_directory={tmp_path / 'again'}"])
    with pytest.raises(ConfigError, match="upstream MaxText's tree already"):
        upstream_ckpt.to_upstream([*_keys("mixtral_scanned"), f"load_parameters_path={items}",
                                   f"base_output_directory={tmp_path / 'again'}"])


def test_imports_that_cannot_be_right_write_nothing(tmp_path, capsys):
    """Another model's keys, an existing step, a model without upstream's tree: one line, nothing written."""
    keys = _keys("mixtral_scanned")
    wrong = [k if not k.startswith("base_mlp_dim=") else "base_mlp_dim=64" for k in keys]
    wrong = [k if not k.startswith("base_moe_mlp_dim=") else "base_moe_mlp_dim=64" for k in wrong]
    out = tmp_path / "wrong"
    assert from_upstream.main([*wrong, f"load_parameters_path={_items('mixtral_scanned')}",
                               f"base_output_directory={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "shape" in err and "[2, 4, 32, 64]" in err, err
    assert not (out / "0").exists() and not (out / ".0.partial").exists()
    ours = _import(tmp_path, "mixtral_scanned")
    assert from_upstream.main([*keys, f"load_parameters_path={_items('mixtral_scanned')}",
                               f"base_output_directory={os.path.dirname(os.path.dirname(ours))}"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert to_upstream.main(["configs/base.yml", *COMMON, f"load_parameters_path={ours}",
                             f"base_output_directory={tmp_path / 'x'}"]) == 2
    assert "decoder_block=None" in capsys.readouterr().err
    assert to_upstream.main([*_keys("mixtral_scanned", "false"), f"load_parameters_path={ours}",
                             f"base_output_directory={tmp_path / 'x'}"]) == 2  # ours is scanned
    err = capsys.readouterr().err
    assert "holds no params.moe_layers.layers_0." in err and "scan_layers" in err, err
    assert not (tmp_path / "x" / "0").exists()


def _maxtext_python():
    for python in (os.environ.get("MAXTEXT_PYTHON"), os.path.join(ROOT, ".venv-maxtext", "bin", "python")):
        if python and os.path.exists(python) and subprocess.run([python, "-c", "import maxtext.version"],
                                                                capture_output=True).returncode == 0:
            return python
    return None


MAXTEXT_PYTHON = _maxtext_python()
live = pytest.mark.skipif(MAXTEXT_PYTHON is None, reason="no interpreter with upstream MaxText 0.2.5 (MAXTEXT_PYTHON "
                                                         "or .venv-maxtext from scripts/setup_maxtext.sh)")


def _upstream(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([MAXTEXT_PYTHON, os.path.join(ROOT, "tests", "upstream_written.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@live
@pytest.mark.parametrize("case", ["mixtral_scanned", "deepseek3_unscanned"])
def test_exports_load_in_upstream_with_upstreams_logits(tmp_path, case):
    """This trainer's export, loaded by upstream's own from_pretrained (its load_parameters_path), gives the logits
    upstream computed from its original checkpoint."""
    ours = _import(tmp_path, case)
    back = upstream_ckpt.to_upstream([*_keys(case), f"load_parameters_path={ours}",
                                      f"base_output_directory={tmp_path / 'back'}"], log=lambda *_: None)
    rows = os.path.join(WRITTEN, case, "rows.npy")
    _upstream("--logits", case, back, rows, tmp_path / "logits.npy", cwd=tmp_path)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), np.load(os.path.join(WRITTEN, case, "logits.npy")),
                               **TOL)


@live
def test_a_checkpoint_upstream_writes_now_imports_with_its_logits(tmp_path):
    """Not only the shipped ones: upstream's trainer writes a checkpoint during the test, and it imports here with
    upstream's logits."""
    _upstream(tmp_path / "written", "qwen3_moe_scanned", cwd=tmp_path)
    fresh = tmp_path / "written" / "qwen3_moe_scanned"
    item = upstream_ckpt.from_upstream([*_keys("qwen3_moe_scanned"),
                                        f"load_parameters_path={fresh / '0' / 'items'}",
                                        f"base_output_directory={tmp_path / 'ours'}"], log=lambda *_: None)
    cfg = load_config([*_keys("qwen3_moe_scanned"), f"load_parameters_path={item}"])
    ours = np.asarray(forward.model_and_params(cfg, log=lambda *_: None)(np.load(fresh / "rows.npy")))
    np.testing.assert_allclose(ours, np.load(fresh / "logits.npy"), **TOL)

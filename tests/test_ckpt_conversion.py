"""Hugging Face import (MaxText.utils.ckpt_conversion.to_maxtext) on tiny checkpoints the tests write: the logits
of the imported model (MaxText.forward) equal an independent float64 numpy forward of each family as its
published code defines it; bad input is one line and writes nothing."""

import json
import os

import numpy as np
import pytest

from MaxText.trainer import forward
from MaxText.config.load import load_config
from MaxText.utils.ckpt_conversion import to_maxtext
from tests import hf_tiny

COMMON = ["dtype=float32", "enable_tensorboard=false", "dataset_type=synthetic", "max_target_length=16"]


def imported(tmp_path, config, tensors, *extra, shards=2):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    hf_tiny.write_checkpoint(hf_dir, config, tensors, shards=shards)
    lines = []
    item = to_maxtext.convert(["configs/base.yml", f"hf_model_path={hf_dir}", f"base_output_directory={out}",
                               *COMMON, *extra], log=lines.append)
    return item, out, lines


@pytest.mark.parametrize("family,scan", [("mixtral", "true"), ("qwen3_moe", "true"), ("qwen3_moe", "false")])
def test_import_then_forward_matches_the_published_forward(tmp_path, family, scan):
    """Scanned layers (stacked on a leading axis) or unscanned (one entry per layer)."""
    config, tensors = hf_tiny.mixtral_or_qwen3(family)
    item, out, lines = imported(tmp_path, config, tensors, f"scan_layers={scan}")
    assert item == f"{out}/0/items" and lines[-1].startswith(f"imported {tmp_path}/hf ({family})"), lines
    cfg = load_config(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON,
                       "ici_fsdp_parallelism=2", "ici_expert_parallelism=4", f"scan_layers={scan}"])
    rows = np.random.default_rng(1).integers(0, hf_tiny.V, (2, 12))
    logits = forward.model_and_params(cfg, log=lambda *_: None)(rows.astype(np.int32))
    for b in range(2):
        want = hf_tiny.reference_logits(config, tensors, rows[b])
        np.testing.assert_allclose(logits[b], want, rtol=2e-4, atol=2e-4, err_msg=f"{family} row {b}")


def test_bf16_release_imports_as_its_float32_values(tmp_path):
    """A bfloat16 release: the imported float32 params are the bf16 values exactly (one file, no index)."""
    import ml_dtypes

    config, tensors = hf_tiny.mixtral_or_qwen3("qwen3_moe", dtype=ml_dtypes.bfloat16)
    item, out, _ = imported(tmp_path, config, tensors, shards=1)
    from MaxText.trainer import checkpointing
    from MaxText.planning import plan
    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    cfg = load_config(["configs/base.yml", f"model_name={out}/model.yml", *COMMON])
    spec = state_spec(cfg, plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES}))
    import jax

    params, _ = checkpointing.load_params(item, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
        spec.abstract["params"]))
    got = np.asarray(params["moe_layers"]["layers"]["moe"]["wi_1"])[2, 3]  # layer 2, expert 3: [D, F]
    want = np.asarray(tensors["model.layers.2.mlp.experts.3.up_proj.weight"], np.float32).T
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case,phrase", [
    ("missing shard", "is missing (model.safetensors.index.json puts"),
    ("wrong family", "model_type='llama' is not one this trainer imports"),
    ("extra tensor", "tensor model.layers.0.self_attn.q_proj.bias has no place in this model"),
    ("missing tensor", "tensor model.layers.2.block_sparse_moe.experts.1.w2.weight is not in"),
    ("shape mismatch", "model.layers.1.self_attn.k_proj.weight"),
    ("disagreeing model_name", "config.json gives base_emb_dim=32 but model_name=mixtral-tiny has base_emb_dim=64"),
    ("truncated shard", "model-00001-of-00002.safetensors is truncated: its header needs"),
    ("not safetensors", "model-00002-of-00002.safetensors is not a readable safetensors file"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case, phrase):
    config, tensors = hf_tiny.mixtral_or_qwen3("mixtral")
    extra = []
    if case == "wrong family":
        config["model_type"] = "llama"
    elif case == "extra tensor":
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(hf_tiny.H * hf_tiny.K, np.float32)
    elif case == "missing tensor":
        del tensors["model.layers.2.block_sparse_moe.experts.1.w2.weight"]
    elif case == "shape mismatch":
        tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((hf_tiny.H * hf_tiny.K, hf_tiny.D), np.float32)
    elif case == "disagreeing model_name":
        extra = ["model_name=mixtral-tiny"]
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    hf_tiny.write_checkpoint(hf_dir, config, tensors)
    if case == "missing shard":
        os.remove(hf_dir / "model-00002-of-00002.safetensors")
    elif case == "truncated shard":
        path = hf_dir / "model-00001-of-00002.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "not safetensors":
        (hf_dir / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    code = to_maxtext.main(["configs/base.yml", f"hf_model_path={hf_dir}", f"base_output_directory={out}", *COMMON,
                            *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert phrase in err, err
    assert not out.exists(), "nothing may be written on bad input"


def _params(item, model_yml, *extra):
    """The imported params and routing biases on one device."""
    import jax

    from MaxText.trainer import checkpointing
    from MaxText.planning import plan
    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    cfg = load_config(["configs/base.yml", f"model_name={model_yml}", *COMMON, *extra])
    spec = state_spec(cfg, plan.abstract_mesh({a: 1 for a in sharding.MESH_AXES}))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), spec.abstract)
    return checkpointing.load_params(item, local["params"], abstract_aux=local.get("nnx_aux"))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-free", "fp8-release"])
def test_deepseek_v3_import_then_forward_matches_the_published_forward(tmp_path, fp8):
    """DeepSeek-V3's layout (YaRN with interleaved rotary pairs, group-limited sigmoid routing with the correction
    bias, a shared expert, a dense first layer, the MTP layer stored as layer num_hidden_layers), in float32 or
    as released in FP8 blocks: the imported model's logits equal the float64 reference on the dequantized
    weights; the routing biases and the MTP layer (eh_proj's halves swapped) are imported."""
    config, tensors = hf_tiny.deepseek_v3(fp8=fp8)
    item, out, lines = imported(tmp_path, config, tensors)
    assert lines[-1].endswith("with the MoE routing biases"), lines
    cfg = load_config(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON,
                       "ici_fsdp_parallelism=2", "ici_expert_parallelism=4"])
    assert (cfg.rope_type, cfg.rope_interleave, cfg.mtp_num_layers, cfg.routed_bias) == ("yarn", True, 1, True)
    rows = np.random.default_rng(2).integers(0, hf_tiny.V, (2, 12))
    logits = forward.model_and_params(cfg, log=lambda *_: None)(rows.astype(np.int32))
    for b in range(2):
        want = hf_tiny.deepseek_reference_logits(config, tensors, rows[b])
        np.testing.assert_allclose(logits[b], want, rtol=2e-4, atol=2e-4, err_msg=f"row {b}")
    params, bias = _params(item, f"{out}/model.yml")
    values = hf_tiny.dequantized(tensors)
    np.testing.assert_array_equal(np.asarray(bias["moe_layers"]["layers"]["moe"]["bias"])[1],
                                  tensors["model.layers.2.mlp.gate.e_score_correction_bias"])
    eh = values["model.layers.3.eh_proj.weight"].T  # [2D, D]: embedding rows, then hidden rows
    np.testing.assert_allclose(np.asarray(params["mtp"]["mtp_1"]["projection"]), np.concatenate([eh[32:], eh[:32]]),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(params["moe_layers"]["layers"]["moe"]["wo"])[0, 5],
                               values["model.layers.1.mlp.experts.5.down_proj.weight"].T, rtol=1e-6)


def test_deepseek_mtp_layer_is_skipped_when_the_config_drops_it(tmp_path):
    config, tensors = hf_tiny.deepseek_v3()
    item, out, lines = imported(tmp_path, config, tensors, "mtp_num_layers=0")
    assert any(line.startswith("not imported: the MTP layer (model.layers.3.*") for line in lines), lines
    from MaxText.config.errors import ConfigError

    assert "model.yml: mtp_num_layers=0 from the command line, not config.json's 1" in lines, lines
    params, _ = _params(item, f"{out}/model.yml")  # model.yml records the depth imported
    assert "mtp" not in params
    with pytest.raises(ConfigError, match=r"holds no \['(params|nnx_aux)'\]\['mtp'\].*set mtp_num_layers=0"):
        _params(item, f"{out}/model.yml", "mtp_num_layers=1", "override_model_config=true")


def test_fp8_blocks_dequantize_with_partial_edge_blocks():
    """dequantize_fp8 on a 300 x 200 weight (3 x 2 blocks, the last ones partial) against a loop over blocks."""
    import ml_dtypes

    from MaxText.utils.ckpt_conversion.safetensors_io import dequantize_fp8

    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 200)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.1, 3, (3, 2)).astype(np.float32)
    want = np.zeros((300, 200), np.float32)
    for i in range(3):
        for j in range(2):
            block = np.s_[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            want[block] = w[block].astype(np.float32) * s[i, j]
    np.testing.assert_array_equal(dequantize_fp8(w, s), want)


# ---------------------------------------------------------------------------------------------------- export


def _export(tmp_path, out, item, *extra):
    from MaxText.utils.ckpt_conversion import to_huggingface

    hf_out = tmp_path / "hf_out"
    lines = []
    to_huggingface.export(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON,
                           f"base_output_directory={hf_out}", "hf_shard_gb=0.0001", *extra], log=lines.append)
    return hf_out, lines


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_export_writes_the_release_back_and_reimports_as_the_identity(tmp_path, family):
    """float32 release -> import -> export float32: every tensor of the release comes back bit for bit under its
    own name (shards, index and config.json of the family), and importing the export gives the same params."""
    from MaxText.utils.ckpt_conversion.families import FAMILIES
    from MaxText.utils.ckpt_conversion.safetensors_io import Checkpoint

    config, tensors = hf_tiny.deepseek_v3() if family == "deepseek_v3" else hf_tiny.mixtral_or_qwen3(family)
    item, out, _ = imported(tmp_path, config, tensors)
    hf_out, lines = _export(tmp_path, out, item, "hf_dtype=float32")
    assert lines[-1].startswith(f"exported {item} as {family} (float32"), lines
    back = Checkpoint(str(hf_out))
    assert len(os.listdir(hf_out)) > 4, "hf_shard_gb=0.0001 should split the tiny model over several shards"
    assert set(back.names()) == set(tensors)
    for name, want in tensors.items():
        np.testing.assert_array_equal(back.get(name), want, err_msg=name)
    exported = json.loads((hf_out / "config.json").read_text())
    fam = FAMILIES[family]()
    assert fam.model_keys(exported) == fam.model_keys(config)
    item2, out2, _ = imported(tmp_path / "again", exported, {n: np.asarray(back.get(n)) for n in back.names()})
    import jax

    for a, b in zip(jax.tree.leaves(_params(item, f"{out}/model.yml")), jax.tree.leaves(_params(item2, f"{out2}/model.yml"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_export_is_deepseeks_block_format(tmp_path):
    """hf_dtype=fp8: Linear weights as float8_e4m3fn with one scale per 128x128 block, head and routers in bf16;
    importing it back gives the weights within FP8's rounding."""
    import ml_dtypes

    from MaxText.utils.ckpt_conversion.safetensors_io import Checkpoint

    config, tensors = hf_tiny.deepseek_v3()
    item, out, _ = imported(tmp_path, config, tensors)
    hf_out, _ = _export(tmp_path, out, item, "hf_dtype=fp8")
    back = Checkpoint(str(hf_out))
    assert back.get("model.layers.1.mlp.experts.2.up_proj.weight").dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert back.shape("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv") == (1, 1)
    assert back.get("lm_head.weight").dtype == np.dtype(ml_dtypes.bfloat16)
    assert back.get("model.layers.1.mlp.gate.weight").dtype == np.dtype(ml_dtypes.bfloat16)
    config_out = json.loads((hf_out / "config.json").read_text())
    assert config_out["quantization_config"]["weight_block_size"] == [128, 128]
    w = tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    np.testing.assert_allclose(back.weight("model.layers.1.self_attn.kv_b_proj.weight"), w, atol=np.abs(w).max() / 14)


def test_an_export_that_fails_mid_write_leaves_nothing(tmp_path, monkeypatch):
    """A full disk (ENOSPC from the third shard) while the export writes: the error comes through, and neither the
    output directory nor its staging copy (<out>.partial) is left behind."""
    import errno

    from MaxText.utils.ckpt_conversion import safetensors_io, to_huggingface

    config, tensors = hf_tiny.mixtral_or_qwen3("mixtral")
    item, out, _ = imported(tmp_path, config, tensors)
    written = []
    real = safetensors_io.write_file

    def filling(path, *args, **kwargs):
        written.append(path)
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(to_huggingface, "write_file", filling)
    with pytest.raises(OSError, match="No space left"):
        _export(tmp_path, out, item, "hf_dtype=float32")
    assert len(written) == 3, written
    assert not (tmp_path / "hf_out").exists() and not (tmp_path / "hf_out.partial").exists()


@pytest.mark.parametrize("case,phrase", [
    ("no params", "load_parameters_path=<run>/checkpoints/<step>/items is required"),
    ("directory in use", "exists and is not empty"),
    ("fp8 for mixtral", "hf_dtype=fp8 is DeepSeek's release format"),
    ("unknown dtype", "hf_dtype=int4 is not one of"),
])
def test_export_mistakes_are_one_line(tmp_path, capsys, case, phrase):
    from MaxText.utils.ckpt_conversion import to_huggingface

    hf_out = tmp_path / "hf_out"
    argv = ["configs/base.yml", "model_name=mixtral-tiny", *COMMON, f"base_output_directory={hf_out}",
            f"load_parameters_path={tmp_path}/nope/items"]
    if case == "no params":
        argv = argv[:-1]
    elif case == "directory in use":
        hf_out.mkdir()
        (hf_out / "config.json").write_text("{}")
    elif case == "fp8 for mixtral":
        argv.append("hf_dtype=fp8")
    else:
        argv.append("hf_dtype=int4")
    assert to_huggingface.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and phrase in err and "\n" not in err, err


def test_parity_command_without_transformers_is_one_line(tmp_path, capsys):
    """The check needs transformers in some interpreter: one given that lacks it is one line, exit 2 (the runs
    against transformers itself are in tests/test_hf_transformers.py)."""
    import importlib.util
    import sys

    from MaxText.utils.ckpt_conversion import check

    if importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"):
        pytest.skip("this interpreter has transformers")
    config, tensors = hf_tiny.mixtral_or_qwen3("mixtral")
    item, out, _ = imported(tmp_path, config, tensors)
    argv = ["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON,
            f"hf_model_path={tmp_path}/hf"]
    for extra, phrase in ((f"hf_python={sys.executable}", "cannot import transformers and torch"),
                          ("check_rows=0", "check_rows=0 must be a whole number")):
        assert check.main(argv + [extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and phrase in err and "\n" not in err, err
    assert check.main([*argv[:-1], f"hf_model_path={tmp_path}"]) == 2
    assert "is not a Hugging Face checkpoint directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------- config schemas and rotary layouts

QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("family,schema,theta,yarn", [
    ("mixtral", "v4", 5000.0, None), ("mixtral", "v5", 5000.0, None), ("qwen3_moe", "v5", 20000.0, None),
    ("qwen3_moe", "v4", 10000.0, QWEN_YARN), ("qwen3_moe", "v5", 10000.0, QWEN_YARN)])
def test_both_config_schemas_import_as_the_same_function(tmp_path, family, schema, theta, yarn):
    """transformers 4's schema (rope_theta, rope_scaling, num_experts) and 5's (rope_parameters, num_local_experts)
    give the published function: a non-default rope_theta is read from either place (the case that imported 78%
    off in silence), and YaRN's attention factor (0.1 ln(factor) + 1 on cos and sin) reaches grouped attention."""
    config, tensors = hf_tiny.mixtral_or_qwen3(family, theta=theta, yarn=yarn)
    written = hf_tiny.as_v5(config) if schema == "v5" else config
    item, out, _ = imported(tmp_path, written, tensors)
    cfg = load_config(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON])
    assert cfg.rope_max_timescale == theta and (cfg.rope_type == "yarn") == bool(yarn)
    if yarn:
        assert not cfg.rope_interleave and cfg.rope_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    rows = np.random.default_rng(1).integers(0, hf_tiny.V, (2, 12))
    logits = forward.model_and_params(cfg, log=lambda *_: None)(rows.astype(np.int32))
    for b in range(2):
        np.testing.assert_allclose(logits[b], hf_tiny.reference_logits(config, tensors, rows[b]), rtol=2e-4,
                                   atol=2e-4, err_msg=f"{family} {schema} row {b}")


@pytest.mark.parametrize("rope,schema", [("plain", "v5"), ("halves", "v4"), ("yarn_halves", "v5"),
                                         ("yarn_mscale0", "v4"), ("yarn", "v5")])
def test_deepseek_rotary_layouts_import_as_the_same_function(tmp_path, rope, schema):
    """Interleaved pairs without YaRN (transformers' default DeepseekV3Config), the halves (rope_interleave false)
    with and without YaRN, YaRN with mscale but no mscale_all_dim (cos and sin scaled, the softmax not), and the
    release's YaRN in transformers 5's schema: each imports as the function the reference computes."""
    config, tensors = hf_tiny.deepseek_v3(rope=rope, mtp=False)
    written = hf_tiny.as_v5(config) if schema == "v5" else config
    item, out, _ = imported(tmp_path, written, tensors)
    cfg = load_config(["configs/base.yml", f"model_name={out}/model.yml", f"load_parameters_path={item}", *COMMON])
    rows = np.random.default_rng(2).integers(0, hf_tiny.V, (2, 12))
    logits = forward.model_and_params(cfg, log=lambda *_: None)(rows.astype(np.int32))
    for b in range(2):
        np.testing.assert_allclose(logits[b], hf_tiny.deepseek_reference_logits(config, tensors, rows[b]), rtol=2e-4,
                                   atol=2e-4, err_msg=f"{rope} row {b}")


def _keys(config, **changes):
    from MaxText.utils.ckpt_conversion.families import FAMILIES

    config = {**config, **changes}
    lines = []
    return FAMILIES[config["model_type"]]().model_keys(config, lines.append), lines


@pytest.mark.parametrize("family,changes,phrase", [
    ("mixtral", {"num_experts": 8}, "num_local_experts=4 and num_experts=8 disagree"),
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
     "rope_theta=10000.0 and rope_parameters.rope_theta=500.0 disagree"),
    ("mixtral", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "type 'linear' is not built here"),
    ("mixtral", {"moe_layer_freq": 2}, "field moe_layer_freq=2 is not understood"),
    ("qwen3_moe", {"rope_scaling": {**QWEN_YARN, "truncate": False}}, "truncate=false"),
    ("qwen3_moe", {"rope_scaling": {**QWEN_YARN, "low_freq_factor": 1}}, "rotary field low_freq_factor=1"),
    ("qwen3_moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not built here"),
    ("qwen3_moe", {"quantization_config": {"quant_method": "awq"}}, "quantization_config="),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ("deepseek_v3", {"rope_parameters": {**hf_tiny.YARN, "factor": 8.0}},
     "rope_scaling.factor=4.0 and rope_parameters.factor=8.0 disagree"),
    ("deepseek_v2", {"norm_topk_prob": True}, "does not renormalise"),
])
def test_config_fields_not_understood_are_one_line(family, changes, phrase):
    from MaxText.config.errors import ConfigError

    config = hf_tiny.deepseek_v3()[0] if family.startswith("deepseek") else hf_tiny.mixtral_or_qwen3(family)[0]
    config = {**config, "model_type": family}
    if family == "deepseek_v2":
        config.update(topk_method="greedy", scoring_func="softmax")
        del config["num_nextn_predict_layers"]
    with pytest.raises(ConfigError, match="^config.json") as e:
        _keys(config, **changes)
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_missing_fields_take_transformers_defaults_and_the_ignored_are_named():
    """A Mixtral config.json without rope_theta has MixtralConfig's 1e6, a DeepSeek-V3 one without
    routed_scaling_factor DeepseekV3Config's 2.5; fields without effect are named in one line; hf_ignore_fields
    accepts a field the importer does not know."""
    config = hf_tiny.mixtral_or_qwen3("mixtral")[0]
    del config["rope_theta"]
    keys, lines = _keys(config, torch_dtype="bfloat16", router_aux_loss_coef=0.02)
    assert keys["rope_max_timescale"] == 1e6
    assert lines == ["config.json: not used (no effect on the model's function): router_aux_loss_coef, torch_dtype"]
    ds = {k: v for k, v in hf_tiny.deepseek_v3()[0].items() if k != "routed_scaling_factor"}
    assert _keys(ds)[0]["routed_scaling_factor"] == 2.5
    from MaxText.utils.ckpt_conversion.families import Mixtral

    assert Mixtral().model_keys({**config, "fancy": 1}, ignore=["fancy"])["num_experts"] == hf_tiny.E


@pytest.mark.parametrize("name", ["deepseek3-671b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_released_configs_read_as_the_built_in_models(name):
    """The config.json of each release (tests/data/hf_configs, transcribed field for field) is read without a
    field left over, and in both schemas (transformers 5 rewrites it with rope_parameters and renamed fields) gives
    exactly the keys of this trainer's model file of that name."""
    from MaxText.utils.ckpt_conversion.families import FAMILIES

    release = json.loads(open(os.path.join(os.path.dirname(__file__), "data", "hf_configs", f"{name}.json")).read())
    family = FAMILIES[release["model_type"]]()
    keys = family.model_keys(release)
    assert family.model_keys(hf_tiny.as_v5(release)) == keys
    to_maxtext.check_agrees(load_config(["configs/base.yml", f"model_name={name}"]), keys, name)

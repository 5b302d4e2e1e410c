"""Upstream MaxText's keys and values (MaxText/upstream.py): the table is complete against upstream's key list as
stored here (tests/data/maxtext-<version>-keys.txt), and each behaviour (implemented, mapped, no-op, refused) and
each of upstream's value spellings does what the table says."""

import fnmatch
import logging
import os

import pytest
import yaml

from MaxText.config import upstream
from MaxText.config.parse import BASE_CONFIG
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config, plain

KEYS_FILE = os.path.join(os.path.dirname(__file__), "data", f"maxtext-{upstream.UPSTREAM_VERSION}-keys.txt")


def stored_keys() -> list[str]:
    with open(KEYS_FILE) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def ours() -> dict:
    with open(BASE_CONFIG) as f:
        return yaml.safe_load(f)


def test_the_table_gives_every_upstream_key_one_behaviour():
    """Each key of upstream's base.yml is in configs/base.yml (implemented), mapped, or in exactly one group by
    name (patterns only for keys no group names); no group lists a key upstream does not have; the defaults file
    the trainer reads holds the same keys as the list stored here."""
    keys = stored_keys()
    assert len(keys) == 786 and len(set(keys)) == len(keys)
    assert list(upstream.upstream_defaults()) == keys
    implemented = set(ours())
    for key in keys:
        if key in implemented:
            assert key not in upstream.MAPPINGS and not any(key in g.keys for g in upstream.GROUPS), key
            continue
        named = [g for g in upstream.GROUPS if key in g.keys]
        patterned = [g for g in upstream.GROUPS if any("*" in p and fnmatch.fnmatchcase(key, p) for p in g.keys)]
        behaviours = len(named) or len(patterned)
        assert behaviours + (key in upstream.MAPPINGS) == 1, (key, named, patterned)
        assert len(named) <= 1, key
    for group in upstream.GROUPS:
        for name in group.keys:
            matches = fnmatch.filter(keys, name) if "*" in name else [k for k in keys if k == name]
            assert [k for k in matches if k not in implemented], f"{name} names no upstream-only key"
    for key, target in upstream.MAPPINGS.items():
        assert key in keys and key not in implemented and target in implemented, (key, target)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_no_op_keys_take_any_value_and_are_listed_in_one_line(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(["gcs_metrics=true", "sa_block_q=4096", "enable_goodput_recording=true",
                     "prefill_slice=v5e-16", "use_iota_embed=true", "float32_logits=false"])
    lines = [line for line in warnings(caplog) if "no effect here" in line]
    assert lines == ["config: MaxText keys with no effect here (README: Coming from MaxText): "
                     "enable_goodput_recording, float32_logits, gcs_metrics, prefill_slice, sa_block_q, use_iota_embed"]


@pytest.mark.parametrize("key,off,on,reason", [
    ("use_multimodal", "false", "true", "vision, audio and multimodal input"),
    ("ici_pipeline_parallelism", "1", "2", "a parallelism or sharding scheme"),
    ("quantize_mtp", "false", "true", "quantized training"),
    ("sliding_window_size", "0", "4096", "an architecture feature"),
    ("mlp_activations", "[silu,linear]", "[gelu]", "SwiGLU"),
    ("packing", "true", "false", "a data pipeline or input option"),
    ("grain_train_mixture_config_path", "", "/data/mix.json", "a data pipeline or input option"),
    ("hf_access_token", "", "hf_abc", "nothing is read from the Hugging Face hub"),
    ("enable_emergency_checkpoint", "false", "true", "a checkpointing or memory-offload mode"),
    ("context", "remat", "offload", "a rematerialisation name no layer here produces"),
    ("decoder_layer_input", "device", "offload", "keeps each layer's input on the device"),
    ("abort_on_nan_loss", "true", "false", "a non-finite loss always stops the run"),
])
def test_refused_keys_are_accepted_off_and_name_the_reason_on(key, off, on, reason):
    load_config([f"{key}={off}"])
    with pytest.raises(ConfigError) as e:
        load_config([f"{key}={on}"])
    message = str(e.value)
    assert message.startswith(f"{key}=") and "is a MaxText key this trainer does not support: " in message, message
    assert reason in message and "remove it or set" in message and "\n" not in message, message


def test_refused_keys_in_a_yaml_file_are_named_with_the_file(tmp_path):
    path = tmp_path / "maxtext_recipe.yml"
    path.write_text("base_config: " + BASE_CONFIG + "\nuse_dpo: true\n")
    with pytest.raises(ConfigError, match=f"use_dpo=true \\(in {path}\\) is a MaxText key this trainer does not"):
        load_config([str(path)])


def test_mapped_keys_carry_over_and_two_spellings_must_agree(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(["use_qk_norm=true", "learning_rate_final_fraction=0.05"])
    assert cfg.qk_norm is True and cfg.cosine_learning_rate_final_fraction == 0.05
    assert "config: use_qk_norm=true is MaxText's spelling of qk_norm; using qk_norm=true" in warnings(caplog)
    assert load_config(["use_qk_norm=true", "qk_norm=true"]).qk_norm is True  # the same thing twice is fine
    with pytest.raises(ConfigError, match="use_qk_norm=true .* is MaxText's spelling of qk_norm, but qk_norm=false "
                                          "is also set; keep one"):
        load_config(["use_qk_norm=true", "qk_norm=false"])


def test_a_key_neither_has_is_unknown():
    with pytest.raises(ConfigError, match="unknown key 'use_qk_nrom' \\(on the command line\\)"):
        load_config(["use_qk_nrom=true"])


@pytest.mark.parametrize("argv,key,want", [
    (["attention=autoselected"], "attention", "dot_product"),
    (["attention=cudnn_flash_te"], "attention", "cudnn_flash"),
    (["attention=cudnn_flash_jax"], "attention", "cudnn_flash"),
    (["attention_type=global"], "attention_type", "mha"),
    (["te_gmm_quantization="], "te_gmm_quantization", "none"),
    (["routed_score_func="], "routed_score_func", "softmax"),
    (["model_name=default"], "model_name", None),
    (["capacity_factor=-1"], "capacity_factor", None),
    (["learning_rate_schedule_steps=-1"], "learning_rate_schedule_steps", None),
    (["eval_steps=-1", "dataset_type=tfds"], "eval_steps", -1),
    (["eval_steps=-1", "dataset_type=synthetic", "eval_interval=-1"], "eval_steps", -1),
    (["base_moe_mlp_dim=-1", "num_experts=1", "num_experts_per_tok=1"], "base_moe_mlp_dim", -1),
])
def test_upstream_values_mean_what_they_mean_upstream(argv, key, want):
    assert load_config(argv)[key] == want


@pytest.mark.parametrize("argv,phrase", [
    (["attention=flash"], "a TPU (Pallas splash) kernel; use attention=dot_product or chunked"),
    (["profiler=nsys"], "NVTX ranges and cudaProfilerStart/Stop are not emitted yet"),
    (["hardware=tpu"], "this trainer targets NVIDIA GPUs"),
    (["dataset_type=olmo_grain"], "the OLMo Grain pipeline is not here"),
    (["opt_type=muon"], "only adamw is built here"),
    (["remat_policy=minimal_with_quantization"], "it names AQT's quantized tensors"),
    (["quantization=te_fp8_delayedscaling"], "delayed scaling keeps an amax history per GEMM"),
    (["quantization=int8"], "AQT / Qwix quantization (upstream's non-TE recipes) is not built here"),
    (["eval_steps=-1", "dataset_type=synthetic", "eval_interval=10"], "synthetic data has none"),
    (["base_moe_mlp_dim=-1"], "base_moe_mlp_dim=-1 must be at least 1"),
    (["decoder_block=gemma3"], "decoder_block=gemma3 is a MaxText model family this trainer does not build"),
    (["decoder_block=deepseek"], "decoder_block=deepseek needs attention_type=mla, but this config has "
                                 "attention_type=mha"),
    (["decoder_block=qwen3_moe"], "decoder_block=qwen3_moe needs qk_norm=true"),
    (["tokenizer_type=tiktoken"], "tokenizer_type=tiktoken is not supported here"),
    (["tokenizer_type=sentencepiece", "tokenizer_path=/t/tokenizer.json"], "expects a .model file"),
])
def test_upstream_values_this_trainer_refuses_say_why(argv, phrase):
    with pytest.raises(ConfigError, match=".*") as e:
        load_config(argv)
    assert phrase in str(e.value) and "\n" not in str(e.value), e.value


def test_model_family_and_tokenizer_type_that_agree_are_accepted():
    load_config(["model_name=deepseek3-tiny", "decoder_block=deepseek"])
    load_config(["qk_norm=true", "decoder_block=qwen3_moe"])
    load_config(["tokenizer_type=huggingface", "tokenizer_path=/t/tokenizer.json"])


@pytest.mark.parametrize("policy,want", [
    ("minimal_with_context", ("minimal", {})),
    ("minimal_flash", ("minimal", {})),
    ("save_qkv_proj", ("custom", {"query_proj": "device", "key_proj": "device", "value_proj": "device"})),
    ("save_dot_except_mlp", ("custom", {"query_proj": "device", "key_proj": "device", "value_proj": "device",
                                        "out_proj": "device"})),
    ("save_dot_except_mlpwi", ("custom", {"query_proj": "device", "key_proj": "device", "value_proj": "device",
                                          "out_proj": "device", "mlpwo": "device", "moe_mlpwo": "device"})),
    ("save_out_proj", ("custom", {"out_proj": "device"})),
    ("qkv_proj_offloaded", ("custom", {"query_proj": "offload", "key_proj": "offload", "value_proj": "offload"})),
    ("minimal_offloaded", ("custom", {n: "offload" for n in ("query_proj", "key_proj", "value_proj", "out_proj",
                                                             "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0",
                                                             "moe_mlpwi_1", "moe_mlpwo")})),
])
def test_upstream_remat_policies_map_onto_this_trainers_names(policy, want):
    from MaxText.config.schema import REMAT_TENSOR_NAMES

    cfg = load_config([f"remat_policy={policy}", "query_proj=offload"])  # ignored, as upstream ignores it
    mode, locations = want
    assert cfg.remat_policy == mode
    if mode == "custom":
        assert {n: cfg[n] for n in REMAT_TENSOR_NAMES} == {n: locations.get(n, "remat") for n in REMAT_TENSOR_NAMES}


def test_upstream_base_yml_as_a_config_file_loads(tmp_path, caplog):
    """Every key of upstream's base.yml at upstream's default, as one config file (a MaxText user's copy): it
    loads (hardware=cpu for this machine), mapping upstream's defaults onto this trainer's, with a no-op line."""
    path = tmp_path / "maxtext_base.yml"
    path.write_text(yaml.safe_dump(dict(upstream.upstream_defaults())))
    with caplog.at_level(logging.WARNING):
        cfg = load_config([str(path), "hardware=cpu"])
    assert (cfg.attention, cfg.attention_type, cfg.moe_impl, cfg.model_name) == ("dot_product", "mha", "ragged", None)
    assert plain(cfg)["logical_axis_rules"] == ours()["logical_axis_rules"]
    assert sum("no effect here" in line for line in warnings(caplog)) == 1
    with pytest.raises(ConfigError, match="hardware=tpu is a MaxText value"):  # upstream's default hardware
        load_config([str(path)])


# A recipe in the style of upstream's GPU MoE recipes (MaxText keys and values throughout), tiny.
UPSTREAM_STYLE_RECIPE = """\
base_config: {base}
hardware: cpu
model_name: default
decoder_block: mixtral
base_emb_dim: 32
base_num_query_heads: 4
base_num_kv_heads: 2
head_dim: 8
base_mlp_dim: 64
base_moe_mlp_dim: 64
base_num_decoder_layers: 2
first_num_dense_layers: 0
vocab_size: 64
num_experts: 4
num_experts_per_tok: 2
max_target_length: 16
per_device_batch_size: 1
dataset_type: synthetic
attention: autoselected
attention_type: global
remat_policy: minimal_with_context
megablox: false
sparse_matmul: true
capacity_factor: -1
use_iota_embed: true
reuse_example_batch: 1
max_segments_per_seq: 32
logits_dot_in_fp32: false
enable_checkpointing: false
enable_tensorboard: false
eval_interval: -1
eval_steps: -1
steps: 3
log_period: 1
skip_jax_distributed_system: true
gcs_metrics: false
enable_goodput_recording: false
checkpoint_storage_use_ocdbt: true
checkpoint_storage_use_zarr3: true
tokenizer_type: sentencepiece
"""


def test_an_upstream_style_recipe_trains(tmp_path):
    """A recipe written with MaxText's keys and values loads and trains on CPU (loss finite, three steps); one
    refused setting in it stops with that key's reason."""
    from tests.tiny import train_records

    path = tmp_path / "mixtral_tiny.yml"
    path.write_text(UPSTREAM_STYLE_RECIPE.format(base=BASE_CONFIG))
    cfg = load_config([str(path), f"base_output_directory={tmp_path}", "run_name=upstream"])
    assert (cfg.moe_impl, cfg.remat_policy, cfg.capacity_factor) == ("ragged", "minimal", None)
    records = train_records(cfg)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in records)
    path.write_text(UPSTREAM_STYLE_RECIPE.format(base=BASE_CONFIG) + "attention_sink: true\n")
    with pytest.raises(ConfigError, match="attention_sink=true .* is a MaxText key this trainer does not support"):
        load_config([str(path)])


def test_save_checkpoint_on_start_and_on_completion(tmp_path):
    """MaxText's save_checkpoint_on_start saves step 0 of a fresh run; save_checkpoint_on_completion=false skips the
    last step's save (only multiples of checkpoint_period)."""
    from MaxText.trainer.loop import train
    from tests.tiny import TINY, args

    base = args(TINY, [f"base_output_directory={tmp_path}", "steps=2", "checkpoint_period=100",
                       "async_checkpointing=false"])
    for name, extra, want in [("both", ["save_checkpoint_on_start=true"], ["0", "2"]),
                              ("start", ["save_checkpoint_on_start=true", "save_checkpoint_on_completion=false"], ["0"]),
                              ("neither", ["save_checkpoint_on_completion=false"], [])]:
        train(load_config(args(base, [f"run_name={name}", *extra])), log=lambda *_: None)
        directory = tmp_path / name / "checkpoints"
        got = sorted(os.listdir(directory)) if directory.exists() else []
        assert sorted(g for g in got if g.isdigit()) == want, (name, got)


def test_reuse_example_batch_repeats_the_first_batch():
    from MaxText.data.synthetic import SyntheticData
    from MaxText.trainer.loop import Repeat
    from tests.tiny import tiny_config

    cfg = tiny_config("reuse_example_batch=1")
    data, fresh = Repeat(SyntheticData(cfg, 2)), SyntheticData(cfg, 2)
    first = next(fresh)
    for _ in range(3):
        batch = next(data)
        assert all((batch[k] == first[k]).all() for k in first)
    assert data.state() == fresh.state()  # the position after the one batch it read


def test_skip_jax_distributed_system_never_initializes(monkeypatch):
    import jax

    from MaxText.parallel.distributed import maybe_initialize_distributed

    def refuse(**kwargs):
        raise AssertionError("jax.distributed.initialize was called")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    maybe_initialize_distributed(load_config(["skip_jax_distributed_system=true"]))
    with pytest.raises(AssertionError, match="was called"):  # the same environment without the key would
        maybe_initialize_distributed(load_config([]))


def test_the_readme_shows_the_table_as_the_code_has_it():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    shown = readme.split("<!-- upstream-keys:begin -->\n")[1].split("<!-- upstream-keys:end -->")[0]
    assert shown == upstream.markdown(), "README's Coming from MaxText table is stale: paste python -m MaxText.upstream"


def test_every_default_is_upstreams_or_listed_with_a_reason():
    """An implemented key's default means upstream's, or the key is in MODEL_DEFAULT_KEYS / DEFAULT_DIFFERENCES
    (the README's table of differences, each with its reason); a listed key really differs."""
    base = ours()
    listed = set(upstream.MODEL_DEFAULT_KEYS) | set(upstream.DEFAULT_DIFFERENCES)
    for key in upstream.implemented_keys():
        if key == "logical_axis_rules":
            continue
        same = upstream.same_default(key, base[key])
        assert same != (key in listed), f"{key}: here {base[key]!r}, upstream {upstream.upstream_defaults()[key]!r}"


def test_a_model_file_names_the_defaults_it_relies_on_that_differ(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(["model_name=mixtral-8x7b"])
    line = next(r.getMessage() for r in caplog.records if "differ from MaxText's" in r.getMessage())
    assert "learning_rate=0.003 (MaxText: 3e-05)" in line and "steps=200 (MaxText: 150001)" in line, line


def test_dropout_rate_is_refused_for_its_own_reason():
    load_config(["dropout_rate=0"])
    with pytest.raises(ConfigError, match=r"dropout_rate=0.1 .* dropout is not built here"):
        load_config(["dropout_rate=0.1"])

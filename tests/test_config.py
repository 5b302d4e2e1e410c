"""Tests of the configuration layer: MaxText/config/ and the mesh arithmetic in MaxText/parallel/sharding.py.

Covers: every shipped YAML loads; `base_config:` chains; `model_name` merging; unknown keys with a
suggestion; typing of values; the cross-key checks; mesh sizes against the device count; the global
batch; XLA flag merging; loading without side effects; and the `python -m MaxText.train` error path
(exit code 2, one line on stderr, no traceback). Nothing here compiles or runs a model.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest
import yaml

from MaxText.config import checks, parse, load as config
from MaxText.parallel import checks as mesh_checks, sharding
from MaxText.config.schema import MESH_AXES, SCHEMA
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO_ROOT, "configs")
BASE_YML = os.path.join(CONFIGS, "base.yml")


def write_yaml(path, text: str) -> str:
    """Writes `text` to `path` (a pathlib.Path) and returns it as a str."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def assert_config_error(argv, *needles: str) -> ConfigError:
    """load_config(argv) raises ConfigError whose message contains every needle."""
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"ConfigError for {argv} should mention {needle!r}; got: {message}"
    return info.value


# ------------------------------------------------------------------------------- shipped config files


def _shipped_configs() -> list:
    """base.yml, each configs/models/<name>.yml (as model_name=<name>), and any other YAML by path."""
    models_dir = os.path.join(CONFIGS, "models")
    cases = [pytest.param([BASE_YML], id="base.yml")]
    for path in sorted(glob.glob(os.path.join(models_dir, "*.yml"))):
        name = os.path.basename(path)[: -len(".yml")]
        cases.append(pytest.param([f"model_name={name}"], id=f"models/{name}"))
    others = glob.glob(os.path.join(CONFIGS, "**", "*.yml"), recursive=True)
    others += glob.glob(os.path.join(CONFIGS, "**", "*.yaml"), recursive=True)
    for path in sorted(set(others)):
        if os.path.abspath(path) == os.path.abspath(BASE_YML) or os.path.dirname(os.path.abspath(path)) == models_dir:
            continue
        cases.append(pytest.param([path], id=os.path.relpath(path, CONFIGS)))
    return cases


@pytest.mark.parametrize("argv", _shipped_configs())
def test_shipped_config_loads_and_validates(argv):
    cfg = load_config(argv)  # load_config runs every check_* function
    assert isinstance(cfg, ml_collections.FrozenConfigDict), "load_config should return a frozen config"
    checks.validate(cfg)


def test_no_arguments_loads_base_defaults():
    cfg = load_config([])
    assert cfg.steps == 200 and cfg.moe_impl == "ragged" and cfg.run_name is None, dict(cfg)  # dropless by default


# ------------------------------------------------------------------------------- base_config chains


def test_base_config_absolute_path_inherits_and_overrides(tmp_path):
    recipe = write_yaml(tmp_path / "recipe.yml", f"base_config: {BASE_YML}\nsteps: 7\nbase_emb_dim: 64\n")
    cfg = load_config([recipe])
    assert (cfg.steps, cfg.base_emb_dim) == (7, 64), "recipe values should override base.yml"
    assert cfg.vocab_size == load_config([]).vocab_size, "keys the recipe omits keep base.yml defaults"


def test_two_level_chain_child_wins_over_parent(tmp_path):
    write_yaml(tmp_path / "parent.yml", f"base_config: {BASE_YML}\nsteps: 11\nlog_period: 5\nvocab_size: 1024\n")
    child = write_yaml(tmp_path / "child.yml", "base_config: parent.yml\nsteps: 22\n")  # relative to child
    cfg = load_config([child])
    assert cfg.steps == 22, f"child's steps should win over parent's 11, got {cfg.steps}"
    assert (cfg.log_period, cfg.vocab_size) == (5, 1024), "values only the parent sets should be inherited"
    assert cfg.base_emb_dim == 128, "values neither file sets should come from base.yml"


def test_command_line_wins_over_every_file(tmp_path):
    write_yaml(tmp_path / "parent.yml", f"base_config: {BASE_YML}\nsteps: 11\nlog_period: 5\n")
    child = write_yaml(tmp_path / "child.yml", "base_config: parent.yml\nsteps: 22\n")
    cfg = load_config([child, "steps=33", "log_period=3"])
    assert (cfg.steps, cfg.log_period) == (33, 3), "key=value should override child and parent files"


def test_missing_base_config_target_raises(tmp_path):
    recipe = write_yaml(tmp_path / "recipe.yml", "base_config: nowhere.yml\nsteps: 3\n")
    assert_config_error([recipe], "base_config", "nowhere.yml")


def test_base_config_cycle_raises(tmp_path):
    a = write_yaml(tmp_path / "a.yml", "base_config: b.yml\n")
    write_yaml(tmp_path / "b.yml", "base_config: a.yml\n")
    assert_config_error([a], "cycle")


# ------------------------------------------------------------------------------- model_name merging


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A config dir with a copy of base.yml and models/foo.yml, installed as parse.CONFIG_DIR."""
    shutil.copy(BASE_YML, tmp_path / "base.yml")
    write_yaml(tmp_path / "models" / "foo.yml", "base_emb_dim: 256\nbase_num_decoder_layers: 8\nvocab_size: 1024\n")
    monkeypatch.setattr(parse, "CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(parse, "BASE_CONFIG", str(tmp_path / "base.yml"))
    return tmp_path


def test_model_file_overrides_base_defaults(model_dir):
    cfg = load_config(["model_name=foo"])
    assert (cfg.base_emb_dim, cfg.base_num_decoder_layers, cfg.vocab_size) == (256, 8, 1024), dict(cfg)
    assert cfg.steps == load_config([]).steps, "keys the model file omits keep base.yml defaults"
    assert (cfg.head_dim, cfg.num_experts, cfg.base_num_query_heads) == (128, 1, 16), \
        "the default job's model keys a model file omits take MaxText's defaults (a dense model stays dense)"
    assert cfg.model_name == "foo"


def test_model_file_overrides_the_config_chain_as_in_maxtext(model_dir, caplog):
    """Upstream's precedence: config files, then the model file, then the command line. A recipe key the model
    file sets otherwise is an error naming both files (upstream would drop it silently), unless
    override_model_config: true, when the recipe's value stands with a log line."""
    recipe = write_yaml(model_dir / "recipe.yml",
                        "base_config: base.yml\nmodel_name: foo\nbase_num_decoder_layers: 6\n")
    assert_config_error([recipe], "base_num_decoder_layers: 6", "recipe.yml", "foo.yml", "override_model_config")
    same = write_yaml(model_dir / "same.yml", "base_config: base.yml\nmodel_name: foo\nbase_num_decoder_layers: 8\n")
    assert load_config([same]).base_num_decoder_layers == 8, "the same value in both is no clash"
    recipe = write_yaml(model_dir / "recipe.yml", "base_config: base.yml\nmodel_name: foo\nbase_num_decoder_layers: 6\n"
                                                  "override_model_config: true\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_config([recipe])
    assert (cfg.base_num_decoder_layers, cfg.base_emb_dim) == (6, 256), dict(cfg)
    assert any("override_model_config=true: base_num_decoder_layers=6" in r.getMessage() for r in caplog.records)


def test_command_line_key_the_model_file_sets_otherwise_needs_override_model_config(model_dir):
    assert_config_error(["model_name=foo", "base_num_decoder_layers=2"], "base_num_decoder_layers=2",
                        "foo.yml", "override_model_config=true")
    assert load_config(["model_name=foo", "base_num_decoder_layers=8"]).base_num_decoder_layers == 8
    for flag in ("override_model_config=true", "override_model_config=1"):
        cfg = load_config(["model_name=foo", "base_num_decoder_layers=2", "vocab_size=64", flag])
        assert (cfg.base_num_decoder_layers, cfg.vocab_size, cfg.base_emb_dim) == (2, 64, 256), dict(cfg)
    recipe = write_yaml(model_dir / "recipe.yml", "base_config: base.yml\nmodel_name: foo\noverride_model_config: 1\n")
    assert load_config([recipe, "base_num_decoder_layers=2"]).base_num_decoder_layers == 2, \
        "override_model_config set in a config file lets the command line override the model file"


def test_a_copy_of_upstreams_base_yml_yields_to_the_model_file(tmp_path):
    """Upstream's base.yml sets every model key; with model_name its values are defaults the model file
    replaces (MaxText's precedence), so base.yml + model_name=mixtral-8x7b is Mixtral, not the dense 1.1B default.
    A value in that root file that is no default and clashes with the model file is an error."""
    from MaxText.config import upstream
    base = dict(upstream.upstream_defaults(), hardware="cpu")
    path = tmp_path / "base.yml"
    path.write_text(yaml.safe_dump(base))
    cfg = load_config([str(path), "model_name=mixtral-8x7b"])
    assert (cfg.base_emb_dim, cfg.num_experts, cfg.base_num_decoder_layers, cfg.first_num_dense_layers,
            cfg.vocab_size) == (4096, 8, 32, 0, 32000)
    path.write_text(yaml.safe_dump(dict(base, base_emb_dim=1024)))
    assert_config_error([str(path), "model_name=mixtral-8x7b"], "base_emb_dim: 1024", "mixtral-8x7b.yml")


def test_base_config_falls_back_to_the_configs_folder(tmp_path):
    """A recipe in a folder of its own finds `base_config: base.yml` in configs/, as upstream's do."""
    recipe = write_yaml(tmp_path / "recipes" / "r.yml", "base_config: base.yml\nsteps: 7\n")
    cfg = load_config([recipe])
    assert cfg.steps == 7 and cfg.base_emb_dim == load_config([]).base_emb_dim
    missing = write_yaml(tmp_path / "m.yml", "base_config: nowhere.yml\n")
    assert_config_error([missing], "nowhere.yml", "does not exist")


def test_upstreams_config_paths_read_this_trainers_configs(caplog):
    """`MaxText/configs/base.yml` (upstream's old layout) and `src/maxtext/configs/...` (0.2.5's) name the same
    files under configs/ here, with a log line."""
    with caplog.at_level(logging.WARNING):
        cfg = load_config(["MaxText/configs/base.yml", "steps=3"])
    assert cfg.steps == 3 and any("MaxText's path of a config" in r.getMessage() for r in caplog.records)
    assert load_config(["src/maxtext/configs/base.yml"]).steps == load_config([]).steps
    assert_config_error(["MaxText/configs/nowhere.yml"], "nowhere.yml")


def test_the_config_folders_models_are_found_first(tmp_path):
    """upstream's search order for model_name: models/ beside the config, then beside its folder, then configs/."""
    write_yaml(tmp_path / "models" / "mixtral-8x7b.yml", "base_emb_dim: 64\n")
    recipe = write_yaml(tmp_path / "r.yml", "base_config: base.yml\nmodel_name: mixtral-8x7b\n")
    assert load_config([recipe]).base_emb_dim == 64
    assert load_config(["model_name=mixtral-8x7b"]).base_emb_dim == 4096


def test_booleans_take_one_and_zero_as_upstream_does(tmp_path):
    assert load_config(["scan_layers=0"]).scan_layers is False and load_config(["scan_layers=1"]).scan_layers is True
    recipe = write_yaml(tmp_path / "r.yml", "base_config: base.yml\nscan_layers: 0\n")
    assert load_config([recipe]).scan_layers is False
    assert_config_error(["scan_layers=2"], "scan_layers")


def test_upstreams_empty_base_output_directory_is_maxtext_output():
    assert load_config(["base_output_directory="]).base_output_directory == "maxtext_output"


def test_unknown_model_name_raises(model_dir):
    assert_config_error(["model_name=bar"], "model_name", "bar")


def test_unknown_model_name_raises_config_error_without_models_dir(tmp_path, monkeypatch):
    # git does not keep empty folders, so a fresh checkout may have no configs/models at all.
    shutil.copy(BASE_YML, tmp_path / "base.yml")
    monkeypatch.setattr(parse, "CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(parse, "BASE_CONFIG", str(tmp_path / "base.yml"))
    assert_config_error(["model_name=bar"], "model_name", "bar")


# ------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("override, suggestion", [
    ("stepz=3", "steps"),
    ("base_emb_dmi=8", "base_emb_dim"),
])
def test_unknown_key_on_command_line_suggests_nearest(override, suggestion):
    bad = override.split("=")[0]
    error = assert_config_error([override], repr(bad), repr(suggestion))
    assert "did you mean" in str(error), str(error)


def test_unknown_key_in_yaml_file_names_key_and_file(tmp_path):
    recipe = write_yaml(tmp_path / "recipe.yml", f"base_config: {BASE_YML}\nlearning_rat: 0.1\n")
    assert_config_error([recipe], "'learning_rat'", "'learning_rate'", "recipe.yml")


def test_argument_without_equals_raises():
    assert_config_error(["steps"], "steps", "key=value")


# ------------------------------------------------------------------------------- value types


@pytest.mark.parametrize("override, expected", [
    ("steps=10", 10),
    ("learning_rate=1", 1.0),
    ("scan_layers=false", False),
    ("capacity_factor=1.5", 1.5),
    ("capacity_factor=null", None),
    ("run_name=123", "123"),
    ("gradient_clipping_threshold=null", None),
])
def test_value_parsed_to_type_of_default(override, expected):
    key = override.split("=")[0]
    value = load_config([override])[key]
    assert value == expected and type(value) is type(expected), (
        f"{override} should give {expected!r} ({type(expected).__name__}), got {value!r} ({type(value).__name__})")


def test_float_in_exponent_notation_is_accepted():
    # PyYAML (YAML 1.1) reads "3e-4" as a string; a float key should still take it.
    cfg = load_config(["learning_rate=3e-4"])
    assert cfg.learning_rate == pytest.approx(3e-4) and isinstance(cfg.learning_rate, float), cfg.learning_rate


def test_null_on_command_line_unsets_optional_string_keys():
    keys = [k for k, spec in SCHEMA.items() if spec.null and spec.type is str]
    values = {k: load_config([f"{k}=null"])[k] for k in keys}
    not_unset = {k: v for k, v in values.items() if v is not None}
    assert not_unset == {}, f"`key=null` should unset these keys (None), but they hold strings: {not_unset}"


@pytest.mark.parametrize("override", [
    "steps=abc", "steps=1.5", "scan_layers=maybe", "learning_rate=fast", "steps=null", "steps=true",
])
def test_wrong_type_raises_naming_key(override):
    key = override.split("=")[0]
    assert_config_error([override], key)


def test_wrong_type_in_yaml_file_raises_naming_key(tmp_path):
    recipe = write_yaml(tmp_path / "recipe.yml", f"base_config: {BASE_YML}\nscan_layers: 3\n")
    assert_config_error([recipe], "scan_layers", "recipe.yml")


# ------------------------------------------------------------------------------- cross-key checks


CROSS_KEY_CASES = [
    (["num_experts_per_tok=9"], ["num_experts_per_tok=9", "num_experts=8"]),
    (["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"], ["ici_fsdp_parallelism", "ici_data_parallelism"]),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], ["base_num_query_heads", "base_num_kv_heads"]),
    (["first_num_dense_layers=5"], ["first_num_dense_layers", "base_num_decoder_layers"]),
    (["load_parameters_path=/a", "load_full_state_path=/b"], ["load_parameters_path", "load_full_state_path"]),
    (["moe_impl=ragged", "te_gmm_quantization=mxfp8"], ["te_gmm_quantization=mxfp8", "moe_impl=te_dropless"]),
    (["moe_impl=ragged", "ragged_buffer_factor=0"], ["ragged_buffer_factor"]),
    (["sparse_matmul=true", "moe_impl=dense"], ["sparse_matmul=true", "moe_impl=ragged"]),
    (["query_proj=somewhere"], ["query_proj", "somewhere"]),
    (["logical_axis_rules=[['embed', ['model']]]"], ["logical_axis_rules", "model"]),
    (["moe_impl=sparse"], ["moe_impl", "sparse"]),
    (["ici_tensor_parallelism=0"], ["ici_tensor_parallelism"]),
    (["steps=0"], ["steps"]),
]


@pytest.mark.parametrize("argv, needles", [pytest.param(a, n, id=" ".join(a)) for a, n in CROSS_KEY_CASES])
def test_cross_key_check_raises_naming_keys(argv, needles):
    assert_config_error(argv, *needles)


# ------------------------------------------------------------------------------- mesh and batch


def _axes(shape: dict) -> dict:
    return {a: shape[a] for a in MESH_AXES}


MESH_CASES = [
    ([], dict(data=1, fsdp=8, context=1, expert=1, tensor=1)),
    (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"], dict(data=1, fsdp=2, context=1, expert=4, tensor=1)),
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
     dict(data=2, fsdp=2, context=1, expert=1, tensor=2)),
    (["dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4"], dict(data=1, fsdp=8, context=1, expert=1, tensor=1)),
    (["ici_fsdp_parallelism=2", "ici_data_parallelism=-1"], dict(data=4, fsdp=2, context=1, expert=1, tensor=1)),
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=-1"], dict(data=1, fsdp=2, context=4, expert=1, tensor=1)),
    (["ici_context_parallelism=2", "dcn_context_parallelism=2", "ici_fsdp_parallelism=2"],
     dict(data=1, fsdp=2, context=4, expert=1, tensor=1)),
]


@pytest.mark.parametrize("argv, expected", [pytest.param(a, e, id=" ".join(a) or "defaults") for a, e in MESH_CASES])
def test_mesh_shape_on_8_devices(argv, expected):
    shape = sharding.mesh_shape(load_config(argv), num_devices=8)
    assert _axes(shape) == expected, f"{argv}: mesh {_axes(shape)}, expected {expected}"


def test_mesh_shape_dcn_times_ici_fsdp():
    shape = sharding.mesh_shape(load_config(["dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4"]), num_devices=8)
    assert (shape["_dcn"][MESH_AXES.index("fsdp")], shape["_ici"][MESH_AXES.index("fsdp")]) == (2, 4), shape


@pytest.mark.parametrize("argv", [
    pytest.param(["ici_fsdp_parallelism=3"], id="ici_fsdp_parallelism=3"),
    pytest.param(["ici_fsdp_parallelism=3", "ici_data_parallelism=-1"], id="3 does not divide 8"),
    pytest.param(["dcn_fsdp_parallelism=3"], id="dcn_fsdp_parallelism=3"),
])
def test_mesh_shape_not_matching_device_count_raises(argv):
    with pytest.raises(ConfigError, match="parallelism"):
        sharding.mesh_shape(load_config(argv), num_devices=8)


@pytest.mark.parametrize("expert", ["ici_expert_parallelism=4", "ici_expert_parallelism=-1"])
def test_experts_that_do_not_split_over_the_expert_axis_are_refused_with_the_mesh(expert):
    """One check, whether the axis is set or fills the devices (-1): parallel/checks.check_mesh."""
    cfg = load_config(["num_experts=6", "ici_fsdp_parallelism=2", expert])
    with pytest.raises(ConfigError, match="num_experts=6 must be divisible by the expert mesh axis, which is 4 here"):
        sharding.mesh_shape(cfg, num_devices=8)


def test_global_batch_size_fractional_per_device():
    assert config.global_batch_size(load_config(["per_device_batch_size=0.5"]), 8) == 4


def test_global_batch_size_not_whole_raises():
    cfg = load_config(["per_device_batch_size=0.3"])
    with pytest.raises(ConfigError, match="per_device_batch_size"):
        config.global_batch_size(cfg, 8)


def test_a_batch_that_does_not_split_over_the_data_shards_is_refused_with_the_mesh():
    """The trainer (create_mesh), the planner and the preflight (mesh_shape) refuse it as the mesh is known."""
    cfg = load_config(["per_device_batch_size=0.5"])  # global batch 4 over fsdp=8
    for make in (lambda: sharding.create_mesh(cfg), lambda: sharding.mesh_shape(cfg, 8)):
        with pytest.raises(ConfigError, match="per_device_batch_size"):
            make()
    shape = _axes(sharding.mesh_shape(load_config([]), 8))
    assert shape == dict(sharding.create_mesh(load_config([])).shape)
    with pytest.raises(ConfigError, match="per_device_batch_size"):
        mesh_checks.check_batch(cfg, shape, config.global_batch_size(cfg, 8))
    mesh_checks.check_batch(load_config([]), shape, config.global_batch_size(load_config([]), 8))


# ------------------------------------------------------------------------------- XLA flags


def test_apply_xla_flags_merges_and_config_wins():
    cfg = load_config(["xla_flags=--xla_a=1 --xla_b=2"])
    environ = {"XLA_FLAGS": "--xla_b=9 --xla_c=3", "OTHER": "x"}
    config.apply_xla_flags(cfg, environ)
    flags = environ["XLA_FLAGS"].split()
    assert sorted(flags) == ["--xla_a=1", "--xla_b=2", "--xla_c=3"], f"merged XLA_FLAGS: {flags}"
    assert environ["OTHER"] == "x"


def test_apply_xla_flags_without_existing_env():
    environ = {}
    config.apply_xla_flags(load_config(["xla_flags=--xla_a=1"]), environ)
    assert environ == {"XLA_FLAGS": "--xla_a=1"}


def test_apply_xla_flags_unset_leaves_environ_untouched():
    for environ in ({}, {"XLA_FLAGS": "--xla_b=9"}):
        before = dict(environ)
        config.apply_xla_flags(load_config([]), environ)
        assert environ == before, f"xla_flags unset changed {before} to {environ}"


# ------------------------------------------------------------------------------- no side effects


def test_loading_creates_no_directory(tmp_path):
    target = tmp_path / "nothere"
    load_config([f"base_output_directory={target}", "run_name=x"])
    assert not target.exists(), f"load_config created {target}"
    assert list(tmp_path.iterdir()) == [], f"load_config wrote into {tmp_path}"


# ------------------------------------------------------------------------------- command line


CLI_CASES = [
    ("stepz=3", ["stepz", "steps"]),
    ("steps=abc", ["steps", "abc"]),
    ("moe_impl=te_dropless", ["moe_impl=te_dropless", "te_kernels=reference"]),
    ("does_not_exist.yml", ["does_not_exist.yml"]),
]


@pytest.mark.parametrize("arg, needles", [pytest.param(a, n, id=a) for a, n in CLI_CASES])
def test_train_cli_config_error_is_one_line_exit_2(arg, needles):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "MaxText.train", arg], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, report
    assert "Traceback" not in proc.stdout + proc.stderr, report
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"stderr should be exactly one non-empty line\n{report}"
    for needle in needles:
        assert needle in lines[0], f"stderr should mention {needle!r}\n{report}"


def test_expert_parallel_dropless_needs_the_batch_split_over_expert():
    """A rule set that splits experts over `expert` but not the batch is refused when the config loads (it
    used to surface at trace time, from inside the MoE layer)."""
    rules = ("logical_axis_rules=[['activation_batch', ['data', 'fsdp']], ['exp', ['expert']], "
             "['embed', ['fsdp']]]")
    with pytest.raises(ConfigError, match="keep 'expert' in the activation_batch rule"):
        load_config(["ici_expert_parallelism=2", "ici_fsdp_parallelism=-1", rules])
    load_config(["ici_expert_parallelism=1", "ici_fsdp_parallelism=-1", rules])  # no expert parallelism: fine


# ------------------------------------------------------------------------------- parsing without surprises

@pytest.mark.parametrize("arg,value", [("steps=010", 10), ("steps=+7", 7), ("learning_rate=3e-4", 3e-4),
                                       ("learning_rate=2", 2.0), ("enable_checkpointing=FALSE", False),
                                       ("capacity_factor=-1", None)])
def test_command_line_values_are_read_by_their_keys_type(arg, value):
    """Not by YAML 1.1, which read steps=010 as 8 (octal). capacity_factor=-1 is MaxText's "no cap"."""
    key = arg.split("=")[0]
    assert load_config([arg])[key] == value


@pytest.mark.parametrize("arg", ["steps=0x10", "steps=1:30", "steps=1e3", "enable_checkpointing=yes",
                                 "enable_checkpointing=on", "steps=ten"])
def test_command_line_values_yaml_would_have_guessed_are_errors(arg):
    """YAML 1.1 took 0x10 for 16, 1:30 for 90 and yes/on for true."""
    with pytest.raises(ConfigError, match=rf"{arg.split('=')[0]}='.*' \(on the command line\) is not a valid"):
        load_config([arg])


def test_a_key_given_twice_is_an_error_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"steps is given twice on the command line \(steps=5 and steps=6\)"):
        load_config(["steps=5", "steps=6"])
    config = tmp_path / "twice.yml"
    config.write_text("steps: 5\nlog_period: 1\nsteps: 6\n")
    with pytest.raises(ConfigError, match=r"twice.yml: steps is given twice \(lines 1 and 3\)"):
        load_config([str(config)])


@pytest.mark.parametrize("model", ["deepseek3-tiny", "default"])
def test_the_dense_weight_table_is_the_layers_own(model):
    """config/checks.dense_weights (what the start-up checks hold `quantization` to) lists exactly the weights the
    layers hand to linear.dense_gemm: their shapes and logical axes, for MLA (with a low-rank query, a dense
    layer, shared experts) and GQA. A layer that changes a projection fails here until the table follows."""
    from flax import nnx

    from MaxText.config.checks import dense_weights
    from MaxText.layers.models import Transformer
    from MaxText.parallel import sharding
    from tests.tiny import tiny_config

    overrides = ["model_name=deepseek3-tiny", "override_model_config=true", "q_lora_rank=32"] if model != "default" \
        else ["first_num_dense_layers=1", "shared_experts=1"]
    cfg = tiny_config(*overrides, "scan_layers=false")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, sharding.axis_rules(cfg), rngs=nnx.Rngs(0)))
    found = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        names = [str(p) for p in path]
        if names[-1] in ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "out", "wi_0", "wi_1") and \
                any(n in ("self_attention", "mlp", "shared_experts") for n in names):
            found[(tuple(var.shape), tuple(var.get_metadata()["out_sharding"]))] = True
    table = {(w.shape, w.logical) for w in dense_weights(cfg).values()}
    assert table == set(found), f"only in the table: {table - set(found)}; only in the layers: {set(found) - table}"


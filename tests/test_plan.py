"""MaxText.plan: its activation estimate against XLA's own accounting of the real train step, the GPU
recipes' fit, and the command line."""

import glob
import json
import math
import os

import jax
import pytest

from MaxText import plan as plan_command
from MaxText.planning import plan
from MaxText.parallel import sharding
from MaxText.config.parse import CONFIG_DIR
from MaxText.config.load import load_config, replace
from MaxText.data.records import abstract_batch
from MaxText.step.state import state_spec
from MaxText.step.train_step import jit_train_step
from tests.tiny import args


def compiled_memory(cfg, devices: int = 1):
    """memory_analysis() of the real jitted train step on `devices` CPU devices (compiled, never run): per device."""
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    spec = state_spec(cfg, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    batch = abstract_batch(round(devices * cfg.per_device_batch_size), cfg.max_target_length, batch_sharding)
    with jax.set_mesh(mesh):
        return jit_train_step(cfg, spec, batch_sharding).lower(spec.abstract, batch).compile().memory_analysis()


# float32 (XLA:CPU computes bf16 through float32 copies, which a GPU does not), sequences short next to
# the width so the layers rather than CPU softmax temporaries decide the peak.
ESTIMATED = {
    "deepseek3-tiny full": ["model_name=deepseek3-tiny", "remat_policy=full", "per_device_batch_size=4"],
    "deepseek3-tiny minimal": ["model_name=deepseek3-tiny", "remat_policy=minimal"],
    "qwen3-tiny full": ["model_name=qwen3-tiny", "remat_policy=full"],
    "mixtral-tiny none": ["model_name=mixtral-tiny", "remat_policy=none", "moe_impl=dense", "capacity_factor=1.25"],
}
COMMON = ["moe_impl=ragged", "dtype=float32", "max_target_length=32", "num_devices=1", "enable_tensorboard=false"]
# Context parallelism over 4 devices: a quarter of each 256-token sequence per device, the keys and values (MLA: its
# latent, expanded to every head's keys and values) gathered whole.
CONTEXT = ["max_target_length=256", "num_devices=4", "ici_fsdp_parallelism=1", "ici_context_parallelism=4",
           "attention=chunked", "attention_chunk_size=32"]
ESTIMATED |= {
    "deepseek3-tiny full, context 4": ["model_name=deepseek3-tiny", "remat_policy=full", "per_device_batch_size=0.25",
                                       *CONTEXT],
    "deepseek3-tiny minimal, context 4": ["model_name=deepseek3-tiny", "remat_policy=minimal",
                                          "per_device_batch_size=0.5", *CONTEXT],
    "qwen3-tiny minimal, context 4": ["model_name=qwen3-tiny", "remat_policy=minimal", "per_device_batch_size=0.25",
                                      *CONTEXT],
}


@pytest.mark.parametrize("case", ESTIMATED)
def test_activation_estimate_within_25_percent_of_compiled_train_step(case):
    """XLA's temp allocation of the train step holds the activations, the float32 gradients and the layer
    loop's weight copies: the plan's activations + gradients + layer weights must be within 25% of it."""
    cfg = load_config(args(COMMON, ESTIMATED[case]))  # later keys win: mixtral-tiny's moe_impl=dense
    p = plan.plan(cfg)
    estimate = p["bytes"]["activations"] + p["bytes"]["gradients"] + p["bytes"]["layer_weights"]
    measured = compiled_memory(cfg, cfg.num_devices).temp_size_in_bytes
    assert abs(estimate / measured - 1) <= 0.25, f"{case}: plan {estimate / 1e6:.2f} MB, XLA {measured / 1e6:.2f} MB"


def test_start_up_refuses_only_beyond_the_estimate_margin():
    """check_fits (the trainer's start-up check): an estimate 1.2x the device memory is a warning (it is within
    the plan's 25% error), 1.5x is a one-line ConfigError giving the estimate and the limit; within HEADROOM
    nothing is said."""
    from MaxText.config.errors import ConfigError

    cfg = load_config(args(COMMON, ["model_name=deepseek3-tiny"]))
    mesh_shape = sharding.mesh_shape(cfg, 1)
    spec = state_spec(cfg, plan.abstract_mesh(mesh_shape))
    total = sum(plan.device_bytes(cfg, spec, mesh_shape, 1)[0].values())
    for ratio, expect in [(0.5, None), (1.2, "warning"), (1.5, "error")]:
        hbm = total / ratio / plan.GIB
        cfg = replace(cfg, hbm_gib=hbm)
        lines = []
        if expect == "error":
            with pytest.raises(ConfigError) as e:
                plan.check_fits(cfg, spec, mesh_shape, 1, lines.append)
            assert f"needs about {total / plan.GIB:.3g} GiB per device" in str(e.value), e.value
            assert f"a device has {hbm:.3g} GiB" in str(e.value) and "\n" not in str(e.value), e.value
        else:
            plan.check_fits(cfg, spec, mesh_shape, 1, lines.append)
            assert [line.split(":")[0] for line in lines] == ([expect] if expect else []), lines


def test_on_cpu_without_hbm_gib_the_host_memory_is_the_limit(monkeypatch):
    """CPU devices share the host's memory: without hbm_gib, a run is checked against it over the local CPU
    devices (upstream's base.yml with hardware=cpu used to be killed by the OOM killer with no word)."""
    from MaxText.config.errors import ConfigError

    cfg = load_config(args(COMMON, ["model_name=deepseek3-tiny"]))
    mesh_shape = sharding.mesh_shape(cfg, 1)
    spec = state_spec(cfg, plan.abstract_mesh(mesh_shape))
    total = sum(plan.device_bytes(cfg, spec, mesh_shape, 1)[0].values())
    host = total * jax.local_device_count() / 2 / plan.GIB  # half of what the 8 devices together need
    monkeypatch.setattr(plan, "host_memory_gib", lambda: host)
    with pytest.raises(ConfigError, match=f"this host's {host:.3g} GiB over {jax.local_device_count()} CPU devices"):
        plan.check_fits(cfg, spec, mesh_shape, 1, print)
    monkeypatch.setattr(plan, "host_memory_gib", lambda: host * 4)
    plan.check_fits(cfg, spec, mesh_shape, 1, print)


def test_state_bytes_are_the_shards_the_trainer_creates():
    """Per-device params and optimizer bytes equal the shard sizes of state_spec on a real 8-device mesh."""
    cfg = load_config(["model_name=deepseek3-tiny", "ici_fsdp_parallelism=2", "ici_expert_parallelism=4"])
    spec = state_spec(cfg, sharding.create_mesh(cfg, jax.devices()))

    def shard_bytes(tree):
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    mesh_shape = sharding.mesh_shape(cfg, 8)
    got = plan.state_bytes(cfg, state_spec(cfg, plan.abstract_mesh(mesh_shape)), mesh_shape)
    assert got["params"] == shard_bytes(spec.abstract["params"])
    assert got["optimizer"] == shard_bytes(spec.abstract["opt_state"])


@pytest.mark.parametrize("scan", ["true", "false"])
def test_layer_weights_are_one_layer_of_a_dense_model(scan):
    """num_experts=1: every layer is dense (first_num_dense_layers does not apply); scanned or unrolled, the
    loop holds one layer's weights in the compute dtype plus its float32 gradient."""
    cfg = load_config(["num_experts=1", "num_experts_per_tok=1", "base_num_decoder_layers=3",
                       "first_num_dense_layers=1", f"scan_layers={scan}", "dtype=bfloat16", "weight_dtype=float32"])
    mesh_shape = sharding.mesh_shape(cfg, 1)
    spec = state_spec(cfg, plan.abstract_mesh(mesh_shape))
    stack = spec.abstract["params"]["dense_layers"]
    one_layer = sum(math.prod(a.shape) * 4 for a in jax.tree.leaves(stack)) / 3
    got = plan.state_bytes(cfg, spec, mesh_shape)["layer_weights"]
    assert got == pytest.approx(one_layer * (2 / 4 + 1)), (got, one_layer)


RECIPES = sorted(glob.glob(os.path.join(CONFIG_DIR, "gpu", "*.yml")))
# Each recipe's own hbm_gib is its target; the H100 recipe also names its H200 variant in its header.
VARIANTS = [(r, []) for r in RECIPES] + [(os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-h100-256.yml"),
                                          ["hbm_gib=140.4", "per_device_batch_size=3",
                                           "batch_split_factor=3"])]


@pytest.mark.parametrize("recipe,extra", VARIANTS, ids=lambda x: os.path.basename(x) if isinstance(x, str) else
                         " ".join(x) or "as shipped")
def test_gpu_recipe_fits_its_target_hbm(recipe, extra):
    p = plan.plan(load_config([recipe, *extra]))
    assert p["verdict"] == "fits", plan.format_table(p)
    assert p["num_devices"] == int(os.path.basename(recipe)[:-4].rsplit("-", 1)[1])
    assert abs(p["params_total"] - p["params_mtp"] - 671e9) / 671e9 < 0.01
    assert abs(p["params_active"] - 37e9) / 37e9 < 0.02


def test_dropless_worst_case_does_not_fit_the_gb200_recipe():
    """The verdict can say no: the recipe's 2x receive buffers are what make it fit."""
    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-gb200-128.yml")
    assert plan.plan(load_config([recipe, "ragged_buffer_factor=null"]))["verdict"] == "does not fit"


def test_command_line_table_json_and_errors(capsys):
    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-gb200-128.yml")
    assert plan_command.main([recipe]) == 0
    table = capsys.readouterr().out
    assert "682.64B total (671.03B without MTP)" in table and "verdict: fits in 184 GiB" in table, table
    assert plan_command.main([recipe, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mesh"] == {"data": 1, "fsdp": 32, "context": 1, "expert": 4, "tensor": 1}
    assert result["bytes"]["total"] == sum(v for k, v in result["bytes"].items() if k != "total")
    assert plan_command.main([recipe, "num_devices=100"]) == 2  # 32 x 4 does not tile 100 devices: one line, exit 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("quantization,per_element", [("mxfp8", 2 * (1 + 1 / 32)), ("fp8_current", 2.0)])
def test_te_fp8_copies_are_counted(quantization, per_element):
    """TE's quantized grouped GEMMs keep row- and column-wise FP8 copies of the buffer (twice: wi_0 and wi_1
    quantize it separately), of the [R, F] hidden and of the local experts' weights, and quantize the three
    cotangents in the backward: one MoE layer's worth, on top of the bf16 plan."""
    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-gb200-128.yml")
    cfg = load_config([recipe, f"te_gmm_quantization={quantization}"])
    bf16 = plan.plan(load_config([recipe, "te_gmm_quantization=none"]))
    fp8 = plan.plan(cfg)
    ep = fp8["mesh"]["expert"]
    r, d, f, local = plan.moe_rows(cfg, fp8["tokens_per_device"], ep), 7168, 2048, 256 // ep
    balanced = fp8["tokens_per_device"] * 8 // ep  # T x K slots over the EP peers
    assert ep * 2 * balanced <= r <= ep * 2 * balanced + 128 * local  # ep peers x 2x, expert groups 128-aligned
    forward = per_element * (2 * r * d + r * f + 3 * local * d * f)
    backward = per_element * (2 * r * f + r * d)
    assert fp8["activation_detail"]["te_fp8_per_moe_layer"] == pytest.approx(forward + backward)
    assert bf16["activation_detail"]["te_fp8_per_moe_layer"] == 0
    # The forward copies are residuals of the recomputed layer; the backward's add to the MoE block's largest
    # short-lived set, which competes with attention's chunk of scores for the layer's peak.
    grown = fp8["bytes"]["activations"] - bf16["bytes"]["activations"]
    assert forward <= grown <= forward + backward, (grown, forward, backward)


def test_gradient_accumulation_counts_one_micro_batch_of_activations_and_the_gradient_sum():
    cfg = load_config(args(COMMON, ["model_name=deepseek3-tiny", "per_device_batch_size=8"]))
    mesh_shape = sharding.mesh_shape(cfg, 8)
    spec = state_spec(cfg, plan.abstract_mesh(mesh_shape))
    one = plan.device_bytes(cfg, spec, mesh_shape, 8)[0]
    four = plan.device_bytes(replace(cfg, gradient_accumulation_steps=4), spec, mesh_shape, 8)[0]
    assert four["gradients"] == 2 * one["gradients"] and four["params"] == one["params"]
    assert four["activations"] < 0.3 * one["activations"], (four["activations"], one["activations"])


def test_te_dense_fp8_copies_scale_with_the_recipes_bytes():
    """`quantization` adds TE's FP8 copies of one rematerialised layer's dense GEMMs (inputs and gathered
    weights, then the cotangents) to the activations and nothing else: linear in the recipe's bytes per element,
    so MXFP8's copies (two 1-byte layouts plus one E8M0 scale per 32) are FP8's times 1 + 1/32."""
    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-gb200-128.yml")
    none, fp8, mx = (plan.plan(load_config([recipe, f"quantization={q}"]))
                     for q in ("none", "te_fp8_currentscaling", "te_mxfp8"))
    added = {name: p["bytes"]["activations"] - none["bytes"]["activations"] for name, p in (("fp8", fp8), ("mx", mx))}
    assert added["fp8"] > 2**30, added  # DeepSeek-V3's MLA and shared expert, 4 x 4096 tokens: GiBs
    assert added["mx"] == pytest.approx(added["fp8"] * (1 + 1 / 32)), added
    for name in none["bytes"]:
        if name not in ("activations", "total"):
            assert fp8["bytes"][name] == none["bytes"][name], name

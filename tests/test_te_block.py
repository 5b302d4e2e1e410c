"""te_moe_block=true: Transformer Engine's own fused MoE block (transformer_engine.jax.moe.moe) executing on CPU (marker
`te_trace`): TE's Python for real, te_reference's kernels behind its router, grouped quantize and grouped GEMM
primitives, and NCCL EP's five calls one level down (`tex.ep_prepare` ... `ep_combine_bwd`) through the double
(tests/nccl_ep_double.py patch_tex). Forward and gradients against the composed te_dropless path (the same TE
router and grouped GEMMs, NCCL EP through the same double) and against the float32 per-expert loop, on the four
test meshes with uniform, skewed (empty experts) and all-to-one routing; its overflow count; the trainer on
deepseek3-tiny (bias update, statistics, checkpoint layout); what the block cannot take, refused in one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.benchmarks import ep_check
from MaxText.config.errors import ConfigError
from MaxText.layers.moe import te_runtime
from MaxText.parallel import checks, sharding
from tests import nccl_ep_double, test_nccl_ep_double as ep_tests, test_te_trace as trace_tests
from tests.test_moe_impls import _relative_close
from tests.test_te_reference import at_sm, on_cpu  # noqa: F401 - fixtures: TE's Python on the references

pytestmark = pytest.mark.te_trace

MESHES = [m for m in trace_tests.MESHES if trace_tests.MESHES[m][1] > 1]  # TE's NCCL EP needs 2 ranks or more
SCALE = 2.5
# DeepSeek-V3's routing semantics (sigmoid scores, a selection bias, top-k renormalised, scaled), which TE's fused
# router computes itself (config.checks.te_router_mode) and its block therefore takes.
ROUTING = ["routed_score_func=sigmoid", "routed_bias=true", "norm_topk_prob=true", f"routed_scaling_factor={SCALE}"]
# The bias steers the choice alone: uniform (none), skewed (experts 5-7 never chosen, 0-4 ever less often), and
# every token to experts 3 and 6.
BIASES = {"uniform": [0.0] * 8, "skewed_empty_experts": [0.3, 0.2, 0.1, 0.05, 0.0, -5, -5, -5],
          "all_to_one": [-5, -5, -5, 5, -5, -5, 4, -5]}
# te_gmm_quantization -> (SM, tolerance relative to each array's largest magnitude, model width, expert width).
# none: NCCL EP moves bf16 tokens and the block's FFN runs in bf16 (measured 1.03e-2 worst, against the composed
# path and the float32 loop alike). mxfp8: e4m3 both ways, one power of two per 32 elements (measured 0.083); the
# block's MXFP8 needs 128-multiple widths (config.checks: TE's V1 kernels refuse NCCL EP's short groups).
QUANTIZATIONS = {"none": (90, 3e-2, 16, 32), "mxfp8": (100, 0.15, 128, 128)}


def _config(quantization, mesh_name, *extra):
    return ep_tests._config(f"te_gmm_quantization={quantization}", *ROUTING, *trace_tests.MESHES[mesh_name][0],
                            *extra)


def _steps(monkeypatch, quantization, mesh_name, t_total, *extra):
    """The mesh, its rules, and the GPU kit's jitted steps (MaxText.benchmarks.ep_check.block_step: y, the gradients
    wrt x, the gate and the expert weights, the overflow and the choice) for TE's block and for the composed path
    routed on the block's logits, both on TE's own kernels with NCCL EP's five `tex` calls through the double (TE's
    ep.py for the composed path and TE's moe.py for the block run for real above them)."""
    cfgs = [_config(quantization, mesh_name, *extra, *block) for block in (["te_moe_block=true"], [])]
    mesh, rules = trace_tests._mesh(cfgs[0], mesh_name), sharding.axis_rules(cfgs[0])
    nccl_ep_double.patch_tex(monkeypatch, cfgs[0], mesh.shape, t_total // ep_tests.L)
    return mesh, rules, [ep_check.block_step(cfg, rules, ep_tests.L) for cfg in cfgs]


def _inputs(t_total):
    x, w = ep_tests._params(t_total)
    gate = ep_tests._bf16_exact(jax.random.normal(jax.random.key(5), (ep_tests.D, ep_tests.E)) * ep_tests.D ** -0.5)
    return x, gate, *w, ep_tests._cotangent((t_total, ep_tests.D))


def _run(steps, mesh, rules, inputs, bias):
    """Both steps on the inputs placed as a trainer places them (tokens split over the batch axes, the rest whole:
    TE's partitioning rules need the mesh in the arguments' shardings), and the float32 loop on the composed
    path's choice: [(y, grads, overflow, experts)] x 2, (y, grads)."""
    tokens = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", None), rules))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x, gate, wi_0, wi_1, wo, ct = inputs
    placed = (jax.device_put(x, tokens), *jax.device_put((gate, wi_0, wi_1, wo, bias), whole),
              jax.device_put(ct, tokens))
    block, composed = (step(*placed) for step in steps)
    want = ep_check.float32_block_step(SCALE)(x, gate, wi_0, wi_1, wo, composed[3], ct)
    return block, composed, want


def _close(got, want, tol, case):
    """(y, gradients) of two runs within tol of the second's largest magnitude, each array."""
    for label, a, b in zip(ep_check.BLOCK_QUANTITIES, [got[0], *got[1]], [want[0], *want[1]]):
        _relative_close(a, b, tol, f"{case}: {label}")


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("mesh_name", MESHES)
def test_te_block_matches_the_composed_path_and_the_float32_loop(at_sm, monkeypatch, mesh_name, quantization):
    sm, tol, d, f = QUANTIZATIONS[quantization]
    at_sm(sm)
    monkeypatch.setattr(ep_tests, "D", d)
    monkeypatch.setattr(ep_tests, "F", f)
    t_total = 8 * ep_tests.L
    mesh, rules, steps = _steps(monkeypatch, quantization, mesh_name, t_total)
    inputs = _inputs(t_total)
    with jax.set_mesh(mesh), te_runtime.mesh_context(_config(quantization, mesh_name)):
        for name, bias in BIASES.items():
            block, composed, want = _run(steps, mesh, rules, inputs, jnp.asarray(bias, jnp.float32))
            case = f"{mesh_name}, {quantization}, routing {name}"
            load = np.bincount(np.asarray(composed[3]).ravel(), minlength=ep_tests.E)
            assert {"uniform": load.min() > 0, "skewed_empty_experts": not load[5:].any() and load[:5].all(),
                    "all_to_one": set(np.flatnonzero(load)) == {3, 6}}[name], f"{case}: set-up, load {load}"
            assert float(block[2]) == float(composed[2]) == 0.0, case
            assert not np.array_equal(np.asarray(block[0]), np.asarray(composed[0])), f"{case}: the same path twice"
            _close(block, composed, tol, f"{case}, block vs composed")
            _close(block, want, tol, f"{case}, block vs float32 loop")


def test_te_block_counts_overflow_as_the_composed_path(at_sm, monkeypatch):
    """A receive buffer of the balanced load (ragged_buffer_factor=1) under all-to-one routing: NCCL EP drops what
    does not fit (bootstrapped with drop_on_overflow), the block reports the same overflow as the composed path,
    and what it returns is the kept slots' sum, as the composed path's."""
    mesh_name = "expert8"
    t_total = 32 * ep_tests.L  # 64 tokens a rank: 128 rows of capacity, 512 wanted on experts 3 and 6
    mesh, rules, steps = _steps(monkeypatch, "none", mesh_name, t_total, "ragged_buffer_factor=1.0")
    with jax.set_mesh(mesh), te_runtime.mesh_context(_config("none", mesh_name)):
        block, composed, _ = _run(steps, mesh, rules, _inputs(t_total), jnp.asarray(BIASES["all_to_one"], jnp.float32))
    assert float(block[2]) == float(composed[2]) == 2 * (512 - 128), (float(block[2]), float(composed[2]))
    _close(block, composed, QUANTIZATIONS["none"][1], "overflow: block vs composed")


# ------------------------------------------------------------------------------------------- the trainer


def test_deepseek3_tiny_trains_through_te_block_on_cpu(at_sm, monkeypatch, tmp_path):
    """The trainer on deepseek3-tiny (MLA, group-limited sigmoid routing with the aux-loss-free bias, a shared expert,
    MTP) on fsdp2 x expert4 with te_moe_block=true: TE's block executing on the references with the NCCL EP double,
    four steps whose losses, bias and load statistics track the composed path on the pure-JAX kernels
    (te_kernels=reference). The same weights under either path: the model state has one layout."""
    from MaxText.config.load import load_config
    from MaxText.trainer import loop
    from MaxText.step.state import state_spec
    from tests.tiny import args, losses, train_records

    at_sm(90)
    monkeypatch.setattr(loop, "check_available", lambda cfg: None)
    mesh_args, devices = trace_tests.MESHES["fsdp2_expert4"]
    common = ["model_name=deepseek3-tiny", "override_model_config=true", "moe_impl=te_dropless", "steps=4",
              "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false", "dataset_type=synthetic",
              "eval_interval=-1", "max_target_length=16", "per_device_batch_size=1", "num_experts=8",
              "routed_bias_update_rate=0.01", "dtype=bfloat16", *mesh_args, f"base_output_directory={tmp_path}"]
    cfgs = {"block": load_config(args(common, ["te_moe_block=true", "run_name=block"])),
            "reference": load_config(args(common, ["te_kernels=reference", "run_name=reference"]))}
    cfg = cfgs["block"]
    mesh_shape = sharding.create_mesh(cfg, jax.devices()[:devices]).shape
    # NCCL EP as te_runtime.bootstrap_ep leaves it on GPUs, its calls through the double.
    monkeypatch.setattr(te_runtime, "bootstrap_ep", lambda *a: None)
    nccl_ep_double.patch_tex(monkeypatch, cfg, mesh_shape, int(devices * cfg.per_device_batch_size))
    runs = {name: train_records(c, devices=jax.devices()[:devices]) for name, c in cfgs.items()}
    got, want = losses(runs["block"]), losses(runs["reference"])
    assert len(got) == 4 and np.isfinite(got).all(), got
    assert want[-1] < want[0], f"the reference run does not learn: {want}"
    np.testing.assert_allclose(got, want, rtol=3e-2, err_msg="losses, TE's block vs the composed reference path")
    last = {name: r[-1] for name, r in runs.items()}
    assert np.min(last["block"]["moe_bias_abs_mean"]) > 0, "the aux-loss-free bias did not move under the block"
    # bf16 (the block's only precision) moves a near-tie token now and then: one bias step (0.01) apart at most, the
    # loads a few slots.
    np.testing.assert_allclose(last["block"]["moe_bias_abs_mean"], last["reference"]["moe_bias_abs_mean"], rtol=0,
                               atol=0.01, err_msg="routing bias")
    for key in ("moe_aux_loss", "moe_load_max_over_mean", "moe_expert_load"):
        np.testing.assert_allclose(last["block"][key], last["reference"][key], rtol=0.1, err_msg=key)
    assert np.sum(last["block"]["moe_overflow"]) == 0.0, last["block"]["moe_overflow"]
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    shapes = {name: jax.tree.map(lambda a: (a.shape, a.dtype), state_spec(c, mesh).abstract)
              for name, c in cfgs.items()}
    assert shapes["block"] == shapes["reference"], "te_moe_block changes the model state's layout"


def test_the_gpu_kits_block_check_passes_on_cpu(at_sm, monkeypatch):
    """MaxText.benchmarks.ep_check --block (bash scripts/gpu_check.sh --ep N runs it on N GPUs) at a small size on 8 CPU
    devices, TE's Python on the references and NCCL EP through the double: every routing within its tolerances, the
    block beside the composed path, nothing overflowing."""
    at_sm(90)
    problem = ep_check.Problem(dim=128, hidden=128, experts_per_rank=1, top_k=2, seq=16, batch_per_rank=1)
    extra = (*ep_check.BLOCK_ROUTING, "te_gmm_quantization=none")
    cfg_block = ep_check.layer_config(problem, 8, "auto", *extra, "te_moe_block=true")
    cfg_composed = ep_check.layer_config(problem, 8, "auto", *extra)
    monkeypatch.setattr(te_runtime, "bootstrap_ep", lambda *a: None)
    nccl_ep_double.patch_tex(monkeypatch, cfg_block, sharding.create_mesh(cfg_block).shape, 8)
    report = ep_check.run(problem, cfg_block, cfg_composed, log=lambda *_: None)
    table = ep_check.format_table(report)
    assert report["status"] == "passed", table
    assert len(report["rows"]) == 3 * 7 and "TE's fused MoE block check" in table, table


# ------------------------------------------------------------------------------------------- refusals


def test_what_the_block_cannot_take_on_a_mesh_is_refused_in_one_line():
    cfg = _config("none", "expert8", "te_moe_block=true")
    one = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs 2 GPUs or more") as e:
        checks.check_nccl_ep(cfg, one)
    with pytest.raises(ConfigError, match="does not split the experts' width over `tensor`"):
        checks.check_nccl_ep(cfg, {**one, "fsdp": 2, "expert": 2, "tensor": 2})
    with pytest.raises(ConfigError, match="num_moe_token_chunks=2"):
        checks.check_nccl_ep(_config("none", "expert8", "te_moe_block=true", "num_moe_token_chunks=2"),
                             {**one, "fsdp": 8})
    assert "\n" not in str(e.value)
    checks.check_nccl_ep(cfg, {**one, "fsdp": 8})  # no expert parallelism: the block still takes it
    assert checks.nccl_ep_used(cfg, {**one, "fsdp": 8}) and not checks.nccl_ep_used(
        _config("none", "expert8"), {**one, "fsdp": 8})

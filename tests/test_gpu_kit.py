"""The GPU validation kit on CPU: its checks fail on wrong kernels, its TE calls trace through Transformer Engine's
real Python (te_trace stand-in), the NCCL EP check runs end to end with the reference kernels, and gpu_check
records a part that raises and runs the next."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.load import replace
from MaxText.benchmarks import ep_check, gpu_check
from MaxText.layers.moe import te_kernels, te_runtime
from MaxText.planning import te_trace
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts
from tests import test_te_dropless as gpu_tests
from tests.tiny import tiny_config

EP_PROBLEM = ep_check.Problem(dim=128, hidden=128, experts_per_rank=1, top_k=2, seq=16, batch_per_rank=2)


def _reference_routing(name, drop_bias=False, renormalise=False):
    cfg, logits, bias, _ = gpu_tests.router_case(name)
    weights, experts = select_experts(expert_scores(jnp.asarray(logits), cfg.routed_score_func),
                                      None if bias is None or drop_bias else jnp.asarray(bias), cfg)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return (*gpu_tests.dense_routing(experts, weights, cfg.num_experts), logits, bias, cfg)


def test_router_check_fails_on_wrong_weights_or_choices():
    """check_routing passes the reference's own routing and fails on softmax weights renormalised (what TE's
    router does not do) or choices made without the bias."""
    softmax, deepseek = "softmax", "DeepSeek-V3: sigmoid with bias, 8 groups keep 4, scaled"
    for name in (softmax, deepseek):
        gpu_tests.check_routing(*_reference_routing(name), label=name)
    with pytest.raises(AssertionError, match="weights of the chosen experts"):
        gpu_tests.check_routing(*_reference_routing(softmax, renormalise=True), label=softmax)
    with pytest.raises(AssertionError, match="chosen experts differ"):
        gpu_tests.check_routing(*_reference_routing(deepseek, drop_bias=True), label=deepseek)


def test_grouped_gemm_check_fails_on_a_wrong_kernel():
    """check_grouped_gemm passes gmm.grouped_matmul and fails on a kernel that mixes up groups, or one that
    hands the padded tail to the last group: te_kernels._te_grouped_gemm does the latter, so the x-gradient of
    the tail rows is a random cotangent times that expert's weights instead of 0."""
    def reference(x, w, sizes, quantization):
        return grouped_matmul(x, w, sizes)

    def tail_to_last_group(x, w, sizes, quantization):
        return grouped_matmul(x, w, sizes.at[-1].add(x.shape[0] - jnp.sum(sizes)))

    def rolled_groups(x, w, sizes, quantization):
        return grouped_matmul(x, w, jnp.roll(sizes, 1))

    for case in ("bf16", "fp32 (TF32)"):
        gpu_tests.check_grouped_gemm(reference, case, f"reference, {case}")
    with pytest.raises(AssertionError, match="dx of the 256 rows past sum"):
        gpu_tests.check_grouped_gemm(tail_to_last_group, "bf16", "tail to the last group")
    with pytest.raises(AssertionError, match="rolled groups: y"):
        gpu_tests.check_grouped_gemm(rolled_groups, "bf16", "rolled groups")


@pytest.mark.te_trace
def test_gpu_tests_te_calls_trace(te_standin):
    """The gpu tests' calls into TE trace through its real Python: the fused router with every native case's
    arguments (SM 90), and te_dropless's grouped GEMM call site forward and backward in every GEMM case (MXFP8
    as on SM 100)."""
    for name, (_, native) in gpu_tests.ROUTER_CASES.items():
        cfg, logits, bias, _ = gpu_tests.router_case(name)
        if native:
            probs, routing_map = jax.eval_shape(lambda l, b, cfg=cfg: gpu_tests.te_router(l, b, cfg), logits, bias)
            assert (probs.shape, probs.dtype, routing_map.dtype) == (logits.shape, jnp.float32, jnp.bool_), name
    grouped_gemm = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).grouped_gemm
    try:
        for name, (dtype, quantization, _, _) in gpu_tests.GEMM_CASES.items():
            te_trace.set_sm(100 if quantization == "mxfp8" else 90)
            x, w, sizes, ct = gpu_tests.gemm_inputs(dtype)
            y, dx, dw = jax.eval_shape(lambda *a, q=quantization: gpu_tests.gemm_vjp(grouped_gemm, *a, q), x, w, sizes, ct)
            got = [(a.shape, a.dtype) for a in (y, dx, dw)]
            assert got == [(ct.shape, dtype), (x.shape, dtype), (w.shape, dtype)], (name, got)
    finally:
        te_trace.set_sm(90)


def _ep_setup(kernels):
    from MaxText.parallel import sharding
    from MaxText.config.load import global_batch_size

    cfg = ep_check.layer_config(EP_PROBLEM, jax.device_count(), kernels)
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    global_batch = global_batch_size(cfg, mesh.devices.size)
    host = ep_check.host_inputs(EP_PROBLEM, cfg.num_experts, global_batch * EP_PROBLEM.seq, "all_to_one")
    return cfg, mesh, rules, global_batch, host


@pytest.mark.te_trace
def test_ep_check_traces_and_partitions_the_nccl_ep_layer(te_standin):
    """ep_check's TE step (NCCL EP dispatch/combine around TE's grouped GEMMs, forward and gradients) on the
    8-device expert mesh: the reference step's shapes, and compiling gets through TE's partitioning rules to
    the first TE kernel, which has no CPU handler."""
    cfg, mesh, rules, global_batch, host = _ep_setup("auto")
    cfg_ref = ep_check.layer_config(EP_PROBLEM, jax.device_count(), "reference")
    te_trace.register_cpu_lowerings()
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        te_trace.bootstrap_ep(cfg, mesh, global_batch)
        args = ep_check.device_inputs(host, mesh, rules)
        args = [args[n] for n in ("x", "wi_0", "wi_1", "wo", "experts", "weights", "cotangent")]
        step = ep_check.layer_step(cfg, rules)
        got, want = jax.eval_shape(step, *args), jax.eval_shape(ep_check.layer_step(cfg_ref, rules), *args)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
        assert "te_ep_dispatch" in str(jax.make_jaxpr(step)(*args)), "the TE step does not run NCCL EP"
        with pytest.raises(Exception, match="No FFI handler registered for te_"):
            step.lower(*args).compile()


def test_ep_check_fallback_dry_run_on_two_slices():
    """ep_check --fallback's configuration on the 8 CPU devices (2 slices of 4, two hops, ragged_buffer_factor=1,
    the layer fallback) with the reference kernels in TE's place: every routing within tolerance, nothing
    overflowing although all-to-one routing sends every token's first choice to one GPU, far past its bounded buffer
    (the same buffers without the fallback overflow: test_ep_check_dry_run_with_reference_kernels, one slice)."""
    extra = ep_check.fallback_overrides(jax.device_count())
    assert "ep_two_hop=true" in extra
    cfg = ep_check.layer_config(EP_PROBLEM, jax.device_count(), "reference", *extra)
    report = ep_check.run(EP_PROBLEM, cfg, cfg, log=lambda *_: None)
    assert report["status"] == "passed", ep_check.format_table(report)


def test_ep_check_dry_run_with_reference_kernels():
    """ep_check end to end on the 8 CPU devices with te_kernels=reference in TE's place: every routing within
    tolerance of the float32 loop; with a receive buffer too small for all-to-one routing it fails."""
    cfg, *_ = _ep_setup("reference")
    report = ep_check.run(EP_PROBLEM, cfg, cfg, log=lambda *_: None)
    table = ep_check.format_table(report)
    assert report["status"] == "passed", table
    assert len(report["rows"]) == len(ep_check.ROUTINGS) * (len(ep_check.QUANTITIES) + 1)
    small = ep_check.layer_config(EP_PROBLEM, jax.device_count(), "reference")
    report = ep_check.run(EP_PROBLEM, replace(small, ragged_buffer_factor=1.0), cfg, log=lambda *_: None)
    bad = {(row["routing"], row["quantity"]) for row in report["rows"] if not row["ok"]}
    assert report["status"] == "failed" and ("all_to_one", "overflow") in bad, ep_check.format_table(report)


def test_gpu_check_records_a_raising_part_and_runs_the_rest(monkeypatch, tmp_path, capsys):
    """A part that raises is recorded with its error line, the others still run, the JSON is written, the
    table printed, and the exit code is 1."""
    def raises(kit):
        raise RuntimeError("kernel crashed\nsecond line")

    ran = []
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setattr(gpu_check, "PARTS", {
        "kernels": raises,
        "ep": lambda kit: ran.append("ep") or {"status": "skipped", "reason": "no --ep"},
        "impls_agree": lambda kit: ran.append("impls_agree") or {"status": "passed", "kernels": "reference",
                                                                 "max_relative_difference": 0.0, "tolerance": 2e-4},
        "moe_layer": lambda kit: ran.append("moe_layer") or {"status": "done"},  # no rows: summary says so
    })
    path = tmp_path / "gc.json"
    assert gpu_check.main(["--smoke", "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert ran == ["ep", "impls_agree", "moe_layer"]
    assert report["parts"]["kernels"]["status"] == "error"
    assert report["parts"]["kernels"]["error"] == "RuntimeError: kernel crashed"
    out = capsys.readouterr().out
    assert "1. kernels (correctness): error: RuntimeError: kernel crashed" in out, out
    assert "3. impls_agree (correctness): passed" in out and "cannot summarise" in out, out
    np.testing.assert_equal(sorted(report["parts"]), ["ep", "impls_agree", "kernels", "moe_layer"])


def test_the_batch_split_part_runs_on_cpu_and_fails_on_different_losses(monkeypatch, tmp_path):
    """gpu_check's batch_split part in --smoke mode on CPU (reference kernels): the batch whole and in 2 parts give
    the same loss (passed, both rows timed); a split that changed the result would fail the part."""
    kit = gpu_check.Kit(te_missing="no TE on CPU", smoke=True, tmp=str(tmp_path), ep=None, json=str(tmp_path / "g"))
    result = gpu_check.check_batch_split(kit)
    assert result["status"] == "passed" and set(result["rows"]) == {"whole", "2 parts"}, result
    assert result["loss_relative_difference"] <= result["tolerance"] and result["split_over_whole"] > 0
    assert "2 parts take" in gpu_check.part_lines("batch_split", result)[-1]
    measure = gpu_check.train_step.measure

    def shifted(cfg, *a, **k):  # a split that changes the loss
        row = measure(cfg, *a, **k)
        return {**row, "loss": row["loss"] * (1.01 if cfg.use_batch_split_schedule else 1.0)}

    monkeypatch.setattr(gpu_check.train_step, "measure", shifted)
    assert gpu_check.check_batch_split(kit)["status"] == "failed"


def test_the_ep_parts_split_timing_is_a_nccl_ep_config_and_its_report_reads(monkeypatch):
    """--ep N's fourth launch: train_step over N processes with the batch whole and in 2 parts on NCCL EP. Its
    arguments make a config NCCL EP takes on N GPUs (each variant); a measured report becomes one line per variant
    beside the checks' lines."""
    from MaxText.config.load import load_config
    from MaxText.parallel import checks

    kit = gpu_check.Kit(te_missing=None, smoke=False, tmp="/tmp", ep=4, json="gc.json")
    args = gpu_check.split_timing_args(kit)
    overrides = args[1:args.index("--steps")]
    impls = args[args.index("--impls") + 1].split(",")
    for entry in impls:
        impl, *own = entry.split(":")
        cfg = load_config([args[0], *overrides, f"moe_impl={impl}", *own])
        shape = {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}
        assert checks.nccl_ep_used(cfg, shape) and cfg.num_experts == 32, entry
        checks.check_nccl_ep(cfg, shape)
    row = {"impl": "te_dropless", "step_s": 0.5, "tflops_per_device": 400.0, "loss": 10.0}
    measured = {"status": "measured", "ranks": 4, "report_path": "gc.ep_split.json",
                "report": {"status": "measured", "rows": [row, {**row, "impl": impls[1], "step_s": 0.4}]}}
    lines = gpu_check.part_lines("ep", {"status": "passed", "batch_split_timing": measured,
                                        "nccl_ep": {"status": "error", "error": "timed out"}})
    assert lines[0].startswith("batch_split_timing: 4 GPUs, te_dropless: step 500.00 ms"), lines
    assert "batch_split_factor=2: step 400.00 ms" in lines[1] and lines[2] == "nccl_ep: error: timed out", lines

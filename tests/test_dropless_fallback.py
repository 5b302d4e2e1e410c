"""moe_dropless_fallback (upstream MaxText's keys and meaning): a bounded receive buffer (ragged_buffer_factor) that
never drops. `layer`: a MoE layer whose tokens would overflow takes a worst-case branch (results equal to the
worst-case buffers', forward and gradients, on the EP meshes, under all-to-one routing). `step`: a step that
overflowed is undone and rerun by the worst-case program (its state bit-equal to that program's from the same state).
Also the first-phase keys, the evaluation's buffer, the metrics and console line, the planner and the refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.config.load import worst_case_program
from MaxText.layers.moe import te_runtime
from MaxText.layers.moe.ep import peer_capacity, worst_case_chunks
from MaxText.parallel import checks as parallel_checks, sharding
from MaxText.planning import plan, steptime, te_trace
from MaxText.step.state import create_state, state_spec
from MaxText.step.train_step import jit_train_step
from MaxText.trainer import programs as programs_lib
from MaxText.trainer.metrics import console_line, tensorboard_scalars
from tests import test_te_trace as trace_tests
from tests.test_batch_split import BIASES, MODEL, _batch, _loss_and_grads
from tests.test_moe_impls import MESHES, _relative_close
from tests.test_te_reference import at_sm, on_cpu  # noqa: F401 - fixtures: TE's Python on the references
from tests.tiny import tiny_config, train_records


# Routing: as initialised (at ragged_buffer_factor=2 some layers overflow, some not), or every token to experts 2 and
# 3, which sit on one device under expert 4 (each token's row carries two slots there: twice the bound).
ROUTINGS = {"uniform": BIASES["uniform"], "all_to_one": [-5, -5, 5, 4, -5, -5, -5, -5]}


def _results(cfg, mesh, batch) -> dict:
    """{routing: (loss, MoE stats, gradients)} of cfg's initial parameters under each routing bias."""
    run = _loss_and_grads(cfg, mesh)
    with jax.set_mesh(mesh):
        return {name: jax.device_get(run(batch, jnp.asarray(bias, jnp.float32))) for name, bias in ROUTINGS.items()}


# (te_dropless's own exchange under a fallback, with TE's kernels: test_te_dropless_takes_the_layer_fallback_...)
LAYER_CASES = {  # name -> (mesh, overrides)
    "ragged data2_expert4, 2 chunks": ("data2_expert4", ["moe_impl=ragged", "num_moe_token_chunks=2"]),
    # all-to-one (experts 2 and 3, one slice) fits hop 1 (a row per token to that slice) and overflows hop 2 only
    "ragged 2 slices x expert4, two hops": ("two_slices", ["moe_impl=ragged"]),
}
LAYER_MESHES = {**trace_tests.MESHES, "two_slices": (MESHES["two_slices_expert4_two_hops"], 8)}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_fallback_gives_the_worst_case_buffers_results(case):
    """ragged_buffer_factor=2 with moe_dropless_fallback=layer against the worst-case buffers: the same loss, every
    gradient and statistic, nothing dropped; a layer takes its worst-case branch exactly when its bounded buffers would
    have overflowed (all-to-one routing makes all of them do)."""
    mesh_name, overrides = LAYER_CASES[case]
    mesh_args, devices = LAYER_MESHES[mesh_name]
    base = [*MODEL, *mesh_args, *overrides]
    cfgs = {"worst": tiny_config(*base), "bounded": tiny_config(*base, "ragged_buffer_factor=2.0"),
            "layer": tiny_config(*base, "ragged_buffer_factor=2.0", "moe_dropless_fallback=layer")}
    mesh = sharding.create_mesh(cfgs["worst"], jax.devices()[:devices])
    batch = _batch(devices * 2, cfgs["worst"].max_target_length, cfgs["worst"].vocab_size, mesh)
    got = {name: _results(cfg, mesh, batch) for name, cfg in cfgs.items()}
    for routing in ROUTINGS:
        label = f"{case}, routing {routing}"
        want, have = got["worst"][routing], got["layer"][routing]
        np.testing.assert_allclose(float(have[0]), float(want[0]), rtol=1e-5, err_msg=f"{label}: loss")
        for path, w in jax.tree_util.tree_flatten_with_path(want[2])[0]:
            _relative_close(dict(jax.tree_util.tree_flatten_with_path(have[2])[0])[path], w, 1e-5,
                            f"{label}: gradient {jax.tree_util.keystr(path)}")
        for part in ("moe", "mtp"):
            took, stats = have[1][part]["fallback"], have[1][part]
            assert not np.any(stats["overflow"]), f"{label}: {part} dropped {stats['overflow']}"
            np.testing.assert_allclose(stats["load_E"], want[1][part]["load_E"], err_msg=f"{label}: {part} load")
            if routing == "all_to_one":
                assert np.all(took == 1), f"{label}: {part} layers took no worst-case branch: {took}"
            would = np.asarray(got["bounded"][routing][1][part]["overflow"]) > 0
            np.testing.assert_array_equal(took == 1, would, err_msg=f"{label}: {part}: fallback iff overflow")
        # the cases: all layers overflow under all-to-one, some but not all as initialised
        over = np.concatenate([np.asarray(got["bounded"][routing][1][p]["overflow"]) > 0 for p in ("moe", "mtp")])
        assert np.all(over) == (routing == "all_to_one") and np.any(over), f"{label}: overflowing layers {over}"


@pytest.mark.te_trace
def test_te_dropless_takes_the_layer_fallback_over_xlas_exchange_with_tes_kernels(at_sm):
    """te_dropless with TE's kernels (TE's Python executing on the references, SM 90) and a fallback: NCCL EP is not
    used (it takes one receive capacity), the exchange is XLA's, and the result is the worst-case buffers' (the
    pure-JAX references'), gradients included, with every layer falling back under all-to-one routing."""
    at_sm(90)
    mesh_args, devices = trace_tests.MESHES["fsdp2_expert4"]
    base = [*MODEL, *mesh_args, "moe_impl=te_dropless"]
    te = tiny_config(*base, "ragged_buffer_factor=2.0", "moe_dropless_fallback=layer")
    reference = tiny_config(*base, "te_kernels=reference")
    mesh = sharding.create_mesh(te, jax.devices()[:devices])
    assert not parallel_checks.nccl_ep_used(te, dict(mesh.shape))
    assert parallel_checks.nccl_ep_used(tiny_config(*base), dict(mesh.shape))
    batch = _batch(devices * 2, te.max_target_length, te.vocab_size, mesh)
    spec = state_spec(te, mesh)
    with jax.set_mesh(mesh), te_runtime.mesh_context(te):
        traced = jit_train_step(te, spec, sharding.batch_sharding(mesh)).trace(spec.abstract, batch)
        prims = {str(e.primitive) for e in te_trace.equations(traced.jaxpr)}
        assert {trace_tests.ROUTER_FWD, trace_tests.GEMM} <= prims and not trace_tests.TE_EP & prims, prims
    with te_runtime.mesh_context(te):
        got = _results(te, mesh, batch)
    want = _results(reference, mesh, batch)
    for routing in ROUTINGS:
        label = f"TE kernels, routing {routing}"
        np.testing.assert_allclose(float(got[routing][0]), float(want[routing][0]), rtol=1e-4, err_msg=label)
        have = dict(jax.tree_util.tree_flatten_with_path(got[routing][2])[0])
        for path, w in jax.tree_util.tree_flatten_with_path(want[routing][2])[0]:
            _relative_close(have[path], w, 1e-3, f"{label}: gradient {jax.tree_util.keystr(path)}")
        stats = got[routing][1]["moe"]
        assert not np.any(stats["overflow"]) and (routing != "all_to_one" or np.all(stats["fallback"] == 1)), stats


def _states_with_bias(cfg, mesh, spec, bias):
    with jax.set_mesh(mesh):
        state = create_state(cfg, mesh, spec)
        state["nnx_aux"] = jax.tree.map(
            lambda b: jax.device_put(np.broadcast_to(np.asarray(bias, np.float32), b.shape).copy(), b.sharding),
            state["nnx_aux"])
    return state


def _copy(tree):
    return jax.tree.map(lambda a: a.copy(), tree)


def test_step_fallback_reruns_an_overflowing_step_bit_equal_to_the_worst_case_program():
    """data2_expert4, routing pushed towards experts 3 and 6 and moved back by the bias update (rate 1): some steps
    overflow ragged_buffer_factor=2 and some do not. From the same state each step: a step that overflowed comes out
    bit-equal to the worst-case program's (its update undone, then rerun), one that did not within float rounding
    (other buffer shapes); no step drops a token; replays are counted."""
    mesh_args, devices = trace_tests.MESHES["data2_expert4"]
    base = [*MODEL, *mesh_args, "moe_impl=ragged", "routed_bias_update_rate=1.0"]
    cfg = tiny_config(*base, "ragged_buffer_factor=2.0", "moe_dropless_fallback=step")
    worst_cfg = worst_case_program(cfg)
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    batch = _batch(devices * 2, cfg.max_target_length, cfg.vocab_size, mesh)
    rows = sharding.batch_sharding(mesh)
    logs = []
    with jax.set_mesh(mesh):
        spec = state_spec(cfg, mesh)
        programs = programs_lib.StepPrograms(cfg, spec, rows, 0, logs.append)
        worst = jit_train_step(worst_cfg, state_spec(worst_cfg, mesh), rows)
        state = _states_with_bias(cfg, mesh, spec, [-1.5, -1.5, -1.5, 1.5, -1.5, -1.5, 1.5, -1.5])
        replayed = []
        for step in range(6):
            want, want_metrics = worst(_copy(state), batch)
            before = programs.replays
            state, metrics = programs(step, state, batch)
            replayed.append(programs.replays > before)
            assert metrics["moe_step_replays"] == programs.replays
            assert not np.any(np.asarray(metrics["moe_overflow"])), f"step {step}: dropped {metrics['moe_overflow']}"
            have = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0])
            for path, w in jax.tree_util.tree_flatten_with_path(jax.device_get(want))[0]:
                where = f"step {step}, {jax.tree_util.keystr(path)}"
                if replayed[-1]:
                    np.testing.assert_array_equal(have[path], w, err_msg=f"{where}: a rerun step is not the worst case's")
                else:
                    _relative_close(have[path], w, 1e-5, where)
            np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-6)
    assert any(replayed) and not all(replayed), f"the case must mix overflowing and clean steps: {replayed}"
    assert sum("runs again with the worst-case buffers" in line for line in logs) == sum(replayed), logs


class _Program:
    """A stand-in for a compiled train step: records its calls and reports overflow as told."""

    def __init__(self, name, calls, overflows=lambda step: False, rollback=False):
        self.name, self.calls, self.overflows, self.rollback = name, calls, overflows, rollback

    def lower(self, *_):
        return self

    def compile(self):
        return self

    def __call__(self, state, batch):
        self.calls.append((self.name, state))
        metrics = {"loss": 0.0}
        if self.rollback:
            metrics["moe_overflowed"] = self.overflows(state)
        return state + 1 if not metrics.get("moe_overflowed") else state, metrics


def test_step_programs_choose_first_phase_attempt_and_rerun_as_upstream(monkeypatch):
    """Which program runs each step: the first retry_dropless_first_steps steps after the start step try the
    first_phase_ragged_buffer_factor program (or, without one, run the worst-case program directly), later steps the
    bounded one; an attempt that overflowed is rerun by the worst-case program on the state it left unchanged."""
    calls = []
    built = []

    def fake_jit(cfg, spec, batch_sharding, rollback=False):
        name = ("worst" if cfg.ragged_buffer_factor is None else
                "first" if cfg.ragged_buffer_factor == 4.0 else "bounded")
        built.append((name, cfg.remat_policy, rollback))
        overflows = {"first": lambda s: s == 10, "bounded": lambda s: s in (12, 14)}.get(name, lambda s: False)
        return _Program(name, calls, overflows, rollback)

    monkeypatch.setattr(programs_lib, "jit_train_step", fake_jit)
    monkeypatch.setattr(programs_lib, "with_config", lambda spec, cfg: spec)
    cfg = tiny_config("ragged_buffer_factor=1.5", "moe_dropless_fallback=step", "retry_dropless_first_steps=2",
                      "first_phase_ragged_buffer_factor=4.0")
    logs = []
    programs = programs_lib.StepPrograms(cfg, None, None, 5, logs.append)
    assert sorted(built) == [("bounded", "full", True), ("first", "full", True), ("worst", "full", False)]
    state = 10
    for step in range(5, 10):
        state, metrics = programs(step, state, None)
    # step 5: first phase, overflows (state 10) -> worst; 6: first phase; 7: bounded, overflows (12) -> worst;
    # 8: bounded; 9: bounded, overflows (14) -> worst
    assert [name for name, _ in calls] == ["first", "worst", "first", "bounded", "worst", "bounded", "bounded",
                                           "worst"], calls
    assert calls[1][1] == calls[0][1] == 10, "the rerun starts from the state the attempt was given"
    assert metrics["moe_step_replays"] == 3 and state == 15
    assert "moe_overflowed" not in metrics
    calls.clear()
    direct = programs_lib.StepPrograms(tiny_config("ragged_buffer_factor=1.5", "moe_dropless_fallback=step",
                                                   "retry_dropless_first_steps=1"), None, None, 0, logs.append)
    direct(0, 0, None)
    direct(1, 1, None)
    assert [name for name, _ in calls] == ["worst", "bounded"] and direct.replays == 0


def test_a_run_with_the_step_fallback_logs_replays_and_reruns_overflowing_eval_batches(tmp_path):
    """The trainer end to end (fsdp2_expert4, ragged_buffer_factor=1): steps that overflow are rerun (counted in
    moe_step_replays, on the console line), nothing is dropped in training or evaluation, and eval batches that
    overflowed eval_ragged_buffer_factor are evaluated again with the worst-case buffers."""
    cfg = tiny_config("ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "num_experts=8", "steps=3",
                      "log_period=1", "eval_interval=3", "eval_steps=2", "ragged_buffer_factor=1.0",
                      "eval_ragged_buffer_factor=1.0", "moe_dropless_fallback=step", "retry_dropless_first_steps=1",
                      "enable_checkpointing=false", "run_name=fallback", f"base_output_directory={tmp_path}")
    lines = []
    records = train_records(cfg, log=lines.append)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(not any(r["moe_overflow"]) for r in steps)
    assert steps[0]["moe_step_replays"] == 0, "step 1 ran the worst-case program directly"
    assert steps[-1]["moe_step_replays"] >= 1, "the case must overflow"
    evaluation = [r for r in records if "eval_loss" in r][0]
    assert evaluation["eval_moe_rerun_batches"] >= 1 and not any(evaluation["eval_moe_overflow"])
    assert f"replayed steps: {steps[-1]['moe_step_replays']}" in console_line(steps[-1])


def test_layer_fallback_counts_reach_metrics_and_tensorboard():
    record = {"step": 3, "loss": 1.0, "moe_fallback": [1.0, 0.0], "moe_dropless_fallback_layers": 1.0}
    assert "worst-case layers: 1" in console_line(record)
    assert tensorboard_scalars(record)["learning/moe_dropless_fallback_layers"] == 1.0


@pytest.mark.parametrize("tokens,chunks,factor", [(4096, 1, 2.0), (8192, 2, 1.25), (100, 3, 1.0), (7, 1, 1.0)])
def test_worst_case_chunks_keep_each_chunk_within_the_bounded_buffer(tokens, chunks, factor):
    """DeepSeek-V3 at EP 64 (256 experts, top 8, 4 per device) and small cases: the worst-case branch's chunks each
    fit the bounded chunk's buffer, and one chunk fewer would not."""
    k, e, local = 8, 256, 4
    many = worst_case_chunks(tokens, chunks, k, e, local, factor)
    bounded = peer_capacity(math.ceil(tokens / chunks), k, e, local, factor).slots
    assert peer_capacity(math.ceil(tokens / many), k, e, local, None).slots <= bounded or many == tokens
    assert many >= chunks
    if many > chunks:
        assert peer_capacity(math.ceil(tokens / (many - 1)), k, e, local, None).slots > bounded


H100 = "configs/gpu/deepseek3-671b-h100-256.yml"
RAGGED = ["moe_impl=ragged", "te_gmm_quantization=none", "ragged_buffer_factor=2.0"]


def test_the_planner_counts_both_programs_and_charges_the_replay_rate():
    """step: the rerun program's memory is reported and must fit too; its time is charged at dropless_fallback_rate
    x the worst-case program's step. layer: the worst-case branch's chunk adds to one layer's transient, a little
    time per fallback. Nothing changes without a fallback."""
    from MaxText.config.load import load_config

    plain = plan.plan(load_config([H100, *RAGGED]))
    step = plan.plan(load_config([H100, *RAGGED, "moe_dropless_fallback=step", "dropless_fallback_rate=0.1"]))
    layer = plan.plan(load_config([H100, *RAGGED, "moe_dropless_fallback=layer"]))
    assert plain["fallback_program_bytes"] is None and plain["step_time"]["fallback_s"] == 0
    assert step["bytes"] == plain["bytes"]
    assert step["fallback_program_bytes"]["total"] > plain["bytes"]["total"]  # the worst case: does not fit here
    assert step["verdict"] == "does not fit" and plain["verdict"] == "fits"
    worst = plan.plan(worst_case_program(load_config([H100, *RAGGED, "moe_dropless_fallback=step"])))
    assert step["step_time"]["fallback_s"] == pytest.approx(0.1 * worst["step_time"]["step_s"])
    assert step["step_time"]["step_s"] == pytest.approx(plain["step_time"]["step_s"] + step["step_time"]["fallback_s"])
    assert plain["bytes"]["activations"] < layer["bytes"]["activations"] < worst["bytes"]["activations"] / 2
    assert layer["verdict"] == "fits"
    assert 0 < layer["step_time"]["fallback_s"] < 0.02 * plain["step_time"]["step_s"]
    table = plan.format_table(step)
    assert "step rerun program" in table and "dropless fallback" in table


@pytest.mark.parametrize("overrides,match", [
    (["moe_dropless_fallback=step"], "needs a bounded buffer"),
    (["moe_impl=dense", "ragged_buffer_factor=2", "moe_dropless_fallback=layer"], "applies to the dropless MoE"),
    (["ragged_buffer_factor=2", "retry_dropless_first_steps=3"], "needs moe_dropless_fallback=step"),
    (["ragged_buffer_factor=2", "moe_dropless_fallback=layer", "retry_dropless_first_steps=3"], "needs"),
    (["ragged_buffer_factor=2", "moe_dropless_fallback=step", "first_phase_ragged_buffer_factor=3"],
     "retry_dropless_first_steps"),
    (["ragged_buffer_factor=2", "moe_dropless_fallback=step", "retry_dropless_first_steps=3",
      "first_phase_ragged_buffer_factor=1.5"], "below ragged_buffer_factor"),
    (["moe_dropless_fallback=both"], "is not one of step, layer"),
])
def test_fallback_keys_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(*overrides)


def test_upstream_spellings_and_nccl_ep_refusal():
    assert tiny_config("moe_dropless_fallback=None").moe_dropless_fallback is None
    assert tiny_config("eval_ragged_buffer_factor=-1").eval_ragged_buffer_factor is None
    from tests.test_te_block import _config as block_config

    shape = {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
    block = block_config("none", "fsdp2_expert4", "te_moe_block=true", "ragged_buffer_factor=2",
                         "moe_dropless_fallback=step")
    with pytest.raises(ConfigError, match="bootstrapped once per process"):  # TE's block is NCCL EP inside
        parallel_checks.check_nccl_ep(block, shape)
    cfg = tiny_config("moe_impl=te_dropless", "ragged_buffer_factor=2", "moe_dropless_fallback=layer",
                      "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
    parallel_checks.check_nccl_ep(cfg, shape)  # the composed path: over XLA's exchange
    assert not parallel_checks.nccl_ep_used(cfg, shape)
    layout = steptime.layout_from_config(cfg, shape, 8)
    assert layout.fallback == "layer" and layout.dispatch_per == "gpu"


@pytest.mark.parametrize("recipe", ["deepseek3-671b-gb200-128.yml", "deepseek3-671b-h100-256.yml"])
def test_each_recipes_drop_nothing_layout_plans_as_its_header_says(recipe):
    """The recipes keep NCCL EP with a counted overflow (the fastest by the model); each header gives the overrides
    that drop nothing (a fallback) and their modelled tokens/s/GPU, which the planner reproduces, fitting."""
    import os
    import re

    from MaxText.config.load import load_config
    from MaxText.config.parse import CONFIG_DIR

    path = os.path.join(CONFIG_DIR, "gpu", recipe)
    header = " ".join(line[1:].strip() for line in open(path) if line.startswith("#"))
    said = re.search(r"To drop nothing(.*?)(\d+) tokens/s/GPU", header)
    assert said, f"{recipe}: no 'To drop nothing ... N tokens/s/GPU' in its comments"
    overrides = re.findall(r"\b(\w+=[\w.]+)", said.group(1))
    assert "moe_dropless_fallback=layer" in overrides, overrides
    got = plan.plan(load_config([path, *overrides]))
    assert got["verdict"] == "fits" and round(got["step_time"]["tokens_per_s_per_gpu"]) == int(said.group(2)), (
        overrides, got["verdict"], got["step_time"]["tokens_per_s_per_gpu"])

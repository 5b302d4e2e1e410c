"""Transformer Engine's real Python traced on CPU (marker `te_trace`): every TE call site of te_dropless, through
the project's own code, forward and gradient, on the five test meshes, then partitioned by TE's own rules.

MaxText/planning/te_trace.py stands in for TE's compiled extension (fixture `te_standin`, SM 90 unless a
test switches it). Tracing proves calls, shapes, dtypes, custom VJPs and shardings; it runs no kernel (the
references and tests/nccl_ep_double.py prove the numbers; only a GPU proves TE's kernels).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from MaxText.parallel import sharding
from MaxText.config.errors import ConfigError
from MaxText.config.load import global_batch_size
from MaxText.data.records import abstract_batch
from MaxText.layers.moe import dispatch, dropless, te_kernels, te_runtime
from MaxText.parallel import checks
from MaxText.planning import lowering, te_reference, te_trace
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.router import Routing
from MaxText.step.state import state_spec
from MaxText.step.train_step import jit_train_step
from tests.tiny import tiny_config

pytestmark = pytest.mark.te_trace

MESHES = {  # name -> (config overrides, devices); data2_fsdp2_expert2 is the one NCCL EP cannot take
    "1 device": ([], 1),
    "fsdp8": (["ici_fsdp_parallelism=8"], 8),
    "fsdp2_expert4": (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"], 8),
    "expert8": (["ici_fsdp_parallelism=1", "ici_expert_parallelism=8"], 8),
    "data2_expert4": (["ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_expert_parallelism=4"], 8),
}
TE_EP = {"te_ep_prepare_ffi_wrapper", "te_ep_dispatch_ffi_wrapper", "te_ep_combine_ffi_wrapper",
         "te_ep_dispatch_bwd_ffi_wrapper", "te_ep_combine_bwd_ffi_wrapper"}
ROUTER_FWD, ROUTER_BWD = ("te_fused_topk_with_score_function_forward_ffi_wrapper",
                          "te_fused_topk_with_score_function_backward_ffi_wrapper")
GEMM = "te_grouped_gemm_ffi_wrapper"


_eqns = te_trace.equations


def _te_primitives(jaxpr) -> set:
    return {str(e.primitive) for e in _eqns(jaxpr) if str(e.primitive).startswith("te_")}


def _config(mesh_name, *extra):
    """deepseek3-tiny (MLA, shared expert, sigmoid + bias, groups, MTP) on te_dropless with TE kernels, bf16."""
    return tiny_config("model_name=deepseek3-tiny", "override_model_config=true", "moe_impl=te_dropless", "te_kernels=auto", "dtype=bfloat16",
                       "num_experts=8", *MESHES[mesh_name][0], *extra)


def _mesh(cfg, mesh_name):
    return sharding.create_mesh(cfg, jax.devices()[:MESHES[mesh_name][1]])


# ------------------------------------------------------------------------------------------- start-up checks


def test_te_kernels_come_from_te_and_a_cpu_run_still_refuses(te_standin, monkeypatch):
    cfg = tiny_config("moe_impl=te_dropless")
    assert te_kernels.kernels(cfg).name == "transformer_engine" and te_kernels.kernels(cfg).te is not None
    with pytest.raises(ConfigError, match="te_kernels=reference"):
        te_runtime.check_available(cfg)  # no NVIDIA GPU: tracing is for tests and the preflight only
    # On a GPU, the quantization is checked against its generation (TE's Python importable through the stand-in).
    monkeypatch.setattr(te_runtime, "_compute_capability", lambda: 9.0)
    with pytest.raises(ConfigError, match="needs a Blackwell"):
        te_runtime.check_available(tiny_config("moe_impl=te_dropless", "te_gmm_quantization=mxfp8"))
    te_runtime.check_available(tiny_config("moe_impl=te_dropless", "te_gmm_quantization=fp8_current"))
    monkeypatch.setattr(te_runtime, "_compute_capability", lambda: 10.0)
    for quantization in ("mxfp8", "fp8_current", "none"):  # fp8_current on Blackwell: tests/test_te_reference.py
        te_runtime.check_available(tiny_config("moe_impl=te_dropless", f"te_gmm_quantization={quantization}"))


def test_nccl_ep_limits_are_refused_in_one_line(te_standin):
    """TE's MeshResource takes one data-parallel axis beside `expert`; its receive capacity a factor >= 1;
    NCCL EP experts in multiples of 4."""
    two_outer = {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    with pytest.raises(ConfigError, match="one data-parallel axis"):
        checks.check_nccl_ep(tiny_config("moe_impl=te_dropless"), two_outer)
    with pytest.raises(ConfigError, match="ragged_buffer_factor=0.5"):
        checks.check_nccl_ep(tiny_config("moe_impl=te_dropless", "ragged_buffer_factor=0.5"),
                                 {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1})
    with pytest.raises(ConfigError, match="num_experts=6"):
        checks.check_nccl_ep(tiny_config("moe_impl=te_dropless", "num_experts=6", "ici_expert_parallelism=2"),
                                 {"data": 1, "fsdp": 4, "expert": 2, "tensor": 1})
    # None applies without NCCL EP: the references' EP takes them all.
    checks.check_nccl_ep(tiny_config("moe_impl=te_dropless", "te_kernels=reference",
                                         "ragged_buffer_factor=0.5"), two_outer)
    checks.check_nccl_ep(tiny_config("moe_impl=te_dropless", "ragged_buffer_factor=0.5"),
                             {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1})


def test_fused_router_needs_whole_experts_per_group():
    """TE's fused router scores a group by its best K / topk_routing_group experts and needs a whole number."""
    with pytest.raises(ConfigError, match="multiple of topk_routing_group"):
        tiny_config("moe_impl=te_dropless", "num_experts=16", "num_experts_per_tok=3", "n_routing_groups=4",
                    "topk_routing_group=2")
    tiny_config("moe_impl=ragged", "num_experts=16", "num_experts_per_tok=3", "n_routing_groups=4",
                "topk_routing_group=2")  # the pure-JAX router takes it


def test_aligned_buffer_is_tes_token_dispatch_size():
    """TE's token_dispatch buffer: floor((T*K + E*(A-1)) / A) * A rows, enough for any routing (the groups'
    aligned sizes add up to a multiple of A that is at most T*K + E*(A-1))."""
    for slots, experts in ((100, 4), (4096, 8), (128, 1), (3, 64)):
        want = (slots + experts * 127) // 128 * 128
        assert dispatch.aligned_buffer_rows(slots, experts) == want, (slots, experts)
        worst = max(sum(-(-c // 128) * 128 for c in counts) for counts in (
            [slots] + [0] * (experts - 1), [slots // experts + (i < slots % experts) for i in range(experts)]))
        assert worst <= want, (slots, experts, worst)


# ------------------------------------------------------------------------------------------- router


ROUTERS = {  # name -> (config overrides, TE's weights used directly)
    "mixtral softmax top-2 renormalised": (["num_experts=8", "num_experts_per_tok=2", "norm_topk_prob=true"], True),
    "softmax top-4 not renormalised": (["num_experts=16", "num_experts_per_tok=4"], True),
    "softmax groups renormalised": (["num_experts=16", "num_experts_per_tok=4", "norm_topk_prob=true",
                                     "n_routing_groups=4", "topk_routing_group=2"], False),
    "deepseek sigmoid bias groups": (["num_experts=64", "num_experts_per_tok=8", "routed_score_func=sigmoid",
                                      "routed_bias=true", "norm_topk_prob=true", "routed_scaling_factor=2.5",
                                      "n_routing_groups=8", "topk_routing_group=4"], True),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_fused_router_traces_forward_and_gradient(te_standin, name):
    overrides, fused = ROUTERS[name]
    cfg = tiny_config("moe_impl=te_dropless", *overrides)
    assert te_kernels.te_router_mode(cfg)[1] == fused
    topk = te_kernels.kernels(cfg).topk
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    bias = jnp.zeros((e,), jnp.float32) if cfg.routed_bias else None

    def loss(logits):
        weights_TK, experts_TK = topk(logits, bias, cfg)
        return jnp.sum(weights_TK * jnp.arange(k, dtype=jnp.float32)), (weights_TK, experts_TK)

    logits = jax.ShapeDtypeStruct((256, e), jnp.float32)
    (_, (weights, experts)), grad = jax.eval_shape(jax.value_and_grad(loss, has_aux=True), logits)
    assert (weights.shape, weights.dtype, experts.shape, experts.dtype) == ((256, k), jnp.float32, (256, k), jnp.int32)
    assert (grad.shape, grad.dtype) == (logits.shape, logits.dtype)
    prims = _te_primitives(jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(jnp.zeros((256, e))))
    # TE's backward runs exactly when its weights are ours (else the gradient goes through our scores).
    assert ROUTER_FWD in prims and (ROUTER_BWD in prims) == fused, (name, prims)


# ------------------------------------------------------------------------------------------- grouped GEMM

# (SM, te_gmm_quantization) -> does TE take its graph-safe V2 grouped GEMM (notes/te.md §13.3)
GEMMS = {(90, "none"): True, (90, "fp8_current"): False, (100, "none"): True, (100, "mxfp8"): True}


@pytest.fixture
def simulated_sm(te_standin):
    """Set the stand-in's compute capability for one test; back to SM 90 after."""
    yield te_trace.set_sm
    te_trace.set_sm(90)


@pytest.mark.parametrize("sm,quantization", list(GEMMS))
def test_grouped_gemm_traces_forward_and_gradient(simulated_sm, sm, quantization):
    simulated_sm(sm)
    gemm = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).grouped_gemm
    sizes = jnp.array([256, 0, 128, 384], jnp.int32)  # 768 of 1024 rows: the tail goes to the last group
    x, w = jnp.zeros((1024, 256), jnp.bfloat16), jnp.zeros((4, 256, 512), jnp.bfloat16)

    def f(x, w):
        return gemm(x, w, sizes, quantization)

    def forward_and_back(x, w):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(y))

    y, dx, dw = jax.eval_shape(forward_and_back, x, w)
    assert (y.shape, y.dtype) == ((1024, 512), jnp.bfloat16)
    assert (dx.shape, dw.shape, dx.dtype, dw.dtype) == (x.shape, w.shape, x.dtype, w.dtype)
    jaxpr = jax.make_jaxpr(forward_and_back)(x, w)
    gemms = [e for e in _eqns(jaxpr) if str(e.primitive) == GEMM]
    assert len(gemms) == 3, f"forward + dgrad + wgrad, got {len(gemms)}"
    assert all(e.params["use_v2_ffi"] == GEMMS[sm, quantization] for e in gemms), [e.params["use_v2_ffi"] for e in gemms]
    if quantization != "none":
        assert "te_grouped_quantize_ffi_wrapper" in _te_primitives(jaxpr)


def sm_answers() -> dict:
    """What TE's Python decides from the compute capability: the quantize layout of every scaling mode and tensor
    usage, whether each mode is supported, and the shapes (or the error) of fp8_current's grouped GEMM forward
    and gradients. Also run in a fresh process by the test below."""
    from transformer_engine.jax.quantize import ScalingMode, TensorUsage, helper

    answers = {}
    gemm = te_kernels.kernels(tiny_config("moe_impl=te_dropless")).grouped_gemm
    sizes = jnp.array([256, 0, 128, 384], jnp.int32)
    x, w = jnp.zeros((1024, 256), jnp.bfloat16), jnp.zeros((4, 256, 512), jnp.bfloat16)
    try:
        shapes = jax.eval_shape(jax.value_and_grad(
            lambda x, w: jnp.sum(gemm(x, w, sizes, "fp8_current").astype(jnp.float32)), argnums=(0, 1)), x, w)
        answers["fp8_current value_and_grad"] = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), shapes))
    except Exception as e:  # noqa: BLE001 - the answer is the error
        answers["fp8_current value_and_grad"] = f"{type(e).__name__}: {e}"
    # After the GEMM: TE's layout caches hold 4 entries each, so the SM 90 run leaves fp8_current's there last
    # and a cache the switch missed is hit first (asked in the other order, eviction would hide it).
    answers.update({mode.name: ([str(mode.get_quantize_layout(u)) for u in TensorUsage],
                                bool(helper.is_scaling_mode_supported(mode)[0])) for mode in ScalingMode})
    return answers


def test_switching_sm_forgets_what_te_derived_from_the_old_one(simulated_sm):
    """After SM 90 work, set_sm(100) gives exactly a fresh SM 100 process's answers: no cache of TE's keeps the old
    SM (get_quantize_layout's lru_cache once made fp8_current look undifferentiable on Blackwell)."""
    import json
    import subprocess
    import sys

    at_90 = sm_answers()
    simulated_sm(100)
    switched = sm_answers()
    code = ("import json; from MaxText.planning import te_trace; te_trace.install(100); "
            "from tests.test_te_trace import sm_answers; print(json.dumps(sm_answers()))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(json.dumps(switched)) == json.loads(fresh.stdout.splitlines()[-1])
    assert switched != at_90  # the comparison can see a stale answer: some do differ between the two SMs
    simulated_sm(90)
    assert sm_answers() == at_90


def test_tensor_scaled_fp8_is_differentiated_by_te_on_blackwell(simulated_sm):
    """TE 2.20.2's grouped_dense takes tensor-scaled FP8 forward and backward at SM 100, with the weight gradient
    shaped as the weights (notes/te.md §14.1). Fails if TE's Python stops supporting it."""
    simulated_sm(100)
    assert sm_answers()["fp8_current value_and_grad"] == \
        "(((), 'float32'), (((1024, 256), 'bfloat16'), ((4, 256, 512), 'bfloat16')))"


# ------------------------------------------------------------------------------------------- layer and train step


def _moe_layer_jaxpr(cfg, mesh):
    """value_and_grad of dropless.moe_ffn (router output as input) inside the mesh, TE kernels throughout."""
    t, d, f, e, k = 8 * cfg.max_target_length, cfg.base_emb_dim, cfg.base_moe_mlp_dim, cfg.num_experts, \
        cfg.num_experts_per_tok
    rules = sharding.axis_rules(cfg)

    def loss(x, w, weights, experts):
        routing = Routing(weights, experts, jnp.zeros(()), jnp.zeros(()), jnp.zeros((e,)), jnp.zeros(()))
        y, stats = dropless.moe_ffn(x, routing, w, cfg, rules)
        return jnp.sum(y.astype(jnp.float32)), (y, stats["overflow"])

    args = (jnp.zeros((t, d), jnp.bfloat16), ExpertWeights(jnp.zeros((e, d, f)), jnp.zeros((e, d, f)),
                                                            jnp.zeros((e, f, d))),
            jnp.zeros((t, k), jnp.float32), jnp.zeros((t, k), jnp.int32))
    return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args), args


def _batch(cfg, mesh):
    return abstract_batch(global_batch_size(cfg, mesh.devices.size), cfg.max_target_length,
                          sharding.batch_sharding(mesh))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_moe_layer_and_train_step_trace_and_partition_with_te_kernels(te_standin, mesh_name):
    cfg = _config(mesh_name)
    mesh = _mesh(cfg, mesh_name)
    expert_parallel = mesh.shape["expert"] > 1
    spec = state_spec(cfg, mesh)  # outside the mesh context, as train.py does
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        te_trace.bootstrap_ep(cfg, mesh, global_batch_size(cfg, mesh.devices.size))
        jaxpr, (x, *_) = _moe_layer_jaxpr(cfg, mesh)
        outs = jaxpr.out_avals  # loss, y, overflow, then the gradients
        assert outs[1].shape == x.shape and outs[1].dtype == x.dtype, f"{mesh_name}: y {outs[1]}"
        prims = _te_primitives(jaxpr)
        assert GEMM in prims and (TE_EP <= prims) == expert_parallel, (mesh_name, prims)
        if expert_parallel:
            _assert_dispatch_inputs_pinned(jaxpr, tuple(a for a in ("data", "fsdp", "expert")))

        step = jit_train_step(cfg, spec, sharding.batch_sharding(mesh))
        traced = step.trace(spec.abstract, _batch(cfg, mesh))
        prims = _te_primitives(traced.jaxpr)
        assert {ROUTER_FWD, ROUTER_BWD, GEMM} <= prims and (TE_EP <= prims) == expert_parallel, (mesh_name, prims)
        new_state = traced.out_info[0]
        assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == \
            jax.tree.map(lambda a: (a.shape, a.dtype), spec.abstract), f"{mesh_name}: the state changes shape"
        # TE's partitioning rules run when XLA partitions the step; compiling then stops at the first TE FFI
        # call, for which CPU has no handler. Any sharding or shape error of TE's rules would surface first.
        te_trace.register_cpu_lowerings()
        if lowering.jaxlib_version() < (0, 12) and mesh.devices.size > 1:
            # jaxlib 0.11.x crashes compiling TE's grouped GEMM custom call here (lowering.check_jax_for_te):
            # compile with te_reference's kernels behind TE's primitives instead: the whole step, or up to NCCL
            # EP's first op (no reference for it yet), where 0.11.2 stops with the FFI error as it should.
            te_reference.install()
            try:
                traced.lower().compile()
            except Exception as e:  # noqa: BLE001 - only NCCL EP's FFI stop is acceptable
                assert expert_parallel and "No FFI handler registered for te_ep_" in str(e), (mesh_name, str(e))
            finally:
                te_reference.uninstall()
        else:
            with pytest.raises(Exception, match="No FFI handler registered for te_"):
                traced.lower().compile()


def test_a_step_larger_than_the_ep_bootstrap_is_refused_before_te_traces_it(te_standin):
    """TE's own EpConfig (te_trace.bootstrap_ep records it as ep_bootstrap does): a step with twice the tokens the
    run bootstrapped NCCL EP for is refused in one line while tracing, before any TE op is traced."""
    cfg = _config("expert8")
    mesh = _mesh(cfg, "expert8")
    from transformer_engine.jax.cpp_extensions import ep as tex_ep

    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        te_trace.bootstrap_ep(cfg, mesh, 4)  # 4 sequences: 4 x 16 tokens / 8 ranks = 8 per rank
        try:
            with pytest.raises(ConfigError, match="needs NCCL EP for 16 tokens per rank.*bootstrapped for 8,"):
                _moe_layer_jaxpr(cfg, mesh)  # 8 sequences
        finally:
            tex_ep.reset_ep_config()  # process-wide: the next test bootstraps its own


def test_the_lowering_refuses_jaxlib_0_11_with_te_on_many_devices(te_standin, monkeypatch):
    """Under jaxlib 0.11.2 (NVIDIA's JAX image) XLA:CPU segfaults compiling the multi-device step with TE's grouped
    GEMM custom call (bisected: the router's custom calls stop with the FFI error, the one-device step compiles):
    the preflight's lowering says so in one line instead of crashing."""
    monkeypatch.setattr(lowering, "jaxlib_version", lambda: (0, 11, 2))
    with pytest.raises(ConfigError, match=r"crashes XLA:CPU under jaxlib 0\.11\.2 .*8-device mesh.*0\.12\.0\.1") as e:
        lowering.lower_step(_config("fsdp8"))
    assert "\n" not in str(e.value)
    lowering.check_jax_for_te(True, 1)  # one device compiles under 0.11.2
    lowering.check_jax_for_te(False, 8)  # nothing of TE's to crash on


def _assert_dispatch_inputs_pinned(jaxpr, batch_axes):
    """ep_dispatch's token arrays are pinned to the batch axes (`expert` innermost) right before the call."""
    producers = {}
    for eqn in _eqns(jaxpr):
        for out in eqn.outvars:
            producers[id(out)] = eqn
    # TE wraps each EP op in a call (compute_on: XLA's collective stream); its operands are made outside it.
    calls = [e for e in _eqns(jaxpr) if "te_ep_dispatch_ffi_wrapper" in _te_primitives_of_params(e)]
    assert calls, "ep_dispatch not found"
    for call in calls:
        arrays = [v for v in call.invars if hasattr(v, "aval") and v.aval.dtype != jnp.uint8]  # not the handle
        assert len(arrays) == 3, call.invars
        for var in arrays:
            producer = producers.get(id(var))
            assert producer is not None and str(producer.primitive) == "sharding_constraint", \
                f"ep_dispatch input {var} is not pinned (made by {producer and producer.primitive})"
            assert producer.params["sharding"].spec == P(batch_axes), producer.params["sharding"]


def _te_primitives_of_params(eqn):
    return {str(e.primitive) for value in eqn.params.values()
            for sub in (value if isinstance(value, (list, tuple)) else (value,))
            if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns") for e in _eqns(sub)}


def test_ep_bootstrap_sees_a_concrete_mesh(te_standin, monkeypatch):
    """TE's self-hosted NCCL bootstrap forms EP groups from mesh.devices: bootstrap_ep, called where train.py
    calls it (inside jax.set_mesh and mesh_context), must let TE see the concrete mesh, with TE's arguments."""
    cfg = _config("fsdp2_expert4")
    mesh = _mesh(cfg, "fsdp2_expert4")
    from transformer_engine.jax import ep as te_ep, moe as te_moe
    from transformer_engine.jax.sharding import _get_mesh

    seen = {}

    def bootstrap(**kwargs):
        seen.update(kwargs)
        visible = _get_mesh()
        # What TE reads on its self-hosted path (ranks by device id: one process holds all 8 CPU devices here).
        seen["domain"] = te_ep._ep_domain_for_rank(visible, "expert", 5, device_to_rank=lambda d: d.id)
        seen["devices"] = visible.devices.shape

    monkeypatch.setattr(te_ep, "ep_bootstrap", bootstrap)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 1)  # as under one process per GPU
    global_batch = global_batch_size(cfg, 8)
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        te_runtime.bootstrap_ep(cfg, mesh, global_batch)
    tokens = global_batch * cfg.max_target_length // 8
    assert seen["devices"] == (1, 2, 1, 4, 1) and seen["domain"] == (4, 1, 2), seen  # device 5: fsdp 1, expert 1
    assert seen["world_size"] == 8 and seen["max_tokens_per_rank"] == tokens and seen["hidden_dim"] == cfg.base_emb_dim
    assert seen["recv_capacity_per_rank"] == te_moe.get_moe_recv_capacity_per_rank(
        num_experts=8, num_experts_per_tok=cfg.num_experts_per_tok, max_tokens_per_rank=tokens, ep_size=4)
    assert seen["drop_on_overflow"] is False and seen["rank"] == jax.process_index()


def test_check_vma_off_leaves_reference_gradients_unchanged():
    """TE's custom VJPs need shard_map's check_vma off; with the reference kernels the gradients are the same
    bit for bit either way, on a mesh with expert parallelism and one without."""
    cfg = tiny_config("moe_impl=te_dropless", "te_kernels=reference", "num_experts=8")
    t, d, f, e, k = 128, 16, 32, 8, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d))
    w = ExpertWeights(*(jax.random.normal(kk, s) * 0.3 for kk, s in zip(keys[1:4], ((e, d, f), (e, d, f), (e, f, d)))))
    experts = jnp.argsort(jax.random.uniform(keys[4], (t, e)), axis=1)[:, :k].astype(jnp.int32)
    weights = jnp.full((t, k), 0.5)
    rules = sharding.axis_rules(cfg)
    for mesh_keys in (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"], ["ici_fsdp_parallelism=8"]):
        mesh = sharding.create_mesh(tiny_config("num_experts=8", *mesh_keys))
        grads = []
        for check_vma in (True, False):
            def loss(x, w):
                routing = Routing(weights, experts, *([jnp.zeros(())] * 2), jnp.zeros((e,)), jnp.zeros(()))
                kernels = te_kernels.REFERENCE._replace(check_vma=check_vma)
                y, _ = dropless.moe_ffn(x, routing, w, cfg, rules, kernels=kernels)
                return jnp.sum(y * jnp.sin(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))

            with jax.set_mesh(mesh):
                grads.append(jax.jit(jax.grad(loss, (0, 1)))(x, w))
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(mesh_keys)),
                     *grads)

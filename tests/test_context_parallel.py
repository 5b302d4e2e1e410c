"""Context parallelism (ici_context_parallelism, the all-gather strategy): each sequence split over the `context` mesh
axis gives the loss, the MoE statistics and every gradient of one device, for GQA and MLA (which gathers its latent),
the routed experts on the pure-JAX dropless path with expert parallelism beside, MTP, packed documents (two a row,
a padded tail) and all-to-one routing; attention=cudnn_flash (its CPU path) alike; TE's router and grouped GEMMs
(executed on CPU with te_reference's kernels) with XLA's exchange alike. The weights are sharded over the context
axis as over fsdp. What it does not take yet is refused in one line."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.layers.moe import te_runtime
from MaxText.parallel import sharding
from tests.test_batch_split import BIASES, MODEL, _batch, _loss_and_grads
from tests.test_moe_impls import _relative_close
from tests.test_te_reference import QUANTIZABLE_TINY
from tests.tiny import TINY, args, tiny_config

MESHES = {  # name -> ici overrides on 8 devices
    "context2_fsdp4": ["ici_fsdp_parallelism=4", "ici_context_parallelism=2"],
    "context4_expert2": ["ici_fsdp_parallelism=1", "ici_context_parallelism=4", "ici_expert_parallelism=2"],
    "data2_context2_expert2": ["ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_context_parallelism=2",
                               "ici_expert_parallelism=2"],
}
MODELS = {  # name -> overrides of tests/tiny.py's TINY (+ test_batch_split's MODEL: DeepSeek's routing, MTP)
    "GQA": ["moe_impl=ragged"],
    "MLA": ["attention_type=mla", "q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8",
            "v_head_dim=8", "moe_impl=ragged", "attention=chunked", "attention_chunk_size=8"],
}
# TE's router and MXFP8 grouped GEMMs, XLA's exchange (moe_dropless_fallback: NCCL EP does not take the context axis)
MODELS["MLA, TE"] = [*MODELS["MLA"][:-3], "moe_impl=te_dropless", "te_kernels=auto", "te_gmm_quantization=mxfp8",
                     "moe_dropless_fallback=layer", "ragged_buffer_factor=2.0", *MODELS["MLA"][-2:]]
# Every dense GEMM in MXFP8 through TE's dense() (widths multiples of 32; each device's piece of a sequence, 32 tokens,
# blocked as on one device); MLA's keys and values expanded by TE inside the per-device attention
MODELS["MLA, MXFP8"] = [*MODELS["MLA"], "quantization=te_mxfp8", *QUANTIZABLE_TINY, "max_target_length=64",
                        "base_num_decoder_layers=2"]
# cuDNN's attention, which on CPU runs the chunked path per block (tests/test_attention_cudnn_cp.py runs its CUDA
# branch with reference kernels): the config goes through, with one device's numbers
MODELS["MLA, cuDNN"] = [*MODELS["MLA"][:-2], "attention=cudnn_flash", "attention_chunk_size=8"]
_ONE = {}  # model -> one device's results


def _step(cfg, devices: int = 8):
    """cfg's mesh on the first `devices` devices, a batch for it and its function (batch, bias) -> (loss, MoE stats,
    gradients) (test_batch_split's)."""
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    batch = _batch(int(devices * cfg.per_device_batch_size), cfg.max_target_length, cfg.vocab_size, mesh)
    return mesh, batch, _loss_and_grads(cfg, mesh)


def _results(model: str, mesh_args: list, devices: int, jaxprs: list | None = None, routings=tuple(BIASES)):
    """(loss, MoE stats, gradients) under each of `routings` (BIASES); jaxprs, when given, takes the step's jaxpr."""
    cfg = tiny_config(*MODEL, *MODELS[model], *mesh_args)
    mesh, batch, run = _step(cfg, devices)
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        if jaxprs is not None:
            jaxprs.append(jax.make_jaxpr(run)(batch, jnp.zeros(8, jnp.float32)))
        return {name: jax.device_get(run(batch, jnp.asarray(BIASES[name], jnp.float32))) for name in routings}


def _one_device(model: str, routings=tuple(BIASES)):
    """One device's results for `model` on the same global batch (16 rows), computed once."""
    if model not in _ONE:
        _ONE[model] = _results(model, ["ici_fsdp_parallelism=1", "per_device_batch_size=16"], 1, routings=routings)
    return _ONE[model]


@pytest.fixture(scope="module")
def te_on_cpu(te_standin):
    """TE's Python over the stand-in (SM 100: MXFP8), its primitives executed by te_reference's kernels."""
    from MaxText.planning import te_reference, te_trace

    te_trace.set_sm(100)
    te_reference.install()
    yield
    te_reference.uninstall()
    te_trace.set_sm(90)


@pytest.mark.parametrize("model,mesh", [("GQA", "context4_expert2"), ("MLA", "context2_fsdp4"),
                                        ("MLA", "data2_context2_expert2"), ("MLA, cuDNN", "context4_expert2"),
                                        pytest.param("MLA, TE", "data2_context2_expert2", marks=pytest.mark.te_trace)])
def test_context_parallelism_gives_one_devices_numbers(request, model, mesh):
    if "TE" in model:
        request.getfixturevalue("te_on_cpu")
    _compare(model, mesh, _one_device(model), _results(model, [*MESHES[mesh]], 8))


def _compare(model, mesh, one, got, gradient_norm=None):
    """got (8 devices) against one device's results: loss, MoE statistics and gradients within 1e-5 of each array's
    largest magnitude; with gradient_norm, each gradient within that of its norm instead."""
    for name in got:
        label = f"{model} on {mesh}, routing {name}"
        want, have = one[name], got[name]
        load = np.asarray(want[1]["moe"]["load_E"]).sum(0)
        assert (set(np.flatnonzero(load)) == {3, 6}) == (name == "all_to_one"), f"{label}: set-up, load {load}"
        np.testing.assert_allclose(float(have[0]), float(want[0]), rtol=1e-5, err_msg=f"{label}: loss")
        for what, i in (("stat", 1), ("gradient", 2)):
            flat = dict(jax.tree_util.tree_flatten_with_path(have[i])[0])
            for path, w in jax.tree_util.tree_flatten_with_path(want[i])[0]:
                message = f"{label}: {what} {jax.tree_util.keystr(path)}"
                if what == "gradient" and gradient_norm is not None:
                    error = np.linalg.norm(np.asarray(flat[path]) - w) / np.linalg.norm(w)
                    assert error < gradient_norm, f"{message}: {error:.3g} of its norm"
                else:
                    _relative_close(flat[path], w, 1e-5, message)


@pytest.mark.te_trace
def test_quantized_dense_gemms_under_context_parallelism(te_on_cpu):
    """quantization=te_mxfp8 on data 2 x context 2 x expert 2, TE's dense() executed by the reference kernels: the
    loss and MoE statistics of one device (each device's 32-token piece of a sequence is quantized in the blocks one
    device uses), every gradient within 0.15 of its norm of one device's: each context device quantizes its own
    partial cotangent of MLA's keys and values (expanded from the latent beside its queries) before the partials are
    summed, as gradient accumulation quantizes each micro-batch's (measured: 0.075 at most, 0.026 the median; bf16
    GEMMs are 0.12-0.41 away). TE quantizes and multiplies inside the per-device attention too. Uniform routing only:
    the MoE layer is the pure-JAX one checked above."""
    from MaxText.planning import te_trace

    jaxprs = []
    got = _results("MLA, MXFP8", MESHES["data2_context2_expert2"], 8, jaxprs=jaxprs, routings=["uniform"])
    ops = te_trace.te_op_counts(jaxprs[0])
    assert ops.get("te_gemm_v2", 0) >= 3 * 7, ops  # 7 dense GEMMs a layer at least, forward and both gradients
    _assert_te_inside_the_attention(jaxprs[0])
    one = _one_device("MLA, MXFP8", routings=["uniform"])
    _compare("MLA, MXFP8", "data2_context2_expert2", one, got, gradient_norm=0.15)


@pytest.mark.te_trace
def test_nvfp4_dense_gemms_lower_under_context_parallelism(te_on_cpu):
    """quantization=te_nvfp4 on data 2 x context 2 x expert 2 (64-token pieces) traces and lowers: inside the
    per-device attention, where TE partitions nothing, MLA's key/value expansion rounds its gradient stochastically
    from a state of a row per device that TE's abstract evaluation asks for (it refused one row, and a sharding
    constraint there), drawn from the device's own key. (Trained 3 steps on fsdp 2 x context 4: within 0.15% of
    fsdp 8's losses, measured.)"""
    cfg = tiny_config(*MODEL, *MODELS["MLA, MXFP8"], *MESHES["data2_context2_expert2"], "quantization=te_nvfp4",
                      "max_target_length=128")
    mesh, batch, run = _step(cfg)
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        jaxpr = jax.make_jaxpr(run)(batch, jnp.zeros(8, jnp.float32))
        jax.jit(run).lower(batch, jnp.zeros(8, jnp.float32))
    _assert_te_inside_the_attention(jaxpr)


def _assert_te_inside_the_attention(jaxpr):
    """TE quantizes and multiplies inside a shard_map of the step (MLA's key/value expansion beside the queries)."""
    from MaxText.planning import te_trace

    inside = [te_trace.te_op_counts(e.params["jaxpr"]) for e in te_trace.equations(jaxpr)
              if str(e.primitive) == "shard_map"]
    assert any(c.get("te_gemm_v2") and c.get("te_dbias_quantize") for c in inside), inside


def test_the_sequence_is_split_and_the_keys_gathered():
    """The lowered step on context 4 x expert 2 holds each device's quarter of every sequence and all-gathers the
    keys and values (GQA) over the context axis: the strategy is the one claimed, not XLA's own choice."""
    cfg = tiny_config(*MODEL, *MODELS["GQA"], *MESHES["context4_expert2"])
    mesh, batch, run = _step(cfg)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda b: run(b, jnp.zeros(8, jnp.float32))).lower(batch).compile().as_text()
    # keys / values [rows, L, kv heads 2, head_dim 8] gathered along L (dimension 1), 2 groups of the 4 context devices
    gathered = [line for line in hlo.splitlines() if re.search(
        r"= f32\[\d+,16,2,8\]\{[^}]*\} all-gather\(.*replica_groups=\[2,4\].*dimensions=\{1\}", line)]
    assert len(gathered) >= 2 * cfg.base_num_decoder_layers, "keys and values are not gathered over the context axis"


@pytest.mark.parametrize("devices,chunk", [(4, 2), (2, 1)])  # (2, 1): groups of two chunks
def test_causal_load_balance_gives_the_same_attention_for_less_work(devices, chunk):
    """context_parallel_load_balance: each device computes an early and a late block of queries (balanced_chunks),
    each chunk against the key prefix it needs. Output and q/k/v gradients equal the unbalanced path's and one
    device's (GQA, three documents a row and a padded tail; padding rows, which the loss masks out, excepted); XLA
    counts prefix_share of the FLOPs of the unbalanced path's forward (one chunk a device: XLA counts a loop's body
    once, so only where each group of rows is one chunk)."""
    from MaxText.layers.attention import attention, dot_product_attention, prefix_rows, prefix_share

    b, length, h, n, k = 2, 48, 4, 2, 8
    rng = np.random.default_rng(0)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, length, heads, k)), jnp.float32) for heads in (h, n, n))
    segments = np.repeat(np.where(np.arange(length) < 10, 1, np.where(np.arange(length) < 30, 2, 3))[None], b, 0)
    segments[-1, -5:] = 0
    segments = jnp.asarray(segments, jnp.int32)
    real = np.asarray(segments != 0)[:, :, None, None]
    cfg = tiny_config(*MODEL, "ici_fsdp_parallelism=1", f"ici_context_parallelism={devices}",
                      f"max_target_length={length}", f"per_device_batch_size={b / devices}")
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    rules = sharding.axis_rules(cfg)

    def loss(fn):
        return lambda q, kk, v: jnp.sum(jnp.where(real, fn(q, kk, v), 0.0) ** 2)

    def run(balance, chunk_size=chunk):
        fn = functools.partial(attention, segment_ids_BL=segments, impl="chunked", chunk_size=chunk_size,
                               rules=rules, load_balance=balance)
        step = jax.jit(lambda q, kk, v: (fn(q, kk, v), jax.grad(loss(fn), argnums=(0, 1, 2))(q, kk, v)))
        with jax.set_mesh(mesh):
            cost = jax.jit(fn).lower(q, kk, v).compile().cost_analysis()
            return jax.device_get(step(q, kk, v)), (cost[0] if isinstance(cost, list) else cost)["flops"]

    (balanced, grads), flops = run(True)
    (plain, plain_grads), _ = run(False)
    plain_flops = run(False, length)[1]
    one = functools.partial(dot_product_attention, segment_ids_BL=segments)
    want, want_grads = one(q, kk, v), jax.grad(loss(one), argnums=(0, 1, 2))(q, kk, v)
    for got, ref in ((balanced, plain), (balanced, want)):
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, ref, 0), rtol=1e-5, atol=1e-6)
    for got, ref in ((grads, plain_grads), (grads, want_grads)):
        for g, r, name in zip(got, ref, "qkv"):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=name)
    share = prefix_share(length, devices, chunk)
    assert share < 0.8
    if all(hi - lo <= chunk for lo, hi, _ in prefix_rows(length // (2 * devices), 0, length, chunk)):
        assert abs(flops / plain_flops - share) < 0.1, (flops / plain_flops, share)  # no loop in a group


def test_the_chunk_loop_moves_nothing_over_the_context_axis():
    """MLA through the chunked path, 8 query chunks per device: the latent's gathers and the keys' cotangent sums
    run once per layer, never once per chunk (the keys marked varying before the loop: otherwise the backward sums
    their cotangent in every trip). tests/test_preflight.py holds the recipes' gathers, which the partitioner
    alone re-ran in every trip at the 32K recipe's shapes (22 TB a step per GPU)."""
    from MaxText.planning.collectives import count_collectives

    cfg = tiny_config(*MODEL, *MODELS["MLA"], *MESHES["context4_expert2"], "max_target_length=64",
                      "attention_chunk_size=2", "per_device_batch_size=0.25")
    mesh, batch, run = _step(cfg)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda b: run(b, jnp.zeros(8, jnp.float32))).lower(batch).compile().as_text()
    over_context = [c for c in count_collectives(hlo, 8)[0] if c.group == 4 and c.kind != "all-to-all"]
    sequence = [c for c in over_context if len(c.shape) >= 3 and c.shape[1] == cfg.max_target_length]
    assert sequence, over_context  # the whole sequence's latent and keys do cross the context axis
    layers = cfg.base_num_decoder_layers + cfg.mtp_num_layers
    assert all(c.count <= layers for c in sequence), [(c.kind, c.shape, c.count) for c in sequence]


@pytest.mark.parametrize("extra,message", [
    (["max_target_length=18"], "max_target_length=18 does not split over the context axis of size 4"),
    (["moe_impl=te_dropless"], "moe_impl=te_dropless's NCCL EP exchange with context parallelism"),
    (["moe_impl=te_dropless", "te_moe_block=true", "moe_dropless_fallback=layer", "ragged_buffer_factor=2.0"],
     "moe_impl=te_dropless's NCCL EP exchange with context parallelism"),
    (["quantization=te_mxfp8", "max_target_length=64", "head_dim=32"],
     "quantization=te_mxfp8: each device's piece of a sequence holds 16 tokens"),
    (["context_parallel_strategy=ring"], "only the all-gather strategy is built here"),
    (["logical_axis_rules=[['activation_batch', ['data', 'fsdp', 'expert']], ['exp', ['expert']]]"],
     "logical_axis_rules does not split activation_length over 'context'"),
])
def test_what_context_parallelism_does_not_take_is_one_line(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = load_config(["configs/base.yml", *args(TINY, MESHES["context4_expert2"], extra)])
        sharding.mesh_shape(cfg, 8)


def test_the_weights_are_sharded_over_the_context_axis():
    """Context parallelism's devices hold FSDP shards of every weight (as upstream's rules put `context` beside
    `fsdp`): a 671B model's state fits only so. Without it the specs are what they were before the axis existed."""
    from MaxText.step.state import state_spec

    for mesh_args, context in ((MESHES["context4_expert2"], ("context",)), ([], ())):
        cfg = tiny_config(*MODEL, *MODELS["MLA"], *mesh_args)
        spec = state_spec(cfg, sharding.create_mesh(cfg))
        layers = spec.abstract["params"]["moe_layers"]["layers"]
        attention = layers["self_attention"]["wq_a"].sharding.spec  # [layers, embed, q_lora]
        assert attention[1] == ("fsdp", *context, "expert"), (mesh_args, attention)
        experts = layers["moe"]["wi_0"].sharding.spec  # [layers, experts, embed, mlp]
        assert experts[1] == "expert" and experts[2] == (("fsdp", *context) if context else "fsdp"), experts


def test_decode_folds_the_context_axis_into_fsdp():
    """A decode step's one token does not split: MaxText.decode runs a context-parallel config's devices as FSDP."""
    from MaxText.trainer import decode

    cfg = load_config(["configs/base.yml", *args(TINY, MESHES["context4_expert2"])])
    lines = []
    out = decode.decode_config(cfg, log=lines.append)
    shape = sharding.mesh_shape(out, 8)
    assert (shape["fsdp"], shape["context"], shape["expert"]) == (4, 1, 2), shape
    assert any("ici_context_parallelism=4 folded into ici_fsdp_parallelism" in line for line in lines), lines

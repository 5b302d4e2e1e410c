"""use_batch_split_schedule: each device's batch in batch_split_factor parts that run every layer side by side (so one
part's expert-parallel exchange can run under another part's compute) gives the loss, every gradient and the MoE
statistics of the whole batch, on every MoE path and the test meshes, with uniform and all-to-one routing.
(That no part's exchange waits for another part's compute: tests/test_overlap.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.layers.moe import te_runtime
from MaxText.parallel import sharding
from MaxText.step.state import create_state, state_spec
from MaxText.step.train_step import loss_fn
from tests import nccl_ep_double, test_te_trace as trace_tests
from tests.test_moe_impls import _relative_close
from tests.test_te_reference import QUANTIZABLE_TINY, at_sm, on_cpu  # noqa: F401 - at_sm, on_cpu: fixtures
from tests.tiny import tiny_config

SPLIT = ["use_batch_split_schedule=true", "batch_split_factor=2"]
# DeepSeek-V3's routing (sigmoid scores, the aux-loss-free bias, top-k renormalised), a balance loss per sequence and
# a z-loss (both pooled over the parts), MTP (its layer split too), 8 experts.
MODEL = ["num_experts=8", "routed_score_func=sigmoid", "routed_bias=true", "norm_topk_prob=true",
         "load_balance_loss_type=sequence", "load_balance_loss_weight=0.01", "router_z_loss_weight=0.001",
         "mtp_num_layers=1", "per_device_batch_size=2"]
# The bias steers the choice: none, or every token to experts 3 and 6 (with moe_impl=dense: past capacity, dropped).
BIASES = {"uniform": [0.0] * 8, "all_to_one": [-5, -5, -5, 5, -5, -5, 4, -5]}
CASES = {  # name -> (mesh, overrides, tolerance relative to each array's largest magnitude)
    "ragged data2_expert4, 2 chunks": ("data2_expert4", ["moe_impl=ragged", "num_moe_token_chunks=2"], 1e-5),
    "dense fsdp8": ("fsdp8", ["moe_impl=dense", "capacity_factor=1.0"], 1e-5),
}
# TE's kernels on the references with NCCL EP's calls through the double. NCCL EP moves bf16 tokens, so the experts
# run in bf16 whatever the model's dtype, and each part's expert weight gradient comes out of TE's grouped GEMM in
# bf16 before the parts are added (measured: 1.6e-3 of the largest, float32 model); TE's block computes in bf16 only,
# where the split also moves sums over the tokens (a norm scale's gradient) by about one bf16 rounding.
MLA_MXFP8 = ["attention_type=mla", *QUANTIZABLE_TINY, "attention=chunked", "attention_chunk_size=8",
             "quantization=te_mxfp8", "max_target_length=64", "base_num_decoder_layers=2", "mtp_num_layers=0"]
# With TE's MXFP8 dense GEMMs (SM 100), the parts share each dense weight's gather (linear.gather_once). MXFP8 blocks a
# sequence's tokens by 32, as the whole batch does; the parts' weight gradients, each out of TE's GEMM in bf16, differ
# from the whole's by up to 2.1e-2 of the largest at one element (the first layer's wq_b, all-to-one routing), 1.1e-2
# of the norm at most (measured; te_moe_block's bf16 case differs as much; with an MTP depth, the code before the
# shared gather gave the same largest difference to the digit).
TE_CASES = {  # name -> (mesh, overrides, tolerance, SM)
    "te_dropless NCCL EP fsdp2_expert4": ("fsdp2_expert4", ["moe_impl=te_dropless"], 1e-2, 90),
    "te_moe_block expert8": ("expert8", ["moe_impl=te_dropless", "te_moe_block=true", "dtype=bfloat16"], 2e-2, 90),
    "te_dropless MLA fsdp8, quantization=te_mxfp8": ("fsdp8", ["moe_impl=te_dropless", *MLA_MXFP8], 3e-2, 100),
}


def _batch(global_batch: int, length: int, vocab: int, mesh):
    """Random tokens, two documents a row, the last row's tail padding: the parts differ in their real tokens."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (global_batch, length + 1))
    segments = np.where(np.arange(length) < length // 3, 1, 2)[None].repeat(global_batch, 0)
    segments[-1, length - 3:] = 0
    positions = np.where(segments == 1, np.arange(length), np.arange(length) - length // 3) * (segments != 0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": positions,
             "inputs_segmentation": segments, "targets_segmentation": segments}
    rows = sharding.batch_sharding(mesh)
    return {k: jax.device_put(np.asarray(v, np.int32), rows) for k, v in batch.items()}


def _loss_and_grads(cfg, mesh):
    """A function (batch, bias) -> (loss, MoE stats, gradients) for cfg's initial parameters on the mesh (to be
    called inside jax.set_mesh)."""
    spec = state_spec(cfg, mesh)
    with jax.set_mesh(mesh):
        state = create_state(cfg, mesh, spec)

    @jax.jit
    def run(params, aux, batch, bias):
        aux = jax.tree.map(lambda b: jnp.broadcast_to(bias, b.shape), aux)
        (loss, out), grads = jax.value_and_grad(lambda p: loss_fn(p, batch, spec.graphdef, cfg, aux),
                                                has_aux=True)(params)
        return loss, {"moe": out["moe"], "mtp": out["mtp"]}, grads

    return lambda batch, bias: run(state["params"], state["nnx_aux"], batch, bias)


def _compare(case, mesh_name, overrides, tol, setup=lambda cfg, mesh: None):
    """The whole batch and the split one: loss, MoE stats and gradients under each routing (setup(cfg, mesh) before
    each: NCCL EP's bootstrap differs)."""
    mesh_args, devices = trace_tests.MESHES[mesh_name]
    cfgs = [tiny_config(*MODEL, *mesh_args, *overrides, *split) for split in ([], SPLIT)]
    mesh = sharding.create_mesh(cfgs[0], jax.devices()[:devices])
    batch = _batch(int(devices * cfgs[0].per_device_batch_size), cfgs[0].max_target_length, cfgs[0].vocab_size, mesh)
    results = []
    for cfg in cfgs:
        setup(cfg, mesh)
        run = _loss_and_grads(cfg, mesh)
        with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
            results.append({name: run(batch, jnp.asarray(bias, jnp.float32)) for name, bias in BIASES.items()})
    for name in BIASES:
        label = f"{case}, routing {name}"
        want, got = results[0][name], results[1][name]
        load = np.asarray(want[1]["moe"]["load_E"]).sum(0)
        assert (set(np.flatnonzero(load)) == {3, 6}) == (name == "all_to_one"), f"{label}: set-up, load {load}"
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=tol, err_msg=f"{label}: loss")
        for what, i in (("stat", 1), ("gradient", 2)):
            flat = dict(jax.tree_util.tree_flatten_with_path(got[i])[0])
            for path, w in jax.tree_util.tree_flatten_with_path(want[i])[0]:
                _relative_close(flat[path], w, tol, f"{label}: {what} {jax.tree_util.keystr(path)}")
        if "dense" in case and name == "all_to_one":
            assert float(np.sum(want[1]["moe"]["overflow"])) > 0, f"{label}: nothing dropped"


@pytest.mark.parametrize("case", CASES)
def test_a_split_batch_gives_the_whole_batchs_loss_gradients_and_statistics(case):
    _compare(case, *CASES[case])


@pytest.mark.te_trace
@pytest.mark.parametrize("case", TE_CASES)
def test_a_split_batch_through_tes_kernels_and_nccl_ep(at_sm, monkeypatch, case):
    """NCCL EP bootstrapped for one part (te_runtime.ep_bootstrap_args), each part dispatched on its own."""
    mesh_name, overrides, tol, sm = TE_CASES[case]
    at_sm(sm)
    devices = trace_tests.MESHES[mesh_name][1]

    def setup(cfg, mesh):  # NCCL EP as te_runtime.bootstrap_ep leaves it for cfg, its calls through the double
        nccl_ep_double.patch_tex(monkeypatch, cfg, mesh.shape, int(devices * cfg.per_device_batch_size))

    _compare(case, mesh_name, overrides, tol, setup)


def test_nccl_ep_is_bootstrapped_for_one_part():
    cfg = tiny_config(*MODEL, "moe_impl=te_dropless")
    shape = {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
    whole, split = (te_runtime.ep_bootstrap_args(c, shape, 16)["max_tokens_per_rank"]
                    for c in (cfg, tiny_config(*MODEL, "moe_impl=te_dropless", *SPLIT)))
    assert whole == 16 * cfg.max_target_length // 8 == 2 * split


def test_a_batch_that_does_not_split_into_the_parts_is_refused_in_one_line():
    cfg = tiny_config(*MODEL, "per_device_batch_size=1", "ici_fsdp_parallelism=8", *SPLIT)
    with pytest.raises(ConfigError, match=r"batch_split_factor=2 must divide the 1 sequences each device runs"):
        sharding.create_mesh(cfg, jax.devices()[:8])

"""ep_two_hop (two_hop.py): the expert exchange across slices in two hops, on 8 CPU devices laid out as 2 slices of 4
on the expert axis. Its results against the float32 loop: tests/test_moe_impls.py (mesh two_slices_expert4_two_hops,
every routing case, forward and gradients); with moe_dropless_fallback=layer: tests/test_dropless_fallback.py. Here:
with bounded buffers, the slots it cuts are exactly the ones it counts, hop by hop; the hop arithmetic; the model and
the planner; the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.two_hop import hop_capacities
from MaxText.parallel import checks as parallel_checks, sharding
from MaxText.planning import plan, steptime
from tests.test_moe_impls import CASES, D, E, K, L, MESHES, T, _loss_and_outputs, _params, _run
from tests.tiny import tiny_config

TWO_SLICES = MESHES["two_slices_expert4_two_hops"]


def _config(*extra):
    return tiny_config("moe_impl=ragged", f"max_target_length={L}", f"num_experts={E}", f"num_experts_per_tok={K}",
                       f"base_emb_dim={D}", "base_moe_mlp_dim=32", *TWO_SLICES, *extra)


def test_bounded_hops_cut_exactly_the_slots_they_count():
    """Every expert computes the same function f and a token's two choices weigh 1 and 2, so y = f(x) x (the weights
    of its slots that came back): which slots were cut is read off each token's output. Under ragged_buffer_factor=1
    (hop 1 cuts, hop 2 cuts, both) the slots missing are as many as the overflow counted, and a factor as large as
    the worst case cuts nothing."""
    x, w = _params()
    same = ExpertWeights(*(jnp.broadcast_to(a[:1], a.shape) for a in w))
    weights = np.tile(np.array([1.0, 2.0], np.float32), (T, 1))
    worst = _config()
    mesh, rules = sharding.create_mesh(worst), sharding.axis_rules(worst)
    full_step = _loss_and_outputs("ragged", worst, rules)
    cut_any = 0
    for factor in (1.0, 64.0):
        bounded = _config(f"ragged_buffer_factor={factor}")
        step = _loss_and_outputs("ragged", bounded, sharding.axis_rules(bounded))
        for name, (experts, _) in CASES.items():
            (_, (y_full, _)), _ = _run(full_step, mesh, rules, x, same, experts, weights)
            (_, (y, stats)), _ = _run(step, mesh, rules, x, same, experts, weights)
            f = np.asarray(y_full) / 3.0  # every slot back: 1 + 2
            back = np.sum(np.asarray(y) * f, axis=1) / np.maximum(np.sum(f * f, axis=1), 1e-30)
            np.testing.assert_allclose(back, np.round(back), atol=1e-3, err_msg=f"{name}: not a sum of slot weights")
            lost = {0: 2, 1: 1, 2: 1, 3: 0}  # slots missing by the weight that came back
            missing = sum(lost[int(v)] for v in np.round(back))
            assert missing == float(stats["overflow"]), (factor, name, missing, float(stats["overflow"]))
            assert factor == 1.0 or missing == 0, (factor, name, missing)
            cut_any += missing
    assert cut_any > 0, "the cases must overflow the bounded hops"


@pytest.mark.parametrize("tokens,factor", [(64, None), (64, 1.0), (16, 2.0), (4096, 1.25)])
def test_hop_budgets(tokens, factor):
    """DeepSeek-V3 at EP 64 as 8 slices of 8 (256 experts, top 8): hop 1's budget per destination slice is the
    balanced T*K/8 x factor (worst case: a row per token carrying min(K, 32) slots), hop 2's per destination device
    T*K/8 x factor too (its relays are the slice's 8 devices; worst case: every received row's pairs on one device),
    and together the grouped GEMMs never see fewer rows than the flat exchange's worst case allows to arrive."""
    first, second = hop_capacities(tokens, 8, 256, 4, 8, factor)
    if factor is None:
        assert (first.rows, first.slots) == (tokens, tokens * 8)
        assert (second.rows, second.slots) == (8 * tokens, 8 * tokens * 4)
    else:
        assert first.slots == min(tokens * 8, int(np.ceil(tokens * 8 / 8 * factor)))
        assert second.slots == min(8 * first.rows * 4, int(np.ceil(tokens * 8 / 8 * factor)))
    assert first.rows <= tokens and second.rows <= 8 * first.rows


H100 = "configs/gpu/deepseek3-671b-h100-256.yml"


def test_the_model_sends_a_row_per_slice_and_the_planner_counts_both_buffers():
    fallback = [H100, "moe_dropless_fallback=layer"]
    flat = load_config(fallback)
    hops = load_config([*fallback, "ep_two_hop=true"])
    shape = sharding.mesh_shape(flat, 256)
    assert steptime.layout_from_config(flat, shape, 256).dispatch_per == "gpu"
    assert steptime.layout_from_config(hops, shape, 256).dispatch_per == "node"
    assert steptime.layout_from_config(load_config([H100]), shape, 256).dispatch_per == "node"  # NCCL EP's own
    t, ep = 8192, shape["expert"]
    first, second = hop_capacities(t, 8, 256, 4, 8, 2.0)
    assert plan.dispatch_rows(hops, t, ep) == 8 * first.rows + 8 * second.rows
    assert plan.moe_rows(hops, t, ep) > 0 and plan.two_hop_node(hops, ep) == 8 and plan.two_hop_node(flat, ep) == 0
    faster = plan.plan(hops)["step_time"]["tokens_per_s_per_gpu"] / plan.plan(flat)["step_time"]["tokens_per_s_per_gpu"]
    assert faster > 1.2, faster


@pytest.mark.parametrize("overrides,match", [
    (["ep_two_hop=true", "ici_expert_parallelism=8", "ici_fsdp_parallelism=1"], "needs the expert axis across slices"),
    (["ep_two_hop=true", "ep_dedup=false", *TWO_SLICES[:3]], "which is ep_dedup"),
    (["ep_two_hop=true", "moe_impl=dense", *TWO_SLICES[:3]], "exchanges nothing"),
])
def test_two_hop_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(*overrides)


def test_nccl_ep_is_two_hop_already():
    cfg = tiny_config("moe_impl=te_dropless", *TWO_SLICES)
    with pytest.raises(ConfigError, match="already crosses between nodes once"):
        parallel_checks.check_nccl_ep(cfg, {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1})
    # with a fallback te_dropless exchanges over XLA: two hops are its own
    parallel_checks.check_nccl_ep(tiny_config("moe_impl=te_dropless", "ragged_buffer_factor=2",
                                              "moe_dropless_fallback=layer", *TWO_SLICES),
                                  {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1})
    assert jax.device_count() == 8

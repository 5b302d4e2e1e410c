"""te_dropless's NCCL EP dispatcher (nccl_ep.NcclEp) on CPU through the NCCL EP double (tests/nccl_ep_double.py).

First the double itself against a loop model of NCCL EP's receive buffer (layout, padding, uninitialized
tail, overflow, round trip, gradients); then moe_ffn through the double, forward and gradients, against
the float32 per-expert loop reference on fsdp2 x expert4, expert8 and fsdp2 x expert2 x tensor2 meshes, and
its overflow count under a small ragged_buffer_factor.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.parallel import sharding
from MaxText.layers.moe import dispatch, dropless, te_runtime
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.router import Routing
from tests.moe_reference import moe_reference
from tests.tiny import tiny_config

pytestmark = pytest.mark.te_trace

ALIGN = dispatch.ALIGN
PAD, TAIL = -1, -2  # receive-buffer rows of the loop model that hold no slot: zero padding, uninitialized tail
L, D, F, E, K = 16, 16, 32, 8, 2

MESHES = {
    "fsdp2_expert4": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"],
    "expert8": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8"],
    # Tensor shards of the FFN add up their partial outputs before combine; the EP ops see replicated rows.
    "fsdp2_expert2_tensor2": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"],
}


def buffer_model(experts_TK, num_groups, ep_size, align, recv_rows):
    """NCCL EP's receive buffers as the double lays them out, written as loops. Returns (slot_PR, counts_PL,
    demand_P): the slot (t*K + k) in every row of every rank (PAD, TAIL), the aligned slab sizes cut at the
    buffer's end, and the pre-drop rows wanted. Rank p = group * ep_size + ep index holds tokens
    [p*t, (p+1)*t); its slab for local expert j gathers, from every rank of its group in order, the slots
    routed to expert p_ep * L + j in (token, k) order, then zero rows up to a multiple of `align`."""
    t_total, k = experts_TK.shape
    ranks = num_groups * ep_size
    t_rank, num_local = t_total // ranks, E // ep_size
    slot_PR = np.full((ranks, recv_rows), TAIL)
    counts_PL = np.zeros((ranks, num_local), np.int64)
    demand_P = np.zeros(ranks, np.int64)
    for p in range(ranks):
        group, d = divmod(p, ep_size)
        tokens = range(group * ep_size * t_rank, (group + 1) * ep_size * t_rank)
        row = 0
        for j in range(num_local):
            slab = [t * k + c for t in tokens for c in range(k) if experts_TK[t, c] == d * num_local + j]
            size = -(-len(slab) // align) * align
            for i in range(size):
                if row + i < recv_rows:
                    slot_PR[p, row + i] = slab[i] if i < len(slab) else PAD
            counts_PL[p, j] = min(row + size, recv_rows) - min(row, recv_rows)
            row += size
        demand_P[p] = row
    return slot_PR, counts_PL, demand_P


def kept_slots(slot_PR, shape_TK):
    """kept[t, k]: whether slot (t, k) has a row in some receive buffer (not dropped on overflow)."""
    kept = np.zeros(math.prod(shape_TK), bool)
    kept[slot_PR[slot_PR >= 0]] = True
    return kept.reshape(shape_TK)


def _config(*overrides):
    return tiny_config("moe_impl=te_dropless", "te_kernels=auto", f"max_target_length={L}", f"num_experts={E}",
                       f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}", *overrides)


# ------------------------------------------------------------------------------------------- the double


@pytest.mark.parametrize("recv_rows", [512, 256])  # 256: rank 0 wants 384 rows and overflows
def test_double_layout_round_trip_and_gradients(te_standin, recv_rows):
    """4 ranks (one EP group), E=8: expert-major 128-aligned slabs with zero padding, a NaN tail, counts ==
    aligned sizes, total_recv_tokens == pre-drop demand; dispatch -> weight -> combine gives sum_k w_k x_t
    over the kept slots, and both ops' gradients are the gathers / sums NCCL EP's VJPs compute."""
    from tests import nccl_ep_double

    ranks, t_rank, h = 4, 48, 8
    t_total = ranks * t_rank
    cfg = _config("ici_fsdp_parallelism=1", f"ici_expert_parallelism={ranks}")
    mesh = sharding.create_mesh(cfg, jax.devices()[:ranks])
    rng = np.random.default_rng(0)
    # Expert 0 gets > 128 rows (a two-block slab), expert 5 none; experts 0 and 1 share rank 0, so a token
    # routed to both sits once in each of rank 0's slabs.
    popularity = np.array([12.0, 3, 1, 1, 1, 0, 1, 1])
    experts_TK = np.stack([rng.choice(E, K, replace=False, p=popularity / popularity.sum())
                           for _ in range(t_total)]).astype(np.int32)
    weights_TK = rng.uniform(0.1, 1.0, (t_total, K)).astype(np.float32)
    # Small integers, exact in bfloat16, with a sign pattern along H.
    x_TH = (np.arange(1, t_total + 1)[:, None] * np.where(np.arange(h) % 2, -1.0, 1.0)).astype(np.float32)
    slot_PR, counts_PL, demand_P = buffer_model(experts_TK, 1, ranks, ALIGN, recv_rows)
    assert (demand_P > recv_rows).any() == (recv_rows == 256), f"case set-up: demand {demand_P}"
    assert np.any(experts_TK[:, 0] // 2 == experts_TK[:, 1] // 2), "case set-up: no token with two experts on a rank"

    double = nccl_ep_double.NcclEpDouble(E, t_rank, recv_rows, h)
    ep_cfg = double.EpLayerConfig(top_k=K, dispatch_output_per_expert_alignment=ALIGN)

    def dispatch(x, w):  # (differentiable outputs), (integer bookkeeping)
        recv, recv_w, *rest = double.ep_dispatch(ep_cfg, jnp.asarray(experts_TK), x, w, recv_rows)
        return (recv, recv_w), tuple(rest)

    def round_trip(x, w):
        (recv, recv_w), (handle, counts, _) = dispatch(x, w)
        valid = jnp.arange(recv_rows)[None, :] < jnp.sum(counts, axis=1, keepdims=True)
        out = jnp.where(valid[..., None], recv.astype(jnp.float32) * recv_w[..., None], 0.0)
        return double.ep_combine(ep_cfg, handle, counts, out, num_local_tokens=t_total)

    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        x = jnp.asarray(x_TH, jnp.bfloat16)
        (recv, recv_w), dispatch_vjp, (handle, counts, total) = jax.vjp(dispatch, x, jnp.asarray(weights_TK),
                                                                         has_aux=True)
        g_recv = rng.standard_normal(recv.shape).astype(np.float32)
        g_recv_w = rng.standard_normal(recv_w.shape).astype(np.float32)
        g_x, g_w = dispatch_vjp((jnp.asarray(g_recv, jnp.bfloat16), jnp.asarray(g_recv_w)))
        y, combine_vjp = jax.vjp(lambda out: double.ep_combine(ep_cfg, handle, counts, out, t_total),
                                 jnp.asarray(g_recv))
        g_y = rng.standard_normal(y.shape).astype(np.float32)
        (g_out,) = combine_vjp(jnp.asarray(g_y))
        y_round = jax.jit(round_trip)(x, jnp.asarray(weights_TK))

    case = f"recv_rows={recv_rows}"
    slot_ok = np.maximum(slot_PR, 0)
    want_recv = np.where((slot_PR >= 0)[..., None], x_TH[slot_ok // K],
                         np.where((slot_PR == PAD)[..., None], 0.0, np.nan))
    want_w = np.where(slot_PR >= 0, weights_TK.reshape(-1)[slot_ok], np.where(slot_PR == PAD, 0.0, np.nan))
    np.testing.assert_array_equal(np.asarray(recv, np.float32), want_recv, err_msg=f"{case}: recv_tokens")
    np.testing.assert_array_equal(np.asarray(recv_w), want_w, err_msg=f"{case}: recv_topk_weights")
    np.testing.assert_array_equal(np.asarray(counts), counts_PL, err_msg=f"{case}: token_counts")
    np.testing.assert_array_equal(np.asarray(total)[:, 0], demand_P, err_msg=f"{case}: total_recv_tokens")
    assert np.all(counts_PL % ALIGN == 0) and np.isnan(want_recv).any(), f"{case}: the case has no NaN tail"

    kept = kept_slots(slot_PR, experts_TK.shape)
    assert kept.all() == (recv_rows == 512), f"{case}: only the overflowing case drops slots"
    want_y = np.einsum("tk,th->th", weights_TK * kept, x_TH)
    np.testing.assert_allclose(np.asarray(y_round), want_y, rtol=1e-6, err_msg=f"{case}: round trip")

    # dispatch VJP: a token's gradient sums its rows' gradients (likewise each (token, k) weight); combine VJP:
    # each occupied row reads its token's gradient, padding and tail rows get 0.
    occupied = slot_PR >= 0
    want_g_x = np.zeros((t_total * K, h), np.float32)
    np.add.at(want_g_x, slot_PR[occupied], np.asarray(jnp.asarray(g_recv, jnp.bfloat16), np.float32)[occupied])
    want_g_w = np.zeros(t_total * K, np.float32)
    np.add.at(want_g_w, slot_PR[occupied], g_recv_w[occupied])
    np.testing.assert_allclose(np.asarray(g_x, np.float32), want_g_x.reshape(t_total, K, h).sum(1), rtol=1e-2,
                               atol=1e-2, err_msg=f"{case}: d tokens (bf16 sums)")
    np.testing.assert_allclose(np.asarray(g_w), want_g_w.reshape(t_total, K), rtol=1e-6,
                               err_msg=f"{case}: d weights")
    want_g_out = np.where(occupied[..., None], g_y[slot_ok // K], 0.0)
    np.testing.assert_array_equal(np.asarray(g_out), want_g_out, err_msg=f"{case}: d expert_out")


# ------------------------------------------------------------------------------------------- the NCCL EP dispatcher


def _routing_cases(t_total):
    """name -> (experts_TK, weights_TK); K distinct experts per token (as tests/test_moe_impls.py)."""
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permutation(E)[:K] for _ in range(t_total)])
    popularity = 1.0 / np.arange(1, 6)  # Zipf-like over experts 0..4: experts 5, 6, 7 stay empty
    skewed = np.stack([rng.choice(5, K, replace=False, p=popularity / popularity.sum()) for _ in range(t_total)])
    one = np.tile(np.array([3, 6]), (t_total, 1))  # every token's first choice is expert 3
    return {name: (experts.astype(np.int32), rng.uniform(0.1, 1.0, (t_total, K)).astype(np.float32))
            for name, experts in (("uniform", uniform), ("skewed_empty_experts", skewed), ("all_to_one", one))}


def _bf16_exact(a):
    """The NCCL EP dispatcher sends bf16 tokens and the FFN runs in bf16: inputs exact in bf16 leave only its rounding."""
    return jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)


def _params(t_total):
    keys = jax.random.split(jax.random.key(1), 4)
    return (_bf16_exact(jax.random.normal(keys[0], (t_total, D))),
            ExpertWeights(_bf16_exact(jax.random.normal(keys[1], (E, D, F)) * D ** -0.5),
                          _bf16_exact(jax.random.normal(keys[2], (E, D, F)) * D ** -0.5),
                          _bf16_exact(jax.random.normal(keys[3], (E, F, D)) * F ** -0.5)))


def _cotangent(shape):
    return jnp.sin(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)  # fixed, non-trivial


def _nccl_ep_step(kernels, cfg, rules):
    """jit(value_and_grad) of <moe_ffn output, cotangent> wrt x, expert weights and routing weights; the
    routing is an input, so one compile serves every routing case."""
    def f(x, w, experts, weights):
        routing = Routing(weights, experts, jnp.zeros(()), jnp.zeros(()), jnp.zeros((E,)), jnp.zeros(()))
        y, stats = dropless.moe_ffn(x, routing, w, cfg, rules, kernels=kernels)
        overflow = stats["overflow"]
        return jnp.sum(y * _cotangent(y.shape)), (y, overflow)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3), has_aux=True))


def _reference(x, w, experts, weights, kept=None):
    def f(x, w, weights):
        y = moe_reference(x, weights, experts, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD, kept_TK=kept)
        return jnp.sum(y * _cotangent(y.shape)), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, weights)
    return y, grads


def _kernels_and_step(cfg, t_total):
    """The double's kernel set, bootstrapped for cfg's mesh and t_total tokens, and its jitted step."""
    from tests import nccl_ep_double

    mesh_shape = sharding.create_mesh(cfg).shape
    kernels = nccl_ep_double.kernels(cfg, mesh_shape, t_total // L)
    return kernels, _nccl_ep_step(kernels, cfg, sharding.axis_rules(cfg))


def _run(cfg, step, x, w, experts, weights):
    """(y, overflow, grads) of the step on cfg's mesh, the token arrays placed as a trainer places them."""
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg):
        tokens = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", None), rules))
        x, experts, weights = (jax.device_put(a, tokens) for a in (x, experts, weights))
        (_, (y, overflow)), grads = step(x, w, experts, weights)
    return y, overflow, grads


def _assert_close(got, want, case):
    """bf16 tolerance, 3e-2 of the array's largest magnitude: the inputs are exact in bf16, but every FFN
    activation, the weighted expert outputs and the backward's cotangents are rounded to bf16 (relative error
    up to 2^-9 each, a few roundings deep); measured worst case 1.1e-2 (TE's own EP tests allow 5e-2)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * scale, err_msg=case)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_nccl_ep_moe_matches_reference(te_standin, mesh_name):
    """Forward and gradients (x, wi_0, wi_1, wo, routing weights) on uniform, skewed (empty experts) and
    all-to-one routing, with the double's NaN tail and 128-aligned slabs in every receive buffer."""
    t_total = 128
    cfg = _config(*MESHES[mesh_name])
    x, w = _params(t_total)
    _, step = _kernels_and_step(cfg, t_total)
    for name, (experts, weights) in _routing_cases(t_total).items():
        y, overflow, grads = _run(cfg, step, x, w, experts, weights)
        y_ref, grads_ref = _reference(x, w, experts, weights)
        case = f"the NCCL EP dispatcher on {mesh_name}, routing {name}"
        assert float(overflow) == 0.0, f"{case}: the dropless buffer overflowed ({float(overflow)})"
        _assert_close(y, y_ref, f"{case}: output")
        _assert_close(grads[0], grads_ref[0], f"{case}: d/dx")
        _assert_close(grads[2], grads_ref[2], f"{case}: d/drouting weights")
        for label in ExpertWeights._fields:
            _assert_close(getattr(grads[1], label), getattr(grads_ref[1], label), f"{case}: d/d{label}")


def test_nccl_ep_moe_overflow_counts_dropped_rows(te_standin):
    """ragged_buffer_factor=1 on an expert8 mesh: every token's second choice is expert 6, the first is expert
    3 but for the last 12 tokens (expert 0), so ranks 3 and 6 each want 512 rows (expert 3's last 12 of them
    padding) and hold 128. The NCCL EP overflow is the rows the double dropped (padding included, so 12 more
    than the dropped slots) and the output is the reference without exactly the dropped slots."""
    t_total = 512  # 64 tokens per rank: enough that the factor-1 buffer (128 rows) is below the demand
    cfg = _config("ragged_buffer_factor=1.0", *MESHES["expert8"])
    x, w = _params(t_total)
    experts, weights = _routing_cases(t_total)["all_to_one"]
    experts[-12:, 0] = 0
    kernels, step = _kernels_and_step(cfg, t_total)
    recv_rows = te_runtime.ep_recv_capacity(kernels.te, cfg, t_total // 8, 8)
    slot_PR, _, demand_P = buffer_model(experts, 1, 8, ALIGN, recv_rows)
    kept = kept_slots(slot_PR, experts.shape)
    rows_dropped = np.maximum(demand_P - recv_rows, 0).sum()
    assert 0 < kept.size - kept.sum() == rows_dropped - 12, f"case set-up: {rows_dropped} rows, {kept.sum()} kept"
    y, overflow, _ = _run(cfg, step, x, w, experts, weights)
    assert float(overflow) == rows_dropped, f"overflow {float(overflow)} != {rows_dropped} rows dropped"
    y_ref, _ = _reference(x, w, experts, weights, kept=kept)
    _assert_close(y, y_ref, "output without the dropped slots")


def test_a_step_beyond_the_bootstrap_is_refused_in_one_line(te_standin):
    """NCCL EP's buffers are sized at bootstrap: a step with more tokens per rank, or other experts, than were
    bootstrapped is refused in one line while tracing (as TE's moe() refuses it); one with fewer tokens runs with
    the bootstrapped capacity and matches the reference."""
    from MaxText.config.errors import ConfigError
    from MaxText.config.load import replace

    cfg = _config(*MESHES["expert8"])
    kernels, step = _kernels_and_step(cfg, 128)  # bootstrapped for 128 tokens: 16 per rank
    x, w = _params(256)
    experts, weights = _routing_cases(256)["uniform"]
    with pytest.raises(ConfigError, match="needs NCCL EP for 32 tokens per rank.*bootstrapped for 16,") as e:
        _run(cfg, step, x, w, experts, weights)
    assert "\n" not in str(e.value)
    more_experts = replace(cfg, num_experts=16)
    with pytest.raises(ConfigError, match="num_experts=16.*bootstrapped for 16, num_experts=8"):
        _run(more_experts, _nccl_ep_step(kernels, more_experts, sharding.axis_rules(more_experts)), x[:128],
             ExpertWeights(*(jnp.concatenate([a, a]) for a in w)), experts[:128], weights[:128])
    y, overflow, _ = _run(cfg, step, x[:64], w, experts[:64], weights[:64])
    assert float(overflow) == 0.0
    _assert_close(y, _reference(x[:64], w, experts[:64], weights[:64])[0], "fewer tokens than bootstrapped")


def _off_by_one_combine(combine):
    """ep_combine reading each slot's row from the next slot's place in the EP group's buffers."""
    def broken(self, cfg, handle, token_counts, expert_out, num_local_tokens, out_sharding=None):
        return combine(self, cfg, handle, token_counts, jnp.roll(expert_out, 1, axis=1), num_local_tokens,
                       out_sharding)
    return broken


def _weightless_dispatch(dispatch):
    """ep_dispatch whose receive buffer carries every row's router weight as 1 (the weight not travelling)."""
    def broken(self, cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank):
        return dispatch(self, cfg, topk_idx, tokens, jnp.ones_like(topk_weights), recv_capacity_per_rank)
    return broken


@pytest.mark.parametrize("op,breaks", [("ep_combine", _off_by_one_combine), ("ep_dispatch", _weightless_dispatch)])
def test_a_broken_double_fails_the_layer_check(te_standin, monkeypatch, op, breaks):
    """NCCL EP is substituted on CPU at function level (its ops need collectives): each of the double's ops broken
    on purpose makes the layer check above fail, on the expert-parallel mesh it exists for."""
    from tests import nccl_ep_double

    monkeypatch.setattr(nccl_ep_double.NcclEpDouble, op, breaks(getattr(nccl_ep_double.NcclEpDouble, op)))
    with pytest.raises(AssertionError, match="routing uniform: output"):
        test_nccl_ep_moe_matches_reference(te_standin, "fsdp2_expert4")

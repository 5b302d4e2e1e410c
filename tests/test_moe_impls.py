"""Every MoE implementation x mesh shape against the float32 per-expert loop reference, forward and gradients.

The routing (experts and weights) is an input of the jitted function, so one compile per (impl, mesh)
serves every routing case: uniform, skewed with empty experts, and all tokens to one expert.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.parallel import sharding
from MaxText.layers.moe.block import MOE_FFNS
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.router import Routing
from tests.moe_reference import moe_reference
from tests.tiny import tiny_config

B, L, D, F, E, K = 8, 16, 16, 32, 8, 2
T = B * L

MESHES = {
    "none": None,
    "fsdp8": ["ici_fsdp_parallelism=8"],
    "fsdp2_expert4": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"],
    "expert8": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8"],
    "fsdp2_expert2_tensor2": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"],
    "fsdp2_expert4_one_row_per_choice": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "ep_dedup=false"],
    "expert8_three_token_chunks": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8", "num_moe_token_chunks=3"],
    # 8 devices as 2 slices of 4 on the expert axis, the exchange in two hops (two_hop.py)
    "two_slices_expert4_two_hops": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=4", "dcn_expert_parallelism=2",
                                    "ep_two_hop=true"],
}
# Keys of the dropless EP path that ragged and te_dropless's reference share (ep.ExpertParallel,
# the chunk loop of dropless.moe_ffn): run for ragged alone; dense does not read them.
RAGGED_ONLY = ("fsdp2_expert4_one_row_per_choice", "expert8_three_token_chunks", "two_slices_expert4_two_hops")


def _routing_cases():
    """name -> (experts_TK, weights_TK); K distinct experts per token in every case."""
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    # Zipf-like skew over experts 0..4 only: experts 5, 6, 7 stay empty.
    popularity = 1.0 / np.arange(1, 6)
    skewed = np.stack([rng.choice(5, K, replace=False, p=popularity / popularity.sum()) for _ in range(T)])
    one = np.tile(np.array([3, 6])[:K], (T, 1))  # every token's first choice is expert 3
    # Every token's K experts on one device of expert 2 and 4 (one row each under ep_dedup), two of expert 8.
    one_device = np.tile(np.array([7, 6])[:K], (T, 1))
    cases = {}
    for name, experts in (("uniform", uniform), ("skewed_empty_experts", skewed), ("all_to_one", one),
                          ("one_device", one_device)):
        weights = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
        cases[name] = (experts.astype(np.int32), weights)
    return cases


CASES = _routing_cases()


def _params():
    keys = jax.random.split(jax.random.key(1), 4)
    return (jax.random.normal(keys[0], (T, D), jnp.float32),
            ExpertWeights(jax.random.normal(keys[1], (E, D, F)) * D ** -0.5,
                          jax.random.normal(keys[2], (E, D, F)) * D ** -0.5,
                          jax.random.normal(keys[3], (E, F, D)) * F ** -0.5))


def _loss_and_outputs(impl, cfg, rules):
    ffn = MOE_FFNS[impl]

    def f(x, w, experts, weights):
        routing = Routing(weights, experts, jnp.zeros(()), jnp.zeros(()), jnp.zeros((E,)), jnp.zeros(()))
        y, stats = ffn(x, routing, w, cfg, rules)
        cot = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)  # a fixed, non-trivial cotangent
        return jnp.sum(y * cot), (y, stats)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3), has_aux=True))


def _run(step, mesh, rules, x, w, experts, weights):
    """step(x, w, experts, weights), with the token arrays split over the batch axes when there is a mesh."""
    if mesh is None:
        return step(x, w, experts, weights)
    with jax.set_mesh(mesh):
        tokens = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", None), rules))
        x, experts, weights = (jax.device_put(a, tokens) for a in (x, experts, weights))
        return step(x, w, experts, weights)


def _reference(x, w, experts, weights):
    def f(x, w, weights):
        y = moe_reference(x, weights, experts, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD)
        cot = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, weights)
    return y, grads


@pytest.fixture(scope="module")
def references():
    x, w = _params()
    return {name: _reference(x, w, *case) for name, case in CASES.items()}


# RAGGED_ONLY meshes exercise the dropless expert-parallel path ragged and te_dropless share: run under ragged.
IMPL_MESHES = [(impl, mesh) for mesh in MESHES for impl in ("dense", "ragged", "te_dropless")
               if impl == "ragged" or mesh not in RAGGED_ONLY]


@pytest.mark.parametrize("impl, mesh_name", IMPL_MESHES, ids=[f"{mesh}-{impl}" for impl, mesh in IMPL_MESHES])
def test_impl_matches_reference_on_mesh(impl, mesh_name, references):
    overrides = MESHES[mesh_name] or []
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}", f"num_experts_per_tok={K}",
                      f"base_emb_dim={D}", f"base_moe_mlp_dim={F}", *overrides)
    x, w = _params()
    if MESHES[mesh_name] is None:
        mesh, rules = None, None
    else:
        mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    step = _loss_and_outputs(impl, cfg, rules)
    for name, (experts, weights) in CASES.items():
        (_, (y, stats)), grads = _run(step, mesh, rules, x, w, experts, weights)
        y_ref, grads_ref = references[name]
        case = f"{impl} on {mesh_name}, routing {name}"
        np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5, err_msg=f"{case}: output")
        for label, got, want in (("x", grads[0], grads_ref[0]), ("weights", grads[2], grads_ref[2])):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{case}: d/d{label}")
        for label in ExpertWeights._fields:
            np.testing.assert_allclose(getattr(grads[1], label), getattr(grads_ref[1], label), rtol=2e-5, atol=2e-5,
                                       err_msg=f"{case}: d/d{label}")
        assert float(stats.get("overflow", 0.0)) == 0.0, f"{case}: dropless run reported overflow"
        assert float(stats.get("dropped_fraction", 0.0)) == 0.0, f"{case}: uncapped run dropped tokens"


def _kept_with_peer_capacity(experts_TK, num_devices, cap, num_peers=None, dedup=True):
    """Which slots fit when every device sends each expert device (E/N experts each) at most `cap` slots, in
    rows served in order of (destination device, token, choice) until the first that does not fit: the ep.py
    contract, as loops. With dedup a row is a token's choices on one device (all kept or none), and a peer
    takes at most one row per token; without, a row is one choice."""
    t_local = T // num_devices
    e_local = E // (num_peers or num_devices)  # experts per device of the `expert` axis
    num_peers = num_peers or num_devices
    row_cap = min(t_local, cap) if dedup else cap
    kept = np.zeros(experts_TK.shape, bool)
    for d in range(num_devices):
        rows = {}  # (peer, token[, choice]) -> the choices it carries
        for t in range(d * t_local, (d + 1) * t_local):
            for k in range(K):
                peer = experts_TK[t, k] // e_local
                rows.setdefault((peer, t) if dedup else (peer, t, k), []).append((t, k))
        sent_rows, sent_slots, full = [0] * num_peers, [0] * num_peers, [False] * num_peers
        for row in sorted(rows):
            peer, slots = row[0], rows[row]
            full[peer] |= sent_rows[peer] == row_cap or sent_slots[peer] + len(slots) > cap
            if not full[peer]:
                sent_rows[peer] += 1
                sent_slots[peer] += len(slots)
                for t, k in slots:
                    kept[t, k] = True
    return kept


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_small_ragged_buffer_counts_overflow_and_drops_only_it(factor, impl):
    """ragged_buffer_factor below the worst case: the slots that do not fit are counted as overflow and only
    they are missing from the output (expert 8-way mesh, every token's first choice on one expert)."""
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}",
                      f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
                      f"ragged_buffer_factor={factor}",
                      *MESHES["expert8"])
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    x, w = _params()
    experts, weights = CASES["all_to_one"]
    cap = int(np.ceil((T // 8) * K / 8 * factor))
    kept = _kept_with_peer_capacity(experts, 8, cap)
    assert 0 < kept.sum() < kept.size, "the case must overflow some slots and keep others"
    (_, (y, stats)), _ = _run(_loss_and_outputs(impl, cfg, rules), mesh, rules, x, w, experts, weights)
    y_ref = moe_reference(x, weights, experts, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD, kept_TK=kept)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5, err_msg=f"{impl}, factor {factor}: output")
    assert float(stats["overflow"]) == kept.size - kept.sum(), (float(stats["overflow"]), kept.size - kept.sum())


@pytest.mark.parametrize("impl,dedup", [("ragged", True), ("ragged", False), ("te_dropless", True)])
def test_overflow_spares_no_expert_for_its_id(impl, dedup):
    """Two experts on one peer (fsdp 2 x expert 4: 2 local experts each), every token choosing both, a receive
    buffer of half the demand: the overflow falls on each device's last tokens, so both experts keep the same
    share. Served in expert-id order, as ep.py used to, expert 1 lost every slot, step after step. With ep_dedup
    a token's two choices travel as one row, kept or cut together; the same quarter of the slots fits."""
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}",
                      f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
                      "ragged_buffer_factor=1.0", f"ep_dedup={str(dedup).lower()}", *MESHES["fsdp2_expert4"])
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    x, w = _params()
    rng = np.random.default_rng(5)
    experts = np.stack([rng.permutation(2) for _ in range(T)]).astype(np.int32)  # experts 0 and 1, either order
    weights = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    cap = int(np.ceil((T // 8) * K / 4))
    kept = _kept_with_peer_capacity(experts, 8, cap, num_peers=4, dedup=dedup)
    kept_per_expert = [int(kept[experts == e].sum()) for e in (0, 1)]
    assert kept_per_expert[0] == kept_per_expert[1] > 0 and not kept.all(), kept_per_expert
    assert kept.sum() == kept.size // 4, kept.sum()
    (_, (y, stats)), _ = _run(_loss_and_outputs(impl, cfg, rules), mesh, rules, x, w, experts, weights)
    y_ref = moe_reference(x, weights, experts, w.wi_0_EDF, w.wi_1_EDF, w.wo_EFD, kept_TK=kept)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5, err_msg=f"{impl}: output")
    assert float(stats["overflow"]) == kept.size - kept.sum()


def test_shared_experts_add_an_always_on_swiglu():
    """shared_experts=2: the block's output is the routed experts' plus a dense SwiGLU of width 2F on every token."""
    from flax import nnx

    from MaxText.layers.moe.block import MoeBlock
    from MaxText.layers.moe.router import route
    from tests.moe_reference import swiglu

    cfg = tiny_config("moe_impl=dense", "shared_experts=2", f"max_target_length={L}", f"num_experts={E}",
                      f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}")
    block = MoeBlock(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=None, rngs=nnx.Rngs(0))
    shared = block.shared_experts
    assert shared.wi_0.shape == (D, 2 * F) and shared.wo.shape == (2 * F, D)
    x_BLD = jax.random.normal(jax.random.key(3), (2, L, D))
    y_BLD, _ = block(x_BLD)
    x_TD = x_BLD.reshape(-1, D)
    routing = route(x_TD, block.gate[...], None, cfg)
    routed = moe_reference(x_TD, routing.weights_TK, routing.experts_TK, block.wi_0[...], block.wi_1[...], block.wo[...])
    want = routed + swiglu(x_TD, shared.wi_0[...], shared.wi_1[...], shared.wo[...])
    np.testing.assert_allclose(y_BLD.reshape(-1, D), want, rtol=2e-5, atol=2e-5)


def _relative_close(got, want, tolerance, message):
    """|got - want| within `tolerance` of want's largest magnitude, element by element (bf16 rounding is
    relative to the values a sum adds up, not to each small result)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want))) or 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale, err_msg=message)


@pytest.mark.parametrize("impl", ["dense", "ragged", "te_dropless"])
@pytest.mark.parametrize("mesh_name", ["none", "fsdp2_expert4"])
def test_impl_matches_reference_in_bfloat16(impl, mesh_name):
    """bf16 compute (x in bf16, float32 master weights and router weights, as the model runs): every impl
    within bf16 rounding of the float32 loop reference on the same (bf16-rounded) inputs, forward and
    gradients. The impls accumulate alike: grouped GEMMs in float32, rounded once to bf16; the
    router-weighted sum of a token's K outputs in float32 (dense used to weight and sum in bf16)."""
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}",
                      f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}", "dtype=bfloat16",
                      *(MESHES[mesh_name] or []))
    x, w = _params()
    x = x.astype(jnp.bfloat16)
    mesh, rules = (None, None) if MESHES[mesh_name] is None else (sharding.create_mesh(cfg), sharding.axis_rules(cfg))
    step = _loss_and_outputs(impl, cfg, rules)
    for name in ("uniform", "all_to_one"):
        experts, weights = CASES[name]
        (_, (y, _)), grads = _run(step, mesh, rules, x, w, experts, weights)
        y_ref, grads_ref = _reference(x.astype(jnp.float32), w, experts, weights)
        case = f"{impl} on {mesh_name}, bf16, routing {name}"
        assert y.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16, case
        _relative_close(y, y_ref, 2e-2, f"{case}: output")
        for label, got, want in (("x", grads[0], grads_ref[0]), ("weights", grads[2], grads_ref[2])):
            _relative_close(got, want, 3e-2, f"{case}: d/d{label}")
        for label in ExpertWeights._fields:
            assert getattr(grads[1], label).dtype == jnp.float32, f"{case}: d/d{label} in the master weights' dtype"
            _relative_close(getattr(grads[1], label), getattr(grads_ref[1], label), 3e-2, f"{case}: d/d{label}")


def test_impls_accumulate_alike_in_bfloat16():
    """Same float32 accumulation, one rounding to bf16 at the same places: on CPU the three impls' bf16 forward
    outputs are bit for bit the same (dense weighted and summed in bf16 before: a third of the outputs
    differed from ragged's, by up to 2 ulps)."""
    x, w = _params()
    x = x.astype(jnp.bfloat16)
    experts, weights = CASES["uniform"]
    outputs = {}
    for impl in ("dense", "ragged", "te_dropless"):
        cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}",
                          f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}", "dtype=bfloat16")
        (_, (y, _)), _ = _loss_and_outputs(impl, cfg, None)(x, w, experts, weights)
        outputs[impl] = np.asarray(y, np.float32)
    exact = jax.default_backend() == "cpu"  # other backends' grouped GEMM kernels may order the sums differently
    for impl in ("ragged", "te_dropless"):
        np.testing.assert_allclose(outputs["dense"], outputs[impl], rtol=0 if exact else 2 ** -7, atol=0,
                                   err_msg=f"dense vs {impl}")


@pytest.mark.parametrize("num_experts,top_k,num_peers", [(16, 8, 4), (64, 8, 8), (8, 2, 8), (16, 4, 2), (8, 8, 2)])
def test_rank_rows_group_each_tokens_choices_by_device(num_experts, top_k, num_peers):
    """ep.rank_rows against loops: per token, its distinct devices in increasing order, each row carrying the
    (local expert, weight) of the choices there in choice order, empty slots (E/N, 0); unused rows go nowhere."""
    from MaxText.layers.moe import ep

    rng = np.random.default_rng(num_experts + top_k + num_peers)
    t, local = 64, num_experts // num_peers
    experts = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(t)]).astype(np.int32)
    experts[0] = np.arange(top_k)  # the first devices' experts only: as few rows as possible
    weights = rng.uniform(0.1, 1.0, (t, top_k)).astype(np.float32)
    got = jax.jit(ep.rank_rows, static_argnums=(2, 3, 4))(experts, weights, local, num_peers, True)
    p, j = min(top_k, num_peers), min(top_k, local)
    assert got.local_TQJ.shape == (t, p, j) and got.weights_TQJ.shape == (t, p, j)
    for i in range(t):
        devices = sorted(set(experts[i] // local))
        want_dest = devices + [num_peers] * (p - len(devices))
        np.testing.assert_array_equal(got.dest_TQ[i], want_dest, err_msg=f"token {i}")
        for row, device in enumerate(devices):
            there = [k for k in range(top_k) if experts[i, k] // local == device]
            want_local = [experts[i, k] % local for k in there] + [local] * (j - len(there))
            want_weights = [weights[i, k] for k in there] + [0.0] * (j - len(there))
            np.testing.assert_array_equal(got.local_TQJ[i, row], want_local, err_msg=f"token {i} row {row}")
            np.testing.assert_array_equal(got.weights_TQJ[i, row], want_weights, err_msg=f"token {i} row {row}")
        assert (np.asarray(got.local_TQJ[i, len(devices):]) == local).all()
    per_choice = ep.rank_rows(experts, weights, local, num_peers, False)
    np.testing.assert_array_equal(per_choice.dest_TQ, experts // local)
    np.testing.assert_array_equal(per_choice.local_TQJ[..., 0], experts % local)


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
def test_dedup_with_more_choices_than_devices(impl):
    """K = 4 choices over 2 expert devices (P = 2 rows of up to J = 4 slots per token), fsdp 4 x expert 2:
    output and gradients match the float32 loop reference, nothing overflows, including every token on one
    device with all four of its choices."""
    k, e = 4, 8
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={e}",
                      f"num_experts_per_tok={k}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
                      "ici_fsdp_parallelism=4", "ici_expert_parallelism=2")
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    x, w = _params()
    rng = np.random.default_rng(7)
    step = _loss_and_outputs(impl, cfg, rules)
    for name, experts in (("uniform", np.stack([rng.permutation(e)[:k] for _ in range(T)])),
                          ("one_device", np.tile(np.array([5, 4, 7, 6]), (T, 1)))):
        experts = experts.astype(np.int32)
        weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
        (_, (y, stats)), grads = _run(step, mesh, rules, x, w, experts, weights)
        y_ref, grads_ref = _reference(x, w, experts, weights)
        np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5, err_msg=f"{impl}, {name}: output")
        for label, got, want in (("x", grads[0], grads_ref[0]), ("weights", grads[2], grads_ref[2]),
                                 *((f, getattr(grads[1], f), getattr(grads_ref[1], f)) for f in ExpertWeights._fields)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{impl}, {name}: d/d{label}")
        assert float(stats["overflow"]) == 0.0


def _depends_on(jaxpr):
    """deps[i]: the indices of the equations whose outputs equation i reads, directly or not (top level)."""
    producer, deps = {}, []
    for i, eqn in enumerate(jaxpr.eqns):
        found = set()
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Literal) and v in producer:
                found |= deps[producer[v]] | {producer[v]}
        deps.append(found)
        producer.update((v, i) for v in eqn.outvars)
    return deps


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
def test_shared_expert_is_independent_of_the_dispatch(impl):
    """Under expert parallelism the shared expert's GEMMs and the routed path's shard_map (dispatch, grouped
    GEMMs, combine) read only the layer's input: neither waits for the other, so the scheduler may overlap the
    all-to-all with the shared expert. Proved on the block's jaxpr; only the final add joins them."""
    from flax import nnx

    from MaxText.layers.moe.block import MoeBlock

    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", "shared_experts=1", f"max_target_length={L}",
                      f"num_experts={E}", f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
                      *MESHES["fsdp2_expert4"])
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    with jax.set_mesh(mesh):
        block = MoeBlock(cfg, dtype=jnp.float32, weight_dtype=jnp.float32, rules=rules, rngs=nnx.Rngs(0))
        jaxpr = jax.make_jaxpr(lambda x: block(x)[0])(jnp.zeros((B, L, D))).jaxpr
    names = [eqn.primitive.name for eqn in jaxpr.eqns]
    routed = names.index("shard_map")
    shared = [i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name == "name" and eqn.params["name"] == "mlpwo"]
    assert names.count("shard_map") == 1 and len(shared) == 1, (names.count("shard_map"), shared)
    deps = _depends_on(jaxpr)
    assert routed not in deps[shared[0]], "the shared expert waits for the routed experts"
    assert shared[0] not in deps[routed], "the dispatch waits for the shared expert"
    joined = [i for i in range(len(deps)) if {routed, shared[0]} <= deps[i]]
    assert joined and jaxpr.eqns[joined[0]].primitive.name == "add", [names[i] for i in joined[:3]]


def _exchanges_independent_of_first_gemm(cfg, rules):
    """In the routed path's per-device body (the shard_map's jaxpr): how many all-to-alls do not depend on
    the first grouped GEMM's output (the first moe_mlpwo), how many grouped GEMMs and all-to-alls there are."""
    routing = Routing(jnp.ones((T, K)), jnp.zeros((T, K), jnp.int32), jnp.zeros(()), jnp.zeros(()),
                      jnp.zeros((E,)), jnp.zeros(()))
    x, w = _params()
    jaxpr = jax.make_jaxpr(lambda x, w: MOE_FFNS[cfg.moe_impl](x, routing, w, cfg, rules)[0])(x, w).jaxpr
    body = next(e for e in jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    gemms = [i for i, e in enumerate(body.eqns) if e.primitive.name == "name" and e.params["name"] == "moe_mlpwo"]
    deps = _depends_on(body)
    exchanges = [i for i, e in enumerate(body.eqns) if e.primitive.name in ("all_to_all", "ragged_all_to_all")]
    return sum(gemms[0] not in deps[i] for i in exchanges), len(gemms), len(exchanges)


@pytest.mark.parametrize("impl", ["ragged", "te_dropless"])
def test_token_chunks_exchange_without_waiting_for_each_others_gemms(impl):
    """num_moe_token_chunks=2: no exchange of the second chunk waits for the first chunk's grouped GEMMs (the
    all-to-alls free of the first GEMM are the first chunk's own free ones plus all of the second's), so on a
    GPU the scheduler can overlap one chunk's exchange with the other's compute. (The results match the
    reference: expert8_three_token_chunks in test_impl_matches_reference_on_mesh.)"""
    base = [f"moe_impl={impl}", "te_kernels=reference", f"max_target_length={L}", f"num_experts={E}",
            f"num_experts_per_tok={K}", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}", *MESHES["fsdp2_expert4"]]
    counts = {}
    for chunks in (1, 2):
        cfg = tiny_config(*base, f"num_moe_token_chunks={chunks}")
        with jax.set_mesh(sharding.create_mesh(cfg)):
            counts[chunks] = _exchanges_independent_of_first_gemm(cfg, sharding.axis_rules(cfg))
    (free_1, gemms_1, exchanges_1), (free_2, gemms_2, exchanges_2) = counts[1], counts[2]
    assert gemms_1 == 1 and gemms_2 == 2 and exchanges_2 == 2 * exchanges_1, counts
    assert 0 < free_1 < exchanges_1 and free_2 == free_1 + exchanges_1, counts

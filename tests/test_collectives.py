"""MaxText.planning.collectives reads a partitioned module's collectives right (kinds, bytes, groups, loop trips), and
the train step, lowered on 8 simulated devices, moves what it should: weights gathered in the compute dtype
with float32 gradient reduction, no token-wide gathers for routing, no float32 logits all-reduced."""

import json
import os
import subprocess
import sys

import pytest

from MaxText.planning.collectives import count_collectives, largest, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE = """HloModule m, entry_computation_layout={(f32[16,8]{1,0})->f32[4,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], bf16[1,8])) -> pred[] {
  %p = (s32[], bf16[1,8]{1,0}) parameter(0)
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%p#0, %n), direction=LT
}

%body (p.1: (s32[], bf16[1,8])) -> (s32[], bf16[1,8]) {
  %p.1 = (s32[], bf16[1,8]{1,0}) parameter(0)
  %ag = bf16[4,8]{1,0} all-gather(%p.1#1), channel_id=1, replica_groups=mesh['data'=1,'fsdp'=4,'expert'=2] {'fsdp'}, dimensions={0}
  %noop = bf16[4,8]{1,0} all-reduce(%ag), channel_id=2, replica_groups=mesh['data'=1,'fsdp'=4,'expert'=2] {'data'}, to_apply=%add
  ROOT %t = (s32[], bf16[1,8]{1,0}) tuple(%p.1#0, %p.1#1)
}

%cond.2 (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %m = s32[] parameter(1)
  ROOT %lt.2 = pred[] compare(%q#0, %m), direction=LT
}

%body.2 (q.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q.1 = (s32[], f32[8]{0}) parameter(0)
  %a2a = f32[8]{0} all-to-all(%q.1#1), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %t.2 = (s32[], f32[8]{0}) tuple(%q.1#0, %a2a)
}

ENTRY %main (x: f32[16,8]) -> f32[4,8] {
  %x = f32[16,8]{1,0} parameter(0)
  %ar = f32[16,8]{1,0} all-reduce(%x), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %c0 = s32[] constant(0)
  %ds = f32[4,8]{1,0} dynamic-slice(%ar, %c0, %c0), dynamic_slice_sizes={4,8}
  %rs = f32[2,8]{1,0} reduce-scatter(%x), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %sum = f32[] all-reduce(%c0), channel_id=6, replica_groups={}, to_apply=%add
  %init = (s32[], bf16[1,8]{1,0}) tuple(%c0, %c0)
  %loop = (s32[], bf16[1,8]{1,0}) while(%init), condition=%cond, body=%body
  %init.2 = (s32[], f32[8]{0}) tuple(%c0, %c0)
  %loop.2 = (s32[], f32[8]{0}) while(%init.2), condition=%cond.2, body=%body.2, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[4,8]{1,0} add(%ds, %ds)
}
"""


def test_kinds_bytes_groups_and_loop_trips():
    found, unknown = count_collectives(MODULE, num_devices=8)
    assert unknown == 0
    by_kind = summarize(found)
    # The all-gather runs 5 times (its loop's condition: i < 5), bf16[4,8] = 64 bytes each, over fsdp (4).
    assert by_kind["all-gather"] == {"count": 5, "bytes": 320, "wire_bytes": 5 * 64 * 3 / 4, "dtypes": {"bf16": 320}}
    # all-reduce + dynamic-slice is a reduce-scatter (512 bytes in); the native one: 64 out x 4 = 256 in.
    assert by_kind["reduce-scatter"]["count"] == 2 and by_kind["reduce-scatter"]["bytes"] == 512 + 256
    # replica_groups={} is every device; the all-reduce over `data` (one device) is left out.
    assert by_kind["all-reduce"] == {"count": 1, "bytes": 4, "wire_bytes": 2 * 4 * 7 / 8, "dtypes": {"f32": 4}}
    # XLA's known_trip_count: 3 runs of a 32-byte all-to-all over pairs.
    assert by_kind["all-to-all"]["count"] == 3 and by_kind["all-to-all"]["bytes"] == 96
    top = largest(found, n=1)[0]
    assert (top["kind"], top["shape"], top["group"]) == ("reduce-scatter", [16, 8], 4), top


def test_a_loop_with_an_unreadable_trip_count_is_reported():
    """A loop bounded by a runtime value (here a parameter): its collectives are counted once and flagged."""
    module = MODULE.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    found, unknown = count_collectives(module, num_devices=8)
    assert unknown == 1 and summarize(found)["all-to-all"]["count"] == 1


TINY_DEEPSEEK = ["configs/base.yml", "model_name=deepseek3-tiny", "num_devices=8", "moe_impl=ragged", "dtype=bfloat16",
                 "dataset_type=synthetic", "max_target_length=64", "per_device_batch_size=2"]
# Two scaled-down layouts: fsdp 4 x expert 2, logits in 4 tiles, full remat (the default); and fsdp 2 x expert 4,
# untiled logits, minimal remat.
FSDP4_EP2 = TINY_DEEPSEEK + ["ici_fsdp_parallelism=4", "ici_expert_parallelism=2", "num_vocab_tiling=4"]
FSDP2_EP4 = TINY_DEEPSEEK + ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "remat_policy=minimal"]
FSDP2_EP4_SPLIT = FSDP2_EP4 + ["use_batch_split_schedule=true", "batch_split_factor=2"]


# Both layouts lowered in one process (one JAX start-up), with XLA:CPU's backend optimisations off (conftest's
# reason): they run after the module the counts are read from (dumped right after SPMD partitioning), so the JSON
# is the same, ~20 s sooner per lowering (measured: 48 s -> 28 s of compile for FSDP4_EP2).
_LOWERING = ("import json, sys; from MaxText.planning import lowering; from MaxText.config.load import load_config; "
             "print(json.dumps([lowering.lowered(load_config(a), backend_optimization=False) "
             "for a in json.loads(sys.argv[1])]))")


def ep_exchange_bytes(m, lay, rows_per_peer: int, slots_per_row: int) -> float:
    """Per GPU per step, the EP all-to-all buffers ep.py's exchange moves where the platform has no ragged
    all-to-all (XLA:CPU: fixed buffers of rows_per_peer rows to every peer): per MoE layer, the rows out and
    back, forward and in the backward (4), once more where the dispatch is rematerialised; the float32 payload
    of (expert, weight) pairs per slot forward and backward, once more under any remat. On GPU the exchange is
    ragged and moves the rows the routing sends (step_time's ep term counts the same exchanges)."""
    if lay.ep <= 1:
        return 0.0
    rows = lay.ep * rows_per_peer * m.moe_layers
    x = rows * m.emb * lay.dispatch_bytes * (4 + lay.dispatch_recompute)
    payload = rows * 2 * slots_per_row * 4.0 * (2 + lay.expert_regather)
    return x + payload


def lowered(*argvs) -> list[dict]:
    """MaxText.lowering's JSON for each argv, lowered in one process of their own (the same num_devices)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", _LOWERING, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for argv, result in zip(argvs, results):
        assert result["ok"] and result["collectives"], (argv[-3:], result)
    return results


@pytest.fixture(scope="module")
def both_lowered():
    return lowered(FSDP4_EP2, FSDP2_EP4, FSDP2_EP4_SPLIT)


@pytest.fixture(scope="module")
def tiny_deepseek_lowered(both_lowered):
    """The tiny DeepSeek (MLA, group-limited routing, MTP) lowered on 8 CPU devices, fsdp 4 x expert 2, bf16
    compute, logits in 4 tiles: MaxText.lowering's JSON."""
    return both_lowered[0]


@pytest.fixture(scope="module")
def tiny_deepseek_ep4_lowered(both_lowered):
    return both_lowered[1]


def test_weights_are_gathered_in_the_compute_dtype(tiny_deepseek_lowered):
    """Expert weights enter the MoE's shard_map as float32 master weights; before, the FSDP all-gather moved
    float32 (twice the bytes). Now every sizeable gather is bf16, and the expert weights' gradients are
    still reduce-scattered in float32."""
    collectives = tiny_deepseek_lowered["collectives"]
    gathers = collectives["per_device_per_step"]["all-gather"]
    assert gathers["dtypes"].get("f32", 0) < 0.05 * gathers["bytes"], gathers
    experts = [c for c in collectives["largest"] if c["shape"][-2:] in ([64, 32], [32, 64], [16, 32], [32, 16])]
    assert {(c["kind"], c["dtype"]) for c in experts} == {("all-gather", "bf16"), ("reduce-scatter", "f32")}, experts


def test_a_split_batch_gathers_each_weight_once(both_lowered):
    """use_batch_split_schedule: the parts of a device's batch share one FSDP all-gather of each MoE layer's expert
    weights and one reduce-scatter of their gradient (MoeBlock.parts, MeshLayout.gather_once), as the whole batch
    does; each part's shard_map gathered them again before (measured at full scale, DeepSeek-V3 on 128 GB200: the
    step's FSDP traffic doubled, 423 -> 802 GiB of all-gathers a GPU). On fsdp 2 x expert 4 the expert weights are
    the collectives over `fsdp` alone. The dense weights (attention, dense and shared MLPs: over fsdp x expert) are
    gathered once for the parts too (linear.gather_once; before, the partitioner gathered them at each part's use):
    the bf16 all-gathers of the split step are the whole step's. (Their gradients are still reduced per part in
    this module, dumped before XLA's later passes.)"""
    whole, split = (result["collectives"]["by_group"] for result in both_lowered[1:])
    for kind in ("all-gather", "reduce-scatter"):
        experts = [sum(g["bytes"] for g in groups if g["kind"] == kind and g["axes"] == ["fsdp"])
                   for groups in (whole, split)]
        assert experts[0] > 0 and experts[1] == experts[0], (kind, experts)
    gathered = [result["collectives"]["per_device_per_step"]["all-gather"]["dtypes"] for result in both_lowered[1:]]
    assert gathered[1]["bf16"] == gathered[0]["bf16"], gathered
    # The rest (routing metadata) at most once per part: the MoE statistics pool the parts' expert choices in the
    # batch's row order (block._pooled), where concatenating them all-gathered every token's choices (7.4 GiB a GPU a
    # step at full scale, H100 recipe).
    assert all(gathered[1][dtype] <= 2 * gathered[0].get(dtype, 0) for dtype in gathered[1]), gathered


def test_no_collective_spans_every_token(tiny_deepseek_lowered):
    """Routing is per token: XLA's partitioner used to gather every token's [T, E] scores to every device for
    lax.top_k, and to split the tiled logits' contraction dim, all-reducing float32 [tokens, V] logits."""
    tokens, vocab = 8 * 2 * 64, 512
    collectives = tiny_deepseek_lowered["collectives"]
    for c in collectives["largest"]:
        assert c["shape"][0] != tokens, c
        assert not (c["kind"] == "all-reduce" and c["shape"][-1] == vocab), c
    assert collectives["per_device_per_step"]["all-reduce"]["bytes"] < 64 * 1024, collectives


@pytest.mark.parametrize("argv,fixture", [(FSDP4_EP2, "tiny_deepseek_lowered"),
                                          (FSDP2_EP4, "tiny_deepseek_ep4_lowered")], ids=["fsdp4_ep2", "fsdp2_ep4"])
def test_the_step_time_formulas_count_what_the_compiler_emits(argv, fixture, request):
    """MaxText.planning.steptime's volumes against the partitioned module, per device per step, within 10%: the FSDP
    all-gathers and reduce-scatters (weights per pass, the head per vocab tile, the gradient dtypes), and the EP
    exchange (XLA:CPU's fixed buffers: rows per peer x peers, its exchanges per layer under each remat policy);
    then the step-time model timing the module's groups agrees with its own formula."""
    from MaxText.planning import params, steptime
    from MaxText.config.load import load_config
    from MaxText.layers.moe.ep import peer_capacity

    result = request.getfixturevalue(fixture)
    cfg = load_config(argv)
    mesh_shape = result["mesh"]
    layout = steptime.layout_from_config(cfg, mesh_shape, 8)
    model = steptime.Model.from_config(cfg, params.parameter_counts(cfg).total)
    module = result["collectives"]["per_device_per_step"]
    formula = steptime.fsdp_collective_bytes(model, layout)
    for kind in ("all-gather", "reduce-scatter"):
        want = sum(part[kind] for part in formula.values())
        assert abs(want / module[kind]["bytes"] - 1) < 0.10, (kind, want, module[kind])
    ep, e, k = mesh_shape["expert"], cfg.num_experts, cfg.num_experts_per_tok
    tokens = int(cfg.per_device_batch_size) * cfg.max_target_length
    rows = peer_capacity(tokens, k, e, e // ep, cfg.ragged_buffer_factor, cfg.ep_dedup).rows
    exchange = ep_exchange_bytes(model, layout, rows, min(k, e // ep))
    found = sum(g["bytes"] for g in result["collectives"]["by_group"] if g["kind"] == "all-to-all"
                and g["axes"] == ["expert"])
    assert abs(exchange / found - 1) < 0.10, (exchange, found)

    # Timed group by group, the module's weight collectives take what the formula's take; everything the module
    # has (activation reshards, statistics' all-reduces too) takes longer, never less.
    hw = steptime.HARDWARE["h100"]
    by_group = result["collectives"]["by_group"]
    weights = [g for g in by_group if g["kind"] in ("all-gather", "reduce-scatter")]
    timed = steptime.module_comm(cfg, mesh_shape, weights, hw)
    everything = steptime.module_comm(cfg, mesh_shape, by_group, hw)
    own = steptime.step_time(model, layout, hw)["comm_s"]
    assert set(timed) == {"fsdp"} and abs(timed["fsdp"] / own["fsdp"] - 1) < 0.10, (timed, own)
    assert set(everything) == {"fsdp"} and everything["fsdp"] >= timed["fsdp"], everything

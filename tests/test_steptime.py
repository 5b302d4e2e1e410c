"""The step-time model (MaxText.planning.steptime): its routing arithmetic against sampling, its terms against the links
they cross, this trainer's layout read from a recipe, and its error against published runs."""

import glob
import logging
import os
import re

import numpy as np
import pytest

from MaxText import plan as plan_command
from MaxText.planning import params, plan, steptime, validation
from MaxText.config.load import load_config

GB200_RECIPE = os.path.join("configs", "gpu", "deepseek3-671b-gb200-128.yml")


def _sampled_destinations(experts, top_k, units, groups, keep, n=20000, seed=0):
    """The balanced-routing model by sampling: keep `keep` groups uniformly, then top_k distinct experts."""
    rng = np.random.default_rng(seed)
    size, total = experts // units, 0
    for _ in range(n):
        if groups:
            g = experts // groups
            pool = (rng.choice(groups, keep, replace=False)[:, None] * g + np.arange(g)).ravel()
        else:
            pool = np.arange(experts)
        total += len(set(rng.choice(pool, top_k, replace=False) // size))
    return total / n


@pytest.mark.parametrize("experts,top_k,units,groups,keep", [
    (256, 8, 64, None, None),  # Megatron's balanced routing at EP 64
    (256, 8, 8, 8, 4),         # DeepSeek-V3 at EP 8: a GPU is a group
    (256, 8, 64, 8, 4),        # EP 64: units inside groups
    (64, 8, 4, 8, 4),          # two groups per unit
    (256, 8, 2, 8, 4),         # four groups per unit
])
def test_expected_destinations_match_sampling(experts, top_k, units, groups, keep):
    got = steptime.expected_destinations(experts, top_k, units, groups, keep)
    want = _sampled_destinations(experts, top_k, units, groups, keep)
    assert got == pytest.approx(want, rel=0.01), (got, want)
    assert 1 <= got <= min(top_k, units)


def _model():
    cfg = load_config(["configs/base.yml", "model_name=deepseek3-671b"])
    return steptime.Model.from_config(cfg, 682.6e9)


def test_each_term_follows_the_link_it_crosses():
    """Halving the NIC halves nothing inside an NVLink domain and doubles what crosses domains; a group with
    more members per domain crosses on more NICs at once; EP past the domain moves its all-to-all onto the NIC;
    the pipeline bubble shrinks with more microbatches."""
    m, hw = _model(), steptime.HARDWARE["h100"]
    slow_nic = hw._replace(nic_gbps=hw.nic_gbps / 2)
    # fsdp 8 one GPU per node (EP 8 inside each node), dense weights over all 64 GPUs, 8 per node
    inside = steptime.Layout(64, 4096, 512, ep=8, fsdp=8, fsdp_dense=64, fsdp_local=1, fsdp_dense_local=8)
    a, b = steptime.step_time(m, inside, hw), steptime.step_time(m, inside, slow_nic)
    assert b["comm_s"]["ep"] == a["comm_s"]["ep"] > 0  # EP 8 stays on NVLink
    assert b["comm_s"]["fsdp"] == pytest.approx(2 * a["comm_s"]["fsdp"])
    one_rail = steptime.step_time(m, inside._replace(fsdp_dense_local=1), hw)
    assert one_rail["comm_s"]["fsdp"] > a["comm_s"]["fsdp"]
    across = steptime.step_time(m, inside._replace(ep=16, fsdp=4, fsdp_dense=64), hw)
    assert across["comm_s"]["ep"] > 3 * a["comm_s"]["ep"], (across["comm_s"], a["comm_s"])
    few, many = (steptime.step_time(m, steptime.Layout(64, 4096, batch, pp=8, ep=8), hw)["bubble"]
                 for batch in (64, 512))
    assert few == pytest.approx(7 / 8) and many == pytest.approx(7 / 64)


def test_fp8_and_full_overlap_change_what_they_should():
    """FP8 speeds up the GEMMs only; DualPipe-style full overlap hides the all-to-all but costs compute SMs."""
    m, hw = _model(), steptime.HARDWARE["h800"]
    base = steptime.Layout(2048, 4096, 15360, pp=16, ep=64)
    bf16, fp8 = steptime.step_time(m, base, hw), steptime.step_time(m, base._replace(gemm_precision="fp8"), hw)
    assert fp8["compute_s"]["dense_gemm"] < bf16["compute_s"]["dense_gemm"]
    assert fp8["compute_s"]["attention"] == bf16["compute_s"]["attention"]
    full = steptime.step_time(m, base._replace(ep_overlap="full"), hw)
    assert full["exposed_comm_s"] < bf16["exposed_comm_s"]
    assert sum(full["compute_s"].values()) == pytest.approx(sum(bf16["compute_s"].values()))  # terms as modelled
    assert full["step_s"] > sum(bf16["compute_s"].values()) / (1 - steptime.FULL_OVERLAP_SM_SHARE) * 0.99


def test_gradient_accumulation_repeats_the_fsdp_and_dp_collectives_only():
    """Micro-batches: the same tokens and FLOPs per step; each one gathers the weights and reduces its gradients
    again. The GB200 recipe's layout with gradient_accumulation_steps=2 read from its config."""
    m, hw = _model(), steptime.HARDWARE["gb200"]
    cfg = load_config([GB200_RECIPE, "gradient_accumulation_steps=2"])
    mesh = {"data": 1, "fsdp": 16, "expert": 8, "tensor": 1}
    two = steptime.layout_from_config(cfg, mesh, 128)
    assert two.grad_accumulation == 2
    one, two = steptime.step_time(m, two._replace(grad_accumulation=1), hw), steptime.step_time(m, two, hw)
    assert one["compute_s"] == two["compute_s"] and one["comm_s"]["ep"] == two["comm_s"]["ep"]
    assert two["comm_s"]["fsdp"] == pytest.approx(2 * one["comm_s"]["fsdp"])


def test_the_model_is_within_its_goal_of_every_published_run():
    """plan --validate: each published figure (sources in validation.VALIDATION) within 25% of the model, with
    constants set once for all of them."""
    rows = validation.validate()
    assert len(rows) >= 3
    misses = {r["run"]: f"{r['error']:+.0%}" for r in rows if abs(r["error"]) > validation.VALIDATION_GOAL}
    assert not misses, misses
    assert all(r["source"] and r["bound"] in ("compute", "ep", "fsdp", "dp", "tp", "offload") for r in rows)


def test_a_mesh_filled_in_from_minus_one_is_read_from_the_mesh():
    """base.yml's ici_fsdp_parallelism=-1 (fill the devices): the layout comes from the mesh, and every term
    of a small step is positive."""
    cfg = load_config(["configs/base.yml", "gpu_profile=h100-sxm", "num_devices=8"])
    st = plan.plan(cfg)["step_time"]
    assert st is not None and all(v > 0 for v in st["compute_s"].values()), st
    assert st["comm_s"]["fsdp"] > 0 and st["step_s"] > 0, st


def test_the_gb200_recipe_reads_its_layout_and_prints_its_step(capsys):
    cfg = load_config([GB200_RECIPE])
    layout = steptime.layout_from_config(cfg, {"data": 1, "fsdp": 32, "expert": 4, "tensor": 1}, 128)
    # fsdp 16 x expert 4 in each NVL72 rack, fsdp 2 across the two: 16 (and 64) members of each group per rack
    assert (layout.ep, layout.fsdp, layout.fsdp_dense, layout.fsdp_local, layout.fsdp_dense_local) == (
        4, 32, 128, 16, 64)
    assert layout.grouped_precision == "fp8" and layout.attention_kernel == "flash" and layout.dispatch_per == "node"
    assert 0 < layout.recompute < 1  # custom remat: the attention products and the remat-named matmuls
    assert plan_command.main([GB200_RECIPE]) == 0
    table = capsys.readouterr().out
    assert "step time (MaxText.planning.steptime on gb200; collectives from the formulas)" in table and "tokens/s/GPU" in table, table
    assert plan_command.main(["--validate"]) == 0
    assert "DeepSeek-V3 pre-training, 2048 H800" in capsys.readouterr().out


RECIPES = sorted(glob.glob(os.path.join("configs", "gpu", "*.yml")))
_MODELLED = re.compile(r"^# Modelled: step ([\d.]+) s, (\d+) tokens/s/GPU, (\d+) TFLOP/s/GPU, MFU (\d+)%, "
                       r"bound by (\w+)", re.M)
_PUBLISHED = re.compile(r"^# Published[^:]*: .*(\d+ tokens/s/GPU|\d+ TFLOP/s/GPU)", re.M)


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_each_recipe_header_states_what_the_model_says(recipe):
    """The `# Modelled:` line of each recipe's header is what MaxText.plan prints for it today (rounded as
    written), so a change to the model or the recipe that moves it fails here until the header follows; a
    `# Published` line beside it gives the published figure for that hardware."""
    with open(recipe) as f:
        found = _MODELLED.search(f.read())
    assert found, f"{recipe}: no '# Modelled: step ... s, ... tokens/s/GPU, ... TFLOP/s/GPU, MFU ...%, bound by ...' line"
    st = plan.plan(load_config([recipe]))["step_time"]
    assert (f"{st['step_s']:.2f}", f"{st['tokens_per_s_per_gpu']:.0f}", f"{st['tflops_per_gpu']:.0f}",
            f"{st['mfu'] * 100:.0f}", st["bound"]) == found.groups(), st
    with open(recipe) as f:
        assert _PUBLISHED.search(f.read()), f"{recipe}: no '# Published ...' line with the figure for its hardware"


def test_search_ranks_fitting_layouts_and_the_recipes_are_near_the_best(caplog):
    """--search on the H100 recipe: every candidate listed fits, they are ranked by modelled tokens/s/GPU, the
    best's overrides plan to exactly its numbers, and the shipped layout is the search's best mesh and batch
    (the earlier FSDP-32-across-nodes layout modelled 3.5x slower). The recipe's config warnings are logged once,
    not once per layout tried (they were: 1141 lines for the 32K recipe)."""
    from MaxText.planning.layout_search import search

    recipe = os.path.join("configs", "gpu", "deepseek3-671b-h100-256.yml")
    with caplog.at_level(logging.WARNING):
        result = search([recipe], top=3)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: left at")]
    assert len(said) == 1 and result["tried"] > 100, (len(said), result["tried"])
    best = result["best"]
    assert result["fitting"] >= 3 and len(best) == 3
    assert [c["tokens_per_s_per_gpu"] for c in best] == sorted((c["tokens_per_s_per_gpu"] for c in best),
                                                               reverse=True)
    replanned = plan.plan(load_config([recipe, *best[0]["overrides"]]))
    assert replanned["verdict"] == "fits"
    assert replanned["step_time"]["tokens_per_s_per_gpu"] == pytest.approx(best[0]["tokens_per_s_per_gpu"])
    shipped = plan.plan(load_config([recipe]))["step_time"]["tokens_per_s_per_gpu"]
    assert shipped >= 0.9 * best[0]["tokens_per_s_per_gpu"], (shipped, best[0])
    # the recipe's bounded buffer drops its overflow; the search also ranks the layouts that drop nothing (a fallback)
    assert best[0]["drops"] and result["best_dropping_nothing"]
    for c in result["best_dropping_nothing"]:
        assert not c["drops"] and any(o.startswith("moe_dropless_fallback=") for o in c["overrides"]), c
        again = plan.plan(load_config([recipe, *c["overrides"]]))
        assert again["verdict"] == "fits" and again["step_time"]["tokens_per_s_per_gpu"] == pytest.approx(
            c["tokens_per_s_per_gpu"])
    old = plan.plan(load_config([recipe, "dcn_fsdp_parallelism=32", "dcn_expert_parallelism=1",
                                 "per_device_batch_size=1", "use_batch_split_schedule=false"]))["step_time"]
    assert shipped > 3 * old["tokens_per_s_per_gpu"] and old["bound"] == "fsdp", old


def test_plan_times_a_lowerings_collectives_group_by_group(tmp_path, capsys):
    """--collectives=FILE (MaxText.lowering's JSON): the GB200 recipe's FSDP volumes written as the module would
    group them time as the formula does; doubling them moves the fsdp term accordingly; a file that is not a
    lowering's JSON is one error line."""
    import json

    cfg = load_config([GB200_RECIPE])
    mesh_shape = plan.sharding.mesh_shape(cfg, cfg.num_devices)
    layout = steptime.layout_from_config(cfg, mesh_shape, cfg.num_devices)
    model = steptime.Model.from_config(cfg, params.parameter_counts(cfg).total)
    axes = {"dense": (["fsdp", "expert"], layout.fsdp_dense), "expert": (["fsdp"], layout.fsdp)}
    by_group = [{"kind": kind, "axes": axes[part][0], "group": axes[part][1], "count": 1, "bytes": b}
                for part, kinds in steptime.fsdp_collective_bytes(model, layout).items() for kind, b in kinds.items()]
    path = tmp_path / "lowering.json"
    path.write_text("lowering log line\n" + json.dumps({"ok": True, "collectives": {"by_group": by_group}}))
    assert plan_command.main([GB200_RECIPE, f"--collectives={path}", "--json"]) == 0
    module = json.loads(capsys.readouterr().out)["step_time"]
    formula = plan.plan(cfg)["step_time"]
    assert module["collectives_from"] == "compiled module" and formula["collectives_from"] == "formulas"
    assert module["comm_s"]["fsdp"] == pytest.approx(formula["comm_s"]["fsdp"], rel=1e-9)
    assert module["comm_s"]["ep"] == formula["comm_s"]["ep"]  # the EP exchange stays the routing's
    doubled = steptime.module_comm(cfg, mesh_shape, [g | {"bytes": 2 * g["bytes"]} for g in by_group],
                                   steptime.HARDWARE["gb200"])
    assert doubled["fsdp"] == pytest.approx(2 * formula["comm_s"]["fsdp"], rel=1e-9)

    path.write_text('{"ok": false, "error": "boom"}')
    assert plan_command.main([GB200_RECIPE, f"--collectives={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --collectives={path}: not the JSON") and "\n" not in err, err


@pytest.mark.parametrize("quantization", ["te_fp8_currentscaling", "te_nvfp4"])
def test_quantization_speeds_up_the_quantizable_dense_gemms_only(quantization):
    """`quantization` puts the attention projections, dense MLPs and shared experts in FP8 (NVFP4), not the router,
    the output heads or MTP's projection: the dense GEMM term drops by exactly that share's FP8 (FP4) speed-up, the
    rest of the step is modelled as before."""
    cfg = load_config(["configs/gpu/deepseek3-671b-gb200-128.yml", "quantization=none"])
    quantized = load_config(["configs/gpu/deepseek3-671b-gb200-128.yml", f"quantization={quantization}"])
    m = steptime.Model.from_config(cfg, 671e9)
    assert 0.5 * m.dense_gemm_flops < m.quantizable_gemm_flops < m.dense_gemm_flops, m
    before, after = (plan.plan(c)["step_time"] for c in (cfg, quantized))
    hw = steptime.HARDWARE["gb200"]
    rate = (hw.fp4_tflops * steptime.FP4_GEMM_FACTOR if quantization == "te_nvfp4"
            else hw.fp8_tflops * steptime.FP8_GEMM_FACTOR)
    speedup = 1 - hw.bf16_tflops / rate
    saved = before["compute_s"]["dense_gemm"] - after["compute_s"]["dense_gemm"]
    assert saved == pytest.approx(before["compute_s"]["dense_gemm"] * m.quantizable_gemm_flops / m.dense_gemm_flops
                                  * speedup, rel=1e-6)
    for term in ("grouped_gemm", "attention", "memory_bound"):
        assert after["compute_s"][term] == pytest.approx(before["compute_s"][term]), term


def test_tes_fused_block_is_charged_its_recomputed_forward():
    """te_moe_block=true: TE's block names none of its outputs, so under a remat policy that keeps the expert GEMMs
    (custom, on NVIDIA's GB200 recipe) its whole forward runs again in the backward: the model charges those GEMMs
    again (and, through the recompute fraction, the dispatch); with remat_policy=none nothing is recomputed either
    way."""
    recipe = "configs/gpu/deepseek3-671b-nvidia-gb200-128.yml"
    composed, block = (load_config([recipe, *extra]) for extra in ([], ["te_moe_block=true"]))
    assert composed.remat_policy == "custom" and composed.moe_mlpwi_0 != "remat", "the recipe keeps its expert GEMMs"
    assert steptime.recompute_fraction(block) > steptime.recompute_fraction(composed)
    times = [plan.plan(c)["step_time"] for c in (composed, block)]
    assert times[1]["compute_s"]["grouped_gemm"] > times[0]["compute_s"]["grouped_gemm"]
    none = [load_config([recipe, "remat_policy=none", *extra]) for extra in ([], ["te_moe_block=true"])]
    assert steptime.recompute_fraction(none[0]) == steptime.recompute_fraction(none[1]) == 0.0


def test_nccl_ep_crosses_the_nics_once_per_destination_node():
    """TE's NCCL EP runs NCCL EP's high-throughput algorithm: RDMA between nodes, NVLink inside one (NVIDIA/nccl
    contrib/nccl_ep/README.md). Across nodes (the H100 recipe: EP 32 over 4 nodes of 8) a token's rows on the NICs
    are its expected destination nodes, not GPUs; inside one NVLink domain (the GB200 recipe: EP 8 in an NVL72)
    there is no node hop and each destination GPU gets its row, as when a row went to each GPU."""
    for recipe, shape, hardware, nodes in (
            ("configs/gpu/deepseek3-671b-h100-256.yml", {"data": 1, "fsdp": 8, "expert": 32, "tensor": 1}, "h100", 4),
            (GB200_RECIPE, {"data": 1, "fsdp": 16, "expert": 8, "tensor": 1}, "gb200", None)):
        cfg = load_config([recipe])
        m, hw = steptime.Model.from_config(cfg, 671e9), steptime.HARDWARE[hardware]
        lay = steptime.layout_from_config(cfg, shape, 256 if hardware == "h100" else 128)
        assert lay.dispatch_per == "node", recipe
        ep = {per: steptime.comm_time(m, lay._replace(dispatch_per=per), hw, 4096.0)["ep"] for per in ("node", "gpu")}
        if nodes is None:
            assert ep["node"] == pytest.approx(ep["gpu"]), (recipe, ep)
        else:
            ratio = (steptime.expected_destinations(m.experts, m.top_k, nodes, m.groups, m.keep)
                     / steptime.expected_destinations(m.experts, m.top_k, 32, m.groups, m.keep))
            assert ep["node"] == pytest.approx(ep["gpu"] * ratio) and ratio < 0.7, (recipe, ep, ratio)


def test_context_parallelism_gathers_each_layers_keys_and_repeats_mlas_up_projection():
    """Context parallelism over c GPUs: each layer gathers its keys and values (MLA: the latent) over the group in the
    forward, all-reduces their cotangents in the backward: at the same tokens per GPU, c = 4 moves 3x the bytes of
    c = 2 ((c - 1) / c of a c times longer buffer), besides MLA's up-projection weight gradient, summed over every GPU
    whatever c; inside an NVLink domain the NIC does not matter, across domains it does. MLA expands the whole
    gathered sequence into keys and values on each of the c GPUs (DeepSeek-V3: 2 x 512 x 128 x (128 + 128) FLOPs a
    token in each of its 61 layers and the MTP depth); GQA computes nothing twice."""
    m, hw = _model(), steptime.HARDWARE["gb200"]
    base = steptime.Layout(128, 32768, 64, ep=8, fsdp=16, fsdp_dense=128)
    one, two, four = (steptime.step_time(m, base._replace(cp=c), hw) for c in (1, 2, 4))
    weight = 62 * 2 * steptime._ring(512 * 128 * 256 * 2, 128, 0, hw)  # [512, 128 heads, 128 + 128] bf16 a layer
    assert "cp" not in one["comm_s"] and two["comm_s"]["cp"] > weight > 0
    assert four["comm_s"]["cp"] - weight == pytest.approx(3 * (two["comm_s"]["cp"] - weight))
    assert steptime.step_time(m, base._replace(cp=2), hw._replace(nic_gbps=1))["comm_s"]["cp"] == two["comm_s"]["cp"]
    across = steptime.step_time(m, base._replace(cp=2, cp_local=1), hw)  # each member in its own NVLink domain
    assert across["comm_s"]["cp"] - weight == pytest.approx((two["comm_s"]["cp"] - weight) * hw.nvlink_gbps
                                                            / hw.nic_gbps)
    tokens, passes = 64 * 32768 / 128, 3  # no recomputation in this layout: forward once, backward twice a forward
    extra = tokens * passes * 2 * 512 * 128 * 256 * 62 / (hw.bf16_tflops * 1e12 * steptime.GEMM_EFFICIENCY)
    assert two["compute_s"]["dense_gemm"] - one["compute_s"]["dense_gemm"] == pytest.approx(extra)
    assert four["compute_s"]["attention"] == one["compute_s"]["attention"]  # the same share of the work per GPU
    # causal load balance: 0.7 of the score work, for the queries and outputs sent to and fro (128 x 320 numbers a
    # token each way: forward, backward)
    balanced = steptime.step_time(m, base._replace(cp=2, attention_share=0.7, cp_balanced=True), hw)
    assert balanced["compute_s"]["attention"] == pytest.approx(0.7 * two["compute_s"]["attention"])
    sent = 62 * 2 * tokens * 128 * 320 * 2 / (hw.nvlink_gbps * 1e9 * steptime.COLLECTIVE_EFFICIENCY)
    assert balanced["comm_s"]["cp"] - two["comm_s"]["cp"] == pytest.approx(sent)
    qwen = steptime.Model.from_config(load_config(["configs/base.yml", "model_name=qwen3-30b-a3b"]), 30.5e9)
    assert qwen.kv_gather_width == 2 * 4 * 128 and qwen.kv_up_flops == 0
    assert (m.kv_gather_width, m.q_out_width) == (512 + 64, 128 * (128 + 64 + 128))
    gqa = [steptime.step_time(qwen, base._replace(cp=c, attention_kernel="xla"), hw) for c in (1, 2)]
    assert gqa[0]["compute_s"] == gqa[1]["compute_s"] and gqa[1]["comm_s"]["cp"] > 0


def test_context_parallel_cudnn_charges_its_rolled_copies():
    """Context parallelism with cuDNN's attention (attention_cudnn_cp) copies the whole sequence's keys and values
    (MLA: expanded, 128 x 320 numbers a token) rolled for each block's first document: read and written in the
    forward, where recomputed, and twice in the backward (the keys again, the gradients back), for each of a
    device's two blocks load-balanced: memory-bound time the XLA path and one device do not pay."""
    m, hw = _model(), steptime.HARDWARE["gb200"]
    tokens = 64 * 32768 / 128
    base = steptime.Layout(128, 32768, 64, ep=8, fsdp=16, fsdp_dense=128, cp=4, cp_balanced=True)
    time = {kernel: steptime.step_time(m, base._replace(attention_kernel=kernel), hw)["compute_s"]["memory_bound"]
            for kernel in ("flash", "xla")}
    one = steptime.step_time(m, base._replace(cp=1, cp_balanced=False), hw)["compute_s"]["memory_bound"]
    copies = 62 * 2 * 3 * 2 * tokens * 4 * 128 * 320 * 2 / (hw.hbm_tbps * 1e12 * steptime.HBM_EFFICIENCY)
    assert time["flash"] - time["xla"] == pytest.approx(copies) and time["xla"] == pytest.approx(one)
    unbalanced = steptime.step_time(m, base._replace(cp_balanced=False), hw)["compute_s"]["memory_bound"]
    assert unbalanced - time["xla"] == pytest.approx(copies / 2)


def test_a_context_parallel_layout_is_read_and_its_gathers_timed_from_the_module():
    """A config with context parallelism: the weights are FSDP-sharded over fsdp x context (the rules put `context`
    beside `fsdp`), the context group inside the NVLink domain; a compiled module's all-gather over `context` alone
    is the cp term."""
    cfg = load_config([GB200_RECIPE, "ici_fsdp_parallelism=4", "ici_context_parallelism=2"])
    mesh = {"data": 1, "fsdp": 8, "context": 2, "expert": 8, "tensor": 1}
    layout = steptime.layout_from_config(cfg, mesh, 128)
    assert (layout.cp, layout.cp_local, layout.fsdp, layout.fsdp_dense, layout.fsdp_local) == (2, 0, 16, 128, 8)
    hw = steptime.HARDWARE["gb200"]
    group = {"kind": "all-gather", "axes": ["context"], "group": 2, "count": 1, "bytes": 1e9}
    assert steptime.module_comm(cfg, mesh, [group], hw) == {"cp": pytest.approx(steptime._ring(1e9, 2, 0, hw))}
    weights = group | {"axes": ["fsdp", "context"], "group": 16}
    assert set(steptime.module_comm(cfg, mesh, [weights], hw)) == {"fsdp"}
    # the 32K recipe's attention, load-balanced or not: chunked, each GPU computes prefix_share of the unbalanced
    # work; cuDNN's, the causal average balanced, the last piece's 2 - 1/4 of it unbalanced
    from MaxText.layers.attention import prefix_share

    recipe = os.path.join("configs", "gpu", "deepseek3-671b-32k-gb200-128.yml")
    mesh = {"data": 1, "fsdp": 8, "context": 4, "expert": 4, "tensor": 1}
    layouts = {(a, b): steptime.layout_from_config(load_config([recipe, f"attention={a}", "attention_chunk_size=512",
                                                                f"context_parallel_load_balance={b}"]), mesh, 128)
               for a in ("chunked", "cudnn_flash") for b in ("true", "false")}
    shares = {key: lay.attention_share for key, lay in layouts.items()}
    assert shares == {("chunked", "true"): prefix_share(32768, 4, 512), ("chunked", "false"): 1.0,
                      ("cudnn_flash", "true"): 1.0, ("cudnn_flash", "false"): 1.75}, shares
    assert 0.6 < shares[("chunked", "true")] < 0.75
    assert [key for key, lay in layouts.items() if lay.cp_balanced] == [("chunked", "true"), ("cudnn_flash", "true")]


def test_search_splits_long_sequences_over_the_context_axis():
    """--search on the 32K recipe: one 32K sequence per GPU does not fit the recipe's GPUs, so every layout it ranks
    splits the sequences over the context axis; the shipped layout is within 2% of the best. Below 16K no context
    split is tried."""
    from MaxText.planning.layout_search import meshes, search

    recipe = os.path.join("configs", "gpu", "deepseek3-671b-32k-gb200-128.yml")
    whole = plan.plan(load_config([recipe, "ici_context_parallelism=1", "ici_fsdp_parallelism=4",
                                   "per_device_batch_size=1"]))
    assert whole["verdict"] == "does not fit", plan.format_table(whole)
    result = search([recipe], top=3)
    assert result["fitting"] >= 3 and all(c["mesh"]["context"] > 1 for c in result["best"]), result["best"]
    shipped = plan.plan(load_config([recipe]))
    assert shipped["verdict"] == "fits"
    assert shipped["step_time"]["tokens_per_s_per_gpu"] >= 0.98 * result["best"][0]["tokens_per_s_per_gpu"]
    assert {m[0]["context"] for m in meshes(128, 64, 4, 256)} == {1}
    assert {m[0]["context"] for m in meshes(128, 64, 4, 256, (1, 2, 4, 8))} == {1, 2, 4, 8}

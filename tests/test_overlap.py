"""The dependency test of issue 32: a sliced MoE's exchange never waits for another slice's GEMMs, in the module
XLA partitions (MaxText.planning.overlap), and the step-time model credits only what that allows."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from MaxText.config.load import load_config
from MaxText.planning import overlap, steptime
from MaxText.planning.plan import format_table, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "configs", "gpu", "deepseek3-671b-h100-256.yml")
NVIDIA_GB200 = os.path.join(ROOT, "configs", "gpu", "deepseek3-671b-nvidia-gb200-128.yml")


def _module(slice1_input: str, control: str = "") -> str:
    """Two slices in one shard_map body: each dispatches (all-to-all), runs its experts (a loop whose body holds a
    dot) and combines (all-to-all); slice 1's dispatch reads `slice1_input`."""
    return f"""HloModule m

%experts_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {{
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8]{{1,0}} get-tuple-element(%p), index=1
  %w = f32[8,8]{{1,0}} constant({{...}})
  %d = f32[4,8]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %d)
}}

%body (a: f32[4,8], b: f32[4,8]) -> (f32[4,8], f32[4,8]) {{
  %a = f32[4,8]{{1,0}} parameter(0)
  %b = f32[4,8]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %send0 = f32[4,8]{{1,0}} all-to-all(%a), dimensions={{0}}, metadata={{op_name="moe_chunk0/a2a"}}
  %in0 = (s32[], f32[4,8]) tuple(%zero, %send0)
  %loop0 = (s32[], f32[4,8]) while(%in0), condition=%cond, body=%experts_body, metadata={{op_name="moe_chunk0/gmm"}}
  %y0 = f32[4,8]{{1,0}} get-tuple-element(%loop0), index=1, metadata={{op_name="moe_chunk0/gmm"}}
  %back0 = f32[4,8]{{1,0}} all-to-all(%y0), dimensions={{0}}, metadata={{op_name="moe_chunk0/a2a"}}
  %send1 = f32[4,8]{{1,0}} all-to-all({slice1_input}), dimensions={{0}}{control}, metadata={{op_name="moe_chunk1/a2a"}}
  %in1 = (s32[], f32[4,8]) tuple(%zero, %send1)
  %loop1 = (s32[], f32[4,8]) while(%in1), condition=%cond, body=%experts_body, metadata={{op_name="moe_chunk1/gmm"}}
  %y1 = f32[4,8]{{1,0}} get-tuple-element(%loop1), index=1
  %back1 = f32[4,8]{{1,0}} custom-call(%y1), custom_call_target="te_ep_combine", metadata={{op_name="moe_chunk1/c"}}
  ROOT %out = (f32[4,8], f32[4,8]) tuple(%back0, %back1)
}}
"""


def _by_name(found):
    return {e.name: e for e in found}


def test_independent_slices_can_hide_each_others_exchanges():
    found = _by_name(overlap.exchanges(_module("%b")))
    assert set(found) == {"send0", "back0", "send1", "back1"}
    assert all(not e.waits_for for e in found.values())
    # send0 can run under slice 1's loop, as can back0; slice 1's under slice 0's
    under = [found[n].under for n in ("send0", "back0", "send1", "back1")]
    assert under == [("moe_chunk1",), ("moe_chunk1",), ("moe_chunk0",), ("moe_chunk0",)]
    assert found["back1"].op == "te_ep_combine" and overlap.summarize(list(found.values()))["hideable"] == 4


@pytest.mark.parametrize("slice1_input,control", [("%y0", ""), ("%b", ", control-predecessors={%loop0}")],
                         ids=["data", "control"])
def test_an_exchange_that_waits_for_another_slices_gemms_is_found(slice1_input, control):
    """Slice 1's dispatch reading slice 0's expert output (or ordered after it): it waits for slice 0's GEMM loop
    (a while whose body holds the dot), and so does slice 1's combine; slice 0's dispatch now feeds slice 1's
    loop (nothing to run under), while slice 0's combine, which slice 1 does not wait for, still can."""
    found = _by_name(overlap.exchanges(_module(slice1_input, control)))
    assert found["send1"].waits_for == ("moe_chunk0",) and found["back1"].waits_for == ("moe_chunk0",)
    assert found["send0"].under == () and found["back0"].under == ("moe_chunk1",)
    summary = overlap.summarize(list(found.values()))
    assert len(summary["waiting"]) == 2, summary
    assert summary["waiting"][0] == "body/send1 (all-to-all, moe_chunk1): waits for moe_chunk0", summary


_LOWER = ("import json, sys; from MaxText.planning import lowering; from MaxText.config.load import load_config; "
          "import os; os.environ['JAX_PLATFORMS'] = 'cpu'; "
          "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=' + sys.argv[1]; "
          "print(json.dumps([lowering.lower_step(load_config(a), d, backend_optimization=False) "
          "for d, a in json.loads(sys.argv[2])]))")
TINY = ["configs/base.yml", "model_name=deepseek3-tiny", "num_devices=8", "dtype=bfloat16", "dataset_type=synthetic",
        "max_target_length=64", "per_device_batch_size=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=4",
        "gpu_profile=h100-sxm"]
SPLIT = ["use_batch_split_schedule=true", "batch_split_factor=2"]
# The tiny DeepSeek (MLA, a shared expert, MTP) two ways: ragged with its tokens in 2 chunks and its batch in 2 parts
# (te_dropless's reference path slices as ragged does: the same ExpertParallel dispatcher around another local
# sort); TE's kernels (NCCL EP) with the batch in 2 parts.
TINY_CASES = {"ragged": ["moe_impl=ragged", "num_moe_token_chunks=2", *SPLIT],
              "NCCL EP": ["moe_impl=te_dropless", *SPLIT]}
OTHER = {"moe_chunk0": "moe_chunk1", "moe_chunk1": "moe_chunk0", "batch_split0": "batch_split1",
         "batch_split1": "batch_split0"}


def _lower(num_devices: int, jobs: list) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", _LOWER, str(num_devices), json.dumps(jobs)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dumps(tmp_path_factory):
    """TINY_CASES on fsdp 2 x expert 4, lowered with XLA's dump of the partitioned step kept (TE traced at SM 90
    for NCCL EP, which stops at TE's first kernel after partitioning): {case: (lowering JSON, module text)}."""
    dirs = {case: str(tmp_path_factory.mktemp(case.replace(" ", "_"))) for case in TINY_CASES}
    results = _lower(8, [(dirs[case], TINY + extra) for case, extra in TINY_CASES.items()])
    out = {}
    for case, result in zip(TINY_CASES, results):
        assert result["ok"], result
        (path,) = glob.glob(os.path.join(dirs[case], "*after_spmd-partitioning*.txt"))
        with open(path) as f:
            out[case] = (result, f.read())
    return out


@pytest.mark.parametrize("case", TINY_CASES)
def test_no_slice_of_the_partitioned_step_waits_for_another_slices_compute(tiny_dumps, case):
    """Forward and backward: no exchange of one slice waits for another slice's compute. Chunks: inside the MoE's
    shard_map bodies, wherever a body holds both chunks' GEMMs, each exchange can run under the other chunk's (a
    body of exchanges alone, the dispatch recomputed for the backward, has none). Parts: in the layer, each part's
    MoE (its shard_map call, or NCCL EP's calls) can run under the other part's compute, every one of them."""
    result, module = tiny_dumps[case]
    found = overlap.exchanges(module)
    assert result["overlap"] == overlap.summarize(found)
    assert not [e for e in found if e.waits_for], overlap.summarize(found)["waiting"]
    chunks = [e for e in found if e.slice.startswith("moe_chunk")]
    parts = [e for e in found if e.slice.startswith("batch_split")]
    assert bool(chunks) == ("num_moe_token_chunks=2" in TINY_CASES[case])
    assert bool(parts) == ("batch_split_factor=2" in TINY_CASES[case])
    with_gemms = {e.computation for e in chunks if e.under}
    assert not chunks or len(with_gemms) >= 2, found  # the forward and the backward at least
    for e in chunks:
        if e.computation in with_gemms:
            assert e.under == (OTHER[e.slice],), e
    for e in parts:
        assert e.under == (OTHER[e.slice],), e
    # XLA:CPU has no ragged all-to-all (ep.py emulates it); NCCL EP's five calls inside TE's partitioned ops
    ops = {e.op for e in found}
    if case == "NCCL EP":
        assert ops == {f"call(te_ep_{op}_ffi)" for op in ("prepare", "dispatch", "combine", "dispatch_bwd",
                                                        "combine_bwd")}, ops
    else:
        assert ops <= {"all-to-all", "call(all-to-all)"} and "all-to-all" in ops, ops


def test_a_dependency_added_to_the_real_module_is_found(tiny_dumps):
    """The detector on XLA's own text: an all-to-all of slice 1 made to follow a GEMM of slice 0 in the same body
    (a control edge, as a scheduler's ordering would) waits for slice 0."""
    _, module = tiny_dumps["ragged"]
    found = overlap.exchanges(module)
    body = next(e.computation for e in found if e.under and e.slice.startswith("moe_chunk"))
    text = module[module.index(f"%{body} "):]
    text = text[:text.index("\n}\n")]
    gemm = re.search(r"%([\w.\-]+) = [^\n]*? dot\([^\n]*op_name=\"moe_chunk0/", text).group(1)
    # a slice 1 exchange listed after that dot (HLO's text lists an instruction after all it depends on)
    target = next(e.name for e in found if e.computation == body and e.slice == "moe_chunk1"
                  and text.index(f"%{e.name} = ") > text.index(f"%{gemm} = "))
    line = re.search(rf"\n(\s*%{re.escape(target)} = [^\n]*?)(, metadata=)", module)
    mutated = module[:line.start(2)] + f", control-predecessors={{%{gemm}}}" + module[line.start(2):]
    changed = _by_name(overlap.exchanges(mutated))[target]
    assert changed.waits_for == ("moe_chunk0",) and _by_name(found)[target].waits_for == ()


def test_the_full_scale_recipe_split_hides_its_exchanges(tmp_path):
    """Full scale: NVIDIA's GB200 recipe (128 simulated devices) on its own path, TE's kernels with NCCL EP, with the
    batch in 2 parts. In XLA's partitioned module no exchange waits for the other part's compute and each has the
    other part's to run under. (A ragged recipe compiles whole on CPU, minutes at full scale: by hand, as the
    README says.)"""
    (result,) = _lower(load_config([NVIDIA_GB200]).num_devices, [(str(tmp_path), [NVIDIA_GB200, *SPLIT])])
    assert result["ok"], result
    summary = result["overlap"]
    assert summary["slices"] == ["batch_split0", "batch_split1"] and summary["waiting"] == []
    assert summary["hideable"] == summary["exchanges"] > 0


def test_the_model_credits_what_the_slices_allow():
    """ep_hidden_fraction: nothing without slices or under NCCL EP (one call a layer); with c slices (c - 1) / c of
    the exchange beside the expert GEMMs, as far as those GEMMs last; the recipes' own numbers unchanged."""
    argv = [H100, "moe_impl=ragged", "te_gmm_quantization=none", "quantization=none", "use_batch_split_schedule=false"]
    steps = {c: plan(load_config([*argv, f"num_moe_token_chunks={c}"]))["step_time"] for c in (1, 2, 4)}
    fractions = {c: st["overlap"]["ep"] for c, st in steps.items()}
    ep, gemm = steps[1]["comm_s"]["ep"], steps[1]["compute_s"]["grouped_gemm"]
    assert fractions[1] == 0.0 and gemm < ep  # this layout's exchange outlasts its expert GEMMs
    for c in (2, 4):
        assert fractions[c] == pytest.approx(gemm * (c - 1) / c / ep, rel=1e-9)
    assert steps[2]["exposed_comm_s"] < steps[1]["exposed_comm_s"]
    nccl_ep = plan(load_config([H100, "use_batch_split_schedule=false"]))["step_time"]
    assert nccl_ep["overlap"]["ep"] == 0.0
    lay = steptime.Layout(8, 4096, 8, ep=8, ep_slices=2, recompute=1.0)
    t = {"grouped_gemm": 10.0, "dense_gemm": 5.0, "attention": 5.0}
    # a recomputed dispatch (2 of the 10 bytes a row) sits beside no GEMM
    assert steptime.ep_hidden_fraction(lay, t, 1.0) == pytest.approx(8 / 10 / 2)
    # the batch in parts: the whole exchange beside all the layer's compute; 2 parts x 2 chunks, 3 of 4 slices
    assert steptime.ep_hidden_fraction(lay._replace(batch_parts=2), t, 1.0) == pytest.approx(3 / 4)
    assert steptime.ep_hidden_fraction(lay._replace(batch_parts=2), t, 40.0) == pytest.approx(20 * 3 / 4 / 40)


def test_the_model_credits_a_split_batch_on_nccl_ep_and_charges_its_sms():
    """NVIDIA's GB200 recipe (NCCL EP, one call a layer) with the batch in 2 parts: half its exchange under the other
    part's compute (which outlasts it), the compute slowed by the SMs the exchange holds meanwhile; the step faster."""
    whole, split = (plan(load_config([NVIDIA_GB200, *extra]))["step_time"] for extra in ([], SPLIT))
    ep = whole["comm_s"]["ep"]
    assert whole["overlap"]["ep"] == 0.0 and split["overlap"]["ep"] == pytest.approx(0.5)
    share = steptime.FULL_OVERLAP_SM_SHARE
    slowed = sum(split["compute_s"].values()) + ep * 0.5 * share / (1 - share)
    assert split["exposed_comm_s"] < whole["exposed_comm_s"] and split["step_s"] < whole["step_s"]
    assert split["step_s"] == pytest.approx(slowed + split["exposed_comm_s"], rel=1e-9)
    assert whole["ep_overlap"].startswith("none") and split["ep_overlap"].startswith("2 batch parts")
    p = plan(load_config([NVIDIA_GB200, *SPLIT]))
    assert "    hidden: 2 batch parts: a part's exchange under" in format_table(p), format_table(p)

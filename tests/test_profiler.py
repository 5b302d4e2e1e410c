"""profiler=xplane writes a trace of the configured steps; the MoE stages are named scopes in every impl."""

import glob
import os

import jax
import pytest

from MaxText.layers.moe import te_kernels
from MaxText.layers.moe.block import MOE_FFNS
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.router import route
from tests.tiny import tiny_config, train_records

STAGES = ("moe_route", "moe_dispatch", "moe_grouped_gemm", "moe_combine")


@pytest.mark.parametrize("impl", ["dense", "ragged", "te_dropless"])
def test_moe_stages_are_named_scopes(impl):
    """Each stage's ops carry its scope name in the compiled program's metadata (what a trace shows)."""
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference")
    keys = jax.random.split(jax.random.key(0), 5)
    t, d, f, e = 32, cfg.base_emb_dim, cfg.base_moe_mlp_dim, cfg.num_experts
    x = jax.random.normal(keys[0], (t, d))
    gate = jax.random.normal(keys[1], (d, e))
    w = ExpertWeights(*(jax.random.normal(k, s) for k, s in zip(keys[2:], ((e, d, f), (e, d, f), (e, f, d)))))

    def layer(x, gate, w):
        routing = route(x, gate, None, cfg, topk=te_kernels.kernels(cfg).topk)
        return MOE_FFNS[impl](x, routing, w, cfg)[0]

    text = jax.jit(layer).lower(x, gate, w).as_text(debug_info=True)
    missing = [s for s in STAGES if s not in text]
    assert not missing, f"{impl}: no ops under {missing}"


def test_xplane_trace_of_the_configured_steps(tmp_path):
    lines = []
    cfg = tiny_config(f"base_output_directory={tmp_path}", "run_name=prof", "steps=4", "profiler=xplane",
                      "skip_first_n_steps_for_profiler=1", "profiler_steps=2", "enable_checkpointing=false")
    train_records(cfg, log=lines.append)
    traces = glob.glob(str(tmp_path / "prof" / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
    assert any("profile of steps 2..3 written" in line for line in lines), lines
    with open(traces[0], "rb") as fh:
        trace = fh.read()
    missing = [s for s in ("train_step", *STAGES) if s.encode() not in trace]
    assert not missing, f"the trace names no {missing}"

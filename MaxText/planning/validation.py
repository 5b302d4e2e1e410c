"""The step-time model (MaxText.planning.steptime) against published DeepSeek-V3 training runs:
`python -m MaxText.plan --validate [--json]` prints each published tokens/s/GPU beside the model's, the error and
the bound; the model's constants were set once, for all of them together."""

from __future__ import annotations

from typing import NamedTuple

from MaxText.config.load import load_config
from MaxText.planning.params import parameter_counts
from MaxText.planning.steptime import HARDWARE, Layout, Model, step_time


class Published(NamedTuple):
    """A published training run: its layout, measured tokens/s/GPU, and where it was published."""
    name: str
    hardware: str
    layout: Layout
    tokens_per_s_per_gpu: float
    overrides: tuple        # onto configs/models/deepseek3-671b.yml
    source: str


_BALANCED = ("n_routing_groups=null", "topk_routing_group=null")  # Megatron's forced load balancing: uniform top-k
VALIDATION = (
    Published("DeepSeek-V3 pre-training, 2048 H800", "h800",
              Layout(2048, 4096, 15360, pp=16, ep=64, micro_batch=1, gemm_precision="fp8", dispatch_bytes=1.0,
                     dispatch_per="node", ep_overlap="full", dualpipe=True, recompute=0.05), 1543.0, (),
              "arXiv 2412.19437 (DeepSeek-V3 report): 180K H800 GPU-hours per trillion tokens = 1543 tokens/s/GPU; "
              "PP16, EP64 over 8 nodes, ZeRO-1 DP; FP8; batch 15360 x 4K; DualPipe; recompute of RMSNorm and MLA "
              "up-projections"),
    Published("Megatron-Bridge 26.02, 256 GB200, MXFP8", "gb200",
              Layout(256, 4096, 4096, pp=4, vp=4, ep=64, micro_batch=1, gemm_precision="fp8", ep_overlap="partial",
                     recompute=0.1), 3955.0, _BALANCED,
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (26.02): DeepSeekV3, GBS 4096, MBS 1, PP4, "
              "VP4, EP64, TP1, FP8-MX, 3955 tokens/s/GPU (1028 TFLOP/s)"),
    Published("Megatron-Bridge 26.02, 256 GB300, MXFP8", "gb300",
              Layout(256, 4096, 4096, pp=2, vp=8, ep=32, micro_batch=2, gemm_precision="fp8", ep_overlap="partial",
                     recompute=0.1), 4612.0, _BALANCED,
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (26.02): DeepSeekV3, GBS 4096, MBS 2, PP2, "
              "VP8, EP32, TP1, FP8-MX, 4612 tokens/s/GPU (1199 TFLOP/s)"),
    Published("Megatron-Bridge 25.09, 1024 H100", "h100",
              Layout(1024, 4096, 8192, tp=2, pp=8, vp=4, ep=64, micro_batch=1, gemm_precision="fp8",
                     dispatch_bytes=1.0, dispatch_per="node", ep_overlap="partial", recompute=0.1), 1297.0, _BALANCED,
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (25.09): DeepSeekV3 dropless, GBS 8192, MBS 1, "
              "TP2, PP8, VP4, EP64, 1297 tokens/s/GPU (338 TFLOP/s); precision not printed (FP8 taken: a footnote "
              "compares its block scaling); DeepEP's node-deduplicated FP8 dispatch across nodes assumed, not read"),
    Published("Megatron-Bridge 25.11, 256 GB300, BF16, no MTP", "gb300",
              Layout(256, 4096, 4096, pp=2, vp=4, ep=32, micro_batch=1, ep_overlap="partial", recompute=0.1),
              3848.0, _BALANCED + ("mtp_num_layers=0",),
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (25.11): DeepSeekV3 without MTP, BF16, GBS "
              "4096, PP2, VP4, EP32, TP1, GA32, 3848 tokens/s/GPU (961 TFLOP/s)"),
    Published("Megatron-Bridge 25.11, 256 GB200, BF16, no MTP", "gb200",
              Layout(256, 4096, 4096, pp=4, vp=4, ep=64, micro_batch=1, ep_overlap="partial", recompute=0.1),
              3139.0, _BALANCED + ("mtp_num_layers=0",),
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (25.11): DeepSeekV3 without MTP, BF16, GBS "
              "4096, PP4, VP4, EP64, TP1, GA64, 3139 tokens/s/GPU (782 TFLOP/s)"),
)
VALIDATION_GOAL = 0.25


def validate() -> list[dict]:
    """Each published run beside the model: measured and modelled tokens/s/GPU, the error, the bound."""
    rows = []
    for run in VALIDATION:
        cfg = load_config(["configs/base.yml", "model_name=deepseek3-671b", "override_model_config=true",
                           f"max_target_length={run.layout.seq}",
                           *run.overrides])
        got = step_time(Model.from_config(cfg, parameter_counts(cfg).total), run.layout, HARDWARE[run.hardware])
        rows.append({"run": run.name, "published": run.tokens_per_s_per_gpu, "model": got["tokens_per_s_per_gpu"],
                     "error": got["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu - 1, "bound": got["bound"],
                     "step_s": got["step_s"], "terms_s": got["compute_s"] | got["comm_s"], "source": run.source})
    return rows

#!/usr/bin/env bash
# The GPU validation kit in one command (see MaxText/benchmarks/gpu_check.py):
#
#   bash scripts/gpu_check.sh [--ep N] [--json gpu_check.json]
#        [--parts kernels,ep,impls_agree,batch_split,grouped_gemm,moe_layer,attention]
#
# On one NVIDIA GPU, in this order, each part in isolation (a part that raises is recorded and the next runs):
#   kernels       the `gpu` tests of tests/test_te_dropless.py: TE's fused router, TE's grouped GEMM forward and
#                 backward (bf16, fp32, FP8 current scaling on SM 9.x+, MXFP8 on SM 10.x) with a padded tail, and
#                 TE's token permutation, against pure-JAX / float64 references; and of tests/test_attention_cudnn.py:
#                 attention=cudnn_flash (cuDNN's fused attention) against dot_product, bf16, GQA and MLA, and
#                 under context parallelism (tests/test_attention_cudnn_cp.py: a query block merged from two calls)
#   ep            with --ep N only: te_dropless with NCCL EP on N >= 2 GPUs of this machine, one process each
#                 (scripts/launch.sh --local N running MaxText.benchmarks.ep_check), forward and gradients against
#                 te_kernels=reference and the float32 per-expert loop; its table goes to <json>.ep.json; then
#                 TE's fused MoE block (te_moe_block=true, ep_check --block) against the float32 loop beside the
#                 composed path (<json>.ep_block.json); then bounded buffers with moe_dropless_fallback=layer
#                 over XLA's exchange, two hops (ep_check --fallback, <json>.ep_fallback.json); then the step of a
#                 4-layer model on NCCL EP timed with the batch whole and in 2 parts (use_batch_split_schedule: the
#                 exchange overlap the model credits; MaxText.benchmarks.train_step, <json>.ep_split.json)
#   impls_agree   a tiny DeepSeek-style model trained a few steps with te_dropless and with ragged: same losses
#   batch_split   a 4-layer MoE model trained the same steps with the batch whole and in 2 parts
#                 (use_batch_split_schedule): same losses, and the step time each (what the split costs on one GPU)
#   grouped_gemm  TFLOP/s of TE's grouped GEMM and ragged_dot at DeepSeek-V3 expert shapes (timing only)
#   moe_layer     MoE layer forward+backward TFLOP/s per moe_impl (timing only)
#   attention     forward+backward time per `attention` impl at DeepSeek-V3's MLA layer shape (timing only)
# It prints one table, writes the JSON (gpu_check.json) and exits 1 if a correctness part (kernels, ep,
# impls_agree, batch_split) failed or any part raised.
#
# Inside the container (docker/) everything is installed. Elsewhere it uses the Python that has a CUDA jax
# (PYTHON=..., else python3) and installs nothing: when one of this project's pure-Python pins
# (requirements.txt without jax/jaxlib/TF/TE) is missing it names them and how to bring them, with network or
# without, and stops (exit 2). Without Transformer Engine the TE checks (TE's kernel tests, ep) are reported as
# skipped (with the reason) and te_dropless runs its reference kernels; pip install "transformer-engine[jax]>=2.20"
# (or use the container, or carry TE as the GPU kit does) to check them too.
# Budget: under 8 minutes on one H100/H200; --ep adds four times N processes' start-up and three
# compiles each (not yet measured; the part is stopped after 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi > /dev/null 2>&1; then
    echo "error: no NVIDIA GPU here (nvidia-smi failed); the kit checks the GPU path. To try the kit itself:" \
         "$PYTHON -m MaxText.benchmarks.gpu_check --smoke" >&2
    exit 2
fi
if ! "$PYTHON" -c "import jax; assert jax.default_backend() == 'gpu'" > /dev/null 2>&1; then
    echo "error: $PYTHON has no CUDA jax; use the container (docker/), or a CUDA jax this code runs on:" \
         "jax 0.11.2 (NVIDIA's JAX image, the GPU kit) or 0.12.x (pip install 'jax[cuda13]==0.12.0.1')" >&2
    exit 2
fi
# Nothing is installed here: a GPU machine often has no network, and a pip that cannot reach an index only
# hangs or fails half-way. What is missing is named, with the two ways to bring it.
# What the kit imports and this Python lacks (scripts/kit_missing.py: requirements.txt's lines for them). Never TE's
# Python alone (pinned for CPU tracing): a GPU uses the TE it has, with its compiled extension (the kit reports
# its checks skipped without it).
missing="$("$PYTHON" scripts/kit_missing.py)"
if [ -n "$missing" ]; then
    missing="$(echo "$missing" | tr '\n' ' ' | sed 's/ $//')"
    echo "error: $PYTHON lacks $missing; with network: $PYTHON -m pip install $missing;" \
         "without: pip download $missing -d wheels/ (Python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')) on a" \
         "machine with network, carry wheels/ here, $PYTHON -m pip install --no-index --find-links wheels/ $missing" >&2
    exit 2
fi
exec timeout 1200 "$PYTHON" -m MaxText.benchmarks.gpu_check "$@"

"""Kernels of `moe_impl=te_dropless`: Transformer Engine's, or pure-JAX references with the same semantics.

This is the only module that imports Transformer Engine (TE 2.20 JAX API, see notes/te.md), and only
when `te_kernels` asks for it. Importing TE without an NVIDIA driver raises OSError (not ImportError),
so every exception of the import is caught and turned into one line naming what is missing.

A kernel set has three parts, each with one signature for both backends:
    topk(logits_TE, bias_E, cfg) -> (weights_TK, experts_TK)        fused router
    grouped_gemm(x_RD, w_EDF, group_sizes_E, quantization) -> y_RF   grouped GEMM (custom VJP)
    te: None for the references (expert parallelism through moe/ep.py), else TE's modules, whose NCCL EP
        ep_dispatch / ep_combine te_dropless uses (bootstrapped once per process by bootstrap_ep)

Status: the TE side is written against TE 2.20's API as read from its source (notes/te.md) and is checked
against the references only by the `gpu`-marked tests; NCCL EP needs one process per GPU and >= 2 GPUs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config import ConfigError
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts

ALIGN = 128  # rows per expert group: TE's MXFP8 grouped GEMM and NCCL EP both need 128-row groups


class TEUnavailable(RuntimeError):
    """Transformer Engine cannot be used here; the message says why."""


class Kernels(NamedTuple):
    name: str
    topk: object
    grouped_gemm: object
    te: object  # the imported TE namespace (None for the references)


@functools.cache
def _import_te():
    """TE's JAX modules, or TEUnavailable with the reason."""
    try:
        import transformer_engine.jax  # noqa: F401  (raises OSError without a driver)
        from transformer_engine.common import recipe
        from transformer_engine.jax import dense, ep, moe, router
        from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode, noop_quantizer_set
        from transformer_engine.jax.sharding import MeshResource, global_shard_guard
    except Exception as e:  # noqa: BLE001 - OSError, ImportError, RuntimeError all mean "not usable"
        raise TEUnavailable(f"Transformer Engine could not be imported ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'no message'})") from None
    return dict(recipe=recipe, dense=dense, ep=ep, moe=moe, router=router, QuantizerFactory=QuantizerFactory,
                ScalingMode=ScalingMode, noop_quantizer_set=noop_quantizer_set, MeshResource=MeshResource,
                global_shard_guard=global_shard_guard)


def _compute_capability() -> float | None:
    """SM version of the first GPU (9.0 Hopper, 10.0 Blackwell), None without an NVIDIA GPU."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return None
    return float(getattr(gpus[0], "compute_capability", "0") or 0)


def check_available(cfg) -> None:
    """Start-up check for moe_impl=te_dropless: one ConfigError line naming the missing piece and the ways out."""
    if cfg.moe_impl != "te_dropless" or cfg.te_kernels == "reference":
        return
    alternatives = "use te_kernels=reference (same semantics in pure JAX) or moe_impl=ragged"
    capability = _compute_capability()
    if capability is None:
        raise ConfigError(f"moe_impl=te_dropless with te_kernels=auto needs an NVIDIA GPU and this machine has none "
                          f"({jax.default_backend()} backend); {alternatives}")
    try:
        _import_te()
    except TEUnavailable as e:
        raise ConfigError(f"moe_impl=te_dropless: {e}; run in the NVIDIA JAX container (docker/), or {alternatives}")
    if cfg.te_gmm_quantization == "mxfp8" and capability < 10.0:
        raise ConfigError(f"te_gmm_quantization=mxfp8 needs a Blackwell GPU (SM 10.x), this one is SM {capability}; "
                          "use te_gmm_quantization=fp8_current (Hopper) or none")


# ------------------------------------------------------------------------------------------- references


def reference_topk(logits_TE, bias_E, cfg):
    """The router semantics of TE's fused_topk_with_score_function, in pure JAX (router.select_experts)."""
    return select_experts(expert_scores(logits_TE, cfg.routed_score_func), bias_E, cfg)


def reference_grouped_gemm(x_RD, w_EDF, group_sizes_E, quantization: str):
    """grouped_dense in pure JAX. FP8/MXFP8 are TE-only: the reference computes in the input dtype."""
    del quantization
    return grouped_matmul(x_RD, w_EDF, group_sizes_E)


REFERENCE = Kernels("reference", reference_topk, reference_grouped_gemm, None)


# ------------------------------------------------------------------------------------------- Transformer Engine


def _te_topk(te, logits_TE, bias_E, cfg):
    """Experts chosen by TE's fused router; weights from our scores of those experts.

    TE selects on softmax probabilities only with use_pre_softmax=True (else on logits, which differs
    under group-limited routing) and renormalises sigmoid weights whenever K > 1 (our norm_topk_prob).
    Taking only the choice from TE and the weights from router.expert_scores keeps one semantics for
    both kernel sets; the choice is the expensive, fused part.
    """
    _, routing_map_TE = te["router"].fused_topk_with_score_function(
        logits_TE.astype(jnp.float32), topk=cfg.num_experts_per_tok, use_pre_softmax=True,
        num_groups=cfg.n_routing_groups or -1, group_topk=cfg.topk_routing_group or -1, scaling_factor=1.0,
        score_function=cfg.routed_score_func, expert_bias=bias_E)
    experts_TK = jnp.argsort(routing_map_TE, axis=-1)[..., -cfg.num_experts_per_tok:].astype(jnp.int32)
    weights_TK = jnp.take_along_axis(expert_scores(logits_TE, cfg.routed_score_func), experts_TK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, experts_TK


def _te_quantizer_set(te, quantization: str, num_groups: int):
    if quantization == "none":
        return te["noop_quantizer_set"]
    mode = {"mxfp8": te["ScalingMode"].MXFP8_1D_SCALING,
            "fp8_current": te["ScalingMode"].CURRENT_TENSOR_SCALING}[quantization]
    return te["QuantizerFactory"].create_set(scaling_mode=mode, fwd_dtype=jnp.float8_e4m3fn,
                                             bwd_dtype=jnp.float8_e4m3fn if quantization == "mxfp8"
                                             else jnp.float8_e5m2, is_2x2x=True, n_groups=num_groups)


def _te_grouped_gemm(te, x_RD, w_EDF, group_sizes_E, quantization: str):
    # TE's V1 grouped GEMM checks sum(group_sizes) == rows: give the zero padding at the tail to the last group.
    sizes = group_sizes_E.at[-1].add(x_RD.shape[0] - jnp.sum(group_sizes_E))
    return te["dense"].grouped_dense(x_RD, w_EDF, sizes.astype(jnp.int32), contracting_dims=((1,), (1,)),
                                     quantizer_set=_te_quantizer_set(te, quantization, w_EDF.shape[0]))


def ep_recv_capacity(te, cfg, tokens_per_rank: int, ep_size: int) -> int:
    """Rows each rank can receive: TE's dropless worst case, or the balanced load x ragged_buffer_factor."""
    return te["moe"].get_moe_recv_capacity_per_rank(
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        max_tokens_per_rank=tokens_per_rank, ep_size=ep_size, recv_capacity_factor=cfg.ragged_buffer_factor,
        alignment=ALIGN)


def mesh_context(cfg):
    """TE's mesh-axis naming (global_shard_guard) while TE kernels run; a no-op for the references. NCCL EP
    reads its group and the token slabs from these axes at bootstrap and when tracing dispatch/combine."""
    if cfg.moe_impl != "te_dropless" or cfg.te_kernels != "auto":
        return contextlib.nullcontext()
    te = _import_te()
    return te["global_shard_guard"](te["MeshResource"](dp_resource="data", fsdp_resource="fsdp",
                                                       ep_resource="expert", tp_resource="tensor"))


def bootstrap_ep(cfg, mesh, global_batch: int) -> None:
    """NCCL EP's one-time set-up (eager, before the first compile, inside the mesh and mesh_context) for
    global_batch sequences a step, split over every mesh axis but `tensor`; a no-op unless te_dropless runs
    TE kernels with expert parallelism. Overflow beyond a smaller ragged_buffer_factor is dropped by NCCL EP
    and reported through total_recv_tokens; the dropless default never overflows."""
    ep_size = mesh.shape.get("expert", 1)
    if cfg.moe_impl != "te_dropless" or cfg.te_kernels != "auto" or ep_size == 1:
        return
    if jax.local_device_count() != 1:
        raise ConfigError("moe_impl=te_dropless with expert parallelism uses NCCL EP, which needs one process per "
                          f"GPU (this process has {jax.local_device_count()}); launch with scripts/launch.sh "
                          "or use te_kernels=reference")
    tokens_per_rank = global_batch * cfg.max_target_length // (mesh.devices.size // mesh.shape["tensor"])
    te = _import_te()
    te["ep"].ep_bootstrap(jax.process_count(), jax.process_index(), cfg.num_experts, tokens_per_rank,
                          ep_recv_capacity(te, cfg, tokens_per_rank, ep_size), cfg.base_emb_dim,
                          max_token_dtype=jnp.bfloat16, drop_on_overflow=cfg.ragged_buffer_factor is not None)


def kernels(cfg) -> Kernels:
    """The kernel set cfg.te_kernels selects (check_available has run at start-up for `auto`)."""
    if cfg.te_kernels == "reference":
        return REFERENCE
    te = _import_te()
    return Kernels("transformer_engine", functools.partial(_te_topk, te),
                   functools.partial(_te_grouped_gemm, te), te)

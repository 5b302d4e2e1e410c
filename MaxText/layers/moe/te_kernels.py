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
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config.errors import ConfigError
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts
from MaxText.parallel.checks import nccl_ep_used

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
    check_quantization(cfg, capability)


def check_quantization(cfg, capability: float) -> None:
    """te_gmm_quantization against the GPU generation: MXFP8 needs Blackwell; tensor-scaled FP8 grouped GEMMs
    are Hopper's, and TE 2.20.2's grouped_dense cannot differentiate them on Blackwell (its backward wants
    a transposed copy that TE's Blackwell quantizers do not make, or returns a wrongly shaped weight
    gradient when forced to make one: both traced with te_trace at SM 100)."""
    if cfg.moe_impl != "te_dropless":
        return
    if cfg.te_gmm_quantization == "mxfp8" and capability < 10.0:
        raise ConfigError(f"te_gmm_quantization=mxfp8 needs a Blackwell GPU (SM 10.x), this one is SM {capability}; "
                          "use te_gmm_quantization=fp8_current (Hopper) or none")
    if cfg.te_gmm_quantization == "fp8_current" and capability >= 10.0:
        raise ConfigError(f"te_gmm_quantization=fp8_current is for Hopper (SM 9.x); on this SM {capability} GPU "
                          "use te_gmm_quantization=mxfp8 (Blackwell's FP8 grouped GEMM) or none")


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


def te_router_mode(cfg) -> tuple[bool, bool]:
    """(use_pre_softmax, fused weights) for TE's fused router under this config's routing semantics.

    TE's sigmoid weights are renormalised exactly when K > 1; its softmax either takes the top-k of the
    softmax over all experts (use_pre_softmax=True: our norm_topk_prob=false) or the softmax over the top-k
    logits (our norm_topk_prob=true, the same choice unless group-limited routing scores groups on logits
    rather than on probabilities). Where TE's weights mean ours, TE's fused forward and backward give them;
    elsewhere TE makes the choice (on probabilities) and the weights are our scores of the chosen experts.
    """
    k, grouped = cfg.num_experts_per_tok, cfg.n_routing_groups is not None
    if cfg.routed_score_func == "sigmoid":
        return False, cfg.norm_topk_prob == (k > 1)
    return not cfg.norm_topk_prob or grouped, not (cfg.norm_topk_prob and grouped)


def _te_topk(te, logits_TE, bias_E, cfg):
    """The chosen experts (and, where te_router_mode allows, their weights) from TE's fused router."""
    k = cfg.num_experts_per_tok
    pre_softmax, fused = te_router_mode(cfg)
    probs_TE, routing_map_TE = te["router"].fused_topk_with_score_function(
        logits_TE.astype(jnp.float32), topk=k, use_pre_softmax=pre_softmax,
        num_groups=cfg.n_routing_groups or -1, group_topk=cfg.topk_routing_group or -1,
        scaling_factor=float(cfg.routed_scaling_factor) if fused else 1.0, score_function=cfg.routed_score_func,
        expert_bias=bias_E)
    # TE's own conversion (moe.py): argsort puts the K chosen (True) experts last.
    experts_TK = jnp.argsort(routing_map_TE, axis=-1)[..., -k:].astype(jnp.int32)
    if fused:
        return jnp.take_along_axis(probs_TE, experts_TK, axis=-1), experts_TK
    weights_TK = jnp.take_along_axis(expert_scores(logits_TE, cfg.routed_score_func), experts_TK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, experts_TK


def _te_quantizer_set(te, quantization: str, num_groups: int):
    if quantization == "none":
        return te["noop_quantizer_set"]
    mode = {"mxfp8": te["ScalingMode"].MXFP8_1D_SCALING,
            "fp8_current": te["ScalingMode"].CURRENT_TENSOR_SCALING}[quantization]
    # is_2x2x left to TE: a transposed second copy only where the GEMM needs one (MXFP8; tensor-scaled FP8 on
    # Hopper, whose FP8 GEMM takes only the NT layout). On Blackwell TE 2.20.2's grouped_dense cannot
    # differentiate tensor-scaled FP8 either way (check_available refuses fp8_current there).
    return te["QuantizerFactory"].create_set(scaling_mode=mode, fwd_dtype=jnp.float8_e4m3fn,
                                             bwd_dtype=jnp.float8_e4m3fn if quantization == "mxfp8"
                                             else jnp.float8_e5m2, n_groups=num_groups)


def _te_grouped_gemm(te, x_RD, w_EDF, group_sizes_E, quantization: str):
    # TE's V1 grouped GEMM checks sum(group_sizes) == rows: the tail past the groups goes to the last group as
    # slack, zeroed on the way in and out so that, as in the reference, those rows read 0 and get no gradient.
    rows = x_RD.shape[0]
    valid_R1 = (jnp.arange(rows) < jnp.sum(group_sizes_E))[:, None]
    sizes = group_sizes_E.at[-1].add(rows - jnp.sum(group_sizes_E))
    y_RF = te["dense"].grouped_dense(jnp.where(valid_R1, x_RD, jnp.zeros((), x_RD.dtype)), w_EDF,
                                     sizes.astype(jnp.int32), contracting_dims=((1,), (1,)),
                                     quantizer_set=_te_quantizer_set(te, quantization, w_EDF.shape[0]))
    return jnp.where(valid_R1, y_RF, jnp.zeros((), y_RF.dtype))


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


def tokens_per_ep_rank(mesh_shape, tokens: int) -> int:
    """Tokens one NCCL EP rank sends of a step's `tokens`: the batch splits over every mesh axis but `tensor`."""
    return tokens // math.prod(size for axis, size in mesh_shape.items() if axis != "tensor")


def ep_bootstrap_args(cfg, mesh_shape, global_batch: int) -> dict:
    """Keyword arguments of TE's ep_bootstrap for this config and mesh (world_size: the mesh's devices)."""
    te = _import_te()
    tokens = tokens_per_ep_rank(mesh_shape, global_batch * cfg.max_target_length)
    return dict(world_size=math.prod(mesh_shape.values()), num_experts=cfg.num_experts,
                max_tokens_per_rank=tokens,
                recv_capacity_per_rank=ep_recv_capacity(te, cfg, tokens, mesh_shape["expert"]),
                hidden_dim=cfg.base_emb_dim, max_token_dtype=jnp.bfloat16,
                drop_on_overflow=cfg.ragged_buffer_factor is not None)


def bootstrap_ep(cfg, mesh, global_batch: int) -> None:
    """NCCL EP's one-time set-up (eager, before the first compile, inside jax.set_mesh and mesh_context);
    a no-op unless te_dropless runs TE kernels with expert parallelism. Overflow beyond a smaller
    ragged_buffer_factor is dropped by NCCL EP and reported through total_recv_tokens; the dropless
    default never overflows."""
    shape = dict(mesh.shape)  # checked for NCCL EP when the mesh was made (parallel/checks.py)
    if not nccl_ep_used(cfg, shape):
        return
    if jax.local_device_count() != 1:
        raise ConfigError("moe_impl=te_dropless with expert parallelism uses NCCL EP, which needs one process per "
                          f"GPU (this process has {jax.local_device_count()}); launch with scripts/launch.sh "
                          "or use te_kernels=reference")
    te = _import_te()
    # TE's self-hosted NCCL path forms the EP groups from mesh.devices (ep.py _ep_domain_for_rank), which only
    # the legacy `with mesh:` context exposes: under jax.set_mesh alone TE sees an AbstractMesh and raises.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            te["ep"].ep_bootstrap(rank=jax.process_index(), **ep_bootstrap_args(cfg, shape, global_batch))


@contextlib.contextmanager
def moe_runtime(cfg, mesh, global_batch: int):
    """The one context a train loop enters around everything it builds and runs: check_available (one line
    when TE kernels cannot run here), jax.set_mesh(mesh), TE's mesh-axis names (mesh_context) and NCCL EP's
    bootstrap (bootstrap_ep). For the pure-JAX impls it is jax.set_mesh alone."""
    check_available(cfg)
    with jax.set_mesh(mesh), mesh_context(cfg):
        bootstrap_ep(cfg, mesh, global_batch)
        yield


def kernels(cfg) -> Kernels:
    """The kernel set cfg.te_kernels selects (check_available has run at start-up for `auto`)."""
    if cfg.te_kernels == "reference":
        return REFERENCE
    te = _import_te()
    return Kernels("transformer_engine", functools.partial(_te_topk, te),
                   functools.partial(_te_grouped_gemm, te), te)

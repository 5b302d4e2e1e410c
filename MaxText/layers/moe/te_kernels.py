"""Kernel sets: the router's top-k and the grouped GEMM, Transformer Engine's or pure JAX with the same semantics.

A kernel set has one signature for both:
    topk(logits_TE, bias_E, cfg) -> (weights_TK, experts_TK)          fused router
    grouped_gemm(x_RD, w_EDF, group_sizes_E, quantization) -> y_RF     grouped GEMM (custom VJP)
    te: None for the references, else TE's modules (te_runtime.import_te): with expert parallelism the
        dispatcher is then TE's NCCL EP (nccl_ep.py)
    check_vma: False for TE, whose custom VJPs carry no shard_map manual-axis types (JAX's check rejects them)

moe_impl=ragged always runs REFERENCE; te_dropless runs the set te_kernels names.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config.checks import te_router_mode
from MaxText.layers.moe.gmm import grouped_matmul
from MaxText.layers.moe.router import expert_scores, select_experts
from MaxText.layers.moe.te_runtime import import_te


class Kernels(NamedTuple):
    name: str
    topk: Callable
    grouped_gemm: Callable
    te: object = None  # the imported TE namespace (None for the references)
    check_vma: bool = True

    def gemm(self, quantization: str) -> Callable:
        """The grouped GEMM as experts.expert_ffn calls it: gemm(x_RD, w_EDF, group_sizes_E). The references
        compute every quantization in the input dtype: theirs is gmm.grouped_matmul itself."""
        if self.grouped_gemm is reference_grouped_gemm:
            return grouped_matmul
        return functools.partial(self.grouped_gemm, quantization=quantization)


# ------------------------------------------------------------------------------------------- references


def reference_topk(logits_TE, bias_E, cfg):
    """The router semantics of TE's fused_topk_with_score_function, in pure JAX (router.select_experts)."""
    return select_experts(expert_scores(logits_TE, cfg.routed_score_func), bias_E, cfg)


def reference_grouped_gemm(x_RD, w_EDF, group_sizes_E, quantization: str):
    """grouped_dense in pure JAX. FP8/MXFP8 are TE-only: the reference computes in the input dtype."""
    del quantization
    return grouped_matmul(x_RD, w_EDF, group_sizes_E)


REFERENCE = Kernels("reference", reference_topk, reference_grouped_gemm)


# ------------------------------------------------------------------------------------------- Transformer Engine


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


def quantizer_set(te, quantization: str, num_groups: int, sr_key=None):
    """TE's quantizer set for a GEMM (num_groups 1) or a grouped GEMM: none, fp8_current (E4M3 forward, E5M2
    gradients) or mxfp8 (E4M3 both ways, 32-element blocks); for a dense GEMM also nvfp4 / nvfp4_no_rht
    (nvfp4_quantizer_set; sr_key seeds its stochastic rounding)."""
    if quantization == "none":
        return te["noop_quantizer_set"]
    if quantization in NVFP4:
        if num_groups != 1:
            raise ValueError("TE 2.20's grouped GEMM takes no NVFP4 operands")
        return nvfp4_quantizer_set(te, rht=quantization == "nvfp4", sr_key=sr_key)
    mode = {"mxfp8": te["ScalingMode"].MXFP8_1D_SCALING,
            "fp8_current": te["ScalingMode"].CURRENT_TENSOR_SCALING}[quantization]
    # is_2x2x left to TE: a transposed second copy only where the GEMM needs one (MXFP8; tensor-scaled FP8 on
    # Hopper, whose FP8 GEMM takes only the NT layout; on Blackwell TE quantizes tensor-scaled FP8 rowwise only).
    return te["QuantizerFactory"].create_set(scaling_mode=mode, fwd_dtype=jnp.float8_e4m3fn,
                                             bwd_dtype=jnp.float8_e4m3fn if quantization == "mxfp8"
                                             else jnp.float8_e5m2, n_groups=num_groups)


NVFP4 = ("nvfp4", "nvfp4_no_rht")


def nvfp4_quantizer_set(te, *, rht: bool, sr_key=None):
    """TE's NVFP4BlockScaling recipe as its Flax modules build it (quantize/helper.py NVFP4ScalingQuantizeConfig),
    outside Flax: activations and gradients in 16-element blocks, weights in 16 x 16 tiles; with `rht` the
    weight gradient's two operands (the colwise copies of x and of the output gradient) through the random
    Hadamard transform; the output gradient rounded stochastically from a per-device state drawn from sr_key
    (a fixed key when None: the same rounding on every call)."""
    from transformer_engine.jax.quantize.metadata import QuantizeMeta, QuantizeMetaSet  # noqa: PLC0415
    from transformer_engine.jax.sharding import get_all_mesh_axes, get_num_devices_in_mesh  # noqa: PLC0415

    key = jax.random.key(0) if sr_key is None else sr_key
    mesh = jax.sharding.get_abstract_mesh()
    manual = not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)
    if manual:
        # inside shard_map (MLA's key/value expansion under context parallelism), where TE partitions nothing but
        # still wants a row per device: the rows drawn from this device's own key (its kernel reads the first)
        key = jax.random.fold_in(key, jax.lax.axis_index(mesh.axis_names))
    state = jax.random.bits(key, (get_num_devices_in_mesh(), 4), jnp.uint32)
    axes = get_all_mesh_axes()
    if axes and not mesh.empty and not manual:
        state = jax.lax.with_sharding_constraint(state, jax.sharding.PartitionSpec(axes, None))
    meta = QuantizeMetaSet(x=QuantizeMeta(use_rht=rht), kernel=QuantizeMeta(),
                           grad=QuantizeMeta(use_rht=rht, stochastic_rounding_rng_state=state))
    return te["QuantizerFactory"].create_set(fp8_recipe=te["recipe"].NVFP4BlockScaling(disable_rht=not rht),
                                             quantize_meta_set=meta)


def _te_grouped_gemm(te, x_RD, w_EDF, group_sizes_E, quantization: str):
    # TE's V1 grouped GEMM checks sum(group_sizes) == rows: the tail past the groups goes to the last group as
    # slack, zeroed on the way in and out so that, as in the reference, those rows read 0 and get no gradient.
    rows = x_RD.shape[0]
    valid_R1 = (jnp.arange(rows) < jnp.sum(group_sizes_E))[:, None]
    sizes_E = group_sizes_E
    if quantization == "fp8_current":
        # TE 2.20's V1 grouped GEMM (gemm.cpp GroupedGemmFFI) moves its tensor-scale pointers only past
        # non-empty GEMMs while the weights carry one scale per expert: after an empty expert every later
        # expert's GEMM reads an earlier expert's weight scale (planning/te_layouts.py). An empty group holds
        # no rows, so putting the empty experts last (weights gathered to match) moves no token row and leaves
        # every non-empty expert's scale where the GEMM reads it.
        order_E = jnp.argsort(group_sizes_E == 0, stable=True)
        sizes_E, w_EDF = group_sizes_E[order_E], w_EDF[order_E]
    sizes = sizes_E.at[-1].add(rows - jnp.sum(sizes_E))
    y_RF = te["dense"].grouped_dense(jnp.where(valid_R1, x_RD, jnp.zeros((), x_RD.dtype)), w_EDF,
                                     sizes.astype(jnp.int32), contracting_dims=((1,), (1,)),
                                     quantizer_set=quantizer_set(te, quantization, w_EDF.shape[0]))
    return jnp.where(valid_R1, y_RF, jnp.zeros((), y_RF.dtype))


def kernels(cfg) -> Kernels:
    """The kernel set of this config: te_kernels under te_dropless (te_runtime.check_available has run at
    start-up for `auto`), REFERENCE for every other moe_impl."""
    if cfg.moe_impl != "te_dropless" or cfg.te_kernels == "reference":
        return REFERENCE
    te = import_te()
    return Kernels("transformer_engine", functools.partial(_te_topk, te), functools.partial(_te_grouped_gemm, te),
                   te, check_vma=False)

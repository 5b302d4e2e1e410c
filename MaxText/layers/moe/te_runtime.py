"""The Transformer Engine runtime of moe_impl=te_dropless: whether TE can run here, NCCL EP's set-up, and TE's
mesh-axis names. The only module that imports Transformer Engine (TE 2.20 JAX API, see notes/te.md), and
only when `te_kernels=auto` asks for it. Importing TE without an NVIDIA driver raises OSError (not
ImportError), so every exception of the import is caught and turned into one line naming what is missing.

A run calls it once, at start-up:

    check_available(cfg)                        # one ConfigError line when TE kernels cannot run here
    with moe_runtime(cfg, mesh, global_batch):  # jax.set_mesh, TE's axis names, NCCL EP's bootstrap
        ...build and run...

Status: written against TE 2.20's API as read from its source (notes/te.md), traced on CPU by te_trace and
checked against the references only by the `gpu`-marked tests; NCCL EP needs one process per GPU, >= 2 GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from MaxText.config.errors import ConfigError
from MaxText.config.load import batch_parts
from MaxText.layers.moe.dispatch import ALIGN
from MaxText.parallel.checks import nccl_ep_used


class TEUnavailable(RuntimeError):
    """Transformer Engine cannot be used here; the message says why."""


@functools.cache
def import_te():
    """TE's JAX modules by name, or TEUnavailable with the reason."""
    try:
        import transformer_engine.jax  # noqa: F401  (raises OSError without a driver)
        from transformer_engine.common import recipe
        from transformer_engine.jax import dense, ep, moe, router
        from transformer_engine.jax.cpp_extensions.ep import get_ep_config
        from transformer_engine.jax.quantize import QuantizerFactory, QuantizerSet, ScalingMode, noop_quantizer_set
        from transformer_engine.jax.sharding import MeshResource, global_shard_guard
    except Exception as e:  # noqa: BLE001 - OSError, ImportError, RuntimeError all mean "not usable"
        raise TEUnavailable(f"Transformer Engine could not be imported ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'no message'})") from None
    return dict(recipe=recipe, dense=dense, ep=ep, moe=moe, router=router, QuantizerFactory=QuantizerFactory,
                QuantizerSet=QuantizerSet,
                ScalingMode=ScalingMode, noop_quantizer_set=noop_quantizer_set, MeshResource=MeshResource,
                global_shard_guard=global_shard_guard, ep_config=get_ep_config)


def _compute_capability() -> float | None:
    """SM version of the first GPU (9.0 Hopper, 10.0 Blackwell), None without an NVIDIA GPU."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return None
    return float(getattr(gpus[0], "compute_capability", "0") or 0)


def uses_te(cfg) -> str | None:
    """What in this config runs Transformer Engine's kernels (for its error lines), or None."""
    if cfg.moe_impl == "te_dropless" and cfg.te_kernels == "auto":
        return ("te_moe_block=true (TE's fused MoE block)" if cfg.te_moe_block
                else "moe_impl=te_dropless with te_kernels=auto")
    if cfg.quantization != "none":
        return f"quantization={cfg.quantization}"
    return None


def check_available(cfg) -> None:
    """Start-up check for TE's kernels (te_dropless, `quantization`): one ConfigError line naming the missing piece
    and the ways out."""
    user = uses_te(cfg)
    if user is None:
        return
    if user.startswith("te_moe_block"):
        alternatives = ("use te_moe_block=false with te_kernels=reference (the composed path's semantics in pure JAX) "
                        "or moe_impl=ragged")
    elif user.startswith("moe_impl"):
        alternatives = "use te_kernels=reference (same semantics in pure JAX) or moe_impl=ragged"
    else:
        alternatives = "use quantization=none (bf16 GEMMs, any platform)"
    capability = _compute_capability()
    if capability is None:
        raise ConfigError(f"{user} needs an NVIDIA GPU and this machine has none ({jax.default_backend()} "
                          f"backend); {alternatives}")
    try:
        import_te()
    except TEUnavailable as e:
        raise ConfigError(f"{user}: {e}; run in the NVIDIA JAX container (docker/), or {alternatives}")
    check_quantization(cfg, capability)


def check_quantization(cfg, capability: float) -> None:
    """te_gmm_quantization and quantization against the GPU generation: MXFP8 and NVFP4 need Blackwell, tensor-scaled
    FP8 SM 8.9 (Ada) or later. Tensor-scaled FP8 runs on Hopper and Blackwell alike: TE's Python quantizes and
    differentiates it at SM 9.0 and SM 10.0 (traced with te_trace, and executed against the references with
    te_reference; an SM 10 refusal here rested on a stale TE cache in the trace stand-in, notes/te.md §14.1)."""
    if cfg.moe_impl == "te_dropless" and cfg.te_gmm_quantization == "mxfp8" and capability < 10.0:
        raise ConfigError(f"te_gmm_quantization=mxfp8 needs a Blackwell GPU (SM 10.x), this one is SM {capability}; "
                          "use te_gmm_quantization=fp8_current (tensor-scaled FP8) or none")
    if cfg.quantization == "te_mxfp8" and capability < 10.0:
        raise ConfigError(f"quantization=te_mxfp8 needs a Blackwell GPU (SM 10.x), this one is SM {capability}; "
                          "use quantization=te_fp8_currentscaling (tensor-scaled FP8) or none")
    if cfg.quantization.startswith("te_nvfp4") and capability < 10.0:
        raise ConfigError(f"quantization={cfg.quantization} needs a Blackwell GPU (SM 10.0 or later: FP4 tensor "
                          f"cores), this one is SM {capability}; use quantization=te_fp8_currentscaling or none")
    if cfg.quantization == "te_fp8_currentscaling" and capability < 8.9:
        raise ConfigError(f"quantization=te_fp8_currentscaling needs FP8 GEMMs (SM 8.9 or later), this GPU is SM "
                          f"{capability}; use quantization=none")


def ep_recv_capacity(te, cfg, tokens_per_rank: int, ep_size: int) -> int:
    """Rows each rank can receive: TE's dropless worst case, or the balanced load x ragged_buffer_factor."""
    return te["moe"].get_moe_recv_capacity_per_rank(
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        max_tokens_per_rank=tokens_per_rank, ep_size=ep_size, recv_capacity_factor=cfg.ragged_buffer_factor,
        alignment=ALIGN)


def mesh_context(cfg):
    """TE's mesh-axis naming (global_shard_guard) while TE kernels run (uses_te); a no-op for the references. NCCL
    EP reads its group and the token slabs from these axes at bootstrap and when tracing dispatch/combine; TE's
    dense GEMM's partitioning rules read them too."""
    if uses_te(cfg) is None:
        return contextlib.nullcontext()
    te = import_te()
    return te["global_shard_guard"](te["MeshResource"](dp_resource="data", fsdp_resource="fsdp",
                                                       ep_resource="expert", tp_resource="tensor"))


def tokens_per_ep_rank(mesh_shape, tokens: int) -> int:
    """Tokens one NCCL EP rank sends of a step's `tokens`: the batch splits over every mesh axis but `tensor`."""
    return tokens // math.prod(size for axis, size in mesh_shape.items() if axis != "tensor")


def bootstrapped_capacity(te, cfg, tokens_per_rank: int, ep_size: int, hidden: int) -> int:
    """The receive capacity a dispatch must use: NCCL EP's, as bootstrapped. A step that needs more than the
    bootstrap provides (more tokens per rank; other experts, hidden size or EP group) would overrun NCCL EP's
    buffers on a GPU: refused in one line while tracing, before any TE op, as TE's own moe() refuses it."""
    try:
        boot = te["ep_config"]()
    except RuntimeError:
        raise ConfigError("moe_impl=te_dropless with expert parallelism: NCCL EP was not bootstrapped; build and run "
                          "the step inside te_runtime.moe_runtime(cfg, mesh, global_batch)") from None
    need = dict(num_experts=cfg.num_experts, hidden_dim=hidden, ep_size=ep_size)
    have = dict(num_experts=boot.num_experts, hidden_dim=boot.hidden_dim, ep_size=boot.ep_size)
    if need != have or tokens_per_rank > boot.max_tokens_per_rank:
        text = ", ".join(f"{k}={v}" for k, v in need.items())
        was = ", ".join(f"{k}={v}" for k, v in have.items())
        raise ConfigError(f"moe_impl=te_dropless: this step needs NCCL EP for {tokens_per_rank} tokens per rank, "
                          f"{text}, but it was bootstrapped for {boot.max_tokens_per_rank}, {was}; bootstrap with this "
                          "step's global batch and config (te_runtime.moe_runtime) or use te_kernels=reference")
    return boot.recv_capacity_per_rank


def ep_bootstrap_args(cfg, mesh_shape, global_batch: int) -> dict:
    """Keyword arguments of TE's ep_bootstrap for this config and mesh (world_size: the mesh's devices)."""
    te = import_te()
    # a split batch (use_batch_split_schedule) dispatches each part on its own: NCCL EP is sized for one part
    tokens = tokens_per_ep_rank(mesh_shape, global_batch * cfg.max_target_length) // batch_parts(cfg)
    return dict(world_size=math.prod(mesh_shape.values()), num_experts=cfg.num_experts,
                max_tokens_per_rank=tokens,
                recv_capacity_per_rank=ep_recv_capacity(te, cfg, tokens, mesh_shape["expert"]),
                hidden_dim=cfg.base_emb_dim, max_token_dtype=jnp.bfloat16,
                drop_on_overflow=cfg.ragged_buffer_factor is not None)


def moe_signature(bootstrap_args: dict, mesh_shape) -> tuple:
    """What TE's fused MoE block checks each call against (moe.py record_ep_bootstrap_signature_for_moe's arguments,
    in its order), from ep_bootstrap_args."""
    a = bootstrap_args
    return (a["num_experts"], a["max_tokens_per_rank"], a["recv_capacity_per_rank"], a["hidden_dim"],
            mesh_shape["expert"])


def bootstrap_ep(cfg, mesh, global_batch: int) -> None:
    """NCCL EP's one-time set-up (eager, before the first compile, inside jax.set_mesh and mesh_context);
    a no-op unless te_dropless runs TE kernels with expert parallelism or TE's fused block (te_moe_block).
    Overflow beyond a smaller ragged_buffer_factor is dropped by NCCL EP and reported through total_recv_tokens;
    the dropless default never overflows."""
    shape = dict(mesh.shape)  # checked for NCCL EP when the mesh was made (parallel/checks.py)
    if not nccl_ep_used(cfg, shape):
        return
    if jax.local_device_count() != 1:
        raise ConfigError("moe_impl=te_dropless with expert parallelism uses NCCL EP, which needs one process per "
                          f"GPU (this process has {jax.local_device_count()}); launch with scripts/launch.sh "
                          "or use te_kernels=reference")
    te = import_te()
    args = ep_bootstrap_args(cfg, shape, global_batch)
    # TE's self-hosted NCCL path forms the EP groups from mesh.devices (ep.py _ep_domain_for_rank), which only
    # the legacy `with mesh:` context exposes: under jax.set_mesh alone TE sees an AbstractMesh and raises.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            te["ep"].ep_bootstrap(rank=jax.process_index(), **args)
    if cfg.te_moe_block:  # TE's block refuses to run until told what NCCL EP was bootstrapped with
        te["moe"].record_ep_bootstrap_signature_for_moe(*moe_signature(args, shape))


@contextlib.contextmanager
def moe_runtime(cfg, mesh, global_batch: int):
    """The one context a run enters around everything it builds and runs, after check_available:
    jax.set_mesh(mesh), TE's mesh-axis names (mesh_context) and NCCL EP's bootstrap (bootstrap_ep). For the
    pure-JAX impls it is jax.set_mesh alone."""
    with jax.set_mesh(mesh), mesh_context(cfg):
        bootstrap_ep(cfg, mesh, global_batch)
        yield

"""Trace-only stand-in for Transformer Engine's compiled JAX extension: TE's real Python, traced on CPU.

TE's JAX package (`transformer_engine.jax`, a pure-Python wheel) sits on one compiled extension,
`transformer_engine_jax` (its FFI kernels and a few device queries), which cannot be built or loaded
without CUDA. `install(sm)` puts a pure-Python module of that name in its place. The stand-in answers
the questions TE's Python asks at import and trace time (its enums, the GPU's compute capability, the
CUDA / cuBLAS / cuDNN versions, workspace sizes, NCCL EP's handle size) as the NGC JAX image on an
H100 (sm=90) or a B200 (sm=100) would, so TE picks the code paths it picks there. It registers no
kernel and can run nothing: `jax.eval_shape`, `jax.make_jaxpr` and `.lower()` go through TE's own
router, grouped GEMM, quantizers and NCCL EP ops (shapes, dtypes, custom VJPs, sharding rules), and
anything that would execute a TE op stops at XLA's "No FFI handler registered".

Used by the tests (marker `te_trace`) and by the preflight, never by a training run: the trainer still
refuses `te_kernels=auto` without an NVIDIA GPU (te_runtime.check_available).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import importlib.util
import os
import sys
import types

STANDIN_NAME = "transformer_engine_jax"
MARK = "_maxtext_trace_standin"  # attribute set on the stand-in module, so install() is idempotent

# What the NGC JAX image (CUDA 13.3) reports; TE's Python gates FP8 on cuBLASLt >= 12.1.3 and MXFP8 on >= 12.8.
CUDA_VERSION = 13030
CUBLASLT_VERSION = 130300
CUDNN_VERSION = 91500
SUPPORTED_SM = (90, 100)


def _enum(name, *members):
    return enum.IntEnum(name, [(m, i) for i, m in enumerate(members)])


class _StandIn(types.ModuleType):
    """The module object installed as `transformer_engine_jax`; `sm` is the simulated compute capability."""

    def __init__(self, sm: int):
        super().__init__(STANDIN_NAME, __doc__)
        setattr(self, MARK, True)
        self.sm = sm
        for name, members in _ENUMS.items():
            setattr(self, name, _enum(name, *members))

    # --- device and library queries (read by TE's Python to choose code paths) ---
    def get_device_compute_capability(self, gpu_id: int = 0) -> int:
        return self.sm

    def get_cuda_version(self) -> int:
        return CUDA_VERSION

    def get_cublasLt_version(self) -> int:  # noqa: N802 - TE's name
        return CUBLASLT_VERSION

    def get_cudnn_version(self) -> int:
        return CUDNN_VERSION

    def get_cudnn_frontend_version(self) -> int:
        return 11500

    def get_num_compute_streams(self) -> int:
        return 4

    def nvte_built_with_cublasmp(self) -> bool:
        return False

    def is_collective_gemm_with_cublasmp(self) -> bool:
        return False

    def get_cgemm_num_max_streams(self) -> int:
        return 1

    def initialize_cgemm_communicator(self, *args, **kwargs):
        raise RuntimeError("trace stand-in: collective GEMM needs the real transformer_engine_jax")

    def registrations(self) -> dict:
        return {}  # no FFI target: nothing traced through the stand-in can execute

    # --- workspace queries: sizes only shape the workspace operand of an FFI call ---
    def get_grouped_gemm_setup_workspace_size(self, num_gemms: int) -> int:
        # Non-zero = TE was built with cuBLAS >= 13.3, so its graph-safe V2 grouped GEMM is available
        # (the NGC image's build). The size is what the cu13 build returned for 1 GEMM, scaled.
        return 404 * max(1, int(num_gemms))

    def get_topk_workspace_sizes(self, *args, **kwargs):
        return 1 << 20

    def _workspace(self, *args, **kwargs):
        return ((1 << 20,), self.DType.kByte)

    def _workspaces(self, *args, **kwargs):
        """The queries TE's Python unpacks as a one-element list of (shape, dtype)."""
        return (self._workspace(),)

    get_norm_fwd_workspace_sizes = get_norm_bwd_workspace_sizes = _workspaces
    get_dbias_quantize_workspace_sizes = get_dact_dbias_quantize_workspace_sizes = _workspaces
    get_fused_attn_fwd_workspace_sizes = get_fused_attn_bwd_workspace_sizes = _workspace

    def get_fused_attn_backend(self, *args, **kwargs):
        return self.NVTE_Fused_Attn_Backend.NVTE_No_Backend

    def nvte_get_qkv_format(self, layout):
        return self.NVTE_QKV_Format.NVTE_BSHD

    # --- NCCL EP host-side calls ---
    def ep_handle_mem_size(self, top_k: int, alignment: int) -> int:
        return 256 + 16 * int(top_k)

    def set_ep_bootstrap_params(self, *args, **kwargs):
        pass

    def release_ep_resources(self):
        pass

    def release_ep_resources_at_exit(self):
        pass


_ENUMS = {
    "DType": ("kByte", "kInt16", "kInt32", "kInt64", "kFloat32", "kFloat16", "kBFloat16", "kFloat8E4M3",
              "kFloat8E5M2", "kFloat8E8M0", "kFloat4E2M1"),
    "JAXX_Score_Function": ("SIGMOID", "SOFTMAX", "SQRTSOFTPLUS"),
    "JAXX_Routing_Map_Format": ("BYTEMAP", "BITMAP_U8"),
    "JAXX_Quantize_Layout": ("ROWWISE", "COLWISE", "ROWWISE_COLWISE"),
    "JAXX_Scaling_Mode": ("NO_SCALING", "DELAYED_TENSOR_SCALING", "MXFP8_1D_SCALING", "CURRENT_TENSOR_SCALING",
                          "NVFP4_1D_SCALING", "NVFP4_2D_SCALING"),
    "JAXX_Collective_Op": ("NONE", "ALL_GATHER", "REDUCE_SCATTER"),
    "NVTE_Activation_Type": ("GELU", "GEGLU", "SILU", "SWIGLU", "RELU", "REGLU", "QGELU", "QGEGLU", "SRELU",
                             "SREGLU", "GLU", "CLAMPED_SWIGLU"),
    "NVTE_Bias_Type": ("NVTE_NO_BIAS", "NVTE_PRE_SCALE_BIAS", "NVTE_POST_SCALE_BIAS", "NVTE_ALIBI"),
    "NVTE_Fused_Attn_Backend": ("NVTE_No_Backend", "NVTE_F16_max512_seqlen", "NVTE_F16_arbitrary_seqlen",
                                "NVTE_FP8"),
    "NVTE_Mask_Type": ("NVTE_NO_MASK", "NVTE_PADDING_MASK", "NVTE_CAUSAL_MASK", "NVTE_PADDING_CAUSAL_MASK",
                       "NVTE_CAUSAL_BOTTOM_RIGHT_MASK", "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK"),
    "NVTE_Norm_Type": ("LayerNorm", "RMSNorm"),
    "NVTE_QKV_Format": ("NVTE_SBHD", "NVTE_BSHD", "NVTE_THD", "NVTE_QKV_Format_NOT_SET"),
    "NVTE_QKV_Layout": ("NVTE_SB3HD", "NVTE_SBH3D", "NVTE_SBHD_SB2HD", "NVTE_SBHD_SBH2D", "NVTE_SBHD_SBHD_SBHD",
                        "NVTE_BS3HD", "NVTE_BSH3D", "NVTE_BSHD_BS2HD", "NVTE_BSHD_BSH2D", "NVTE_BSHD_BSHD_BSHD",
                        "NVTE_T3HD", "NVTE_TH3D", "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD", "NVTE_QKV_Layout_NOT_SET"),
    "NVTE_Softmax_Type": ("NVTE_VANILLA_SOFTMAX", "NVTE_OFF_BY_ONE_SOFTMAX", "NVTE_LEARNABLE_SOFTMAX"),
}


def installed() -> _StandIn | None:
    """The stand-in, if this process installed it."""
    module = sys.modules.get(STANDIN_NAME)
    return module if getattr(module, MARK, False) else None


def install(sm: int = 90) -> _StandIn:
    """Imports TE's real Python (transformer_engine.jax) over the stand-in, simulating compute capability
    `sm` (90 Hopper, 100 Blackwell). Idempotent; a different `sm` later is set with `set_sm`. Refuses
    when the real extension is already loaded (a GPU process must never trace through a stand-in)."""
    if sm not in SUPPORTED_SM:
        raise ValueError(f"te_trace: sm must be one of {SUPPORTED_SM}, got {sm}")
    standin = installed()
    if standin is not None:
        set_sm(sm)
        return standin
    if STANDIN_NAME in sys.modules:
        raise RuntimeError("te_trace: the real transformer_engine_jax is loaded; tracing uses the stand-in only")
    if importlib.util.find_spec("transformer_engine") is None:
        raise RuntimeError("te_trace: Transformer Engine's Python is not installed "
                           "(pip install transformer-engine==2.20.2, see requirements.txt)")
    standin = _StandIn(sm)
    sys.modules[STANDIN_NAME] = standin
    # TE's package __init__ imports transformer_engine.common (which dlopens CUDA libraries unless
    # NVTE_PROJECT_BUILDING is set) and then transformer_engine.jax, whose first act is
    # common.load_framework_extension("jax"): load the package without running its __init__, import
    # `common` quietly, point the loader at the stand-in, then run the package's own __init__.
    spec = importlib.util.find_spec("transformer_engine")
    package = importlib.util.module_from_spec(spec)
    sys.modules["transformer_engine"] = package
    with _env(NVTE_PROJECT_BUILDING="1", NVTE_FRAMEWORK="jax"):
        import transformer_engine.common as common  # noqa: PLC0415

        common.load_framework_extension = _load_standin
        spec.loader.exec_module(package)
        import transformer_engine.jax  # noqa: F401, PLC0415
    return standin


def _load_standin(framework: str) -> None:
    assert framework == "jax", framework
    assert installed() is not None


def set_sm(sm: int) -> None:
    """Switches the simulated compute capability and forgets every answer TE derived from the old one.

    TE caches SM-dependent answers in more places than `device_utils`: `get_quantize_layout` of each scaling
    mode (an lru_cache that branches on is_fp8_gemm_with_all_layouts_supported), helper's scaling-mode support
    table, and others. Rather than a list that goes stale with TE, every functools cache of every loaded TE
    module and of the classes they define is cleared, and helper's table reset."""
    if sm not in SUPPORTED_SM:
        raise ValueError(f"te_trace: sm must be one of {SUPPORTED_SM}, got {sm}")
    installed().sm = sm
    for cache in te_caches():
        cache.cache_clear()
    from transformer_engine.jax.quantize import helper  # noqa: PLC0415

    helper._is_scaling_mode_supported = helper._reason_for_no_scaling_mode = None  # noqa: SLF001 - TE's own memo


def te_caches() -> list:
    """Every functools cache (lru_cache, cache; on functions and on class attributes) of the loaded TE modules."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformer_engine.jax") or module is None:
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if isinstance(value, type) and value.__module__ == name else ()
            for candidate in (value, *members):
                if callable(getattr(candidate, "cache_clear", None)):
                    found[id(candidate)] = candidate
    return list(found.values())


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def equations(jaxpr):
    """Every equation of a (closed) jaxpr, recursively through its sub-jaxprs (jit, scan, shard_map, custom VJPs...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from equations(sub)


def te_op_counts(jaxpr) -> dict[str, int]:
    """TE's primitives in a jaxpr by name (te_..._ffi_wrapper shortened to te_...), each body of a loop once: a
    step's forward, its backward and what remat recomputes there."""
    found = (str(e.primitive) for e in equations(jaxpr) if str(e.primitive).startswith("te_"))
    return dict(sorted(collections.Counter(name.removesuffix("_ffi_wrapper") for name in found).items()))


def register_cpu_lowerings(rules=None) -> None:
    """Registers the lowering of every TE primitive for the CPU platform as well as CUDA, so `.lower()` and
    `.compile()` of a program with TE ops run TE's partitioning rules on CPU; compiling then stops at the
    first FFI call, for which no CPU handler exists. `rules(cls)` may give another CPU lowering for a
    primitive class (None: TE's own): te_reference's kernels."""
    from jax.interpreters import mlir  # noqa: PLC0415
    from transformer_engine.jax.cpp_extensions import base  # noqa: PLC0415

    for cls in base._primitive_registry.values():  # noqa: SLF001 - TE keeps no public list
        if cls.inner_primitive is not None:
            rule = rules(cls) if rules is not None else None
            mlir.register_lowering(cls.inner_primitive, rule or cls.lowering, platform="cpu")


def bootstrap_ep(cfg, mesh, global_batch: int) -> None:
    """For tracing, what te_runtime.bootstrap_ep leaves behind on GPUs: TE's EpConfig, from the same arguments
    and TE's own mesh helpers, without NCCL (run inside jax.set_mesh and te_runtime.mesh_context)."""
    from transformer_engine.jax.cpp_extensions import ep as tex_ep  # noqa: PLC0415
    from transformer_engine.jax.sharding import get_mesh_axis_size  # noqa: PLC0415

    from MaxText.parallel import checks  # noqa: PLC0415

    shape = dict(mesh.shape)  # checked for NCCL EP when the mesh was made (parallel/checks.py)
    if not checks.nccl_ep_used(cfg, shape):
        return
    outer = tex_ep._ep_outer_axis()  # noqa: SLF001 - the axis TE's ep_bootstrap reads
    tex_ep.set_ep_config(ep_config(cfg, shape, global_batch, 1 if outer is None else get_mesh_axis_size(outer)))
    if cfg.te_moe_block:
        from transformer_engine.jax import moe  # noqa: PLC0415

        from MaxText.layers.moe import te_runtime  # noqa: PLC0415

        args = te_runtime.ep_bootstrap_args(cfg, shape, global_batch)
        moe.record_ep_bootstrap_signature_for_moe(*te_runtime.moe_signature(args, shape))


def ep_config(cfg, mesh_shape: dict, global_batch: int, num_ep_groups: int):
    """TE's EpConfig as its ep_bootstrap records it (cpp_extensions/ep.py), from te_runtime.ep_bootstrap_args for
    this config and mesh; num_ep_groups: the size of the one outer batch axis TE keeps beside `expert`."""
    from transformer_engine.jax.cpp_extensions import ep as tex_ep  # noqa: PLC0415

    from MaxText.layers.moe import te_runtime  # noqa: PLC0415

    args = te_runtime.ep_bootstrap_args(cfg, mesh_shape, global_batch)
    ep_size = mesh_shape["expert"]
    return tex_ep.EpConfig(
        world_size=args["world_size"], rank=0, ep_size=ep_size, num_ep_groups=num_ep_groups,
        num_experts=args["num_experts"], num_local_experts=args["num_experts"] // ep_size,
        max_tokens_per_rank=args["max_tokens_per_rank"], recv_capacity_per_rank=args["recv_capacity_per_rank"],
        hidden_dim=args["hidden_dim"])

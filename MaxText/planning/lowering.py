"""The full-scale train step, lowered on a laptop: abstract parameters, the recipe's whole mesh, TE traced.

    python -m MaxText.lowering <recipe.yml> [key=value ...]      # prints one JSON object (the preflight's row)

Runs in its own process, because the device count is fixed when JAX starts: JAX on CPU with as many
simulated devices as the recipe's num_devices, Transformer Engine's real Python over te_trace's stand-in at
the gpu_profile's compute capability (when the MoE runs TE kernels), nothing allocated. Three steps:

  1. trace the jitted train step on the state's and the batch's abstract values (shape and dtype errors);
     with attention=cudnn_flash, JAX's cuDNN queries answer as the gpu_profile's GPU would
     (attention_cudnn.cuda_trace_profile), so the CUDA branch carries cuDNN's fused attention;
  2. lower it for CUDA: count TE's FFI custom calls, TE's and cuDNN attention's partitioned ops
     (custom_partitioning) and the host-offload annotations in the module the GPU would compile;
  3. lower for CPU (TE's lowerings registered there) and compile: XLA partitions the step over the mesh with
     TE's own sharding rules, then stops at the first TE kernel, for which CPU has no handler. Any sharding
     or shape error of the partitioning surfaces before that stop; a step without TE compiles whole. CPU
     lowerings take attention=cudnn_flash's XLA path (lax.platform_dependent), so cuDNN's own partitioning
     is not exercised here.
     XLA dumps the module right after SPMD partitioning (per-device shapes, before any CPU-specific pass
     such as CPU's widening of bf16 collectives to float32), and MaxText.planning.collectives counts its collectives
     per device per step: kind, dtype, bytes, loop trips multiplied through; MaxText.planning.overlap reads
     from the same module which exchange of a sliced MoE (num_moe_token_chunks) or of a part of a split batch
     (use_batch_split_schedule) waits for another slice's compute and which can run under it.

lowered(cfg, backend_optimization=False) leaves out XLA:CPU's backend optimisations, which run after that
dump: the same result, sooner, where only the counts are read (tests/test_collectives.py lowers two configs
in one process that way).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import re
import sys
import tempfile
import time

from MaxText.planning import overlap
from MaxText.planning.collectives import by_group, count_collectives, largest, summarize

FFI_STOP = "No FFI handler registered for te_"
# XLA's options for the CPU compile, not XLA_FLAGS: per compile, so one process can lower several configs.
_DUMP_OPTIONS = {"xla_dump_hlo_module_re": "jit_train_step", "xla_dump_hlo_pass_re": "spmd-partitioning"}


def dumped_module(dump_dir: str) -> str | None:
    """XLA's text of the train step it dumped into dump_dir after SPMD partitioning (None: no dump)."""
    partitioned = sorted(glob.glob(os.path.join(dump_dir, "*jit_train_step*after_spmd-partitioning*.txt")))
    if not partitioned:
        return None
    with open(partitioned[-1]) as f:
        return f.read()


def module_collectives(text: str, num_devices: int) -> dict:
    """The collectives of a partitioned train step, as the lowering's JSON has them."""
    found, unknown_trips = count_collectives(text, num_devices)
    return {"per_device_per_step": summarize(found), "by_group": by_group(found), "largest": largest(found),
            "loops_with_unknown_trips": unknown_trips}


def jaxlib_version() -> tuple:
    import jaxlib.version  # here, not at the top: JAX loads only after main has set XLA_FLAGS

    return tuple(int(p) for p in re.findall(r"\d+", jaxlib.version.__version__)[:3])


def check_jax_for_te(uses_te: bool, num_devices: int) -> None:
    """jaxlib 0.11.x (NVIDIA's JAX image of TE 2.20) crashes XLA:CPU (a segfault in backend_compile_and_load)
    compiling a multi-device program that holds TE's grouped GEMM custom call without a CPU handler; the
    router's and NCCL EP's custom calls stop with the FFI error as they should, and the one-device step
    compiles. Refused in one line instead of a crash."""
    # here, not at the top: as the module's other imports, after main has set XLA_FLAGS
    from MaxText.config.errors import ConfigError

    if not uses_te or num_devices == 1:
        return
    version = jaxlib_version()
    if version < (0, 12):
        raise ConfigError(f"the full-scale lowering with TE kernels crashes XLA:CPU under jaxlib "
                          f"{'.'.join(map(str, version))} (TE's grouped GEMM custom call on a "
                          f"{num_devices}-device mesh); run the preflight with jax and jaxlib 0.12.0.1 "
                          "(requirements.txt) or with --no-lowering")


def lower_step(cfg, dump_dir: str | None = None, backend_optimization: bool = True) -> dict:
    """Steps 1-3 for cfg in this process (which must hold cfg.num_devices CPU devices). With dump_dir (where
    XLA dumps the train step after SPMD partitioning), the result counts its collectives."""
    # here, not at the top: JAX loads only after main has set XLA_FLAGS (the simulated device count)
    import jax

    from MaxText.parallel import sharding
    from MaxText.config.load import global_batch_size
    from MaxText.data.records import abstract_batch
    from MaxText.config.hardware import GPU_PROFILES
    from MaxText.layers import attention_cudnn
    from MaxText.layers.moe import te_runtime
    from MaxText.planning import te_trace
    from MaxText.step.state import state_spec
    from MaxText.step.train_step import jit_train_step

    uses_te = te_runtime.uses_te(cfg) is not None
    sm = GPU_PROFILES[cfg.gpu_profile].sm if cfg.gpu_profile else 90
    if uses_te:
        te_trace.install(sm)
    start = time.perf_counter()
    mesh = sharding.create_mesh(cfg)
    check_jax_for_te(uses_te, mesh.devices.size)
    global_batch = global_batch_size(cfg, mesh.devices.size)
    spec = state_spec(cfg, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    batch = abstract_batch(global_batch, cfg.max_target_length, batch_sharding)
    cudnn = attention_cudnn.cuda_trace_profile(sm) if cfg.attention == "cudnn_flash" else contextlib.nullcontext()
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg), cudnn:
        if uses_te:
            te_trace.bootstrap_ep(cfg, mesh, global_batch)
        traced = jit_train_step(cfg, spec, batch_sharding).trace(spec.abstract, batch)
        te_ops = te_trace.te_op_counts(traced.jaxpr)
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
        cudnn_ops = attention_cudnn.kernel_calls(traced.jaxpr)
        if uses_te:
            te_trace.register_cpu_lowerings()
        options = {"xla_dump_to": dump_dir, **_DUMP_OPTIONS} if dump_dir else {}
        if not backend_optimization:
            options["xla_backend_optimization_level"] = 0
        try:
            traced.lower().compile(compiler_options=options or None)
            stop = "compiled whole (no TE kernel)"
        except Exception as e:  # noqa: BLE001 - the only acceptable failure is the FFI stop, checked by the caller
            stop = str(e).splitlines()[0] if str(e) else type(e).__name__
    module = dumped_module(dump_dir) if dump_dir else None
    return {
        "mesh": {a: int(n) for a, n in mesh.shape.items()},
        "collectives": module_collectives(module, mesh.devices.size) if module else None,
        # the sliced MoE's exchanges: which wait for another slice's compute, which can run under it
        "overlap": overlap.summarize(overlap.exchanges(module)) if module else None,
        "te_ffi_calls": dict(collections.Counter(re.findall(r"custom_call @(te_\w+)", cuda))),
        # cuDNN's ops are custom-partitioned too, but for those inside shard_map (context parallelism), which lower
        # as cuDNN's own custom calls
        "te_partitioned_ops": cuda.count("@CustomSPMDPartitioning") - cudnn_ops + len(re.findall(
            r"custom_call @__cudnn\$fmha", cuda)),
        "te_ops": te_ops,
        "cudnn_attention_ops": cudnn_ops,
        "host_offload_annotations": len(re.findall(r"pinned_host", cuda)),
        "compile_stop": stop,
        "ok": stop.startswith("compiled whole") or FFI_STOP in stop,
        "seconds": round(time.perf_counter() - start, 1),
    }


def lowered(cfg, backend_optimization: bool = True) -> dict:
    """The JSON object for cfg, lowered in this process. Before JAX starts it asks for as many CPU devices as
    the recipe's GPUs (the recipe's GPU XLA flags stay out); a later call in the same process needs the same
    num_devices."""
    # here, not at the top: JAX loads only after main has set XLA_FLAGS (the simulated device count)
    from MaxText.config.errors import ConfigError

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cfg.num_devices or 1}"
    with tempfile.TemporaryDirectory(prefix="maxtext-lowering-") as dump:
        try:
            return lower_step(cfg, dump, backend_optimization)
        except ConfigError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - reported as the preflight's row, with its first line
            return {"ok": False, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # here, not at the top: JAX loads only after main has set XLA_FLAGS (the simulated device count)
    from MaxText.config.errors import ConfigError
    from MaxText.config.load import load_config

    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 2
    result = lowered(cfg)
    print(json.dumps(result))
    return 0 if result["ok"] else 1

"""Will this recipe launch on its target GPUs? Checked on any machine, without a GPU or the model in memory.

    python -m MaxText.preflight <recipe.yml> [key=value ...] [--json] [--tasks-per-node N] [--no-lowering]

The recipe names its hardware with `gpu_profile` (MaxText/config/hardware.py). One row per check, each `pass`,
`fail` (one line naming the key and the fix) or `todo` (not run, said plainly); exit 0 only when nothing
fails, 1 when something does, 2 when the config itself does not load. 10-30 s on 2 cores, nearly all of it
the lowering (--no-lowering leaves it as a todo row: what scripts/slurm.sbatch runs before starting the GPUs,
where the container's TE may not be the version te_trace answers for).

  devices       num_devices fills whole hosts; one process per GPU: --ntasks-per-node = GPUs per host
  mesh          the trainer's own mesh builder (sharding.device_grid) over simulated devices carrying the
                process_index and slice_index the runtime gives (one slice per host, or per NVLink domain
                on multi-node NVLink): every ICI block inside one slice, dcn_* = the number of slices
  xla_flags     every flag parses under the installed jaxlib (an unknown one aborts XLA at start)
  data          a corpus, and a tokenizer for a large vocabulary, are named (the recipes leave both to the
                user; their files are checked at start-up)
  quantization  te_gmm_quantization suits the GPU generation (MXFP8: Blackwell; fp8_current: Hopper)
  nccl_ep       what NCCL EP cannot take (one data-parallel axis beside expert, experts % 4, factor >= 1)
  hbm           MaxText.plan's per-GPU memory against the profile's HBM
  pinned_pool   the offloaded activations per GPU fit XLA's pinned-host pool (host_memory_limit_gb)
  host_memory   per host: the pinned pools of its GPUs plus async checkpointing's host copy of the state
  lowering      the whole train step at full scale (MaxText.lowering, in its own process): traced, lowered
                for CUDA (TE's custom calls and the host-offload annotations counted) and partitioned over
                the recipe's devices with TE's own sharding rules, up to the first TE kernel; the partitioned
                module's collectives per GPU per step, by kind and dtype (MaxText.planning.collectives)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import NamedTuple

from MaxText.config.load import HOST_POOL_ENV, XLA_DEFAULT_HOST_POOL_GB, cli_arguments, load_config
from MaxText.config.errors import ConfigError, error_line
from MaxText.config.storage import shown_path
from MaxText.config.hardware import GPU_PROFILES, GpuProfile, simulated_devices
from MaxText.parallel import checks

GIB = 1 << 30
HOST_HEADROOM = 0.9  # of a host's memory: the OS, the data pipeline and the Python processes need the rest


class Row(NamedTuple):
    check: str
    status: str   # pass | fail | todo
    detail: str


def _try(check: str, fn) -> list[Row]:
    """Runs one check; a ConfigError becomes its failing row (the error's line is the fix)."""
    try:
        return fn()
    except ConfigError as e:
        return [Row(check, "fail", str(e))]


def check_devices(cfg, profile: GpuProfile, tasks_per_node: int | None) -> list[Row]:
    if not cfg.num_devices:
        return [Row("devices", "fail", "set num_devices to the GPUs the recipe is laid out for")]
    g = profile.gpus_per_host
    if cfg.num_devices % g:
        return [Row("devices", "fail", f"num_devices={cfg.num_devices} does not fill whole {profile.name} hosts of "
                                        f"{g} GPUs; use a multiple of {g}")]
    if tasks_per_node is not None and tasks_per_node != g:
        return [Row("devices", "fail", f"{tasks_per_node} tasks per node on {profile.name} hosts of {g} GPUs: one "
                                        f"process per GPU needs --ntasks-per-node={g} (JAX maps the local rank to "
                                        "its GPU)")]
    return [Row("devices", "pass", f"{cfg.num_devices // g} hosts x {g} GPUs: launch with --ntasks-per-node={g}, "
                                    "one process per GPU")]


def check_mesh(cfg, profile: GpuProfile) -> list[Row]:
    # here, not at the top: JAX loads only for the checks that need it (a recipe's mistakes are one line without JAX's
    # start-up)
    from MaxText.parallel import sharding

    devices = simulated_devices(profile, cfg.num_devices)
    grid = sharding.device_grid(cfg, devices)
    slices = len({d.slice_index for d in devices})
    shape = " x ".join(f"{a} {n}" for a, n in zip(sharding.MESH_AXES, grid.shape) if n > 1)
    return [Row("mesh", "pass", f"{shape} over {slices} slice(s) of {cfg.num_devices // slices} GPUs "
                                 f"({'NVLink domains' if profile.slice_per_domain else 'hosts'}); every ICI block "
                                 "inside one slice")]


def check_xla_flags(cfg) -> list[Row]:
    # here, not at the top: JAX loads only for the checks that need it (a recipe's mistakes are one line without JAX's
    # start-up)
    from MaxText.config.xla_flags import check_flags, retired_flags

    if not cfg.xla_flags:
        return [Row("xla_flags", "pass", "none set")]
    problems = check_flags(cfg.xla_flags)
    if not problems:
        retired = retired_flags(cfg.xla_flags)
        return [Row("xla_flags", "pass", f"all {len(cfg.xla_flags.split())} parse under the installed jaxlib"
                    + "".join(f"; {line}" for line in retired))]
    return [Row("xla_flags", "fail", f"xla_flags: {p.message}") for p in problems]


def check_data(cfg) -> list[Row]:
    """A corpus and, for a large vocabulary, a tokenizer are named (their files live on the cluster: the
    trainer checks them at start-up)."""
    # here, not at the top: JAX loads only for the checks that need it (a recipe's mistakes are one line without JAX's
    # start-up)
    from MaxText.data import corpus_problem

    problem = corpus_problem(cfg)
    if problem:
        return [Row("data", "fail", problem)]
    name = {"tfds": cfg.dataset_name, "grain": f"grain over {cfg.grain_train_files}",
            "hf": f"hf over {cfg.hf_train_files or cfg.hf_path}"}.get(cfg.dataset_type, "synthetic data")
    return [Row("data", "pass", f"{name}, tokenizer {cfg.tokenizer_path or 'byte-level'} (files checked at start-up)")]


def check_quantization(cfg, profile: GpuProfile) -> list[Row]:
    # here, not at the top: JAX loads only for the checks that need it (a recipe's mistakes are one line without JAX's
    # start-up)
    from MaxText.layers.moe import te_runtime

    return _try("quantization", lambda: te_runtime.check_quantization(cfg, profile.sm / 10) or [
        Row("quantization", "pass", f"quantization={cfg.quantization}, te_gmm_quantization={cfg.te_gmm_quantization} "
                                    f"on SM {profile.sm / 10:g}")])


def nccl_ep_row(cfg, mesh_shape: dict) -> Row:
    """Whether NCCL EP runs on this mesh; what it cannot take was refused with the mesh (the mesh row)."""
    if checks.nccl_ep_used(cfg, mesh_shape):
        return Row("nccl_ep", "pass", "NCCL EP takes this mesh and buffer")
    fallback = cfg.moe_dropless_fallback and mesh_shape.get("expert", 1) > 1 and cfg.moe_impl == "te_dropless"
    why = ("moe_dropless_fallback: XLA's ragged all-to-all exchanges the tokens" if fallback
           else "no expert parallelism through TE")
    return Row("nccl_ep", "pass", f"not used ({why})")


def check_memory(cfg, profile: GpuProfile, plan: dict) -> list[Row]:
    """HBM (the plan), the pinned-host pool per process, and each host's memory."""
    total, hbm, verdict = plan["bytes"]["total"], plan["hbm_gib"], plan["verdict"]
    rows = [Row("hbm", "fail" if verdict == "does not fit" else "pass",
                f"{total / GIB:.1f} of {hbm:g} GiB per GPU ({total / (hbm * GIB):.0%}, {verdict})"
                + ("; lower per_device_batch_size or offload more (MaxText.plan shows the parts)"
                   if verdict == "does not fit" else ""))]
    pool_gb = cfg.host_memory_limit_gb if cfg.host_memory_limit_gb is not None else XLA_DEFAULT_HOST_POOL_GB
    offload = plan["host_offload_bytes"]
    # XLA's limit is in GB; read it as 10^9 bytes (if XLA means 2^30 the pool is 7% larger than checked).
    need_gb = math.ceil(offload / 1e9 * 1.05) if offload else 0
    if offload > pool_gb * 1e9:
        rows.append(Row("pinned_pool", "fail", f"{offload / GIB:.1f} GiB of offloaded activations per GPU exceed "
                                               f"XLA's pinned-host pool of {pool_gb} GB ({HOST_POOL_ENV}); set "
                                               f"host_memory_limit_gb={need_gb} or offload less"))
    else:
        rows.append(Row("pinned_pool", "pass", f"{offload / GIB:.1f} GiB offloaded per GPU within the {pool_gb} GB "
                                               "pool" + ("" if cfg.host_memory_limit_gb else " (XLA's default)")))
    # Per host: each GPU's process may hold its whole pool (XLA can preallocate it), and an async checkpoint
    # copies the process's state shard (params and optimizer moments) to host memory before writing it.
    state = plan["bytes"]["params"] + plan["bytes"]["optimizer"]
    checkpoint = state if cfg.enable_checkpointing and cfg.async_checkpointing else 0
    per_host = profile.gpus_per_host * (pool_gb * 1e9 if offload else 0) + profile.gpus_per_host * checkpoint
    limit = profile.host_memory_gib * GIB * HOST_HEADROOM
    detail = (f"{per_host / GIB:.0f} GiB per host ({profile.gpus_per_host} x "
              f"({pool_gb if offload else 0} GB pool + {checkpoint / GIB:.1f} GiB checkpoint copy)) of "
              f"{profile.host_memory_gib:g} GiB x {HOST_HEADROOM:.0%}")
    if per_host > limit:
        rows.append(Row("host_memory", "fail", detail + "; lower host_memory_limit_gb to what the offload needs "
                                                        f"({need_gb}) or set async_checkpointing=false"))
    else:
        rows.append(Row("host_memory", "pass", detail))
    return rows


def check_lowering(argv: list[str], timeout: float = 600) -> list[Row]:
    """MaxText.lowering in its own process (it needs num_devices simulated devices from JAX's start)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-m", "MaxText.lowering", *argv], capture_output=True, text=True,
                              timeout=timeout, env=env)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return [Row("lowering", "fail", f"lowering the full step took over {timeout:g} s")]
    except (json.JSONDecodeError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [Row("lowering", "fail", f"the lowering process failed: {last}")]
    if "error" in result:
        return [Row("lowering", "fail", f"the full-scale step does not trace or lower: {result['error']}")]
    calls = result["te_ffi_calls"]
    mesh = " x ".join(f"{a} {n}" for a, n in result["mesh"].items() if n > 1) or "one device"
    if not result["ok"]:
        return [Row("lowering", "fail", f"partitioning the full-scale step on {mesh} failed: {result['compile_stop']}")]
    stop = ("compiled whole" if result["compile_stop"].startswith("compiled whole")
            else "partitioned by XLA with TE's rules up to the first TE kernel")
    detail = (f"traced and lowered for CUDA on {mesh}: {sum(calls.values())} TE FFI calls ("
              + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) + f"), {result['te_partitioned_ops']} "
              f"TE partitioned ops, TE ops in the step (forward, backward, recomputed; a loop body once: "
              + ", ".join(f"{k} {v}" for k, v in result.get("te_ops", {}).items()) + "), "
              + (f"{result['cudnn_attention_ops']} cuDNN fused-attention ops, "
                                         if result.get("cudnn_attention_ops") else "")
              + f"{result['host_offload_annotations']} host-offload annotations; {stop}"
              + _collectives_text(result.get("collectives")) + f" ({result['seconds']} s)")
    return [Row("lowering", "pass" if result["ok"] else "fail", detail)]


def _collectives_text(collectives: dict | None) -> str:
    """`; XLA collectives per GPU per step: all-gather 423 GiB (bf16), ...`, each kind's bytes with its
    dtypes by share; TE's NCCL EP dispatch/combine are FFI calls, not among them."""
    if not collectives:
        return ""
    kinds = []
    for kind, s in collectives["per_device_per_step"].items():
        shares = [(d, b / s["bytes"]) for d, b in sorted(s["dtypes"].items(), key=lambda kv: -kv[1])]
        shares = [(d, f) for d, f in shares if f >= 0.01]
        dtypes = shares[0][0] if len(shares) == 1 else ", ".join(f"{d} {f:.0%}" for d, f in shares)
        size = s["bytes"] / GIB
        kinds.append(f"{kind} {size:.1f} GiB" if size >= 0.1 else f"{kind} {s['bytes'] / 2**20:.1f} MiB")
        kinds[-1] += f" ({dtypes})"
    unknown = collectives.get("loops_with_unknown_trips")
    return ("; XLA collectives per GPU per step: " + (", ".join(kinds) or "none")
            + (f" ({unknown} loops counted once: trip count unreadable)" if unknown else ""))


def preflight(argv: list[str], tasks_per_node: int | None = None, lower: bool = True) -> dict:
    """Every check's rows and the verdict, for the table and --json; argv as for MaxText.train (a ConfigError
    when the config itself does not load). lower=False leaves the full-scale lowering as a todo row."""
    cfg = load_config(argv)
    if cfg.gpu_profile is None:
        rows = [Row("profile", "fail", f"set gpu_profile to the target system ({', '.join(GPU_PROFILES)})")]
        return {"rows": [r._asdict() for r in rows], "ok": False}
    profile = GPU_PROFILES[cfg.gpu_profile]
    rows = [Row("profile", "pass", f"{profile.name}: {profile.gpus_per_host} GPUs per host, NVLink domain "
                                   f"{profile.nvlink_domain}, {profile.hbm_gib:g} GiB HBM, SM {profile.sm / 10:g}")]
    rows += check_devices(cfg, profile, tasks_per_node)
    devices_ok = rows[-1].status == "pass"
    if devices_ok:  # the mesh row: every check of the config against its mesh (parallel/checks.py)
        rows += _try("mesh", lambda: check_mesh(cfg, profile))
    rows += check_xla_flags(cfg)
    rows += check_data(cfg)
    plan = None
    if devices_ok:
        # here, not at the top: JAX loads only for the checks that need it (a recipe's mistakes are one line without
        # JAX's start-up)
        from MaxText.planning import plan as planner
        from MaxText.parallel import sharding

        rows += check_quantization(cfg, profile)
        try:
            mesh_shape = sharding.mesh_shape(cfg, cfg.num_devices)  # runs the mesh checks again: the mesh row says them
            rows.append(nccl_ep_row(cfg, mesh_shape))
            plan = planner.plan(cfg, hbm_gib=cfg.hbm_gib or profile.hbm_gib)
            rows += check_memory(cfg, profile, plan)
        except ConfigError as e:
            if str(e) not in {r.detail for r in rows if r.check == "mesh"}:  # a mesh check: said once, in its row
                rows.append(Row("memory", "fail", str(e)))
    layout_ok = devices_ok and all(r.status == "pass" for r in rows if r.check in ("mesh", "nccl_ep", "quantization"))
    if lower and layout_ok:
        rows += check_lowering(argv)
    else:
        rows.append(Row("lowering", "todo", "not run (--no-lowering)" if not lower else
                        "not run: fix the mesh, quantization and NCCL EP rows first"))
    return {"profile": cfg.gpu_profile, "num_devices": cfg.num_devices, "rows": [r._asdict() for r in rows],
            "plan": plan, "ok": all(r.status != "fail" for r in rows)}


def format_table(result: dict) -> str:
    width = max(len(r["check"]) for r in result["rows"])
    lines = [f"{r['check']:<{width}}  {r['status']:<4}  {r['detail']}" for r in result["rows"]]
    failed = sum(r["status"] == "fail" for r in result["rows"])
    lines.append(f"\nverdict: {'ready to launch' if result['ok'] else f'{failed} check(s) fail'}"
                 + ("" if not any(r["status"] == "todo" for r in result["rows"]) else " (todo rows not checked)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parsed = cli_arguments(list(sys.argv[1:] if argv is None else argv), __doc__)
    if parsed is None:
        return 0
    argv, as_json = parsed
    lower = "--no-lowering" not in argv
    argv = [x for x in argv if x != "--no-lowering"]
    tasks = None
    if "--tasks-per-node" in argv:
        i = argv.index("--tasks-per-node")
        given = argv[i + 1] if i + 1 < len(argv) else None
        if given is None or not (given.isascii() and given.isdigit()) or len(given) > 6 or int(given) < 1:
            got = "nothing" if given is None else shown_path(given) or "an empty value"
            print(f"error: --tasks-per-node needs a whole number of processes per node (1 to 999999), got {got}",
                  file=sys.stderr)
            return 2
        tasks = int(given)
        del argv[i:i + 2]
    elif os.environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        tasks = int(os.environ["SLURM_NTASKS_PER_NODE"])
    try:
        result = preflight(argv, tasks, lower=lower)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str) if as_json else format_table(result))
    return 0 if result["ok"] else 1

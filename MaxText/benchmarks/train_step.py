"""End-to-end train-step speed of a config, per `moe_impl`, side by side in one run.

    python -m MaxText.benchmarks.train_step <config.yml> [key=value ...] [--impls dense,ragged,te_dropless]
                                            [--steps 10] [--warmup 2] [--json PATH]

An entry of --impls may carry its own overrides after colons: `ragged:ep_dedup=false,ragged` compares the
expert-parallel dispatch one row per chosen expert with one row per device in the same run.
For each entry: the config with `moe_impl=<impl>` (and the entry's overrides), its mesh over the visible devices, a freshly initialised
state and one synthetic batch (the input pipeline is not what is measured). The step is compiled ahead of
time (compile seconds and XLA's temporary-buffer bytes are reported), run `--warmup` times, then `--steps`
times back to back; step time is the wall time of those steps / steps, after the last one has finished.
Tokens/s/device, model TFLOP/s/device and MFU (against the device's bf16 peak, MaxText/planning/flops.py) follow
from it. `te_dropless` runs its pure-JAX reference kernels where there is no NVIDIA GPU (marked so).
Prints a table and one JSON line (process 0 of a multi-process job: scripts/launch.sh with
LAUNCH_MODULE=MaxText.benchmarks.train_step); never part of the test suite's timing.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from MaxText.planning import flops
from MaxText.parallel import sharding
from MaxText.benchmarks import emit
from MaxText.config.errors import ConfigError
from MaxText.config.load import apply_xla_flags, global_batch_size, load_config
from MaxText.data.synthetic import SyntheticData
from MaxText.layers.moe.te_runtime import check_available, moe_runtime
from MaxText.parallel.distributed import maybe_initialize_distributed
from MaxText.step.state import create_state, state_spec
from MaxText.step.train_step import jit_train_step


def measure(cfg, steps: int, warmup: int, devices=None) -> dict:
    """One impl's row: compile seconds, temp bytes, seconds per step and what follows from them (on `devices`,
    default all)."""
    mesh = sharding.create_mesh(cfg, devices)
    devices = mesh.devices.size
    global_batch = global_batch_size(cfg, devices)
    spec = state_spec(cfg, mesh)
    check_available(cfg)  # te_dropless: one line when TE cannot run here
    with moe_runtime(cfg, mesh, global_batch):
        batch_sharding = sharding.batch_sharding(mesh)
        batch = jax.make_array_from_process_local_data(
            batch_sharding, next(SyntheticData(cfg, global_batch, jax.process_index(), jax.process_count())))
        state = create_state(cfg, mesh, spec)
        start = time.perf_counter()
        step = jit_train_step(cfg, spec, batch_sharding).lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        memory = step.memory_analysis()
        for _ in range(warmup):
            state, metrics = step(state, batch)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        step_s = (time.perf_counter() - start) / steps
    tokens = global_batch * cfg.max_target_length
    peak = flops.peak_tflops(jax.devices()[0].device_kind)
    tps, tflops, mfu = flops.throughput(cfg, tokens, devices, step_s, peak)
    return {"compile_s": compile_s, "temp_gib": memory.temp_size_in_bytes / 2**30 if memory else None,
            "step_s": step_s, "tokens_per_s_per_device": tps, "tflops_per_device": tflops, "mfu": mfu,
            "loss": float(metrics["loss"]), "devices": devices, "tokens_per_step": tokens}


def format_table(result: dict) -> str:
    lines = [f"train step of {result['config']} on {result['devices']} x {result['device_kind']}, "
             f"{result['tokens_per_step']} tokens/step, {result['steps']} steps after {result['warmup']} warm-up",
             f"{'moe_impl':<32}{'compile s':>10}{'step s':>10}{'tokens/s/dev':>14}{'TFLOP/s/dev':>13}{'MFU':>8}"
             f"{'temp GiB':>10}{'loss':>9}"]
    for r in result["rows"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        temp = f"{r['temp_gib']:.3f}" if r["temp_gib"] is not None else "-"
        lines.append(f"{r['impl']:<32}{r['compile_s']:>10.1f}{r['step_s']:>10.4f}"
                     f"{r['tokens_per_s_per_device']:>14.1f}{r['tflops_per_device']:>13.3f}{mfu:>8}{temp:>10}"
                     f"{r['loss']:>9.4f}")
    return "\n".join(lines)


def main(argv=None) -> dict | int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config YAML, e.g. configs/base.yml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--impls", default="dense,ragged,te_dropless", help="comma-separated moe_impl values")
    p.add_argument("--steps", type=int, default=10, help="measured steps per impl")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    try:
        base = load_config([a.config, *a.overrides])
        apply_xla_flags(base)  # before anything starts JAX's backend
        maybe_initialize_distributed(base)  # one process per GPU (scripts/launch.sh): jax.distributed
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    on_nvidia = jax.default_backend() == "gpu"
    rows = []
    try:
        for entry in a.impls.split(","):
            impl, *own = entry.split(":")
            extra = [f"moe_impl={impl}", *own]
            if impl == "te_dropless" and not on_nvidia and not any(o.startswith("te_kernels=") for o in a.overrides):
                extra.append("te_kernels=reference")  # TE's kernels need an NVIDIA GPU
            cfg = load_config([a.config, *a.overrides, *extra])
            label = entry + (" (reference)" if cfg.moe_impl == "te_dropless" and cfg.te_kernels == "reference"
                             else "")
            rows.append({"impl": label, **measure(cfg, a.steps, a.warmup)})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"status": "measured", "config": a.config, "overrides": a.overrides, "steps": a.steps,
              "warmup": a.warmup, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "devices": rows[0]["devices"], "tokens_per_step": rows[0]["tokens_per_step"], "rows": rows}
    if jax.process_index() == 0:  # one table and one report per job, whatever its processes
        print(format_table(result))
        emit(result, a.json)
    return result


if __name__ == "__main__":
    out = main()
    raise SystemExit(out if isinstance(out, int) else 0)

"""The GPU validation kit: is the TE path correct here, and how fast is it? (`scripts/gpu_check.sh` runs it.)

    python -m MaxText.benchmarks.gpu_check [--json gpu_check.json] [--smoke]

1. kernels: the `gpu`-marked tests (TE router, token permutation, and grouped GEMM forward and backward
   against their pure-JAX references at TE's own tolerances), through pytest; skipped with the reason where
   TE cannot be imported.
2. te_dropless vs ragged: a tiny DeepSeek-style model (MLA, sigmoid group-limited routing with bias, shared
   expert, MTP) trained a few bf16 steps with each; the losses must agree within bf16 tolerance.
3. grouped GEMM TFLOP/s at DeepSeek-V3 expert shapes (D 7168, F 2048, 32 local experts, Zipf-skewed routing of
   8 experts per token) for jax.lax.ragged_dot and TE's grouped GEMM (groups rounded up to 128 rows, as
   te_dropless feeds it), next to a bf16 8192^3 dense matmul measured in the same run.
4. MoE layer forward+backward TFLOP/s per moe_impl (MaxText.benchmarks.moe_layer at a GPU size).
Prints a table per part and writes everything as JSON. `--smoke` shrinks every shape so the whole kit runs on
a CPU in a minute (the suite runs it that way; the numbers then mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.benchmarks import grouped_matmul as gmm_bench, moe_layer
from MaxText.config import load_config
from MaxText.layers.moe import te_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def te_status() -> str | None:
    """None when TE's JAX modules import, else why not."""
    try:
        te_kernels._import_te()
    except te_kernels.TEUnavailable as e:
        return str(e)
    return None


def check_kernels(te_missing: str | None) -> dict:
    """pytest -m gpu over the TE kernel tests, in a subprocess (its own JAX on the GPU)."""
    if te_missing:
        return {"status": "skipped", "reason": te_missing}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             os.path.join(ROOT, "tests", "test_te_dropless.py")],
                            cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS=""))
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"status": "passed" if result.returncode == 0 else "failed", "summary": summary,
            "output_tail": (result.stdout + result.stderr)[-4000:] if result.returncode else ""}


def check_impls_agree(te_missing: str | None, smoke: bool, tmp_dir: str) -> dict:
    """Losses of te_dropless and ragged on deepseek3-tiny, bf16, same data and init."""
    from MaxText.train import train

    steps = 3 if smoke else 10
    base = ["model_name=deepseek3-tiny", "dtype=float32" if smoke else "dtype=bfloat16", f"steps={steps}",
            "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false", "dataset_type=synthetic",
            "eval_interval=-1", "max_target_length=64", "per_device_batch_size=4", f"base_output_directory={tmp_dir}"]
    te = ["moe_impl=te_dropless"] + (["te_kernels=reference"] if te_missing else [])
    runs = {}
    for name, extra in (("ragged", ["moe_impl=ragged"]), ("te_dropless", te)):
        cfg = load_config(base + extra + [f"run_name={name}_{int(time.time())}"])
        path = os.path.join(tmp_dir, cfg.run_name, "metrics", "metrics.jsonl")
        train(cfg, log=lambda *_: None, devices=jax.devices()[:1])
        with open(path) as f:
            runs[name] = [json.loads(line)["loss"] for line in f]
    a, b = np.array(runs["ragged"]), np.array(runs["te_dropless"])
    tol = 2e-4 if smoke else 3e-2  # bf16: TE's grouped GEMM accumulates in another order than ragged_dot
    worst = float(np.max(np.abs(a - b) / np.abs(a)))
    return {"status": "passed" if worst <= tol else "failed", "kernels": "reference" if te_missing else "TE",
            "losses": runs, "max_relative_difference": worst, "tolerance": tol}


def dense_tflops(n: int, repeats: int) -> float:
    """bf16 n x n x n matmul TFLOP/s on random data: the ceiling the grouped GEMMs are compared with."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds = gmm_bench.time_calls(jax.jit(jnp.matmul), (a, b), repeats)["s"]
    return 2 * n ** 3 / seconds / 1e12


def check_grouped_gemm(te_missing: str | None, smoke: bool) -> dict:
    """fwd and fwd+bwd TFLOP/s of the grouped GEMMs at DeepSeek-V3's expert shapes."""
    tokens, dim, hidden, experts, top_k = (256, 256, 128, 8, 2) if smoke else (4096, 7168, 2048, 32, 8)
    repeats = 2 if smoke else 10
    sizes = gmm_bench.zipf_group_sizes(tokens, experts, top_k, skew=1.0)
    sizes = (sizes + 127) // 128 * 128  # te_dropless's aligned groups
    rows = int(sizes.sum())
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(experts, dim, hidden)) / np.sqrt(dim), jnp.bfloat16)
    ct = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    methods = {"ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
               .astype(x.dtype)}
    if not te_missing:
        te = te_kernels.kernels(load_config(["moe_impl=te_dropless"]))
        methods["TE grouped GEMM"] = lambda x, w, gs: te.grouped_gemm(x, w, gs, "none")
    useful = 2 * rows * dim * hidden / 1e12
    out = {"shape": {"rows": rows, "dim": dim, "hidden": hidden, "experts": experts,
                     "max_over_mean_group": float(sizes.max() / sizes.mean())},
           "dense_bf16_tflops": dense_tflops(512 if smoke else 8192, repeats), "methods": {}}
    if te_missing:
        out["te"] = f"skipped: {te_missing}"
    for name, matmul in methods.items():
        fwd, fwd_bwd = gmm_bench.fwd_and_fwd_bwd(matmul)
        t_fwd = gmm_bench.time_calls(fwd, (x, w, group_sizes), repeats)["s"]
        t_fb = gmm_bench.time_calls(fwd_bwd, (x, w, group_sizes, ct), repeats)["s"]
        out["methods"][name] = {"fwd_tflops": useful / t_fwd, "fwd_bwd_tflops": 3 * useful / t_fb,
                                "fwd_s": t_fwd, "fwd_bwd_s": t_fb}
    return out


def check_moe_layer(smoke: bool) -> dict:
    """moe_layer's side-by-side run at a GPU size, with TFLOP/s of each impl's useful FLOPs."""
    t, d, f, e, k = (256, 64, 64, 8, 2) if smoke else (16384, 2048, 1024, 32, 8)
    argv = ["--tokens", str(t), "--dim", str(d), "--hidden", str(f), "--experts", str(e), "--top-k", str(k),
            "--dtype", "float32" if smoke else "bfloat16", "--repeats", "2" if smoke else "5"]
    result = moe_layer.main(argv)
    useful = 2 * 3 * t * k * d * f / 1e12
    for row in result["rows"]:
        row["fwd_tflops"], row["fwd_bwd_tflops"] = useful / row["fwd_s"], 3 * useful / row["fwd_bwd_s"]
    result["te_dropless_kernels"] = "reference (moe_layer times the pure-JAX references)"
    return result


def format_summary(report: dict) -> str:
    lines = [f"GPU check on {report['device_kind']} (jax {report['jax']}, TE: {report['te'] or 'available'})"]
    lines.append(f"1. TE kernels vs references: {report['kernels']['status']} "
                 f"{report['kernels'].get('summary', report['kernels'].get('reason', ''))}")
    agree = report["impls_agree"]
    lines.append(f"2. te_dropless ({agree['kernels']}) vs ragged, deepseek3-tiny: {agree['status']}, max relative "
                 f"loss difference {agree['max_relative_difference']:.2e} (tolerance {agree['tolerance']:.0e})")
    g = report["grouped_gemm"]
    lines.append(f"3. grouped GEMM {g['shape']}: dense bf16 matmul {g['dense_bf16_tflops']:.3g} TFLOP/s")
    for name, m in g["methods"].items():
        lines.append(f"   {name:<18} fwd {m['fwd_tflops']:8.3g} TFLOP/s ({m['fwd_tflops'] / g['dense_bf16_tflops']:.0%}"
                     f" of dense)   fwd+bwd {m['fwd_bwd_tflops']:8.3g} TFLOP/s")
    lines.append("4. MoE layer fwd+bwd")
    for row in report["moe_layer"]["rows"]:
        lines.append(f"   {row['method']:<26} fwd {row['fwd_tflops']:8.3g} TFLOP/s   fwd+bwd "
                     f"{row['fwd_bwd_tflops']:8.3g} TFLOP/s   dropped {row['dropped_fraction']:.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="gpu_check.json", help="where to write the JSON report")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: check the kit itself runs (any device)")
    p.add_argument("--tmp", default="/tmp/gpu_check_runs", help="output directory of the training runs")
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu" and not a.smoke:
        print(f"error: no NVIDIA GPU ({jax.default_backend()} backend); run on a GPU, or with --smoke to try the kit",
              file=sys.stderr)
        return 2
    te_missing = te_status()
    report = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "te": te_missing,
              "smoke": a.smoke}
    report["kernels"] = check_kernels(te_missing)
    report["impls_agree"] = check_impls_agree(te_missing, a.smoke, a.tmp)
    report["grouped_gemm"] = check_grouped_gemm(te_missing, a.smoke)
    report["moe_layer"] = check_moe_layer(a.smoke)
    print(format_summary(report))
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"JSON: {a.json}")
    failed = [part for part in ("kernels", "impls_agree") if report[part]["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

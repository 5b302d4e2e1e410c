"""The GPU validation kit: is the TE path correct here, and how fast is it? (`scripts/gpu_check.sh` runs it.)

    python -m MaxText.benchmarks.gpu_check [--json gpu_check.json] [--ep N] [--parts kernels,ep,...] [--smoke]

Parts, in the order they run (each in isolation: an exception or a failure is recorded with its first line,
and the next part runs):
1. kernels (correctness): the `gpu`-marked tests of tests/test_te_dropless.py and tests/test_attention_cudnn.py
   through pytest, in a subprocess. TE's own fused router (its probabilities and routing map) and
   te_dropless's top-k call site against router.select_experts (fp32, 1e-5); TE's grouped GEMM through
   te_dropless's call site, forward and backward with a random cotangent and a zero-padded tail, against a
   float64 per-group loop: bf16 at TE's tolerance, fp32 at a TF32-aware one, FP8 current scaling (SM 9.x on)
   and MXFP8 (SM 10.x only, else skipped with the reason) at quantisation tolerances; the reference grouped
   GEMM on the GPU; TE's token permutation (needs triton) against aligned_permute. TE's tests are left out,
   with the reason, where TE cannot be imported. attention=cudnn_flash (cuDNN's fused attention) against
   dot_product, forward and q/k/v gradients in bf16, GQA and MLA, packed documents and a row beyond its bound;
   and context parallelism's cuDNN block (tests/test_attention_cudnn_cp.py: a block of queries against the whole
   sequence's keys, its first document merged from two calls by cuDNN's softmax statistics) against dot_product.
2. ep (correctness, only with --ep N): MaxText.benchmarks.ep_check on N GPUs, one process each through
   scripts/launch.sh --local N: te_dropless with NCCL EP against te_kernels=reference and the float32
   per-expert loop, forward and gradients, three routings (<json>.ep.json); then TE's fused MoE block
   (te_moe_block=true, ep_check --block) against the float32 loop beside the composed path (<json>.ep_block.json).
3. impls_agree (correctness): a tiny DeepSeek-style model (MLA, sigmoid group-limited routing with bias,
   shared expert, MTP) trained a few bf16 steps with te_dropless and with ragged; the losses must agree.
4. batch_split (correctness and timing): one GPU, a 4-layer MoE model (D 2048, 32 experts of F 1024, 4 x 4096
   tokens, te_dropless) trained the same steps with the batch whole and in 2 parts (use_batch_split_schedule):
   the losses must agree; the step times give what splitting costs where there is no exchange to hide (the
   overlap itself needs EP over several GPUs, one process each: not in the kit yet).
5. grouped_gemm (timing): TFLOP/s at DeepSeek-V3 expert shapes (D 7168, F 2048, 32 local experts, Zipf-skewed
   routing of 8 experts per token) for jax.lax.ragged_dot and TE's grouped GEMM (groups rounded up to 128
   rows, as te_dropless feeds it), next to a bf16 8192^3 dense matmul measured in the same run.
6. moe_layer (timing): MoE layer forward+backward TFLOP/s per moe_impl (MaxText.benchmarks.moe_layer).
7. attention (timing): the attention core at DeepSeek-V3's MLA layer shape (1 x 4096 tokens, 128 heads, q/k
   head dim 192, v 128, bf16, one document), forward and forward+backward per `attention` impl (dot_product,
   chunked, cudnn_flash), TFLOP/s of the causal half's useful FLOPs, whether cuDNN's kernel is in the
   compiled step, and cudnn_flash's largest output difference from dot_product.
Prints one table, writes everything as JSON (always, even when a part raised), and exits 1 when a correctness
part failed or any part raised. `--smoke` shrinks every shape so the kit runs on a CPU (numbers meaningless):
`python -m MaxText.benchmarks.gpu_check --smoke`, about 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.benchmarks import grouped_matmul as gmm_bench, moe_layer, train_step
from MaxText.config.load import load_config
from MaxText.layers.moe import te_kernels, te_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORRECTNESS = ("kernels", "ep", "impls_agree", "batch_split")
KERNEL_TESTS_TIMEOUT_S = 480
EP_TIMEOUT_S = 480  # start-up of N processes, NCCL EP bootstrap, three compiles; a hung collective ends here


class Kit(NamedTuple):
    """What every part may read: why TE is missing (None if it imports), the options, where the JSON goes."""
    te_missing: str | None
    smoke: bool
    tmp: str
    ep: int | None
    json: str


def te_status() -> str | None:
    """None when TE's JAX modules import, else why not."""
    try:
        te_runtime.import_te()
    except te_runtime.TEUnavailable as e:
        return str(e)
    return None


def first_line(text: str) -> str:
    """The first line of a message (an exception's, a report's), at most 300 characters."""
    return (text.strip().splitlines() or ["(no message)"])[0][:300]


def last_line(text: str) -> str:
    """The last line of a subprocess's output, at most 300 characters."""
    return (text.strip().splitlines() or ["(no output)"])[-1][:300]


def run_subprocess(cmd, env, timeout_s: int):
    """(return code, output, timed out): cmd in its own process group, all of it killed on timeout
    (scripts/launch.sh --local starts one child per GPU)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return proc.returncode, out, True
    finally:
        if proc.poll() is None:  # this process is being ended (SIGTERM from `timeout`): take the group along
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def subprocess_env(**extra) -> dict:
    """This environment for a subprocess on the GPUs, plus `extra`."""
    # The subprocesses share this machine's GPUs with this process: none of them takes 75% of every GPU's
    # memory up front (JAX's default), which would leave the others too little.
    return dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **extra)


def check_kernels(kit: Kit) -> dict:
    """pytest -m gpu over the kernel tests (TE's where TE imports, cuDNN attention's), in a subprocess (its own
    JAX on the GPU)."""
    if jax.default_backend() != "gpu":  # --smoke on a CPU: every test would skip
        return {"status": "skipped", "reason": f"the kernel tests need an NVIDIA GPU ({jax.default_backend()} here)"}
    files = ([] if kit.te_missing else [os.path.join("tests", "test_te_dropless.py")]) + [
        os.path.join("tests", "test_attention_cudnn.py"), os.path.join("tests", "test_attention_cudnn_cp.py"),
        os.path.join("tests", "test_decode.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", "gpu", "-p", "no:cacheprovider", *files]
    rc, out, timed_out = run_subprocess(cmd, subprocess_env(JAX_PLATFORMS=""), KERNEL_TESTS_TIMEOUT_S)
    lines = out.strip().splitlines() or ["(no output)"]
    result = {"summary": lines[-1], "details": [line for line in lines if line.startswith(("FAILED", "ERROR",
                                                                                          "SKIPPED"))]}
    if kit.te_missing:
        result["details"].insert(0, f"TE's kernel tests left out: {first_line(kit.te_missing)}")
    if timed_out:
        return {**result, "status": "error", "error": f"pytest timed out after {KERNEL_TESTS_TIMEOUT_S} s",
                "output_tail": out[-4000:]}
    if rc == 0 and " passed" not in result["summary"]:  # every test skipped: nothing was checked
        return {**result, "status": "error", "error": f"no gpu test ran: {result['summary']}",
                "output_tail": out[-4000:]}
    return {**result, "status": "passed" if rc == 0 else "failed", "output_tail": out[-4000:] if rc else ""}


def check_ep(kit: Kit) -> dict:
    """MaxText.benchmarks.ep_check on kit.ep GPUs through scripts/launch.sh --local, three times: te_dropless's NCCL
    EP path, TE's fused MoE block (--block), and bounded buffers with the layer fallback over XLA's exchange in two
    hops (--fallback); their JSONs, summarised (passed when all passed)."""
    if not kit.ep:
        return {"status": "skipped", "reason": "NCCL EP is checked with --ep N (N >= 2 GPUs)"}
    if kit.te_missing:
        return {"status": "skipped", "reason": kit.te_missing}
    gpus = sum(d.platform == "gpu" for d in jax.devices())
    if kit.ep > gpus:
        return {"status": "error", "error": f"--ep {kit.ep} needs {kit.ep} GPUs, this process sees {gpus}"}
    launch = os.path.join(ROOT, "scripts", "launch.sh")
    with open(launch) as f:
        if "LAUNCH_MODULE" not in f.read():
            return {"status": "error", "error": "scripts/launch.sh starts MaxText.train only (no LAUNCH_MODULE); "
                                                "it cannot start MaxText.benchmarks.ep_check"}
    runs = (("nccl_ep", ".ep.json", []), ("te_moe_block", ".ep_block.json", ["--block"]),
            ("fallback_xla_exchange", ".ep_fallback.json", ["--fallback"]))
    results = {name: _launch_ep_check(kit, launch, suffix, args) for name, suffix, args in runs}
    # the step with NCCL EP on the N GPUs, the batch whole and in 2 parts (one part's exchange under the other's
    # compute): the overlap the model credits, timed (MaxText.benchmarks.train_step, process 0's report)
    results["batch_split_timing"] = _launch_ep_check(kit, launch, ".ep_split.json", split_timing_args(kit),
                                                     module="MaxText.benchmarks.train_step")
    statuses = {r["status"] for r in results.values()}
    status = "error" if "error" in statuses else "failed" if "failed" in statuses else "passed"
    return {"status": status, **results}


def split_timing_args(kit: Kit) -> list:
    """train_step's arguments for the batch_split timing on kit.ep GPUs: a 4-layer DeepSeek-style model on NCCL EP
    (all GPUs on `expert`, 8 experts each), the step with the batch whole and in 2 parts."""
    model = ["base_num_decoder_layers=4", "first_num_dense_layers=1", "base_emb_dim=2048", "base_num_query_heads=16",
             "base_num_kv_heads=8", "head_dim=128", "base_mlp_dim=8192", "base_moe_mlp_dim=1024",
             f"num_experts={8 * kit.ep}", "num_experts_per_tok=8", "vocab_size=32768", "max_target_length=4096",
             "per_device_batch_size=4", "dtype=bfloat16", "attention=cudnn_flash", "hardware=gpu_multiprocess",
             "ici_fsdp_parallelism=1", "ici_expert_parallelism=-1"]
    return ["configs/base.yml", *model, "--steps", "10", "--warmup", "2",
            "--impls", "te_dropless,te_dropless:use_batch_split_schedule=true:batch_split_factor=2"]


def _launch_ep_check(kit: Kit, launch: str, suffix: str, args: list, module: str = "MaxText.benchmarks.ep_check"):
    report_path = os.path.splitext(kit.json)[0] + suffix
    if os.path.exists(report_path):
        os.remove(report_path)  # never read a previous run's report
    env = subprocess_env(LAUNCH_MODULE=module, PYTHON=sys.executable, JAX_PLATFORMS="")
    rc, out, timed_out = run_subprocess(["bash", launch, "--local", str(kit.ep), "--json", report_path, *args], env,
                                        EP_TIMEOUT_S)
    result = {"ranks": kit.ep, "report_path": report_path, "output_tail": out[-4000:]}
    if timed_out:
        return {**result, "status": "error", "error": f"timed out after {EP_TIMEOUT_S} s (a hung collective?)"}
    if not os.path.exists(report_path):
        return {**result, "status": "error", "error": f"exit code {rc} and no report; last line: {last_line(out)}"}
    with open(report_path) as f:
        report = json.load(f)
    if report["status"] == "error":
        return {**result, "status": "error", "error": report["error"]}
    if report["status"] in ("passed", "measured") and rc != 0:
        return {**result, "status": "error", "report": report,
                "error": f"process 0 passed but a process exited with code {rc}; last line: {last_line(out)}"}
    return {**result, "status": report["status"], "report": report,
            "output_tail": "" if report["status"] == "passed" else result["output_tail"]}


def check_impls_agree(kit: Kit) -> dict:
    """Losses of te_dropless and ragged on deepseek3-tiny, bf16, same data and init."""
    from MaxText.trainer.loop import train

    steps = 3 if kit.smoke else 10
    base = ["model_name=deepseek3-tiny", "dtype=float32" if kit.smoke else "dtype=bfloat16", f"steps={steps}",
            "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false", "dataset_type=synthetic",
            "eval_interval=-1", "max_target_length=64", "per_device_batch_size=4", f"base_output_directory={kit.tmp}"]
    te = ["moe_impl=te_dropless"] + (["te_kernels=reference"] if kit.te_missing else [])
    runs = {}
    for name, extra in (("ragged", ["moe_impl=ragged"]), ("te_dropless", te)):
        cfg = load_config(base + extra + [f"run_name={name}_{int(time.time())}"])
        path = os.path.join(kit.tmp, cfg.run_name, "metrics", "metrics.jsonl")
        train(cfg, log=lambda *_: None, devices=jax.devices()[:1])
        with open(path) as f:
            runs[name] = [json.loads(line)["loss"] for line in f]
    a, b = np.array(runs["ragged"]), np.array(runs["te_dropless"])
    tol = 2e-4 if kit.smoke else 3e-2  # bf16: TE's grouped GEMM accumulates in another order than ragged_dot
    worst = float(np.max(np.abs(a - b) / np.abs(a)))
    return {"status": "passed" if worst <= tol else "failed", "kernels": "reference" if kit.te_missing else "TE",
            "losses": runs, "max_relative_difference": worst, "tolerance": tol}


def dense_tflops(n: int, repeats: int) -> float:
    """bf16 n x n x n matmul TFLOP/s on random data: the ceiling the grouped GEMMs are compared with."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds = gmm_bench.time_calls(jax.jit(jnp.matmul), (a, b), repeats)["s"]
    return 2 * n ** 3 / seconds / 1e12


def check_grouped_gemm(kit: Kit) -> dict:
    """fwd and fwd+bwd TFLOP/s of the grouped GEMMs at DeepSeek-V3's expert shapes."""
    tokens, dim, hidden, experts, top_k = (256, 256, 128, 8, 2) if kit.smoke else (4096, 7168, 2048, 32, 8)
    repeats = 2 if kit.smoke else 10
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
    if not kit.te_missing:
        te = te_kernels.kernels(load_config(["moe_impl=te_dropless"]))
        methods["TE grouped GEMM"] = lambda x, w, gs: te.grouped_gemm(x, w, gs, "none")
    useful = 2 * rows * dim * hidden / 1e12
    out = {"status": "done", "shape": {"rows": rows, "dim": dim, "hidden": hidden, "experts": experts,
                                       "max_over_mean_group": float(sizes.max() / sizes.mean())},
           "dense_bf16_tflops": dense_tflops(512 if kit.smoke else 8192, repeats), "methods": {}}
    if kit.te_missing:
        out["te"] = f"skipped: {kit.te_missing}"
    for name, matmul in methods.items():
        fwd, fwd_bwd = gmm_bench.fwd_and_fwd_bwd(matmul)
        t_fwd = gmm_bench.time_calls(fwd, (x, w, group_sizes), repeats)["s"]
        t_fb = gmm_bench.time_calls(fwd_bwd, (x, w, group_sizes, ct), repeats)["s"]
        out["methods"][name] = {"fwd_tflops": useful / t_fwd, "fwd_bwd_tflops": 3 * useful / t_fb,
                                "fwd_s": t_fwd, "fwd_bwd_s": t_fb}
    return out


def check_moe_layer(kit: Kit) -> dict:
    """moe_layer's side-by-side run at a GPU size, with TFLOP/s of each impl's useful FLOPs."""
    t, d, f, e, k = (256, 64, 64, 8, 2) if kit.smoke else (16384, 2048, 1024, 32, 8)
    argv = ["--tokens", str(t), "--dim", str(d), "--hidden", str(f), "--experts", str(e), "--top-k", str(k),
            "--dtype", "float32" if kit.smoke else "bfloat16", "--repeats", "2" if kit.smoke else "5"]
    result = moe_layer.main(argv)
    useful = 2 * 3 * t * k * d * f / 1e12
    for row in result["rows"]:
        row["fwd_tflops"], row["fwd_bwd_tflops"] = useful / row["fwd_s"], 3 * useful / row["fwd_bwd_s"]
    result["te_dropless_kernels"] = "reference (moe_layer times the pure-JAX references)"
    result["status"] = "done"
    return result


def check_attention(kit: Kit) -> dict:
    """fwd and fwd+bwd time of the attention core per `attention` impl at DeepSeek-V3's MLA layer shape."""
    from MaxText.layers.attention import attention

    b, length, h, kd, vd = (1, 256, 4, 32, 16) if kit.smoke else (1, 4096, 128, 192, 128)
    repeats = 2 if kit.smoke else 10
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (b, length, h, kd), jnp.bfloat16) for key in keys[:2])
    v, ct = (jax.random.normal(key, (b, length, h, vd), jnp.bfloat16) for key in keys[2:])
    segments = jnp.ones((b, length), jnp.int32)
    fwd_flops = 2 * b * h * length * (length + 1) // 2 * (kd + vd)  # the causal half: q k^T and p v
    out = {"status": "done", "shape": {"batch": b, "length": length, "heads": h, "qk_head_dim": kd,
                                       "v_head_dim": vd, "dtype": "bfloat16"}, "impls": {}}
    outputs = {}
    for impl in ("dot_product", "chunked", "cudnn_flash"):
        def attend(q, k, v, impl=impl):
            return attention(q, k, v, segments, impl=impl, chunk_size=512, scale=kd ** -0.5)

        def fwd_bwd(q, k, v, ct, attend=attend):
            y, vjp = jax.vjp(attend, q, k, v)
            return (y, *vjp(ct))
        fwd = jax.jit(attend)
        t_fwd = gmm_bench.time_calls(fwd, (q, k, v), repeats)["s"]
        t_fb = gmm_bench.time_calls(jax.jit(fwd_bwd), (q, k, v, ct), repeats)["s"]
        outputs[impl] = np.asarray(fwd(q, k, v), np.float32)
        out["impls"][impl] = {"fwd_s": t_fwd, "fwd_bwd_s": t_fb, "fwd_tflops": fwd_flops / t_fwd / 1e12,
                              "fwd_bwd_tflops": 3 * fwd_flops / t_fb / 1e12}
    compiled = jax.jit(lambda q, k, v: attention(q, k, v, segments, impl="cudnn_flash", chunk_size=512,
                                                 scale=kd ** -0.5)).lower(q, k, v).compile().as_text()
    out["cudnn_kernel"] = "__cudnn$fmha" in compiled
    reference = outputs["dot_product"]
    difference = np.abs(outputs["cudnn_flash"] - reference).max() / np.abs(reference).max()
    out["cudnn_flash_max_difference"] = float(difference)
    return out


def check_batch_split(kit: Kit) -> dict:
    """use_batch_split_schedule on one GPU: the same train step with the batch whole and in 2 parts, side by side
    (MaxText.benchmarks.train_step.measure: same init, same batch, same steps). One GPU has no EP exchange to hide,
    so this measures what the split costs (smaller GEMMs, more kernel launches), which the step-time model does not
    charge; the losses after the same steps must agree (bf16: 3e-2)."""
    size = (["base_emb_dim=64", "base_moe_mlp_dim=64", "max_target_length=64", "per_device_batch_size=4",
             "dtype=float32"] if kit.smoke else
            ["base_emb_dim=2048", "base_num_query_heads=16", "base_num_kv_heads=8", "head_dim=128",
             "base_mlp_dim=8192", "base_moe_mlp_dim=1024", "num_experts=32", "num_experts_per_tok=8",
             "vocab_size=32768", "max_target_length=4096", "per_device_batch_size=4", "dtype=bfloat16",
             "attention=cudnn_flash"])
    impl = ["moe_impl=te_dropless"] + (["te_kernels=reference"] if kit.te_missing else [])
    base = ["configs/base.yml", "base_num_decoder_layers=4", "first_num_dense_layers=1", *size, *impl]
    steps, warmup = (2, 1) if kit.smoke else (10, 2)
    rows = {}
    for name, split in (("whole", []), ("2 parts", ["use_batch_split_schedule=true", "batch_split_factor=2"])):
        rows[name] = train_step.measure(load_config([*base, *split]), steps, warmup, devices=jax.devices()[:1])
    whole, parts = rows["whole"], rows["2 parts"]
    tol = 1e-4 if kit.smoke else 3e-2
    difference = abs(parts["loss"] - whole["loss"]) / abs(whole["loss"])
    return {"status": "passed" if difference <= tol else "failed", "config": base, "rows": rows,
            "kernels": "reference" if kit.te_missing else "TE", "loss_relative_difference": difference,
            "tolerance": tol, "split_over_whole": parts["step_s"] / whole["step_s"]}


# Run in this order: the subprocess parts first, while this process holds little GPU memory.
PARTS = {"kernels": check_kernels, "ep": check_ep, "impls_agree": check_impls_agree,
         "batch_split": check_batch_split, "grouped_gemm": check_grouped_gemm, "moe_layer": check_moe_layer,
         "attention": check_attention}


def run_part(part, kit: Kit) -> dict:
    """One part, its exception recorded rather than raised, with its wall time."""
    start = time.perf_counter()
    try:
        result = part(kit)
    except Exception as e:  # noqa: BLE001 - one part's failure must not stop the others
        result = {"status": "error", "error": f"{type(e).__name__}: {first_line(str(e))}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def _ep_lines(check: str, r: dict) -> list[str]:
    """One ep_check run's lines: its worst error of the path under test, what fell out of tolerance, its table (a
    train_step timing: each variant's step time)."""
    if "report" not in r:
        return [f"{check}: {r['status']}: {r.get('error', '')}"]
    if r["report"]["status"] == "measured":
        return [f"{check}: {r['ranks']} GPUs, {row['impl']}: step {row['step_s'] * 1e3:.2f} ms, "
                f"{row['tflops_per_device']:.3g} TFLOP/s/GPU, loss {row['loss']:.5f}" for row in r["report"]["rows"]]
    rows, column = r["report"]["rows"], r["report"].get("columns", ["te_dropless"])[0]
    worst = max(rows, key=lambda row: row["te_vs_float32"] / row["tolerance"] if row["tolerance"] else 0.0)
    bad = [f"{row['routing']}/{row['quantity']}" for row in rows if not row["ok"]]
    return [f"{check}: {r['ranks']} GPUs, mesh {r['report']['mesh']}: worst {column} error "
            f"{worst['te_vs_float32']:.2e} ({worst['routing']}/{worst['quantity']}, tolerance {worst['tolerance']:.0e})"
            + (f"; out of tolerance: {', '.join(bad)}" if bad else ""), f"table: {r['report_path']}"]


def part_lines(name: str, r: dict) -> list[str]:
    """The detail lines of one finished part (its status line is format_summary's)."""
    if name == "kernels":
        return [r["summary"]] + r["details"]
    if name == "ep":
        return [line for check, run in r.items() if isinstance(run, dict) for line in _ep_lines(check, run)]
    if name == "impls_agree":
        return [f"te_dropless ({r['kernels']}) vs ragged on deepseek3-tiny: max relative loss difference "
                f"{r['max_relative_difference']:.2e} (tolerance {r['tolerance']:.0e})"]
    if name == "batch_split":
        lines = [f"{label:<8} step {row['step_s'] * 1e3:9.2f} ms {row['tflops_per_device']:8.3g} TFLOP/s   loss "
                 f"{row['loss']:.5f}" for label, row in r["rows"].items()]
        return lines + [f"2 parts take {r['split_over_whole']:.3f}x the whole batch's step ({r['kernels']} kernels, "
                        f"one device: no exchange to hide); losses {r['loss_relative_difference']:.1e} apart "
                        f"(tolerance {r['tolerance']:.0e})"]
    if name == "grouped_gemm":
        lines = [f"{r['shape']}: dense bf16 matmul {r['dense_bf16_tflops']:.3g} TFLOP/s"]
        for method, m in r["methods"].items():
            lines.append(f"{method:<18} fwd {m['fwd_tflops']:8.3g} TFLOP/s ({m['fwd_tflops'] / r['dense_bf16_tflops']:.0%}"
                         f" of dense)   fwd+bwd {m['fwd_bwd_tflops']:8.3g} TFLOP/s")
        return lines
    if name == "moe_layer":
        return [f"{row['method']:<26} fwd {row['fwd_tflops']:8.3g} TFLOP/s   fwd+bwd {row['fwd_bwd_tflops']:8.3g} "
                f"TFLOP/s   dropped {row['dropped_fraction']:.1%}" for row in r["rows"]]
    if name == "attention":
        lines = [f"{r['shape']}: cuDNN kernel {'in' if r['cudnn_kernel'] else 'NOT in'} the cudnn_flash step; its "
                 f"output differs from dot_product's by {r['cudnn_flash_max_difference']:.1e} of the largest"]
        base = r["impls"]["dot_product"]["fwd_bwd_s"]
        lines += [f"{impl:<12} fwd {m['fwd_s'] * 1e3:8.2f} ms {m['fwd_tflops']:7.3g} TFLOP/s   fwd+bwd "
                  f"{m['fwd_bwd_s'] * 1e3:8.2f} ms {m['fwd_bwd_tflops']:7.3g} TFLOP/s   ({base / m['fwd_bwd_s']:.2f}x "
                  "dot_product)" for impl, m in r["impls"].items()]
        return lines
    return []


def format_summary(report: dict) -> str:
    """The table: one status line per part that ran, with its details when it finished."""
    te = report["te"] or "available"
    lines = [f"GPU check on {report['device_kind']} (jax {report['jax']}, TE: {first_line(te)[:160]})"]
    for i, (name, r) in enumerate(report["parts"].items(), 1):
        kind = "correctness" if name in CORRECTNESS else "timing"
        status = r["status"]
        why = r.get("reason") or r.get("error")
        lines.append(f"{i}. {name} ({kind}): {status}{': ' + first_line(why)[:200] if why else ''}  "
                     f"[{r.get('seconds', 0):.0f} s]")
        if status in ("passed", "failed", "done") or (name == "kernels" and "details" in r):
            try:
                lines += ["   " + line for line in part_lines(name, r)]
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                lines.append(f"   (cannot summarise: {type(e).__name__}: {e}; see the JSON)")
    return "\n".join(lines)


def parse_parts(text: str) -> tuple:
    """--parts: comma-separated names of PARTS."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(PARTS)}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="gpu_check.json", help="where to write the JSON report")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: check the kit itself runs (any device)")
    p.add_argument("--tmp", default="/tmp/gpu_check_runs", help="output directory of the training runs")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="also check NCCL EP on N >= 2 GPUs of this machine (one process each)")
    p.add_argument("--parts", type=parse_parts, default=tuple(PARTS),
                   help=f"comma-separated subset of the parts to run (default: all of {','.join(PARTS)})")
    a = p.parse_args(argv)
    if a.ep is not None and a.ep < 2:
        p.error(f"--ep {a.ep}: NCCL EP needs at least 2 GPUs")
    # Before JAX starts its backend: this process would otherwise take 75% of every GPU's memory up front,
    # and the kernel tests and the EP ranks run beside it on the same GPUs.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.smoke and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # Smoke numbers mean nothing: skipping XLA's backend optimisations halves the kit's time on a CPU
        # (it is mostly compiling), 58 s -> 29 s.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    if jax.default_backend() != "gpu" and not a.smoke:
        print(f"error: no NVIDIA GPU ({jax.default_backend()} backend); run on a GPU, or with --smoke to try the kit",
              file=sys.stderr)
        return 2
    kit = Kit(te_status(), a.smoke, a.tmp, a.ep, a.json)
    report = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "te": kit.te_missing,
              "smoke": a.smoke, "parts": {}}
    try:
        for name in PARTS:  # in PARTS' order whatever the order of --parts
            if name in a.parts:
                report["parts"][name] = run_part(PARTS[name], kit)
    finally:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(format_summary(report))
        print(f"JSON: {a.json}")
    broken = [name for name, r in report["parts"].items() if r["status"] in ("failed", "error")]
    if broken:
        print(f"FAILED: {', '.join(broken)}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    # scripts/gpu_check.sh's `timeout` ends the kit with SIGTERM: leave through the finally blocks, which end
    # a running subprocess group and still write the JSON of the parts that finished.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    sys.exit(main())

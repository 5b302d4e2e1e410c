"""Time grouped_matmul's kernels against a dense matmul of the same useful FLOPs, on this machine's devices.

    python -m MaxText.benchmarks.grouped_matmul [--tokens 4096 --dim 512 --hidden 1024 --experts 8 --top-k 2
        --skew 1.0 --dtype float32 --repeats 5 --block-sizes 128,256,512 --json PATH]

Workload: tokens*top_k rows of x [R, D], sorted by expert, times w [E, D, F]. Expert popularity follows
Zipf(skew) (skew 0 = uniform) and every token picks top_k distinct experts (Gumbel top-k), as a router would.
- fwd: y = x @ w[group], the output in --dtype.
- fwd+bwd: y plus the gradients w.r.t. x and w for a random cotangent of y (three matmuls' worth of FLOPs).
- The limit: one dense x [R, D] @ w [D, F], fwd and fwd+bwd, i.e. the same useful FLOPs with no grouping.

Each method is jitted, run once to compile, then timed --repeats times with block_until_ready; the table
shows the median wall time and the limit's time divided by it. Process CPU time per call is recorded too:
CPU/wall well under the core count means something else shared the cores, and so does the load average
printed before and after. A JSON copy goes to stdout (one line) and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.benchmarks import emit
from MaxText.layers.moe.gmm import grouped_matmul


def zipf_group_sizes(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0) -> np.ndarray:
    """Rows per expert when each token picks top_k distinct experts, expert e with weight 1/(e+1)^skew."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"--top-k must be between 1 and --experts ({experts}), got {top_k}")
    rng = np.random.default_rng(seed)
    log_p_E = -skew * np.log(np.arange(1, experts + 1))
    # Gumbel top-k samples k distinct experts without replacement, in proportion to the weights.
    scores_TE = log_p_E + rng.gumbel(size=(tokens, experts))
    chosen_TK = np.argsort(-scores_TE, axis=1)[:, :top_k]
    return np.bincount(chosen_TK.reshape(-1), minlength=experts).astype(np.int32)


def time_calls(fn, args, repeats: int) -> dict:
    jax.block_until_ready(fn(*args))   # compile and warm up
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"s": statistics.median(wall), "min_s": min(wall), "cpu_per_wall": sum(cpu) / sum(wall)}


def fwd_and_fwd_bwd(matmul):
    """Jitted (fwd, fwd+bwd) of matmul(x, w, group_sizes); fwd+bwd returns y, dx and dw."""
    def fwd_bwd(x, w, group_sizes, ct):
        y, vjp = jax.vjp(lambda x, w: matmul(x, w, group_sizes), x, w)
        return (y, *vjp(ct))
    return jax.jit(matmul), jax.jit(fwd_bwd)


def run(args) -> dict:
    dtype = jnp.dtype(args.dtype)
    sizes_E = zipf_group_sizes(args.tokens, args.experts, args.top_k, args.skew)
    rows = args.tokens * args.top_k
    rng = np.random.default_rng(1)
    x_RD = jnp.asarray(rng.normal(size=(rows, args.dim)), dtype)
    w_EDF = jnp.asarray(rng.normal(size=(args.experts, args.dim, args.hidden)) / np.sqrt(args.dim), dtype)
    ct_RF = jnp.asarray(rng.normal(size=(rows, args.hidden)), dtype)
    group_sizes_E = jnp.asarray(sizes_E)

    def dense(x, w, _):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    methods = [("dense limit", dense, (x_RD, w_EDF[0]))]
    methods.append(("ragged_dot", lambda x, w, gs: grouped_matmul(x, w, gs, kernel="ragged_dot"), (x_RD, w_EDF)))
    for block in args.block_sizes:
        methods.append((f"block_sparse B={block}", lambda x, w, gs, block=block: grouped_matmul(
            x, w, gs, kernel="block_sparse", block_size=block), (x_RD, w_EDF)))

    load_before = os.getloadavg()
    results = []
    for name, matmul, (x, w) in methods:
        fwd, fwd_bwd = fwd_and_fwd_bwd(matmul)
        results.append({"method": name, "fwd": time_calls(fwd, (x, w, group_sizes_E), args.repeats),
                        "fwd_bwd": time_calls(fwd_bwd, (x, w, group_sizes_E, ct_RF), args.repeats)})
        print(f"  timed {name}", flush=True)
    limit = results[0]
    for r in results:
        r["fwd_fraction_of_limit"] = limit["fwd"]["s"] / r["fwd"]["s"]
        r["fwd_bwd_fraction_of_limit"] = limit["fwd_bwd"]["s"] / r["fwd_bwd"]["s"]
    useful_gflop = 2 * rows * args.dim * args.hidden / 1e9
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "group_sizes": sizes_E.tolist(),
            "rows": rows, "useful_gflop_fwd": useful_gflop, "useful_gflop_fwd_bwd": 3 * useful_gflop,
            "device": str(jax.devices()[0]), "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": results}


def format_table(report: dict) -> str:
    lines = [f"{report['rows']} rows, D={report['config']['dim']}, F={report['config']['hidden']}, "
             f"E={report['config']['experts']}, group sizes {report['group_sizes']}, {report['config']['dtype']}, "
             f"{report['device']}; load avg before {report['load_avg_before'][0]:.2f}, "
             f"after {report['load_avg_after'][0]:.2f}",
             f"{'method':<20} {'fwd s':>8} {'fwd+bwd s':>10} {'fwd frac':>9} {'f+b frac':>9} {'CPU/wall':>9}"]
    for r in report["results"]:
        lines.append(f"{r['method']:<20} {r['fwd']['s']:>8.4f} {r['fwd_bwd']['s']:>10.4f} "
                     f"{r['fwd_fraction_of_limit']:>8.0%} {r['fwd_bwd_fraction_of_limit']:>9.0%} "
                     f"{r['fwd_bwd']['cpu_per_wall']:>9.2f}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512, help="D, the input width")
    p.add_argument("--hidden", type=int, default=1024, help="F, the output width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity; 0 = uniform")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method after one warm-up call")
    p.add_argument("--block-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[128, 256, 512],
                   help="comma-separated block sizes of the block_sparse kernel")
    p.add_argument("--json", help="also write the JSON report to this file")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    print(format_table(report))
    emit(report, args.json)


if __name__ == "__main__":
    main()

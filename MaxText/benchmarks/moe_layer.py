"""Forward+backward time of one MoE layer's expert computation per `moe_impl`, beside the dense limit.

    python -m MaxText.benchmarks.moe_layer [--tokens 4096 --dim 512 --hidden 1024 --experts 8 --top-k 2
                                            --skew 1.0 --dtype float32 --repeats 5 --json PATH]

Every variant gets the same skewed routing (Zipf(skew) expert popularity, K distinct experts per token)
and the same weights. The limit is a plain SwiGLU on T*K rows with one expert's weights: the same useful
FLOPs with no routing at all. Prints a table and one JSON line; never part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.benchmarks import emit
from MaxText.config import load_config
from MaxText.layers.moe.block import MOE_FFNS, ExpertWeights
from MaxText.layers.moe.router import Routing


def skewed_routing(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0):
    """(experts_TK, weights_TK): Gumbel top-k over Zipf(skew) popularity, so every token's K are distinct."""
    rng = np.random.default_rng(seed)
    log_pop = -skew * np.log(np.arange(1, experts + 1))
    scores = log_pop[None, :] + rng.gumbel(size=(tokens, experts))
    chosen = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    return chosen, weights


def timed(fn, *args, repeats: int) -> float:
    """Median wall seconds of fn(*args) after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fwd_and_fwd_bwd(f, args, repeats: int) -> tuple[float, float]:
    """Seconds for f(*args) and for its value and gradients w.r.t. every float argument."""
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating))
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    return (timed(jax.jit(f), *args, repeats=repeats),
            timed(jax.jit(jax.value_and_grad(loss, argnums=floats)), *args, repeats=repeats))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    t, d, f, e, k = a.tokens, a.dim, a.hidden, a.experts, a.top_k
    dt = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (t, d), dt)
    w = ExpertWeights(*(jax.random.normal(kk, s, dt) * s[1] ** -0.5
                        for kk, s in zip(keys[1:], ((e, d, f), (e, d, f), (e, f, d)))))
    experts, weights = skewed_routing(t, e, k, a.skew)
    load = np.bincount(experts.reshape(-1), minlength=e)
    base = [f"num_experts={e}", f"num_experts_per_tok={k}", f"base_emb_dim={d}", f"base_moe_mlp_dim={f}",
            f"max_target_length={min(t, 1024)}", f"dtype={a.dtype}", "te_kernels=reference"]
    variants = {
        "dense cf=1.0": ("dense", ["capacity_factor=1.0"]),
        "dense cf=1.25": ("dense", ["capacity_factor=1.25"]),
        "dense no cap": ("dense", []),
        "ragged": ("ragged", []),
        "te_dropless (reference)": ("te_dropless", []),
    }
    rows = []

    def limit(x_rows, wi_0, wi_1, wo):
        return (jax.nn.silu(x_rows @ wi_0) * (x_rows @ wi_1)) @ wo

    x_rows = jnp.repeat(x, k, axis=0)
    fwd, fwd_bwd = fwd_and_fwd_bwd(limit, (x_rows, w.wi_0_EDF[0], w.wi_1_EDF[0], w.wo_EFD[0]), a.repeats)
    rows.append({"method": "dense matmul limit", "fwd_s": fwd, "fwd_bwd_s": fwd_bwd, "dropped_fraction": 0.0})
    for name, (impl, extra) in variants.items():
        cfg = load_config(base + [f"moe_impl={impl}", *extra])

        def run(x, weights_TK, wi_0, wi_1, wo, experts_TK, cfg=cfg, impl=impl):
            routing = Routing(weights_TK, experts_TK, jnp.zeros(()), jnp.zeros(()), jnp.zeros((e,)), jnp.zeros(()))
            return MOE_FFNS[impl](x, routing, ExpertWeights(wi_0, wi_1, wo), cfg)

        def layer(*args, run=run):
            return run(*args)[0]

        args = (x, jnp.asarray(weights), *w, jnp.asarray(experts))
        stats = jax.jit(lambda *args, run=run: run(*args)[1])(*args)
        fwd, fwd_bwd = fwd_and_fwd_bwd(layer, args, a.repeats)
        rows.append({"method": name, "fwd_s": fwd, "fwd_bwd_s": fwd_bwd,
                     "dropped_fraction": float(stats["overflow"]) / experts.size})
    for r in rows:
        r["fwd_vs_limit"] = rows[0]["fwd_s"] / r["fwd_s"]
        r["fwd_bwd_vs_limit"] = rows[0]["fwd_bwd_s"] / r["fwd_bwd_s"]
    result = {"shape": {"tokens": t, "dim": d, "hidden": f, "experts": e, "top_k": k, "skew": a.skew,
                        "dtype": a.dtype, "max_over_mean_load": float(load.max() / load.mean())},
              "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "rows": rows}
    print(f"MoE layer fwd+bwd, T={t} D={d} F={f} E={e} K={k} skew={a.skew} {a.dtype} "
          f"(max/mean expert load {result['shape']['max_over_mean_load']:.2f}), {result['device_kind']}")
    print(f"{'method':<26}{'fwd s':>10}{'fwd+bwd s':>12}{'fwd/limit':>11}{'fwd+bwd/limit':>15}{'dropped':>9}")
    for r in rows:
        print(f"{r['method']:<26}{r['fwd_s']:>10.4f}{r['fwd_bwd_s']:>12.4f}{r['fwd_vs_limit']:>10.0%}"
              f"{r['fwd_bwd_vs_limit']:>15.0%}{r['dropped_fraction']:>9.1%}")
    emit(result, a.json)
    return result


if __name__ == "__main__":
    main()

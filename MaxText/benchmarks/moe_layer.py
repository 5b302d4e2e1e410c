"""Forward+backward time of one MoE layer's expert computation per `moe_impl`, beside the dense limit; with
--ep, the expert-parallel dispatch one row per chosen expert against one row per destination device.

    python -m MaxText.benchmarks.moe_layer [--tokens 4096 --dim 512 --hidden 1024 --experts 8 --top-k 2
                                            --skew 1.0 --dtype float32 --repeats 5 --json PATH]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m MaxText.benchmarks.moe_layer --ep 4,8
                                            [--experts 64 --top-k 8 --groups 8 --keep-groups 4 ...]

Every variant gets the same skewed routing (Zipf(skew) expert popularity, K distinct experts per token)
and the same weights. The limit is a plain SwiGLU on T*K rows with one expert's weights: the same useful
FLOPs with no routing at all.

--ep N,M: `ragged` on every device (--tokens in all, split over them; expert = N, fsdp the rest), with
DeepSeek-V3's group-limited routing (the best --keep-groups of --groups expert groups, a group scored by the
sum of its two best experts), for ep_dedup=false and true side by side: rows sent per token (from the routing,
through the dispatch's own grouping), the bytes a ragged all-to-all moves per device per step for them (GPU:
dispatch and combine, forward and backward; self-sends included), the all-to-all bytes in the compiled
module (on CPU the emulation's fixed per-peer buffers: the receive buffers' size), XLA's temporary bytes and
the fwd+bwd time. Prints a table and one JSON line; never part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.parallel import sharding
from MaxText.benchmarks import emit
from MaxText.planning.collectives import count_collectives
from MaxText.config.load import load_config
from MaxText.layers.moe import ep as ep_lib
from MaxText.layers.moe.block import MOE_FFNS
from MaxText.layers.moe.experts import ExpertWeights
from MaxText.layers.moe.router import Routing


def skewed_routing(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0):
    """(experts_TK, weights_TK): Gumbel top-k over Zipf(skew) popularity, so every token's K are distinct."""
    rng = np.random.default_rng(seed)
    log_pop = -skew * np.log(np.arange(1, experts + 1))
    scores = log_pop[None, :] + rng.gumbel(size=(tokens, experts))
    chosen = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    return chosen, weights


def group_limited_routing(tokens: int, experts: int, top_k: int, groups: int, keep: int, skew: float,
                          seed: int = 0):
    """(experts_TK, weights_TK) as DeepSeek-V3 routes: Gumbel scores over Zipf(skew) popularity, the `keep`
    groups whose two best scores sum highest, then the top-k experts inside them."""
    rng = np.random.default_rng(seed)
    scores = -skew * np.log(np.arange(1, experts + 1))[None, :] + rng.gumbel(size=(tokens, experts))
    by_group = scores.reshape(tokens, groups, experts // groups)
    group_score = np.sort(by_group, axis=2)[:, :, -2:].sum(axis=2)
    kept = np.argsort(-group_score, axis=1)[:, :keep]
    mask = np.zeros((tokens, groups), bool)
    np.put_along_axis(mask, kept, True, axis=1)
    scores = np.where(np.repeat(mask, experts // groups, axis=1), scores, -np.inf)
    chosen = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    return chosen, rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)


def given_routing(weights_TK, experts_TK, num_experts: int) -> Routing:
    """A Routing of these choices and weights, its losses and statistics zero (the layer reads only these two)."""
    zero = jnp.zeros(())
    return Routing(weights_TK, experts_TK, zero, zero, jnp.zeros((num_experts,)), zero)


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


def ep_rows(a, base, x, w, experts, weights) -> list[dict]:
    """The --ep rows: ragged on all devices, expert = each of a.ep, one row per choice vs per device."""
    devices = jax.device_count()
    t, k, e, d = x.shape[0], experts.shape[1], w.wi_0_EDF.shape[0], x.shape[1]
    rows = []
    for n in (int(v) for v in a.ep.split(",")):
        for dedup in (False, True):
            cfg = load_config(base + ["moe_impl=ragged", f"ici_expert_parallelism={n}",
                                      f"ici_fsdp_parallelism={devices // n}", f"ep_dedup={str(dedup).lower()}"])
            mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
            grouped = ep_lib.rank_rows(experts, weights, e // n, n, dedup)
            rows_per_token = float(np.sum(np.asarray(grouped.dest_TQ) < n)) / t
            capacity = ep_lib.peer_capacity(t // devices, k, e, e // n, cfg.ragged_buffer_factor, dedup)

            def layer(x, weights_TK, wi_0, wi_1, wo, experts_TK, cfg=cfg, rules=rules):
                routing = given_routing(weights_TK, experts_TK, e)
                return MOE_FFNS["ragged"](x, routing, ExpertWeights(wi_0, wi_1, wo), cfg, rules)[0]

            loss = lambda *args, layer=layer: jnp.sum(layer(*args).astype(jnp.float32))  # noqa: E731
            with jax.set_mesh(mesh):
                tokens = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", None), rules))
                args = (*(jax.device_put(v, tokens) for v in (x, jnp.asarray(weights))), *w,
                        jax.device_put(jnp.asarray(experts), tokens))
                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
                compiled = step.lower(*args).compile()
                found, _ = count_collectives(compiled.as_text(), devices)
                memory = compiled.memory_analysis()
                fwd_bwd = timed(compiled, *args, repeats=a.repeats)
            # Dispatch and combine each move every row once forward and once backward (their transposes).
            row_bytes = d * x.dtype.itemsize
            rows.append({"ep": n, "ep_dedup": dedup, "rows_per_token": rows_per_token,
                         "ragged_bytes_per_device": 4 * rows_per_token * (t // devices) * row_bytes,
                         "hlo_all_to_all_bytes_per_device": sum(c.bytes * c.count for c in found
                                                                if c.kind in ("all-to-all", "ragged-all-to-all")),
                         "receive_rows_per_device": n * capacity.rows,
                         "temp_bytes": memory.temp_size_in_bytes if memory else None, "fwd_bwd_s": fwd_bwd})
    return rows


def print_ep(result: dict) -> None:
    sh = result["shape"]
    print(f"EP dispatch, ragged, T={sh['tokens']} over {result['devices']} devices, D={sh['dim']} F={sh['hidden']} "
          f"E={sh['experts']} K={sh['top_k']}, {sh['groups']} groups keep {sh['keep_groups']}, {sh['dtype']}, "
          f"{result['device_kind']}")
    print(f"{'EP':>3} {'rows per':<15}{'rows/token':>11}{'ragged MB/dev':>15}{'HLO a2a MB/dev':>16}"
          f"{'recv rows':>11}{'temp MB':>9}{'fwd+bwd s':>11}")
    for r in result["ep_rows"]:
        temp = f"{r['temp_bytes'] / 2**20:>9.1f}" if r["temp_bytes"] is not None else f"{'-':>9}"
        print(f"{r['ep']:>3} {'device' if r['ep_dedup'] else 'chosen expert':<15}{r['rows_per_token']:>11.2f}"
              f"{r['ragged_bytes_per_device'] / 2**20:>15.2f}{r['hlo_all_to_all_bytes_per_device'] / 2**20:>16.2f}"
              f"{r['receive_rows_per_device']:>11}{temp}{r['fwd_bwd_s']:>11.4f}")


def main(argv=None) -> dict | int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=None, help="default 8; 64 with --ep")
    p.add_argument("--top-k", type=int, default=None, help="default 2; 8 with --ep")
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ep", default=None, help="comma-separated expert-parallel sizes: the EP dispatch comparison")
    p.add_argument("--groups", type=int, default=8, help="--ep: routing groups (DeepSeek-V3: 8)")
    p.add_argument("--keep-groups", type=int, default=4, help="--ep: groups each token may use (DeepSeek-V3: 4)")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    t, d, f = a.tokens, a.dim, a.hidden
    e = a.experts or (64 if a.ep else 8)
    k = a.top_k or (8 if a.ep else 2)
    dt = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (t, d), dt)
    w = ExpertWeights(*(jax.random.normal(kk, s, dt) * s[1] ** -0.5
                        for kk, s in zip(keys[1:], ((e, d, f), (e, d, f), (e, f, d)))))
    base = [f"num_experts={e}", f"num_experts_per_tok={k}", f"base_emb_dim={d}", f"base_moe_mlp_dim={f}",
            f"max_target_length={min(t, 1024)}", f"dtype={a.dtype}", "te_kernels=reference"]
    if a.ep:
        sizes = [int(v) for v in a.ep.split(",")]
        need = max(sizes)
        if jax.device_count() < need or any(jax.device_count() % n or e % n for n in sizes) or t % jax.device_count():
            print(f"error: --ep {a.ep} needs a device count that each size divides (have {jax.device_count()}; on "
                  f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8), --experts and --tokens divisible "
                  "by them", file=sys.stderr)
            return 2
        experts, weights = group_limited_routing(t, e, k, a.groups, a.keep_groups, a.skew)
        result = {"shape": {"tokens": t, "dim": d, "hidden": f, "experts": e, "top_k": k, "groups": a.groups,
                            "keep_groups": a.keep_groups, "skew": a.skew, "dtype": a.dtype},
                  "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                  "devices": jax.device_count(), "ep_rows": ep_rows(a, base, x, w, experts, weights)}
        print_ep(result)
        emit(result, a.json)
        return result
    experts, weights = skewed_routing(t, e, k, a.skew)
    load = np.bincount(experts.reshape(-1), minlength=e)
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
            routing = given_routing(weights_TK, experts_TK, e)
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
    out = main()
    raise SystemExit(out if isinstance(out, int) else 0)

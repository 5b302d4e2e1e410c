"""NCCL EP check: te_dropless's MoE layer with Transformer Engine kernels and expert parallelism over N GPUs
(TE's ep_dispatch / ep_combine around its grouped GEMMs, one process per GPU), forward and gradients, against
the same layer with te_kernels=reference on the same mesh and against the float32 per-expert loop
(tests/moe_reference.py).

    bash scripts/gpu_check.sh --ep N                                         # the usual way (part of the kit)
    LAUNCH_MODULE=MaxText.benchmarks.ep_check scripts/launch.sh --local N [--json ep_check.json]

Every process builds the mesh (expert = N, the batch split over it), calls bootstrap_ep inside jax.set_mesh and
mesh_context as MaxText.train does, and runs a small bf16 problem (D = F = 256, 8 experts per GPU, K = 4, 256
tokens per GPU) under three routings: uniform, skewed (Zipf 1.5: some experts get nothing) and all-to-one
(every token's first choice is expert 3, so one GPU receives every token). Each output and gradient (x, the
combine weights, wi_0, wi_1, wo) must be within TE's EP-test tolerances of the float32 loop, as a normalised
max error max|got - want| / max|want|: 5e-2 for the output, 1e-1 for the gradients; no slot may overflow.
Process 0 prints the table and writes the JSON; the exit code is 1 on any mismatch, 2 when it cannot run.
`--kernels reference` runs the same check without TE (any platform with >= 2 devices): a dry run of the check.

`--fallback` checks te_dropless's bounded buffers with moe_dropless_fallback=layer instead (ragged_buffer_factor=1,
so the skewed and all-to-one routings fall back): TE's router and grouped GEMMs around XLA's ragged all-to-all on the
GPUs, in two hops (ep_two_hop, the N GPUs as 2 slices) when N >= 4; nothing may overflow. tests/test_two_hop.py and
tests/test_dropless_fallback.py run the same on 8 CPU devices.

`--block` checks TE's fused MoE block (te_moe_block=true) instead: the block routes itself, so each routing is
set by a selection bias on DeepSeek-V3's sigmoid router (none; the last quarter of the experts never chosen; every
token's first choice expert 3), and the block's output and gradients (x, the gate, wi_0, wi_1, wo) are held to the
same tolerances against the float32 loop on the composed path's choice, beside the composed te_dropless path on
TE's kernels (`--te-gmm-quantization mxfp8` on Blackwell: 0.2 both). tests/test_te_block.py runs it on 8 CPU
devices with TE's Python on the references and NCCL EP through the double.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NamedTuple

import numpy as np

OUT_TOL, GRAD_TOL = 5e-2, 1e-1  # TE's tests/jax/test_te_ep_moe.py: forward 5e-2, FFN gradients 1e-1 (bf16)
ROUTINGS = ("uniform", "skewed", "all_to_one")
QUANTITIES = ("y", "dx", "dweights", "dwi_0", "dwi_1", "dwo")
BLOCK_QUANTITIES = ("y", "dx", "dgate", "dwi_0", "dwi_1", "dwo")
BLOCK_ROUTING = ("routed_score_func=sigmoid", "routed_bias=true", "norm_topk_prob=true")
MXFP8_TOL = 0.2  # e4m3 in 32-element blocks, both ways (tests/test_te_block.py measured 0.083 on CPU)


class Problem(NamedTuple):
    """The layer's sizes. NCCL EP wants the expert count a multiple of 4 (TE's EP tests) and hidden_dim in bf16."""
    dim: int = 256
    hidden: int = 256
    experts_per_rank: int = 8
    top_k: int = 4
    seq: int = 128
    batch_per_rank: int = 2


def layer_config(problem: Problem, num_ranks: int, kernels: str, *extra: str):
    """te_dropless with `kernels` on a mesh of num_ranks devices, all on `expert` (the batch split over it)."""
    from MaxText.config.load import load_config

    return load_config([
        "moe_impl=te_dropless", f"te_kernels={kernels}", f"num_experts={problem.experts_per_rank * num_ranks}",
        f"num_experts_per_tok={problem.top_k}", f"base_emb_dim={problem.dim}", f"base_moe_mlp_dim={problem.hidden}",
        f"max_target_length={problem.seq}", f"per_device_batch_size={problem.batch_per_rank}", "dtype=bfloat16",
        "ici_fsdp_parallelism=1", "ici_expert_parallelism=-1", *extra])


def fallback_overrides(num_ranks: int) -> tuple:
    """--fallback: bounded buffers (the balanced load) with the layer fallback, over 2 slices in two hops when the
    ranks split into slices of 2 or more."""
    hops = ("dcn_expert_parallelism=2", "ep_two_hop=true") if num_ranks >= 4 else ()
    return ("ragged_buffer_factor=1.0", "moe_dropless_fallback=layer", *hops)


def host_inputs(problem: Problem, num_experts: int, tokens: int, routing: str, seed: int = 0) -> dict:
    """The same numpy arrays in every process: x, expert weights (float32, as the model keeps them), the
    routing (K distinct experts per token, weights in [0.1, 1]) and the output cotangent."""
    from MaxText.benchmarks.moe_layer import skewed_routing

    rng = np.random.default_rng(seed)
    d, f, k = problem.dim, problem.hidden, problem.top_k
    if routing == "uniform":
        experts = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k]
    elif routing == "skewed":
        experts = skewed_routing(tokens, num_experts, k, skew=1.5, seed=seed)[0]
    else:  # all_to_one: first choice expert 3, the other K-1 distinct among the rest
        others = np.argsort(rng.random((tokens, num_experts - 1)), axis=1)[:, :k - 1]
        experts = np.concatenate([np.full((tokens, 1), 3), others + (others >= 3)], axis=1)
    return {"x": rng.normal(size=(tokens, d)).astype(np.float32),
            "wi_0": (rng.normal(size=(num_experts, d, f)) / np.sqrt(d)).astype(np.float32),
            "wi_1": (rng.normal(size=(num_experts, d, f)) / np.sqrt(d)).astype(np.float32),
            "wo": (rng.normal(size=(num_experts, f, d)) / np.sqrt(f)).astype(np.float32),
            "experts": experts.astype(np.int32),
            "weights": rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32),
            "cotangent": rng.normal(size=(tokens, d)).astype(np.float32),
            "gate": (rng.normal(size=(d, num_experts)) / np.sqrt(d)).astype(np.float32),
            "bias": block_bias(routing, num_experts)}


def block_bias(routing: str, num_experts: int):
    """The selection bias that routes TE's block (--block): none, skewed (the last quarter of the experts never
    chosen, the first ones favoured), all-to-one (expert 3 every token's first choice, the last expert its second)."""
    if routing == "uniform":
        return np.zeros(num_experts, np.float32)
    if routing == "skewed":
        bias = np.linspace(0.3, 0.0, num_experts)
        bias[-(num_experts // 4):] = -5.0
        return bias.astype(np.float32)
    bias = np.full(num_experts, -5.0, np.float32)
    bias[3], bias[-1] = 5.0, 4.0
    return bias


def device_inputs(host: dict, mesh, rules) -> dict:
    """Global arrays: token arrays split over the batch axes, expert weights over `expert`; x and the
    cotangent in bf16. Built from callbacks, so it works with one process per GPU."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from MaxText.parallel import sharding

    tokens = NamedSharding(mesh, sharding.logical_to_spec(("activation_batch", None), rules))
    experts = NamedSharding(mesh, P("expert", None, None))
    whole = NamedSharding(mesh, P())
    out = {}
    for name, value in host.items():
        if name in ("x", "cotangent"):
            value = value.astype(jnp.bfloat16)
        target = experts if name in ("wi_0", "wi_1", "wo") else whole if name in ("gate", "bias") else tokens
        out[name] = jax.make_array_from_callback(value.shape, target, lambda index, v=value: v[index])
    return out


def layer_step(cfg, rules):
    """(x, wi_0, wi_1, wo, experts, weights, cotangent) -> (y, (dx, dweights, dwi_0, dwi_1, dwo), overflow)
    of dropless.moe_ffn under cfg's kernels; trace it inside jax.set_mesh and te_runtime.mesh_context."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from MaxText.layers.moe import dropless
    from MaxText.layers.moe.experts import ExpertWeights
    from MaxText.layers.moe.router import Routing

    def step(x, wi_0, wi_1, wo, experts, weights, cotangent):
        def layer(x, weights, wi_0, wi_1, wo):
            routing = Routing(weights, experts, jnp.zeros(()), jnp.zeros(()), jnp.zeros((wi_0.shape[0],)),
                              jnp.zeros(()))
            return dropless.moe_ffn(x, routing, ExpertWeights(wi_0, wi_1, wo), cfg, rules)

        y, vjp, stats = jax.vjp(layer, x, weights, wi_0, wi_1, wo, has_aux=True)
        # Replicated, so every process can read it (one process per GPU).
        return y, vjp(cotangent), jax.lax.with_sharding_constraint(stats["overflow"].astype(jnp.float32), P())

    return jax.jit(step)


def block_step(cfg, rules, seq: int):
    """(x, gate, wi_0, wi_1, wo, bias, cotangent) -> (y, (dx, dgate, dwi_0, dwi_1, dwo), overflow, experts): TE's
    fused block (cfg.te_moe_block), else the composed path routed on the block's logits; `experts` is the choice."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from MaxText.layers.moe import dropless, te_block, te_kernels
    from MaxText.layers.moe.experts import ExpertWeights
    from MaxText.layers.moe.router import route

    def step(x, gate, wi_0, wi_1, wo, bias, cotangent):
        def layer(x, gate, wi_0, wi_1, wo):
            w = ExpertWeights(wi_0, wi_1, wo)
            routing = route(x, gate, bias, cfg, topk=te_kernels.kernels(cfg).topk, logits=te_block.gate_logits)
            if cfg.te_moe_block:
                y, stats = te_block.moe_ffn(x.reshape(-1, seq, x.shape[-1]), gate, bias, w, cfg, rules)
            else:
                y, stats = dropless.moe_ffn(x, routing, w, cfg, rules)
            return y, (stats["overflow"], routing.experts_TK)

        y, vjp, (overflow, experts) = jax.vjp(layer, x, gate, wi_0, wi_1, wo, has_aux=True)
        return y, vjp(cotangent), jax.lax.with_sharding_constraint(overflow.astype(jnp.float32), P()), experts

    return jax.jit(step)


def float32_block_step(scaling: float):
    """The float32 loop on a given choice, its weights DeepSeek's (sigmoid, renormalised, scaled) from the block's
    logits: (x, gate, wi_0, wi_1, wo, experts, cotangent) -> (y, (dx, dgate, dwi_0, dwi_1, dwo), 0)."""
    import jax
    import jax.numpy as jnp

    from MaxText.layers.moe.te_block import gate_logits
    from tests.moe_reference import moe_reference

    def step(x, gate, wi_0, wi_1, wo, experts, cotangent):
        def layer(x, gate, wi_0, wi_1, wo):
            weights = jnp.take_along_axis(jax.nn.sigmoid(gate_logits(x, gate)), experts, axis=-1)
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * scaling
            return moe_reference(x.astype(jnp.float32), weights, experts, wi_0, wi_1, wo)

        y, vjp = jax.vjp(layer, x, gate, wi_0, wi_1, wo)
        return y, vjp(cotangent.astype(jnp.float32)), jnp.zeros(())

    return jax.jit(step)


def float32_step():
    """The same outputs and gradients from tests/moe_reference.py's float32 per-expert loop."""
    import jax
    import jax.numpy as jnp

    from tests.moe_reference import moe_reference

    def step(x, wi_0, wi_1, wo, experts, weights, cotangent):
        def layer(x, weights, wi_0, wi_1, wo):
            return moe_reference(x.astype(jnp.float32), weights, experts, wi_0, wi_1, wo)

        y, vjp = jax.vjp(layer, x, weights, wi_0, wi_1, wo)
        return y, vjp(cotangent.astype(jnp.float32)), jnp.zeros(())

    return jax.jit(step)


def normalised_errors(mesh):
    """max|got - want| / max|want| of each output pair, reduced on the devices and replicated, so every process
    reads the same numbers without gathering the arrays."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def errors(got, want):
        def one(g, w):
            g, w = g.astype(jnp.float32), w.astype(jnp.float32)
            return jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), jnp.finfo(jnp.float32).tiny)

        return jnp.stack([one(g, w) for g, w in zip(got, want)])

    return jax.jit(errors, out_shardings=NamedSharding(mesh, P()))


def flat(outputs):
    """(y, grads, overflow[, experts]) -> the arrays in QUANTITIES order (grads come as x, weights or the gate, wi_0,
    wi_1, wo)."""
    y, grads = outputs[:2]
    return (y, *grads)


def run(problem: Problem, cfg_te, cfg_ref, log=print) -> dict:
    """Builds the mesh, bootstraps NCCL EP (a no-op for reference kernels), runs every routing under cfg_te's
    and cfg_ref's kernels and the float32 loop; returns the report (status passed or failed)."""
    import jax

    from MaxText.parallel import sharding
    from MaxText.config.load import global_batch_size
    from MaxText.layers.moe import te_runtime

    mesh, rules = sharding.create_mesh(cfg_te), sharding.axis_rules(cfg_te)
    global_batch = global_batch_size(cfg_te, mesh.devices.size)
    tokens = global_batch * problem.seq
    block = bool(cfg_te.te_moe_block)
    out_tol, grad_tol = (MXFP8_TOL, MXFP8_TOL) if cfg_te.te_gmm_quantization == "mxfp8" else (OUT_TOL, GRAD_TOL)
    report = {"problem": problem._asdict(), "mesh": dict(mesh.shape), "num_experts": cfg_te.num_experts,
              "tokens": tokens, "kernels": cfg_te.te_kernels, "device_kind": jax.devices()[0].device_kind,
              "columns": ["te_moe_block", "te_dropless"] if block else ["te_dropless", "reference"],
              "te_gmm_quantization": cfg_te.te_gmm_quantization,
              "tolerances": {"y": out_tol, "gradients": grad_tol}, "rows": []}
    with jax.set_mesh(mesh), te_runtime.mesh_context(cfg_te):
        te_runtime.bootstrap_ep(cfg_te, mesh, global_batch)
        if block:
            steps = {"te": block_step(cfg_te, rules, problem.seq), "reference": block_step(cfg_ref, rules, problem.seq),
                     "float32": float32_block_step(cfg_te.routed_scaling_factor)}
        else:
            steps = {"te": layer_step(cfg_te, rules), "reference": layer_step(cfg_ref, rules),
                     "float32": float32_step()}
        errors = normalised_errors(mesh)
        for routing in ROUTINGS:
            args = device_inputs(host_inputs(problem, cfg_te.num_experts, tokens, routing), mesh, rules)
            if block:
                common = [args[n] for n in ("x", "gate", "wi_0", "wi_1", "wo")]
                out = {name: steps[name](*common, args["bias"], args["cotangent"]) for name in ("te", "reference")}
                out["float32"] = steps["float32"](*common, out["reference"][3], args["cotangent"])
            else:
                args = [args[n] for n in ("x", "wi_0", "wi_1", "wo", "experts", "weights", "cotangent")]
                out = {name: step(*args) for name, step in steps.items()}
            te_err = np.asarray(errors(flat(out["te"]), flat(out["float32"])))
            ref_err = np.asarray(errors(flat(out["reference"]), flat(out["float32"])))
            overflow = {name: float(out[name][2]) for name in ("te", "reference")}
            for i, quantity in enumerate(BLOCK_QUANTITIES if block else QUANTITIES):
                tol = out_tol if quantity == "y" else grad_tol
                ok = bool(te_err[i] <= tol and ref_err[i] <= tol)  # False for NaN too
                report["rows"].append({"routing": routing, "quantity": quantity, "te_vs_float32": float(te_err[i]),
                                       "reference_vs_float32": float(ref_err[i]), "tolerance": tol, "ok": ok})
            report["rows"].append({"routing": routing, "quantity": "overflow", "te_vs_float32": overflow["te"],
                                   "reference_vs_float32": overflow["reference"], "tolerance": 0.0,
                                   "ok": overflow["te"] == 0.0 and overflow["reference"] == 0.0})
            log(f"routing {routing}: done")
    report["status"] = "passed" if all(row["ok"] for row in report["rows"]) else "failed"
    return report


def format_table(report: dict) -> str:
    what = "TE's fused MoE block" if report.get("columns", [""])[0] == "te_moe_block" else "NCCL EP"
    lines = [f"{what} check on {report['device_kind']}: mesh {report['mesh']}, {report['num_experts']} experts, "
             f"{report['tokens']} tokens, kernels={report['kernels']}: {report['status']}",
             "normalised max error max|got - want| / max|want| against the float32 per-expert loop "
             "(overflow: slots that did not fit)",
             f"{'routing':<11} {'quantity':<9} {report['columns'][0]:>12} {report['columns'][1]:>12} "
             f"{'tolerance':>10}  ok"]
    for row in report["rows"]:
        lines.append(f"{row['routing']:<11} {row['quantity']:<9} {row['te_vs_float32']:12.3e} "
                     f"{row['reference_vs_float32']:12.3e} {row['tolerance']:10.1e}  {'yes' if row['ok'] else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="ep_check.json", help="where process 0 writes the report")
    p.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                   help="auto: TE's kernels and NCCL EP (NVIDIA GPUs); reference: a dry run of the check without TE")
    p.add_argument("--experts-per-rank", type=int, default=Problem().experts_per_rank)
    p.add_argument("--top-k", type=int, default=Problem().top_k)
    p.add_argument("--block", action="store_true", help="check TE's fused MoE block (te_moe_block=true) instead")
    p.add_argument("--fallback", action="store_true",
                   help="check bounded buffers with moe_dropless_fallback=layer over XLA's exchange instead")
    p.add_argument("--te-gmm-quantization", choices=("none", "mxfp8"), default="none",
                   help="the grouped GEMMs' precision under --block (mxfp8: Blackwell)")
    a = p.parse_args(argv)
    problem = Problem(experts_per_rank=a.experts_per_rank, top_k=a.top_k)

    from MaxText.benchmarks import emit
    from MaxText.config.errors import ConfigError
    from MaxText.config.load import apply_xla_flags
    from MaxText.parallel.distributed import maybe_initialize_distributed

    try:
        base = layer_config(problem, 1, a.kernels)
        apply_xla_flags(base)  # before anything starts the JAX backend
        maybe_initialize_distributed(base)  # one process per GPU (scripts/launch.sh): jax.distributed
        import jax

        from MaxText.layers.moe import te_runtime

        n = jax.device_count()
        if n < 2:
            raise ConfigError(f"the NCCL EP check needs >= 2 devices (one process per GPU), this job has {n}; "
                              "run bash scripts/gpu_check.sh --ep N")
        if a.block:
            extra = (*BLOCK_ROUTING, f"te_gmm_quantization={a.te_gmm_quantization}")
            cfg_te = layer_config(problem, n, a.kernels, *extra, "te_moe_block=true")
            cfg_ref = layer_config(problem, n, a.kernels, *extra)
        elif a.fallback:
            extra = fallback_overrides(n)
            cfg_te, cfg_ref = layer_config(problem, n, a.kernels, *extra), layer_config(problem, n, "reference", *extra)
        else:
            cfg_te, cfg_ref = layer_config(problem, n, a.kernels), layer_config(problem, n, "reference")
        te_runtime.check_available(cfg_te)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    primary = jax.process_index() == 0
    try:
        report = run(problem, cfg_te, cfg_ref, log=print if primary else (lambda *_: None))
    except Exception as e:  # noqa: BLE001 - reported in the JSON; the other processes may hang, gpu_check times out
        report = {"status": "error", "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
                  "traceback": traceback.format_exc()[-4000:]}
        print(report["traceback"], file=sys.stderr)
    if primary:
        if report["status"] != "error":
            print(format_table(report))
        emit(report, a.json)
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())

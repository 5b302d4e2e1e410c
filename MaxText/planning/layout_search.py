"""Which layout trains a recipe fastest: `python -m MaxText.plan <recipe.yml> --search [num_devices=N] [--json]`.

Enumerates this trainer's layouts for the recipe's GPUs (its gpu_profile): tensor parallelism inside a host,
expert parallelism over powers of two dividing num_experts (inside a slice first, then across slices), for
sequences of LONG tokens or more context parallelism inside a slice (each sequence split over 2, 4 or 8 GPUs, a
device then holding a fraction of one), FSDP over the rest; sequences per device; the recipe's remat policy and
`full`; the batch whole or in two parts (use_batch_split_schedule); with a bounded receive buffer
(ragged_buffer_factor), overflow counted as the recipe has it or either moe_dropless_fallback, which drops nothing
(its rerun program must fit too; across slices its exchange in two hops, ep_two_hop). The state is traced once
(twice with context parallelism; its shardings come from the logical rules, whatever the sizes), so each candidate
costs only MaxText.plan's byte counts and
MaxText.planning.steptime's model. Keeps the candidates that fit (at most HEADROOM of HBM), ranks them by modelled
tokens/s/GPU and prints the best as `key=value` overrides for the recipe.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import NamedTuple

from MaxText.config.errors import ConfigError
from MaxText.config.hardware import GPU_PROFILES, hosts_per_slice
from MaxText.config.load import load_config
from MaxText.config.schema import DROPLESS_FALLBACKS
from MaxText.parallel import sharding
from MaxText.planning import steptime
from MaxText.planning.params import parameter_counts
from MaxText.planning.plan import (GIB, HEADROOM, abstract_mesh, device_bytes, fallback_bytes, modelled_step,
                                   planned_devices)
from MaxText.step.state import state_spec

BATCHES = (1, 2, 4, 6, 8)  # sequences per device; with context parallelism c, per context group (c devices)
TENSOR = (1, 2, 4, 8)
CONTEXT = (2, 4, 8)
LONG = 16384  # sequences this long or longer are also tried split over the context axis
AXES = ("data", "fsdp", "context", "expert", "tensor")


class Candidate(NamedTuple):
    overrides: tuple        # key=value onto the recipe
    mesh: dict
    hbm_use: float          # of hbm_gib
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bound: str
    drops: bool             # a bounded buffer without a fallback: overflow is counted and dropped


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def meshes(num_devices: int, per_slice: int, per_host: int, num_experts: int, contexts=(1,)):
    """(ici, dcn) parallelism dicts: tensor t inside a host, expert e (dividing num_experts) filling the slice
    after tensor and spilling across slices, context c (of `contexts`) inside the slice, fsdp over the rest (inside
    the slice first); data 1."""
    slices = num_devices // per_slice
    for t in (t for t in TENSOR if t <= per_host and per_slice % t == 0):
        for e in (e for e in _powers_of_two(num_devices // t) if num_experts % e == 0):
            ici_e = math.gcd(e, per_slice // t)
            dcn_e = e // ici_e
            if slices % dcn_e:
                continue
            for c in (c for c in contexts if (per_slice // (t * ici_e)) % c == 0):
                ici_f = per_slice // (t * ici_e * c)
                yield ({"data": 1, "fsdp": ici_f, "context": c, "expert": ici_e, "tensor": t},
                       {"data": 1, "fsdp": slices // dcn_e, "context": 1, "expert": dcn_e, "tensor": 1})


def search(argv: list[str], top: int = 5) -> dict:
    """The ranked candidates for the recipe `argv` (config path and overrides; gpu_profile required)."""

    base = load_config(argv)
    if base.gpu_profile not in steptime.PROFILE_HARDWARE:
        raise ConfigError(f"--search needs gpu_profile (one of {', '.join(steptime.PROFILE_HARDWARE)}): the "
                          "hardware whose links and memory it ranks layouts by")
    profile = GPU_PROFILES[base.gpu_profile]
    n = planned_devices(base)
    hbm = base.hbm_gib or profile.hbm_gib
    per_slice = hosts_per_slice(profile, n) * profile.gpus_per_host
    mesh0 = sharding.mesh_shape(base, n)
    # traced once (twice with context parallelism, whose rules shard the weights over `context` too): shardings follow
    # the logical rules, whatever the sizes
    specs = {mesh0["context"] > 1: state_spec(base, abstract_mesh(mesh0))}
    total = parameter_counts(base, specs[mesh0["context"] > 1].abstract["params"]).total
    remats = [[]] + ([["remat_policy=full"]] if base.remat_policy != "full" else [])
    # the batch in two parts side by side (one part's EP exchange under the other's compute), or as the recipe has it
    splits = [[], ["use_batch_split_schedule=false"] if base.use_batch_split_schedule
              else ["use_batch_split_schedule=true", "batch_split_factor=2"]]
    # a bounded buffer as the recipe has it (overflow counted, dropped) or never dropping, with either fallback
    fallbacks = [[]] + ([[f"moe_dropless_fallback={m}"] for m in DROPLESS_FALLBACKS]
                        if base.ragged_buffer_factor is not None and base.moe_dropless_fallback is None else [])
    contexts = (1,) + tuple(c for c in CONTEXT if base.max_target_length % c == 0) * (base.max_target_length >= LONG)
    found, tried = [], 0
    for ici, dcn in meshes(n, per_slice, profile.gpus_per_host, base.num_experts, contexts):
        layout = [f"{g}_{a}_parallelism={d[a]}" for g, d in (("ici", ici), ("dcn", dcn)) for a in AXES]
        for batch in (b / ici["context"] for b in BATCHES):
            for remat, split, fallback in ((r, p, f) for r in remats for p in splits for f in fallbacks):
                # a fallback's exchange is XLA's: across slices in two hops, once per destination slice
                hops = ["ep_two_hop=true"] if fallback and dcn["expert"] > 1 and not base.ep_two_hop else []
                overrides = (*layout, f"per_device_batch_size={batch:g}", *remat, *split, *fallback, *hops)
                tried += 1
                try:
                    with _quiet():  # the recipe's config warnings were logged once, for `base`
                        cfg = load_config([*argv, *overrides])
                    shape = sharding.mesh_shape(cfg, n)
                    cp = shape["context"] > 1
                    if cp not in specs:
                        specs[cp] = state_spec(cfg, abstract_mesh(shape))
                    memory, acts = device_bytes(cfg, specs[cp], shape, n)
                    rerun = fallback_bytes(cfg, specs[cp], shape, n) or {}
                except ConfigError:
                    continue
                use = max(sum(memory.values()), sum(rerun.values())) / (hbm * GIB)
                if use > HEADROOM:
                    continue
                st = modelled_step(cfg, shape, n, total, acts["host_offload"])
                drops = cfg.ragged_buffer_factor is not None and cfg.moe_dropless_fallback is None
                found.append(Candidate(overrides, {a: shape[a] for a in AXES}, use, st["step_s"],
                                       st["tokens_per_s_per_gpu"], st["mfu"], st["bound"], drops))
    found.sort(key=lambda c: -c.tokens_per_s_per_gpu)
    return {"num_devices": n, "hardware": steptime.PROFILE_HARDWARE[base.gpu_profile], "hbm_gib": hbm,
            "tried": tried, "fitting": len(found), "best": [c._asdict() for c in found[:top]],
            "best_dropping_nothing": [c._asdict() for c in [c for c in found if not c.drops][:min(top, 3)]]}


@contextlib.contextmanager
def _quiet():
    """No log records of WARNING or below within."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def format_search(result: dict) -> str:
    lines = [f"{result['tried']} layouts tried on {result['num_devices']} x {result['hardware']}, "
             f"{result['fitting']} fit in {result['hbm_gib']:g} GiB; the fastest by the step-time model:"]
    _candidates(lines, result["best"])
    if any(c["drops"] for c in result["best"]) and result["best_dropping_nothing"]:
        lines.append("the fastest that drop nothing:")
        _candidates(lines, result["best_dropping_nothing"])
    return "\n".join(lines)


def _candidates(lines: list, candidates: list) -> None:
    for i, c in enumerate(candidates, 1):
        mesh = " x ".join(f"{a} {c['mesh'][a]}" for a in AXES if c["mesh"][a] > 1)
        lines.append(f"{i}. {c['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, step {c['step_s']:.2f} s, MFU "
                     f"{c['mfu']:.0%}, bound by {c['bound']}, {c['hbm_use']:.0%} of HBM ({mesh}); "
                     + ("overflow dropped (counted)" if c["drops"] else "drops nothing"))
        lines.append("   " + " ".join(c["overrides"]))

"""Which expert-parallel exchange can run under which compute: the data dependencies of a partitioned module.

    from MaxText.planning.overlap import exchanges, summarize
    found = exchanges(hlo_text)      # one Exchange per all-to-all / NCCL EP call in a sliced MoE
    print(summarize(found))          # {exchanges, sliced, waiting: [...], hideable}

A MoE layer that slices its tokens (num_moe_token_chunks) gives each slice its own dispatch, expert GEMMs and
combine under the JAX name scope `moe_chunk<i>` (dropless.py), which XLA keeps in each instruction's metadata
(op_name), forward and backward. A slice's exchange can overlap another slice's GEMMs only if neither waits for
the other: no path of operands (or control edges) leads from one to the other inside the computation that holds
both (a shard_map body after partitioning). XLA's latency-hiding scheduler may then run the exchange while
those GEMMs run; with a path it cannot, whatever it is told. This module reads that from XLA's text of the
module after SPMD partitioning (what MaxText.lowering dumps), before any backend pass:

  exchange  all-to-all, ragged-all-to-all (and their -start), a custom call to TE's NCCL EP (te_ep_*)
  compute   dot, ragged-dot, convolution, a custom call to a GEMM (te_*gemm*, cuBLAS, cuDNN), or any instruction
            calling a computation that holds one (a loop over the experts, a fusion)

For each exchange in slice i: the slices j != i whose compute it waits for (`waits_for`: should be none), and the
slices whose compute it neither waits for nor feeds (`under`: what it can hide under).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from MaxText.planning.collectives import _CALLED, _CALLED_LIST, _call_graph, _parse

SLICE = re.compile(r"\bmoe_chunk(\d+)\b")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_EXCHANGE_OPS = ("all-to-all", "ragged-all-to-all")
_COMPUTE_OPS = ("dot", "ragged-dot", "convolution")
_GEMM_TARGET = re.compile(r"gemm|cublas|cudnn", re.IGNORECASE)


class Exchange(NamedTuple):
    computation: str
    name: str                # the instruction
    op: str                  # its opcode, or the custom call's target
    slice: int               # the moe_chunk it belongs to
    waits_for: tuple         # other slices whose compute it depends on (sorted)
    under: tuple             # other slices whose compute is independent of it (sorted)


def _operands(rest: str) -> tuple[list[str], str]:
    """An instruction's operand names and its attribute text (rest: everything after the opcode's '(')."""
    depth = 1
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i]), rest[i + 1:]
    return re.findall(r"%([\w.\-]+)", rest), ""


def exchanges(hlo_text: str) -> list[Exchange]:
    """Every exchange of a sliced MoE (one whose op_name names a moe_chunk) with what it waits for and what it can
    run under, computation by computation."""
    comps, _ = _parse(hlo_text)
    _, callees, _ = _call_graph(comps)

    @functools.cache
    def holds_compute(comp: str) -> bool:
        for instr in comps.get(comp, ()):
            if instr.op in _COMPUTE_OPS or (instr.op == "custom-call" and _is_gemm(instr.rest)):
                return True
        return any(holds_compute(c) for c in callees[comp])

    found = []
    for comp, instrs in comps.items():
        index = {instr.name: i for i, instr in enumerate(instrs)}
        ancestors = [0] * len(instrs)  # bit j set: instruction j is upstream (HLO text lists operands first)
        kinds, slices = [], []
        for i, instr in enumerate(instrs):
            operands, attrs = _operands(instr.rest)
            control = _CONTROL.search(attrs)
            if control:
                operands += re.findall(r"%([\w.\-]+)", control.group(1))
            for name in operands:
                j = index.get(name)
                if j is not None and j < i:
                    ancestors[i] |= ancestors[j] | (1 << j)
            target = _TARGET.search(attrs)
            called = _called(attrs)
            if instr.op.removesuffix("-start") in _EXCHANGE_OPS or (target and target.group(1).startswith("te_ep_")):
                kinds.append(("exchange", target.group(1) if target else instr.op))
            elif (instr.op in _COMPUTE_OPS or (instr.op == "custom-call" and _is_gemm(attrs))
                  or any(holds_compute(c) for c in called)):
                kinds.append(("compute", instr.op))
            else:
                kinds.append((None, instr.op))
            name = _OP_NAME.search(attrs)
            chunk = SLICE.findall(name.group(1)) if name else []
            slices.append(int(chunk[-1]) if chunk else None)
        compute = [i for i, (kind, _) in enumerate(kinds) if kind == "compute" and slices[i] is not None]
        for i, (kind, op) in enumerate(kinds):
            if kind != "exchange" or slices[i] is None:
                continue
            waits, under = set(), set()
            for j in compute:
                if slices[j] == slices[i]:
                    continue
                if ancestors[i] >> j & 1:
                    waits.add(slices[j])
                elif not ancestors[j] >> i & 1:
                    under.add(slices[j])
            found.append(Exchange(comp, instrs[i].name, op, slices[i], tuple(sorted(waits)), tuple(sorted(under))))
    return found


def _is_gemm(text: str) -> bool:
    target = _TARGET.search(text)
    return bool(target and _GEMM_TARGET.search(target.group(1)))


def _called(attrs: str) -> list[str]:
    names = _CALLED.findall(attrs)
    for group in _CALLED_LIST.findall(attrs):
        names += re.findall(r"%([\w.\-]+)", group)
    return names


def summarize(found: list[Exchange]) -> dict:
    """{exchanges: sliced exchanges, slices: how many, waiting: the ones that wait for another slice's compute
    (computation/name: slices, at most 10), hideable: the ones with another slice's compute to run under}."""
    waiting = [e for e in found if e.waits_for]
    return {"exchanges": len(found), "slices": len({e.slice for e in found}),
            "waiting": [f"{e.computation}/{e.name} ({e.op}, slice {e.slice}): waits for slices "
                        f"{', '.join(map(str, e.waits_for))}" for e in waiting[:10]],
            "hideable": sum(bool(e.under) for e in found)}

"""Which expert-parallel exchange can run under which compute: the data dependencies of a partitioned module.

    from MaxText.planning.overlap import exchanges, summarize
    found = exchanges(hlo_text)      # one Exchange per all-to-all / NCCL EP call in a sliced MoE
    print(summarize(found))          # {exchanges, slices, waiting: [...], hideable}

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
slices whose compute it neither waits for nor feeds (`under`: what it can hide under), in the same pass: forward
against forward, backward (JAX's transpose(...) in op_name, recomputation included) against backward. Every
backward op depends on every part's forward through the loss, which is no reason to wait: that compute is done.

The slices: a MoE layer's tokens in num_moe_token_chunks (JAX name scope `moe_chunk<i>`, dropless.py) or the batch
in use_batch_split_schedule's parts (`batch_split<k>`, decoder.py). Inside a shard_map body, op_names start afresh
(no outer scope): a part's MoE body is then the `call` of it in the layer, labelled by the part.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from MaxText.planning.collectives import _CALLED, _CALLED_LIST, _call_graph, _parse

SLICE = re.compile(r"\b(moe_chunk|batch_split)(\d+)\b")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_EXCHANGE_OPS = ("all-to-all", "ragged-all-to-all")
_COMPUTE_OPS = ("dot", "ragged-dot", "convolution")
_GEMM_TARGET = re.compile(r"gemm|cublas|cudnn", re.IGNORECASE)


class Exchange(NamedTuple):
    computation: str
    name: str                # the instruction
    op: str                  # its opcode, or the custom call's target; call(...) for a call holding exchanges
    slice: str               # the part and / or chunk it belongs to: batch_split1, moe_chunk0, batch_split1/moe_chunk0
    waits_for: tuple         # other slices whose compute it depends on (sorted)
    under: tuple             # other slices whose compute is independent of it (sorted)


def _label(op_name: str) -> dict:
    """{scheme: index} of the slice an op_name names (the innermost scope of each scheme)."""
    return {scheme: int(i) for scheme, i in SLICE.findall(op_name)}


def _apart(a: dict, b: dict) -> bool:
    """Two slices are apart where a scheme both name differs: batch_split0 and batch_split1, moe_chunk0 and
    moe_chunk1, but not batch_split0 and batch_split0/moe_chunk1 (a part's chunk belongs to that part)."""
    return any(a[s] != b[s] for s in a.keys() & b.keys())


def _text(label: dict) -> str:
    return "/".join(f"{s}{label[s]}" for s in sorted(label))


def _operands(rest: str) -> tuple[list[str], str]:
    """An instruction's operand names and its attribute text (rest: everything after the opcode's '(')."""
    depth = 1
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i]), rest[i + 1:]
    return re.findall(r"%([\w.\-]+)", rest), ""


def exchanges(hlo_text: str) -> list[Exchange]:
    """Every exchange of a sliced MoE or a split batch (an instruction whose op_name names a moe_chunk or a
    batch_split, or a call of such a slice into a computation holding exchanges: a shard_map body) with what it
    waits for and what it can run under, computation by computation."""
    comps, _ = _parse(hlo_text)
    _, callees, _ = _call_graph(comps)

    def own(comp: str, kind: str) -> set:
        """The exchange ops (kind "exchange") or the GEMM ops (kind "compute") directly in comp."""
        classify = _exchange_op if kind == "exchange" else lambda op, text: op if _is_compute(op, text) else None
        return {found for instr in comps.get(comp, ()) if (found := classify(instr.op, instr.rest))}

    @functools.cache
    def holds(comp: str, kind: str) -> frozenset:
        return frozenset(own(comp, kind).union(*(holds(c, kind) for c in callees[comp])))

    found = []
    for comp, instrs in comps.items():
        index = {instr.name: i for i, instr in enumerate(instrs)}
        ancestors = [0] * len(instrs)  # bit j set: instruction j is upstream (HLO text lists operands first)
        exchange_ops, computes, labels, backward = [], [], [], []
        for i, instr in enumerate(instrs):
            operands, attrs = _operands(instr.rest)
            control = _CONTROL.search(attrs)
            if control:
                operands += re.findall(r"%([\w.\-]+)", control.group(1))
            for name in operands:
                j = index.get(name)
                if j is not None and j < i:
                    ancestors[i] |= ancestors[j] | (1 << j)
            called = _called(attrs)
            inner = sorted(set().union(*(holds(c, "exchange") for c in called)))
            exchange_ops.append(_exchange_op(instr.op, attrs) or (f"{instr.op}({', '.join(inner)})" if inner else None))
            computes.append(_is_compute(instr.op, attrs) or any(holds(c, "compute") for c in called))
            name = _OP_NAME.search(attrs)
            labels.append(_label(name.group(1)) if name else {})
            backward.append(bool(name) and "transpose(" in name.group(1))
        compute = [i for i, c in enumerate(computes) if c and labels[i]]
        for i, op in enumerate(exchange_ops):
            if op is None or not labels[i]:
                continue
            waits, under = set(), set()
            for j in compute:
                if j == i or backward[j] != backward[i] or not _apart(labels[i], labels[j]):
                    continue
                if ancestors[i] >> j & 1:
                    waits.add(_text(labels[j]))
                elif not ancestors[j] >> i & 1:
                    under.add(_text(labels[j]))
            found.append(Exchange(comp, instrs[i].name, op, _text(labels[i]), tuple(sorted(waits)),
                                  tuple(sorted(under))))
    return found


def _exchange_op(op: str, text: str) -> str | None:
    """An exchange's name (its opcode, or the NCCL EP custom call's target), None for anything else."""
    if op.removesuffix("-start") in _EXCHANGE_OPS:
        return op.removesuffix("-start")
    target = _TARGET.search(text) if op == "custom-call" else None
    return target.group(1) if target and target.group(1).startswith("te_ep_") else None


def _is_compute(op: str, text: str) -> bool:
    """A GEMM: dot, ragged-dot, convolution, or a custom call to a GEMM kernel (TE's, cuBLAS', cuDNN's)."""
    target = _TARGET.search(text) if op == "custom-call" else None
    return op in _COMPUTE_OPS or bool(target and _GEMM_TARGET.search(target.group(1)))


def _called(attrs: str) -> list[str]:
    names = _CALLED.findall(attrs)
    for group in _CALLED_LIST.findall(attrs):
        names += re.findall(r"%([\w.\-]+)", group)
    return names


def summarize(found: list[Exchange]) -> dict:
    """{exchanges: sliced exchanges, slices: their names, waiting: the ones that wait for another slice's compute
    (computation/name: slices, at most 10), hideable: the ones with another slice's compute to run under}."""
    waiting = [e for e in found if e.waits_for]
    return {"exchanges": len(found), "slices": sorted({e.slice for e in found}),
            "waiting": [f"{e.computation}/{e.name} ({e.op}, {e.slice}): waits for {', '.join(e.waits_for)}"
                        for e in waiting[:10]],
            "hideable": sum(bool(e.under) for e in found)}

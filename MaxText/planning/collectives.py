"""Collectives of a partitioned XLA module, per device and per step: kind, dtype, bytes, group size, executions.

    from MaxText.planning.collectives import count_collectives, summarize
    stats = count_collectives(hlo_text, num_devices=128)   # one Collective per collective instruction
    print(summarize(stats))                                   # {kind: {count, bytes, wire_bytes, dtypes}}

`hlo_text` is XLA's text of a module after SPMD partitioning (what `MaxText.lowering` dumps; shapes are per
device). Executions multiply through the call graph: a collective in a scanned layer's loop body runs once per
trip (the trip count is read from the loop's `known_trip_count`, else from its condition `i < N`).

Read as the GPU compiler will see it: an all-reduce whose every user is a dynamic-slice is the partitioner's
spelling of a reduce-scatter (XLA's GPU pipeline fuses the pair), so it is counted as one. `bytes` is the
full buffer each device holds (all-gather: the gathered result; reduce-scatter: its input); `wire_bytes` is
what a bandwidth-optimal ring sends from each device: (n-1)/n of the buffer, twice that for an all-reduce.
A collective over a group of one device is left out: XLA deletes it.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from typing import NamedTuple

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_CALLED = re.compile(r"\b(?:condition|body|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=")


class Collective(NamedTuple):
    kind: str          # one of KINDS
    dtype: str         # element type of the largest buffer
    shape: tuple       # that buffer's per-device dims as the instruction has them (a native reduce-scatter: its
                       # output shard; one spelled all-reduce + dynamic-slice: the all-reduce's full buffer)
    bytes: float       # per device, one execution (a reduce-scatter's: its input)
    group: int | None  # devices taking part (None: collective-permute, or unreadable)
    count: int         # executions per step (loop trips multiplied through)
    axes: tuple = ()   # the mesh axes its groups span, as the module names them (() when it does not: a group
                       # written as device lists, or over a shard_map's anonymous axis_0 of every device)

    @property
    def wire_bytes(self) -> float:
        """What a ring sends from each device per execution."""
        if self.kind == "collective-permute":
            return self.bytes
        if not self.group:
            return 0.0  # group unreadable
        share = (self.group - 1) / self.group
        return self.bytes * share * (2 if self.kind == "all-reduce" else 1)


class _Instr(NamedTuple):
    name: str
    type: str
    op: str
    rest: str  # operands and attributes


def _split_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    tail = line[m.end():]
    if tail.startswith("("):  # a tuple type: up to its matching parenthesis
        depth = 0
        for i, c in enumerate(tail):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                break
        type_, tail = tail[:i + 1], tail[i + 1:].lstrip()
    else:
        type_, _, tail = tail.partition(" ")
    op, _, rest = tail.partition("(")
    return _Instr(m.group(1), type_, op, rest)


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """{computation name: its instructions} and the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")) and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
            continue
        if current is not None:
            instr = _split_instr(line)
            if instr:
                comps[current].append(instr)
    return comps, entry


def _arrays(type_: str) -> list[tuple[str, tuple, float]]:
    """(dtype, dims, bytes) of every array in an instruction's type (a tuple has several)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is not None:
            shape = tuple(int(d) for d in dims.split(",") if d)
            out.append((dtype, shape, size * math.prod(shape)))
    return out


def _trip_count(instr: _Instr, comps: dict[str, list[_Instr]]) -> int | None:
    """A while loop's trips: XLA's annotation, else N of a condition `counter < N` (JAX's scans and fori
    loops count up from 0)."""
    m = _TRIP.search(instr.rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%([\w.\-]+)", instr.rest)
    body = comps.get(cond.group(1), []) if cond else []
    constants = [re.match(r"(-?\d+)\)", i.rest) for i in body if i.op == "constant" and i.type.startswith("s32[]")]
    if any(i.op == "compare" and "direction=LT" in i.rest for i in body) and len(constants) == 1 and constants[0]:
        return int(constants[0].group(1))
    return None


def _mesh_axes(rest: str) -> tuple[str, ...]:
    """The named mesh axes of a `replica_groups=mesh[...] {...}` attribute (() otherwise, or for axis_0)."""
    m = _MESH_GROUPS.search(rest)
    named = tuple(re.findall(r"'([^']+)'", m.group(2))) if m else ()
    return () if named == ("axis_0",) else named


def _group_size(rest: str, num_devices: int) -> int | None:
    m = _MESH_GROUPS.search(rest)
    if m:
        sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        named = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(sizes[a] for a in named) if all(a in sizes for a in named) else None
    m = _LIST_GROUPS.search(rest)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = _IOTA_GROUPS.search(rest)
    if m:
        return int(m.group(1).split(",")[-1])
    if "replica_groups={}" in rest:
        return num_devices
    return None


def _call_graph(comps: dict) -> tuple[dict, dict, list]:
    """Who calls whom: {callee: [(caller, times per call)]}, {caller: [callee]}, and the bodies of the while loops
    whose trip count is not known (a data-dependent bound; counted once)."""
    callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    callees: dict[str, list[str]] = collections.defaultdict(list)
    unknown_bodies = []
    for name, instrs in comps.items():
        for instr in instrs:
            called = _CALLED.findall(instr.rest)
            for group in _CALLED_LIST.findall(instr.rest):
                called += re.findall(r"%([\w.\-]+)", group)
            factor = 1
            if instr.op == "while":
                trips = _trip_count(instr, comps)
                if trips is None:
                    unknown_bodies += re.findall(r"\bbody=%([\w.\-]+)", instr.rest)
                factor = trips or 1
            for callee in called:
                callers[callee].append((name, factor))
                callees[name].append(callee)
    return callers, callees, unknown_bodies


def count_collectives(hlo_text: str, num_devices: int) -> tuple[list[Collective], int]:
    """Every collective of the module with its executions per step, and how many while loops with collectives
    inside had a trip count that could not be read (their bodies are counted once)."""
    comps, entry = _parse(hlo_text)
    callers, callees, unknown_bodies = _call_graph(comps)

    @functools.cache
    def has_collective(comp: str) -> bool:
        return (any(i.op.removesuffix("-start") in KINDS for i in comps.get(comp, ()))
                or any(has_collective(c) for c in callees[comp]))

    unknown_trips = sum(has_collective(body) for body in unknown_bodies)

    memo: dict[str, int] = {}

    def executions(comp: str) -> int:
        if comp == entry or comp not in callers:
            return 1 if comp == entry else 0
        if comp not in memo:
            memo[comp] = sum(executions(caller) * factor for caller, factor in callers[comp])
        return memo[comp]

    found = []
    for name, instrs in comps.items():
        users: dict[str, set[str]] = collections.defaultdict(set)
        for instr in instrs:
            for operand in re.findall(r"%([\w.\-]+)", instr.rest.split("),", 1)[0]):
                users[operand].add(instr.op)
        runs = executions(name)
        for instr in instrs:
            kind = instr.op.removesuffix("-start")
            if kind not in KINDS or not runs:
                continue
            arrays = _arrays(instr.type)
            if not arrays:
                continue
            if instr.op.endswith("-start"):  # async: a tuple holding the operand and the result
                dtype, shape, size = max(arrays, key=lambda a: a[2])
            else:  # a variadic collective's tuple: all of it moves
                dtype, shape, size = arrays[0][0], arrays[0][1], sum(a[2] for a in arrays)
            group = _group_size(instr.rest, num_devices)
            if group == 1:  # XLA deletes a collective over one device (e.g. a psum over a size-1 mesh axis)
                continue
            if kind == "all-reduce" and users.get(instr.name) == {"dynamic-slice"}:
                kind = "reduce-scatter"
            elif kind == "reduce-scatter":
                size *= group or 1  # its input: the full buffer
            found.append(Collective(kind, dtype, shape, size, group, runs, _mesh_axes(instr.rest)))
    return found, unknown_trips


def summarize(found: list[Collective]) -> dict[str, dict]:
    """{kind: {"count", "bytes", "wire_bytes", "dtypes": {dtype: bytes}}} per device per step, in KINDS order,
    kinds that never occur left out."""
    out: dict[str, dict] = {}
    for c in sorted(found, key=lambda c: KINDS.index(c.kind)):
        s = out.setdefault(c.kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0, "dtypes": {}})
        s["count"] += c.count
        s["bytes"] += c.bytes * c.count
        s["wire_bytes"] += c.wire_bytes * c.count
        s["dtypes"][c.dtype] = s["dtypes"].get(c.dtype, 0.0) + c.bytes * c.count
    return out


def by_group(found: list[Collective]) -> list[dict]:
    """Per device per step, by (kind, mesh axes, group size): count, bytes and wire_bytes, JSON-ready; what
    MaxText.planning.steptime times link by link."""
    out: dict[tuple, dict] = {}
    for c in found:
        s = out.setdefault((c.kind, c.axes, c.group), {"kind": c.kind, "axes": list(c.axes), "group": c.group,
                                                       "count": 0, "bytes": 0.0, "wire_bytes": 0.0})
        s["count"] += c.count
        s["bytes"] += c.bytes * c.count
        s["wire_bytes"] += c.wire_bytes * c.count
    return sorted(out.values(), key=lambda s: (KINDS.index(s["kind"]), -s["bytes"]))


def largest(found: list[Collective], n: int = 10) -> list[dict]:
    """The n collectives that move the most bytes per step, as JSON-ready dicts, identical ones merged."""
    merged: dict[tuple, int] = collections.Counter()
    for c in found:
        merged[c._replace(count=0)] += c.count
    top = sorted(merged.items(), key=lambda kv: -kv[0].bytes * kv[1])[:n]
    return [{"kind": c.kind, "dtype": c.dtype, "shape": list(c.shape), "group": c.group, "axes": list(c.axes),
             "count": count, "bytes_per_step": c.bytes * count} for c, count in top]

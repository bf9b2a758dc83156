"""Read a compiled (SPMD-partitioned, per-device) HLO module's text: how often each
computation runs, the collectives it issues and the matmul FLOPs it does.

XLA's own ``cost_analysis()`` counts a while loop's body once. The train step scans over
microbatches (``data.grad_accum``), so its FLOPs and collectives would be undercounted by
that factor. Here every computation gets a *multiplicity*: the entry runs once, a while
body ``known_trip_count`` times its caller's multiplicity (XLA records the trip count of
loops it can analyse in the while's ``backend_config``; an unknown count is taken as 1 and
reported), every other callee (fusions, calls, conditionals) its caller's.

Bytes each device moves for one collective on a group of ``n`` devices, with ring
algorithms (the textbook lower bounds NCCL reaches on large messages):

* all-gather: ``out * (n-1)/n`` (receives every other shard);
* reduce-scatter: ``out * (n-1)`` (the input is ``n`` times the output);
* all-reduce: ``2 * size * (n-1)/n`` (a reduce-scatter plus an all-gather);
* all-to-all: ``size * (n-1)/n``; collective-permute: ``size``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

__all__ = ["COLLECTIVES", "HloModule", "shape_bytes"]

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "f8e4m3": 8,
    "f8e8m0fnu": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8,
    "f4e2m1fn": 4,
    "c64": 64,
    "c128": 128,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dt, dims in _ARRAY.findall(shape):
        if dt in _DTYPE_BITS:
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (a tuple's arrays summed)."""
    return sum(_DTYPE_BITS[dt] * math.prod(dims) / 8 for dt, dims in _arrays(shape))


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], s32[]) while(...), ...' -> ('(f32[2], s32[])', 'while(...), ...')."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _group_size(attrs: str, n_devices: int) -> int:
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:  # iota form: [groups, size]<=[...]
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([0-9,\s]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    return n_devices  # {} or absent: all devices


class HloModule:
    """A parsed HLO module text (``jax.stages.Compiled.as_text()``)."""

    def __init__(self, text: str, n_devices: int):
        self.n_devices = int(n_devices)
        # computation -> [(instruction, result shape, opcode, rest of the line)]
        self.computations: dict[str, list[tuple[str, str, str, str]]] = {}
        self.entry: str | None = None
        order: list[str] = []
        current = None
        for line in text.splitlines():
            h = _HEADER.match(line)
            if h and not line.startswith(" "):
                current = h.group(2)
                order.append(current)
                self.computations[current] = []
                if h.group(1):
                    self.entry = current
                continue
            m = _INSTR.match(line) if current else None
            if m and current:
                shape, tail = _split_shape(m.group(2))
                op = tail.split("(", 1)[0].strip()
                self.computations[current].append((m.group(1), shape, op, tail))
        if self.entry is None:
            raise ValueError("HLO text has no ENTRY computation")
        self.unknown_trip_counts = 0
        self.multiplicity = self._multiplicity(order)

    def _multiplicity(self, order: list[str]) -> dict[str, float]:
        mult: dict[str, float] = defaultdict(float)
        assert self.entry is not None  # __init__ raised otherwise
        mult[self.entry] = 1.0
        # Callees are printed before their callers: walk callers first.
        for name in reversed(order):
            m = mult.get(name, 0.0)
            if not m:
                continue
            for _, _, op, tail in self.computations[name]:
                factor = 1.0
                if op == "while":
                    t = _TRIP.search(tail)
                    if t:
                        factor = float(t.group(1))
                    else:
                        self.unknown_trip_counts += 1
                for kind, callee in _CALLEE.findall(tail):
                    if callee in self.computations:
                        mult[callee] += m * (factor if kind == "body" else 1.0)
                for group in _CALLEE_LIST.findall(tail):
                    for callee in re.findall(r"%?([\w.\-]+)", group):
                        if callee in self.computations:
                            mult[callee] += m
        return dict(mult)

    def _instructions(self):
        for name, instrs in self.computations.items():
            m = self.multiplicity.get(name, 0.0)
            if m:
                for _, shape, op, tail in instrs:
                    yield m, shape, op, tail

    def collectives(self) -> dict[str, dict[str, float]]:
        """{kind: {"count", "bytes" (per device, ring), "payload" (result bytes),
        "elements" (moved per device, as "bytes" but one per element whatever its dtype)}},
        loop bodies counted as often as they run.

        "elements" compares programs that move the same values in different dtypes: XLA:CPU
        widens float4/float8 operands of a collective to float16, which a GPU moves as
        they are."""
        out = {
            k: {"count": 0.0, "bytes": 0.0, "payload": 0.0, "elements": 0.0} for k in COLLECTIVES
        }
        for m, shape, op, tail in self._instructions():
            kind = op[:-6] if op.endswith("-start") else op
            if kind not in COLLECTIVES:
                continue
            arrays = _arrays(shape)
            if op.endswith("-start") and arrays:  # (operand, result[, ...]) tuples
                big = max(arrays, key=lambda a: _DTYPE_BITS[a[0]] * math.prod(a[1]))
                size, elems = _DTYPE_BITS[big[0]] * math.prod(big[1]) / 8, math.prod(big[1])
            else:
                size, elems = shape_bytes(shape), sum(math.prod(d) for _, d in arrays)
            n = max(_group_size(tail, self.n_devices), 1)
            factor = {
                "all-gather": (n - 1) / n,
                "reduce-scatter": n - 1,
                "all-reduce": 2 * (n - 1) / n,
                "all-to-all": (n - 1) / n,
                "collective-permute": 1,
            }[kind]
            rec = out[kind]
            rec["count"] += m
            rec["bytes"] += m * size * factor
            rec["payload"] += m * size
            rec["elements"] += m * elems * factor
        return out

    def gathered_shapes(self) -> list[tuple[int, ...]]:
        """Result dims of every all-gather (a gather's output is what one device holds
        afterwards: a full weight here means the weight was not left sharded)."""
        out = []
        for _, shape, op, _ in self._instructions():
            if op in ("all-gather", "all-gather-start"):
                arrays = _arrays(shape)
                if arrays:
                    out.append(max(arrays, key=lambda a: math.prod(a[1]))[1])
        return out

    def dot_flops(self) -> float:
        """2 * (output elements) * (contracted length) summed over every ``dot``, each
        counted as often as its computation runs."""
        total = 0.0
        for name, instrs in self.computations.items():
            m = self.multiplicity.get(name, 0.0)
            if not m:
                continue
            shapes = {n: shape for n, shape, _, _ in instrs}
            for _, shape, op, tail in instrs:
                if op != "dot":
                    continue
                args = tail[tail.index("(") + 1 :].split(")", 1)[0]
                lhs = args.split(",")[0].strip()
                lhs_arrays = _arrays(lhs) or _arrays(shapes.get(lhs.lstrip("%"), ""))
                c = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", tail)
                out = _arrays(shape)
                if not (out and lhs_arrays and c):
                    continue
                dims = lhs_arrays[0][1]
                k = math.prod(dims[int(i)] for i in c.group(1).split(",") if i)
                total += m * 2.0 * math.prod(out[0][1]) * k
        return total

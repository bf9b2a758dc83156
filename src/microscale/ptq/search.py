"""Budgeted mixed-precision search: an exact multiple-choice knapsack over formats.

Every quantizable layer ``l`` (``n_l`` weight elements) gets one format ``f`` from a
candidate list. Format ``f`` stores ``b_f = FormatSpec.bits_per_element`` bits per
element (NVFP4 4.5 = 4 + 8/16, MXFP4 4.25, MXFP8 8.25, FP8 8, BF16 16; the one float32
per tensor is ignored) and costs the model ``s_lf`` (a sensitivity score: how much the
loss suffers when layer ``l`` alone is stored in ``f``). Scores of different layers are
treated as additive (the first-order / Fisher picture), so the best allocation solves

    minimise    sum_l sum_f  s_lf x_lf
    subject to  sum_f x_lf = 1                          (one format per layer)
                sum_l sum_f  b_f n_l x_lf <= B sum_l n_l    (effective bits <= budget B)
                x_lf in {0, 1}

Fused groups (q/k/v read the same input, as do gate/up: an engine runs them as one GEMM
with one set of scales) must share a format: a group is one decision whose score and
cost are the sums over its members. Pinned layers have a single option; they still
count in the budget. High-precision tensors that are not candidate layers
(embeddings, LM head) can be counted as a constant ``extra_numel`` elements at
``extra_bits`` bits, or be an item of their own with their own candidates (``options``:
the token embedding / LM head, whose candidates are the formats a GGUF stores it in).

Exactness. Costs are exact rationals (``b_f`` are binary fractions and the budget is
read from its decimal text), scaled to integers and divided by their gcd: for
transformer shapes (widths that are multiples of 64..1024) that leaves a few thousand
capacity units, so a dynamic program over capacity is exact and fast:
``best[c] = min_o best_prev[c - cost_o] + score_o`` group by group, ``O(groups x
options x capacity)``. Ties go to the lower cost, then to the earlier option. When the
capacity is too large for the table, ``scipy.optimize.milp`` (HiGHS branch and bound)
solves the same program with normalised coefficients; its answer is re-checked against
the exact integer budget and re-solved with a tighter bound on the (rare) tolerance
overshoot, so the budget is never exceeded in either path. `brute_force` enumerates
every allocation (tests, tiny instances).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np

from microscale.formats import get_weight_format
from microscale.model import FUSED_LINEARS

__all__ = [
    "DEFAULT_GROUPS",
    "EMBED_ITEM",
    "Allocation",
    "Problem",
    "brute_force",
    "check_budget",
    "effective_bits",
    "model_bits",
    "group_layers",
    "linear_formats",
    "search",
]


def _group_pattern(name: str, members: Sequence[str]) -> tuple[str, str]:
    """One `DEFAULT_GROUPS` row: the members' last names as alternatives of a regex
    (their common suffix factored out, e.g. ``(q|k|v)_proj``), the group's last name."""
    leaves = [m.rsplit(".", 1)[-1] for m in members]
    suffix = os.path.commonprefix([leaf[::-1] for leaf in leaves])[::-1]
    stems = "|".join(re.escape(leaf[: len(leaf) - len(suffix)]) for leaf in leaves)
    return rf"(.*)\.({stems}){re.escape(suffix)}", r"\1." + name.rsplit(".", 1)[-1]


# (regex fully matching a layer path, group-name template): the members of each fused group
# of `microscale.model.FUSED_LINEARS` (q/k/v, gate/up) share a format. Matched by their last
# name, so HF paths (``model.layers.3.self_attn.q_proj``) group too. Paths that match
# nothing are groups of their own.
DEFAULT_GROUPS: tuple[tuple[str, str], ...] = tuple(
    _group_pattern(name, members) for name, members in FUSED_LINEARS.items()
)

# Largest dynamic-programming table (groups x capacity units) before switching to MILP.
_DP_MAX_CELLS = 40_000_000


def group_layers(
    paths: Sequence[str], patterns: Sequence[tuple[str, str]] = DEFAULT_GROUPS
) -> dict[str, str]:
    """{layer path: group name}. The first pattern that fully matches a path names its
    group by ``re.fullmatch(...).expand(template)``; unmatched paths are their own group."""
    out = {}
    for p in paths:
        out[p] = p
        for pattern, template in patterns:
            m = re.fullmatch(pattern, p)
            if m:
                out[p] = m.expand(template)
                break
    return out


def _bits(fmt: str) -> Fraction:
    return Fraction(get_weight_format(fmt).bits_per_element)


def effective_bits(
    assignment: Mapping[str, str],
    numel: Mapping[str, int],
    *,
    extra_numel: int = 0,
    extra_bits: float = 16.0,
) -> float:
    """Average stored bits per weight element of ``assignment`` ({layer: format})."""
    missing = sorted(set(assignment) - set(numel))
    if missing:
        raise ValueError(f"effective_bits: no element count for layer(s) {missing}")
    bits = sum(_bits(f) * int(numel[p]) for p, f in assignment.items())
    bits += Fraction(extra_bits) * int(extra_numel)
    total = sum(int(numel[p]) for p in assignment) + int(extra_numel)
    if total <= 0:
        raise ValueError("effective_bits: no weight elements (empty assignment)")
    return float(bits / total)


def model_bits(
    assignment: Mapping[str, str],
    numel: Mapping[str, int],
    other_numel: int,
    *,
    other_bits: float = 16.0,
) -> dict[str, float]:
    """Both averages a report names: ``linear_bits``, the stored bits per weight of the
    linear layers of ``assignment``, and ``model_bits``, of the whole model, whose other
    ``other_numel`` parameters (embeddings, norms, LM head) are stored at ``other_bits``."""
    return {
        "linear_bits": effective_bits(assignment, numel),
        "model_bits": effective_bits(
            assignment, numel, extra_numel=other_numel, extra_bits=other_bits
        ),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocation:
    """One format per layer and what it costs."""

    # {layer path: format name}.
    formats: dict[str, str]
    # Average stored bits per weight element (extra high-precision tensors included).
    effective_bits: float
    # Sum of the chosen layers' scores.
    total_score: float
    # The budget it was solved for (None for fixed allocations such as a heuristic).
    budget: float | None = None
    # "dp", "milp", "brute_force" or "fixed".
    solver: str = "fixed"
    # Wall time of the solve in seconds.
    solve_time_s: float = 0.0

    def counts(self) -> dict[str, int]:
        """{format: number of layers}."""
        out: dict[str, int] = {}
        for f in self.formats.values():
            out[f] = out.get(f, 0) + 1
        return dict(sorted(out.items()))


# The item of quantize's search for the token embedding / LM head (QuantizeConfig.
# embed_formats, one item with its own ``options``): a name no linear layer path takes.
EMBED_ITEM = "<embedding>"


def linear_formats(assignment: Mapping[str, str]) -> dict[str, str]:
    """``assignment`` without the embedding item: the linear layers' formats."""
    return {p: f for p, f in assignment.items() if p != EMBED_ITEM}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """A search instance: layers, candidate formats, scores and sizes."""

    # Candidate format names (registry names), in column order of ``scores``.
    formats: tuple[str, ...]
    # {layer path: {format: score}} (lower is better; every candidate needed unless pinned).
    scores: Mapping[str, Mapping[str, float]]
    # {layer path: weight elements}.
    numel: Mapping[str, int]
    # {layer path: group name}; None = every layer its own group.
    groups: Mapping[str, str] | None = None
    # {layer path: format} layers that must take that format (they still count as cost).
    pinned: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # {layer path: its own candidate formats} for items whose candidates are not
    # ``formats`` (the token embedding: bf16 and GGUF's formats without a global scale).
    options: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    # High-precision elements outside the candidate layers counted in the budget.
    extra_numel: int = 0
    # Bits per element of those extra elements.
    extra_bits: float = 16.0

    def __post_init__(self):
        if not self.formats:
            raise ValueError("Problem.formats is empty: expected at least one candidate format")
        for f in self.formats:
            get_weight_format(f)  # raises on unknown names
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"Problem.formats={self.formats!r} has duplicates")
        layers = list(self.numel)
        if not layers:
            raise ValueError("Problem.numel is empty: expected at least one layer")
        for p in layers:
            n = self.numel[p]
            if isinstance(n, bool) or int(n) != n or n <= 0:
                raise ValueError(f"Problem.numel[{p!r}]={n!r}: expected a positive int")
        for p, f in self.pinned.items():
            if p not in self.numel:
                raise ValueError(f"Problem.pinned names {p!r}, which is not a layer")
            get_weight_format(f)
        for p, fmts in self.options.items():
            if p not in self.numel:
                raise ValueError(f"Problem.options names {p!r}, which is not a layer")
            if not fmts:
                raise ValueError(f"Problem.options[{p!r}] is empty")
            for f in fmts:
                get_weight_format(f)
        for p in layers:
            if p in self.pinned:
                continue
            row = self.scores.get(p)
            if row is None:
                raise ValueError(f"Problem.scores has no row for layer {p!r}")
            cands = self.candidates(p)
            miss = [f for f in cands if f not in row]
            if miss:
                raise ValueError(f"Problem.scores[{p!r}] lacks format(s) {miss}")
            bad = [f for f in cands if not math.isfinite(float(row[f]))]
            if bad:
                raise ValueError(
                    f"Problem.scores[{p!r}] is not finite for {bad}: { {f: row[f] for f in bad} }"
                )
        if self.groups is not None:
            miss = [p for p in layers if p not in self.groups]
            if miss:
                raise ValueError(f"Problem.groups lacks layer(s) {miss}")

    def candidates(self, path: str) -> tuple[str, ...]:
        """The formats layer ``path`` may take unless pinned (``options``, else ``formats``)."""
        return tuple(self.options.get(path, self.formats))

    def group_options(
        self,
    ) -> tuple[list[str], list[list[str]], list[list[tuple[str, Fraction, float]]]]:
        """(group names, members per group, options per group as (format, exact bits,
        score)) in first-appearance order of the layers."""
        groups = self.groups or {p: p for p in self.numel}
        names: list[str] = []
        members: dict[str, list[str]] = {}
        for p in self.numel:
            g = groups[p]
            if g not in members:
                names.append(g)
                members[g] = []
            members[g].append(p)
        options = []
        for g in names:
            mem = members[g]
            pins = {self.pinned[p] for p in mem if p in self.pinned}
            if len(pins) > 1:
                raise ValueError(
                    f"group {g!r} has members pinned to different formats "
                    f"{sorted(pins)}: a group shares one format"
                )
            cands = {self.candidates(p) for p in mem}
            # a group shares one format: the formats every member may take
            common = [f for f in self.candidates(mem[0]) if all(f in c for c in cands)]
            if not common:
                raise ValueError(
                    f"group {g!r} has members with no candidate format in common "
                    f"{sorted(cands)}: a group shares one format"
                )
            fmts = sorted(pins) if pins else common
            n = sum(int(self.numel[p]) for p in mem)
            opts = []
            for f in fmts:
                score = sum(
                    float(self.scores[p][f]) if p in self.scores and f in self.scores[p] else 0.0
                    for p in mem
                )
                opts.append((f, _bits(f) * n, score))
            options.append(opts)
        return names, [members[g] for g in names], options

    def total_numel(self) -> int:
        return sum(int(n) for n in self.numel.values()) + int(self.extra_numel)


def _expand(members, choice) -> dict[str, str]:
    out = {}
    for mem, f in zip(members, choice, strict=True):
        for p in mem:
            out[p] = f
    return out


def _result(problem: Problem, members, options, idx, budget, solver, t0) -> Allocation:
    choice = [options[g][i][0] for g, i in enumerate(idx)]
    fmts = _expand(members, choice)
    ordered = {p: fmts[p] for p in problem.numel}
    score = sum(options[g][i][2] for g, i in enumerate(idx))
    return Allocation(
        formats=ordered,
        effective_bits=effective_bits(
            ordered, problem.numel, extra_numel=problem.extra_numel, extra_bits=problem.extra_bits
        ),
        total_score=float(score),
        budget=budget,
        solver=solver,
        solve_time_s=time.perf_counter() - t0,
    )


def _integer_costs(problem: Problem, options, budget: float):
    """Exact integer costs per option and the integer capacity (after gcd reduction and
    after subtracting each group's cheapest option)."""
    budget_q = Fraction(repr(float(budget)))
    capacity = budget_q * problem.total_numel() - Fraction(problem.extra_bits) * problem.extra_numel
    base = [min(c for _, c, _ in opts) for opts in options]
    rel = [[c - b for _, c, _ in opts] for opts, b in zip(options, base, strict=True)]
    capacity -= sum(base)
    if capacity < 0:
        return None, None, None
    fracs = [c for row in rel for c in row] + [capacity]
    denom = math.lcm(*(x.denominator for x in fracs))
    ints = [[int(c * denom) for c in row] for row in rel]
    cap = capacity * denom
    g = (
        math.gcd(*(c for row in ints for c in row if c))
        if any(c for row in ints for c in row)
        else 1
    )
    ints = [[c // g for c in row] for row in ints]
    return ints, math.floor(cap / g), g


def _min_bits(problem: Problem, options) -> float:
    low = sum(min(c for _, c, _ in opts) for opts in options)
    low += Fraction(problem.extra_bits) * problem.extra_numel
    return float(low / problem.total_numel())


def _below_cheapest(problem: Problem, options, budget: float) -> ValueError:
    return ValueError(
        f"budget {budget} bits/element is below the cheapest allocation "
        f"({_min_bits(problem, options):.4f} bits/element: every layer in its "
        "cheapest allowed format)"
    )


def check_budget(problem: Problem, budget: float) -> None:
    """Raise the ``ValueError`` :func:`search` raises when even the cheapest allocation of
    ``problem`` exceeds ``budget``. The cheapest allocation depends on the layers' sizes,
    candidates, groups and pins only, not on the scores: a problem of zero scores checks a
    budget before any calibration or scoring."""
    _, _, options = problem.group_options()
    if _integer_costs(problem, options, budget)[0] is None:
        raise _below_cheapest(problem, options, budget)


def search(problem: Problem, budget: float, *, solver: str = "auto") -> Allocation:
    """The allocation of least total score whose effective bits are <= ``budget``.

    ``solver``: "auto" (dynamic program when its table is small, else MILP), "dp", "milp".
    Raises ValueError when even the cheapest allocation exceeds the budget.
    """
    if solver not in ("auto", "dp", "milp"):
        raise ValueError(f"search: solver={solver!r}: expected 'auto', 'dp' or 'milp'")
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"search: budget={budget!r}: expected a positive number of bits")
    t0 = time.perf_counter()
    _, members, options = problem.group_options()
    costs, cap, _ = _integer_costs(problem, options, budget)
    if costs is None:
        raise _below_cheapest(problem, options, budget)
    scores = [[s for _, _, s in opts] for opts in options]
    if solver == "auto":
        solver = "dp" if len(options) * (cap + 1) <= _DP_MAX_CELLS else "milp"
    if solver == "dp":
        idx = _solve_dp(costs, scores, cap)
    else:
        idx = _solve_milp(costs, scores, cap)
    used = sum(costs[g][i] for g, i in enumerate(idx))
    if used > cap:  # pragma: no cover - both solvers guarantee this
        raise AssertionError(f"solver {solver} exceeded the budget ({used} > {cap})")
    return _result(problem, members, options, idx, float(budget), solver, t0)


def _solve_dp(costs: list[list[int]], scores: list[list[float]], cap: int) -> list[int]:
    """Exact multiple-choice knapsack over integer capacity 0..cap."""
    inf = np.inf
    best = np.full(cap + 1, inf)
    best[0] = 0.0
    choices = []
    for cost_row, score_row in zip(costs, scores, strict=True):
        new = np.full(cap + 1, inf)
        arg = np.zeros(cap + 1, np.int8)
        for i, (c, s) in enumerate(zip(cost_row, score_row, strict=True)):
            if c > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[c:] = best[: cap + 1 - c] + s
            better = cand < new
            new = np.where(better, cand, new)
            arg = np.where(better, i, arg)
        best = new
        choices.append(arg)
    end = int(np.argmin(best))  # first minimum: the cheapest among equal scores
    if not np.isfinite(best[end]):  # pragma: no cover - capacity >= 0 was checked
        raise AssertionError("dynamic program found no feasible allocation")
    idx = []
    c = end
    for g in range(len(costs) - 1, -1, -1):
        i = int(choices[g][c])
        idx.append(i)
        c -= costs[g][i]
    return idx[::-1]


def _solve_milp(costs: list[list[int]], scores: list[list[float]], cap: int) -> list[int]:
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = [len(r) for r in costs]
    n = sum(sizes)
    start = np.cumsum([0] + sizes[:-1])
    c_scale = max(max(max(r) for r in costs), 1)
    s_flat = []
    for row in scores:  # shift each group to min 0 (argmin unchanged), then normalise
        lo = min(row)
        s_flat += [s - lo for s in row]
    s_arr = np.asarray(s_flat, np.float64)
    s_arr = s_arr / max(float(s_arr.max()), 1e-300)
    # Tie-break towards cheaper options with a weight far below any score difference.
    cost_arr = np.asarray([c for r in costs for c in r], np.float64)
    obj = s_arr + 1e-9 * cost_arr / c_scale
    onehot = np.zeros((len(sizes), n))
    for g, (s0, k) in enumerate(zip(start, sizes, strict=True)):
        onehot[g, s0 : s0 + k] = 1.0
    bound = float(cap)
    for _ in range(20):
        cons = [
            LinearConstraint(onehot, 1.0, 1.0),
            LinearConstraint(cost_arr[None, :] / c_scale, -np.inf, bound / c_scale),
        ]
        res = milp(
            obj,
            constraints=cons,
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            options={"mip_rel_gap": 0.0},
        )
        if res.x is None:
            raise ValueError(f"MILP found no feasible allocation ({res.message})")
        idx = [int(np.argmax(res.x[s0 : s0 + k])) for s0, k in zip(start, sizes, strict=True)]
        used = sum(costs[g][i] for g, i in enumerate(idx))
        if used <= cap:
            return idx
        bound -= (used - cap) + 0.5  # tolerance overshoot: tighten and re-solve
    raise ValueError("MILP kept exceeding the budget by its tolerance")  # pragma: no cover


def brute_force(problem: Problem, budget: float) -> Allocation:
    """Enumerate every allocation (exponential: tests and tiny instances only)."""
    t0 = time.perf_counter()
    _, members, options = problem.group_options()
    n_total = problem.total_numel()
    limit = (
        Fraction(repr(float(budget))) * n_total - Fraction(problem.extra_bits) * problem.extra_numel
    )
    best, best_key = None, None
    for idx in itertools.product(*(range(len(o)) for o in options)):
        cost = sum(options[g][i][1] for g, i in enumerate(idx))
        if cost > limit:
            continue
        score = sum(options[g][i][2] for g, i in enumerate(idx))
        key = (score, cost)
        if best_key is None or key < best_key:
            best, best_key = idx, key
    if best is None:
        raise ValueError(
            f"budget {budget} bits/element is below the cheapest allocation "
            f"({_min_bits(problem, options):.4f})"
        )
    return _result(problem, members, options, list(best), float(budget), "brute_force", t0)

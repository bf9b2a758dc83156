"""Validation of allocations: the evaluator, the evaluated points and the PTQ-effects table.

:class:`Evaluator` gives an allocation's per-batch validation losses (cached by allocation,
PTQ options and input quantization) on the fixed evaluation batches, priced in effective
bits as the search prices it. :func:`evaluate` is the run's evaluation phase: the uniform
formats, the fixed heuristic (:func:`heuristic_allocation`), the searched allocation across
budgets and a trained one, and the paired differences between them;
:func:`ptq_effects` measures each PTQ choice (RTN, MSE scale, four over six, GPTQ; dynamic
vs static input amax) on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from microscale.formats import get_weight_format, weight_only
from microscale.formats.ggml import layer_format
from microscale.ptq.config import QuantizeConfig
from microscale.ptq.engine import ActQuant, Engine
from microscale.ptq.search import (
    EMBED_ITEM,
    Allocation,
    Problem,
    effective_bits,
    linear_formats,
    model_bits,
    search,
)
from microscale.ptq.weights import WeightCache, WeightPTQ, supports_four_over_six

__all__ = [
    "Evaluator",
    "evaluate",
    "heuristic_allocation",
    "ptq_effects",
    "uniform_allocation",
]


def _block_index(path: str) -> int | None:
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


def heuristic_allocation(
    paths: Sequence[str],
    high: str,
    low: str,
    *,
    pinned: Mapping[str, str] | None = None,
    groups: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The fixed heuristic: ``high`` for the first and last blocks (first integer path
    component) and for down-projections (paths ending in ``down_proj``), ``low`` for the
    rest; a group with one high member is high; pinned layers keep their format."""
    idx = {p: _block_index(p) for p in paths}
    blocks = [i for i in idx.values() if i is not None]
    ends = {min(blocks), max(blocks)} if blocks else set()
    out = {p: high if (idx[p] in ends or p.endswith("down_proj")) else low for p in paths}
    if groups:
        high_groups = {groups[p] for p in paths if out[p] == high}
        out = {p: high if groups[p] in high_groups else f for p, f in out.items()}
    for p, f in (pinned or {}).items():
        out[p] = f
    return out


def uniform_allocation(paths: Sequence[str], fmt: str, pinned: Mapping[str, str]) -> dict[str, str]:
    """Every layer in ``fmt``, pinned layers keeping their pin."""
    return {p: pinned.get(p, fmt) for p in paths}


class Evaluator:
    """Validation loss of allocations (cached by allocation and PTQ options)."""

    def __init__(
        self,
        engine: Engine,
        weights: WeightCache,
        evals,
        cfg: QuantizeConfig,
        static_amax,
        problem: Problem,
        trained: Mapping[str, str] | None = None,
    ):
        self.engine, self.weights, self.evals, self.cfg = engine, weights, evals, cfg
        self.static_amax = static_amax
        # allocations are priced as the search prices them: the problem's elements (the
        # embedding item among them when searched: every allocation then has a format for
        # it, bf16 unless given) and its extra elements at 16 bits
        self.extra = problem.extra_numel
        self.numel = dict(problem.numel)
        self.embed = EMBED_ITEM in self.numel
        self.other_numel = engine.other_numel - self.numel.get(EMBED_ITEM, 0)
        self._cache: dict[Any, np.ndarray] = {}
        # called after each evaluated batch (progress), or None
        self.progress: Callable[[], None] | None = None
        # every format an evaluated allocation may use: one compiled W4A4 forward
        trained_formats = tuple((trained or {}).values())
        self.palette = tuple(
            sorted(
                {
                    f
                    for f in (*cfg.formats, *cfg.uniform_formats, *cfg.heuristic, *trained_formats)
                    if get_weight_format(f).quantized and not weight_only(get_weight_format(f))
                }
            )
        )

    def loss(self, assignment: Mapping[str, str], ptq: WeightPTQ, **kw) -> float:
        return float(np.mean(self.batch_losses(assignment, ptq, **kw)))

    def batch_losses(
        self,
        assignment: Mapping[str, str],
        ptq: WeightPTQ,
        *,
        activations: bool | None = None,
        amax: Mapping[str, float] | None = None,
    ) -> np.ndarray:
        acts = self.cfg.activations if activations is None else activations
        amax = self.static_amax if amax is None and activations is None else amax
        assignment = self._full(assignment)
        key = (
            tuple(sorted(assignment.items())),
            ptq,
            acts,
            None if amax is None else tuple(sorted(amax.items())),
        )
        if key not in self._cache:
            linear = linear_formats(assignment)
            qw = self.weights.for_assignment(linear, ptq)
            params = self.engine.with_kernels({p: w.values for p, w in qw.items()})
            if EMBED_ITEM in assignment:
                params = self.engine.with_tables(assignment[EMBED_ITEM], params)
            act = ActQuant.matching(linear, amax, self.palette) if acts else None
            self._cache[key] = self.engine.batch_losses(
                params, self.evals, act, progress=self.progress
            )
            del params
        return self._cache[key]

    def paired(
        self,
        a: Mapping[str, str],
        b: Mapping[str, str],
        ptq: WeightPTQ,
        ptq_b: WeightPTQ | None = None,
    ) -> dict[str, float]:
        """Mean per-batch loss difference ``a - b`` on the evaluation batches, its standard
        error and t = mean / se (the batches are the pairs: both see the same tokens); ``b``
        rounded with ``ptq_b`` (default: ``ptq``, as ``a``)."""
        d = self.batch_losses(a, ptq) - self.batch_losses(b, ptq if ptq_b is None else ptq_b)
        se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
        mean = float(np.mean(d))
        return {
            "dloss": mean,
            "se": se,
            "t": mean / se if se and math.isfinite(se) and se > 0 else float("nan"),
            "batches": int(len(d)),
        }

    def point(
        self,
        assignment: Mapping[str, str],
        ptq: WeightPTQ,
        *,
        kind: str,
        budget: float | None = None,
        **kw,
    ) -> dict[str, Any]:
        losses = self.batch_losses(assignment, ptq, **kw)
        loss = float(np.mean(losses))
        full = self._full(assignment)
        linear = linear_formats(full)
        bits = effective_bits(full, self.numel, extra_numel=self.extra)
        # per-batch losses: pairs with any other point (or run) on the same batches
        out = {
            "kind": kind,
            "effective_bits": bits,
            **model_bits(full, self.numel, self.other_numel),
            "linear_bits": effective_bits(linear, self.engine.numel),
            "val_loss": loss,
            "val_ppl": float(math.exp(loss)),
            "batch_losses": [float(v) for v in losses],
        }
        if budget is not None:
            out["budget"] = budget
            out["layers"] = linear
        if self.embed:
            out["embedding"] = full[EMBED_ITEM]
        return out

    def _full(self, assignment: Mapping[str, str]) -> dict[str, str]:
        """``assignment`` as stored (each layer's ggml type that cannot hold its rows
        replaced by llama.cpp's fallback: a uniform Q4_K is Q5_0 on 576-wide rows, as
        llama-quantize writes it), with the embedding item's format (bf16 unless it names
        one) when the search has the item."""
        w = self.engine.rows  # a ggml type these rows cannot hold: llama.cpp's fallback
        out = {p: layer_format(f, w[p]) if p in w else f for p, f in assignment.items()}
        if self.embed and EMBED_ITEM not in out:
            out[EMBED_ITEM] = "bf16"
        return out


def ptq_effects(
    ev: Evaluator, cfg: QuantizeConfig, paths, pinned, alloc: Allocation, act_amax
) -> dict[str, Any]:
    """Validation perplexity with each PTQ choice on and off, per applicable format."""
    grid = cfg.ptq.scale_grid
    variants = {
        "rtn": WeightPTQ.rtn(),
        "mse_scale": WeightPTQ(mse_scale=True, four_over_six=False, scale_grid=grid),
        "four_over_six": WeightPTQ(mse_scale=False, four_over_six=True),
        "both": WeightPTQ(mse_scale=True, four_over_six=True, scale_grid=grid),
    }
    if cfg.ptq.method == "gptq":
        variants["gptq"] = cfg.ptq
    out: dict[str, Any] = {"weights": {}, "activations": {}}
    rows: dict[str, tuple[Mapping[str, str], list[str]]] = {}  # label: (allocation, variants)
    for f in cfg.uniform_formats:
        spec = get_weight_format(f)
        tensor, four6 = spec.has_tensor_scale, supports_four_over_six(spec)
        if not (tensor or four6 or ("gptq" in variants and spec.quantized)):
            continue
        names = (
            ["rtn"]
            + (["mse_scale"] if tensor else [])
            + (["four_over_six"] if four6 else [])
            + (["both"] if tensor and four6 else [])
            + (["gptq"] if "gptq" in variants else [])
        )
        rows[f"uniform_{f}"] = (uniform_allocation(paths, f, pinned), names)
    rows["searched"] = (alloc.formats, list(variants))
    for label, (_, names) in rows.items():
        out["weights"][label] = dict.fromkeys(names, 0.0)
    # variant by variant, each variant's weights forgotten after its last use (all of them
    # held at once were the run's peak memory: 16 candidate sets)
    for n, v in variants.items():
        for label, (assign, names) in rows.items():
            if n in names:
                out["weights"][label][n] = float(math.exp(ev.loss(assign, v)))
        if v != cfg.ptq:
            ev.weights.release(v)
    # W4A4 / W8A8 inputs: dynamic (per batch) vs static calibrated amax, vs weight-only.
    for f in cfg.uniform_formats:
        spec = get_weight_format(f)
        if not spec.has_tensor_scale:
            continue
        assign = uniform_allocation(paths, f, pinned)
        out["activations"][f"uniform_{f}"] = {
            "weight_only": float(math.exp(ev.loss(assign, cfg.ptq, activations=False))),
            "dynamic": float(math.exp(ev.loss(assign, cfg.ptq, activations=True))),
            "static": float(math.exp(ev.loss(assign, cfg.ptq, activations=True, amax=act_amax))),
        }
    return out


def evaluate(
    ev: Evaluator,
    problem: Problem,
    alloc: Allocation,
    groups: Mapping[str, str],
    pinned: Mapping[str, str],
    trained: Mapping[str, str] | None,
    say: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """Phase 4: the points (uniform formats, the heuristic, the searched allocation, the
    search at the heuristic's bits and at each Pareto budget, the trained allocation) and
    the paired differences of the searched and trained ones against the references."""
    cfg, paths = ev.cfg, ev.engine.paths
    points: dict[str, dict[str, Any]] = {}
    for f in cfg.uniform_formats:
        label = "bf16" if not get_weight_format(f).quantized else f"uniform_{f}"
        points[label] = ev.point(uniform_allocation(paths, f, pinned), cfg.ptq, kind="uniform")
    if "bf16" not in points:
        points["bf16"] = ev.point(uniform_allocation(paths, "bf16", {}), cfg.ptq, kind="uniform")
    heur = heuristic_allocation(paths, *cfg.heuristic, pinned=pinned, groups=groups)
    points["heuristic"] = ev.point(heur, cfg.ptq, kind="heuristic")
    points["searched"] = ev.point(alloc.formats, cfg.ptq, kind="searched", budget=cfg.budget)
    hb = points["heuristic"]["effective_bits"]
    try:
        at_h = search(problem, hb + 1e-9, solver=cfg.solver)
        points["searched_at_heuristic_bits"] = ev.point(
            at_h.formats, cfg.ptq, kind="searched", budget=hb
        )
    except ValueError:
        pass
    for b in cfg.pareto_budgets:
        try:
            a = search(problem, b, solver=cfg.solver)
        except ValueError:
            say(f"quantize: pareto budget {b} is infeasible with formats {cfg.formats}")
            continue
        points[f"pareto_{b:g}"] = ev.point(a.formats, cfg.ptq, kind="searched", budget=b)
    refs = {
        "heuristic": heur,
        "uniform_nvfp4": uniform_allocation(paths, "nvfp4", pinned),
        "bf16": uniform_allocation(paths, "bf16", {}),
    }
    compared: dict[str, tuple[Mapping[str, str], WeightPTQ]] = {
        "searched": (alloc.formats, cfg.ptq)
    }
    if trained is not None:
        # QAT trained its weights against round-to-nearest, and export rounds so
        roundings = {"trained": WeightPTQ.rtn()}
        if cfg.ptq.mse_scale or cfg.ptq.four_over_six or cfg.ptq.method != "rtn":
            roundings["trained_ptq"] = cfg.ptq
        for label, ptq in roundings.items():
            points[label] = ev.point(trained, ptq, kind=label)
            compared[label] = (trained, ptq)
    comparisons = {}
    for label, (assignment, ptq) in compared.items():
        for name, ref in refs.items():
            if name in points:
                comparisons[f"{label} - {name}"] = ev.paired(assignment, ref, ptq, cfg.ptq)
    say(
        "quantize: val ppl "
        + ", ".join(
            f"{k} {v['val_ppl']:.4f} @ {v['effective_bits']:.2f}b"
            for k, v in points.items()
            if not k.startswith("pareto_")
        )
    )
    return points, comparisons

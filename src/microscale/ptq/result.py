"""What a quantize run decided and measured: :class:`QuantizeResult` and its report.

:meth:`QuantizeResult.report` is ``report.json``'s record
(:class:`~microscale.outputs.QuantizeReport`; :mod:`~microscale.ptq.report` writes it
beside the checkpoint through :class:`~microscale.outputs.QuantizeOutput`); :func:`allocation_rules` turns the searched allocation
into the :class:`~microscale.model.PrecisionRules` training and export use, each layer's
recipe :func:`ptq_recipe`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from microscale.formats import get_weight_format
from microscale.model import PrecisionRules
from microscale.ops import SLOTS, OperandSpec, Recipe
from microscale.outputs import QuantizeReport
from microscale.ptq.config import QuantizeConfig
from microscale.ptq.engine import Engine
from microscale.ptq.imatrix import Imatrix
from microscale.ptq.search import Allocation
from microscale.ptq.weights import QuantizedWeight

__all__ = ["QuantizeResult", "allocation_rules", "ptq_recipe"]


def ptq_recipe(fmt: str, activations: bool = False) -> Recipe | str:
    """The inference recipe of a layer stored in ``fmt``: forward weights in ``fmt`` (1-D
    blocks along the input dimension), inputs in ``fmt`` too when ``activations``, bf16
    everywhere else (``Recipe.derive``: ``"ptq_<fmt>+bf16_backward_inputs"``, or
    ``"ptq_<fmt>+bf16_backward"`` with activations); ``"bf16"`` for an unquantized format."""
    spec = get_weight_format(fmt)
    if not spec.quantized:
        return "bf16"
    op = OperandSpec(format=spec.name)
    stored = Recipe(name=f"ptq_{spec.name}", **dict.fromkeys(SLOTS, op))  # type: ignore[arg-type]
    return stored.derive(bf16=("backward",) if activations else ("backward", "inputs"))


def allocation_rules(formats: Mapping[str, str], activations: bool = False) -> PrecisionRules:
    """{path: format} -> PrecisionRules: the most common format is the default, every other
    format one rule matching its layers' exact paths."""
    if not formats:
        raise ValueError("allocation_rules: empty allocation")
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    default = max(sorted(counts), key=lambda f: counts[f])
    rules = []
    for f in sorted(counts):
        if f == default:
            continue
        paths = [p for p, g in formats.items() if g == f]
        pattern = "|".join(re.escape(p) for p in paths)
        rules.append((f"(?:{pattern})", ptq_recipe(f, activations)))
    return PrecisionRules(rules=tuple(rules), default=ptq_recipe(default, activations))


@dataclasses.dataclass(kw_only=True)
class QuantizeResult:
    """Everything a quantize run measured and decided (see :meth:`report`)."""

    # The config of the run.
    config: QuantizeConfig
    # Candidate linear layer paths, in model order.
    paths: list[str]
    # {path: weight elements}.
    numel: dict[str, int]
    # {path: group name}.
    groups: dict[str, str]
    # {path: pinned format}.
    pinned: dict[str, str]
    # {path: max |input|} over the calibration batches.
    act_amax: dict[str, float]
    # {path: {amax, rms, and per format: rel_mse, rel_mse_rtn, scale_multiplier, ...}}.
    weight_stats: dict[str, dict[str, Any]]
    # Raw and (monotone-)corrected scores {path: {format: score}}.
    scores_raw: dict[str, dict[str, float]]
    scores: dict[str, dict[str, float]]
    # The searched allocation at config.budget.
    allocation: Allocation
    # Named evaluated allocations: {label: {"effective_bits", "val_ppl", "val_loss", ...}}.
    points: dict[str, dict[str, Any]]
    # PTQ effect measurements ({} when config.ptq_effects is off).
    ptq_effects: dict[str, Any]
    # Paired validation-loss differences {"searched - <ref>": {dloss, se, t, batches}}
    # over the same evaluation batches (is the difference larger than its noise?).
    comparisons: dict[str, dict[str, float]]
    # PrecisionRules of the searched allocation; None when it holds one of ggml's block
    # types (formats.weight_only), which no training recipe runs.
    rules: PrecisionRules | None
    # Quantized weights of the searched allocation {path: QuantizedWeight}.
    weights: dict[str, QuantizedWeight]
    # Calibration description (source, tokens, batches).
    calibration: dict[str, Any]
    # Wall times of the phases in seconds ("calibrate_s", "quantize_weights_s", "score_s",
    # "search_s", "evaluate_s", "ptq_effects_s").
    timings: dict[str, float]
    # Peak resident memory of each phase in GiB (microscale.ptq.phases).
    peak_rss_gb: dict[str, float] = dataclasses.field(default_factory=dict)
    # The token embedding / LM head item when the search chose its format
    # (QuantizeConfig.embed_formats): {"format", "numel", "candidates", "scores",
    # "scores_raw"}; None when it is not searched (stored bf16).
    embedding: dict[str, Any] | None = None
    # What AWQ chose (config.awq): {"format", "alphas", "tokens", "batches", "groups":
    # {name: {"alpha", "layers", "into", "error", "error_alpha0", "s_min", "s_max"}}};
    # None without AWQ.
    awq: dict[str, Any] | None = None
    # The importance matrix ggml's block types were encoded with (measured on the engine's
    # model over the calibration batches); None when the run has none of them.
    imatrix: Imatrix | None = None
    # The engine (model view) used; not serialized.
    engine: Engine | None = None

    @property
    def embed_format(self) -> str | None:
        """The searched format of the token embedding / LM head (None: not searched)."""
        return None if self.embedding is None else self.embedding["format"]

    @property
    def val_ppl(self) -> dict[str, float]:
        """{"bf16", "uniform_<fmt>", "heuristic", "searched", ...}: validation perplexity."""
        return {k: v["val_ppl"] for k, v in self.points.items() if not k.startswith("pareto_")}

    def report(self) -> QuantizeReport:
        """The report's record (``report.json``; the writer adds ``checkpoint`` and
        ``numerics``). ``embedding`` / ``embed_format`` are set only when searched and
        ``awq`` only with AWQ, so a default report is what it was before they existed."""
        a = self.allocation
        return QuantizeReport(
            budget=self.config.budget,
            # the budget's measure: linear layers only, or the whole model with
            # count_other_params; both are named in linear_bits / model_bits
            effective_bits=a.effective_bits,
            linear_bits=self.points["searched"]["linear_bits"],
            model_bits=self.points["searched"]["model_bits"],
            val_ppl=self.val_ppl,
            layers=dict(a.formats),
            method=self.config.method,
            formats=list(self.config.formats),
            activations=self.config.activations,
            static_act_scales=self.config.static_act_scales,
            ptq=dataclasses.asdict(self.config.ptq),
            seed=self.config.seed,
            solver=a.solver,
            solve_time_s=a.solve_time_s,
            total_score=a.total_score,
            counts=a.counts(),
            points=self.points,
            pareto=[dict(label=k, **v) for k, v in self.points.items()],
            ptq_effects=self.ptq_effects,
            comparisons=self.comparisons,
            monotone=self.config.use_monotone,
            groups=self.groups,
            pinned=self.pinned,
            numel=self.numel,
            scores=self.scores,
            scores_raw=self.scores_raw,
            act_amax=self.act_amax,
            weight_stats=self.weight_stats,
            calibration=self.calibration,
            timings=self.timings,
            peak_rss_gb=self.peak_rss_gb,
            config=_jsonable(self.config.to_dict()),
            embedding=self.embedding,
            embed_format=self.embed_format,
            awq=self.awq,
        )


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x

"""Adaptive PTQ end to end: calibrate, score, search, evaluate.

``quantize_model(model, calib_batches, eval_batches, config)`` works on any NNX model whose
linear layers have 2-D ``[in, out]`` kernels (microscale's ``Transformer``, an imported HF
checkpoint, ``nnx.Linear`` models; other layers stay as they are) and token batches
``[n, rows, seq + 1]``:

1. **calibrate** on held-out batches: every layer's input amax (the static input scales of
   W4A4 / W8A8 deployment) and weight statistics;
2. **quantize** every kernel in every candidate format with the PTQ choices
   (:mod:`~microscale.ptq.weights`: MSE tensor scale, four over six; GPTQ error
   compensation with each layer's calibration-input Hessian when ``config.ptq.method`` is
   ``"gptq"``, so the scores, the search and every evaluated point see GPTQ weights),
   fused groups sharing one tensor scale;
3. **score** every (layer, format) (:mod:`~microscale.ptq.sensitivity`; default the
   signed second-order Taylor estimate of the loss change, one fwd+bwd per calibration
   batch), monotone corrected for the unsigned scores;
4. **search** the allocation of least total score within the bit budget
   (:mod:`~microscale.ptq.search`), fused groups sharing a format, pinned layers fixed;
5. **evaluate** validation perplexity of BF16, uniform formats, the fixed heuristic
   (first/last blocks and down-projections in FP8, the rest NVFP4) and the searched
   allocation across budgets (the Pareto curve), the paired per-batch differences of the
   searched allocation against the heuristic, uniform NVFP4 and BF16 (mean, standard
   error, t: is a 0.1% perplexity difference more than evaluation noise?), and the
   effect of each PTQ choice. A ``trained`` allocation (the one a QAT run or a
   sensitivity-chosen bf16 run trained with, and that ``microscale export`` writes for it)
   is evaluated too, with its paired differences against BF16 and uniform NVFP4: rounded to
   nearest in the format's 1-D blocks along the input dimension, as a QAT forward pass and
   export round it (point ``trained``; a full training recipe's 16x16 weight tiles are not
   reproduced), and with ``config.ptq`` (point ``trained_ptq``, when that is not
   round-to-nearest). Every other allocation is evaluated with the same PTQ choices
   (``config.ptq``) and priced by the same :func:`~microscale.ptq.search.effective_bits`.

Weight-only (W4A16-style) by default: the model runs bf16 GEMMs on
``bf16(dequantize(quantize(W)))``. With ``activations=True`` each quantized layer's input is
quantized too, in the layer's format, with the calibrated static amax
(``static_act_scales``; dynamic per-batch amax otherwise), in scoring and evaluation alike;
GPTQ then takes each format's Hessians ``2 Q_f(X)^T Q_f(X) / n`` from the inputs quantized
in that format (one calibration pass per format, when GPTQ first needs it).

The result carries the :class:`~microscale.model.PrecisionRules` of the searched allocation
(each layer's recipe quantizes its forward weights, and inputs under W4A4, in its format:
the same rule object training and export use) and the quantized weights
(:class:`~microscale.formats.QArray` in the export layout). Deterministic given
``config.seed`` (which picks the calibration windows, see :mod:`~microscale.ptq.run`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from microscale.export.gguf import EMBED_FORMATS, GGUF_FORMATS
from microscale.formats import get_format
from microscale.model import PrecisionRules
from microscale.ops import SLOTS, OperandSpec, Recipe
from microscale.ptq.awq import DEFAULT_ALPHAS, awq_fold
from microscale.ptq.engine import ActQuant, Engine, LossFn
from microscale.ptq.phases import Phases
from microscale.ptq.search import (
    DEFAULT_GROUPS,
    Allocation,
    Problem,
    check_budget,
    effective_bits,
    group_layers,
    model_bits,
    search,
)
from microscale.ptq.sensitivity import (
    METHODS,
    ONE_PASS,
    SIGNED_METHODS,
    monotone,
    score,
    table_scores,
)
from microscale.ptq.weights import (
    QuantizedWeight,
    WeightPTQ,
    quantize_group,
    supports_four_over_six,
)

__all__ = [
    "DEFAULT_FORMATS",
    "EMBED_ITEM",
    "GGUF_CANDIDATES",
    "QuantizeConfig",
    "QuantizeResult",
    "allocation_rules",
    "check_quantize_budget",
    "heuristic_allocation",
    "ptq_recipe",
    "quantize_model",
]

DEFAULT_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "bf16")
# What ggml / llama.cpp runs natively (microscale.export.gguf), for --target gguf.
GGUF_CANDIDATES = (*GGUF_FORMATS, "bf16")
DEFAULT_PIN = ((r"(.*\.)?lm_head", "bf16"), (r"(.*\.)?embed(_tokens|ding)?", "bf16"))
DEFAULT_PARETO = (4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5)
# The search's item for the token embedding / LM head (QuantizeConfig.embed_formats): a
# name no linear layer path takes.
EMBED_ITEM = "<embedding>"


def _check_format_list(name: str, fmts) -> tuple[str, ...]:
    if isinstance(fmts, str):
        fmts = tuple(f.strip() for f in fmts.split(",") if f.strip())
    fmts = tuple(fmts)
    if not fmts:
        raise ValueError(f"QuantizeConfig.{name} is empty: expected at least one format")
    for f in fmts:
        try:
            get_format(f)
        except ValueError as e:
            raise ValueError(f"QuantizeConfig.{name}: {e}") from None
    if len(set(fmts)) != len(fmts):
        raise ValueError(f"QuantizeConfig.{name}={fmts!r} lists a format twice")
    return fmts


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """One adaptive-PTQ run."""

    # Effective bits per weight element the searched allocation may use (<=).
    budget: float = 4.8
    # Candidate formats of the search (registry names).
    formats: tuple[str, ...] = DEFAULT_FORMATS
    # Sensitivity estimator: "taylor" (first + second order loss change, one fwd+bwd per
    # batch), "gradient" (ModelOpt's Fisher score, same pass), "kl", "loss" (one forward
    # per layer, format and batch). See microscale.ptq.sensitivity and docs/ptq/.
    method: str = "taylor"
    # Calibration tokens (held-out windows; rounded up to whole batches). The first-order
    # term needs enough of them: fewer move the allocation (docs/ptq/real-model.md,
    # "How many score tokens").
    calib_tokens: int = 65536
    # Seed of the calibration window choice (everything else is deterministic).
    seed: int = 0
    # Weight PTQ beyond round-to-nearest (MSE tensor scale, four over six).
    ptq: WeightPTQ = dataclasses.field(default_factory=WeightPTQ)
    # Quantize each quantized layer's input too (W4A4 / W8A8), in scoring and evaluation;
    # with ptq.method "gptq", each format's GPTQ Hessians come from the inputs quantized in
    # that format (the GEMM that runs).
    activations: bool = False
    # With activations: static calibrated input amax (True) or dynamic per batch (False).
    static_act_scales: bool = True
    # Replace each score by the least score of the formats costing at most as many bits.
    # None: on for the unsigned scores (gradient, kl), off for the signed loss changes
    # (taylor, loss), where a cheaper format can measurably *lower* the loss and the
    # correction would credit that gain to the dearer formats too.
    monotone: bool | None = None
    # (regex, group template) fused groups sharing one format and one tensor scale.
    groups: tuple[tuple[str, str], ...] = DEFAULT_GROUPS
    # (regex, format) layers forced to a format (still counted in the budget).
    pin: tuple[tuple[str, str], ...] = DEFAULT_PIN
    # Count the non-linear parameters (embeddings, norms, LM head) in the effective bits:
    # the token embedding / LM head at its searched format (embed_formats), the rest at 16
    # bits (False: the budget covers the candidate linear layers only).
    count_other_params: bool = False
    # Candidate formats of the token embedding / LM head (a tied model's one table, an
    # untied model's embedding and LM head together), one more item of the search whose
    # scores are measured with the table stored so in a GGUF (microscale.export.gguf.
    # EMBED_FORMATS: bf16 and GGUF's formats without a global scale). Searched only with
    # count_other_params. None: EMBED_FORMATS there, except with method "gradient" (its
    # Fisher units have no measured counterpart for a table: the table stays bf16).
    embed_formats: tuple[str, ...] | None = None
    # Knapsack solver: "auto", "dp" (exact dynamic program) or "milp" (scipy HiGHS).
    solver: str = "auto"
    # Budgets of the searched points of the Pareto curve.
    pareto_budgets: tuple[float, ...] = DEFAULT_PARETO
    # Uniform allocations evaluated for the Pareto plot (bf16 is the reference).
    uniform_formats: tuple[str, ...] = ("nvfp4", "mxfp4", "fp8_e4m3", "mxfp8", "bf16")
    # Fixed heuristic: (high format for first/last blocks and down-projections, low format).
    heuristic: tuple[str, str] = ("fp8_e4m3", "nvfp4")
    # Evaluate each PTQ choice (RTN vs MSE scale vs four over six; W4A4 static vs dynamic).
    ptq_effects: bool = True
    # AWQ-style activation-aware per-input-channel weight scales (microscale.ptq.awq),
    # chosen on the calibration batches and folded into the model first (1/s into the
    # preceding RMSNorm for q/k/v and gate/up, into v_proj's / up_proj's output columns for
    # o_proj / down_proj), so every phase and every written output sees the folded model.
    # Off by default for now (it changes every default run's numbers); on SmolLM2-135M it
    # lowered uniform NVFP4's perplexity by 8% (docs/ptq/gptq.md, "AWQ").
    awq: bool = False
    # AWQ: the grid of alpha in s = mean|X|^alpha (0, no scaling, is always tried).
    awq_alphas: tuple[float, ...] = DEFAULT_ALPHAS
    # AWQ: the format whose calibration output error chooses each group's alpha (with the
    # run's ptq choices; GPTQ rounds to nearest in that search).
    awq_format: str = "nvfp4"

    def __post_init__(self):
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b) or b <= 0:
            raise ValueError(
                f"QuantizeConfig.budget={b!r}: expected a positive number of "
                "bits per weight element (e.g. 4.8)"
            )
        object.__setattr__(self, "formats", _check_format_list("formats", self.formats))
        if not any(get_format(f).quantized for f in self.formats):
            raise ValueError(
                f"QuantizeConfig.formats={','.join(self.formats)}: no quantized format, so "
                "every layer stays as it is and there is nothing to score, search or "
                "scale (awq); add one, e.g. formats=nvfp4,bf16"
            )
        object.__setattr__(
            self, "uniform_formats", _check_format_list("uniform_formats", self.uniform_formats)
        )
        _check_format_list("heuristic", self.heuristic)
        if len(self.heuristic) != 2:
            raise ValueError(
                f"QuantizeConfig.heuristic={self.heuristic!r}: expected (high format, low format)"
            )
        if self.method not in METHODS:
            raise ValueError(f"QuantizeConfig.method={self.method!r}: expected one of {METHODS}")
        if (
            isinstance(self.calib_tokens, bool)
            or not isinstance(self.calib_tokens, int)
            or self.calib_tokens < 1
        ):
            raise ValueError(
                f"QuantizeConfig.calib_tokens={self.calib_tokens!r}: expected a positive int"
            )
        if self.solver not in ("auto", "dp", "milp"):
            raise ValueError(
                f"QuantizeConfig.solver={self.solver!r}: expected 'auto', 'dp' or 'milp'"
            )
        for name in ("groups", "pin"):
            pairs = tuple(tuple(x) for x in getattr(self, name))
            for pair in pairs:
                if len(pair) != 2:
                    raise ValueError(
                        f"QuantizeConfig.{name} entry {pair!r}: expected a (regex, value) pair"
                    )
                try:
                    re.compile(pair[0])
                except re.error as e:
                    raise ValueError(f"QuantizeConfig.{name} regex {pair[0]!r}: {e}") from None
                if name == "pin":
                    _check_format_list("pin", (pair[1],))
            object.__setattr__(self, name, pairs)
        budgets = tuple(float(x) for x in self.pareto_budgets)
        if any(not (math.isfinite(x) and x > 0) for x in budgets):
            raise ValueError(
                f"QuantizeConfig.pareto_budgets={self.pareto_budgets!r}: expected positive numbers"
            )
        object.__setattr__(self, "pareto_budgets", budgets)
        if not isinstance(self.ptq, WeightPTQ):
            raise TypeError(f"QuantizeConfig.ptq={self.ptq!r}: expected a WeightPTQ")
        if self.embed_formats is not None:
            self._check_embed_formats()
        self._check_awq()

    def _check_awq(self) -> None:
        alphas = tuple(float(a) for a in self.awq_alphas)
        if not alphas or any(not (0.0 <= a <= 1.0) for a in alphas):
            raise ValueError(
                f"QuantizeConfig.awq_alphas={self.awq_alphas!r}: expected values in [0, 1]"
            )
        object.__setattr__(self, "awq_alphas", alphas)
        (fmt,) = _check_format_list("awq_format", (self.awq_format,))
        if not get_format(fmt).quantized:
            raise ValueError(
                f"QuantizeConfig.awq_format={fmt!r}: expected a quantized format (e.g. nvfp4)"
            )

    def _check_embed_formats(self) -> None:
        fmts = _check_format_list("embed_formats", self.embed_formats)
        object.__setattr__(self, "embed_formats", fmts)
        bad = [f for f in fmts if f not in EMBED_FORMATS]
        if bad:
            raise ValueError(
                f"QuantizeConfig.embed_formats: {bad} cannot store the token embedding "
                f"(a GGUF stores it as one of {list(EMBED_FORMATS)})"
            )
        if not self.count_other_params:
            raise ValueError(
                "QuantizeConfig.embed_formats has no effect without count_other_params=true "
                "(only a budget that counts the whole model searches the embedding)"
            )
        if self.method == "gradient" and any(get_format(f).quantized for f in fmts):
            raise ValueError(
                "QuantizeConfig.embed_formats: method 'gradient' cannot score the token "
                "embedding (its Fisher units have no measured counterpart); use taylor, "
                "loss or kl, or embed_formats=bf16"
            )

    @classmethod
    def for_gguf(cls, **overrides: Any) -> QuantizeConfig:
        """Search only what llama.cpp runs natively (``GGUF_CANDIDATES``: nvfp4, mxfp4, q8_0,
        bf16 at 4.5, 4.25, 8.5 and 16 bits per weight, ggml's block sizes), with the
        heuristic's 8-bit layers in q8_0."""
        return cls(
            **{
                "formats": GGUF_CANDIDATES,
                "uniform_formats": GGUF_CANDIDATES,
                "heuristic": ("q8_0", "nvfp4"),
                **overrides,
            }
        )

    @property
    def searched_embed_formats(self) -> tuple[str, ...]:
        """The token embedding's candidates in the search (``embed_formats``, or its
        default); () when it is not an item (counted at 16 bits, or not at all)."""
        if not self.count_other_params:
            return ()
        if self.embed_formats is not None:
            return self.embed_formats
        return () if self.method == "gradient" else EMBED_FORMATS

    @property
    def use_monotone(self) -> bool:
        """Whether the monotone correction applies (``monotone``, or its method default)."""
        if self.monotone is None:
            return self.method not in SIGNED_METHODS
        return bool(self.monotone)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- rules


def ptq_recipe(fmt: str, activations: bool = False) -> Recipe | str:
    """The inference recipe of a layer stored in ``fmt``: forward weights in ``fmt`` (1-D
    blocks along the input dimension), inputs in ``fmt`` too when ``activations``, bf16
    everywhere else (``Recipe.derive``: ``"ptq_<fmt>+bf16_backward_inputs"``, or
    ``"ptq_<fmt>+bf16_backward"`` with activations); ``"bf16"`` for an unquantized format."""
    spec = get_format(fmt)
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


# ---------------------------------------------------------------------- allocations


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


def _uniform(paths: Sequence[str], fmt: str, pinned: Mapping[str, str]) -> dict[str, str]:
    return {p: pinned.get(p, fmt) for p in paths}


# ---------------------------------------------------------------------- result


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
    # PrecisionRules of the searched allocation.
    rules: PrecisionRules
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

    def report(self) -> dict[str, Any]:
        """The JSON report (``report.json``)."""
        a = self.allocation
        return {
            "budget": self.config.budget,
            # the budget's measure: linear layers only, or the whole model with
            # count_other_params; both are named in linear_bits / model_bits
            "effective_bits": a.effective_bits,
            "linear_bits": self.points["searched"]["linear_bits"],
            "model_bits": self.points["searched"]["model_bits"],
            "val_ppl": self.val_ppl,
            "layers": dict(a.formats),
            "method": self.config.method,
            "formats": list(self.config.formats),
            "activations": self.config.activations,
            "static_act_scales": self.config.static_act_scales,
            "ptq": dataclasses.asdict(self.config.ptq),
            "seed": self.config.seed,
            "solver": a.solver,
            "solve_time_s": a.solve_time_s,
            "total_score": a.total_score,
            "counts": a.counts(),
            "points": self.points,
            "pareto": [dict(label=k, **v) for k, v in self.points.items()],
            "ptq_effects": self.ptq_effects,
            "comparisons": self.comparisons,
            "monotone": self.config.use_monotone,
            "groups": self.groups,
            "pinned": self.pinned,
            "numel": self.numel,
            "scores": self.scores,
            "scores_raw": self.scores_raw,
            "act_amax": self.act_amax,
            "weight_stats": self.weight_stats,
            "calibration": self.calibration,
            "timings": self.timings,
            "peak_rss_gb": self.peak_rss_gb,
            "config": _jsonable(self.config.to_dict()),
            # only when searched: a default report is what it was before the item existed
            **(
                {}
                if self.embedding is None
                else {"embedding": self.embedding, "embed_format": self.embed_format}
            ),
            **({} if self.awq is None else {"awq": self.awq}),
        }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


# ---------------------------------------------------------------------- the run


class _Weights:
    """Quantized kernels per (format, PTQ options), computed once per group."""

    def __init__(
        self,
        engine: Engine,
        groups: Mapping[str, str],
        hessians: Mapping[str, Any] | Callable[[str], Mapping[str, Any]] | None = None,
    ):
        self.engine = engine
        # {path: input Hessian} for GPTQ, or format -> {path: Hessian} (W4A4: the inputs
        # quantized in that format; computed when GPTQ first needs the format, the latest
        # kept); None: only round-to-nearest is available
        self.hessians = hessians
        self._hessians_of: tuple[str, Mapping[str, Any]] | None = None
        self.members: dict[str, list[str]] = {}
        for p in engine.paths:
            self.members.setdefault(groups[p], []).append(p)
        # (format, PTQ options or None for an unquantized format) -> {path: weight}; the
        # weights hold only their packed QArrays (QuantizedWeight.values decodes on demand)
        self._cache: dict[tuple[str, WeightPTQ | None], dict[str, QuantizedWeight]] = {}

    def get(self, fmt: str, ptq: WeightPTQ) -> dict[str, QuantizedWeight]:
        # an unquantized format ignores the PTQ options: one entry serves them all
        key = (fmt, ptq if get_format(fmt).quantized else None)
        if key not in self._cache:
            out: dict[str, QuantizedWeight] = {}
            by_path = self._hessians(fmt, ptq)
            for mem in self.members.values():
                hs = None if by_path is None else [by_path[p] for p in mem]
                qs = quantize_group([self.engine.kernels[p] for p in mem], fmt, ptq, hs)
                out.update(zip(mem, qs, strict=True))
            self._cache[key] = {p: out[p] for p in self.engine.paths}
        return self._cache[key]

    def _hessians(self, fmt: str, ptq: WeightPTQ) -> Mapping[str, Any] | None:
        if not callable(self.hessians):
            return self.hessians
        if ptq.method != "gptq" or not get_format(fmt).quantized:
            return None
        if self._hessians_of is None or self._hessians_of[0] != fmt:
            self._hessians_of = None  # the previous format's arrays go first
            self._hessians_of = (fmt, self.hessians(fmt))
        return self._hessians_of[1]

    def for_assignment(
        self, assignment: Mapping[str, str], ptq: WeightPTQ
    ) -> dict[str, QuantizedWeight]:
        return {p: self.get(f, ptq)[p] for p, f in assignment.items()}

    def release(self, ptq: WeightPTQ) -> None:
        """Forget the quantized formats' weights under ``ptq`` (computed again if asked
        for): the PTQ-effects table's variants, one at a time."""
        for key in [k for k in self._cache if k[1] == ptq]:
            del self._cache[key]


def quantize_model(
    model: Any,
    calib_batches,
    eval_batches,
    config: QuantizeConfig | None = None,
    *,
    loss_fn: LossFn | None = None,
    calibration: Mapping[str, Any] | None = None,
    trained: Mapping[str, str] | None = None,
    candidates: Mapping[str, Sequence[str]] | None = None,
    log: Callable[[str], None] | None = None,
) -> QuantizeResult:
    """Calibrate, score, search and evaluate (see the module doc).

    Args:
      model: an NNX model with linear layers (left untouched: a private copy is used).
      calib_batches: int token batches ``[n, rows, seq + 1]`` (held out; calibration).
      eval_batches: token batches for validation perplexity (disjoint from calibration).
      config: the run's :class:`QuantizeConfig`.
      loss_fn: ``loss_fn(model, batch) -> scalar``; default next-token cross-entropy.
      calibration: a description of where the calibration batches came from (reported).
      trained: ``{path: format}`` the model was trained with (QAT): evaluated as the points
        ``"trained"`` (round-to-nearest weights) and ``"trained_ptq"`` (``config.ptq``,
        when it differs), pinned layers keeping their pin, with paired differences.
      candidates: ``{path: formats}`` the search may give those layers instead of
        ``config.formats`` (the output layout's restrictions: its ``candidates`` record).
      log: progress messages (e.g. ``print``); None is silent.

    Long: the run's five phases in order, one call each, with the arguments each phase
    hands the next; split, the parts would pass the same dozen names back and forth.
    """
    cfg = QuantizeConfig() if config is None else config
    say = log or (lambda _msg: None)
    calib = [np.asarray(b) for b in calib_batches]
    evals = [np.asarray(b) for b in eval_batches]
    phases = Phases(log)
    options = {p: tuple(f) for p, f in (candidates or {}).items()}
    engine, groups, pinned, trained, awq = _prepare(
        model, calib, evals, cfg, loss_fn, trained, phases, say, options
    )
    paths = engine.paths
    # 1. calibration, 2. sensitivity (the layers', then the token embedding's)
    act_amax, static, weights = _calibrate(engine, calib, cfg, groups, phases)
    raw, scores, stats = _score_layers(engine, weights, calib, cfg, static, phases, say, act_amax)
    embed = _score_embedding(engine, calib, cfg, phases)
    # 3. search
    with phases.phase("search", total=1, unit="solve"):
        problem = _problem(engine, cfg, scores, groups, pinned, embed, options)
        alloc = search(problem, cfg.budget, solver=cfg.solver)
    if embed is not None:
        embed["format"] = alloc.formats[EMBED_ITEM]
    say(
        f"quantize: searched allocation at {alloc.effective_bits:.3f} bits "
        f"(budget {cfg.budget}) {alloc.counts()} in {alloc.solve_time_s * 1e3:.1f} ms"
    )
    # 4. evaluation, 5. the effect of each PTQ choice
    evaluator = _Evaluator(engine, weights, evals, cfg, static, problem, trained)
    with phases.phase("evaluate", total=None) as tick:
        evaluator.progress = tick
        points, comparisons = _evaluate(evaluator, problem, alloc, groups, pinned, trained, say)
    effects: dict[str, Any] = {}
    if cfg.ptq_effects:
        with phases.phase("ptq_effects", total=None) as tick:
            evaluator.progress = tick
            effects = _ptq_effects(evaluator, cfg, paths, pinned, alloc, act_amax)
    evaluator.progress = None
    return _result(
        cfg,
        engine,
        weights,
        alloc,
        calib,
        calibration,
        phases,
        groups=groups,
        pinned=pinned,
        act_amax=act_amax,
        weight_stats=stats,
        scores_raw=raw,
        scores=scores,
        points=points,
        comparisons=comparisons,
        ptq_effects=effects,
        embedding=embed,
        awq=awq,
    )


def _prepare(
    model: Any,
    calib,
    evals,
    cfg: QuantizeConfig,
    loss_fn: LossFn | None,
    trained: Mapping[str, str] | None,
    phases: Phases,
    say: Callable[[str], None],
    options: Mapping[str, tuple[str, ...]],
) -> tuple[Engine, dict[str, str], dict[str, str], dict[str, str] | None, dict | None]:
    """The engine (of the AWQ-folded model with ``config.awq``), the layers' groups, pins
    and trained formats, and what AWQ chose; the budget is checked first, before AWQ's
    phase: the folded model has the same layers and sizes."""
    with phases.phase("setup", total=1, unit="model"):
        engine = Engine(model, loss_fn=loss_fn)
    groups, pinned, trained = _setup(engine, cfg, calib, evals, trained, say, options)
    awq = None
    if cfg.awq:
        model, awq = _awq(model, calib, cfg, loss_fn, phases, say)
        engine = Engine(model, loss_fn=loss_fn)
    return engine, groups, pinned, trained, awq


def _awq(
    model: Any,
    calib,
    cfg: QuantizeConfig,
    loss_fn: LossFn | None,
    phases: Phases,
    say: Callable[[str], None],
) -> tuple[Any, dict[str, Any]]:
    """Phase 0 (``config.awq``): a copy of ``model`` with AWQ scales folded in, and what
    was chosen (:func:`~microscale.ptq.awq.awq_fold`)."""
    with phases.phase("awq", total=None, unit="step") as tick:
        folded, info = awq_fold(
            model,
            calib,
            fmt=cfg.awq_format,
            ptq=cfg.ptq,
            alphas=cfg.awq_alphas,
            loss_fn=loss_fn,
            progress=tick,
        )
    alphas = [g["alpha"] for g in info["groups"].values()]
    say(
        f"quantize: awq scales for {len(alphas)} groups in {phases.timings['awq_s']:.1f}s "
        f"({sum(a > 0 for a in alphas)} scaled; alpha median {float(np.median(alphas)):.2f})"
    )
    return folded, info


def _result(
    cfg: QuantizeConfig,
    engine: Engine,
    weights: _Weights,
    alloc: Allocation,
    calib,
    calibration: Mapping[str, Any] | None,
    phases: Phases,
    **fields: Any,
) -> QuantizeResult:
    """The result: the searched allocation of the linear layers (the embedding item's
    format is in ``fields["embedding"]``), its rules and weights, and ``fields``."""
    linear = dataclasses.replace(alloc, formats=_linear(alloc.formats))
    return QuantizeResult(
        config=cfg,
        paths=engine.paths,
        numel=dict(engine.numel),
        allocation=linear,
        rules=allocation_rules(linear.formats, cfg.activations),
        weights=weights.for_assignment(linear.formats, cfg.ptq),
        calibration=dict(
            calibration or {},
            batches=len(calib),
            tokens=int(sum(b.shape[0] * (b.shape[1] - 1) for b in calib)),
        ),
        timings=phases.timings,
        peak_rss_gb=phases.peak_rss_gb,
        engine=engine,
        **fields,
    )


def _setup(
    engine: Engine,
    cfg: QuantizeConfig,
    calib: Sequence[np.ndarray],
    evals: Sequence[np.ndarray],
    trained: Mapping[str, str] | None,
    say: Callable[[str], None],
    options: Mapping[str, tuple[str, ...]],
) -> tuple[dict[str, str], dict[str, str], dict[str, str] | None]:
    """The layers' groups, pins and trained formats (:func:`_trained`); refuses a run
    without calibration or evaluation batches."""
    if not calib or not evals:
        raise ValueError(
            f"quantize_model needs calibration and evaluation batches (got "
            f"{len(calib)} and {len(evals)})"
        )
    groups = group_layers(engine.paths, cfg.groups)
    pinned = _pins(engine.paths, cfg.pin)
    _check_budget(engine, cfg, groups, pinned, options)
    say(
        f"quantize: {len(engine.paths)} linear layers in {len(set(groups.values()))} groups, "
        f"{len(pinned)} pinned; {len(calib)} calibration and {len(evals)} eval batches"
    )
    return groups, pinned, _trained(trained, engine.paths, pinned)


def _check_budget(
    engine: Engine,
    cfg: QuantizeConfig,
    groups: Mapping[str, str],
    pinned: Mapping[str, str],
    options: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Refuse a budget below the cheapest allocation before any work: the cheapest
    allocation depends on the layers' sizes, candidates, groups and pins, not on scores
    (:func:`~microscale.ptq.search.check_budget` of the search's problem, scores zero)."""
    fmts = cfg.searched_embed_formats
    embed = None
    if fmts and engine.tables:  # the token embedding item, as _score_embedding makes it
        embed = {
            "numel": engine.table_numel,
            "candidates": list(fmts),
            "scores": dict.fromkeys(fmts, 0.0),
        }
    zero = {p: dict.fromkeys(cfg.formats, 0.0) for p in engine.paths}
    check_budget(_problem(engine, cfg, zero, groups, pinned, embed, options), cfg.budget)


def check_quantize_budget(
    model: Any, config: QuantizeConfig, candidates: Mapping[str, Sequence[str]] | None = None
) -> None:
    """Raise the ``ValueError`` :func:`quantize_model` raises for ``config.budget`` below
    the cheapest allocation of ``model``'s layers (with ``candidates`` as there), without
    calibration data (callers check it before loading any)."""
    engine = Engine(model)
    _check_budget(
        engine,
        config,
        group_layers(engine.paths, config.groups),
        _pins(engine.paths, config.pin),
        {p: tuple(f) for p, f in (candidates or {}).items()},
    )


def _pins(paths: Sequence[str], pin: Sequence[tuple[str, str]]) -> dict[str, str]:
    """{path: format} of the layers the first matching ``pin`` regex forces."""
    pinned = {}
    for p in paths:
        for pattern, fmt in pin:
            if re.fullmatch(pattern, p):
                pinned[p] = fmt
                break
    return pinned


def _trained(
    trained: Mapping[str, str] | None, paths: Sequence[str], pinned: Mapping[str, str]
) -> dict[str, str] | None:
    """The trained allocation with registry names, pinned layers keeping their pin."""
    if trained is None:
        return None
    missing = sorted(set(paths) - set(trained))
    if missing:
        raise ValueError(
            f"quantize_model: trained allocation has no format for "
            f"{len(missing)} layer(s), e.g. {missing[0]!r}; expected one "
            f"for every linear layer"
        )
    return {p: pinned.get(p, get_format(trained[p]).name) for p in paths}


def _amax_in_score(cfg: QuantizeConfig) -> bool:
    """Whether the score pass measures the layers' input amax (no calibrate phase): a
    weight-only round-to-nearest run scored in one pass per batch, where nothing needs
    the amax (or GPTQ's Hessians) before scoring."""
    return not cfg.activations and cfg.ptq.method != "gptq" and cfg.method in ONE_PASS


def _calibrate(
    engine: Engine, calib, cfg: QuantizeConfig, groups: Mapping[str, str], phases: Phases
) -> tuple[dict[str, float], dict[str, float] | None, _Weights]:
    """Phase 1: every layer's input amax (and GPTQ's input Hessians); returns the amax, the
    static input amax of W4A4 (None: weight-only or dynamic) and the weights' source.
    Skipped when the score pass measures the amax (:func:`_amax_in_score`): the amax is
    then returned empty, and the score phase fills it."""
    if _amax_in_score(cfg):
        return {}, None, _Weights(engine, groups, None)
    gptq = cfg.ptq.method == "gptq"
    with phases.phase("calibrate", total=len(calib) * (2 if gptq else 1)) as tick:
        act_amax = engine.input_amax(calib, progress=tick)
        static = act_amax if (cfg.activations and cfg.static_act_scales) else None
        hessians: Any = None
        if gptq and cfg.activations:  # W4A4: each format's Hessians from its inputs

            def hessians(fmt: str) -> dict[str, np.ndarray]:
                return engine.input_hessians(calib, act_format=fmt, act_amax=static)

            tick(len(calib))
        elif gptq:
            hessians = engine.input_hessians(calib, progress=tick)
    return act_amax, static, _Weights(engine, groups, hessians)


def _score_layers(
    engine: Engine,
    weights: _Weights,
    calib,
    cfg: QuantizeConfig,
    static: Mapping[str, float] | None,
    phases: Phases,
    say: Callable[[str], None],
    act_amax: dict[str, float],
) -> tuple[dict, dict, dict]:
    """Phase 2: every candidate of every layer quantized (packed QArrays, compactly), then
    scored, one capture pass per batch; returns (raw scores, corrected scores, weight
    statistics). ``act_amax``: filled by the score pass when the calibrate phase was
    skipped (:func:`_amax_in_score`)."""
    with phases.phase("quantize_weights", total=len(cfg.formats), unit="format") as tick:
        cand = {}
        for f in cfg.formats:
            cand[f] = weights.get(f, cfg.ptq)
            tick()
    stats = _weight_stats(engine, cand)
    with phases.phase("score", total=len(calib)) as tick:
        raw = score(
            engine,
            calib,
            cand,
            cfg.method,
            activations=cfg.activations,
            act_amax=static,
            progress=tick,
            input_amax=act_amax if _amax_in_score(cfg) else None,
        )
        scores = monotone(raw, cfg.formats) if cfg.use_monotone else raw
    say(
        f"quantize: {cfg.method} scores for {len(engine.paths)} layers x {len(cfg.formats)} "
        f"formats in {phases.timings['score_s']:.1f}s"
    )
    return raw, scores, stats


def _evaluate(
    ev: _Evaluator,
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
        label = "bf16" if not get_format(f).quantized else f"uniform_{f}"
        points[label] = ev.point(_uniform(paths, f, pinned), cfg.ptq, kind="uniform")
    if "bf16" not in points:
        points["bf16"] = ev.point(_uniform(paths, "bf16", {}), cfg.ptq, kind="uniform")
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
        "uniform_nvfp4": _uniform(paths, "nvfp4", pinned),
        "bf16": _uniform(paths, "bf16", {}),
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


def _score_embedding(
    engine: Engine, calib, cfg: QuantizeConfig, phases: Phases
) -> dict[str, Any] | None:
    """The token embedding / LM head item (:attr:`QuantizeResult.embedding`, its format
    chosen by the search) when ``cfg`` searches it and the model has the table; None
    otherwise (an explicit ``embed_formats`` on a model without one is refused)."""
    fmts = cfg.searched_embed_formats
    if not fmts:
        return None
    if not engine.tables:
        if cfg.embed_formats is None:
            return None  # count_other_params on a model without a token embedding
        raise ValueError(
            f"QuantizeConfig.embed_formats={list(fmts)}: the model has no token embedding "
            "table (embed.embedding) to search a format for"
        )
    n_q = sum(get_format(f).quantized for f in fmts)
    per_batch = n_q + (n_q > 0 and cfg.method != "kl")  # kl: its reference in the pass
    with phases.phase("score_embedding", total=len(calib) * per_batch) as tick:
        raw = table_scores(engine, calib, fmts, cfg.method, progress=tick)
    return {
        "format": None,
        "numel": engine.table_numel,
        "candidates": list(fmts),
        "scores": monotone({EMBED_ITEM: raw}, fmts)[EMBED_ITEM] if cfg.use_monotone else raw,
        "scores_raw": raw,
    }


def _problem(
    engine: Engine,
    cfg: QuantizeConfig,
    scores: Mapping[str, Mapping[str, float]],
    groups: Mapping[str, str],
    pinned: Mapping[str, str],
    embed: Mapping[str, Any] | None,
    options: Mapping[str, tuple[str, ...]] | None = None,
) -> Problem:
    """The search over the linear layers, the other parameters counted at 16 bits with
    ``count_other_params``, or the token embedding / LM head among them as one more item
    (:data:`EMBED_ITEM`, with its own candidates)."""
    extra = engine.other_numel if cfg.count_other_params else 0
    options = {p: f for p, f in (options or {}).items() if p in engine.numel}
    if embed is None:
        return Problem(
            formats=cfg.formats,
            scores=scores,
            numel=engine.numel,
            groups=groups,
            pinned=pinned,
            options=options,
            extra_numel=extra,
        )
    if EMBED_ITEM in engine.numel:  # pragma: no cover - no module path has "<"
        raise ValueError(f"a linear layer is named {EMBED_ITEM!r}, the embedding item's name")
    return Problem(
        formats=cfg.formats,
        scores={**scores, EMBED_ITEM: embed["scores"]},
        numel={**engine.numel, EMBED_ITEM: embed["numel"]},
        groups={**groups, EMBED_ITEM: EMBED_ITEM},
        pinned=pinned,
        options={**options, EMBED_ITEM: tuple(embed["candidates"])},
        extra_numel=extra - embed["numel"],
    )


def _linear(assignment: Mapping[str, str]) -> dict[str, str]:
    """``assignment`` without the embedding item: the linear layers' formats."""
    return {p: f for p, f in assignment.items() if p != EMBED_ITEM}


def _weight_stats(
    engine: Engine, cand: Mapping[str, Mapping[str, QuantizedWeight]]
) -> dict[str, dict[str, Any]]:
    out = {}
    for p in engine.paths:
        k = np.asarray(engine.kernels[p], np.float32)
        row: dict[str, Any] = {
            "amax": float(np.max(np.abs(k))),
            "rms": float(np.sqrt(np.mean(k * k))),
            "shape": list(k.shape),
        }
        for f, qw in cand.items():
            w = qw[p]
            row[f] = {
                "rel_mse": w.rel_mse,
                "rel_mse_rtn": w.rel_mse_rtn,
                "scale_multiplier": w.scale_multiplier,
                "four_fraction": w.four_fraction,
            }
        out[p] = row
    return out


class _Evaluator:
    """Validation loss of allocations (cached by allocation and PTQ options)."""

    def __init__(
        self,
        engine: Engine,
        weights: _Weights,
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
                    if get_format(f).quantized
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
            linear = _linear(assignment)
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
        full, linear = self._full(assignment), _linear(assignment)
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
        """``assignment`` with the embedding item's format (bf16 unless it names one)
        when the search has the item."""
        if not self.embed or EMBED_ITEM in assignment:
            return dict(assignment)
        return {**assignment, EMBED_ITEM: "bf16"}


def _ptq_effects(
    ev: _Evaluator, cfg: QuantizeConfig, paths, pinned, alloc: Allocation, act_amax
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
        spec = get_format(f)
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
        rows[f"uniform_{f}"] = (_uniform(paths, f, pinned), names)
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
        spec = get_format(f)
        if not spec.has_tensor_scale:
            continue
        assign = _uniform(paths, f, pinned)
        out["activations"][f"uniform_{f}"] = {
            "weight_only": float(math.exp(ev.loss(assign, cfg.ptq, activations=False))),
            "dynamic": float(math.exp(ev.loss(assign, cfg.ptq, activations=True))),
            "static": float(math.exp(ev.loss(assign, cfg.ptq, activations=True, amax=act_amax))),
        }
    return out

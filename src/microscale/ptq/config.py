"""The options of one adaptive-PTQ run: :class:`QuantizeConfig`, its checks and presets.

Every key ``microscale quantize`` takes beside the run options is a field here, checked on
construction (one ``ValueError`` naming the key). :meth:`QuantizeConfig.for_gguf` is the
GGUF layout's preset, read from that row of :mod:`microscale.export.registry`
(``quantize_preset``, as ``microscale quantize layout=gguf`` reads it); the token
embedding's default candidates are the formats some layout stores it in
(:func:`~microscale.export.registry.stored_embed_formats`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from microscale.export.registry import GGUF_FP4_PRESET, get_layout, stored_embed_formats
from microscale.formats import get_format, get_weight_format, weight_only
from microscale.ptq.awq import DEFAULT_ALPHAS
from microscale.ptq.search import DEFAULT_GROUPS
from microscale.ptq.sensitivity import METHODS, SIGNED_METHODS
from microscale.ptq.weights import WeightPTQ

__all__ = ["DEFAULT_FORMATS", "QuantizeConfig"]

DEFAULT_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "bf16")
DEFAULT_PIN = ((r"(.*\.)?lm_head", "bf16"), (r"(.*\.)?embed(_tokens|ding)?", "bf16"))
DEFAULT_PARETO = (4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5)


def _check_format_list(name: str, fmts) -> tuple[str, ...]:
    if isinstance(fmts, str):
        fmts = tuple(f.strip() for f in fmts.split(",") if f.strip())
    fmts = tuple(fmts)
    if not fmts:
        raise ValueError(f"QuantizeConfig.{name} is empty: expected at least one format")
    for f in fmts:
        try:
            get_weight_format(f)
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
    # scores are measured with the table stored so by a layout (microscale.export.registry.
    # stored_embed_formats(): bf16 and GGUF's formats without a global scale). Searched only
    # with count_other_params. None: all of those, except with method "gradient" (its
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
        if not any(get_weight_format(f).quantized for f in self.formats):
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
        self._check_ggml()

    def weight_only_formats(self) -> tuple[str, ...]:
        """The formats of the run (candidates, uniform points, heuristic, pins) that are ggml
        block types (:func:`microscale.formats.weight_only`), in first-seen order."""
        fmts = (*self.formats, *self.uniform_formats, *self.heuristic, *(f for _, f in self.pin))
        return tuple(dict.fromkeys(f for f in fmts if weight_only(get_weight_format(f))))

    def _check_ggml(self) -> None:
        ggml = self.weight_only_formats()
        if not ggml:
            return
        if self.activations:
            raise ValueError(
                f"QuantizeConfig.activations=true: {', '.join(ggml)} quantize weights only "
                "(llama.cpp quantizes a GEMM's input itself); use activations=false, or "
                "formats without ggml's block types"
            )

    def _check_awq(self) -> None:
        alphas = tuple(float(a) for a in self.awq_alphas)
        if not alphas or any(not (0.0 <= a <= 1.0) for a in alphas):
            raise ValueError(
                f"QuantizeConfig.awq_alphas={self.awq_alphas!r}: expected values in [0, 1]"
            )
        object.__setattr__(self, "awq_alphas", alphas)
        (fmt,) = _check_format_list("awq_format", (self.awq_format,))
        if weight_only(get_weight_format(fmt)) or not get_format(fmt).quantized:
            raise ValueError(
                f"QuantizeConfig.awq_format={fmt!r}: expected a quantized format (e.g. nvfp4)"
            )

    def _check_embed_formats(self) -> None:
        fmts = _check_format_list("embed_formats", self.embed_formats)
        object.__setattr__(self, "embed_formats", fmts)
        stored = stored_embed_formats()
        bad = [f for f in fmts if f not in stored]
        if bad:
            raise ValueError(
                f"QuantizeConfig.embed_formats: {bad} cannot store the token embedding "
                f"(a GGUF stores it as one of {list(stored)})"
            )
        if not self.count_other_params:
            raise ValueError(
                "QuantizeConfig.embed_formats has no effect without count_other_params=true "
                "(only a budget that counts the whole model searches the embedding)"
            )
        if self.method == "gradient" and any(get_weight_format(f).quantized for f in fmts):
            raise ValueError(
                "QuantizeConfig.embed_formats: method 'gradient' cannot score the token "
                "embedding (its Fisher units have no measured counterpart); use taylor, "
                "loss or kl, or embed_formats=bf16"
            )

    @classmethod
    def for_gguf(cls, *, fp4: bool = False, **overrides: Any) -> QuantizeConfig:
        """The GGUF layout's preset (its row's ``quantize_preset``): ggml's own block types
        (q3_k, q4_0, q4_k, q5_0, q5_k, q6_k, q8_0 and bf16 at 3.44, 4.5, 4.5, 5.5, 5.5,
        6.56, 8.5 and 16 bits per weight), the heuristic as llama.cpp's Q4_K_M (q6_k first
        and last blocks and down projections, q4_k elsewhere), and the budget counting the
        whole file (``count_other_params``: the token embedding at its searched format);
        then ``overrides``. ``fp4``: the FP4 search instead, for runtimes with fast NVFP4 /
        MXFP4 kernels (``GGUF_FP4_PRESET``: nvfp4, mxfp4, q8_0 and bf16, the heuristic's
        8-bit layers in q8_0, the budget over the linear layers)."""
        fp4_keys = GGUF_FP4_PRESET if fp4 else {}
        return cls(**{**get_layout("gguf").quantize_preset, **fp4_keys, **overrides})

    @property
    def searched_embed_formats(self) -> tuple[str, ...]:
        """The token embedding's candidates in the search (``embed_formats``, or its
        default); () when it is not an item (counted at 16 bits, or not at all)."""
        if not self.count_other_params:
            return ()
        if self.embed_formats is not None:
            return self.embed_formats
        return () if self.method == "gradient" else stored_embed_formats()

    @property
    def use_monotone(self) -> bool:
        """Whether the monotone correction applies (``monotone``, or its method default)."""
        if self.monotone is None:
            return self.method not in SIGNED_METHODS
        return bool(self.monotone)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

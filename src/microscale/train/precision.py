"""``precision:``: which linear layers of a run train in which recipe, in one sub-config.

A run's ``recipe`` names the low-precision recipe; ``precision`` says where it applies. It
holds one **kind** (:data:`PRECISION_KINDS`, one registry row each) and the kind's
settings, the optional all-bf16 **warm-up** and the **late switch**:

============ =========================================================================
kind         the main phase's per-layer rules
============ =========================================================================
position     ``recipe`` everywhere but the first ``bf16_first`` and last ``bf16_last``
             blocks (default: the last 15%, at least 1; ``PrecisionRules.for_recipe``)
layout       the same for a named (first, last) layout (``BF16_LAYOUTS``: paper_12b)
rules        a ``PrecisionRules`` JSON (e.g. a ``microscale quantize`` output, for QAT),
             trained as ``rules_bf16`` says
sensitivity  after a bf16 warm-up, measured per-layer sensitivity picks the bf16 layers
             under the FLOP budget of the positional rule (``train/adaptive.py``)
============ =========================================================================

One vocabulary: every mode names **what runs in bf16** (``Recipe.derive``'s parts):
``late.bf16`` is ``"all"`` or ``"forward"``; ``rules_bf16`` is ``"backward"`` (QAT: the
forward pass quantized, straight-through gradients), ``"nothing"`` (the format's full
training recipe) or ``"as_written"``.

A new kind is one :class:`PrecisionKind` row in :data:`PRECISION_KINDS` (its fields, its
rules, its flags) plus its tests; the checks that a kind's fields are the only ones set are
generic. The keys before this sub-config (``bf16_first``, ``bf16_last``, ``bf16_layout``,
``rules``, ``rules_mode``, ``bf16_policy``, ``adaptive.*``, ``late_switch.*``) are gone:
each is refused with one line naming what replaces it (:data:`REMOVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from microscale.model import BF16_LAYOUTS, PrecisionRules, rules_for_training
from microscale.ptq.sensitivity import METHODS

__all__ = [
    "PRECISION_KINDS",
    "REMOVED_KEYS",
    "LateSwitchConfig",
    "PrecisionConfig",
    "PrecisionKind",
    "SensitivityConfig",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LateSwitchConfig:
    """Train the last tokens in high precision (NVFP4 paper, Appendix D)."""

    # Fraction of the final training tokens in the late phase (0 = never switch; paper:
    # ~0.18).
    fraction: float = 0.0
    # What runs in bf16 in the late phase: "all" (forward and backward GEMMs) or "forward"
    # (the forward GEMM; dgrad/wgrad keep the recipe).
    bf16: Literal["all", "forward"] = "all"

    def __post_init__(self):
        if not 0 <= self.fraction < 1:
            raise ValueError(f"precision.late.fraction={self.fraction}: expected in [0, 1)")
        if self.bf16 not in ("all", "forward"):
            raise ValueError(f"precision.late.bf16={self.bf16!r}: expected 'all' or 'forward'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SensitivityConfig:
    """``precision.kind=sensitivity``: how the bf16 layers are chosen (``train/adaptive.py``)."""

    # Largest fraction of the linear-layer FLOPs (= weight elements) kept in bf16; None =
    # the fraction the positional rule keeps (precision.bf16_first + bf16_last blocks).
    bf16_flops: float | None = None
    # Sensitivity score (microscale.ptq: "taylor", "gradient", "kl", "loss").
    method: str = "taylor"
    # Training-split tokens the scores are measured on (rounded up to whole batches).
    calib_tokens: int = 16384
    # Score with each layer's input quantized too (as the recipe's forward pass does).
    activations: bool = True
    # "layer": q/k/v and gate/up share a precision, other layers choose alone; "block":
    # whole transformer blocks stay bf16 or not.
    granularity: Literal["layer", "block"] = "layer"

    def __post_init__(self):
        if self.bf16_flops is not None and not 0 <= self.bf16_flops < 1:
            raise ValueError(
                f"precision.sensitivity.bf16_flops={self.bf16_flops}: expected "
                "None or a fraction in [0, 1)"
            )
        if self.method not in METHODS:
            raise ValueError(
                f"precision.sensitivity.method={self.method!r}: expected one of {METHODS}"
            )
        if self.calib_tokens < 1:
            raise ValueError(
                f"precision.sensitivity.calib_tokens={self.calib_tokens}: expected an int >= 1"
            )
        if self.granularity not in ("layer", "block"):
            raise ValueError(
                f"precision.sensitivity.granularity={self.granularity!r}: "
                "expected 'layer' or 'block'"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionKind:
    """One row of :data:`PRECISION_KINDS`: a way to make the main phase's per-layer rules."""

    # What precision.kind says.
    name: str
    # One line for errors and docs.
    description: str
    # The PrecisionConfig fields the kind reads; every other one (but kind and late) must
    # stay at its default.
    fields: tuple[str, ...]
    # (precision, recipe, n_layers) -> the main phase's rules (for a kind chosen during
    # the run: the positional rules it starts from and takes its budget from).
    main_rules: Callable[[PrecisionConfig, str, int], PrecisionRules]
    # Extra checks of the kind's fields (raise ValueError naming the key), or None.
    check: Callable[[PrecisionConfig], None] | None = None
    # The warm-up fraction when precision.warmup is None.
    default_warmup: float = 0.0
    # Whether the kind needs a quantized recipe.
    needs_quantized: bool = False
    # Whether the rules are chosen during the run, after the warm-up (train/adaptive.py).
    chosen_in_run: bool = False
    # Whether main_rules reads a file (checked when the run starts, not with the config).
    reads_file: bool = False
    # Whether the run trains an allocation of its own (rules of its own, recorded in
    # OUT/precision_rules.json: what export writes and quantize scores as "trained").
    own_allocation: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Where the recipe applies: one kind (:data:`PRECISION_KINDS`), the warm-up, the late
    switch."""

    # How the main phase's per-layer rules are made: "position", "layout", "rules" or
    # "sensitivity" (see microscale/train/precision.py).
    kind: str = "position"
    # position, sensitivity: leading transformer blocks kept in bf16.
    bf16_first: int = 0
    # position, sensitivity: trailing blocks kept in bf16; None = the recipe default (15%
    # of blocks, >= 1, for a quantized recipe; 0 for bf16).
    bf16_last: int | None = None
    # layout: a named (bf16_first, bf16_last) layout: "paper_12b" = first 2 + last 8
    # blocks in bf16 (arXiv 2509.25149).
    layout: str | None = None
    # rules: path of a PrecisionRules JSON (e.g. a `microscale quantize` output's
    # precision_rules.json, for QAT); the recipe then names no layer's recipe.
    rules: str | None = None
    # rules: what of each rule's quantized recipe runs in bf16: "backward" (QAT: the
    # forward pass quantized, straight-through gradients), "nothing" (each layer in the full
    # training recipe of its weight format: nvfp4, mxfp4, mxfp8, fp8_e4m3) or "as_written".
    rules_bf16: Literal["backward", "nothing", "as_written"] = "backward"
    # Fraction of the steps trained all in bf16 before the kind's rules apply (position,
    # layout: the control that separates a warm-up's effect from sensitivity's choice);
    # None = the kind's default (sensitivity 0.1, the others 0).
    warmup: float | None = None
    # sensitivity: the measurement and the budget.
    sensitivity: SensitivityConfig = SensitivityConfig()
    # The late switch to high precision for the final tokens (any kind).
    late: LateSwitchConfig = LateSwitchConfig()

    def __post_init__(self):
        if self.kind not in PRECISION_KINDS:
            raise ValueError(
                f"precision.kind={self.kind!r}: expected one of {list(PRECISION_KINDS)}"
            )
        spec = self.spec
        for f in dataclasses.fields(self):
            if f.name in ("kind", "late") or f.name in spec.fields:
                continue
            value, default = getattr(self, f.name), _default(f)
            if value != default:
                raise ValueError(
                    f"precision.{f.name}={_show(value)} is not read by "
                    f"precision.kind={self.kind!r} (it reads: "
                    f"{', '.join(spec.fields) or 'no other key'}); leave it at "
                    f"{_show(default)}"
                )
        if self.warmup is not None and not 0 <= self.warmup < 1:
            raise ValueError(
                f"precision.warmup={self.warmup}: expected None or a fraction in [0, 1)"
            )
        if spec.check is not None:
            spec.check(self)

    @property
    def spec(self) -> PrecisionKind:
        """This config's row of :data:`PRECISION_KINDS`."""
        return PRECISION_KINDS[self.kind]

    @property
    def warmup_fraction(self) -> float:
        """The all-bf16 warm-up's fraction of the steps (``warmup``, else the kind's)."""
        return self.spec.default_warmup if self.warmup is None else self.warmup

    def main_rules(self, recipe: str, n_layers: int) -> PrecisionRules:
        """The per-layer rules of the main phase for ``recipe`` on ``n_layers`` blocks."""
        return self.spec.main_rules(self, recipe, n_layers)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _show(v: Any) -> str:
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


# ----------------------------------------------------------------------------- the kinds


def _position_rules(p: PrecisionConfig, recipe: str, n_layers: int) -> PrecisionRules:
    return PrecisionRules.for_recipe(
        recipe, n_layers, bf16_first=p.bf16_first, bf16_last=p.bf16_last
    )


def _check_position(p: PrecisionConfig) -> None:
    if p.bf16_first < 0:
        raise ValueError(f"precision.bf16_first={p.bf16_first}: expected an int >= 0")
    if p.bf16_last is not None and p.bf16_last < 0:
        raise ValueError(f"precision.bf16_last={p.bf16_last}: expected None or an int >= 0")


def _layout_rules(p: PrecisionConfig, recipe: str, n_layers: int) -> PrecisionRules:
    assert p.layout is not None  # _check_layout ran first
    first, last = BF16_LAYOUTS[p.layout]
    return PrecisionRules.for_recipe(recipe, n_layers, bf16_first=first, bf16_last=last)


def _check_layout(p: PrecisionConfig) -> None:
    if p.layout not in BF16_LAYOUTS:
        raise ValueError(
            f"precision.layout={p.layout!r}: precision.kind='layout' needs one "
            f"of {sorted(BF16_LAYOUTS)}"
        )


def _rules_rules(p: PrecisionConfig, recipe: str, n_layers: int) -> PrecisionRules:
    assert p.rules is not None  # the rules kind requires precision.rules
    try:
        rules = PrecisionRules.load(p.rules)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"precision.rules={p.rules!r}: {e}") from None
    return rules_for_training(rules, p.rules_bf16)


def _check_rules(p: PrecisionConfig) -> None:
    if not p.rules:
        raise ValueError(
            "precision.kind='rules' needs precision.rules=PATH (a "
            "PrecisionRules JSON, e.g. a quantize output's precision_rules.json)"
        )
    if p.rules_bf16 not in ("backward", "nothing", "as_written"):
        raise ValueError(
            f"precision.rules_bf16={p.rules_bf16!r}: expected 'backward', 'nothing' or 'as_written'"
        )


def _check_sensitivity(p: PrecisionConfig) -> None:
    _check_position(p)
    if p.warmup_fraction <= 0:
        raise ValueError(
            f"precision.warmup={p.warmup}: precision.kind='sensitivity' "
            "measures after a bf16 warm-up; expected a fraction in (0, 1)"
        )


# One row a kind: what precision.kind accepts (docs/training.md, "Precision").
PRECISION_KINDS: dict[str, PrecisionKind] = {
    k.name: k
    for k in (
        PrecisionKind(
            name="position",
            description="the first bf16_first and last bf16_last blocks in bf16",
            fields=("bf16_first", "bf16_last", "warmup"),
            main_rules=_position_rules,
            check=_check_position,
        ),
        PrecisionKind(
            name="layout",
            description="a named (first, last) layout of bf16 blocks",
            fields=("layout", "warmup"),
            main_rules=_layout_rules,
            check=_check_layout,
        ),
        PrecisionKind(
            name="rules",
            description="a PrecisionRules JSON, e.g. for QAT",
            fields=("rules", "rules_bf16"),
            main_rules=_rules_rules,
            check=_check_rules,
            reads_file=True,
            own_allocation=True,
        ),
        PrecisionKind(
            name="sensitivity",
            description="measured sensitivity picks the bf16 layers after a bf16 warm-up",
            fields=("bf16_first", "bf16_last", "warmup", "sensitivity"),
            main_rules=_position_rules,
            check=_check_sensitivity,
            default_warmup=0.1,
            needs_quantized=True,
            chosen_in_run=True,
            own_allocation=True,
        ),
    )
}


# ----------------------------------------------------------------------------- removed keys

# The keys before this sub-config (removed; docs/release-notes.md) -> what replaces each, as
# the one-line error for an old key says (a dotted group: any key under it).
REMOVED_KEYS = {
    "bf16_first": "precision.bf16_first",
    "bf16_last": "precision.bf16_last",
    "bf16_layout": "precision.kind=layout precision.layout=NAME",
    "rules": "precision.kind=rules precision.rules=PATH",
    "rules_mode": "precision.rules_bf16 (forward->backward, full->nothing, as_written)",
    "bf16_policy": "precision.kind=sensitivity (position_warmup: precision.warmup=0.1)",
    "adaptive.warmup_fraction": "precision.warmup",
    "adaptive": "precision.sensitivity.* (adaptive.warmup_fraction: precision.warmup)",
    "late_switch.mode": "precision.late.bf16 (full->all, fwd_only->forward)",
    "late_switch": "precision.late.* (late_switch.mode: precision.late.bf16)",
}

"""What a quantize output's ``report.json`` stores: :class:`QuantizeReport`, one typed
record with a version, written and read back by
:class:`~microscale.outputs.folders.QuantizeOutput` (``write_report`` / ``read_report``).

The fields are the report's keys in the order they are written. The optional ones at the
end are left out of the file when ``None`` (a report without a searched embedding, AWQ,
written model or numerics fingerprint is what it was before they existed). Version 1 is
the report as it was before the record had a version: it is written without a
``"version"`` key (so its bytes are unchanged), and a report without one reads as
version 1; a later version writes its number, and a reader refuses a version newer than
:data:`REPORT_VERSION`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["REPORT_VERSION", "QuantizeReport"]

REPORT_VERSION = 1
# Left out of the file when None (each with the key it goes with).
_OPTIONAL = {"embedding": ("embedding", "embed_format"), "awq": ("awq",)}
_OPTIONAL_ALONE = ("checkpoint", "numerics")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeReport:
    """``report.json`` (docs/quantize.md names each key)."""

    # The bit budget (bits per weight) the search met.
    budget: float | None = None
    # Bits per weight of the searched allocation, in the budget's measure.
    effective_bits: float | None = None
    # ... over the linear layers only, and over the whole model.
    linear_bits: float | None = None
    model_bits: float | None = None
    # {allocation: validation perplexity} (bf16, uniform_<fmt>, heuristic, searched, ...).
    val_ppl: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # {linear path: format} of the searched allocation.
    layers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The score method, candidate formats, and whether layer inputs are quantized.
    method: str | None = None
    formats: list[str] = dataclasses.field(default_factory=list)
    activations: bool | None = None
    static_act_scales: bool | None = None
    # The PTQ options (GPTQ, clipping, ...), as QuantizeConfig.ptq.
    ptq: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    # The search: solver, its time, the allocation's total score and format counts.
    solver: str | None = None
    solve_time_s: float | None = None
    total_score: float | None = None
    counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # {label: point} of the searched, uniform and heuristic allocations; the same as a list.
    points: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pareto: list[Any] = dataclasses.field(default_factory=list)
    ptq_effects: Any = None
    comparisons: Any = None
    monotone: bool | None = None
    # {linear path: group}, pinned layers, {linear path: parameter count}.
    groups: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pinned: Any = None
    numel: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # {linear path: {format: score}} (scaled and raw), input amax, weight statistics.
    scores: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scores_raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    act_amax: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    weight_stats: Any = None
    # The calibration data: source run folder and step, corpus, split, tokens, batches.
    calibration: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    peak_rss_gb: Mapping[str, float] | None = None
    # The whole QuantizeConfig.
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The token embedding's search record and chosen format (None: not searched).
    embedding: Any = None
    embed_format: str | None = None
    # AWQ's record (None: no AWQ).
    awq: Any = None
    # The model written (path, layout, ...) and the numerics fingerprint, set by the writer.
    checkpoint: Mapping[str, Any] | None = None
    numerics: Any = None
    # The record's version (module doc).
    version: int = REPORT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The report as ``report.json`` stores it (module doc: keys, order, omissions)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, keys in _OPTIONAL.items():
            if out[key] is None:
                for k in keys:
                    del out[k]
        for key in _OPTIONAL_ALONE:
            if out[key] is None:
                del out[key]
        if self.version == 1:
            del out["version"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "report.json") -> QuantizeReport:
        """The record from a report's JSON object; keys it does not know are ignored and
        absent ones take their defaults (an older report). Raises ``ValueError`` for
        something that is no report object, or a version newer than this code reads."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        version = data.get("version", 1)
        if not isinstance(version, int) or not 1 <= version <= REPORT_VERSION:
            raise ValueError(
                f"{where}: report version {version!r}; this microscale reads versions 1 to "
                f"{REPORT_VERSION} (a newer microscale wrote it?)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

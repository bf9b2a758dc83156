"""Statistics of a comparison: paired per-seed gaps, Student-t intervals, eval noise, verdicts.

Why paired. Runs that share a seed share the initialisation and the data order, so the
run-to-run noise that moves bf16's loss moves nvfp4's loss the same way; the *difference*
within a seed is far less noisy than either loss. For a run ``x`` and a reference ``r`` the
per-seed relative gap (in percent) is ``g_s = 100 (L_x,s - L_r,s) / L_r,s``, and the seeds'
gaps are independent replicates of one quantity.

Interval over seeds. With ``n`` gaps of mean ``m`` and sample standard deviation ``sd``, the
95% confidence interval of the true gap is ``m +- t(0.975, n - 1) sd / sqrt(n)`` (Student t:
``n`` is small, and the population sd is unknown). One seed gives no interval.

Eval noise. The final loss is a mean over ``B`` fixed validation batches; the gap within a
seed has its own sampling error from the choice of those batches. With per-batch paired
differences ``d_b = l_x,b - l_r,b`` its standard error is ``sd(d) / sqrt(B)`` (loss units),
``100 sd(d) / (sqrt(B) L_r)`` in points of relative gap. The mean over seeds has eval SE
``sqrt(sum_s se_s^2) / n``. The t interval over seeds already contains this noise (each
seed's gap carries it); the eval SE says how much of the interval it is.

Verdict. Words follow the interval (docs/design.md#statistics): the run is "worse" when the whole
interval is above 0, "better" when below, else "no difference detected" and the interval's
ends are the largest gaps still compatible with the data.

Trend. Gap against model size is fitted as ``g = a + b log10(params)`` by ordinary least
squares over every (size, seed) point; the slope's interval uses t with ``N - 2`` degrees of
freedom, and a prediction at another size gets the interval of the fitted mean there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from scipy import stats as _st

__all__ = [
    "eval_se",
    "loglinear_fit",
    "mean_ci",
    "paired_gaps",
    "seeds_needed",
    "t_quantile",
    "verdict",
]


def t_quantile(df: int, level: float = 0.95) -> float:
    """Two-sided Student-t critical value: ``t(1 - (1 - level) / 2, df)``."""
    if df < 1:
        raise ValueError(f"df={df}: expected >= 1 degree of freedom")
    if not 0 < level < 1:
        raise ValueError(f"level={level}: expected a confidence level in (0, 1)")
    return float(_st.t.ppf(1 - (1 - level) / 2, df))


def _finite(vals: Sequence[float | None]) -> list[float]:
    return [float(v) for v in vals if v is not None and math.isfinite(v)]


def mean_ci(values: Sequence[float | None], level: float = 0.95) -> dict[str, Any]:
    """Mean, sample sd, ``level`` Student-t interval and half-width of the finite values.

    Returns ``{"mean", "sd", "n", "ci95": [lo, hi] | None, "half_width": float | None}``
    (``ci95`` is None with fewer than two values; ``mean`` is None with none).
    """
    v = _finite(values)
    n = len(v)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "ci95": None, "half_width": None}
    m = sum(v) / n
    if n == 1:
        return {"mean": m, "sd": None, "n": 1, "ci95": None, "half_width": None}
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    h = t_quantile(n - 1, level) * sd / math.sqrt(n)
    return {"mean": m, "sd": sd, "n": n, "ci95": [m - h, m + h], "half_width": h}


def paired_gaps(x: Mapping[Any, float | None], ref: Mapping[Any, float | None]) -> dict[Any, float]:
    """Per-seed relative gap in percent, ``100 (x_s - ref_s) / ref_s``, for the seeds both
    have with finite values (a diverged run has no gap)."""
    out = {}
    for s, v in x.items():
        r = ref.get(s)
        if v is None or r is None or not (math.isfinite(v) and math.isfinite(r)) or r == 0:
            continue
        out[s] = 100.0 * (v - r) / r
    return out


def eval_se(x_batches: Sequence[float], ref_batches: Sequence[float]) -> float | None:
    """Standard error, in points of relative gap, of one seed's gap from its ``B`` paired
    validation batches: ``100 sd(x_b - r_b) / (sqrt(B) mean(r_b))``. None for ``B < 2``."""
    if len(x_batches) != len(ref_batches):
        raise ValueError(
            f"paired eval needs the same batches: got {len(x_batches)} and "
            f"{len(ref_batches)} batch losses"
        )
    b = len(x_batches)
    if b < 2:
        return None
    d = [a - r for a, r in zip(x_batches, ref_batches, strict=True)]
    md = sum(d) / b
    sd = math.sqrt(sum((v - md) ** 2 for v in d) / (b - 1))
    ref_mean = sum(ref_batches) / b
    return 100.0 * sd / math.sqrt(b) / ref_mean


def combined_eval_se(per_seed: Sequence[float | None]) -> float | None:
    """Eval SE of the mean gap over seeds: ``sqrt(sum se_s^2) / n`` (None if any is)."""
    known = [v for v in per_seed if v is not None]
    if not per_seed or len(known) < len(per_seed):
        return None
    return math.sqrt(sum(v * v for v in known)) / len(known)


def seeds_needed(
    sd: float | None, half_width: float = 0.5, level: float = 0.95, max_n: int = 1000
) -> int | None:
    """Smallest ``n >= 2`` with ``t(n - 1) sd / sqrt(n) <= half_width`` (None: unknown sd
    or more than ``max_n``)."""
    if sd is None or not math.isfinite(sd):
        return None
    for n in range(2, max_n + 1):
        if t_quantile(n - 1, level) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def verdict(run: str, ref: str, ci: Mapping[str, Any]) -> str:
    """The reading of one comparison, from :func:`mean_ci` of its per-seed gaps (%)."""
    m, n, iv = ci.get("mean"), ci.get("n", 0), ci.get("ci95")
    if m is None:
        return f"`{run}` vs `{ref}`: no finished pair of runs, no gap."
    if iv is None:
        return (
            f"`{run}` vs `{ref}`: {m:+.2f}% with one seed -- not a verdict "
            "(no interval; run two or more seeds)."
        )
    lo, hi = iv
    tail = f"95% CI {lo:+.2f}% to {hi:+.2f}%, n = {n} seeds"
    if lo > 0:
        return f"`{run}` is worse than `{ref}` by {m:.2f}% ({tail})."
    if hi < 0:
        return f"`{run}` is better than `{ref}` by {-m:.2f}% ({tail})."
    return (
        f"`{run}` vs `{ref}`: no difference detected; a gap larger than "
        f"{max(hi, 0):.2f}% (worse) or {max(-lo, 0):.2f}% (better) is excluded ({tail})."
    )


def loglinear_fit(
    sizes: Sequence[float], gaps: Sequence[float], level: float = 0.95
) -> dict[str, Any]:
    """OLS fit ``gap = a + b log10(size)`` over all points, with the slope's interval.

    Returns ``{"intercept", "slope", "slope_ci95", "n_points", "residual_sd", "x_mean",
    "sxx"}``; :func:`predict` evaluates it with an interval. Needs >= 3 points at >= 2
    distinct sizes.
    """
    if len(sizes) != len(gaps):
        raise ValueError(f"{len(sizes)} sizes but {len(gaps)} gaps")
    pts = [
        (math.log10(s), g)
        for s, g in zip(sizes, gaps, strict=True)
        if s and s > 0 and g is not None and math.isfinite(g)
    ]
    xs = {x for x, _ in pts}
    if len(pts) < 3 or len(xs) < 2:
        raise ValueError(
            f"a log-linear fit needs >= 3 points at >= 2 sizes; got {len(pts)} "
            f"points at {len(xs)} sizes"
        )
    n = len(pts)
    xm = sum(x for x, _ in pts) / n
    ym = sum(y for _, y in pts) / n
    sxx = sum((x - xm) ** 2 for x, _ in pts)
    b = sum((x - xm) * (y - ym) for x, y in pts) / sxx
    a = ym - b * xm
    rss = sum((y - a - b * x) ** 2 for x, y in pts)
    s = math.sqrt(rss / (n - 2))
    h = t_quantile(n - 2, level) * s / math.sqrt(sxx)
    return {
        "intercept": a,
        "slope": b,
        "slope_ci95": [b - h, b + h],
        "n_points": n,
        "residual_sd": s,
        "x_mean": xm,
        "sxx": sxx,
        "level": level,
    }


def predict(fit: Mapping[str, Any], size: float) -> dict[str, Any]:
    """The fitted mean gap at ``size`` parameters and its confidence interval."""
    x = math.log10(size)
    y = fit["intercept"] + fit["slope"] * x
    se = fit["residual_sd"] * math.sqrt(1 / fit["n_points"] + (x - fit["x_mean"]) ** 2 / fit["sxx"])
    h = t_quantile(fit["n_points"] - 2, fit["level"]) * se
    return {"size": size, "gap": y, "ci95": [y - h, y + h]}

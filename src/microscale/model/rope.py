"""RoPE frequencies: the default rotary embedding and the context extensions of Llama 3.x.

Notation: ``d`` = head_dim, ``θ`` = rope_theta, ``i = 0 … d/2 − 1`` numbers the rotated pairs
(dimension ``i`` with ``i + d/2``, `microscale.model.layers.apply_rope`), ``p`` a position,
``s`` = ``factor``, ``L`` = ``original_max_position_embeddings`` (the pretraining context).
Pair ``i`` is rotated by the angle ``p · ω'_i``, and the default RoPE has::

    ω_i = θ^(−2i/d)              (its inverse frequency)
    λ_i = 2π / ω_i               (its wavelength: positions per full turn)

The kinds (`ROPE_KINDS`) are those transformers' ``modeling_rope_utils.py`` defines for
Llama (its ``ROPE_INIT_FUNCTIONS``), derived here from the formulas there; the fields of
`RopeScaling` carry the names of its ``config.json`` keys.

**Static kinds interpolate some pairs.** Dividing a frequency by ``s`` reads position ``p``
as ``p / s``: a model trained on ``L`` positions then sees ``s · L`` positions as ``L``.
Each static kind keeps a share ``k_i`` in ``[0, 1]`` of each pair's frequency and
interpolates the rest::

    ω'_i = (ω_i / s) · (1 − k_i) + ω_i · k_i

* ``default``: ``k_i = 1`` (the table is the default RoPE's, bit for bit).
* ``linear`` (position interpolation): ``k_i = 0``, so ``ω'_i = ω_i / s``.
* ``llama3``: long wavelengths (``λ_i > L / low_freq_factor``) are interpolated, short ones
  (``λ_i < L / high_freq_factor``) keep their frequency, and between them the share kept
  is linear in the number of turns a pair makes over the pretraining context, ``L / λ_i``::

      k_i = clamp((L / λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor), 0, 1)

  llama.cpp stores the per-pair divisor ``ω_i / ω'_i = 1 / ((1 − k_i) / s + k_i)`` as the
  GGUF tensor ``rope_freqs.weight`` (`frequency_divisors`).
* ``yarn`` (YaRN's "NTK-by-parts"): the same blend with a ramp over the pair index. Pair
  ``c`` makes ``L / λ_c = L θ^(−2c/d) / (2π)`` turns over ``L``; setting that to ``β`` and
  solving for ``c`` gives the pair at which ``β`` turns are made::

      c(β) = d · ln(L / (2π β)) / (2 ln θ)

  With ``lo = c(beta_fast)``, ``hi = c(beta_slow)`` (``lo`` floored and ``hi`` ceiled when
  ``truncate``; then ``lo ≥ 0``, ``hi ≤ d − 1``, and ``hi += 0.001`` where they meet)::

      k_i = 1 − clamp((i − lo) / (hi − lo), 0, 1)

  so pairs turning more than ``beta_fast`` times keep their frequency and those turning
  fewer than ``beta_slow`` times are interpolated. YaRN also sharpens attention: cos and
  sin are both multiplied by ``m`` (the attention logits ``q · k`` by ``m²``), with
  ``m = attention_factor`` when given, else ``μ(s, mscale) / μ(s, mscale_all_dim)`` when
  both are given, else ``μ(s, 1)``, where ``μ(s, k) = 1 + 0.1 k ln s`` (1 for ``s ≤ 1``).

**Dynamic NTK** (``dynamic``) changes the base instead, by the length ``n`` of the call
(its largest position + 1): NTK-aware scaling spreads the stretch over the pairs by
raising θ::

    θ'(n) = θ · (s · max(n, L) / L − (s − 1)) ^ (d / (d − 2)),    ω'_i = θ'(n)^(−2i/d)

Up to ``L`` positions ``θ' = θ`` exactly; past it the base grows with ``n``. Here ``L`` is
transformers' ``max_position_embeddings`` (``config.json`` keeps no other length for this
kind). A call is rotated with its own ``θ'(n)``; in KV-cache generation the keys already
cached keep the rotation of the step that wrote them, as in transformers' ``generate``.
(Transformers also keeps the largest ``θ'`` it has seen until a call shorter than ``L``
comes: a second forward shorter than a first one, both longer than ``L``, is rotated with
the first one's base there and with its own here. Generation, whose length only grows,
and every single forward are the same in both.)

Every table is computed in float32, as transformers computes it: the static kinds' once,
in numpy, as a constant of the program (so training, PTQ and generation rotate by the same
bits), dynamic NTK's in the forward pass, the default RoPE's as it always was.
Transformers' own float32 arithmetic differs from these by rounding (a few ulp,
``tests/model/test_rope.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ROPE_KINDS",
    "RopeKind",
    "RopeScaling",
    "frequency_divisors",
    "inverse_frequencies",
    "rope_tables",
    "yarn_attention_factor",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Which RoPE variant a model uses and its parameters (the module doc derives each)."""

    # The variant, a row of ROPE_KINDS: "default", "linear", "dynamic", "llama3" or "yarn".
    kind: str = "default"
    # s: how many times the pretraining context the scaled RoPE stretches to (>= 1).
    factor: float = 1.0
    # L: the context the model was pretrained with (llama3, yarn); for dynamic the length
    # past which the base grows (transformers' max_position_embeddings).
    original_max_position_embeddings: int | None = None
    # llama3: wavelengths longer than L / low_freq_factor are fully interpolated.
    low_freq_factor: float = 1.0
    # llama3: wavelengths shorter than L / high_freq_factor keep their frequency.
    high_freq_factor: float = 4.0
    # yarn: pairs turning more than beta_fast times over L keep their frequency.
    beta_fast: float = 32.0
    # yarn: pairs turning fewer than beta_slow times over L are fully interpolated.
    beta_slow: float = 1.0
    # yarn: the cos/sin multiplier m; none: derived from factor (and the two below).
    attention_factor: float | None = None
    # yarn: mscale of the numerator of the derived m (with mscale_all_dim; DeepSeek's).
    mscale: float | None = None
    # yarn: mscale of the denominator of the derived m (with mscale).
    mscale_all_dim: float | None = None
    # yarn: round the ramp's ends outwards to whole pairs (floor lo, ceil hi).
    truncate: bool = True

    def __post_init__(self) -> None:
        row = ROPE_KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if row is None:
            raise ValueError(
                f"RopeScaling.kind={self.kind!r}: expected one of {sorted(ROPE_KINDS)}"
            )
        defaults = RopeScaling.__dataclass_fields__
        for name in defaults:
            if name != "kind" and name not in row.fields:
                v = getattr(self, name)
                if v != defaults[name].default:
                    raise ValueError(
                        f"RopeScaling.{name}={v!r} is not read by kind {self.kind!r} "
                        f"(it reads {list(row.fields) or 'nothing'}); leave it unset"
                    )
        for name in row.fields:
            _check_field(self, name)
        if "high_freq_factor" in row.fields and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor!r}: expected more than "
                f"low_freq_factor={self.low_freq_factor!r}"
            )
        if "beta_fast" in row.fields and not self.beta_fast > self.beta_slow:
            raise ValueError(
                f"RopeScaling.beta_fast={self.beta_fast!r}: expected more than "
                f"beta_slow={self.beta_slow!r}"
            )


# What each field may hold: (lowest value, whether the lowest is allowed, may it be None).
_BOUNDS: dict[str, tuple[float, bool, bool]] = {
    "factor": (1.0, True, False),
    "original_max_position_embeddings": (1, True, False),
    "low_freq_factor": (0.0, False, False),
    "high_freq_factor": (0.0, False, False),
    "beta_fast": (0.0, False, False),
    "beta_slow": (0.0, False, False),
    "attention_factor": (0.0, False, True),
    "mscale": (0.0, False, True),
    "mscale_all_dim": (0.0, False, True),
}


def _check_field(sc: RopeScaling, name: str) -> None:
    """Raise naming ``RopeScaling.<name>`` unless its value fits `_BOUNDS` (ints for L,
    a bool for truncate); ints of float fields become floats."""
    v = getattr(sc, name)
    if name == "truncate":
        if not isinstance(v, bool):
            raise ValueError(f"RopeScaling.truncate={v!r}: expected true or false")
        return
    low, inclusive, optional = _BOUNDS[name]
    if v is None and optional:
        return
    whole = name == "original_max_position_embeddings"
    kinds = (int,) if whole else (int, float)
    ok = isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v >= low if inclusive else v > low)
    if not ok:
        what = "a positive int" if whole else f"a number {'>=' if inclusive else '>'} {low:g}"
        raise ValueError(
            f"RopeScaling.{name}={v!r}: expected {what}"
            + (" or none" if optional else "")
            + f" (kind {sc.kind!r} reads it)"
        )
    if not whole:
        object.__setattr__(sc, name, float(v))


# ---------------------------------------------------------------------- the kinds

# A static kind's kept shares: (scaling, theta, head_dim) -> k [d/2] float32.
Keep = Callable[[RopeScaling, float, int], np.ndarray]
# A length-dependent kind's base: (scaling, theta, head_dim, n) -> θ'(n), n the call's length.
Base = Callable[[RopeScaling, float, int, Any], Any]


def _no_attention_factor(sc: RopeScaling) -> float:
    return 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeKind:
    """One row of `ROPE_KINDS`: the module doc's formula for one kind."""

    # The RopeScaling fields it reads (the others must keep their defaults).
    fields: tuple[str, ...]
    # A static kind's k_i (ω' = (ω / s)(1 − k) + ω k); None for a length-dependent kind.
    keep: Keep | None = None
    # A length-dependent kind's θ'(n) (ω' = θ'(n)^(−2i/d)); None for a static kind.
    base: Base | None = None
    # The cos/sin multiplier m.
    attention: Callable[[RopeScaling], float] = _no_attention_factor
    # Whether config.json holds L as max_position_embeddings rather than in the rope dict.
    original_is_context: bool = False

    @property
    def length_dependent(self) -> bool:
        """Whether the table depends on the length of the call (dynamic NTK)."""
        return self.base is not None


def _omega(theta: Any, head_dim: int, xp: Any = jnp) -> Any:
    """ω_i = θ^(−2i/d), float32: the default RoPE's inverse frequencies, in ``xp`` (jax.numpy
    in the forward pass; numpy for the static kinds' constant tables)."""
    return theta ** (-xp.arange(head_dim // 2, dtype=xp.float32) * xp.float32(2.0) / head_dim)


def _all(sc: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """k_i of default: 1."""
    return np.ones((head_dim // 2,), np.float32)


def _none(sc: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """k_i of linear: 0."""
    return np.zeros((head_dim // 2,), np.float32)


def _llama3(sc: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """k_i of llama3: clamp((L/λ_i − a) / (b − a), 0, 1)."""
    wavelength = 2 * math.pi / _omega(np.float32(theta), head_dim, np)
    turns = _span(sc) / wavelength
    a, b = sc.low_freq_factor, sc.high_freq_factor
    return np.clip((turns - a) / (b - a), 0.0, 1.0)


def _yarn(sc: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """k_i of yarn: 1 − clamp((i − lo) / (hi − lo), 0, 1), lo/hi the pairs turning
    beta_fast / beta_slow times over L."""
    span = _span(sc)

    def pair(beta: float) -> float:  # c(β) = d ln(L / (2π β)) / (2 ln θ)
        return head_dim * math.log(span / (2 * math.pi * beta)) / (2 * math.log(theta))

    lo, hi = pair(sc.beta_fast), pair(sc.beta_slow)
    if sc.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    i = np.arange(head_dim // 2, dtype=np.float32)
    return 1.0 - np.clip((i - lo) / (hi - lo), 0.0, 1.0)


def _span(sc: RopeScaling) -> int:
    """L (RopeScaling checks that a kind reading it has one)."""
    assert sc.original_max_position_embeddings is not None
    return sc.original_max_position_embeddings


def _mu(s: float, k: float = 1.0) -> float:
    """μ(s, k) = 1 + 0.1 k ln s (1 for s ≤ 1)."""
    return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0


def yarn_attention_factor(sc: RopeScaling) -> float:
    """yarn's cos/sin multiplier m: attention_factor, else μ(s, mscale) / μ(s,
    mscale_all_dim) when both are set, else μ(s, 1)."""
    if sc.attention_factor is not None:
        return sc.attention_factor
    if sc.mscale and sc.mscale_all_dim:
        return _mu(sc.factor, sc.mscale) / _mu(sc.factor, sc.mscale_all_dim)
    return _mu(sc.factor)


def _dynamic(sc: RopeScaling, theta: float, head_dim: int, n: Any) -> Any:
    """θ'(n) = θ (s max(n, L) / L − (s − 1))^(d / (d − 2)), float32."""
    span = _span(sc)
    length = jnp.maximum(jnp.asarray(span if n is None else n, jnp.float32), span)
    stretch = sc.factor * length / span - (sc.factor - 1)
    return theta * stretch ** (head_dim / (head_dim - 2))


ROPE_KINDS: dict[str, RopeKind] = {
    "default": RopeKind(fields=(), keep=_all),
    "linear": RopeKind(fields=("factor",), keep=_none),
    "dynamic": RopeKind(
        fields=("factor", "original_max_position_embeddings"),
        base=_dynamic,
        original_is_context=True,
    ),
    "llama3": RopeKind(
        fields=(
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
        ),
        keep=_llama3,
    ),
    "yarn": RopeKind(
        fields=(
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ),
        keep=_yarn,
        attention=yarn_attention_factor,
    ),
}


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, length: Any = None
) -> tuple[jax.Array, float]:
    """``(ω' [head_dim // 2] float32, m)``: the inverse frequencies of ``scaling``'s kind
    (None: the default RoPE) and the multiplier of cos and sin. ``length``: the call's
    length ``n`` (an int or a traced scalar), read by length-dependent kinds only (None:
    ``L``, the table up to the original context)."""
    sc = scaling or _DEFAULT
    row = ROPE_KINDS[sc.kind]
    if row.base is not None:
        return _omega(row.base(sc, theta, head_dim, length), head_dim), row.attention(sc)
    if sc == _DEFAULT:  # the default RoPE's table, in the forward pass as it always was
        return _omega(theta, head_dim), 1.0
    assert row.keep is not None  # a static kind: a constant table, the same in every program
    k = row.keep(sc, theta, head_dim)
    omega = _omega(np.float32(theta), head_dim, np)
    return omega / sc.factor * (1.0 - k) + omega * k, row.attention(sc)


def frequency_divisors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """``ω_i / ω'_i = 1 / ((1 − k_i) / s + k_i)`` per pair (float32) of a static kind:
    llama.cpp's ``rope_freqs.weight`` (it divides each pair's frequency by it)."""
    row = ROPE_KINDS[scaling.kind]
    if row.keep is None:
        raise ValueError(
            f"RopeScaling.kind={scaling.kind!r}: its frequencies depend on the sequence "
            "length; no fixed per-pair divisors exist"
        )
    k = row.keep(scaling, theta, head_dim)
    return (1.0 / ((1.0 - k) / scaling.factor + k)).astype(np.float32)


_DEFAULT = RopeScaling()


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape ``[..., T, head_dim // 2]`` (float32) for integer positions.

    Angles ``p · ω'_i`` with ``ω'`` from `inverse_frequencies` (``scaling`` None: the default
    ``θ^(−2i/d)``, Llama / HF convention); both multiplied by the kind's ``m`` (yarn). A
    length-dependent kind reads the call's length as ``max(positions) + 1``.
    """
    sc = scaling or _DEFAULT
    length = jnp.max(positions) + 1 if ROPE_KINDS[sc.kind].length_dependent else None
    inv_freq, m = inverse_frequencies(head_dim, theta, sc, length)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if m != 1.0:
        cos, sin = cos * m, sin * m
    return cos, sin

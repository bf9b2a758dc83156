"""RoPE scaling in a llama.cpp GGUF: what llama.cpp's converter writes, written and read back.

``convert_hf_to_gguf.py`` (``TextModel.set_gguf_parameters`` for the keys,
``LlamaModel.generate_extra_tensors`` for the tensor) turns a ``config.json``'s RoPE
into (``{arch}``: the file's ``general.architecture``; the names are ``gguf.constants``'
``Keys.Rope``; the tensor is written, and read, for ``llama`` only)::

    kind     GGUF
    default  nothing
    linear   {arch}.rope.scaling.type = "linear", {arch}.rope.scaling.factor = s
    yarn     {arch}.rope.scaling.type = "yarn", .factor = s,
             .original_context_length = L, .yarn_beta_fast, .yarn_beta_slow
    llama3   the tensor rope_freqs.weight [head_dim / 2] float32: each pair's divisor
             ω_i / ω'_i (microscale.model.rope.frequency_divisors); llama.cpp divides
             the pair's frequency by it

`gguf_rope` writes the same, and refuses what llama.cpp's Llama graph cannot compute:
``dynamic`` (its base depends on the length of the call; llama.cpp has no such base), and
a yarn scaling with ``attention_factor``, ``mscale`` or ``mscale_all_dim`` set or
``truncate`` false (llama.cpp derives the attention factor from ``s`` alone, ``1 + 0.1 ln
s``, and always floors/ceils the ramp's ends).

The file holds llama3's divisors, not its parameters, so microscale also records the
`RopeScaling` as JSON under ``microscale.rope_scaling`` (other readers ignore it), and
`read_gguf_rope` reads it back exactly after checking it against llama.cpp's keys and
tensor. A file without it (llama.cpp's converter's) is solved for the parameters: ``s``
is the largest divisor; a pair in between has ``1 / divisor = (1 − k) / s + k`` and
``k = (L / λ − a) / (b − a)``, linear in ``1 / λ`` (λ its wavelength): two such pairs
give its slope ``L / (b − a)`` and intercept ``a / (b − a)``; only ``L / a`` and
``L / b`` change the math, so ``a = 1`` (every Llama 3.x release) fixes ``L`` and ``b``.
The solution is checked against the whole tensor. Any other key of llama.cpp's that
would change the rotation (another scaling type, an extrapolation or attention factor that
is not the default, ``yarn_log_multiplier``) is refused naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from microscale.export.gguffile import GGUFContents, gguf_package
from microscale.model import ModelConfig, RopeScaling
from microscale.model.rope import frequency_divisors, yarn_attention_factor

__all__ = ["MS_ROPE_KEY", "ROPE_FREQS", "GGUFRope", "gguf_rope", "read_gguf_rope"]

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's MODEL_TENSOR.ROPE_FREQS
MS_ROPE_KEY = "microscale.rope_scaling"
# RoPE keys of llama.cpp that the converter writes for no Llama kind, with their neutral
# values (a file holding another value is refused: its rotation is not microscale's).
_NEUTRAL = {
    "rope.scaling.attn_factor": 1.0,
    "rope.scaling.yarn_log_multiplier": 0.0,
    "rope.scaling.yarn_ext_factor": 1.0,
}


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GGUFRope:
    """What a GGUF holds of a model's RoPE scaling."""

    # llama.cpp's scaling type: "none", "linear" or "yarn".
    type: str = "none"
    # {arch}.rope.scaling.factor (linear, yarn).
    factor: float | None = None
    # {arch}.rope.scaling.original_context_length (yarn).
    original_context_length: int | None = None
    # {arch}.rope.scaling.yarn_beta_fast / yarn_beta_slow (yarn).
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    # rope_freqs.weight: per-pair frequency divisors (llama3), float32 [head_dim / 2].
    freqs: np.ndarray | None = None

    def write(self, w: Any, scaling: RopeScaling | None) -> None:
        """The keys into a ``gguf.GGUFWriter`` (the tensor goes with the others), and
        ``scaling`` under `MS_ROPE_KEY`."""
        gguf = gguf_package("GGUF export")
        if self.type != "none":
            w.add_rope_scaling_type(gguf.RopeScalingType(self.type))
        for name, add in _ADD.items():
            if getattr(self, name) is not None:
                getattr(w, add)(getattr(self, name))
        if scaling is not None:
            w.add_string(MS_ROPE_KEY, json.dumps(dataclasses.asdict(scaling), sort_keys=True))

    def same(self, other: GGUFRope) -> bool:
        """Whether two hold the same keys (float32 in the file: to 1e-6), tensors aside."""
        for name in ("type", *_ADD):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None) or (
                a is not None and a != b and not math.isclose(a, b, rel_tol=1e-6)
            ):
                return False
        return (self.freqs is None) == (other.freqs is None)


# GGUFRope field -> the gguf.GGUFWriter method that writes its key.
_ADD = {
    "factor": "add_rope_scaling_factor",
    "original_context_length": "add_rope_scaling_orig_ctx_len",
    "yarn_beta_fast": "add_rope_scaling_yarn_beta_fast",
    "yarn_beta_slow": "add_rope_scaling_yarn_beta_slow",
}


def _refuse(kind: str, why: str) -> ValueError:
    return ValueError(f"GGUF export: rope_scaling.kind={kind!r}: {why}")


def _linear(cfg: ModelConfig, sc: RopeScaling) -> GGUFRope:
    return GGUFRope(type="linear", factor=sc.factor)


def _yarn(cfg: ModelConfig, sc: RopeScaling) -> GGUFRope:
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(sc, name) is not None:
            raise _refuse(
                "yarn",
                f"{name}={getattr(sc, name)!r}: llama.cpp derives yarn's attention factor "
                "from the factor alone (1 + 0.1 ln s); leave it unset to export",
            )
    if not sc.truncate:
        raise _refuse("yarn", "truncate=false: llama.cpp always rounds the ramp's ends")
    return GGUFRope(
        type="yarn",
        factor=sc.factor,
        original_context_length=sc.original_max_position_embeddings,
        yarn_beta_fast=sc.beta_fast,
        yarn_beta_slow=sc.beta_slow,
    )


def _llama3(cfg: ModelConfig, sc: RopeScaling) -> GGUFRope:
    div = frequency_divisors(cfg.head_dim, cfg.rope_theta, sc)
    return GGUFRope(freqs=np.asarray(div, np.float32))


def _dynamic(cfg: ModelConfig, sc: RopeScaling) -> GGUFRope:
    raise _refuse(
        "dynamic",
        "dynamic NTK's base depends on the sequence length; llama.cpp's llama graph has "
        "no such RoPE (export to an HF folder instead)",
    )


# kind -> what llama.cpp's file holds for it (the module doc's table).
_WRITE: dict[str, Callable[[ModelConfig, RopeScaling], GGUFRope]] = {
    "linear": _linear,
    "yarn": _yarn,
    "llama3": _llama3,
    "dynamic": _dynamic,
}


def gguf_rope(cfg: ModelConfig) -> GGUFRope:
    """What the GGUF of ``cfg`` holds of its RoPE scaling; refuses what llama.cpp cannot
    compute (the module doc)."""
    sc = cfg.rope_scaling
    return GGUFRope() if sc is None else _WRITE[sc.kind](cfg, sc)


# ---------------------------------------------------------------------- reading


def _in_file(file: GGUFContents) -> GGUFRope:
    """The file's RoPE scaling keys and tensor; a key that would change the rotation in
    a way microscale does not compute is refused naming it."""
    field = file.value
    a = field("general.architecture") + "."
    for key, neutral in _NEUTRAL.items():
        v = field(a + key, None)
        if v is not None and not math.isclose(float(v), neutral, rel_tol=1e-6):
            raise ValueError(f"GGUF {a}{key}={v!r}: microscale's RoPE has only {neutral}")
    if field(a + "rope.scaling.alpha", None) is not None:
        raise ValueError(f"GGUF {a}rope.scaling.alpha: a RoPE microscale does not compute")
    kind = field(a + "rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(
            f"GGUF {a}rope.scaling.type={kind!r}: microscale reads 'none', 'linear' or 'yarn'"
        )
    freqs = next((t for t in file.tensors if t.name == ROPE_FREQS), None)
    got = {name: field(a + f"rope.scaling.{name}", None) for name in _ADD}
    found = GGUFRope(
        type=kind,
        factor=None if kind == "none" or got["factor"] is None else float(got["factor"]),
        original_context_length=(
            None if got["original_context_length"] is None else int(got["original_context_length"])
        ),
        yarn_beta_fast=None if got["yarn_beta_fast"] is None else float(got["yarn_beta_fast"]),
        yarn_beta_slow=None if got["yarn_beta_slow"] is None else float(got["yarn_beta_slow"]),
        freqs=None if freqs is None else file.decode(freqs).reshape(-1),
    )
    attn = field(a + "rope.scaling.yarn_attn_factor", None)
    default = (
        yarn_attention_factor(
            RopeScaling(kind="yarn", factor=found.factor or 1.0, original_max_position_embeddings=1)
        )
        if kind == "yarn"
        else 1.0
    )
    if attn is not None and not math.isclose(float(attn), default, rel_tol=1e-6):
        raise ValueError(
            f"GGUF {a}rope.scaling.yarn_attn_factor={attn!r}: microscale reads only the "
            f"default {default:.6g} (llama.cpp's own for this scaling)"
        )
    if found.freqs is not None and kind != "none":
        raise ValueError(
            f"GGUF {ROPE_FREQS} with {a}rope.scaling.type={kind!r}: two scalings at once"
        )
    return found


def _from_keys(found: GGUFRope, cfg: ModelConfig) -> RopeScaling | None:
    """The RopeScaling of llama.cpp's keys alone (the module doc)."""
    if found.type == "linear":
        return RopeScaling(kind="linear", factor=found.factor or 1.0)
    if found.type == "yarn":
        return RopeScaling(
            kind="yarn",
            factor=found.factor or 1.0,
            original_max_position_embeddings=found.original_context_length or cfg.max_seq_len,
            beta_fast=found.yarn_beta_fast or 32.0,  # llama.cpp's defaults
            beta_slow=found.yarn_beta_slow or 1.0,
        )
    if found.freqs is not None:
        return _solve_llama3(found.freqs, cfg)
    return None


def _solve_llama3(div: np.ndarray, cfg: ModelConfig) -> RopeScaling:
    """llama3's parameters from its divisors, with low_freq_factor 1 (the module doc);
    from a single pair in between, high_freq_factor 4 too."""
    hd, theta = cfg.head_dim, cfg.rope_theta
    if div.shape != (hd // 2,):
        raise ValueError(f"GGUF {ROPE_FREQS}: shape {div.shape}, expected ({hd // 2},)")
    s = float(div.max())
    wavelength = 2 * math.pi * theta ** (np.arange(hd // 2) * 2.0 / hd)
    between = (div.astype(np.float64) - 1) * (s - div) > 1e-4 * s
    if s <= 1 or not between.any():
        raise ValueError(
            f"GGUF {ROPE_FREQS}: no pair between the kept and the interpolated ones; "
            f"llama3's parameters cannot be solved from it (no {MS_ROPE_KEY} in the file)"
        )
    u = (1 / div[between].astype(np.float64) - 1 / s) / (1 - 1 / s)  # k
    if between.sum() == 1:  # u = (L / λ − 1) / 3
        span, high = float(wavelength[between][0] * (3 * u[0] + 1)), 4.0
    else:  # u = slope / λ − icept, slope = L / (b − 1), icept = 1 / (b − 1)
        slope, icept = np.polyfit(1 / wavelength[between], u, 1)
        span, high = slope / -icept, float(f"{1 - 1 / icept:.6g}")
    try:
        sc = RopeScaling(
            kind="llama3",
            factor=float(f"{s:.6g}"),
            original_max_position_embeddings=int(round(span)),
            low_freq_factor=1.0,
            high_freq_factor=high,
        )
    except ValueError as e:
        raise ValueError(f"GGUF {ROPE_FREQS}: not llama3's divisors (solved: {e})") from None
    _check_freqs(div, sc, cfg, "solved from it")
    return sc


def _check_freqs(div: np.ndarray, sc: RopeScaling, cfg: ModelConfig, what: str) -> None:
    want = np.asarray(frequency_divisors(cfg.head_dim, cfg.rope_theta, sc), np.float32)
    if div.shape != want.shape or not np.allclose(div, want, rtol=1e-5, atol=0):
        raise ValueError(f"GGUF {ROPE_FREQS} disagrees with the llama3 scaling {what}: {sc}")


def read_gguf_rope(file: GGUFContents, cfg: ModelConfig) -> RopeScaling | None:
    """The RopeScaling of a GGUF (read by :func:`~microscale.export.gguffile.open_gguf`;
    ``cfg`` the rest of its model): microscale's own record when the file has one, checked
    against llama.cpp's keys and tensor, else solved from those."""
    found = _in_file(file)
    own = file.value(MS_ROPE_KEY, None)
    if own is None:
        return _from_keys(found, cfg)
    try:
        sc = RopeScaling(**json.loads(own))
    except (TypeError, ValueError) as e:
        raise ValueError(f"GGUF {MS_ROPE_KEY}={own!r}: {e}") from None
    want = gguf_rope(cfg.replace(rope_scaling=sc))
    if not want.same(found):
        raise ValueError(f"GGUF {MS_ROPE_KEY}={own!r} disagrees with llama.cpp's RoPE keys")
    if found.freqs is not None:
        _check_freqs(found.freqs, sc, cfg, f"of {MS_ROPE_KEY}")
    return sc

"""Post-training weight quantization beyond round-to-nearest.

A linear kernel is stored ``[in, out]`` (``y = x @ W``); deployment layouts (HF,
compressed-tensors, ModelOpt) store ``W^T [out, in]`` and quantize each row along ``in``,
the GEMM's contraction axis, in blocks of ``block_size``. Everything here works on that
transposed ``[out, in]`` array with ``axis=-1``, so the :class:`~microscale.formats.QArray`
is already in the export layout and its values equal blocks of 16 along ``in`` of the
``[in, out]`` kernel.

Round-to-nearest (RTN) NVFP4 (docs/design.md#scales) fixes two scales from the data: the
tensor scale ``s_dec = amax / (448 * 6)`` and, per block, ``sb = e4m3(block_amax / (6 s_dec))``
so the block maximum lands on E2M1's largest value 6. Two cheap choices lower the error
without changing the storage format:

**MSE scale search.** Quantize with a tensor amax ``c * amax(|W|)`` for ``c`` on a grid
(1.0 included) and keep the ``c`` of least ``||Q(W) - W||^2``. For NVFP4 ``c`` moves every
block scale along the E4M3 grid (its 3-bit mantissa rounds ``block_amax / (6 s_dec)``
differently) and ``c < 1`` clips the largest blocks; for per-tensor FP8 it trades
clipping against resolution. Formats without a tensor scale (MX: the E8M0 block scale
is a pure power of two of the block amax) have nothing to search. The chosen ``amax``
is simply passed to ``microscale.formats.quantize(..., amax=)``; it is also the tensor
scale an exporter writes (``weight_global_scale = 2688 / amax``). Fused groups (q/k/v,
gate/up: one GEMM and so one tensor scale in vLLM / TensorRT-LLM) share one amax,
``c * max_i amax(|W_i|)``, with ``c`` chosen for the group's summed error
(:func:`quantize_group`).

**Four over six** (Cook et al., 2025). E2M1's grid near the top is coarse (4 -> 6 is a
step of 2): a block whose values cluster around 75% of its max rounds them to 4 or 6
when the max maps to 6. Mapping the block max to 4 instead
(``sb4 = e4m3(block_amax / (4 s_dec))``) uses the grid ``{..., 3, 4}`` for the same
range, finer at the top and coarser below. Each block keeps whichever of the two gives
the lower squared error, so the result is never worse than RTN block by block, and it is
still plain NVFP4 (only the chosen block scales differ): any NVFP4 reader decodes it.
It applies to formats with E2M1 elements and a non-power-of-two (E4M3) block scale.
The block holding the tensor amax already has the largest E4M3 scale (448), so it can
map to 4 only under a tensor amax raised by 1.5; the MSE search's grid (up to 1.5) tries
that, and picks it when the whole tensor's error says so.

The per-block choice is ``microscale.formats.quantize(..., four_over_six=True)``.

**ggml's block types** (Q4_K, IQ4_XS, ...: :func:`~microscale.formats.weight_only`) are
encoded by ggml's own quantizer (:func:`~microscale.formats.ggml_qarray`, bit for bit), with
each layer's importance weights where given (llama.cpp's imatrix: the mean square of each
input column over the calibration tokens) and ggml's plain encoder otherwise; their scales
come from ggml's own search, so the MSE scale search and four over six do not apply.
GPTQ runs on their grids (:func:`~microscale.ptq.gptq.gptq_ggml`: the encoder fixes each
block's scales as GPTQ reaches it, with the same importance weights).

**GPTQ** (``WeightPTQ(method="gptq")``, :mod:`~microscale.ptq.gptq`): with the tensor
amax chosen as above, each kernel is quantized column by column with its input Hessian,
each column's rounding error moved onto the columns still to come; block scales (and the
four-over-six choice) are fixed from the updated weights as each block is reached.

A quantize run asks for every layer in many (format, PTQ options) pairs: :class:`WeightCache`
quantizes each fused group once per pair and keeps the packed results.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from microscale.formats import (
    FormatSpec,
    QArray,
    dequantize,
    get_format,
    get_weight_format,
    ggml_qarray,
    quantize,
    tensor_amax,
    weight_only,
)
from microscale.formats.ggml import layer_format
from microscale.ptq.gptq import gptq_ggml, gptq_quantize

if TYPE_CHECKING:
    from microscale.ptq.engine import Engine

__all__ = [
    "WEIGHT_METHODS",
    "QuantizedWeight",
    "WeightCache",
    "WeightPTQ",
    "four_over_six",
    "quantize_group",
    "quantize_weight",
    "supports_four_over_six",
    "weight_stats",
]


# WeightPTQ.method values.
WEIGHT_METHODS = ("rtn", "gptq")


def _default_grid() -> tuple[float, ...]:
    return tuple(float(c) for c in np.round(np.arange(0.50, 1.5001, 0.05), 4))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightPTQ:
    """Which post-training weight choices to make beyond round-to-nearest."""

    # Search the tensor amax multiplier c on `scale_grid` for the least weight MSE
    # (formats with a tensor scale: NVFP4's global scale, per-tensor FP8).
    mse_scale: bool = True
    # Multipliers c tried by the MSE search; 1.0 (plain RTN) is always tried first.
    scale_grid: tuple[float, ...] = dataclasses.field(default_factory=_default_grid)
    # Per block, map the block max to 4 instead of 6 when that lowers the block's error
    # (E2M1 formats with E4M3 block scales).
    four_over_six: bool = True
    # How the elements are rounded given the scales: "rtn" (each to nearest) or "gptq"
    # (GPTQ error compensation with the layer's calibration-input Hessian,
    # microscale.ptq.gptq; the MSE tensor scale and four over six still apply).
    method: str = "rtn"
    # GPTQ: fraction of mean(diag H) added to the Hessian's diagonal.
    gptq_damp: float = 0.01
    # GPTQ: lazy-update block in columns (a multiple of every candidate's block size).
    gptq_block: int = 128

    def __post_init__(self):
        grid = tuple(float(c) for c in self.scale_grid)
        if not grid or any(not (np.isfinite(c) and c > 0) for c in grid):
            raise ValueError(
                f"WeightPTQ.scale_grid={self.scale_grid!r}: expected positive finite multipliers"
            )
        object.__setattr__(self, "scale_grid", grid)
        if self.method not in WEIGHT_METHODS:
            raise ValueError(
                f"WeightPTQ.method={self.method!r}: expected one of {list(WEIGHT_METHODS)}"
            )
        if not (
            isinstance(self.gptq_damp, int | float)
            and np.isfinite(self.gptq_damp)
            and self.gptq_damp >= 0
        ):
            raise ValueError(
                f"WeightPTQ.gptq_damp={self.gptq_damp!r}: expected a finite "
                "fraction >= 0 (e.g. 0.01)"
            )
        if (
            isinstance(self.gptq_block, bool)
            or not isinstance(self.gptq_block, int)
            or self.gptq_block < 1
            or self.gptq_block % 32
        ):
            raise ValueError(
                f"WeightPTQ.gptq_block={self.gptq_block!r}: expected a positive "
                "multiple of 32 (every block format's block size divides it)"
            )

    @classmethod
    def rtn(cls) -> WeightPTQ:
        """Plain round-to-nearest (both choices off)."""
        return cls(mse_scale=False, four_over_six=False)


def supports_four_over_six(spec: FormatSpec) -> bool:
    """E2M1 elements (4-bit, packed) with a non-power-of-two (E4M3) block scale."""
    return spec.packed and spec.scale_kind == "e4m3"


def four_over_six(x, fmt: str | FormatSpec = "nvfp4", *, amax=None) -> QArray:
    """Quantize ``x [rows, K]`` along its last axis, choosing per block whether its max
    maps to ``elem_max`` (6) or to 4, whichever gives the lower squared block error.

    ``amax``: tensor amax (default ``max|x|``), as in ``formats.quantize``. Returns a
    normal QArray of ``fmt`` (decode with ``formats.dequantize``).
    """
    spec = get_format(fmt)
    if not supports_four_over_six(spec):
        raise ValueError(
            f"four_over_six needs E2M1 elements with E4M3 block scales; format "
            f"{spec.name!r} has elem_bits={spec.elem_bits}, "
            f"scale_kind={spec.scale_kind!r}"
        )
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 2:
        raise ValueError(f"four_over_six expects a 2-D [rows, K] array, got shape {x.shape}")
    return quantize(x, spec, axis=-1, amax=amax, four_over_six=True)


def _quantize_t(w_t: jax.Array, spec: FormatSpec, amax, four6: bool) -> QArray:
    return quantize(w_t, spec, axis=-1, amax=amax, four_over_six=four6)


@functools.partial(jax.jit, static_argnames=("spec", "four6"))
def _sq_error(w_t, amax, spec: FormatSpec, four6: bool):
    return jnp.sum(jnp.square(dequantize(_quantize_t(w_t, spec, amax, four6)) - w_t))


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedWeight:
    """One layer's kernel in one format."""

    # Format name.
    format: str
    # Quantized ``W^T [out, in]`` along axis -1 (the export layout). Only this packed form
    # is held (a 4-bit kernel: ~1/8 of float32); ``values`` decodes it on demand.
    qarray: QArray
    # Tensor amax passed to the quantizer (None: the format has no tensor scale).
    amax: float | None
    # Chosen multiplier c of amax(|W|) (1.0 = RTN scale).
    scale_multiplier: float
    # ||Q(W) - W||^2 / ||W||^2 of the result and of plain RTN.
    rel_mse: float
    rel_mse_rtn: float
    # Fraction of blocks that took the max->4 scale (0 when four over six is off, and
    # under GPTQ, whose scales follow the updated weights).
    four_fraction: float = 0.0

    @property
    def values(self) -> jax.Array:
        """The dequantized kernel ``[in, out]`` float32 (what the model computes with),
        decoded from ``qarray`` on each access (not cached: callers hold it as long as
        they need it)."""
        return dequantize(self.qarray).T


def quantize_weight(
    kernel, fmt: str | FormatSpec, ptq: WeightPTQ | None = None, hessian=None, importance=None
) -> QuantizedWeight:
    """Quantize a linear kernel ``[in, out]`` along ``in`` with the PTQ choices of ``ptq``
    (default: :class:`WeightPTQ` ()); ``hessian`` ``[in, in]`` of its input for GPTQ;
    ``importance`` ``[in]`` (llama.cpp's imatrix) for ggml's block types. Deterministic."""
    return quantize_group(
        [kernel],
        fmt,
        ptq,
        None if hessian is None else [hessian],
        None if importance is None else [importance],
    )[0]


def _own_group(
    ws, wts, norms, spec: FormatSpec, importance, hessians, ptq: WeightPTQ
) -> list[QuantizedWeight]:
    """A group whose members are quantized each on its own, with no tensor scale to share:
    an unscaled format (bf16: rounding) or one of ggml's block types (ggml's encoder with
    the member's importance weights, or GPTQ on its grid given ``hessians``;
    ``rel_mse_rtn``: its plain encoder, without them)."""
    out = []
    for i, (w, t, n) in enumerate(zip(ws, wts, norms, strict=True)):
        imp = None if importance is None else importance[i]
        if hessians is None:
            q = ggml_qarray(t, spec, imp)
        else:
            data = gptq_ggml(t, hessians[i], spec, importance=imp, damp=ptq.gptq_damp)
            q = ggml_qarray(t, spec, data=data)
        err = err0 = float(jnp.sum(jnp.square(dequantize(q).T - w))) / n
        if (imp is not None or hessians is not None) and weight_only(spec):
            err0 = float(jnp.sum(jnp.square(dequantize(ggml_qarray(t, spec)).T - w))) / n
        out.append(
            QuantizedWeight(
                format=spec.name,
                qarray=q,
                amax=None,
                scale_multiplier=1.0,
                rel_mse=err,
                rel_mse_rtn=err0,
            )
        )
    return out


def _search_scale(wts, spec: FormatSpec, ptq: WeightPTQ, four6: bool):
    """The group's base amax, the multiplier ``c`` of the MSE search (1.0 without it), each
    member's squared error at ``c`` and each member's plain round-to-nearest error."""
    base = tensor_amax(jnp.stack([tensor_amax(t) for t in wts]))

    def errors(c: float, f6: bool) -> list[float]:
        a = base * jnp.float32(c)
        return [float(_sq_error(t, a, spec, f6)) for t in wts]

    rtn = errors(1.0, False)
    best_c, best = 1.0, errors(1.0, True) if four6 else rtn
    if ptq.mse_scale and spec.has_tensor_scale:
        for c in ptq.scale_grid:
            if c == 1.0:
                continue
            errs = errors(c, four6)
            if sum(errs) < sum(best):
                best_c, best = c, errs
    return base, best_c, best, rtn


def quantize_group(
    kernels,
    fmt: str | FormatSpec,
    ptq: WeightPTQ | None = None,
    hessians=None,
    importance=None,
) -> list[QuantizedWeight]:
    """Quantize the kernels of one fused group (q/k/v or gate/up: one GEMM in an engine)
    with ONE tensor amax, as deployment requires: ``c * max_i amax(|W_i|)``, where the MSE
    search picks ``c`` for the least summed error of the members. Formats without a
    tensor scale quantize each member on its own (their scales are per block anyway).
    With ``ptq.method == "gptq"`` each member is then GPTQ-quantized with that amax and its
    input Hessian (``hessians``, one per kernel). One of ggml's block types is encoded by
    ggml's quantizer with ``importance`` (one ``[in]`` array or None per kernel)."""
    spec = get_weight_format(fmt)
    ptq = WeightPTQ() if ptq is None else ptq
    ws = [jnp.asarray(k, jnp.float32) for k in kernels]
    if not ws:
        raise ValueError("quantize_group: no kernels")
    gptq = ptq.method == "gptq" and spec.quantized
    if importance is not None and len(importance) != len(ws):
        raise ValueError(
            f"quantize_group: {len(importance)} importance arrays for {len(ws)} kernels"
        )
    if gptq and (hessians is None or len(hessians) != len(ws)):
        raise ValueError(
            f"quantize_group: WeightPTQ.method='gptq' needs one input Hessian "
            f"per kernel ({len(ws)}), got "
            f"{'none' if hessians is None else len(hessians)}"
        )
    for w in ws:
        if w.ndim != 2:
            raise ValueError(f"quantize_weight expects 2-D [in, out] kernels, got shape {w.shape}")
    wts = [w.T for w in ws]
    norms = [max(float(jnp.sum(jnp.square(t))), 1e-30) for t in wts]
    if not spec.quantized or weight_only(spec):
        return _own_group(ws, wts, norms, spec, importance, hessians if gptq else None, ptq)
    tensor = spec.has_tensor_scale
    four6 = ptq.four_over_six and supports_four_over_six(spec)
    base, best_c, best, rtn = _search_scale(wts, spec, ptq, four6)
    amax = base * jnp.float32(best_c)
    out = []
    for i, (t, e, e0, n) in enumerate(zip(wts, best, rtn, norms, strict=True)):
        if gptq:
            q = gptq_quantize(
                t,
                hessians[i],
                spec,
                amax=amax if tensor else None,
                four_over_six=four6,
                damp=ptq.gptq_damp,
                block=ptq.gptq_block,
            )
            e = float(jnp.sum(jnp.square(dequantize(q) - t)))
        else:
            q = _quantize_t(t, spec, amax, four6)
        frac = 0.0
        if four6 and not gptq:
            rtn_scales = quantize(t, spec, axis=-1, amax=amax).scales
            frac = float(jnp.mean((q.scales != rtn_scales).astype(jnp.float32)))  # type: ignore[union-attr]
        out.append(
            QuantizedWeight(
                format=spec.name,
                qarray=q,
                amax=float(amax) if tensor else None,
                scale_multiplier=best_c,
                rel_mse=e / n,
                rel_mse_rtn=e0 / n,
                four_fraction=frac,
            )
        )
    return out


class WeightCache:
    """Quantized kernels per (format, PTQ options), computed once per group."""

    def __init__(
        self,
        engine: Engine,
        groups: Mapping[str, str],
        hessians: Mapping[str, Any] | Callable[[str], Mapping[str, Any]] | None = None,
        importance: Mapping[str, Any] | None = None,
    ):
        self.engine = engine
        # {path: [in] importance weights} (llama.cpp's imatrix: mean square of each input
        # column) for ggml's block types; a layer without one: ggml's plain encoder
        self.importance = importance
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
        key = (fmt, ptq if get_weight_format(fmt).quantized else None)
        if key not in self._cache:
            out: dict[str, QuantizedWeight] = {}
            by_path = self._hessians(fmt, ptq)
            imp = self.importance
            for mem in self.members.values():
                hs = None if by_path is None else [by_path[p] for p in mem]
                im = None if imp is None else [imp.get(p) for p in mem]
                kernels = [self.engine.kernels[p] for p in mem]
                # a ggml type the group's rows cannot hold: llama.cpp's fallback stands in
                # (the search never picks it there; an allocation names the fallback)
                stored = layer_format(fmt, self.engine.rows[mem[0]])
                qs = quantize_group(kernels, stored, ptq, hs, im)
                out.update(zip(mem, qs, strict=True))
            self._cache[key] = {p: out[p] for p in self.engine.paths}
        return self._cache[key]

    def _hessians(self, fmt: str, ptq: WeightPTQ) -> Mapping[str, Any] | None:
        if not callable(self.hessians):
            return self.hessians
        if ptq.method != "gptq" or not get_weight_format(fmt).quantized:
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


def weight_stats(
    engine: Engine, cand: Mapping[str, Mapping[str, QuantizedWeight]]
) -> dict[str, dict[str, Any]]:
    """Each layer's kernel amax, rms and shape, and per candidate format its quantization
    error (``rel_mse``, ``rel_mse_rtn``), scale multiplier and four-over-six fraction: the
    report's ``weight_stats``."""
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

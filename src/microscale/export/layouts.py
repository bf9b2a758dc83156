"""Per-layer quantization choices, and the scales and orientation every layout shares.

A linear layer is stored by a :class:`LayerQuant`: the format of its weights and,
optionally, of its input activations (W4A4 / W8A8 deployment; ``inputs=None`` is
weight-only, W4A16 / W8A16). All numerics come from ``microscale.formats``; this module
holds what every layout shares: the per-layer choices, scales, orientation.

Each HF-style layout names a format in its own vocabulary, one module each with its table:
:mod:`microscale.export.compressed_tensors` (``CT_SCHEMES``) and
:mod:`microscale.export.modelopt` (``MODELOPT_ALGOS``).

Element packing is the same everywhere: element ``2i`` of a row in the low nibble of byte
``i``, sign in bit 3 (``[[0, .5, 4, -0], [-0, 1, -6, 3]] -> [[0x10, 0x86], [0x28, 0x5F]]``).

Fused groups. vLLM and TensorRT-LLM run q/k/v as one GEMM and gate/up as another, with one
tensor scale per GEMM, so the members of a group get one format and their weights are
quantized with the group's amax (``quantize(w, fmt, amax=max_group_amax)``): identical
global scales. Static input scales are shared the same way.

Weight blocks always run along the contraction (input) dimension ``K``. microscale's
kernels are ``[K, N]``; a weight quantized here is ``quantize(kernel, fmt, axis=0)`` (blocks
along ``K``, packed along ``K``) and its leaves transposed give the layout's ``[N, ...]``
arrays byte for byte. The layouts hold one scale per ``1 x 16`` row segment: weights are
quantized that way (a training recipe's 16x16 weight tiles are not used for export), and
a pre-quantized QArray with 16x16 tiles is stored by repeating each tile's scale over its
16 rows, which leaves every decoded value unchanged.

Tensor scales in the encode direction (compressed-tensors' ``*_global_scale``) are stored
as a float32 ``r`` whose reciprocal is *exactly* microscale's decode scale ``s_dec``
(:func:`exact_reciprocal`; within an ulp of ``2688/amax``), so ``1/r`` on import gives back
the bits ``formats.quantize`` produced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from microscale.export.hf import ms_module
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
from microscale.model import ModelConfig, PrecisionRules, fused_groups, linear_paths
from microscale.ops import get_recipe

__all__ = [
    "LayerQuant",
    "amax_from_decode_scale",
    "exact_reciprocal",
    "input_decode_scales",
    "kernel_values",
    "quantize_linear_weights",
    "resolve_layers",
    "row_blocks",
    "tensor_decode_scale",
    "to_hf_orientation",
    "to_kernel_orientation",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerQuant:
    """How one linear layer is stored and run."""

    # Weight format (microscale.formats registry name, or one of ggml's block types:
    # formats.get_weight_format); "bf16" = unquantized (the layouts list such layers as
    # ignored / excluded).
    weights: str = "bf16"
    # Input-activation format for W4A4 / W8A8 deployment; None = weight-only (W4A16).
    inputs: str | None = None

    def __post_init__(self):
        get_weight_format(self.weights)  # raises with the known names
        if self.inputs is not None:
            if weight_only(get_weight_format(self.inputs)):
                raise ValueError(
                    f"LayerQuant(inputs={self.inputs!r}): ggml's block types quantize "
                    "weights only (llama.cpp quantizes a GEMM's input itself)"
                )
            if not get_format(self.inputs).quantized:
                object.__setattr__(self, "inputs", None)
            elif not get_weight_format(self.weights).quantized:
                raise ValueError(
                    f"LayerQuant(weights={self.weights!r}, inputs="
                    f"{self.inputs!r}): quantized inputs need quantized weights"
                )

    @property
    def weight_spec(self) -> FormatSpec:
        return get_weight_format(self.weights)

    @property
    def input_spec(self) -> FormatSpec | None:
        return None if self.inputs is None else get_format(self.inputs)

    @property
    def quantized(self) -> bool:
        return self.weight_spec.quantized

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "inputs": self.inputs}

    def __str__(self) -> str:
        return self.weights if self.inputs is None else f"{self.weights}/a:{self.inputs}"


# ---------------------------------------------------------------------- scales


def tensor_decode_scale(spec: FormatSpec, amax: float) -> np.float32:
    """The per-tensor decode scale ``formats.quantize`` derives from ``amax`` (NVFP4:
    ``amax/2688``; FP8: ``amax/448``), computed by ``formats`` itself on a dummy block."""
    q = quantize(jnp.zeros((spec.block_size or 1,), jnp.float32), spec, amax=jnp.float32(amax))
    s = q.global_scale if spec.has_global_scale else q.scales
    return np.float32(np.asarray(s))


def amax_from_decode_scale(spec: FormatSpec, scale) -> Any:
    """Inverse of :func:`tensor_decode_scale` (to re-run ``quantize(..., amax=...)`` with a
    stored static scale): NVFP4 ``scale * 6 * 448``, FP8 ``scale * 448``."""
    factor = spec.elem_max * (spec.scale_max if spec.has_global_scale else 1.0)
    return scale * np.float32(factor)


def exact_reciprocal(s) -> np.float32:
    """A float32 ``r`` with ``float32(1 / r) == s`` exactly (``1/s`` or a neighbour).

    compressed-tensors stores NVFP4's global scale in the encode direction ``2688/amax``
    while ``formats`` keeps the decode scale ``s = 1/s_enc``; a reader computes
    ``1/stored``. Storing such an ``r`` makes that read exact, so export -> import
    round-trips bit for bit.
    """
    s = np.float32(s)
    one = np.float32(1.0)
    if not np.isfinite(s) or s == 0:
        return np.float32(one / s) if s != 0 else np.float32(np.inf)
    r = np.float32(one / s)
    for cand in (
        r,
        np.nextafter(r, np.float32(np.inf)),
        np.nextafter(r, np.float32(0)),
        np.nextafter(np.nextafter(r, np.float32(np.inf)), np.float32(np.inf)),
        np.nextafter(np.nextafter(r, np.float32(0)), np.float32(0)),
    ):
        if np.float32(one / cand) == s:
            return np.float32(cand)
    return r  # no float32 inverts exactly (cannot happen for a formats-computed scale)


# ---------------------------------------------------------------------- orientation


def to_hf_orientation(q: QArray) -> QArray:
    """A weight QArray as the layouts store it: shape ``(N, K)``, blocks along axis 1.
    Accepts microscale's kernel orientation ``(K, N)`` with ``axis=0`` (transposes the
    leaves; packing along ``K`` is preserved) or an already ``(N, K)``, ``axis=1`` array."""
    if len(q.shape) != 2:
        raise ValueError(f"weight QArray of shape {q.shape}: expected a 2-D weight")
    if q.axis == 1:
        return q
    return _transpose(q)


def to_kernel_orientation(q: QArray) -> QArray:
    """Inverse of :func:`to_hf_orientation`: shape ``(K, N)``, blocks along axis 0. One of
    ggml's block types has rows of ``K`` bytes only (:func:`kernel_values` decodes it)."""
    if len(q.shape) != 2:
        raise ValueError(f"weight QArray of shape {q.shape}: expected a 2-D weight")
    if weight_only(q.spec):
        raise ValueError(
            f"a {q.spec.name} QArray holds ggml's rows [N, K] and cannot be transposed"
        )
    return q if q.axis == 0 else _transpose(q)


def kernel_values(q: QArray) -> jnp.ndarray:
    """The float32 kernel ``[K, N]`` a weight QArray decodes to, in either orientation (one
    of ggml's block types: its ``[N, K]`` rows, transposed)."""
    if weight_only(q.spec):
        return dequantize(q).T
    return dequantize(to_kernel_orientation(q))


def _transpose(q: QArray) -> QArray:
    def t(x):
        return x if x is None or np.ndim(x) < 2 else x.T

    bs = None if q.block_shape is None else tuple(reversed(q.block_shape))
    return QArray(
        t(q.data), t(q.scales), q.global_scale, q.spec, 1 - q.axis, tuple(reversed(q.shape)), bs
    )


def row_blocks(q: QArray) -> QArray:
    """HF-oriented QArray with one scale per ``1 x block`` row segment (the layouts'
    ``[N, K/block]`` scale array). 2-D tiles (training's 16x16 weights) are expanded by
    repeating each tile's scale over its rows: the stored values are unchanged."""
    if q.block_shape is None or q.block_shape[0] == 1:
        return q
    rows = q.block_shape[0]
    assert q.scales is not None  # a block-scaled QArray has scales
    sc = jnp.repeat(q.scales, rows, axis=0)[: q.data.shape[0]]
    return QArray(q.data, sc, q.global_scale, q.spec, q.axis, q.shape, (1, q.block_shape[1]))


# ---------------------------------------------------------------------- resolution

LayerFormats = str | PrecisionRules | Mapping[str, Any] | None


def _as_layer_quant(where: str, v: Any, activations: bool) -> LayerQuant:
    if isinstance(v, LayerQuant):
        return v
    if isinstance(v, FormatSpec):
        v = v.name
    if isinstance(v, str):
        spec = get_weight_format(v)
        return LayerQuant(weights=v, inputs=v if activations and spec.quantized else None)
    if isinstance(v, Mapping):
        unknown = sorted(set(v) - {"weights", "inputs"})
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {unknown}; expected 'weights' and optionally 'inputs'"
            )
        return LayerQuant(**v)
    raise TypeError(
        f"{where}: {v!r} ({type(v).__name__}): expected a format name, a "
        "LayerQuant or {'weights': fmt, 'inputs': fmt}"
    )


def resolve_layers(
    cfg: ModelConfig, layer_formats: LayerFormats = None, *, activations: bool = False
) -> dict[str, LayerQuant]:
    """{linear path: LayerQuant} for every linear layer of ``cfg``'s model.

    ``layer_formats``:
      * None — NVFP4 everywhere; a format name — that format everywhere;
      * a ``PrecisionRules`` — each layer's recipe's forward formats (``fprop_w`` for the
        weights, ``fprop_x`` for the inputs);
      * a mapping {path: format name | LayerQuant | {"weights", "inputs"}} with microscale
        paths (``layers.0.attn.q_proj``) or HF module names; layers it omits stay bf16.

    ``activations``: whether inputs are quantized too (format names and rules then give
    the inputs the layer's activation format); False gives weight-only layers. An
    explicit ``LayerQuant`` is taken as is. Fused groups (q/k/v, gate/up) must agree.
    """
    paths = linear_paths(cfg)
    out: dict[str, LayerQuant] = {}
    if layer_formats is None or isinstance(layer_formats, (str, FormatSpec)):
        lq = _as_layer_quant("layer_formats", layer_formats or "nvfp4", activations)
        out = dict.fromkeys(paths, lq)
    elif isinstance(layer_formats, PrecisionRules):
        for p in paths:
            recipe = layer_formats.resolve(p)
            if recipe is None:
                out[p] = LayerQuant()
                continue
            r = get_recipe(recipe)
            w, x = r.fprop_w.spec, r.fprop_x.spec
            out[p] = LayerQuant(
                weights=w.name,
                inputs=x.name if activations and x.quantized and w.quantized else None,
            )
    elif isinstance(layer_formats, Mapping):
        known = set(paths)
        for key, v in layer_formats.items():
            p = key
            if p not in known:
                try:
                    p = ms_module(key)
                except ValueError:
                    p = None
            if p not in known:
                raise ValueError(
                    f"layer_formats: {key!r} is not a linear layer of this model; "
                    f"expected paths like {paths[0]!r} (or HF module names)"
                )
            out[p] = _as_layer_quant(f"layer_formats[{key!r}]", v, activations)
        for p in paths:
            out.setdefault(p, LayerQuant())
    else:
        raise TypeError(
            f"layer_formats={layer_formats!r}: expected None, a format name, a "
            "PrecisionRules or a {path: format} mapping"
        )
    for group in fused_groups(cfg):
        first = out[group[0]]
        for p in group[1:]:
            if out[p] != first:
                raise ValueError(
                    f"{group[0]} ({first}) and {p} ({out[p]}) are fused into one GEMM by "
                    "vLLM / TensorRT-LLM and must share one format; give the group "
                    f"{list(group)} the same format"
                )
    return {p: out[p] for p in paths}


# ---------------------------------------------------------------------- quantization


def _group_amax(kernels: list) -> jnp.ndarray:
    return tensor_amax(jnp.stack([tensor_amax(k) for k in kernels]))


def quantize_linear_weights(
    params: Mapping[str, Any], cfg: ModelConfig, layers: Mapping[str, LayerQuant]
) -> dict[str, Any]:
    """Quantize every linear kernel as ``layers`` says, sharing tensor scales in fused groups.

    ``params``: flat {parameter path: array} (``layers.0.attn.q_proj.kernel`` -> ``[K, N]``
    float array, or an already quantized ``QArray`` — e.g. from PTQ — in kernel or HF
    orientation). Returns {linear path: QArray in kernel orientation ``(K, N)``, blocks along
    axis 0} for quantized layers (one of ggml's block types: its ``(N, K)`` rows) and
    {linear path: float kernel} for bf16 layers.
    Pre-quantized groups are checked: same format, and one global scale per group.
    """
    out: dict[str, Any] = {}
    for group in fused_groups(cfg):
        lq = layers[group[0]]
        spec = lq.weight_spec
        ws = [params[f"{p}.kernel"] for p in group]
        given = [isinstance(w, QArray) for w in ws]
        if any(given) and not all(given):
            raise ValueError(
                f"fused group {list(group)} mixes quantized (QArray) and float "
                "kernels; pass all of them quantized or all float"
            )
        if all(given):
            # ggml's block types stay as given: their bytes hold [N, K] rows only
            qs = [w if weight_only(w.spec) else to_kernel_orientation(w) for w in ws]
            for p, q in zip(group, qs, strict=True):
                if q.spec.name != spec.name:
                    raise ValueError(
                        f"{p}: the given QArray is {q.spec.name!r} but the layer's "
                        f"format is {spec.name!r}"
                    )
            if spec.has_global_scale:
                g = [np.float32(np.asarray(q.global_scale)) for q in qs]
                if len(set(g)) > 1:
                    raise ValueError(
                        f"fused group {list(group)} has different global scales {g}; quantize "
                        "its members with the group's amax (quantize(w, fmt, amax=max amax)) "
                        "so vLLM / TensorRT-LLM can fuse them"
                    )
            out.update(zip(group, qs, strict=True))
            continue
        if not spec.quantized:
            out.update(zip(group, ws, strict=True))
            continue
        if weight_only(spec):  # ggml's plain encoder on the [N, K] rows
            out.update(
                (p, ggml_qarray(np.asarray(w, np.float32).T, spec))
                for p, w in zip(group, ws, strict=True)
            )
            continue
        amax = _group_amax(ws) if spec.has_tensor_scale else None
        for p, w in zip(group, ws, strict=True):
            out[p] = quantize(jnp.asarray(w, jnp.float32), spec, axis=0, amax=amax)
    return out


def input_decode_scales(
    cfg: ModelConfig, layers: Mapping[str, LayerQuant], input_amax: Mapping[str, Any] | None
) -> dict[str, np.float32]:
    """Static activation decode scales {linear path: float32} for layers whose input format
    has a tensor scale, from calibrated ``input_amax`` (shared within fused groups).
    A layer that needs one and has no amax raises, naming it."""
    out: dict[str, np.float32] = {}
    amax = dict(input_amax or {})
    for key in list(amax):
        if key not in layers:
            try:
                amax[ms_module(key)] = amax.pop(key)
            except ValueError:
                raise ValueError(
                    f"input_amax: {key!r} is not a linear layer of this model; "
                    f"expected paths like {next(iter(layers))!r}"
                ) from None
    for group in fused_groups(cfg):
        spec = layers[group[0]].input_spec
        if spec is None or not spec.has_tensor_scale:
            continue
        missing = [p for p in group if p not in amax]
        if missing:
            raise ValueError(
                f"{missing[0]}: its inputs are quantized to {spec.name} (W4A4/W8A8), which "
                "needs a static input scale, but input_amax has no calibrated amax for it; "
                "pass input_amax (e.g. from microscale.ptq.run.input_amax) or "
                "export weight-only (activations=False)"
            )
        vals = [float(np.asarray(amax[p])) for p in group]
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"input_amax for {list(group)} = {vals}: expected finite values >= 0")
        s = tensor_decode_scale(spec, max(vals))
        out.update(dict.fromkeys(group, s))
    return out

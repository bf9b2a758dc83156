"""compressed-tensors (vLLM's ``compressed-tensors`` quant_method): its table and its row.

Per quantized linear ``<module>``, by microscale format (:data:`CT_SCHEMES`):

===========  ========================  =====================================  ==========
weights      config group ``format``   tensors                                scale dtype
===========  ========================  =====================================  ==========
nvfp4        nvfp4-pack-quantized      weight_packed U8 [N, K/2],             F8_E4M3
                                       weight_scale [N, K/16],
                                       weight_global_scale F32 [1] = 2688/amax
mxfp4        mxfp4-pack-quantized      weight_packed U8 [N, K/2],             U8 (E8M0
                                       weight_scale [N, K/32]                 exponent)
mxfp8        mxfp8-quantized           weight F8_E4M3 [N, K], weight_scale    U8
                                       [N, K/32]
fp8_e4m3     float-quantized           weight F8_E4M3 [N, K], weight_scale    F32
                                       F32 [1] = amax/448
===========  ========================  =====================================  ==========

With quantized inputs, NVFP4 adds ``input_global_scale`` F32 [1] (``2688/amax`` of the
calibrated input, the *encode* direction like ``weight_global_scale``) and FP8 adds
``input_scale`` F32 [1] (``amax/448``, decode direction); MX inputs are dynamic (no tensor).

``config.json``'s ``quantization_config``::

    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"
                                                     | "mixed-precision" | ...,
     "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"] or [module names],
                                   "weights": {QuantizationArgs}, "input_activations":
                                   {QuantizationArgs} | null, "format": ...}, ...},
     "ignore": ["lm_head", "model.embed_tokens", <bf16 linears>], ...}

One config group per distinct (weight format, input format) pair; a single group covering
every linear targets ``"Linear"``, otherwise groups list their modules by name. Read back,
groups are matched against module names (``"Linear"``, exact names, ``"re:"`` regexes;
``ignore`` wins). :data:`COMPRESSED_TENSORS` is the layout's
:class:`~microscale.export.hfquant.HFQuant` row.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from microscale.export import layouts as L
from microscale.export.hf import hf_module, linear_paths
from microscale.export.hfquant import CheckpointError, HFQuant
from microscale.formats import get_format
from microscale.model import ModelConfig

__all__ = [
    "COMPRESSED_TENSORS",
    "CT_SCHEMES",
    "CTScheme",
    "ct_format_of",
    "ct_input_format_of",
    "ct_scheme",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CTScheme:
    """compressed-tensors vocabulary for one microscale format."""

    # The config group's ``format`` (a compressed-tensors CompressionFormat value).
    format: str
    # QuantizationArgs JSON of weights in this format.
    weights: dict[str, Any]
    # QuantizationArgs JSON of input activations in this format.
    inputs: dict[str, Any]
    # safetensors dtype the block scales are stored as, when it differs from the
    # QArray's (E8M0 scales are stored as their raw exponent byte, U8).
    scale_storage: str | None = None


_F = dict(type="float", symmetric=True)
CT_SCHEMES: dict[str, CTScheme] = {
    "nvfp4": CTScheme(
        format="nvfp4-pack-quantized",
        weights=dict(
            num_bits=4,
            **_F,
            group_size=16,
            strategy="tensor_group",
            dynamic=False,
            scale_dtype="torch.float8_e4m3fn",
        ),
        inputs=dict(
            num_bits=4,
            **_F,
            group_size=16,
            strategy="tensor_group",
            dynamic="local",
            scale_dtype="torch.float8_e4m3fn",
            observer="static_minmax",
        ),
    ),
    "mxfp4": CTScheme(
        format="mxfp4-pack-quantized",
        weights=dict(
            num_bits=4,
            **_F,
            group_size=32,
            strategy="group",
            dynamic=False,
            scale_dtype="torch.uint8",
        ),
        inputs=dict(
            num_bits=4,
            **_F,
            group_size=32,
            strategy="group",
            dynamic=True,
            scale_dtype="torch.uint8",
        ),
        scale_storage="U8",
    ),
    "mxfp8": CTScheme(
        format="mxfp8-quantized",
        weights=dict(
            num_bits=8,
            **_F,
            group_size=32,
            strategy="group",
            dynamic=False,
            scale_dtype="torch.uint8",
        ),
        inputs=dict(
            num_bits=8,
            **_F,
            group_size=32,
            strategy="group",
            dynamic=True,
            scale_dtype="torch.uint8",
        ),
        scale_storage="U8",
    ),
    "fp8_e4m3": CTScheme(
        format="float-quantized",
        weights=dict(num_bits=8, **_F, group_size=None, strategy="tensor", dynamic=False),
        inputs=dict(
            num_bits=8,
            **_F,
            group_size=None,
            strategy="tensor",
            dynamic=False,
            observer="static_minmax",
        ),
    ),
}


def ct_scheme(fmt: str) -> CTScheme:
    if fmt not in CT_SCHEMES:
        raise ValueError(
            f"format {fmt!r} has no compressed-tensors scheme; expected one of "
            f"{sorted(CT_SCHEMES)} (or bf16 for an unquantized layer)"
        )
    return CT_SCHEMES[fmt]


_CT_KEY = ("num_bits", "type", "group_size", "strategy")


def _ct_match(args: Mapping[str, Any], role: str) -> str | None:
    """The format whose ``role`` ("weights" / "inputs") QuantizationArgs agree with
    ``args`` on :data:`_CT_KEY` (unique per role), or None."""
    key = tuple(args.get(k) for k in _CT_KEY)
    for name, s in CT_SCHEMES.items():
        if key == tuple(getattr(s, role)[k] for k in _CT_KEY):
            return name
    return None


def ct_format_of(weights: Mapping[str, Any], where: str) -> str:
    """microscale format of a compressed-tensors weights QuantizationArgs dict."""
    name = _ct_match(weights, "weights")
    if name is not None and weights.get("symmetric", True) is True:
        return name
    raise ValueError(
        f"{where}: compressed-tensors weights {dict(weights)!r} match no format "
        "microscale can read; expected one of "
        + "; ".join(
            f"{n}: num_bits={s.weights['num_bits']} type=float "
            f"group_size={s.weights['group_size']} "
            f"strategy={s.weights['strategy']}"
            for n, s in CT_SCHEMES.items()
        )
    )


def ct_input_format_of(inputs: Mapping[str, Any], where: str) -> str:
    """microscale format of a compressed-tensors input_activations QuantizationArgs dict."""
    name = _ct_match(inputs, "inputs")
    if name is None:
        raise ValueError(
            f"{where}: input activations {dict(inputs)!r} match no format "
            "microscale can emulate (expected NVFP4 tensor_group 16, MX group 32 "
            "or FP8 per-tensor)"
        )
    return name


def _config(layers: Mapping[str, L.LayerQuant], ignore: list[str]) -> dict[str, Any]:
    kinds: dict[L.LayerQuant, list[str]] = {}
    for p, lq in layers.items():
        if lq.quantized:
            kinds.setdefault(lq, []).append(hf_module(p))
    groups = {}
    every = len(kinds) == 1 and all(lq.quantized for lq in layers.values())
    for i, (lq, mods) in enumerate(kinds.items()):
        scheme = ct_scheme(lq.weights)
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if every else mods,
            "weights": dict(scheme.weights),
            "input_activations": None if lq.inputs is None else dict(ct_scheme(lq.inputs).inputs),
            "output_activations": None,
            "format": scheme.format,
        }
    fmts = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": fmts.pop() if len(fmts) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def _matches(name: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def _layers(
    qc: dict[str, Any], cfg: ModelConfig
) -> tuple[dict[str, L.LayerQuant], dict[str, bool]]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config.config_groups: expected a non-empty object")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise CheckpointError(
            f"quantization_config.quantization_status="
            f"{qc.get('quantization_status')!r}: only 'compressed' "
            "checkpoints hold packed weights"
        )
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise CheckpointError("quantization_config.ignore: expected a list of strings")
    top = qc.get("format")
    parsed = []
    for gname, g in groups.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(g, dict) or not isinstance(g.get("targets"), list):
            raise CheckpointError(f"{where}: expected an object with a 'targets' list")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise CheckpointError(f"{where}.weights: expected QuantizationArgs, got {w!r}")
        wf = ct_format_of(w, f"{where}.weights")
        fmt = g.get("format") or top
        if fmt != CT_SCHEMES[wf].format:
            raise CheckpointError(
                f"{where}: format {fmt!r} does not hold {wf} weights; "
                f"expected {CT_SCHEMES[wf].format!r}"
            )
        inp = g.get("input_activations")
        inf, static = None, False
        if inp:
            if not isinstance(inp, dict):
                raise CheckpointError(
                    f"{where}.input_activations: expected QuantizationArgs or null, got {inp!r}"
                )
            inf = ct_input_format_of(inp, f"{where}.input_activations")
            static = get_format(inf).has_tensor_scale and inp.get("dynamic") in (False, "local")
        parsed.append((g["targets"], L.LayerQuant(weights=wf, inputs=inf), static))
    layers, static_in = {}, {}
    for p in linear_paths(cfg):
        name = hf_module(p)
        layers[p], static_in[p] = L.LayerQuant(), False
        if any(_matches(name, t) for t in ignore):
            continue
        for targets, lq, static in parsed:
            if any(_matches(name, t) for t in targets):
                layers[p], static_in[p] = lq, static
                break
    return layers, static_in


COMPRESSED_TENSORS = HFQuant(
    name="compressed-tensors",
    description="an HF folder in vLLM's compressed-tensors layout",
    packed_data="weight_packed",
    scalar=(1,),
    scale_storage=lambda fmt: ct_scheme(fmt).scale_storage,
    check=lambda lq: None,
    global_scale="weight_global_scale",
    global_encode=True,
    input_global_scale="input_global_scale",
    input_global_encode=True,
    files=lambda layers, ignore: (_config(layers, ignore), {}),
    parse=lambda path, cfg_json, cfg: _layers(cfg_json["quantization_config"], cfg),
)

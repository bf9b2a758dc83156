"""NVIDIA ModelOpt's layout (TensorRT-LLM, vLLM ``modelopt``): its table and its row.

Per quantized linear ``<module>``: ``weight`` (packed U8 or F8_E4M3), ``weight_scale``
(F8_E4M3 blocks, or an F32 scalar for FP8), ``weight_scale_2`` = amax/2688 (NVFP4's global
scale in the *decode* direction), ``input_scale`` (decode direction) as 0-d F32 tensors;
per-layer ``quant_algo`` (:data:`MODELOPT_ALGOS`): ``NVFP4`` (W4A4), ``W4A16_NVFP4`` or
``FP8``.

``hf_quant_config.json`` = ``{"producer": {...}, "quantization": Q}`` and
``config.json["quantization_config"] = {"quant_method": "modelopt", **Q}``::

    Q = {"quant_algo": "NVFP4" | "W4A16_NVFP4" | "FP8", "group_size": 16,
         "kv_cache_quant_algo": null, "exclude_modules": [...]}                (one algo)
    Q = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": null,
         "quantized_layers": {module: {"quant_algo": ..., "group_size": ...}},
         "exclude_modules": [...]}                                          (several)

Read back from ``hf_quant_config.json`` when present (else ``quantization_config``):
``quant_algo`` / ``quantized_layers`` / ``exclude_modules`` (names or ``fnmatch``
patterns). :data:`MODELOPT` is the layout's :class:`~microscale.export.hfquant.HFQuant`
row.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from microscale import __version__
from microscale.export import layouts as L
from microscale.export.hf import hf_module, linear_paths
from microscale.export.hfquant import CheckpointError, HFQuant, load_json
from microscale.formats import get_format
from microscale.model import ModelConfig

__all__ = ["MODELOPT", "MODELOPT_ALGOS", "modelopt_algo"]

# ModelOpt quant_algo -> (weight format, input format or None); its group_size field.
MODELOPT_ALGOS: dict[str, tuple[str, str | None]] = {
    "NVFP4": ("nvfp4", "nvfp4"),
    "W4A16_NVFP4": ("nvfp4", None),
    "FP8": ("fp8_e4m3", "fp8_e4m3"),
}


def modelopt_algo(lq: L.LayerQuant) -> dict[str, Any]:
    """The ``quantized_layers`` entry of a layer (``{"quant_algo": ..., "group_size"}``)."""
    for algo, (w, i) in MODELOPT_ALGOS.items():
        if (lq.weights, lq.inputs) == (w, i):
            bs = lq.weight_spec.block_size
            return {"quant_algo": algo} if bs is None else {"quant_algo": algo, "group_size": bs}
    supported = ", ".join(f"{w}+{i or 'weight-only'}" for w, i in MODELOPT_ALGOS.values())
    raise ValueError(
        f"the ModelOpt layout has no quant_algo for weights {lq.weights!r} with "
        f"inputs {lq.inputs!r}; it supports {supported} (use the "
        "compressed-tensors layout for other formats)"
    )


def _config(layers: Mapping[str, L.LayerQuant], ignore: list[str]) -> dict[str, Any]:
    per = {hf_module(p): modelopt_algo(lq) for p, lq in layers.items() if lq.quantized}
    algos = {json.dumps(a, sort_keys=True) for a in per.values()}
    if len(algos) == 1:
        return {**json.loads(algos.pop()), "kv_cache_quant_algo": None, "exclude_modules": ignore}
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": per,
        "exclude_modules": ignore,
    }


def _quant(path: Path, cfg_json: dict[str, Any]) -> dict[str, Any]:
    if (path / "hf_quant_config.json").is_file():
        obj = load_json(path / "hf_quant_config.json")
        q = obj.get("quantization") if isinstance(obj, dict) else None
        if not isinstance(q, dict):
            raise CheckpointError("hf_quant_config.json: expected {'quantization': {...}}")
        return q
    return cfg_json["quantization_config"]


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(
        name == p or fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns
    )


def _layers(q: dict[str, Any], cfg: ModelConfig) -> tuple[dict[str, L.LayerQuant], dict[str, bool]]:
    if q.get("kv_cache_quant_algo") not in (None, "NONE"):
        raise CheckpointError(
            f"kv_cache_quant_algo={q.get('kv_cache_quant_algo')!r}: "
            "quantized KV caches are not supported"
        )
    exclude = q.get("exclude_modules") or []

    def algo(entry: Any, where: str) -> L.LayerQuant:
        a = entry.get("quant_algo") if isinstance(entry, dict) else None
        if a not in MODELOPT_ALGOS:
            raise CheckpointError(
                f"{where}: quant_algo={a!r}; microscale reads {sorted(MODELOPT_ALGOS)}"
            )
        w, i = MODELOPT_ALGOS[a]
        bs = get_format(w).block_size
        gs = entry.get("group_size", bs)
        if gs != bs:
            raise CheckpointError(f"{where}: group_size={gs}; {a} uses blocks of {bs}")
        return L.LayerQuant(weights=w, inputs=i)

    layers = {}
    if q.get("quant_algo") == "MIXED_PRECISION":
        ql = q.get("quantized_layers")
        if not isinstance(ql, dict):
            raise CheckpointError("MIXED_PRECISION needs a 'quantized_layers' object")
        known = {hf_module(p) for p in linear_paths(cfg)}
        for name in ql:
            if name not in known:
                raise CheckpointError(
                    f"quantized_layers: {name!r} is not a linear layer of this model"
                )
        for p in linear_paths(cfg):
            name = hf_module(p)
            layers[p] = (
                algo(ql[name], f"quantized_layers[{name!r}]") if name in ql else L.LayerQuant()
            )
    else:
        lq = algo(q, "quant_algo")
        for p in linear_paths(cfg):
            layers[p] = L.LayerQuant() if _excluded(hf_module(p), exclude) else lq
    return layers, {p: lq.inputs is not None for p, lq in layers.items()}


def _files(
    layers: Mapping[str, L.LayerQuant], ignore: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    q = _config(layers, ignore)
    hq = {"producer": {"name": "microscale", "version": __version__}, "quantization": q}
    return {"quant_method": "modelopt", **q}, {"hf_quant_config.json": hq}


MODELOPT = HFQuant(
    name="modelopt",
    description="an HF folder in NVIDIA ModelOpt's layout",
    packed_data="weight",
    scalar=(),
    scale_storage=lambda fmt: None,
    check=modelopt_algo,
    global_scale="weight_scale_2",
    global_encode=False,
    input_global_scale="input_scale",
    input_global_encode=False,
    files=_files,
    parse=lambda path, cfg_json, cfg: _layers(_quant(path, cfg_json), cfg),
)

"""The HF-style quantized layouts, one :class:`HFQuant` row each: compressed-tensors, ModelOpt.

Both store a Llama as an HF folder (``config.json`` + safetensors); they differ in how a
quantized linear's tensors are named and in which direction their tensor scales run
(the per-format tables are in :mod:`microscale.export.layouts`), and in how the
quantization is described (``config.json``'s ``quantization_config``, ModelOpt's
``hf_quant_config.json``). :func:`~microscale.export.writer.export_checkpoint` and
:func:`~microscale.export.reader.read_checkpoint` take all of that from the row, so a new
HF-style layout is one row here (and one in :mod:`microscale.export.registry`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from microscale import __version__
from microscale.export import layouts as L
from microscale.export.hf import hf_module, linear_paths
from microscale.formats import get_format
from microscale.model import ModelConfig

__all__ = ["HF_QUANT", "CheckpointError", "HFQuant", "hf_quant", "load_json", "quant_method"]


class CheckpointError(ValueError):
    """A checkpoint folder is inconsistent with its config (names the tensor / field)."""


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON file ({e})") from None


# ---------------------------------------------------------------------- compressed-tensors


def _ct_config(layers: Mapping[str, L.LayerQuant], ignore: list[str]) -> dict[str, Any]:
    kinds: dict[L.LayerQuant, list[str]] = {}
    for p, lq in layers.items():
        if lq.quantized:
            kinds.setdefault(lq, []).append(hf_module(p))
    groups = {}
    every = len(kinds) == 1 and all(lq.quantized for lq in layers.values())
    for i, (lq, mods) in enumerate(kinds.items()):
        scheme = L.ct_scheme(lq.weights)
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if every else mods,
            "weights": dict(scheme.weights),
            "input_activations": None if lq.inputs is None else dict(L.ct_scheme(lq.inputs).inputs),
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


def _ct_matches(name: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def _ct_layers(
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
        wf = L.ct_format_of(w, f"{where}.weights")
        fmt = g.get("format") or top
        if fmt != L.CT_SCHEMES[wf].format:
            raise CheckpointError(
                f"{where}: format {fmt!r} does not hold {wf} weights; "
                f"expected {L.CT_SCHEMES[wf].format!r}"
            )
        inp = g.get("input_activations")
        inf, static = None, False
        if inp:
            if not isinstance(inp, dict):
                raise CheckpointError(
                    f"{where}.input_activations: expected QuantizationArgs or null, got {inp!r}"
                )
            inf = L.ct_input_format_of(inp, f"{where}.input_activations")
            static = get_format(inf).has_tensor_scale and inp.get("dynamic") in (False, "local")
        parsed.append((g["targets"], L.LayerQuant(weights=wf, inputs=inf), static))
    layers, static_in = {}, {}
    for p in linear_paths(cfg):
        name = hf_module(p)
        layers[p], static_in[p] = L.LayerQuant(), False
        if any(_ct_matches(name, t) for t in ignore):
            continue
        for targets, lq, static in parsed:
            if any(_ct_matches(name, t) for t in targets):
                layers[p], static_in[p] = lq, static
                break
    return layers, static_in


# ---------------------------------------------------------------------- ModelOpt


def _modelopt_config(layers: Mapping[str, L.LayerQuant], ignore: list[str]) -> dict[str, Any]:
    per = {hf_module(p): L.modelopt_algo(lq) for p, lq in layers.items() if lq.quantized}
    algos = {json.dumps(a, sort_keys=True) for a in per.values()}
    if len(algos) == 1:
        return {**json.loads(algos.pop()), "kv_cache_quant_algo": None, "exclude_modules": ignore}
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": per,
        "exclude_modules": ignore,
    }


def _modelopt_quant(path: Path, cfg_json: dict[str, Any]) -> dict[str, Any]:
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


def _modelopt_layers(
    q: dict[str, Any], cfg: ModelConfig
) -> tuple[dict[str, L.LayerQuant], dict[str, bool]]:
    if q.get("kv_cache_quant_algo") not in (None, "NONE"):
        raise CheckpointError(
            f"kv_cache_quant_algo={q.get('kv_cache_quant_algo')!r}: "
            "quantized KV caches are not supported"
        )
    exclude = q.get("exclude_modules") or []

    def algo(entry: Any, where: str) -> L.LayerQuant:
        a = entry.get("quant_algo") if isinstance(entry, dict) else None
        if a not in L.MODELOPT_ALGOS:
            raise CheckpointError(
                f"{where}: quant_algo={a!r}; microscale reads {sorted(L.MODELOPT_ALGOS)}"
            )
        w, i = L.MODELOPT_ALGOS[a]
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


def _modelopt_files(
    layers: Mapping[str, L.LayerQuant], ignore: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    q = _modelopt_config(layers, ignore)
    hq = {"producer": {"name": "microscale", "version": __version__}, "quantization": q}
    return {"quant_method": "modelopt", **q}, {"hf_quant_config.json": hq}


# ---------------------------------------------------------------------- the rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFQuant:
    """How one HF-style layout stores quantized linears (``<module>`` = ``model.layers.i.
    self_attn.q_proj`` ...) and describes them."""

    # The layout's name (its quant_method in config.json).
    name: str
    # What it is, in a few words (the registry row's description).
    description: str
    # Name of the packed (4-bit) weight data, after "<module>." (8-bit data: "weight").
    packed_data: str
    # Shape of a stored tensor scale: (1,) or () (0-d).
    scalar: tuple[int, ...]
    # scale_storage(format name) -> the dtype name block scales are stored as (None: their
    # own); raises ValueError for a format the layout cannot store.
    scale_storage: Callable[[str], str | None]
    # check(layer) raises ValueError for a weight / input combination it has no name for.
    check: Callable[[L.LayerQuant], Any]
    # Name of the weight tensor scale, after "<module>.".
    global_scale: str
    # Whether that scale is stored in the encode direction (1 / s_dec; else s_dec).
    global_encode: bool
    # Name of a static input scale of a format with a tensor scale (NVFP4), after "<module>."
    # (inputs without one, FP8: "input_scale", decode direction).
    input_global_scale: str
    # Whether that input scale is stored in the encode direction.
    input_global_encode: bool
    # files(layers, ignore) -> (config.json's quantization_config, {other file: JSON}).
    files: Callable[[Mapping[str, L.LayerQuant], list[str]], tuple[dict[str, Any], dict[str, Any]]]
    # parse(folder, config.json, model config) -> ({linear path: LayerQuant},
    # {linear path: static input scale stored}); raises ValueError / CheckpointError.
    parse: Callable[
        [Path, dict[str, Any], ModelConfig], tuple[dict[str, L.LayerQuant], dict[str, bool]]
    ]


HF_QUANT: dict[str, HFQuant] = {
    row.name: row
    for row in (
        HFQuant(
            name="compressed-tensors",
            description="an HF folder in vLLM's compressed-tensors layout",
            packed_data="weight_packed",
            scalar=(1,),
            scale_storage=lambda fmt: L.ct_scheme(fmt).scale_storage,
            check=lambda lq: None,
            global_scale="weight_global_scale",
            global_encode=True,
            input_global_scale="input_global_scale",
            input_global_encode=True,
            files=lambda layers, ignore: (_ct_config(layers, ignore), {}),
            parse=lambda path, cfg_json, cfg: _ct_layers(cfg_json["quantization_config"], cfg),
        ),
        HFQuant(
            name="modelopt",
            description="an HF folder in NVIDIA ModelOpt's layout",
            packed_data="weight",
            scalar=(),
            scale_storage=lambda fmt: None,
            check=L.modelopt_algo,
            global_scale="weight_scale_2",
            global_encode=False,
            input_global_scale="input_scale",
            input_global_encode=False,
            files=_modelopt_files,
            parse=lambda path, cfg_json, cfg: _modelopt_layers(
                _modelopt_quant(path, cfg_json), cfg
            ),
        ),
    )
}


def hf_quant(name: str) -> HFQuant:
    """The row of the HF-style quantized layout ``name``; ValueError naming the choices."""
    if name not in HF_QUANT:
        raise ValueError(f"layout={name!r}: expected one of {tuple(HF_QUANT)}")
    return HF_QUANT[name]


def quant_method(cfg_json: Any, folder: Path) -> str | None:
    """The quantization method of an HF folder with this ``config.json`` (as parsed): its
    ``quantization_config.quant_method`` ("modelopt" for a non-object one, or for none
    beside an ``hf_quant_config.json``); None when the folder is not quantized."""
    qc = cfg_json.get("quantization_config") if isinstance(cfg_json, dict) else None
    if qc is None:
        return "modelopt" if (folder / "hf_quant_config.json").is_file() else None
    return qc.get("quant_method") if isinstance(qc, dict) else "modelopt"

"""What an HF-style quantized layout is: the :class:`HFQuant` record, and the error of a
folder that disagrees with it.

The HF-style layouts store a Llama as an HF folder (``config.json`` + safetensors); they
differ in how a quantized linear's tensors are named, in which direction their tensor
scales run, and in how the quantization is described (``config.json``'s
``quantization_config``, ModelOpt's ``hf_quant_config.json``). Each is one module with its
table and its row: :mod:`microscale.export.compressed_tensors`,
:mod:`microscale.export.modelopt`; :data:`microscale.export.hflayouts.HF_QUANT` holds the
rows. :func:`~microscale.export.writer.export_checkpoint` and
:func:`~microscale.export.reader.read_checkpoint` take all of that from the row, so a new
HF-style layout is one module with its row (listed in ``HF_QUANT``, and one row in
:mod:`microscale.export.registry`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from microscale.export import layouts as L
from microscale.model import ModelConfig

__all__ = ["CheckpointError", "HFQuant", "load_json", "quant_method"]


class CheckpointError(ValueError):
    """A checkpoint folder is inconsistent with its config (names the tensor / field)."""


def load_json(path: Path) -> Any:
    """A JSON file's content; a missing file or bad JSON raises an error naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON file ({e})") from None


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


def quant_method(cfg_json: Any, folder: Path) -> str | None:
    """The quantization method of an HF folder with this ``config.json`` (as parsed): its
    ``quantization_config.quant_method`` ("modelopt" for a non-object one, or for none
    beside an ``hf_quant_config.json``); None when the folder is not quantized."""
    qc = cfg_json.get("quantization_config") if isinstance(cfg_json, dict) else None
    if qc is None:
        return "modelopt" if (folder / "hf_quant_config.json").is_file() else None
    return qc.get("quant_method") if isinstance(qc, dict) else "modelopt"

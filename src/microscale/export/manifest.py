"""microscale's own checkpoint layout: ``model.safetensors`` + ``manifest.json``.

What ``microscale quantize layout=microscale`` writes (and what it falls back to when an
export to another layout fails): PTQ's quantized weights exactly as PTQ holds them, with
what only PTQ knows (each layer's amax and scale multiplier). ``manifest.json``
describes every tensor:

* per quantized linear ``<path>.weight`` (the QArray's data: packed uint8 ``[out, in/2]``
  for 4-bit formats, the 8-bit elements' raw bytes ``[out, in]`` as uint8),
  ``<path>.weight_scale`` (block scales' raw bytes ``[out, in/block]`` as uint8, or the
  float32 per-tensor scale) and ``<path>.weight_global_scale`` (float32 ``[1]``, decode
  direction ``amax/2688``);
* ``<path>.input_amax`` (float32 ``[1]``) for W4A4;
* other parameters float32 under their paths.

:func:`read_manifest` reads it back into QArrays; :func:`manifest_params` decodes it to
float kernels. The layout is the ``"microscale"`` row of :mod:`microscale.export.registry`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from microscale.export.tensorfile import TensorStore, write_safetensors
from microscale.files import atomic_write_json, read_json
from microscale.formats import QArray, dequantize, get_format, get_weight_format

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "manifest_params", "read_manifest", "write_manifest"]

MANIFEST = "manifest.json"  # the file that marks the layout
MANIFEST_FORMAT = "microscale-ptq"  # its "format" field (and the safetensors metadata's)
_MANIFEST_VERSION = 1


def _raw(a) -> tuple[np.ndarray, str]:
    """An array as safetensors-storable numpy plus its logical dtype name."""
    a = np.asarray(a)
    name = str(a.dtype)
    if a.dtype.itemsize == 1 and a.dtype not in (np.uint8, np.int8):
        return a.view(np.uint8), name
    if a.dtype == ml_dtypes.bfloat16:
        return a.view(np.uint16), name
    return a, name


def write_manifest(
    out_dir: str | os.PathLike,
    *,
    params: Mapping[str, Any],
    weights: Mapping[str, Any],
    activations: bool,
    input_amax: Mapping[str, float] | None,
    rules: dict[str, Any],
) -> dict[str, Any]:
    """Write the layout into ``out_dir`` (created); returns a description.

    ``params``: every parameter, flat (the kernels of ``weights`` are left out);
    ``weights``: {linear path: PTQ's weight} with ``qarray`` (``[out, in]``), ``format``,
    ``amax`` and ``scale_multiplier``; ``activations``: inputs quantized too (each
    quantized layer then stores ``input_amax[path]``); ``rules``: the PrecisionRules dict.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    layers: dict[str, Any] = {}
    kernel_names = {f"{p}.kernel" for p in weights}
    for name, v in params.items():
        if name not in kernel_names:
            tensors[name] = np.asarray(v, np.float32)
    for p, w in weights.items():
        q: QArray = w.qarray
        entry: dict[str, Any] = {
            "format": w.format,
            "shape": list(q.shape),
            "layout": "out_in",
            "axis": -1,
            "block_shape": None if q.block_shape is None else list(q.block_shape),
            "amax": w.amax,
            "scale_multiplier": w.scale_multiplier,
            "tensors": {},
        }
        for field, key in (
            ("data", "weight"),
            ("scales", "weight_scale"),
            ("global_scale", "weight_global_scale"),
        ):
            arr = getattr(q, field)
            if arr is None:
                continue
            raw, dtype = _raw(arr)
            raw = raw.reshape(1) if raw.ndim == 0 else raw
            tensors[f"{p}.{key}"] = np.ascontiguousarray(raw)
            entry["tensors"][field] = {"name": f"{p}.{key}", "dtype": dtype}
        if activations and get_format(w.format).quantized:
            assert input_amax is not None  # activations=True comes with input_amax
            tensors[f"{p}.input_amax"] = np.asarray([input_amax[p]], np.float32)
            entry["input_amax"] = input_amax[p]
        layers[p] = entry
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": MANIFEST_FORMAT})
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": _MANIFEST_VERSION,
        "activations": activations,
        "layers": layers,
        "params": sorted(n for n in tensors if not any(n.startswith(p + ".") for p in weights)),
        "rules": rules,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return {"layout": MANIFEST_FORMAT, "path": str(out), "files": ["model.safetensors", MANIFEST]}


def read_manifest(
    path: str | os.PathLike,
) -> tuple[dict[str, QArray], dict[str, Any], dict[str, Any]]:
    """``({layer path: QArray [out, in]}, {param path: float32 array}, manifest)``."""
    path = Path(path)
    manifest = read_json(path / MANIFEST, what="PTQ manifest")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(
            f"{str(path)!r}: manifest format {manifest.get('format')!r}; expected "
            f"{MANIFEST_FORMAT!r}"
        )
    store = TensorStore(path / "model.safetensors")
    qs = {}
    for p, e in manifest["layers"].items():
        spec = get_weight_format(e["format"])
        leaves: dict[str, Any] = {}
        for field in ("data", "scales", "global_scale"):
            t = e["tensors"].get(field)
            if t is None:
                leaves[field] = None
                continue
            arr = store.get(t["name"])
            dt = np.dtype(getattr(ml_dtypes, t["dtype"], t["dtype"]))
            arr = arr.view(dt) if arr.dtype != dt else arr
            if field == "global_scale" or (field == "scales" and spec.block_size is None):
                arr = arr.reshape(())
            leaves[field] = jax.numpy.asarray(arr)
        bs = None if e["block_shape"] is None else tuple(e["block_shape"])
        qs[p] = QArray(
            leaves["data"], leaves["scales"], leaves["global_scale"], spec, 1, tuple(e["shape"]), bs
        )
    params = {n: np.array(store.get(n)) for n in manifest["params"]}
    return qs, params, manifest


def manifest_params(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], None]:
    """``({parameter path: float32 array}, None)``: every weight decoded, kernels
    ``[in, out]`` (the manifest holds no model config, hence None)."""
    qs, params, _ = read_manifest(path)
    flat = {k: np.asarray(v, np.float32) for k, v in params.items()}
    for p, q in qs.items():  # stored [out, in]; kernels are [in, out]
        flat[f"{p}.kernel"] = np.asarray(dequantize(q, np.float32)).T
    return flat, None

"""Readers and writers of deployment layouts: compressed-tensors, ModelOpt, plain HF.

Export a model (or PTQ's packed weights) in the layouts vLLM and TensorRT-LLM load::

    from microscale.export import export_checkpoint, read_checkpoint

    export_checkpoint(model, "out/nvfp4", layout="compressed-tensors")      # W4A16 NVFP4
    export_checkpoint(model, "out/mixed", layer_formats={"layers.0.mlp.down_proj": "fp8_e4m3",
                      ...}, layout="modelopt", input_amax=amax)             # W4A4 + W8A8
    ck = read_checkpoint("out/nvfp4")          # packed QArrays, bytes as stored
    model, cfg = import_model("meta-llama-like-folder")      # an HF folder -> Transformer

The NVFP4 tensors of one linear ``y = x W^T`` (``W`` is ``[N, K]``, blocks of 16 along
``K``), as both layouts store them:

* packed codes ``U8 [N, K/2]``: E2M1 code ``c = sign << 3 | index`` (magnitudes 0, 0.5, 1,
  1.5, 2, 3, 4, 6 by index), element ``2i`` in the low nibble of byte ``i``:
  ``[[0, 0.5, 4, -0], [-0, 1, -6, 3]]`` packs to ``[[0x10, 0x86], [0x28, 0x5F]]``;
* block scales ``F8_E4M3 [N, K/16]``, row-major (block ``j`` of row ``r`` at ``[r, j]``);
* a float32 tensor scale: compressed-tensors' ``weight_global_scale = 2688 / amax``
  (encode direction), ModelOpt's ``weight_scale_2 = amax / 2688`` (decode direction);
* decoding: ``W[r, k] = e2m1(code[r, k]) * scale[r, k // 16] * amax / 2688``.

q/k/v and gate/up are fused by the engines, so they share one format and one global
scale (quantized with the group's amax). Each layout's per-format table is in its own
module (:mod:`microscale.export.compressed_tensors`, :mod:`microscale.export.modelopt`);
W4A4 input scales and mixed precision in :mod:`microscale.export.layouts`; the file
format and its validation in :mod:`microscale.export.tensorfile`; HF names, the config
mapping and the RoPE convention in :mod:`microscale.export.hf`; GGUF (llama.cpp) in
:mod:`microscale.export.gguf`.

Each layout (compressed-tensors, modelopt, hf, gguf, microscale's manifest) is one row of
:mod:`microscale.export.registry` with ``detect``, ``write`` and ``read``;
:func:`detect` says what a path is (a training run, a quantize output, or a layout).
Exporting a run, a quantize output or an HF folder end to end (what ``microscale export``
does) is :func:`microscale.inference.export_run.export_run`.

Safety: only JSON and safetensors are read (never pickle); names, dtypes, shapes and the
config are validated before any tensor is used, and errors name the offending tensor.
"""

from microscale.export.hf import (
    fused_groups,
    hf_config,
    hf_module,
    hf_param_name,
    linear_paths,
    model_config_from_hf,
    ms_param_name,
    param_shapes,
)
from microscale.export.hflayouts import HF_QUANT
from microscale.export.layouts import (
    LayerQuant,
    exact_reciprocal,
    input_decode_scales,
    quantize_linear_weights,
    resolve_layers,
    to_hf_orientation,
)
from microscale.export.params import check_params, flat_params
from microscale.export.reader import (
    Checkpoint,
    CheckpointError,
    build_model,
    import_model,
    read_checkpoint,
)
from microscale.export.registry import (
    KINDS,
    Kind,
    Layout,
    detect,
    get_layout,
    layout_names,
)
from microscale.export.tensorfile import SafetensorsError, TensorStore, write_safetensors
from microscale.export.writer import ExportResult, export_checkpoint

LAYOUTS = tuple(HF_QUANT)  # the HF-style quantized layouts export_checkpoint writes

# ExportResult and Kind have no caller by name: they are what export_checkpoint and detect
# return (and KINDS holds), so the API page shows them with those functions.
__all__ = [
    "KINDS",
    "LAYOUTS",
    "Checkpoint",
    "CheckpointError",
    "ExportResult",
    "Kind",
    "LayerQuant",
    "Layout",
    "SafetensorsError",
    "TensorStore",
    "detect",
    "get_layout",
    "layout_names",
    "build_model",
    "check_params",
    "exact_reciprocal",
    "export_checkpoint",
    "flat_params",
    "fused_groups",
    "hf_config",
    "hf_module",
    "hf_param_name",
    "import_model",
    "input_decode_scales",
    "linear_paths",
    "model_config_from_hf",
    "ms_param_name",
    "param_shapes",
    "quantize_linear_weights",
    "read_checkpoint",
    "resolve_layers",
    "to_hf_orientation",
    "write_safetensors",
]

"""``export_checkpoint``: a microscale model as an HF-style folder vLLM / TensorRT-LLM load.

Output folder::

    config.json                     LlamaForCausalLM fields + "quantization_config"
    model.safetensors               (or model-0000k-of-0000K.safetensors + index above
                                    ``shard_bytes``; a layer's tensors share a shard)
    hf_quant_config.json            ModelOpt layout only
    tokenizer.json, tokenizer_config.json, generation_config.json
                                    when a tokenizer is given (HF format; EOS stops)
    microscale_export.json          provenance: producer, layout, {layer: formats}
                                    (informative; readers use config.json only)

``quantization_config`` (and ModelOpt's ``hf_quant_config.json``) is written by the layout's
row (:mod:`~microscale.export.compressed_tensors`, :mod:`~microscale.export.modelopt`).

A model with no quantized layer is written as a plain HF checkpoint (no
``quantization_config``). Unquantized tensors (embeddings, norms, LM head, bf16 linears)
are stored in ``dtype``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from microscale import __version__
from microscale.data import check_vocab_fits, load_tokenizer
from microscale.export import layouts as L
from microscale.export.hf import hf_config, hf_module, hf_param_name, linear_paths
from microscale.export.hflayouts import HF_QUANT, hf_quant
from microscale.export.params import check_params, flat_params
from microscale.export.tensorfile import DTYPES, write_sharded
from microscale.export.tokenizer import write_tokenizer
from microscale.files import (
    atomic_folder,
    atomic_write_json,
    check_output_dir,
    check_replace_dir,
    lock_folder,
)
from microscale.formats import QArray
from microscale.model import ModelConfig
from microscale.outputs import ExportFolder

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ExportResult",
    "check_export_out",
    "export_checkpoint",
    "layer_tensors",
]

# Shard above 5 GB (the Hugging Face default ``max_shard_size="5GB"``).
DEFAULT_SHARD_BYTES = 5 * 10**9
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_LAYOUTS = (*HF_QUANT, "hf")  # "hf": a plain HF folder, every linear unquantized


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What ``export_checkpoint`` wrote."""

    # The output folder.
    path: Path
    # "compressed-tensors", "modelopt" or "hf".
    layout: str
    # File names written into the folder.
    files: tuple[str, ...]
    # {linear path: "nvfp4" | "nvfp4/a:nvfp4" | "bf16" | ...}.
    layers: dict[str, str]
    # Bytes of the safetensors data (all shards).
    tensor_bytes: int
    # The model config written.
    config: ModelConfig

    def describe(self) -> dict[str, Any]:
        """What a report records of the export (``quantize``'s ``checkpoint`` entry)."""
        return {"layout": self.layout, "path": str(self.path), "files": list(self.files)}


def _host(x) -> np.ndarray:
    return np.asarray(x)


def _scalar(x, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(x, np.float32).reshape(shape)


def layer_tensors(
    layout: str, module: str, q: QArray, lq: L.LayerQuant, input_scale: np.float32 | None
) -> dict[str, np.ndarray]:
    """The tensors of one quantized linear in ``layout`` (an :data:`HF_QUANT` row's name;
    ``q``: kernel or HF orientation)."""
    row = hf_quant(layout)
    q = L.row_blocks(L.to_hf_orientation(q))
    spec = q.spec
    n, k = q.shape
    if tuple(q.data.shape) != tuple(q.shape[:1]) + (q.data.shape[1],) or (
        spec.block_size is not None and k % spec.block_size
    ):
        raise ValueError(
            f"{module}: weight of shape {(n, k)} is padded to {q.data.shape}; "
            f"the input dimension must be a multiple of {spec.block_size}"
        )
    row.check(lq)  # raises for combinations the layout has no name for
    storage = row.scale_storage(spec.name)
    out: dict[str, np.ndarray] = {}
    out[f"{module}.{row.packed_data if spec.packed else 'weight'}"] = _host(q.data)
    sc = _host(q.scales)
    if spec.block_size is None:
        sc = _scalar(sc, row.scalar)
    elif storage is not None:
        sc = sc.view(DTYPES[storage])
    out[f"{module}.weight_scale"] = sc
    if spec.has_global_scale:
        g = L.exact_reciprocal(np.asarray(q.global_scale)) if row.global_encode else q.global_scale
        out[f"{module}.{row.global_scale}"] = _scalar(g, row.scalar)
    if input_scale is not None:
        assert lq.input_spec is not None  # an input scale is a quantized input's
        if lq.input_spec.has_global_scale:
            s = L.exact_reciprocal(input_scale) if row.input_global_encode else input_scale
            out[f"{module}.{row.input_global_scale}"] = _scalar(s, row.scalar)
        else:
            out[f"{module}.input_scale"] = _scalar(input_scale, row.scalar)
    return out


def _source(model: Any, config: ModelConfig | None):
    """(flat params, config, layers, input scales) from a model / params / Checkpoint."""
    from microscale.export.reader import Checkpoint

    if isinstance(model, Checkpoint):
        return (
            dict(model.params),
            config or model.config,
            dict(model.layers),
            dict(model.input_scales),
        )
    if config is None:
        config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(
            "export_checkpoint needs the ModelConfig (pass config=...) unless the "
            "model carries one (a Transformer or a Checkpoint)"
        )
    return flat_params(model), config, None, None


def export_checkpoint(
    model: Any,
    out_dir: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    layout: str = "compressed-tensors",
    layer_formats: L.LayerFormats = None,
    activations: bool | None = None,
    input_amax: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> ExportResult:
    """Write ``model`` to ``out_dir`` in ``layout`` ("compressed-tensors", "modelopt", or
    "hf": float weights only, ``layer_formats`` default "bf16").

    Args:
      model: a ``Transformer``, its params (``nnx.State``, nested or flat dict; kernels may
        be pre-quantized ``QArray``\\ s, e.g. from PTQ), or a ``Checkpoint`` from
        :func:`read_checkpoint` (re-export / layout conversion keeps its packed bytes).
      config: the ``ModelConfig`` (taken from a Transformer / Checkpoint when omitted).
      layer_formats: per-layer formats (see :func:`~microscale.export.resolve_layers`):
        None = NVFP4 everywhere, a format name, a ``PrecisionRules``, or {path: format}.
        Default for a Checkpoint: its own layers.
      activations: quantize inputs too (W4A4 / W8A8); None = True iff ``input_amax`` is
        given. NVFP4 and FP8 inputs need a calibrated ``input_amax`` per layer.
      input_amax: {linear path: max |x| of its input over calibration data}.
      tokenizer: a microscale tokenizer or tokenizer file to ship with the model.
      dtype: dtype of the unquantized tensors ("bfloat16", "float16", "float32").
      shard_bytes: above this many bytes the weights are sharded with an index.
      overwrite: replace an existing non-empty ``out_dir``.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {_LAYOUTS}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
    out = Path(out_dir)
    check_output_dir(out)
    lock = lock_folder(out).acquire()  # released at the end, after the rename into place
    try:
        return _export(
            model,
            out,
            config=config,
            layout=layout,
            layer_formats=layer_formats,
            activations=activations,
            input_amax=input_amax,
            tokenizer=tokenizer,
            dtype=dtype,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
        )
    finally:
        lock.release()


def check_export_out(out_dir: str | os.PathLike, *, overwrite: bool) -> Path:
    """Fail fast unless ``out_dir`` can take an export: a writable new or empty folder, or
    (with ``overwrite``) an earlier exported model (``config.json`` present); the rule of
    :func:`~microscale.files.check_replace_dir`, which ``quantize`` follows too."""
    return check_replace_dir(
        out_dir,
        overwrite=overwrite,
        earlier=lambda out: (out / "config.json").is_file(),
        earlier_what="an exported model (no config.json)",
    )


def _export_layers(cfg, layout, ck_layers, ck_scales, layer_formats, activations, input_amax):
    """Each linear layer's quantization and input decode scales: a re-export of a
    quantized checkpoint keeps its own unless formats or amaxes are given."""
    if activations is None:
        activations = input_amax is not None
    if layout == "hf" and layer_formats is None:
        layer_formats = "bf16"
    if ck_layers is not None and layer_formats is None and input_amax is None:
        layers, input_scales = ck_layers, ck_scales  # re-export: bytes and scales kept
    else:
        if ck_layers is not None and layer_formats is None:
            layer_formats = {p: lq.weights for p, lq in ck_layers.items()}
        layers = L.resolve_layers(cfg, layer_formats, activations=activations)
        input_scales = L.input_decode_scales(cfg, layers, input_amax)
    if layout == "hf" and any(lq.quantized for lq in layers.values()):
        shown = sorted({str(lq) for lq in layers.values() if lq.quantized})
        raise ValueError(
            f"layout='hf' stores float weights only, but layers are {shown}; "
            "choose compressed-tensors or modelopt for quantized layers"
        )
    return layers, input_scales


def _export_tensors(
    params, cfg, layers, quantized, input_scales, layout: str, np_dtype
) -> tuple[dict[str, np.ndarray], list[list[str]]]:
    """The output tensors under their HF names, and the groups of tensors of one quantized
    layer (kept in one shard)."""
    tensors: dict[str, np.ndarray] = {}
    groups: list[list[str]] = []
    for name, v in params.items():
        if name.endswith(".kernel") and name != "lm_head.kernel":
            continue
        arr = np.asarray(jnp.asarray(v, jnp.float32)).astype(np_dtype)
        tensors[hf_param_name(name, cfg.family)] = arr.T if name == "lm_head.kernel" else arr
    for p in linear_paths(cfg):
        lq, w = layers[p], quantized[p]
        mod = hf_module(p)
        if not lq.quantized:
            tensors[f"{mod}.weight"] = np.asarray(jnp.asarray(w, jnp.float32)).T.astype(np_dtype)
            continue
        layer = layer_tensors(layout, mod, w, lq, input_scales.get(p))
        tensors.update(layer)
        groups.append(list(layer))
    return tensors, groups


def _export(
    model,
    out: Path,
    *,
    config,
    layout,
    layer_formats,
    activations,
    input_amax,
    tokenizer,
    dtype,
    shard_bytes,
    overwrite,
) -> ExportResult:
    check_export_out(out, overwrite=overwrite)
    params, cfg, ck_layers, ck_scales = _source(model, config)
    check_params(params, cfg)
    tok_file = None  # a tokenizer.json path brings the HF files beside it (write_tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        tok_file, tokenizer = tokenizer, load_tokenizer(tokenizer)
    if tokenizer is not None:
        check_vocab_fits(tokenizer.vocab_size, cfg.vocab_size)
    layers, input_scales = _export_layers(
        cfg, layout, ck_layers, ck_scales, layer_formats, activations, input_amax
    )
    quantized = L.quantize_linear_weights(params, cfg, layers)

    # Everything is computed and validated before the output folder is touched.
    tensors, groups = _export_tensors(
        params, cfg, layers, quantized, input_scales, layout, _DTYPES[dtype]
    )

    ignore = ["lm_head", "model.embed_tokens"] + [
        hf_module(p) for p in linear_paths(cfg) if not layers[p].quantized
    ]
    cfg_json = hf_config(
        cfg, dtype=dtype, eos_token_id=None if tokenizer is None else tokenizer.eos_id
    )
    extra: dict[str, Any] = {}  # files beside config.json describing the quantization
    if any(lq.quantized for lq in layers.values()):
        cfg_json["quantization_config"], extra = hf_quant(layout).files(layers, ignore)

    # Written into a temporary sibling folder that replaces `out` only once complete: a
    # killed export leaves the old model (or none), never a partial one.
    files: list[str] = []
    with atomic_folder(out, overwrite=True) as tmp:
        for name, obj in extra.items():
            atomic_write_json(tmp / name, obj)
            files.append(name)
        files += write_sharded(
            tmp, tensors, shard_bytes=shard_bytes, groups=groups, metadata={"format": "pt"}
        )
        atomic_write_json(tmp / "config.json", cfg_json)
        files.append("config.json")
        if tokenizer is not None:
            files += write_tokenizer(tok_file or tokenizer, tmp, max_len=cfg.max_seq_len)
            if "generation_config.json" not in files:
                gen = {"eos_token_id": tokenizer.eos_id, "max_length": cfg.max_seq_len}
                atomic_write_json(tmp / "generation_config.json", gen)
                files.append("generation_config.json")
        marker = {
            "producer": "microscale",
            "version": __version__,
            "layout": layout,
            "layers": {p: lq.to_dict() for p, lq in layers.items()},
        }
        atomic_write_json(tmp / ExportFolder.MARKER, marker)
        files.append(ExportFolder.MARKER)
    return ExportResult(
        path=out,
        layout=layout,
        files=tuple(files),
        layers={p: str(lq) for p, lq in layers.items()},
        tensor_bytes=sum(a.nbytes for a in tensors.values()),
        config=cfg,
    )

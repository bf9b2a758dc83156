"""GGUF export: one file that llama.cpp (ggml's CPU, Metal, CUDA... backends) loads and runs.

Written with the ``gguf`` package's ``GGUFWriter`` (the container is never hand-made):
the metadata of the family's architecture (:mod:`~microscale.export.gguf.arch`: what is
refused before any work), the tokenizer (:mod:`~microscale.export.gguf.vocab`), the RoPE
scaling (:mod:`~microscale.export.gguf.rope`), and every tensor as
:mod:`~microscale.export.gguf.tensors` stores it.

The file is written to a temporary sibling and renamed when complete
(:func:`microscale.files.atomic_writer`): a killed export leaves no file that loads.

Integrity: the metadata carries ``microscale.crc32.tensors`` (the CRC-32 of every tensor's
stored bytes, as JSON) and ``microscale.crc32.header`` (the CRC-32 of the header and tensor
table), which other readers ignore; :mod:`microscale.export.gguffile` defines them and
checks a file against them (``microscale verify``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from microscale.export import layouts as L
from microscale.export.gguf.arch import (
    ARCHS,
    MS_FAMILY_KEY,
    OTHER_NAMES,
    Arch,
    check_arch,
    check_scales,
    is_norm,
    param_tensor,
    rope_order,
    tensor_name,
)
from microscale.export.gguf.rope import ROPE_FREQS, gguf_rope
from microscale.export.gguf.tensors import (
    FLOAT_TYPES,
    embed_tensor,
    float_tensor,
    gguf_embed_format,
    gguf_format,
    gguf_tensor,
)
from microscale.export.gguf.vocab import GGUFVocab, add_vocab, gguf_vocab
from microscale.export.gguffile import (
    CRC_HEADER_KEY,
    CRC_TENSORS_KEY,
    gguf_package,
    seal_gguf_header,
)
from microscale.export.params import check_params
from microscale.files import atomic_writer
from microscale.formats import QArray, dequantize
from microscale.integrity import crc32_many
from microscale.model import ModelConfig, block_param_shapes, linear_paths

__all__ = ["GGUFResult", "gguf_layer_formats", "write_gguf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFResult:
    """What :func:`write_gguf` wrote."""

    # The file.
    path: Path
    # {linear path: stored format (nvfp4, mxfp4, q8_0, bf16)}.
    layers: dict[str, str]
    # Bytes of tensor data.
    tensor_bytes: int
    # Tokenizer entry written (model, pre, tokens, merges).
    tokenizer: dict[str, Any]
    # The model config written.
    config: ModelConfig
    # The layout (the name of its registry row).
    layout: str = "gguf"
    # Stored format of the token embedding (and of an untied LM head): bf16 = ``dtype``.
    embedding: str = "bf16"

    def describe(self) -> dict[str, Any]:
        """What a report records of the export (``quantize``'s ``checkpoint`` entry)."""
        return {
            "layout": self.layout,
            "path": str(self.path),
            "files": [self.path.name],
            "tokenizer": self.tokenizer,
            "embedding": self.embedding,
        }


def gguf_layer_formats(
    cfg: ModelConfig, params: Mapping[str, Any], layer_formats: L.LayerFormats, ck_layers=None
) -> dict[str, str]:
    """{linear path: stored format}: the requested formats (default: a Checkpoint's own
    layers, else NVFP4) mapped through :func:`gguf_format`."""
    if layer_formats is None and ck_layers is not None:
        layer_formats = {p: lq.weights for p, lq in ck_layers.items()}
    layers = L.resolve_layers(cfg, layer_formats)
    return {p: gguf_format(lq.weights) for p, lq in layers.items()}


def write_gguf(
    model: Any,
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    layer_formats: L.LayerFormats = None,
    tokenizer: Any = None,
    dtype: str = "bfloat16",
    embed_format: str = "bf16",
    name: str | None = None,
    overwrite: bool = False,
) -> GGUFResult:
    """Write ``model`` as a llama.cpp GGUF file of its family's architecture (see the
    module doc: what each family gets, and what is refused before any work).

    Args:
      model: a ``Transformer``, its params (kernels may be pre-quantized QArrays, e.g. from
        PTQ: stored byte for byte when their format is native to ggml), or a
        ``Checkpoint`` from :func:`~microscale.export.read_checkpoint` (its layers' formats).
      path: the ``.gguf`` file.
      config: the ``ModelConfig`` (taken from a Transformer / Checkpoint when omitted).
      layer_formats: per-layer formats as :func:`~microscale.export.resolve_layers` takes
        them (default NVFP4; a qwen2 MLP needs another: llama.cpp's qwen2 graph drops
        NVFP4's tensor scale there); FP8 / MXFP8 become Q8_0, unquantized ones ``dtype``.
      tokenizer: a microscale tokenizer or a ``tokenizer.json`` path (required: llama.cpp
        needs a vocab); a path brings the special tokens and chat template of the
        ``tokenizer_config.json`` beside it (:func:`gguf_vocab`).
      dtype: unquantized tensors: "bfloat16" (default), "float16" or "float32".
      embed_format: the token embedding (the tied LM head) and an untied LM head: "bf16"
        (default: stored as ``dtype``), "q8_0" or "mxfp4" (8-bit formats become q8_0):
        about a half or a quarter of the BF16 bytes a decode step reads for the LM head.
      name: ``general.name`` (default: the file's stem).
      overwrite: replace an existing file.
    """
    from microscale.export.writer import _source

    gguf_package("GGUF export")  # without the gguf package: refused before any work
    if dtype not in FLOAT_TYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(FLOAT_TYPES)}")
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(
            f"--out {str(out)!r} is a folder; GGUF export writes one file (e.g. model.gguf)"
        )
    if out.exists() and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists; pass overwrite=True (CLI: overwrite=true)")
    if tokenizer is None:
        raise ValueError(
            "GGUF export needs the model's tokenizer (llama.cpp stores the vocab "
            "in the file); pass tokenizer=... (a run or a folder with "
            "tokenizer.json provides it)"
        )
    emb_fmt = gguf_embed_format(embed_format)
    vocab = gguf_vocab(tokenizer)  # an unsupported tokenizer is refused before any work
    params, cfg, ck_layers, _ = _source(model, config)
    arch = check_arch(cfg)  # what the family's llama.cpp graph cannot compute: refused first
    gguf_rope(cfg)  # a RoPE scaling llama.cpp cannot compute: refused before any work
    check_params(params, cfg)
    formats = gguf_layer_formats(cfg, params, layer_formats, ck_layers)
    check_scales(arch, formats)
    _check_finite(params)
    # Every tensor is built and validated before the file is touched.
    tensors = _tensors(params, cfg, arch, formats, emb_fmt, dtype)
    tok = _write_file(out, name or out.stem, cfg, vocab, tensors)
    return GGUFResult(
        path=out,
        layers=formats,
        tensor_bytes=sum(a.nbytes for _, a, _ in tensors),
        tokenizer=tok,
        config=cfg,
        embedding=emb_fmt,
    )


def _check_finite(params: Mapping[str, Any]) -> None:
    """ValueError naming the first tensor with a NaN or Inf (checked before quantizing:
    formats' amax may not see a NaN)."""
    for key, v in params.items():
        a = dequantize(v) if isinstance(v, QArray) else jnp.asarray(v, jnp.float32)
        if not np.isfinite(np.asarray(a)).all():
            raise ValueError(
                f"{param_tensor(key)}: non-finite weights (NaN or Inf); refusing to write a "
                "file llama.cpp would misread"
            )


_Tensor = tuple[str, np.ndarray, Any]  # (GGUF name, stored array, raw ggml type or None)


def _tensors(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    arch: Arch,
    formats: Mapping[str, str],
    emb_fmt: str,
    dtype: str,
) -> list[_Tensor]:
    """Every tensor of the file in order, as stored: the token embedding in ``emb_fmt``,
    the norms (and the family's biases, q/k norms), the linear layers in ``formats`` (with
    their ``.scale``), an untied LM head; q/k rows in ``arch``'s order."""
    # Kernels that are not already in their stored format are decoded (8-bit -> Q8_0).
    params = dict(params)
    for p, f in formats.items():
        v = params[f"{p}.kernel"]
        if isinstance(v, QArray) and v.spec.name != f:
            params[f"{p}.kernel"] = np.asarray(L.kernel_values(v))
    layers = {p: L.LayerQuant(weights=f) for p, f in formats.items()}
    quantized = L.quantize_linear_weights(params, cfg, layers)
    tensors: list[_Tensor] = [
        (
            "token_embd.weight",
            *embed_tensor(params["embed.embedding"], emb_fmt, "token_embd", dtype),
        )
    ]

    def add_float(tname, x, dt=dtype):
        tensors.append((tname, *float_tensor(x, dt)))

    others = [sub for sub in OTHER_NAMES if sub in block_param_shapes(cfg)]
    for i in range(cfg.n_layers):
        for sub in others:
            p = f"layers.{i}.{sub}"
            x = _stored_norm(cfg, p, np.asarray(jnp.asarray(params[p], jnp.float32)))
            add_float(param_tensor(p), rope_order(arch, p, x, cfg.head_dim), "float32")
    for p in linear_paths(cfg):
        tname = tensor_name(p)
        w = quantized[p]
        w = (
            L.to_hf_orientation(w)
            if isinstance(w, QArray)
            else np.asarray(jnp.asarray(w, jnp.float32)).T
        )
        w = rope_order(arch, f"{p}.kernel", w, cfg.head_dim)
        if isinstance(w, QArray):
            tensors.append((f"{tname}.weight", *gguf_tensor(w, tname)))
            if w.spec.has_global_scale:
                tensors.append(
                    (f"{tname}.scale", np.asarray(w.global_scale, np.float32).reshape(1), None)
                )
        else:
            if not np.isfinite(w).all():
                raise ValueError(f"{tname}: non-finite weights; refusing to write them")
            add_float(f"{tname}.weight", w)
    final = np.asarray(jnp.asarray(params["final_norm.scale"], jnp.float32))
    add_float("output_norm.weight", _stored_norm(cfg, "final_norm.scale", final), "float32")
    freqs = gguf_rope(cfg).freqs
    if freqs is not None:
        add_float(ROPE_FREQS, freqs, "float32")
    if not cfg.tie_embeddings:
        head = np.asarray(jnp.asarray(params["lm_head.kernel"], jnp.float32)).T
        tensors.append(("output.weight", *embed_tensor(head, emb_fmt, "output", dtype)))
    return tensors


def _stored_norm(cfg: ModelConfig, path: str, x: np.ndarray) -> np.ndarray:
    """A float32 parameter as stored: a norm weight as the factor it multiplies by
    (``norm_offset + w``, in float32 as microscale's norm computes it)."""
    if not is_norm(path) or not cfg.arch.norm_offset:
        return x
    return (np.float32(cfg.arch.norm_offset) + x).astype(np.float32)


def _write_file(
    out: Path, name: str, cfg: ModelConfig, vocab: GGUFVocab, tensors: list[_Tensor]
) -> dict[str, Any]:
    """The file: the metadata of ``cfg``'s architecture, the tokenizer, checksums,
    ``tensors``; written to a temporary sibling and renamed. Returns the tokenizer entry."""
    gguf = gguf_package("GGUF export")
    w = gguf.GGUFWriter(None, cfg.arch.gguf_arch)  # every key below: "{arch}." + key
    w.add_name(name)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    arch = ARCHS[cfg.arch.gguf_arch]
    if cfg.attn_head_dim is not None or arch.head_dim_keys:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    gguf_rope(cfg).write(w, cfg.rope_scaling)
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    if arch.swa_pattern:  # no window: one covering the context (the same attention)
        w.add_sliding_window(cfg.sliding_window or cfg.max_seq_len)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string(MS_FAMILY_KEY, cfg.family)
    tok = add_vocab(w, vocab, cfg.vocab_size)
    # Checksums (gguffile's module doc): of each tensor's bytes as they will be stored, and
    # of the header, filled in once the file is written (a fixed-width placeholder first).
    sums = crc32_many({tname: arr for tname, arr, _ in tensors})
    w.add_string(CRC_TENSORS_KEY, json.dumps(sums, sort_keys=True, separators=(",", ":")))
    w.add_string(CRC_HEADER_KEY, "00000000")
    for tname, arr, raw in tensors:
        w.add_tensor(tname, arr, raw_dtype=raw)
    # The tensors' bytes (the header adds a little): refused before writing when they
    # cannot fit; a disk that fills anyway is named by atomic_writer (DiskWriteError).
    size = sum(arr.nbytes for _, arr, _ in tensors)
    with atomic_writer(out, "wb", size=size, what="GGUF file") as fh:
        w.open_output_file(Path(fh.name))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        seal_gguf_header(fh.name)
    return tok

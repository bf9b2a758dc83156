"""GGUF tensors: how a microscale weight is stored as a ggml tensor, byte for byte.

Each linear layer keeps the format microscale quantized it in whenever ggml has a native type:

=========  =====================  ==================================================
microscale ggml type              block layout (ggml/src/ggml-common.h)
=========  =====================  ==================================================
nvfp4      ``NVFP4 = 40``         36 bytes per 64 values: 4 unsigned-E4M3 scale bytes
                                  (one per 16), then 32 code bytes; in each 16-group
                                  byte j = element j (low nibble) | element j+8 (high).
                                  The FP32 tensor scale ``s_dec`` is a separate
                                  ``<name>.scale`` F32 ``[1]`` tensor that llama.cpp
                                  multiplies onto the matmul output.
mxfp4      ``MXFP4 = 39``         17 bytes per 32 values: the E8M0 byte, then 16 bytes;
                                  byte j = element j (low) | element j+16 (high).
q8_0       ``Q8_0 = 8``           34 bytes per 32 values: float16 scale, 32 int8.
8-bit      ``Q8_0``               FP8 / MXFP8 layers have no ggml type: requantized to
                                  Q8_0 from the float weights (the master weights of a
                                  run, the decoded 8-bit weights of a packed folder).
bf16       ``BF16`` (or F16/F32)  unquantized layers, embeddings, LM head.
=========  =====================  ==================================================

ggml's own integer types (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K, IQ4_NL, IQ4_XS:
``formats.spec.GGML_FORMATS``) are stored as themselves: a layer quantized by PTQ holds
ggml's bytes already (:func:`~microscale.formats.ggml_qarray`, encoded with the importance
matrix), written as they are; a float weight is encoded by :func:`gguf_ggml_tensor`, bit for
bit as ggml's quantizer writes it (``formats/ggml.py``).

Norm weights, biases and ``.scale`` tensors are F32. ggml decodes E2M1 codes as doubled
integers (``kvalues = 2 * e2m1``) times half the block scale; both products are exact in
float32, so decoding a file gives microscale's ``dequantize`` bit for bit (tested with the
``gguf`` package's own dequantizers). The byte of an E4M3 scale *is* its UE4M3 byte: block
scales are never negative, and 0x7F (NaN in E4M3, 0 in UE4M3) never occurs for finite
weights. Element packing reuses :func:`microscale.formats.pack_nibbles` on codes reordered
so that each pair (j, j + half a scale block) lands in one byte.

A row of ``K`` inputs holds ``K / 64`` NVFP4 blocks (``K / 32`` MXFP4 / Q8_0 blocks): other
lengths cannot be stored and are refused, naming the tensor, as are non-finite weights.

The token embedding (and an untied LM head) is stored unquantized or in a ggml type without
a tensor scale (:data:`EMBED_FORMATS`); :func:`embed_values` is what llama.cpp decodes from
it, what the precision search scores a table format with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from microscale.export import layouts as L
from microscale.export.gguffile import gguf_package
from microscale.formats import (
    QArray,
    block_scales_f32,
    dequantize,
    get_format,
    get_weight_format,
    pack_nibbles,
    quantize,
    unpack_nibbles,
    weight_only,
)
from microscale.formats.ggml import fallback_format, quantize_ggml
from microscale.formats.spec import get_ggml_format

__all__ = [
    "EMBED_FORMATS",
    "FLOAT_TYPES",
    "GGUF_FORMATS",
    "embed_tensor",
    "embed_values",
    "float_tensor",
    "gguf_embed_format",
    "gguf_format",
    "gguf_ggml_tensor",
    "gguf_tensor",
]

# microscale formats ggml runs natively -> GGMLQuantizationType member name.
GGUF_FORMATS: dict[str, str] = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "q8_0": "Q8_0"}
FLOAT_TYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Stored formats of the token embedding (and of an untied LM head): unquantized (bf16) or a
# ggml type without a global (per-tensor) scale, so llama.cpp's get_rows (the embedding
# lookup) and the tied LM head matmul both decode it. NVFP4 is not one of them: its FP32
# tensor scale lives in a separate ``.scale`` tensor that llama.cpp's graphs apply to
# linear layers' outputs, not to the embedding lookup.
EMBED_FORMATS = ("bf16",) + tuple(f for f in GGUF_FORMATS if not get_format(f).has_global_scale)


def gguf_format(fmt: str) -> str:
    """The format a layer in ``fmt`` is stored in: ggml's native 4/8-bit types and its own
    block types as is, other 8-bit formats (FP8, MXFP8) as ``q8_0``, unquantized ones as
    ``bf16``."""
    spec = get_weight_format(fmt)
    if spec.name in GGUF_FORMATS or weight_only(spec) or not spec.quantized:
        return spec.name if spec.quantized else "bf16"
    if spec.elem_bits == 8:
        return "q8_0"
    raise ValueError(
        f"format {spec.name!r} has no GGUF type; expected one of "
        f"{sorted(GGUF_FORMATS)}, an 8-bit format (stored as q8_0) or bf16"
    )


def gguf_embed_format(fmt: str) -> str:
    """The stored format of the token embedding / LM head for ``fmt`` (one of
    :data:`EMBED_FORMATS`, or an 8-bit format, stored as ``q8_0``); others are refused."""
    stored = gguf_format(fmt)
    if stored not in EMBED_FORMATS:
        raise ValueError(
            f"embed_format={fmt!r}: the token embedding / LM head can be stored "
            f"as {list(EMBED_FORMATS)} (or an 8-bit format, as q8_0); {stored} "
            "needs a tensor scale that llama.cpp does not apply to the "
            "embedding lookup"
        )
    return stored


def _embed_qarray(x: Any, fmt: str) -> QArray:
    """A ``[vocab, d_model]`` table quantized as a GGUF stores it in the quantized ``fmt``:
    along ``d_model`` (one block row per token), from float32."""
    return quantize(jnp.asarray(x, jnp.float32), gguf_embed_format(fmt), axis=1)


def embed_values(x: Any, fmt: str) -> jax.Array:
    """The float32 ``[vocab, d_model]`` values llama.cpp decodes from the table ``x``
    stored in the quantized ``fmt`` (:func:`write_gguf`'s ``embed_format``): what the
    search scores a token embedding / LM head format with (``microscale.ptq``); bf16: the
    table rounded to bfloat16."""
    if gguf_embed_format(fmt) == "bf16":
        return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)
    return dequantize(_embed_qarray(x, fmt))


def embed_tensor(x: Any, fmt: str, name: str, dtype: str) -> tuple[np.ndarray, Any]:
    """A ``[vocab, d_model]`` embedding (or transposed LM head kernel) as stored: ``dtype``
    when ``fmt`` is bf16, else quantized along ``d_model`` (one block row per token)."""
    if fmt == "bf16":
        return float_tensor(x, dtype)
    return gguf_tensor(_embed_qarray(x, fmt), name)


def gguf_tensor(q: QArray, name: str) -> tuple[np.ndarray, Any]:
    """(uint8 ``[N, bytes per row]``, GGMLQuantizationType) of a weight QArray in HF
    orientation ``[N, K]`` (blocks along ``K``), in ggml's block layout (module doc); one
    of ggml's own block types holds its bytes already."""
    gguf = gguf_package("GGUF export")
    spec = q.spec
    if weight_only(spec):
        data = np.ascontiguousarray(np.asarray(q.data, np.uint8))
        return data, gguf.GGMLQuantizationType(spec.ggml_type)
    if spec.name not in GGUF_FORMATS:
        raise ValueError(
            f"{name}: format {spec.name!r} has no GGUF block type; expected one "
            f"of {sorted(GGUF_FORMATS)}"
        )
    qtype = gguf.GGMLQuantizationType[GGUF_FORMATS[spec.name]]
    per_block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    q = L.row_blocks(L.to_hf_orientation(q))
    n, k = q.shape
    if k % per_block:
        raise ValueError(
            f"{name}: input dimension {k} is not a multiple of {per_block}, "
            f"the {qtype.name} block length; ggml cannot hold this tensor "
            f"(use another format for this layer, e.g. bf16)"
        )
    sub = spec.block_size
    assert sub is not None  # only block-scaled formats have a ggml block type
    groups = per_block // sub  # scale groups per ggml block
    scales = np.asarray(q.scales)[:n]  # 16x16 tiles may pad rows
    data = np.asarray(q.data)[:n]
    if spec.has_global_scale and not np.isfinite(np.asarray(q.global_scale)):
        raise ValueError(
            f"{name}: the tensor scale is {float(np.asarray(q.global_scale))} (non-finite "
            "weights); refusing to write a tensor llama.cpp would misread"
        )
    # Block scales must be finite and non-negative (decoded: E8M0 0xFF is NaN, which ggml
    # does not handle; a UE4M3 byte has no sign bit and reads 0x7F as 0).
    decoded = np.asarray(block_scales_f32(dataclasses.replace(q, scales=jnp.asarray(scales))))
    if not (np.isfinite(decoded) & (decoded >= 0) & ~np.signbit(decoded)).all():
        raise ValueError(
            f"{name}: non-finite or negative block scales (non-finite "
            "weights); refusing to write a tensor llama.cpp would misread"
        )
    sbytes = scales.view(np.uint8).reshape(n, k // per_block, -1)
    if spec.packed:
        codes = np.asarray(unpack_nibbles(jnp.asarray(data), 1)).reshape(n, -1, 2, sub // 2)
        # (j, j + sub/2) side by side, then two codes per byte: element 2i low, 2i+1 high
        pairs = np.swapaxes(codes, -1, -2).reshape(n, -1, sub)
        elems = np.asarray(pack_nibbles(jnp.asarray(pairs), -1))
    else:
        elems = data.view(np.uint8)
    elems = elems.reshape(n, k // per_block, -1)
    blocks = np.concatenate([sbytes, elems], axis=-1)
    assert blocks.shape[-1] == type_size and sbytes.shape[-1] == groups * scales.itemsize
    return np.ascontiguousarray(blocks.reshape(n, -1)), qtype


def gguf_ggml_tensor(w: Any, fmt: str, name: str, imatrix: Any = None) -> tuple[np.ndarray, Any]:
    """(uint8 ``[N, bytes per row]``, GGMLQuantizationType) of a float weight ``[N, K]`` (HF
    orientation, blocks along ``K``) in one of ggml's own block types (``GGML_FORMATS``:
    Q4_0 ... Q6_K, IQ4_NL, IQ4_XS), encoded as ggml's ``ggml_quantize_chunk`` encodes it
    (``formats/ggml.py``), with ``imatrix`` (one importance weight per input, llama.cpp's
    imatrix) where ggml uses one. A ``K`` the type's blocks do not divide is refused, naming
    the type llama.cpp would write instead."""
    gguf = gguf_package("GGUF export")
    spec = get_ggml_format(fmt)
    x = np.asarray(jnp.asarray(w, jnp.float32))
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a [N, K] weight, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: non-finite weights; refusing to write them")
    k = x.shape[1]
    fallback = fallback_format(spec, k)
    if fallback != spec.name:
        raise ValueError(
            f"{name}: input dimension {k} is not a multiple of "
            f"{spec.super_block or spec.block_size}, the {spec.name} block length; "
            f"llama.cpp writes such a tensor as {fallback}"
        )
    qtype = gguf.GGMLQuantizationType(spec.ggml_type)
    return np.ascontiguousarray(quantize_ggml(x, spec, imatrix)), qtype


def float_tensor(x, dtype: str) -> tuple[np.ndarray, Any]:
    gguf = gguf_package("GGUF export")
    a = np.asarray(jnp.asarray(x, jnp.float32))
    if dtype == "bfloat16":
        b = a.astype(ml_dtypes.bfloat16).view(np.uint8)
        return np.ascontiguousarray(b.reshape(*a.shape[:-1], -1)), gguf.GGMLQuantizationType.BF16
    return np.ascontiguousarray(a.astype(np.float16 if dtype == "float16" else np.float32)), None

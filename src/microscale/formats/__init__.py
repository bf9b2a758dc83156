"""Exact block-scaled number formats: the single source of truth for format math.

Imports nothing else from microscale. See ``spec.py`` for the registry and
``quantize.py`` for the numerics.
"""

from microscale.formats.elements import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    unpack_nibbles,
)
from microscale.formats.hadamard import hadamard_matrix, random_hadamard, random_signs
from microscale.formats.quantize import (
    QArray,
    block_scales_f32,
    dequantize,
    fake_quantize,
    ggml_qarray,
    quantize,
    quantize_dequantize,
    requantize,
    requantize_values,
    storage_bits,
    tensor_amax,
)
from microscale.formats.spec import (
    REGISTRY,
    FormatSpec,
    get_format,
    get_weight_format,
    list_formats,
    weight_only,
)

__all__ = [
    "E2M1_VALUES",
    "REGISTRY",
    "FormatSpec",
    "QArray",
    "block_scales_f32",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "fake_quantize",
    "get_format",
    "get_weight_format",
    "ggml_qarray",
    "hadamard_matrix",
    "list_formats",
    "pack_nibbles",
    "quantize",
    "quantize_dequantize",
    "random_hadamard",
    "requantize",
    "requantize_values",
    "random_signs",
    "storage_bits",
    "tensor_amax",
    "unpack_nibbles",
    "weight_only",
]

"""The format registry: one frozen row per number format.

Everything outside ``microscale.formats`` reads the fields of a :class:`FormatSpec`;
only this package branches on how a format is built (its *kind*), and nothing
anywhere branches on a format's *name*.

A block-scaled format stores ``x ~= element * block_scale [* global_scale]``:

========== ========= ====== ================ ============= ===============================
name       element   block  block scale      tensor scale  bits / element (weights only)
========== ========= ====== ================ ============= ===============================
nvfp4      E2M1      16     E4M3 (RNE)       FP32 s_dec    4 + 8/16 = 4.5
mxfp4      E2M1      32     E8M0 (2^k)       -             4 + 8/32 = 4.25
mxfp8      E4M3      32     E8M0 (2^k)       -             8 + 8/32 = 8.25
fp8_e4m3   E4M3      tensor -                FP32          8
fp8_e5m2   E5M2      tensor -                FP32          8
q8_0       INT8      32     FP16             -             8 + 16/32 = 8.5
bf16       BF16      -      -                -             16
========== ========= ====== ================ ============= ===============================

``q8_0`` is ggml's ``GGML_TYPE_Q8_0`` (llama.cpp), exactly as ``quantize_row_q8_0_ref`` in
``ggml/src/ggml-quants.c`` computes it: per block of 32, ``d = amax / 127`` (float32),
codes ``roundf(x * (1 / d))`` (round half away from zero; ``d == 0`` gives zeros), ``d``
stored as float16; decoding is ``code * float32(float16(d))``. It exists so that an 8-bit
choice runs natively in llama.cpp (GGUF export, ``quantize --target gguf``).

MX scale rounding (OCP Microscaling v1.0 vs NVIDIA): ``"floor"`` is the OCP rule
``2^(floor(log2 amax) - emax_elem)`` (the largest values may saturate); ``"ceil"`` is
NVIDIA's ``2^ceil(log2(amax / elem_max))`` (never saturates; what cuDNN, Transformer
Engine's MXFP8 and JAX's reference quantizer use). Defaults: ``mxfp8`` -> ``"ceil"``
(matches the hardware recipe), ``mxfp4`` -> ``"floor"`` (the OCP definition).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import ml_dtypes
import numpy as np

ScaleKind = Literal["e4m3", "e8m0", "f16", "tensor", "none"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """One number format. Frozen, hashable: usable as static jit metadata."""

    # Registry key, e.g. "nvfp4".
    name: str
    # numpy/ml_dtypes dtype of one element (float4_e2m1fn, float8_e4m3fn, int8, ...).
    elem_dtype: Any
    # Storage bits of one element (4 -> two codes packed per uint8).
    elem_bits: int
    # Largest finite element magnitude (6, 448, 57344, ...).
    elem_max: float
    # Exponent of the largest element binade (E2M1: 2, E4M3: 8, E5M2: 15; INT8: 6).
    elem_emax: int
    # Elements per scale block along the quantized axis; None = one scale per tensor.
    block_size: int | None
    # How block scales are stored: E4M3 (NVFP4), E8M0 powers of two (MX), float16
    # (ggml Q8_0), one float32 per tensor (FP8 current scaling), or none (pass-through).
    scale_kind: ScaleKind
    # dtype of the stored scales (None when there are none).
    scale_dtype: Any
    # NVFP4's second level: a float32 per-tensor decode scale amax / (448 * 6).
    has_global_scale: bool = False
    # Default MX scale rounding: "floor" (OCP) or "ceil" (NVIDIA); None if not MX.
    scale_rounding: Literal["floor", "ceil"] | None = None

    @property
    def quantized(self) -> bool:
        """False for the pass-through (bf16) row."""
        return self.scale_kind != "none"

    @property
    def has_tensor_scale(self) -> bool:
        """True when an amax over the whole tensor sets a scale (per-tensor FP8, NVFP4's
        global scale): such a format can take a given ``amax`` (delayed scaling)."""
        return self.quantized and (self.block_size is None or self.has_global_scale)

    @property
    def packed(self) -> bool:
        """True when two elements share one uint8 (4-bit elements)."""
        return self.elem_bits == 4

    @property
    def scale_bits(self) -> int:
        return 0 if self.scale_dtype is None else np.dtype(self.scale_dtype).itemsize * 8

    @property
    def bits_per_element(self) -> float:
        """Storage cost of one element including its share of the block scale."""
        if self.block_size is None:
            return float(self.elem_bits)
        return self.elem_bits + self.scale_bits / self.block_size

    @property
    def integer(self) -> bool:
        """True when elements are integers (ggml Q8_0) rather than floats."""
        return bool(np.issubdtype(np.dtype(self.elem_dtype), np.integer))

    @property
    def scale_max(self) -> float:
        """Largest finite block-scale value (E4M3: 448)."""
        return float(ml_dtypes.finfo(self.scale_dtype).max)


_E2M1 = dict(elem_dtype=ml_dtypes.float4_e2m1fn, elem_bits=4, elem_max=6.0, elem_emax=2)
_E4M3 = dict(elem_dtype=ml_dtypes.float8_e4m3fn, elem_bits=8, elem_max=448.0, elem_emax=8)
_E5M2 = dict(elem_dtype=ml_dtypes.float8_e5m2, elem_bits=8, elem_max=57344.0, elem_emax=15)

REGISTRY: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec(
            name="nvfp4",
            **_E2M1,
            block_size=16,
            scale_kind="e4m3",
            scale_dtype=ml_dtypes.float8_e4m3fn,
            has_global_scale=True,
        ),
        FormatSpec(
            name="mxfp4",
            **_E2M1,
            block_size=32,
            scale_kind="e8m0",
            scale_dtype=ml_dtypes.float8_e8m0fnu,
            scale_rounding="floor",
        ),
        FormatSpec(
            name="mxfp8",
            **_E4M3,
            block_size=32,
            scale_kind="e8m0",
            scale_dtype=ml_dtypes.float8_e8m0fnu,
            scale_rounding="ceil",
        ),
        FormatSpec(
            name="fp8_e4m3", **_E4M3, block_size=None, scale_kind="tensor", scale_dtype=np.float32
        ),
        FormatSpec(
            name="fp8_e5m2", **_E5M2, block_size=None, scale_kind="tensor", scale_dtype=np.float32
        ),
        FormatSpec(
            name="q8_0",
            elem_dtype=np.int8,
            elem_bits=8,
            elem_max=127.0,
            elem_emax=6,
            block_size=32,
            scale_kind="f16",
            scale_dtype=np.float16,
        ),
        FormatSpec(
            name="bf16",
            elem_dtype=ml_dtypes.bfloat16,
            elem_bits=16,
            elem_max=float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
            elem_emax=127,
            block_size=None,
            scale_kind="none",
            scale_dtype=None,
        ),
    )
}


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Look a format up by name (or pass a spec through). Raises on unknown names."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if not isinstance(fmt, str) or fmt not in REGISTRY:
        raise ValueError(
            f"unknown format {fmt!r}; expected one of {sorted(REGISTRY)} or a FormatSpec"
        )
    return REGISTRY[fmt]


def list_formats() -> list[str]:
    return list(REGISTRY)

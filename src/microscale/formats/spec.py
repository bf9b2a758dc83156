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

``GGML_FORMATS`` holds ggml's own block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K,
IQ4_NL, IQ4_XS) as rows with their block layout as data (``ggml_type``, ``block_bytes``,
``super_block``, ``sub_scale_bits``, ``has_block_min``, ``elem_values``, ``ggml_search``,
``ggml_fallback``). Their codecs are numpy, in ``formats/ggml.py`` (bit-identical to ggml's
``ggml_quantize_chunk``); ``microscale.quantize`` (JAX) does not take them, so they are not
in ``REGISTRY`` (its callers and tests assume a JAX quantizer for every row). Q8_0 is in
both: the same row.

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
# The rule family of a ggml block type's numpy encoder (formats/ggml.py): "q8" (Q8_0),
# "sym" (Q4_0, Q5_0: d = max / -2^(b-1)), "asym" (Q4_1, Q5_1: a scale and a minimum),
# "k_asym" (Q2_K, Q4_K, Q5_K: sub-block scales and minimums under a float16 pair),
# "k_sym" (Q3_K, Q6_K: signed sub-block scales under one float16), "iq4" (IQ4_NL, IQ4_XS:
# a non-uniform codebook).
GgmlCodec = Literal["q8", "sym", "asym", "k_asym", "k_sym", "iq4"]


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
    # ggml's ``enum ggml_type`` id when formats/ggml.py encodes and decodes the row to
    # ggml's exact block bytes (a GGUF tensor of that type); None otherwise.
    ggml_type: int | None = None
    # The encoder's rule family in formats/ggml.py (None: not a ggml block type).
    ggml_codec: GgmlCodec | None = None
    # Bytes of one ggml block: a super-block where ``super_block`` is set.
    block_bytes: int | None = None
    # Elements per super-block (256: the K-quants, IQ4_XS): one float16 scale (and float16
    # minimum) per super-block scales each ``block_size`` sub-block's small integer scale
    # (and minimum); None: each block stores its own float16 scale.
    super_block: int | None = None
    # Bits of each sub-block's integer scale and minimum under the super-block's float16
    # (Q2_K 4, Q3_K / Q4_K / Q5_K / IQ4_XS 6, Q6_K 8); None without super-blocks.
    sub_scale_bits: int | None = None
    # True when a block decodes as ``d * q - m`` (an unsigned code and a stored minimum:
    # Q4_1, Q5_1, Q2_K, Q4_K, Q5_K); False for ``d * (q - offset)`` or a codebook.
    has_block_min: bool = False
    # The integer codebook a 4-bit code indexes (IQ4's kvalues_iq4nl); None: uniform levels.
    elem_values: tuple[int, ...] | None = None
    # ggml's reference encoder's sub-block scale search for a K-quant with minimums
    # (make_qkx2_quants: rmin, rdelta, nstep, mean absolute instead of squared error).
    ggml_search: tuple[float, float, int, bool] | None = None
    # The type llama.cpp writes instead (llama-quant.cpp, tensor_type_fallback) when a
    # row's width is not a multiple of ``super_block``; None for the 32-wide types.
    ggml_fallback: str | None = None

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
        """Storage cost of one element including its share of the block scale (a ggml
        block type: its block's bytes over its elements, minimums and sub-scales included)."""
        if self.block_bytes is not None and self.block_size is not None:
            return self.block_bytes * 8 / (self.super_block or self.block_size)
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
            ggml_type=8,
            ggml_codec="q8",
            block_bytes=34,
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


_GGML = dict(scale_kind="f16", scale_dtype=np.float16)
_K = dict(_GGML, super_block=256)
# IQ4's codebook (ggml-common.h, kvalues_iq4nl).
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _ggml(name: str, *, elem_bits: int, elem_max: float, **kw: Any) -> FormatSpec:
    """A ggml row: integer elements (unsigned codes, or signed after the offset), the
    largest binade ``elem_bits - 1``."""
    return FormatSpec(
        name=name, elem_bits=elem_bits, elem_max=elem_max, elem_emax=elem_bits - 1, **kw
    )


# ggml's block types with an exact numpy codec (formats/ggml.py) and no JAX quantizer:
# what ``microscale.quantize`` takes is REGISTRY. Q8_0 is in both (the same row).
GGML_FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        _ggml(
            "q4_0",
            elem_dtype=np.int8,
            elem_bits=4,
            elem_max=8,
            block_size=32,
            ggml_type=2,
            ggml_codec="sym",
            block_bytes=18,
            **_GGML,
        ),
        _ggml(
            "q4_1",
            elem_dtype=np.uint8,
            elem_bits=4,
            elem_max=15,
            block_size=32,
            ggml_type=3,
            ggml_codec="asym",
            block_bytes=20,
            has_block_min=True,
            **_GGML,
        ),
        _ggml(
            "q5_0",
            elem_dtype=np.int8,
            elem_bits=5,
            elem_max=16,
            block_size=32,
            ggml_type=6,
            ggml_codec="sym",
            block_bytes=22,
            **_GGML,
        ),
        _ggml(
            "q5_1",
            elem_dtype=np.uint8,
            elem_bits=5,
            elem_max=31,
            block_size=32,
            ggml_type=7,
            ggml_codec="asym",
            block_bytes=24,
            has_block_min=True,
            **_GGML,
        ),
        REGISTRY["q8_0"],
        _ggml(
            "q2_k",
            elem_dtype=np.uint8,
            elem_bits=2,
            elem_max=3,
            block_size=16,
            ggml_type=10,
            ggml_codec="k_asym",
            block_bytes=84,
            sub_scale_bits=4,
            has_block_min=True,
            ggml_search=(-0.5, 0.1, 15, True),
            ggml_fallback="q4_0",
            **_K,
        ),
        _ggml(
            "q3_k",
            elem_dtype=np.int8,
            elem_bits=3,
            elem_max=4,
            block_size=16,
            ggml_type=11,
            ggml_codec="k_sym",
            block_bytes=110,
            sub_scale_bits=6,
            ggml_fallback="q4_0",
            **_K,
        ),
        _ggml(
            "q4_k",
            elem_dtype=np.uint8,
            elem_bits=4,
            elem_max=15,
            block_size=32,
            ggml_type=12,
            ggml_codec="k_asym",
            block_bytes=144,
            sub_scale_bits=6,
            has_block_min=True,
            ggml_search=(-1.0, 0.1, 20, False),
            ggml_fallback="q5_0",
            **_K,
        ),
        _ggml(
            "q5_k",
            elem_dtype=np.uint8,
            elem_bits=5,
            elem_max=31,
            block_size=32,
            ggml_type=13,
            ggml_codec="k_asym",
            block_bytes=176,
            sub_scale_bits=6,
            has_block_min=True,
            ggml_search=(-0.5, 0.1, 15, False),
            ggml_fallback="q5_1",
            **_K,
        ),
        _ggml(
            "q6_k",
            elem_dtype=np.int8,
            elem_bits=6,
            elem_max=32,
            block_size=16,
            ggml_type=14,
            ggml_codec="k_sym",
            block_bytes=210,
            sub_scale_bits=8,
            ggml_fallback="q8_0",
            **_K,
        ),
        _ggml(
            "iq4_nl",
            elem_dtype=np.int8,
            elem_bits=4,
            elem_max=127,
            block_size=32,
            ggml_type=20,
            ggml_codec="iq4",
            block_bytes=18,
            elem_values=KVALUES_IQ4NL,
            **_GGML,
        ),
        _ggml(
            "iq4_xs",
            elem_dtype=np.int8,
            elem_bits=4,
            elem_max=127,
            block_size=32,
            ggml_type=23,
            ggml_codec="iq4",
            block_bytes=136,
            sub_scale_bits=6,
            elem_values=KVALUES_IQ4NL,
            ggml_fallback="iq4_nl",
            **_K,
        ),
    )
}


def get_ggml_format(fmt: str | FormatSpec) -> FormatSpec:
    """A ggml block type by name (or a spec with a ggml codec passed through)."""
    spec = GGML_FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(spec, FormatSpec) or spec.ggml_codec is None:
        raise ValueError(f"not a ggml block type: {fmt!r}; expected one of {sorted(GGML_FORMATS)}")
    return spec


def get_weight_format(fmt: str | FormatSpec) -> FormatSpec:
    """A format a linear layer's weight can be stored in: a ``REGISTRY`` row, or one of
    ggml's block types (``GGML_FORMATS``: weights only, see :func:`weight_only`). Raises on
    unknown names, listing both."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, str) and fmt in GGML_FORMATS and fmt not in REGISTRY:
        return GGML_FORMATS[fmt]
    if not isinstance(fmt, str) or fmt not in REGISTRY:
        raise ValueError(
            f"unknown format {fmt!r}; expected one of {sorted(REGISTRY)} or ggml's "
            f"{sorted(set(GGML_FORMATS) - set(REGISTRY))}"
        )
    return REGISTRY[fmt]


def weight_only(spec: FormatSpec) -> bool:
    """True for a ggml block type without a JAX quantizer (Q4_K, IQ4_XS, ...): it stores
    weights, encoded by ``formats/ggml.py``'s exact numpy codec, and neither quantizes
    activations nor trains. Q8_0 is in ``REGISTRY`` too: False."""
    return spec.ggml_codec is not None and REGISTRY.get(spec.name) != spec


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

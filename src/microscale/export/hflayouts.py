"""The HF-style quantized layouts, one :class:`~microscale.export.hfquant.HFQuant` row each
(:mod:`~microscale.export.compressed_tensors`, :mod:`~microscale.export.modelopt`): what
``export_checkpoint`` and ``read_checkpoint`` look a layout's name up in."""

from __future__ import annotations

from microscale.export.compressed_tensors import COMPRESSED_TENSORS
from microscale.export.hfquant import HFQuant
from microscale.export.modelopt import MODELOPT

__all__ = ["HF_QUANT", "hf_quant"]

HF_QUANT: dict[str, HFQuant] = {row.name: row for row in (COMPRESSED_TENSORS, MODELOPT)}


def hf_quant(name: str) -> HFQuant:
    """The row of the HF-style quantized layout ``name``; ValueError naming the choices."""
    if name not in HF_QUANT:
        raise ValueError(f"layout={name!r}: expected one of {tuple(HF_QUANT)}")
    return HF_QUANT[name]

"""Content checksums and finiteness checks for stored tensors.

Checkpoints (``train/checkpoint.py``) and exported safetensors (``export/tensorfile.py``)
store a CRC-32 of every tensor's bytes when written, and check it, plus that every
floating-point value is finite, when read. A bit flip, a truncated or a swapped file is
then reported with the file and tensor it hit instead of being computed on.

CRC-32 (``zlib.crc32``, the checksum of zip and PNG) detects every burst error of up to 32
bits and any other corruption with probability 1 - 2^-32 per tensor; it is not a
cryptographic hash (it does not defend against deliberate tampering). It is the fastest
checksum in the standard library and releases the GIL, so tensors are hashed in parallel
threads. ``benchmarks/integrity.py`` measures the cost against saving and loading.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["CorruptDataError", "check_finite", "crc32", "crc32_many", "verify_crc32"]

_CHUNK = 1 << 26  # hash in 64 MiB pieces: zlib takes at most 4 GiB at once


class CorruptDataError(ValueError):
    """Stored data fails its checksum, is not finite, or cannot be decoded."""


def crc32(array) -> str:
    """CRC-32 of an array's bytes (C order), as 8 hex digits."""
    a = np.ascontiguousarray(np.asarray(array))
    flat = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
    c = 0
    for i in range(0, flat.size, _CHUNK):
        c = zlib.crc32(flat[i:i + _CHUNK], c)
    return f"{c:08x}"


def _pool_size() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def crc32_many(arrays: Mapping[str, object]) -> dict[str, str]:
    """``{name: crc32}`` of many arrays, hashed in parallel threads."""
    names = list(arrays)
    if len(names) < 2:
        return {n: crc32(arrays[n]) for n in names}
    with ThreadPoolExecutor(_pool_size()) as pool:
        return dict(zip(names, pool.map(lambda n: crc32(arrays[n]), names), strict=True))


def verify_crc32(arrays: Mapping[str, object], expected: Mapping[str, str], *,
                 where: str) -> None:
    """Raise :class:`CorruptDataError` naming ``where`` and the first tensor whose CRC-32
    differs from ``expected`` (tensors without an expected value are not checked)."""
    names = [n for n in arrays if n in expected]
    got = crc32_many({n: arrays[n] for n in names})
    bad = [n for n in names if got[n] != str(expected[n]).lower()]
    if bad:
        n = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CorruptDataError(f"{where}: tensor {n!r} fails its checksum (crc32 {got[n]}, "
                               f"stored {expected[n]}){more}: the file is damaged")


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or "float" in dtype.name  # + ml_dtypes


def check_finite(items: Iterable[tuple[str, object]], *, where: str) -> None:
    """Raise :class:`CorruptDataError` naming ``where`` and the first floating-point tensor
    holding a NaN or infinity."""
    for name, x in items:
        a = np.asarray(x)
        if not (_is_float(a.dtype) and a.size):
            continue
        ok = np.isfinite(a.astype(np.float32) if a.dtype.itemsize < 4 else a)
        if not ok.all():
            n_bad = int(a.size - np.count_nonzero(ok))
            raise CorruptDataError(f"{where}: tensor {name!r} holds {n_bad} non-finite "
                                   f"value(s) (NaN or infinity) of {a.size}")

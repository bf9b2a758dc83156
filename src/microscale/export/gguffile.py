"""GGUF files, read and validated in plain Python + numpy, and their checksums.

A GGUF file (llama.cpp's ``gguf.h`` / ``gguf-py``; version 3, little-endian) is::

    "GGUF", uint32 version, uint64 tensor_count, uint64 kv_count
    kv_count x   key (uint64 length + UTF-8 bytes), uint32 value type, value
                 (scalars; strings as uint64 length + bytes; arrays as uint32 element
                 type, uint64 count, elements)
    tensor_count x   name (string), uint32 n_dims, n_dims x uint64 ne, uint32 ggml type,
                     uint64 offset (relative to the data section, aligned)
    padding to ``general.alignment`` (default 32), then the tensors' bytes

:func:`read_gguf_header` walks that structure checking every length, count and offset
against the file before using it, so a damaged header fails at once with the byte where it
went wrong. (The ``gguf`` package's reader instead loops over every element of an array
whose length was flipped to 2^32 + n: still running after 20 s in a test.) It is
microscale's one GGUF reader: :func:`open_gguf` gives the metadata values (decoded on
demand from the validated spans) and each tensor's bytes (:class:`GGUFContents`), what the
GGUF -> HF conversion reads. The ``gguf`` package (:func:`gguf_package`) is used for its
tables of ggml types and its decoders only.

Integrity: :func:`~microscale.export.gguf.writer.write_gguf` stores two metadata entries, which
llama.cpp and the ``gguf`` package read as ordinary strings and otherwise ignore:

* ``microscale.crc32.tensors``: a JSON object ``{tensor name: 8 hex digits}``, the CRC-32
  (:func:`microscale.integrity.crc32`) of each tensor's bytes exactly as stored -- the
  ``n_bytes`` at its offset, i.e. what ``gguf.GGUFReader`` returns as the tensor's ``data``
  (the value format of the safetensors ``microscale.crc32`` entry);
* ``microscale.crc32.header``: 8 hex digits, the CRC-32 of the header -- every byte from
  the magic to the end of the tensor table (counts, all metadata entries including the
  tensor checksums, names, shapes, types, offsets) -- with this entry's own 8 characters
  read as ``00000000``. The writer stores ``00000000`` and patches in the value once the
  file is written.

:func:`check_gguf` reports every problem (a header that does not parse, a header or tensor
that fails its checksum, a tensor without one); :func:`verify_gguf` raises
:class:`~microscale.integrity.CorruptDataError` naming the file and the first damaged
tensor. Alignment padding between tensors is covered by neither checksum (no reader looks
at it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from microscale.integrity import CorruptDataError, crc32, crc32_many

__all__ = [
    "CRC_HEADER_KEY",
    "CRC_TENSORS_KEY",
    "GGUFCheck",
    "GGUFContents",
    "GGUFFormatError",
    "GGUFHeader",
    "GGUFTensorInfo",
    "GGUFValue",
    "check_gguf",
    "gguf_package",
    "header_crc",
    "open_gguf",
    "read_gguf_header",
    "seal_gguf_header",
    "verify_gguf",
]

CRC_TENSORS_KEY = "microscale.crc32.tensors"
CRC_HEADER_KEY = "microscale.crc32.header"
_HEADER_PLACEHOLDER = b"00000000"

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUFValueType -> byte size of a scalar (8: STRING and 9: ARRAY are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGUFValueType -> numpy dtype of a scalar (little-endian).
_SCALAR_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_HEX8 = re.compile(r"[0-9a-f]{8}")


class GGUFFormatError(CorruptDataError):
    """A GGUF file's header is malformed, truncated or inconsistent with its size."""


@dataclasses.dataclass(frozen=True)
class GGUFValue:
    """One metadata entry: its value type, where it lies, and its value when it is a
    string or a scalar (arrays are only located, not decoded)."""

    vtype: int
    begin: int  # the entry's first byte (its key length)
    value_begin: int  # first byte of the value (a string's characters, after the length)
    end: int
    value: object = None


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie: absolute ``[begin, end)`` in the file."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]  # ggml order (ne0 = the contiguous dimension first)
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    size: int  # file size in bytes
    kv: dict[str, GGUFValue]
    tensors: list[GGUFTensorInfo]
    header_end: int  # end of the tensor table
    data_start: int

    def string(self, key: str) -> str | None:
        v = self.kv.get(key)
        value = v.value if v is not None and v.vtype == _STRING else None
        return value if isinstance(value, str) else None  # None: absent, or not decoded


def gguf_package(need: str = "reading GGUF files") -> Any:
    """The ``gguf`` package (ggml's type tables, its quant decoders, ``GGUFWriter``);
    without it an ImportError says that ``need`` needs it and how to install it."""
    try:
        import gguf
    except ImportError:  # pragma: no cover - the [gguf] extra
        raise ImportError(
            f"{need} needs the gguf package: pip install "
            "'microscale[gguf]' (or pip install 'gguf>=0.19')"
        ) from None
    return gguf


def _gguf_types():
    gguf = gguf_package()
    return gguf.GGMLQuantizationType, gguf.GGML_QUANT_SIZES


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(
            f"{self.path}: the GGUF header is damaged or truncated at byte "
            f"{self.pos if at is None else at} ({what})"
        )

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what}: {n} bytes do not fit the file's {self.size}")
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str, decode: bool = True) -> tuple[int, str | None]:
        n = self.u64(f"{what} length")
        start = self.take(n, what)
        if not decode:
            return start, None
        try:
            return start, bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", start) from None

    def value(self, vtype: int, what: str, decode: bool = False, depth: int = 0) -> Any:
        """Walks one value of type ``vtype``, checking every length against the file;
        returns it decoded (a Python scalar, str or list) when ``decode``, else None."""
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], what)
            return _scalars(self.buf, vtype, 1, start)[0] if decode else None
        if vtype == _STRING:
            return self.string(what, decode)[1]
        if vtype == _ARRAY and depth < 4:
            itype = self.u32(f"{what} element type")
            count = self.u64(f"{what} element count")
            if itype in _SCALAR_SIZES:
                start = self.take(count * _SCALAR_SIZES[itype], f"{what} ({count} elements)")
                return _scalars(self.buf, itype, count, start) if decode else None
            if itype in (_STRING, _ARRAY):
                # each element takes at least 8 bytes: a bad count fails before it loops long
                if count * 8 > self.size - self.pos:
                    raise self.fail(f"{what}: {count} elements do not fit the file")
                items = []
                for _ in range(count):
                    item = self.value(itype, what, decode, depth + 1)
                    if decode:
                        items.append(item)
                return items if decode else None
            raise self.fail(f"{what}: unknown array element type {itype}")
        raise self.fail(f"{what}: unknown value type {vtype}")


def _scalars(buf, vtype: int, count: int, start: int) -> list:
    """``count`` scalars of GGUF value type ``vtype`` at byte ``start``, as Python values
    (what ``gguf.GGUFReader``'s ``contents()`` gives: float32 widened, bools as bool)."""
    return np.frombuffer(buf, _SCALAR_DTYPES[vtype], count, start).tolist()


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and validate a GGUF file's header and tensor table (see the module doc).
    Raises :class:`GGUFFormatError` (a :class:`~microscale.integrity.CorruptDataError`)
    naming the file and the byte where the header stops making sense."""
    return _map(path)[1]


def _map(path: str | os.PathLike) -> tuple[np.ndarray, GGUFHeader]:
    """(the file memory-mapped as uint8, its parsed header)."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise GGUFFormatError(f"{path}: the file is empty (truncated?)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    return buf, _parse(buf, path, size)


def open_gguf(path: str | os.PathLike) -> GGUFContents:
    """A GGUF file to read: its header parsed and validated (:func:`read_gguf_header`), its
    metadata values and tensors' bytes read through it (:class:`GGUFContents`)."""
    buf, header = _map(path)
    return GGUFContents(header=header, buf=buf)


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFContents:
    """A GGUF file read through its validated header: each metadata value decoded when
    asked for (only from the span the parse checked), each tensor's stored bytes."""

    header: GGUFHeader
    buf: np.ndarray  # the file, memory-mapped read-only

    @property
    def tensors(self) -> list[GGUFTensorInfo]:
        return self.header.tensors

    def value(self, key: str, default: Any = ...) -> Any:
        """The metadata value of ``key``: a str, a Python scalar, or a list for an array;
        ``default`` when the file has no ``key`` (without one: a ValueError naming it)."""
        v = self.header.kv.get(key)
        if v is None:
            if default is ...:
                raise ValueError(f"GGUF metadata has no {key!r}")
            return default
        c = _Cursor(self.buf, self.header.path)
        c.pos = v.begin
        c.string(f"metadata key {key!r}", decode=False)
        return c.value(c.u32(f"type of {key!r}"), f"value of {key!r}", decode=True)

    def data(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The stored bytes of ``tensor`` as uint8 ``[..., bytes per row]`` (ggml's ``ne``
        reversed, the contiguous dimension as its bytes): what ``gguf.quants.dequantize``
        decodes, for every ggml type."""
        shape = tuple(reversed(tensor.shape[1:]))
        rows = int(np.prod(shape, dtype=np.int64))
        row_bytes = (tensor.end - tensor.begin) // rows if rows else 0
        return np.asarray(self.buf[tensor.begin : tensor.end]).reshape(*shape, row_bytes)

    def decode(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """``tensor``'s values as float32, row-major (ggml's ``ne`` reversed), decoded by
        the ``gguf`` package's ``quants.dequantize`` (ggml's own decoders)."""
        gguf = gguf_package()
        vals = gguf.quants.dequantize(
            self.data(tensor), gguf.GGMLQuantizationType(tensor.ggml_type)
        )
        return np.asarray(vals, np.float32).reshape(tuple(reversed(tensor.shape)))


def _place_tensors(
    path: Path, size: int, kv: dict[str, GGUFValue], infos: list, header_end: int
) -> tuple[int, list[GGUFTensorInfo]]:
    """``(data start, tensors)``: the tensor table's ``(name, type, type name, shape,
    offset, bytes)`` rows placed after the header at ``general.alignment``, each checked to
    be unique, aligned, inside the file and not overlapping another."""
    align_v = kv.get("general.alignment")
    align = _DEFAULT_ALIGNMENT
    if align_v is not None:
        stored = align_v.value
        if (
            align_v.vtype != _UINT32
            or not isinstance(stored, int)
            or not stored
            or (stored & (stored - 1))
        ):
            raise GGUFFormatError(
                f"{path}: general.alignment must be a uint32 power of two; the header is damaged"
            )
        align = stored
    data_start = -(-header_end // align) * align
    tensors: list[GGUFTensorInfo] = []
    names: set[str] = set()
    for name, t, tname, shape, offset, nbytes in infos:
        where = f"{path}: tensor {name!r}"
        if name in names:
            raise GGUFFormatError(
                f"{where} appears twice in the tensor table; the header is damaged"
            )
        names.add(name)
        if offset % align:
            raise GGUFFormatError(
                f"{where}: offset {offset} is not a multiple of the "
                f"alignment {align}; the header is damaged"
            )
        begin = data_start + offset
        if begin + nbytes > size:
            raise GGUFFormatError(
                f"{where}: its {nbytes} bytes at byte {begin} run past the "
                f"end of the file ({size} bytes): truncated, or the header "
                "is damaged"
            )
        tensors.append(GGUFTensorInfo(name, t, tname, shape, begin, begin + nbytes))
    spans = sorted((x.begin, x.end, x.name) for x in tensors if x.end > x.begin)
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise GGUFFormatError(
                f"{path}: tensors {a!r} and {b!r} overlap in the file; the header is damaged"
            )
    return data_start, tensors


def _read_kv(c: _Cursor, n_kv: int) -> dict[str, GGUFValue]:
    """The metadata table: each key once, strings decoded only where microscale reads them."""
    kv: dict[str, GGUFValue] = {}
    for i in range(n_kv):
        begin = c.pos
        _, key = c.string(f"metadata entry {i} key")
        assert key is not None  # decoded
        if key in kv:
            raise c.fail(f"metadata key {key!r} appears twice", begin)
        vtype = c.u32(f"type of {key!r}")
        vbegin = c.pos
        value = None
        if vtype == _STRING:
            vbegin, value = c.string(
                f"value of {key!r}",
                decode=key.startswith("microscale.") or key == "general.alignment",
            )
        elif vtype in _SCALAR_SIZES:
            value = c.value(vtype, f"value of {key!r}", decode=vtype == _UINT32)
        else:
            c.value(vtype, f"value of {key!r}")
        kv[key] = GGUFValue(vtype, begin, vbegin, c.pos, value)
    return kv


def _read_tensor_infos(c: _Cursor, n_tensors: int) -> list[tuple]:
    """The tensor table: ``(name, ggml type, type name, shape, offset, nbytes)`` per tensor,
    with each row length checked against its type's block."""
    qtypes, qsizes = _gguf_types()
    infos = []
    for i in range(n_tensors):
        start = c.pos
        _, name = c.string(f"tensor {i} name")
        assert name is not None  # decoded
        n_dims = c.u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise c.fail(f"tensor {name!r}: {n_dims} dimensions, expected 1 to {_MAX_DIMS}", start)
        shape = tuple(c.u64(f"tensor {name!r} shape") for _ in range(n_dims))
        t = c.u32(f"tensor {name!r} type")
        try:
            qtype = qtypes(t)
            block, type_size = qsizes[qtype]
        except (ValueError, KeyError):
            raise c.fail(f"tensor {name!r}: unknown ggml type {t}", start) from None
        offset = c.u64(f"tensor {name!r} offset")
        n = int(np.prod(shape, dtype=object))
        if shape[0] % block:
            raise c.fail(
                f"tensor {name!r}: row length {shape[0]} is not a multiple of "
                f"{qtype.name}'s block of {block}",
                start,
            )
        infos.append((name, t, qtype.name, shape, offset, n // block * type_size))
    return infos


def _parse(buf, path: Path, size: int) -> GGUFHeader:
    c = _Cursor(buf, path)
    try:
        if bytes(buf[c.take(4, "magic") : 4]) != _MAGIC:
            raise c.fail(
                f"magic {bytes(buf[:4])!r}, expected {_MAGIC!r}: not a GGUF file "
                "or its first bytes are damaged",
                0,
            )
        version = c.u32("version")
        if version not in _VERSIONS:
            raise c.fail(f"version {version}; expected one of {_VERSIONS} (little-endian)", 4)
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # every entry takes at least 12 bytes: a bad count fails here, not after a long loop
        if n_kv * 12 + n_tensors * 24 > size:
            raise c.fail(
                f"{n_kv} metadata entries and {n_tensors} tensors do not fit the "
                f"file's {size} bytes",
                8,
            )
        kv = _read_kv(c, n_kv)
        infos = _read_tensor_infos(c, n_tensors)
        header_end = c.pos
    except struct.error as e:  # pragma: no cover - take() bounds every read
        raise c.fail(str(e)) from None
    data_start, tensors = _place_tensors(path, size, kv, infos, header_end)
    return GGUFHeader(
        path=path,
        version=version,
        size=size,
        kv=kv,
        tensors=tensors,
        header_end=header_end,
        data_start=data_start,
    )


# ---------------------------------------------------------------------- checksums


def header_crc(buf, header: GGUFHeader) -> str:
    """CRC-32 of ``buf[:header_end]`` (the file's bytes) with the value of
    ``microscale.crc32.header`` read as ``00000000`` (see the module doc)."""
    raw = bytearray(buf[: header.header_end])
    v = header.kv.get(CRC_HEADER_KEY)
    if v is not None and v.vtype == _STRING and v.end - v.value_begin == 8:
        raw[v.value_begin : v.end] = _HEADER_PLACEHOLDER
    return crc32(raw)


def seal_gguf_header(path: str | os.PathLike) -> str:
    """Write the header checksum into a freshly written file whose
    ``microscale.crc32.header`` holds the placeholder ``00000000``; returns it."""
    path = Path(path)
    buf, header = _map(path)
    v = header.kv.get(CRC_HEADER_KEY)
    if v is None or v.vtype != _STRING or v.end - v.value_begin != 8:
        raise ValueError(f"{path}: no 8-character {CRC_HEADER_KEY!r} entry to fill")
    if bytes(buf[v.value_begin : v.end]) != _HEADER_PLACEHOLDER:
        raise ValueError(f"{path}: {CRC_HEADER_KEY!r} is already filled")
    value = header_crc(buf, header)
    del buf
    with open(path, "r+b") as f:
        f.seek(v.value_begin)
        f.write(value.encode("ascii"))
    return value


_DAMAGED = "; the header is damaged"


@dataclasses.dataclass(frozen=True)
class GGUFCheck:
    """What :func:`check_gguf` found. ``problems``: ``(tensor name or None for the file as
    a whole, message)``; ``checksums``: whether the file stores checksums at all (files
    written before microscale stored them do not)."""

    path: Path
    tensors: int  # tensors in the file (0 when the header does not parse)
    checked: int  # tensors compared with a stored checksum
    checksums: bool
    problems: tuple[tuple[str | None, str], ...]


def _stored_tensor_sums(header: GGUFHeader, problems: list[tuple[str | None, str]]) -> Any:
    """The per-tensor checksums the file stores (``{}`` when none can be read); appends to
    ``problems`` what is wrong with the stored table itself."""
    sums: Any = {}
    text = header.string(CRC_TENSORS_KEY)
    if text is not None:
        try:
            sums = json.loads(text)
        except json.JSONDecodeError:
            sums = None
        if not (
            isinstance(sums, dict)
            and all(isinstance(v, str) and _HEX8.fullmatch(v) for v in sums.values())
        ):
            problems.append(
                (None, f"{CRC_TENSORS_KEY!r} is not a JSON object of checksums{_DAMAGED}")
            )
            sums = {}
        names = {t.name for t in header.tensors}
        for n in sorted(set(sums) - names):
            problems.append(
                (
                    None,
                    f"a checksum is stored for tensor {n!r}, which the tensor "
                    f"table does not list{_DAMAGED}",
                )
            )
        for n in sorted(names - set(sums)) if sums else ():
            problems.append(
                (n, f"tensor {n!r} has no stored checksum although the file stores them{_DAMAGED}")
            )
    return sums


def check_gguf(
    path: str | os.PathLike, *, progress: Callable[[int], None] | None = None
) -> GGUFCheck:
    """Check a GGUF file against its stored checksums (module doc), reporting every damaged
    tensor; ``progress(nbytes)`` is called as tensor bytes are hashed."""
    path = Path(path)
    try:
        buf, header = _map(path)
    except CorruptDataError as e:
        return GGUFCheck(path, 0, 0, True, ((None, str(e)),))
    has = [k for k in header.kv if k.startswith("microscale.crc32")]
    if not has:
        return GGUFCheck(path, len(header.tensors), 0, False, ())
    problems: list[tuple[str | None, str]] = []
    for key in (CRC_HEADER_KEY, CRC_TENSORS_KEY):
        if key not in header.kv:
            problems.append(
                (None, f"metadata entry {key!r} is missing (the file has {sorted(has)}){_DAMAGED}")
            )
        elif header.kv[key].vtype != _STRING:
            problems.append((None, f"metadata entry {key!r} is not a string{_DAMAGED}"))
    for key in sorted(set(has) - {CRC_HEADER_KEY, CRC_TENSORS_KEY}):
        problems.append((None, f"unknown metadata entry {key!r}{_DAMAGED}"))
    stored_header = header.string(CRC_HEADER_KEY)
    if stored_header is not None:
        got_header = header_crc(buf, header)
        if got_header != stored_header:
            shown = stored_header if _HEX8.fullmatch(stored_header) else repr(stored_header)
            problems.append(
                (
                    None,
                    f"the header (metadata and tensor table) fails its "
                    f"checksum (crc32 {got_header}, stored {shown}): the "
                    "header is damaged",
                )
            )
    sums = _stored_tensor_sums(header, problems)
    sizes = {t.name: t.end - t.begin for t in header.tensors}
    got = crc32_many(
        {t.name: buf[t.begin : t.end] for t in header.tensors if t.name in sums},
        on_done=None if progress is None else lambda n: progress(sizes[n]),
    )
    maybe = " (the header is damaged too: the stored value may be what changed)" if problems else ""
    for t in header.tensors:
        if t.name in got and got[t.name] != sums[t.name]:
            problems.append(
                (
                    t.name,
                    f"tensor {t.name!r} ({t.type_name}) fails its checksum "
                    f"(crc32 {got[t.name]}, stored {sums[t.name]}){maybe}",
                )
            )
    return GGUFCheck(path, len(header.tensors), len(got), True, tuple(problems))


def verify_gguf(path: str | os.PathLike) -> GGUFCheck:
    """:func:`check_gguf`, raising :class:`~microscale.integrity.CorruptDataError` that
    names the file and the first damaged tensor (or the header). A file without stored
    checksums passes unverified (``checksums`` is False)."""
    res = check_gguf(path)
    if res.problems:
        tensor, msg = next(((t, m) for t, m in res.problems if t is not None), res.problems[0])
        more = len(res.problems) - 1
        text = msg if msg.startswith(str(res.path)) else f"{res.path}: {msg}"
        raise CorruptDataError(
            text
            + (f" (and {more} more problem(s))" if more else "")
            + ("" if "damaged" in msg else ": the file is damaged")
        )
    return res

"""Safetensors files, read and written in plain Python + numpy, validated before use.

A ``.safetensors`` file is::

    [8 bytes]  N, little-endian uint64: length of the header
    [N bytes]  JSON header, UTF-8, padded with spaces to a multiple of 8:
               {"__metadata__": {str: str},                       (optional)
                "<tensor name>": {"dtype": "F8_E4M3", "shape": [4096, 256],
                                  "data_offsets": [begin, end]},  (relative to the data)
                ...}
    [rest]     the tensors' bytes, little-endian, C order, back to back

Nothing in it is executable (unlike pickle), but a header is untrusted input. Before any
tensor is handed out we check: the header length fits the file, the header is a JSON
object of known dtypes with non-negative integer shapes, each tensor's byte range has
exactly ``prod(shape) * itemsize`` bytes, lies inside the file, and no two ranges overlap.
A truncated file fails with the name of the first tensor that runs past its end.

Integrity: microscale's writer stores a CRC-32 of every tensor's bytes in the header's
``__metadata__`` under ``"microscale.crc32"`` (a JSON object ``{tensor: 8 hex digits}``;
other readers ignore it). :meth:`TensorStore.get` checks a tensor's checksum (when the file
has one) and that its floating-point values are finite the first time it is read, and
raises :class:`SafetensorsError` naming the file and tensor -- a bit-flipped file is never
computed on.

Large checkpoints are split into shards ``model-00001-of-0000K.safetensors`` next to
``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: shard file}}`` (the Hugging Face convention). Shard names
must be plain file names in the same folder (no ``/`` or ``..``).

float8 and bfloat16 tensors are numpy arrays of ``ml_dtypes`` dtypes (``F8_E4M3`` ->
``float8_e4m3fn``, ``BF16`` -> ``bfloat16``, ...). Tensors are memory-mapped read-only:
reading a header is cheap and a tensor's bytes are only touched when it is used.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from microscale.files import atomic_write_json, atomic_writer
from microscale.integrity import CorruptDataError, check_finite, crc32_many, verify_crc32

__all__ = [
    "DTYPES",
    "CRC_KEY",
    "DTYPE_NAMES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "SafetensorsError",
    "TensorInfo",
    "TensorStore",
    "read_safetensors_header",
    "write_safetensors",
    "write_sharded",
]

# __metadata__ key of the per-tensor CRC-32 checksums (see the module docstring).
CRC_KEY = "microscale.crc32"

# safetensors dtype string -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
# numpy dtype -> safetensors dtype string.
DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Largest header accepted (the safetensors library uses the same 100 MB bound).
MAX_HEADER_BYTES = 100_000_000

if sys.byteorder != "little":  # pragma: no cover - every supported platform
    raise ImportError(
        "microscale.export reads safetensors by memory mapping and needs a little-endian host"
    )


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed, truncated or inconsistent."""


class TensorInfo:
    """Where one tensor lives: file, dtype name, shape, absolute byte range."""

    __slots__ = ("begin", "dtype", "end", "file", "name", "shape")

    def __init__(
        self, name: str, file: Path, dtype: str, shape: tuple[int, ...], begin: int, end: int
    ):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, shape
        self.begin, self.end = begin, end

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.dtype}, {list(self.shape)}, {self.file.name})"


def _dtype_name(dtype: np.dtype) -> str:
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise SafetensorsError(f"big-endian dtype {dt} cannot be stored; convert to little-endian")
    name = DTYPE_NAMES.get(dt)
    if name is None:
        raise SafetensorsError(
            f"dtype {dt} has no safetensors equivalent; expected one of "
            f"{sorted(str(d) for d in DTYPE_NAMES)}"
        )
    return name


def read_safetensors_header(
    path: str | os.PathLike,
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one file's header: ``({name: TensorInfo}, metadata)``."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"safetensors file {str(path)!r} does not exist") from None
    if size < 8:
        raise SafetensorsError(
            f"{path}: {size} bytes is too short for a safetensors file "
            "(expected an 8-byte header length first)"
        )
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(
                f"{path}: header length {n} does not fit the file ({size} bytes; at most "
                f"{min(size - 8, MAX_HEADER_BYTES)} expected) - truncated or not safetensors"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: the header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(
            f"{path}: the header is a JSON {type(header).__name__}, expected an object"
        )
    meta = header.pop("__metadata__", None) or {}
    if not (
        isinstance(meta, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(
                f"{where}: expected exactly the keys dtype, shape, data_offsets, got {entry!r}"
            )
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorsError(
                f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}"
            )
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: shape {shape!r} must be a list of ints >= 0")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(type(o) is int and o >= 0 for o in offs)
            and offs[0] <= offs[1]
        ):
            raise SafetensorsError(
                f"{where}: data_offsets {offs!r} must be [begin, end] with 0 <= begin <= end"
            )
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise SafetensorsError(
                f"{where}: {offs[1] - offs[0]} bytes for dtype {dtype} "
                f"shape {shape}; expected {want}"
            )
        if offs[1] > data_len:
            raise SafetensorsError(
                f"{where}: its data ends at byte {data_start + offs[1]} but the file has "
                f"only {size} bytes (truncated file?)"
            )
        infos[name] = TensorInfo(
            name, path, dtype, tuple(shape), data_start + offs[0], data_start + offs[1]
        )
    spans = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {a!r} and {b!r} overlap in the file")
    return infos, dict(meta)


class TensorStore:
    """Read-only view of the tensors of one checkpoint folder (or a single file).

    ``TensorStore(folder)`` reads ``model.safetensors.index.json`` if present (every shard
    it names), else ``model.safetensors``, else the folder's only ``*.safetensors`` file.
    Every header and the index are validated on construction.

    ``prefix``: the view holds only the tensors whose names start with it, under their
    names without it (a multimodal checkpoint's text model: ``language_model.``); the
    others' names are in ``left_out``.
    """

    def __init__(self, path: str | os.PathLike, *, prefix: str = ""):
        path = Path(path)
        self.root = path if path.is_dir() else path.parent
        self._maps: dict[Path, np.memmap] = {}
        # Names looked up through info()/get(): lets a reader find tensors it never used.
        self.accessed: set[str] = set()
        if path.is_file():
            files = [path]
            weight_map = None
        elif (path / INDEX_NAME).is_file():
            files, weight_map = self._read_index(path / INDEX_NAME)
        elif (path / SINGLE_NAME).is_file():
            files, weight_map = [path / SINGLE_NAME], None
        else:
            found = sorted(path.glob("*.safetensors")) if path.is_dir() else []
            if len(found) != 1:
                raise FileNotFoundError(
                    f"{str(path)!r}: expected {SINGLE_NAME}, {INDEX_NAME} or exactly one "
                    f"*.safetensors file, found {[f.name for f in found]}"
                )
            files, weight_map = found, None
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._crc: dict[str, str] = {}  # tensor -> stored CRC-32 (files microscale wrote)
        self._verified: set[str] = set()
        for file in files:
            infos, meta = read_safetensors_header(file)
            self._crc.update(_stored_crc(file, meta.pop(CRC_KEY, None), infos))
            self.metadata.update(meta)
            for name, info in infos.items():
                if name in self.infos:
                    raise SafetensorsError(
                        f"tensor {name!r} is stored twice: in "
                        f"{self.infos[name].file.name} and {file.name}"
                    )
                if weight_map is not None and weight_map.get(name) != file.name:
                    raise SafetensorsError(
                        f"tensor {name!r} is in {file.name} but the index maps it to "
                        f"{weight_map.get(name)!r}"
                    )
                self.infos[name] = info
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.infos))
            if missing:
                raise SafetensorsError(
                    f"tensor {missing[0]!r} is listed in {INDEX_NAME} (file "
                    f"{weight_map[missing[0]]!r}) but missing from that file"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                )
        self.left_out: list[str] = []
        if prefix:
            self.left_out = sorted(n for n in self.infos if not n.startswith(prefix))
            cut = len(prefix)
            self.infos = {n[cut:]: i for n, i in self.infos.items() if n.startswith(prefix)}
            self._crc = {n[cut:]: c for n, c in self._crc.items() if n.startswith(prefix)}

    def _read_index(self, index: Path) -> tuple[list[Path], dict[str, str]]:
        try:
            obj = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{index}: not a JSON file ({e})") from None
        wm = obj.get("weight_map") if isinstance(obj, dict) else None
        if not (
            isinstance(wm, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items())
        ):
            raise SafetensorsError(f"{index}: expected {{'weight_map': {{tensor: file}}}}")
        files = []
        for fname in sorted(set(wm.values())):
            if Path(fname).name != fname or fname in (".", "..") or "\\" in fname:
                raise SafetensorsError(
                    f"{index}: shard name {fname!r} must be a plain file "
                    "name in the checkpoint folder"
                )
            if not (index.parent / fname).is_file():
                raise FileNotFoundError(f"{index}: shard {fname!r} does not exist")
            files.append(index.parent / fname)
        return files, dict(wm)

    # ------------------------------------------------------------------ queries
    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def names(self) -> list[str]:
        return sorted(self.infos)

    @property
    def checksums(self) -> dict[str, str]:
        """``{tensor: CRC-32}`` stored in the files' headers (empty for files written
        without them); :meth:`get` checks them."""
        return dict(self._crc)

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.root}")
        self.accessed.add(name)
        return self.infos[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array (memory-mapped), verified on first read:
        its stored checksum (if any) and, for floats, that every value is finite."""
        info = self.info(name)
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = mm[info.begin : info.end]
        arr = raw.view(info.np_dtype).reshape(info.shape)
        if name not in self._verified:
            try:
                if name in self._crc:
                    verify_crc32({name: raw}, {name: self._crc[name]}, where=str(info.file))
                check_finite([(name, arr)], where=str(info.file))
            except CorruptDataError as e:
                raise SafetensorsError(str(e)) from None
            self._verified.add(name)
        return arr


# ---------------------------------------------------------------------- writing


def _stored_crc(file: Path, text: str | None, infos: Mapping[str, TensorInfo]) -> dict[str, str]:
    if text is None:
        return {}
    try:
        crc = json.loads(text)
    except json.JSONDecodeError:
        crc = None
    if not (isinstance(crc, dict) and all(isinstance(v, str) for v in crc.values())):
        raise SafetensorsError(
            f"{file}: __metadata__[{CRC_KEY!r}] is not a JSON object of "
            "checksums; the header is damaged"
        )
    unknown = sorted(set(crc) - set(infos))
    if unknown:
        raise SafetensorsError(
            f"{file}: a checksum is stored for tensor {unknown[0]!r}, "
            "which the header does not list; the header is damaged"
        )
    return crc


def _as_array(name: str, x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">":
        raise SafetensorsError(f"tensor {name!r}: big-endian dtype {arr.dtype}")
    # (np.ascontiguousarray would turn a 0-d scalar into shape [1])
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _header_bytes(
    arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    order = sorted(arrays)
    off = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": _dtype_name(a.dtype),
            "shape": list(a.shape),
            "data_offsets": [off, off + a.nbytes],
        }
        off += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, order


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, object],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``tensors`` (name -> array) to ``path`` atomically; returns the file size."""
    path = Path(path)
    arrays = {}
    for name, x in tensors.items():
        if not isinstance(name, str) or not name:
            raise SafetensorsError(f"tensor names must be non-empty strings, got {name!r}")
        arrays[name] = _as_array(name, x)
    sums = json.dumps(crc32_many(arrays), separators=(",", ":"), sort_keys=True)
    raw, order = _header_bytes(arrays, {**(metadata or {}), CRC_KEY: sums})
    size = 8 + len(raw) + sum(a.nbytes for a in arrays.values())
    with atomic_writer(path, "wb", size=size, what="safetensors file") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            f.write(arrays[name].tobytes(order="C"))
    return path.stat().st_size


def write_sharded(
    folder: str | os.PathLike,
    tensors: Mapping[str, object],
    *,
    shard_bytes: int,
    groups: Iterable[Iterable[str]] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards plus an index when their
    total exceeds ``shard_bytes``. ``groups`` keeps related tensors (one layer's weight
    and scales) in the same shard. Returns the file names written."""
    folder = Path(folder)
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes={shard_bytes}: expected a positive byte count")
    arrays = {name: _as_array(name, x) for name, x in tensors.items()}
    total = sum(a.nbytes for a in arrays.values())
    if total <= shard_bytes:
        write_safetensors(folder / SINGLE_NAME, arrays, metadata)
        return [SINGLE_NAME]
    units: list[list[str]] = []
    seen: set[str] = set()
    for group in groups or ():
        unit = [n for n in group if n in arrays and n not in seen]
        seen.update(unit)
        if unit:
            units.append(unit)
    units += [[n] for n in sorted(arrays) if n not in seen]
    shards: list[list[str]] = [[]]
    size = 0
    for unit in units:
        nbytes = sum(arrays[n].nbytes for n in unit)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += nbytes
    k = len(shards)
    names = [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    weight_map = {}
    for fname, members in zip(names, shards, strict=True):
        write_safetensors(folder / fname, {n: arrays[n] for n in members}, metadata)
        weight_map.update({n: fname for n in members})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_json(folder / INDEX_NAME, index)
    return names + [INDEX_NAME]

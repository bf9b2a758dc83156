"""llama.cpp's importance matrix as the file ``llama-quantize --imatrix FILE`` reads
(measured by :func:`microscale.ptq.imatrix.collect_imatrix`).

For every linear layer ``Y = X W^T`` of the blocks, llama.cpp's ``llama-imatrix`` sums the
squares of the layer's input over the calibration tokens, per input column, and counts
the tokens::

    in_sum2[j] = sum_t X[t, j]^2        counts = number of tokens t

``llama-quantize`` weights each column's rounding error by the mean of squares
``in_sum2 / counts`` (ggml's ``quant_weights``; microscale's ``quantize_ggml(x, fmt,
imatrix)`` takes the same vector). Input columns are the weight's columns in llama.cpp's
orientation, which no export reorders (the q/k row permutation for RoPE moves rows).

The file is GGUF (current llama.cpp, ``tools/imatrix``), its tensors in name order::

    key or tensor           type              value
    general.type            string            "imatrix"
    imatrix.datasets        [string]          the calibration text's names
    imatrix.chunk_count     u32               calibration sequences (llama.cpp: chunks)
    imatrix.chunk_size      u32               tokens per sequence
    <weight>.in_sum2        F32 [n_mat, K]    sum of squares per input column
    <weight>.counts         F32 [n_mat, 1]    tokens per matrix

``<weight>`` is the weight's GGUF name (``blk.0.attn_q.weight``, as ``write_gguf`` names
it; :func:`write_imatrix` maps microscale's layer paths to it); ``n_mat`` is 1 for a dense layer (a mixture of experts has one row per expert).
:func:`write_imatrix` writes it and :func:`read_imatrix` reads it back (a file of
llama.cpp's own too), as the mean of squares.

    >>> im = collect_imatrix(model, batches)            # doctest: +SKIP
    >>> write_imatrix("imatrix.gguf", im, datasets=["stdlib"])  # doctest: +SKIP
    # llama-quantize --imatrix imatrix.gguf model-bf16.gguf model-q4_k_m.gguf Q4_K_M
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from microscale.export.gguf.arch import tensor_name

__all__ = ["Imatrix", "read_imatrix", "write_imatrix"]

GENERAL_TYPE = "imatrix"
DATASETS, CHUNK_COUNT, CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
IN_SUM2, COUNTS = ".in_sum2", ".counts"


class Imatrix(Protocol):
    """What :func:`write_imatrix` writes (:class:`microscale.ptq.imatrix.Imatrix`)."""

    # linear layer path (``layers.0.attn.q_proj``) -> float [K]: sum over the tokens of
    # each input column's square
    in_sum2: Mapping[str, np.ndarray]
    tokens: int  # tokens summed (every layer sees every token)
    sequences: int  # calibration sequences (llama.cpp's chunk count)
    seq_len: int  # tokens per sequence (llama.cpp's chunk size)


def write_imatrix(path: str | os.PathLike, im: Imatrix, *, datasets: Sequence[str]) -> None:
    """Write ``im`` as llama.cpp's GGUF imatrix (the table in the module doc), atomically,
    each block linear under its GGUF weight name (``layers.0.attn.q_proj`` ->
    ``blk.0.attn_q.weight``)."""
    import gguf

    from microscale.files import atomic_writer

    w = gguf.GGUFWriter(None, GENERAL_TYPE)
    w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama.cpp's file has none
    w.add_string("general.type", GENERAL_TYPE)
    w.add_array(DATASETS, [str(d) for d in datasets])
    w.add_uint32(CHUNK_COUNT, im.sequences)
    w.add_uint32(CHUNK_SIZE, im.seq_len)
    named = {f"{tensor_name(p)}.weight": v for p, v in im.in_sum2.items()}
    for name in sorted(named):
        w.add_tensor(name + IN_SUM2, np.asarray(named[name], np.float32).reshape(1, -1))
        w.add_tensor(name + COUNTS, np.full((1, 1), im.tokens, np.float32))
    with atomic_writer(path, "wb", what="imatrix file") as fh:
        w.open_output_file(Path(fh.name))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def read_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The mean of squares ``in_sum2 / counts`` per GGUF weight name of an imatrix GGUF
    (``[K]`` for a dense layer, ``[n_mat, K]`` otherwise); a file that is not one, or an
    entry without its counts, raises ``ValueError`` naming the file and the entry."""
    import gguf

    try:
        r = gguf.GGUFReader(os.fspath(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"imatrix {os.fspath(path)!r}: not a GGUF file ({e})") from None
    field = r.fields.get("general.type")
    kind = field.contents() if field is not None else None
    if kind != GENERAL_TYPE:
        raise ValueError(
            f"imatrix {os.fspath(path)!r}: general.type is {kind!r}, not {GENERAL_TYPE!r} "
            "(a model GGUF, not an importance matrix?)"
        )
    arrays = {t.name: np.asarray(t.data, np.float32) for t in r.tensors}
    out = {}
    for name, s in arrays.items():
        if not name.endswith(IN_SUM2):
            continue
        weight = name[: -len(IN_SUM2)]
        counts = arrays.get(weight + COUNTS)
        if counts is None:
            raise ValueError(f"imatrix {os.fspath(path)!r}: {weight} has no {COUNTS} tensor")
        s = s.reshape(counts.size, -1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(counts.reshape(-1, 1) > 0, s / counts.reshape(-1, 1), 0.0)
        out[weight] = mean[0] if counts.size == 1 else mean
    return out

"""Output layouts and folder kinds: one registry row each, and one :func:`detect`.

A **layout** is a way of storing a model on disk. Each is one :class:`Layout` row with
``detect`` (does this path hold it?), ``write`` and ``read``:

==================  =====================================================  ===============
name                what                                                   single file
==================  =====================================================  ===============
compressed-tensors  HF folder, ``quantization_config`` of vLLM's            no
                    compressed-tensors
modelopt            HF folder + ``hf_quant_config.json`` (TensorRT-LLM)    no
hf                  plain HF folder: float weights, no quantization         no
gguf                one llama.cpp file (:mod:`~microscale.export.gguf`)     yes
microscale          ``model.safetensors`` + ``manifest.json``: PTQ's        no
                    weights as PTQ holds them (:mod:`~.manifest`)
==================  =====================================================  ===============

A row is also what its callers know of a layout (no module outside ``export/`` branches
on a layout's name; ``tests/test_layout_names.py``): whether it stores input scales
(``weights_only`` says why not, and :meth:`Layout.refuse_activations` is the one refusal),
one file or a folder, whether a quantize output may hold it, the token embedding formats it
stores and how a reader decodes them (``embed_formats``, ``embed_values``;
:func:`table_values` for the search), the formats it stores as themselves
(``check_formats``), the layers it restricts (``candidates``) and ``microscale quantize``'s
preset for it (``quantize_preset``).

What kind of *output* a path is (a training run, a quantize output, an export folder, a
GGUF file) is :func:`microscale.outputs.kind_of`'s answer, and the file names are its
owners'; :func:`detect` here says which *layout* a model folder or file holds.

The HF-style quantized layouts (compressed-tensors, modelopt) get their rows from
:data:`microscale.export.hflayouts.HF_QUANT`: how each names its tensors and describes its
quantization, which :func:`~microscale.export.export_checkpoint` and
:func:`~microscale.export.read_checkpoint` use; a new one is one ``HFQuant`` row there.
Any other layout is one :class:`Layout` row in :data:`KINDS` plus its tests (the
``microscale`` row was moved here from ``ptq/report.py`` that way).

:func:`detect` returns the first row of :data:`KINDS` whose ``detect`` matches, in the
order above.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.gguf.arch import gguf_layer_candidates
from microscale.export.gguf.imatrix import write_imatrix
from microscale.export.gguf.tensors import EMBED_FORMATS, GGUF_FORMATS, embed_values, gguf_format
from microscale.export.gguf.to_hf import read_gguf_params
from microscale.export.gguf.vocab import gguf_vocab
from microscale.export.gguf.writer import write_gguf
from microscale.export.hflayouts import HF_QUANT
from microscale.export.hfquant import quant_method
from microscale.export.manifest import MANIFEST, manifest_params, write_manifest
from microscale.export.reader import read_checkpoint
from microscale.export.writer import DEFAULT_SHARD_BYTES, export_checkpoint
from microscale.formats import get_weight_format, weight_only
from microscale.model import ModelConfig
from microscale.outputs import ExportFolder, GGUFFile

__all__ = [
    "DEFAULT_LAYOUT",
    "KINDS",
    "Kind",
    "Layout",
    "detect",
    "get_layout",
    "layout_names",
    "stored_embed_formats",
    "table_values",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kind:
    """Something :func:`detect` recognizes at a path."""

    # The name errors and reports use ("run", "compressed-tensors", ...).
    name: str
    # What it is, in a few words (help texts, errors).
    description: str
    # Whether the path holds this kind (file names and config fields only; never raises
    # for a readable path).
    detect: Callable[[Path], bool]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout(Kind):
    """A layout: a :class:`Kind` microscale also writes and reads."""

    # Written as one file (the others are folders).
    single_file: bool
    # write() takes a model (False: PTQ's weights, see `write`).
    writes_model: bool
    # Stores quantized weights (False: float weights only).
    quantized: bool
    # An HF-style folder: read_checkpoint reads it with its packed bytes (a re-export
    # keeps them).
    hf_folder: bool
    # Why it stores no static scales of quantized layer inputs (W4A4 / W8A8), as the
    # refusal of activations=true says it; None: it stores them.
    weights_only: str | None
    # A `microscale quantize` output may hold it (its checkpoint/ or model.gguf).
    quantize_output: bool
    # What `microscale quantize layout=NAME` starts from: QuantizeConfig overrides (the
    # formats it searches, its uniform points, the heuristic's), before the user's keys.
    quantize_preset: Mapping[str, Any]
    # check_formats(formats) raises for a format the layout cannot store as itself (the
    # search's candidates, checked before any work; ggml's block types, gguf's only).
    check_formats: Callable[[Sequence[str]], None] | None
    # The formats it stores the token embedding / tied LM head in (export's embed_format,
    # the search's table candidates); (): as the float dtype only.
    embed_formats: tuple[str, ...]
    # embed_values(table [vocab, d_model], fmt) -> the float32 values a reader decodes from
    # the table stored in fmt (one of embed_formats); None when embed_formats is ().
    embed_values: Callable[[Any, str], Any] | None
    # check_tokenizer(tokenizer.json) raises for a tokenizer the layout cannot store
    # (called before any work); None: it stores any.
    check_tokenizer: Callable[[Path], Any] | None
    # The writer. Model layouts: write(model, out, *, config, layer_formats, activations,
    # input_amax, tokenizer, dtype, shard_bytes, overwrite) -> a result with .path,
    # .layers {linear path: format} and .tensor_bytes. The microscale row stores PTQ's
    # weights instead: write(out, *, params, weights, activations, input_amax, rules).
    write: Callable[..., Any]
    # candidates(model config, formats) -> {linear path: the formats it may take} for the
    # layers this layout restricts (GGUF: no NVFP4 where llama.cpp's graph drops the
    # tensor scale), refusing a model it cannot store at all; None: every format anywhere.
    candidates: Callable[[ModelConfig, Sequence[str]], dict[str, tuple[str, ...]]] | None
    # read(path) -> ({parameter path: float array, kernels [in, out]}, ModelConfig or None
    # when the layout stores none): every weight decoded.
    read: Callable[[Path], tuple[dict[str, np.ndarray], ModelConfig | None]]
    # imatrix(path, im, *, datasets): writes the importance matrix measured on the calibration
    # text (an Imatrix of ptq.imatrix) as the runtime's quantizer reads it, beside the model
    # of a `microscale quantize` output (llama.cpp: imatrix.gguf); None: not written.
    imatrix: Callable[..., None] | None = None

    @property
    def input_scales(self) -> bool:
        """Whether it stores static scales of quantized layer inputs."""
        return self.weights_only is None

    def refuse_activations(self, given: str = "activations=true") -> None:
        """The one refusal of quantized layer inputs for a layout that stores weights
        only: a ValueError naming ``given`` (the option as the caller spelled it) and why."""
        if self.weights_only is not None:
            raise ValueError(f"{given} with layout={self.name}: {self.weights_only}; drop it")


# ----------------------------------------------------------------------------- detection


def _quant_method(p: Path) -> str | None:
    """The quantization method of an HF-style folder as :func:`read_checkpoint` decides it
    ("hf" for none); None when ``p`` has no ``config.json``. An unreadable config.json
    counts as "hf" (the reader then says what is wrong with it)."""
    f = p / ExportFolder.CONFIG
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "hf"
    return quant_method(cfg, p) or "hf"


# ----------------------------------------------------------------------------- the rows' I/O


def _hf_params(p: Path) -> tuple[dict[str, np.ndarray], ModelConfig]:
    ck = read_checkpoint(p, dequantize=True)
    return {k: np.asarray(v) for k, v in ck.params.items()}, ck.config


def _write_hf_family(
    model: Any, out: str | os.PathLike, *, layout: str, shard_bytes: int | None = None, **options
) -> Any:
    return export_checkpoint(
        model,
        out,
        layout=layout,
        shard_bytes=DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes,
        **options,
    )


def _write_gguf(
    model: Any,
    out: str | os.PathLike,
    *,
    activations: bool | None = None,
    input_amax: Any = None,
    shard_bytes: int | None = None,
    **options,
) -> Any:
    if activations or input_amax is not None:
        get_layout("gguf").refuse_activations("activations")
    if shard_bytes is not None:
        raise ValueError(f"shard_bytes={shard_bytes}: a GGUF is one file, never sharded")
    return write_gguf(model, out, **options)


def _check_gguf_formats(formats: Sequence[str]) -> None:
    for f in formats:
        if gguf_format(f) != f:
            raise ValueError(
                f"formats: llama.cpp has no native {f} (it would run as {gguf_format(f)}); "
                f"layout=gguf takes ggml's block types ({', '.join(_GGUF_GGML)}, ...) and "
                f"{', '.join(_GGUF_CANDIDATES)}"
            )


def _no_ggml_types(formats: Sequence[str]) -> None:
    """The check of a layout that stores no ggml block type (only a GGUF holds their bytes)."""
    ggml = [f for f in formats if weight_only(get_weight_format(f))]
    if ggml:
        raise ValueError(
            f"formats: {', '.join(ggml)} (ggml's block types) are stored by layout=gguf only"
        )


# What ggml / llama.cpp runs natively. The GGUF layout's quantize search takes ggml's own
# block types by default: the K-quants llama-quantize's presets mix (Q3_K .. Q6_K), the
# 32-blocks it falls back to where a row is not a multiple of 256 (Q4_0, Q5_0), Q8_0 and
# BF16. The FP4 search (runtimes with fast NVFP4 / MXFP4 kernels) is _GGUF_CANDIDATES.
_GGUF_GGML = ("q3_k", "q4_0", "q4_k", "q5_0", "q5_k", "q6_k", "q8_0", "bf16")
_GGUF_CANDIDATES = (*GGUF_FORMATS, "bf16")
# The FP4 search over the GGUF layout's preset (QuantizeConfig.for_gguf(fp4=True)): NVFP4,
# MXFP4, Q8_0 and BF16, the heuristic's 8-bit layers in Q8_0, the budget over the linears.
GGUF_FP4_PRESET: dict[str, Any] = {
    "formats": _GGUF_CANDIDATES,
    "uniform_formats": _GGUF_CANDIDATES,
    "heuristic": ("q8_0", "nvfp4"),
    "count_other_params": False,
}

_HF: dict[str, Any] = dict(
    single_file=False,
    writes_model=True,
    hf_folder=True,
    check_tokenizer=None,
    read=_hf_params,
    candidates=None,
    quantize_preset={},
    check_formats=_no_ggml_types,
    embed_formats=(),
    embed_values=None,
)  # what the HF-style folders share
KINDS: tuple[Kind, ...] = (
    # one row per HF-style quantized layout (microscale.export.hfquant)
    *(
        Layout(
            name=q.name,
            description=q.description,
            detect=functools.partial(lambda p, name: _quant_method(p) == name, name=q.name),
            quantized=True,
            weights_only=None,
            quantize_output=True,
            write=functools.partial(_write_hf_family, layout=q.name),
            **_HF,
        )
        for q in HF_QUANT.values()
    ),
    Layout(
        name="hf",
        description="a plain HF folder of a supported family (config.json + *.safetensors)",
        # any other config.json: read_checkpoint names the unsupported quant_method
        detect=lambda p: _quant_method(p) not in (None, *HF_QUANT),
        quantized=False,
        weights_only="the hf layout stores float weights only (no quantization)",
        quantize_output=False,
        write=functools.partial(_write_hf_family, layout="hf"),
        **_HF,
    ),
    Layout(
        name="gguf",
        description="a llama.cpp GGUF file",
        detect=GGUFFile.detect,
        single_file=True,
        writes_model=True,
        quantized=True,
        hf_folder=False,
        weights_only="a GGUF stores weights only (llama.cpp quantizes activations itself)",
        quantize_output=True,
        imatrix=write_imatrix,
        quantize_preset={
            "formats": _GGUF_GGML,
            "uniform_formats": ("q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "bf16"),
            "heuristic": ("q6_k", "q4_k"),  # as Q4_K_M: Q6_K first/last blocks and down
            "count_other_params": True,  # budget= is the whole file's bits per weight
        },
        check_formats=_check_gguf_formats,
        embed_formats=EMBED_FORMATS,
        embed_values=embed_values,
        check_tokenizer=gguf_vocab,
        candidates=gguf_layer_candidates,
        read=read_gguf_params,
        write=_write_gguf,
    ),
    Layout(
        name="microscale",
        description="microscale's own layout (model.safetensors + manifest.json)",
        detect=lambda p: (p / MANIFEST).is_file(),
        single_file=False,
        writes_model=False,
        quantized=True,
        hf_folder=False,
        weights_only=None,
        quantize_output=True,
        quantize_preset={},
        check_formats=_no_ggml_types,
        embed_formats=(),
        embed_values=None,
        check_tokenizer=None,
        candidates=None,
        read=manifest_params,
        write=write_manifest,
    ),
)


# What `microscale export` and `microscale quantize` write without layout=.
DEFAULT_LAYOUT = "compressed-tensors"


def stored_embed_formats() -> tuple[str, ...]:
    """Every format some layout stores a token embedding / tied LM head in (the union of
    the rows' ``embed_formats``, in registry order): the search's table candidates."""
    out: list[str] = []
    for k in KINDS:
        for f in getattr(k, "embed_formats", ()):
            if f not in out:
                out.append(f)
    return tuple(out)


def table_values(table: Any, fmt: str) -> Any:
    """The float32 values a reader decodes from the token embedding ``table`` ``[vocab,
    d_model]`` stored in ``fmt``, by the first layout that stores it so (what the search
    scores a table format with); ValueError for a format no layout stores a table in."""
    for k in KINDS:
        if isinstance(k, Layout) and fmt in k.embed_formats and k.embed_values is not None:
            return k.embed_values(table, fmt)
    raise ValueError(
        f"embed format {fmt!r}: no layout stores a token embedding in it; expected one of "
        f"{', '.join(stored_embed_formats())}"
    )


def layout_names(**where: bool) -> tuple[str, ...]:
    """The layouts' names, in registry order; ``where``: only the rows with these field
    values (``layout_names(writes_model=True)``: what ``microscale export`` writes)."""
    for f in where:
        if f not in {x.name for x in dataclasses.fields(Layout)}:
            raise TypeError(f"layout_names({f}=...): Layout has no field {f!r}")
    return tuple(
        k.name
        for k in KINDS
        if isinstance(k, Layout) and all(getattr(k, f) == v for f, v in where.items())
    )


def get_layout(name: str) -> Layout:
    """The layout row called ``name``; ValueError naming the choices otherwise."""
    for k in KINDS:
        if isinstance(k, Layout) and k.name == name:
            return k
    raise ValueError(f"layout {name!r}: expected one of {', '.join(layout_names())}")


def detect(path: str | os.PathLike) -> Kind | None:
    """Which layout ``path`` holds: the first row of :data:`KINDS` that matches, None for
    anything else (a missing path, a training run, an unrelated folder)."""
    p = Path(path).expanduser()
    return next((k for k in KINDS if k.detect(p)), None)

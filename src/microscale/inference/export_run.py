"""``export_run``: a training run, a quantize output or an HF folder written in a layout.

What ``microscale export`` does, as a library function (the command only parses its
flags). The source is recognized by :func:`microscale.export.detect`; the output is
written by the layout's row of :mod:`microscale.export.registry`. It sits above
``microscale.export`` because ``activations=True`` calibrates the input scales with the
inference engine.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Literal

from microscale.data import DataConfig, check_vocab_fits, load_data, load_tokenizer
from microscale.export import Checkpoint, read_checkpoint
from microscale.export.layouts import LayerFormats
from microscale.export.reader import build_model
from microscale.export.registry import (
    DEFAULT_LAYOUT,
    Layout,
    detect,
    get_layout,
    layout_names,
)
from microscale.export.writer import check_export_out
from microscale.files import check_input_dir, check_output_file, lock_folder
from microscale.model import PrecisionRules
from microscale.outputs import ExportFolder, QuantizeOutput, TrainingRun
from microscale.ptq.run import (
    calibration_batches,
    folder_data_config,
    input_amax,
    run_data_config,
)
from microscale.train import load_checkpoint

__all__ = ["CALIB_BATCHES", "ExportConfig", "export_run"]

CALIB_BATCHES = 8  # calibration batches of activations=True by default


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """What ``microscale export`` takes as ``key=value``: the options of
    :func:`export_run` as the command line writes them (``formats`` and ``rules`` as
    text or a file, ``shard_size`` in GB)."""

    # Output layout: compressed-tensors, modelopt, hf (float weights) or gguf (llama.cpp,
    # one file).
    layout: str = DEFAULT_LAYOUT
    # Number formats: one format name for every layer (nvfp4, fp8_e4m3, mxfp4, mxfp8, q8_0,
    # bf16) or JSON {layer path: format} (text or a file); None: NVFP4, a packed folder's
    # own formats, or the allocation a run trained with.
    formats: str | None = None
    # A PrecisionRules JSON file (e.g. RUN/precision_rules.json); not with formats.
    rules: str | None = None
    # Quantize layer inputs too (W4A4 / W8A8) with calibrated static scales.
    activations: bool = False
    # With activations: calibration batches; None: CALIB_BATCHES.
    calib_batches: int | None = None
    # With activations: the calibration corpus; None: the run's own corpus.
    corpus: str | None = None
    # Checkpoint step of a training run folder; None: the latest.
    step: int | None = None
    # dtype of the unquantized tensors.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # GGUF only: the token embedding / tied LM head's format (bf16, q8_0, mxfp4); None: the
    # format a quantize output's search chose (its report.json embed_format), else
    # unquantized, as dtype.
    embed_format: str | None = None
    # Shard a folder's weights above this many GB; None: the writer's default (5 GB).
    shard_size: float | None = None
    # Replace an existing output (an earlier export).
    overwrite: bool = False

    def __post_init__(self):
        valid = layout_names(writes_model=True)
        if self.layout not in valid:
            raise ValueError(f"layout={self.layout!r}: expected one of {', '.join(valid)}")
        if self.formats is not None and self.rules is not None:
            raise ValueError("formats= and rules= both give the layers' formats; give one")
        for name in ("calib_batches", "step"):
            v, lo = getattr(self, name), int(name == "calib_batches")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise ValueError(f"{name}={v!r}: expected an integer >= {lo} or none")
        s = self.shard_size
        if s is not None and not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
            raise ValueError(f"shard_size={s!r}: expected a number of GB > 0 or none")


def export_run(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    layout: str = DEFAULT_LAYOUT,
    formats: LayerFormats = None,
    activations: bool = False,
    calib_batches: int | None = None,
    data: str | None = None,
    step: int | None = None,
    dtype: str = "bfloat16",
    shard_bytes: int | None = None,
    embed_format: str | None = None,
    overwrite: bool = False,
) -> Any:
    """Write the model of ``source`` to ``out`` in ``layout``; returns the layout's result
    (``.path``, ``.layers`` {linear path: format}, ``.tensor_bytes``).

    Args:
      source: a training run folder (its latest checkpoint, or ``step``), a ``microscale
        quantize`` output (its HF-style ``checkpoint/``) or an HF-style folder (plain or
        packed: converted between layouts byte for byte when ``formats`` is None).
      out: the output folder (a file for a single-file layout such as gguf).
      layout: a layout name of :mod:`microscale.export.registry`.
      formats: per-layer formats (a format name, {layer path: format} or a
        PrecisionRules); None: NVFP4, a packed folder's own formats, or the allocation a
        run trained with (``precision.kind=rules``, ``precision.kind=sensitivity``).
      activations: quantize layer inputs too (W4A4 / W8A8) with static scales calibrated
        on ``calib_batches`` (default :data:`CALIB_BATCHES`) batches of ``data`` (default:
        the run's corpus).
      step: the run's checkpoint step (default: latest).
      dtype: dtype of the unquantized tensors.
      shard_bytes: shard a folder's weights above this many bytes (default 5 GB).
      embed_format: the token embedding / LM head's format in a GGUF (``bf16``, ``q8_0``,
        ``mxfp4``; :func:`~microscale.export.gguf.writer.write_gguf`); None: the format a
        quantize output's search chose (``report.json``'s ``embed_format``, written with
        ``count_other_params=true``), else unquantized.
      overwrite: replace an existing output (an earlier export).
    """
    row = get_layout(layout)
    if row.single_file:
        check_output_file(out, what="--out", overwrite=overwrite)
    else:
        check_export_out(out, overwrite=overwrite)
    with lock_folder(out):  # before any work; held until the end
        return _export_run(
            source,
            out,
            row,
            formats=formats,
            activations=activations,
            calib_batches=calib_batches,
            data=data,
            step=step,
            dtype=dtype,
            shard_bytes=shard_bytes,
            embed_format=embed_format,
            overwrite=overwrite,
        )


def _check_options(
    row: Layout, *, activations: bool, calib_batches, data, shard_bytes, embed_format
) -> None:
    """ValueError naming an option ``row`` or the other options leave without effect."""
    if activations:
        row.refuse_activations("activations=True")
    unused = [
        (
            row.single_file and shard_bytes is not None,
            f"shard_bytes={shard_bytes}",
            f"with layout={row.name!r} (it writes one file)",
        ),
        (
            not activations and calib_batches is not None,
            f"calib_batches={calib_batches}",
            "without activations (only layer inputs are calibrated)",
        ),
        (
            not activations and data is not None,
            f"data={data!r}",
            "without activations (only layer inputs are calibrated)",
        ),
        (
            not row.embed_formats and embed_format is not None,
            f"embed_format={embed_format!r}",
            f"with layout={row.name!r} (it stores the token embedding as dtype)",
        ),
    ]
    for bad, what, why in unused:
        if bad:
            raise ValueError(f"{what} has no effect {why}")


def _searched_embed_format(source) -> str | None:
    """The token embedding / LM head format a quantize output's search chose (its
    ``report.json``'s ``embed_format``); None for another source or an unsearched one."""
    src = Path(source)
    if not src.is_dir() or not QuantizeOutput.detect(src):
        return None
    got = QuantizeOutput.read_report(src).embed_format
    return got if isinstance(got, str) else None


def _source_folder(source) -> Path:
    """The folder to read: ``source``, or a quantize output's HF-style ``checkpoint/``."""
    src = check_input_dir(
        source,
        what="--model",
        expected="a training run folder, a quantize output or an HF model folder",
    )
    if not QuantizeOutput.detect(src):
        return src
    model = QuantizeOutput.model(src)
    found = detect(model)
    if isinstance(found, Layout) and found.single_file:
        raise ValueError(
            f"--model {str(src)!r} is a quantize output that already holds "
            f"its model as {found.description}: {str(model)!r}"
        )
    if not (isinstance(found, Layout) and found.hf_folder):
        raise FileNotFoundError(
            f"--model {str(src)!r}: a quantize output without an "
            "HF-style checkpoint/ (quantized with layout=microscale?)"
        )
    return model


def _calibrate_inputs(model, config, data: DataConfig | None, calib_batches) -> Any:
    """Each linear layer's input amax for static activation scales: quantize's calibrator
    (:mod:`microscale.ptq.run`) on ``calib_batches`` of the batches it cuts from ``data``
    (seed 0, quantize's default), so ``quantize activations=true calib_tokens=`` the same
    number of tokens writes the same scales."""
    if data is None:
        raise ValueError("activations=true needs calibration data: pass corpus=PATH")
    loaded = load_data(data)
    check_vocab_fits(loaded.vocab_size, config.vocab_size, what=f"data {data.corpus!r}")
    batches, _ = calibration_batches(loaded, seed=0, n_batches=calib_batches or CALIB_BATCHES)
    nnx_model = build_model(config, model.params) if isinstance(model, Checkpoint) else model
    return input_amax(nnx_model, batches)


def _export_run(
    source,
    out,
    row: Layout,
    *,
    formats,
    activations,
    calib_batches,
    data,
    step,
    dtype,
    shard_bytes,
    embed_format,
    overwrite,
) -> Any:
    _check_options(
        row,
        activations=activations,
        calib_batches=calib_batches,
        data=data,
        shard_bytes=shard_bytes,
        embed_format=embed_format,
    )
    if embed_format is None and row.embed_formats:
        embed_format = _searched_embed_format(source)
    src = _source_folder(source)
    tokenizer = None
    tok_file = src / ExportFolder.TOKENIZER  # a run's too (TrainingRun.TOKENIZER)
    if row.check_tokenizer is not None and tok_file.is_file():
        row.check_tokenizer(tok_file)  # one it cannot store: refused before the model is read
    kind = detect(src)
    if TrainingRun.detect(src):
        model, tcfg, _ = load_checkpoint(src, step)
        config = tcfg.model
        if formats is None and tcfg.own_allocation:
            # a run trained with an allocation (QAT, sensitivity-chosen bf16 layers)
            # exports that allocation
            formats = PrecisionRules.load(src / TrainingRun.RULES)
        if tok_file.is_file():
            tokenizer = load_tokenizer(tok_file)
        calib_data: DataConfig | None = run_data_config(tcfg.data, corpus=data)
    elif isinstance(kind, Layout) and kind.hf_folder:
        # A packed folder without formats is re-written as is (layout conversion keeps
        # its bytes); otherwise its weights are decoded and quantized again (with
        # activations, export_checkpoint keeps the folder's weight formats).
        ck = read_checkpoint(
            src, dequantize=not row.single_file and (formats is not None or activations)
        )
        if formats is None and not kind.quantized and row.quantized:
            formats = "nvfp4"  # a float folder written in a quantized layout
        model, config, tokenizer = ck, ck.config, ck.tokenizer()
        calib_data = (
            None if data is None else folder_data_config(data, tok_file, config.max_seq_len)
        )
    else:
        raise FileNotFoundError(
            f"--model {str(src)!r}: neither a training run "
            "(config.yaml + checkpoints/) nor an HF model folder"
        )
    input_amax = (
        _calibrate_inputs(model, config, calib_data, calib_batches) if activations else None
    )
    # a tokenizer.json brings its tokenizer_config.json (special tokens, chat template)
    extra = {} if embed_format is None else {"embed_format": embed_format}
    return row.write(
        model,
        out,
        config=config,
        layer_formats=formats,
        activations=activations,
        input_amax=input_amax,
        dtype=dtype,
        tokenizer=tok_file if tok_file.is_file() else tokenizer,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        **extra,
    )

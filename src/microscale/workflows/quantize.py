"""A model folder -> quantized outputs: the thin layer over :func:`~microscale.ptq.quantize_model`.

It reads training runs (``microscale.train``) and quantizes them (``microscale.ptq``), and
``train`` is itself a client of ``ptq`` (``train.adaptive``), so it sits above both.
``quantize_run(checkpoint, out_dir, config)`` takes what ``train init_from=`` takes
(:func:`microscale.train.init.check_model_source`, with its errors): a training run (its
corpus and tokenizer), an HF folder or a quantize output (the text of ``corpus=``, default
:data:`MODEL_DEFAULT_CORPUS`, in windows of :data:`MODEL_SEQ_LEN` tokens); a run trained
with an allocation has it evaluated too (:func:`trained_allocation`), and
:func:`~microscale.ptq.report.write_outputs` writes the outputs. The sources, the held-out
split and the outputs: docs/quantize.md, docs/ptq/real-model.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from microscale.data import check_vocab_fits, load_data
from microscale.export.reader import build_model
from microscale.export.registry import DEFAULT_LAYOUT, get_layout, layout_names
from microscale.files import lock_folder
from microscale.outputs import ExportFolder, OutputKind, QuantizeOutput, TrainingRun
from microscale.ptq.config import QuantizeConfig
from microscale.ptq.imatrix import collect_imatrix
from microscale.ptq.pipeline import quantize_model
from microscale.ptq.problem import check_quantize_budget
from microscale.ptq.report import check_quantize_out, check_quantize_space, write_outputs
from microscale.ptq.result import QuantizeResult
from microscale.ptq.run import (
    MODEL_EVAL_BATCHES,
    MODEL_ROWS,
    MODEL_SEQ_LEN,
    calibration_batches,
    folder_data_config,
    run_data_config,
    trained_allocation,
)
from microscale.train import load_checkpoint
from microscale.train.init import (
    check_model_source,
    load_init_weights,
    quantize_calibration,
    quantized_run,
    source_kind,
    source_model,
)

__all__ = [
    "MODEL_DEFAULT_CORPUS",
    "MODEL_EVAL_BATCHES",
    "MODEL_ROWS",
    "MODEL_SEQ_LEN",
    "QuantizeRunConfig",
    "quantize_run",
]


# A model folder (HF, or a quantize output without its run): the text without corpus=
# (its windows: microscale.ptq.run's MODEL_SEQ_LEN, MODEL_ROWS, MODEL_EVAL_BATCHES).
MODEL_DEFAULT_CORPUS = "stdlib"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeRunConfig:
    """The options of :func:`quantize_run` beside its :class:`QuantizeConfig` (what
    ``microscale quantize`` takes as ``key=value`` next to the QuantizeConfig keys)."""

    # Output layout: compressed-tensors, modelopt, microscale (own safetensors + manifest)
    # or gguf (searches only what llama.cpp runs natively; writes OUT/model.gguf).
    layout: str = DEFAULT_LAYOUT
    # Calibration/evaluation corpus (a text file or folder, a .jsonl, stdlib, ...) tokenized
    # with the model's own tokenizer; None: a run's own corpus, stdlib for an HF folder.
    corpus: str | None = None
    # Checkpoint step of a training run folder; None: the latest.
    step: int | None = None
    # Validation batches for perplexity; None: the run's (8 batches of 2 x 512 tokens for
    # a model folder).
    eval_batches: int | None = None
    # Replace an existing non-empty output folder (an earlier quantize output only); as
    # for export, an existing one is refused without it.
    overwrite: bool = False

    def __post_init__(self):
        valid = layout_names(quantize_output=True)
        if self.layout not in valid:
            raise ValueError(f"layout={self.layout!r}: expected one of {', '.join(valid)}")
        for name, lo in (("step", 0), ("eval_batches", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise ValueError(f"{name}={v!r}: expected an integer >= {lo} or none")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite={self.overwrite!r}: expected true or false")


def quantize_run(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: QuantizeConfig | None = None,
    *,
    corpus: str | None = None,
    step: int | None = None,
    eval_batches: int | None = None,
    layout: str = DEFAULT_LAYOUT,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> QuantizeResult:
    """Quantize a training run, an HF model folder (a family of
    :data:`microscale.model.FAMILIES`) or a quantize output's model (see the module doc).
    Returns the result.

    ``corpus``: calibrate and evaluate on this corpus (a run's tokenizer settings; a model
    folder's own tokenizer); ``step``: checkpoint step of a run (default latest);
    ``eval_batches``: validation batches (default: the run's ``data.eval_batches``,
    :data:`MODEL_EVAL_BATCHES` for a model folder); ``layout``: checkpoint layout
    ("compressed-tensors", "modelopt", "microscale" or "gguf"); ``overwrite``: replace an
    earlier quantize output at ``out_dir`` (without it an existing non-empty ``out_dir`` is
    refused before any work, as ``export`` refuses one).
    """
    cfg = QuantizeConfig() if config is None else config
    path, kind = check_model_source(checkpoint, what="--model")
    if step is not None and kind is not TrainingRun:
        what = "a quantize output" if kind is QuantizeOutput else "an HF folder"
        raise ValueError(
            f"step={step} applies to a training run folder, but --model "
            f"{str(checkpoint)!r} is {what}"
        )
    # before any work: not a file, writable, not someone's data, existing only with overwrite
    check_quantize_out(out_dir, overwrite=overwrite)
    row = get_layout(layout)  # an unknown name: refused before any work
    ggml = cfg.weight_only_formats()
    if ggml and row.check_formats is not None:
        row.check_formats(ggml)  # ggml's block types: only a layout that stores them
    if kind is QuantizeOutput:
        run = _live_source_run(path)
        if run is not None:
            if log:
                log(
                    f"quantize: {path} is a quantize output of step {run[1]} of {run[0]}, "
                    "which still exists: quantizing that run's master weights"
                )
            path, step, kind = run[0], run[1], TrainingRun
    tok_file = _tokenizer_file(path, kind)
    if row.check_tokenizer is not None and tok_file is not None:
        row.check_tokenizer(tok_file)  # one the layout cannot store: refused now
    with lock_folder(out_dir):
        if kind is TrainingRun:
            return _quantize_run(
                path,
                out_dir,
                cfg,
                corpus=corpus,
                step=step,
                eval_batches=eval_batches,
                layout=layout,
                log=log,
            )
        return _quantize_folder(
            path,
            kind,
            out_dir,
            cfg,
            corpus=corpus,
            eval_batches=eval_batches,
            layout=layout,
            log=log,
        )


def _live_source_run(path: Path) -> tuple[Path, int | None] | None:
    """A quantize output's source run and step when that checkpoint still exists."""
    run_dir, step = quantized_run(path)
    if not run_dir:
        return None
    run = Path(run_dir)
    try:
        if source_kind(run) is not TrainingRun:
            return None
    except ValueError:
        return None
    if step is not None and not (run / TrainingRun.CHECKPOINTS / str(step)).is_dir():
        return None
    return run, step


def _tokenizer_file(path: Path, kind: type[OutputKind]) -> Path | None:
    """The tokenizer.json a model folder (or a run that saved one) carries."""
    folder = path / QuantizeOutput.CHECKPOINT if kind is QuantizeOutput else path
    tok = folder / ExportFolder.TOKENIZER
    return tok if tok.is_file() else None


def _quantize_folder(
    path: Path,
    kind: type[OutputKind],
    out_dir,
    cfg: QuantizeConfig,
    *,
    corpus,
    eval_batches,
    layout,
    log,
) -> QuantizeResult:
    """An HF folder, or a quantize output whose run is gone: weights, the folder's own
    tokenizer and ``corpus`` (default :data:`MODEL_DEFAULT_CORPUS`)."""
    say = log or (lambda _: None)
    found = source_model(path)
    if found is None:
        raise ValueError(
            f"--model {str(path)!r}: no config.json describes its model (a "
            "quantize output in microscale's own layout whose run is gone)"
        )
    model_cfg, _, where = found
    tok = _tokenizer_file(path, kind)
    if tok is None:
        raise FileNotFoundError(
            f"--model {str(path)!r} has no tokenizer.json"
            f"{' in checkpoint/' if kind is QuantizeOutput else ''}; "
            "quantize tokenizes the calibration text with the model's own "
            "tokenizer"
        )
    if corpus is None:
        recorded = _recorded_corpus(path) if kind is QuantizeOutput else None
        corpus = recorded or MODEL_DEFAULT_CORPUS
        say(
            f"quantize: no corpus=: calibrating and evaluating on {corpus!r}"
            + (
                " (the corpus the report names)"
                if recorded
                else " (the Python standard library's sources, no download); pass corpus="
                "FOLDER|FILE.jsonl for text of the model's own domain"
            )
        )
    say(f"quantize: reading the weights of {path} ({where})")
    flat, init = load_init_weights(path)
    model = build_model(model_cfg, flat)
    del flat
    data_cfg = folder_data_config(corpus, tok, model_cfg.max_seq_len, eval_batches)
    source = {
        "source": {
            "kind": kind.source,
            "path": str(path),
            "weights": init.weights,
            "note": init.note,
        }
    }
    return _calibrate_and_quantize(
        model,
        model_cfg,
        data_cfg,
        out_dir,
        cfg,
        source=source,
        trained=None,
        tokenizer=tok,
        what=f"the tokenizer {tok}",
        layout=layout,
        log=log,
    )


def _recorded_corpus(path: Path) -> str | None:
    got = quantize_calibration(path).get("corpus")
    return got if isinstance(got, str) else None


def _quantize_run(
    run_dir: Path, out_dir, cfg: QuantizeConfig, *, corpus, step, eval_batches, layout, log
) -> QuantizeResult:
    model, train_cfg, meta = load_checkpoint(run_dir, step)
    data_cfg = run_data_config(train_cfg.data, corpus=corpus, eval_batches=eval_batches)
    tok_file = run_dir / TrainingRun.TOKENIZER  # with its tokenizer_config.json, if any
    return _calibrate_and_quantize(
        model,
        train_cfg.model,
        data_cfg,
        out_dir,
        cfg,
        source={"run_dir": str(run_dir), "step": meta.get("step")},
        trained=trained_allocation(run_dir, train_cfg),
        tokenizer=tok_file if tok_file.is_file() else None,
        what=f"the tokenizer of {run_dir}",
        layout=layout,
        log=log,
    )


def _calibrate_and_quantize(
    model,
    model_cfg,
    data_cfg,
    out_dir,
    cfg: QuantizeConfig,
    *,
    source: dict[str, Any],
    trained,
    tokenizer,
    what: str,
    layout,
    log,
) -> QuantizeResult:
    """Load ``data_cfg``'s corpus, cut evaluation and calibration windows, quantize, write."""
    # the layout's restrictions (GGUF: no NVFP4 where llama.cpp drops its scale) become
    # the search's candidates, and a model it cannot store is refused, before any work
    row = get_layout(layout)
    candidates = row.candidates(model_cfg, cfg.formats) if row.candidates else {}
    check_quantize_budget(model, cfg, candidates)  # below the cheapest allocation: no work
    check_quantize_space(  # a disk that cannot hold the cheapest output: no work either
        out_dir,
        model,
        [*cfg.formats, *(f for _, f in cfg.pin), *(f for fs in candidates.values() for f in fs)],
    )
    data = load_data(data_cfg)
    check_vocab_fits(
        data.vocab_size,
        model_cfg.vocab_size,
        what=what if data.tokenizer else f"corpus {data_cfg.corpus!r}",
    )
    evals = data.val_batches("val")
    calib, desc = calibration_batches(data, n_tokens=cfg.calib_tokens, seed=cfg.seed)
    desc.update(source, tokenizer=data_cfg.tokenizer, seed=cfg.seed)
    result = quantize_model(
        model,
        calib,
        evals,
        cfg,
        calibration=desc,
        trained=trained,
        candidates=candidates,
        log=log,
    )
    # llama.cpp's quantizer can reuse what the calibration text says about each input
    imatrix = result.imatrix  # the one ggml's block types were encoded with, if any
    if imatrix is None and row.imatrix is not None:
        imatrix = collect_imatrix(model, calib)
    write_outputs(  # out_dir checked before any work with the caller's overwrite, locked since
        result,
        out_dir,
        overwrite=True,
        model_config=model_cfg,
        tokenizer=tokenizer if tokenizer is not None else data.tokenizer,
        layout=layout,
        log=log,
        imatrix=imatrix,
        datasets=[str(desc.get("corpus", data_cfg.corpus))],
    )
    return result

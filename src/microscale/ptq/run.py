"""The pieces of quantizing a run that sit in ``ptq`` (``train.adaptive`` uses them too).

:func:`calibration_windows` cuts seeded calibration windows out of a token stream, and
:func:`trained_allocation` reads the allocation a run trained with. The run-level workflow
that uses them, ``quantize_run`` (a run folder, an HF folder or a quantize output in,
quantized outputs out), reads training runs, so it sits above both ``ptq`` and ``train``:
:mod:`microscale.workflows.quantize`.

**The calibrator** of ``microscale quantize`` and ``microscale export`` (``activations=
true``: static input scales), one rule for both commands:

* the text: a run's own data (:func:`run_data_config`, ``corpus=`` swapped in, tokenized
  the same way) or a model folder's corpus with its own tokenizer
  (:func:`folder_data_config`);
* the batches: :func:`calibration_batches`, seeded windows of the evaluation batches'
  shape from the val split *after* the evaluation windows (the train split when the val
  split is too short);
* the amax: :func:`input_amax`, ``max |X_l|`` of every linear layer's input in the bf16
  reference model (:meth:`~microscale.ptq.engine.Engine.input_amax`, which quantize's
  calibrate phase runs on its engine).

Quantize asks for ``calib_tokens`` (seed ``seed``), export for ``calib_batches`` batches
(seed 0, quantize's default): the same checkpoint, text and count give the same table.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from microscale.data import Data, DataConfig
from microscale.export.layouts import resolve_layers
from microscale.model import PrecisionRules
from microscale.outputs import TrainingRun
from microscale.ptq.engine import Engine, LossFn

__all__ = [
    "MODEL_EVAL_BATCHES",
    "MODEL_ROWS",
    "MODEL_SEQ_LEN",
    "calibration_batches",
    "calibration_windows",
    "folder_data_config",
    "input_amax",
    "run_data_config",
    "trained_allocation",
]

# A model folder (HF, or a quantize output without its run): the window length (at most
# the model's context), windows per batch, evaluation batches.
MODEL_SEQ_LEN = 512
MODEL_ROWS = 2
MODEL_EVAL_BATCHES = 8


def trained_allocation(run_dir: str | os.PathLike, train_cfg: Any) -> dict[str, str] | None:
    """``{linear path: weight format}`` a run trained with when it trained with an allocation
    (``precision.kind=rules``, e.g. QAT on a quantize output, or ``sensitivity``): each
    layer's forward weight format in the run's ``precision_rules.json``, the allocation
    ``microscale export`` writes for it. None for a run with the positional rule."""
    if not train_cfg.own_allocation:
        return None
    path = Path(run_dir) / TrainingRun.RULES
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is missing: the run trained with an "
            "allocation (precision.kind=rules or sensitivity) and "
            "records it there"
        )
    layers = resolve_layers(train_cfg.model, PrecisionRules.load(path))
    return {p: lq.weights for p, lq in layers.items()}


def calibration_windows(
    tokens: np.ndarray, *, n_tokens: int, seq_len: int, rows: int, seed: int, start: int = 0
) -> np.ndarray | None:
    """``ceil(n_tokens / (rows * seq_len))`` batches ``[n, rows, seq_len + 1]`` of windows at
    distinct random offsets (``numpy`` PCG64 seeded by ``seed``) in ``tokens[start:]``,
    or None when that region holds fewer windows than needed."""
    if n_tokens < 1 or seq_len < 1 or rows < 1:
        raise ValueError(
            f"calibration_windows: n_tokens={n_tokens}, seq_len={seq_len}, "
            f"rows={rows}: expected positive ints"
        )
    n_batches = max(1, math.ceil(n_tokens / (rows * seq_len)))
    need = n_batches * rows
    region = np.asarray(tokens)[start:]
    n_starts = region.shape[0] - seq_len  # window [s, s + seq_len + 1)
    if n_starts < need:
        return None
    rng = np.random.default_rng(seed)
    starts = rng.choice(n_starts, size=need, replace=False)
    out = np.stack([region[s : s + seq_len + 1] for s in starts.tolist()]).astype(np.int32)
    return out.reshape(n_batches, rows, seq_len + 1)


def run_data_config(
    data: DataConfig, *, corpus: str | None = None, eval_batches: int | None = None
) -> DataConfig:
    """A training run's data (its ``data`` section) for calibration and evaluation: the
    run's corpus, or ``corpus`` tokenized the same way (no extra held-out sets);
    ``eval_batches``: that many validation batches instead of the run's."""
    if corpus is not None:
        data = dataclasses.replace(data, corpus=corpus, heldout="none")
    if eval_batches is not None:
        data = dataclasses.replace(data, eval_batches=int(eval_batches))
    return data


def folder_data_config(
    corpus: str, tokenizer: str | os.PathLike, max_seq_len: int, eval_batches: int | None = None
) -> DataConfig:
    """A model folder's data: ``corpus`` tokenized with the folder's ``tokenizer.json``, in
    windows of :data:`MODEL_SEQ_LEN` tokens (at most ``max_seq_len``), :data:`MODEL_ROWS`
    per batch, :data:`MODEL_EVAL_BATCHES` evaluation batches unless ``eval_batches``."""
    return DataConfig(
        corpus=corpus,
        heldout="none",
        tokenizer=str(Path(tokenizer).absolute()),
        seq_len=min(MODEL_SEQ_LEN, max_seq_len),
        batch_size=MODEL_ROWS,
        eval_batches=int(eval_batches or MODEL_EVAL_BATCHES),
    )


def calibration_batches(
    data: Data, *, seed: int, n_tokens: int | None = None, n_batches: int | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """The calibration batches of ``data`` and their description (``split``, ``offset``,
    ``corpus``, and a ``note`` for the fallback), for ``n_tokens`` tokens or ``n_batches``
    batches (one of them): :func:`calibration_windows` of the evaluation batches' shape
    (``data.val_batches("val")``) drawn with ``seed`` from the val split after the
    evaluation windows (disjoint from them), or from the train split when the val split
    holds too few; ValueError when neither does."""
    if (n_tokens is None) == (n_batches is None):
        raise TypeError("calibration_batches: give n_tokens or n_batches")
    evals = data.val_batches("val")
    rows, seq = evals.shape[1], evals.shape[2] - 1
    tokens = n_tokens if n_batches is None else n_batches * rows * seq
    used = evals.shape[0] * rows * seq + 1  # evaluation windows start at k * seq_len
    corpus = data.config.corpus
    cut = dict(n_tokens=tokens, seq_len=seq, rows=rows, seed=seed)
    calib = calibration_windows(data.eval_sets()["val"], start=used, **cut)
    desc: dict[str, Any] = {"split": "val", "offset": used, "corpus": corpus}
    if calib is None:
        calib = calibration_windows(data.corpus.train, **cut)
        desc = {
            "split": "train",
            "offset": 0,
            "corpus": corpus,
            "note": "val split too short for disjoint calibration windows",
        }
    if calib is None:
        what = "calib_tokens" if n_batches is None else "calib_batches"
        raise ValueError(
            f"corpus {corpus!r} is too small for {what}={n_tokens or n_batches} at "
            f"seq_len={seq}; lower {what}"
        )
    return calib, desc


def input_amax(model: Any, batches, *, loss_fn: LossFn | None = None) -> dict[str, float]:
    """``{linear path: max |X_l|}`` of every linear layer's input over ``batches`` in
    ``model``'s bf16 reference forward pass (:meth:`Engine.input_amax
    <microscale.ptq.engine.Engine.input_amax>`): the static input scales of W4A4 / W8A8."""
    return Engine(model, loss_fn=loss_fn).input_amax(batches)

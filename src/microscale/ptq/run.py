"""A training run folder -> quantized outputs: the thin layer over :func:`quantize_model`.

``quantize_run(run_dir, out_dir, config)`` restores the run's latest checkpoint
(``microscale.train.load_checkpoint``), loads its corpus with its tokenizer
(``microscale.data.load_data``; ``corpus=`` swaps in another one), and splits the held-out
tokens:

* evaluation: the run's own fixed validation batches (``Data.val_batches("val")``:
  ``eval_batches`` batches of windows from the *start* of the val split), so the
  perplexities here are the ones training reported;
* calibration: ``calib_tokens`` worth of windows drawn with ``seed`` from the val split
  *after* the evaluation windows (disjoint), falling back to the train split when the val
  split is too short.

A run trained with an allocation (QAT: ``rules=``; ``bf16_policy=sensitivity``) also has
that allocation evaluated (the ``"trained"`` point, :func:`trained_allocation`).

Then :func:`~microscale.ptq.report.write_outputs` writes ``precision_rules.json``, the
quantized checkpoint, ``report.json``, ``report.md``, ``pareto.png`` and
``sensitivity.png`` under ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.registry import RUN, detect, get_layout
from microscale.files import check_input_dir, lock_folder
from microscale.ptq.pipeline import QuantizeConfig, QuantizeResult, quantize_model

__all__ = ["calibration_windows", "quantize_run", "trained_allocation"]


def trained_allocation(run_dir: str | os.PathLike, train_cfg: Any) -> dict[str, str] | None:
    """``{linear path: weight format}`` a run trained with when it trained with an allocation
    (``rules=``, e.g. QAT on a quantize output, or ``bf16_policy=sensitivity``): each
    layer's forward weight format in the run's ``precision_rules.json``, the allocation
    ``microscale export`` writes for it. None for a run with the positional rule."""
    from microscale.export.layouts import resolve_layers
    from microscale.model import PrecisionRules

    if not train_cfg.own_allocation:
        return None
    path = Path(run_dir) / "precision_rules.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing: the run trained with an "
                                "allocation (rules= or bf16_policy=sensitivity) and records it "
                                "there")
    layers = resolve_layers(train_cfg.model, PrecisionRules.load(path))
    return {p: lq.weights for p, lq in layers.items()}


def calibration_windows(tokens: np.ndarray, *, n_tokens: int, seq_len: int, rows: int,
                        seed: int, start: int = 0) -> np.ndarray | None:
    """``ceil(n_tokens / (rows * seq_len))`` batches ``[n, rows, seq_len + 1]`` of windows at
    distinct random offsets (``numpy`` PCG64 seeded by ``seed``) in ``tokens[start:]``,
    or None when that region holds fewer windows than needed."""
    if n_tokens < 1 or seq_len < 1 or rows < 1:
        raise ValueError(f"calibration_windows: n_tokens={n_tokens}, seq_len={seq_len}, "
                         f"rows={rows}: expected positive ints")
    n_batches = max(1, math.ceil(n_tokens / (rows * seq_len)))
    need = n_batches * rows
    region = np.asarray(tokens)[start:]
    n_starts = region.shape[0] - seq_len  # window [s, s + seq_len + 1)
    if n_starts < need:
        return None
    rng = np.random.default_rng(seed)
    starts = rng.choice(n_starts, size=need, replace=False)
    out = np.stack([region[s:s + seq_len + 1] for s in starts.tolist()]).astype(np.int32)
    return out.reshape(n_batches, rows, seq_len + 1)


def quantize_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 config: QuantizeConfig | None = None, *, corpus: str | None = None,
                 step: int | None = None, eval_batches: int | None = None,
                 layout: str = "compressed-tensors",
                 log: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize a microscale training run (see the module doc). Returns the result.

    ``corpus``: calibrate and evaluate on another corpus (same tokenizer settings);
    ``step``: checkpoint step (default latest); ``eval_batches``: validation batches
    (default: the run's ``data.eval_batches``); ``layout``: checkpoint layout
    ("compressed-tensors", "modelopt" or "microscale").
    """
    from microscale.ptq.report import check_quantize_out

    cfg = QuantizeConfig() if config is None else config
    run_dir = check_input_dir(run_dir, what="--checkpoint",
                              expected="the out= folder of a training run")
    if detect(run_dir) is not RUN:
        raise FileNotFoundError(f"{str(run_dir)!r} is not a microscale run folder (no "
                                "config.yaml + checkpoints/); expected the out= folder of a "
                                "training run")
    check_quantize_out(out_dir)  # before any work: not a file, writable, not someone's data
    row = get_layout(layout)  # an unknown name: refused before any work
    if row.check_tokenizer is not None and (run_dir / "tokenizer.json").is_file():
        row.check_tokenizer(run_dir / "tokenizer.json")  # one it cannot store: refused now
    with lock_folder(out_dir):
        return _quantize_run(run_dir, out_dir, cfg, corpus=corpus, step=step,
                             eval_batches=eval_batches, layout=layout, log=log)


def _quantize_run(run_dir: Path, out_dir, cfg: QuantizeConfig, *, corpus, step, eval_batches,
                  layout, log) -> QuantizeResult:
    from microscale.data import check_vocab_fits, load_data
    from microscale.ptq.report import write_outputs
    from microscale.train import load_checkpoint

    model, train_cfg, meta = load_checkpoint(run_dir, step)
    data_cfg = train_cfg.data
    if corpus is not None:
        data_cfg = dataclasses.replace(data_cfg, corpus=corpus, heldout="none")
    if eval_batches is not None:
        data_cfg = dataclasses.replace(data_cfg, eval_batches=int(eval_batches))
    data = load_data(data_cfg)
    check_vocab_fits(data.vocab_size, train_cfg.model.vocab_size,
                     what=f"the tokenizer of {run_dir}" if data.tokenizer else
                     f"corpus {data_cfg.corpus!r}")
    evals = data.val_batches("val")
    rows, seq = evals.shape[1], evals.shape[2] - 1
    val_tokens = data.eval_sets()["val"]
    used = evals.shape[0] * rows * seq + 1  # evaluation windows start at k * seq_len
    calib = calibration_windows(val_tokens, n_tokens=cfg.calib_tokens, seq_len=seq,
                                rows=rows, seed=cfg.seed, start=used)
    source: dict[str, Any] = {"split": "val", "offset": used, "corpus": data_cfg.corpus}
    if calib is None:
        calib = calibration_windows(data.corpus.train, n_tokens=cfg.calib_tokens, seq_len=seq,
                                    rows=rows, seed=cfg.seed)
        source = {"split": "train", "offset": 0, "corpus": data_cfg.corpus,
                  "note": "val split too short for disjoint calibration windows"}
        if calib is None:
            raise ValueError(f"corpus {data_cfg.corpus!r} is too small for calib_tokens="
                             f"{cfg.calib_tokens} at seq_len={seq}; lower calib_tokens")
    source.update(run_dir=str(run_dir), step=meta.get("step"), seed=cfg.seed)
    result = quantize_model(model, calib, evals, cfg, calibration=source,
                            trained=trained_allocation(run_dir, train_cfg), log=log)
    tok_file = run_dir / "tokenizer.json"  # with its tokenizer_config.json, if any
    write_outputs(result, out_dir, model_config=train_cfg.model,
                  tokenizer=tok_file if tok_file.is_file() else data.tokenizer,
                  layout=layout, log=log)
    return result

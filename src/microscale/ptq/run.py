"""The pieces of quantizing a run that sit in ``ptq`` (``train.adaptive`` uses them too).

:func:`calibration_windows` cuts seeded calibration windows out of a token stream, and
:func:`trained_allocation` reads the allocation a run trained with. The run-level workflow
that uses them, ``quantize_run`` (a run folder, an HF folder or a quantize output in,
quantized outputs out), reads training runs, so it sits above both ``ptq`` and ``train``:
:mod:`microscale.workflows.quantize`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.layouts import resolve_layers
from microscale.model import PrecisionRules

__all__ = ["calibration_windows", "trained_allocation"]


def trained_allocation(run_dir: str | os.PathLike, train_cfg: Any) -> dict[str, str] | None:
    """``{linear path: weight format}`` a run trained with when it trained with an allocation
    (``precision.kind=rules``, e.g. QAT on a quantize output, or ``sensitivity``): each
    layer's forward weight format in the run's ``precision_rules.json``, the allocation
    ``microscale export`` writes for it. None for a run with the positional rule."""
    if not train_cfg.own_allocation:
        return None
    path = Path(run_dir) / "precision_rules.json"
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

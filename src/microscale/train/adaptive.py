"""``precision.kind=sensitivity``: measured sensitivity, not position, picks the bf16 layers.

NVIDIA's NVFP4 recipe keeps about 15% of the blocks in BF16, chosen by position (the
last ones, ``PrecisionRules.for_recipe``). Here the run chooses them from the model:

1. **warm-up**: the first ``precision.warmup`` of the steps train every layer in
   bf16 (a fresh model's sensitivities say little);
2. **sensitivity**: on ``precision.sensitivity.calib_tokens`` tokens of the *training*
   split, the PTQ scores of :mod:`microscale.ptq.sensitivity` (default ``taylor``: the
   second-order estimate of the loss change when only that layer's forward weights -- and,
   with ``precision.sensitivity.activations``, its inputs -- are rounded to the recipe's
   format) for every linear layer, with round-to-nearest weights as the training recipe's
   forward pass uses;
3. **budget**: the exact knapsack of :func:`microscale.ptq.search` over the two choices
   {recipe format, bf16} per layer (q/k/v and gate/up together; or whole blocks with
   ``precision.sensitivity.granularity=block``). A layer's linear FLOPs per token are
   ``2 * in * out``, proportional to its weight elements, so "at most a fraction ``f`` of
   the linear FLOPs in bf16" is the bits budget ``b + (16 - b) f`` (``b`` the format's bits per element).
   ``f`` is ``precision.sensitivity.bf16_flops`` or, by default, what the positional rule
   would keep;
4. the rest of the run trains with ``recipe`` everywhere except the chosen layers.

The allocation (layers, scores, FLOP fraction, the positional rule's layers for
comparison) is recorded as a ``bf16_allocation`` event in ``metrics.jsonl``, in
``summary.json`` and in every later checkpoint (resume reuses it), and the run's
``precision_rules.json`` is rewritten with the chosen rules.

Approximation: the scores measure forward rounding of weights in 1-D blocks; the
training recipe also quantizes the backward GEMMs and (for ``nvfp4``) uses 16x16 weight
tiles. Forward sensitivity stands in for both.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from microscale.formats import get_format
from microscale.model import PrecisionRules
from microscale.ops import get_recipe
from microscale.ptq import (
    Engine,
    Problem,
    WeightPTQ,
    calibration_windows,
    group_layers,
    monotone,
    quantize_weight,
    score,
    search,
)
from microscale.ptq.search import DEFAULT_GROUPS
from microscale.ptq.sensitivity import SIGNED_METHODS

__all__ = ["allocate_bf16", "bf16_rules", "choose_bf16_layers"]

# Whole blocks as one decision (precision.sensitivity.granularity=block).
_BLOCK_GROUPS = ((r"(layers\.\d+)\..*", r"\1"),)


def bf16_rules(recipe: str, bf16_layers: Sequence[str]) -> PrecisionRules:
    """``recipe`` everywhere except the exact paths ``bf16_layers``."""
    if not bf16_layers:
        return PrecisionRules(default=recipe)
    pattern = "|".join(re.escape(p) for p in sorted(bf16_layers))
    return PrecisionRules(rules=((f"(?:{pattern})", "bf16"),), default=recipe)


def _fraction(paths, numel, is_bf16) -> float:
    total = sum(numel[p] for p in paths)
    return sum(numel[p] for p in paths if is_bf16(p)) / total


def allocate_bf16(
    scores: Mapping[str, Mapping[str, float]],
    numel: Mapping[str, int],
    groups: Mapping[str, str],
    low: str,
    fraction: float,
) -> list[str]:
    """The layers kept in bf16: least total score of {``low``, bf16} per group with at most
    ``fraction`` of the weight elements (= linear FLOPs) in bf16 (exact knapsack)."""
    bits = float(get_format(low).bits_per_element)
    hi = float(get_format("bf16").bits_per_element)
    budget = bits + (hi - bits) * fraction + 1e-9
    alloc = search(
        Problem(formats=(low, "bf16"), scores=scores, numel=numel, groups=groups), budget
    )
    return [p for p in scores if alloc.formats[p] == "bf16"]


def choose_bf16_layers(
    model: Any, cfg, train_tokens: np.ndarray
) -> tuple[PrecisionRules, dict[str, Any]]:
    """``(rules, record)`` for the rest of the run (see the module doc). ``model``: the
    warmed-up model; ``train_tokens``: the training split (1-D token ids)."""
    t0 = time.perf_counter()
    a = cfg.precision.sensitivity
    recipe = get_recipe(cfg.recipe)
    op = recipe.fprop_w if recipe.fprop_w.quantized else recipe.fprop_x
    low = op.format
    formats = (low, "bf16")
    engine = Engine(model)
    paths = engine.paths
    numel = dict(engine.numel)
    positional = cfg.precision_rules()  # the positional rules the choice starts from
    pos_layers = [p for p in paths if not get_recipe(positional.resolve(p)).quantized]
    frac = a.bf16_flops
    if frac is None:
        frac = _fraction(paths, numel, set(pos_layers).__contains__)
    calib = calibration_windows(
        train_tokens,
        n_tokens=a.calib_tokens,
        seq_len=cfg.data.seq_len,
        rows=cfg.data.batch_size // cfg.data.grad_accum,
        seed=cfg.seed,
    )
    if calib is None:
        raise ValueError(
            f"precision.sensitivity.calib_tokens={a.calib_tokens}: the training "
            f"split is too short for that many windows of seq_len="
            f"{cfg.data.seq_len}"
        )
    rtn = WeightPTQ.rtn()
    cand = {f: {p: quantize_weight(engine.kernels[p], f, rtn) for p in paths} for f in formats}
    raw = score(engine, list(calib), cand, a.method, activations=a.activations)
    scores = raw if a.method in SIGNED_METHODS else monotone(raw, formats)
    groups = group_layers(paths, _BLOCK_GROUPS if a.granularity == "block" else DEFAULT_GROUPS)
    chosen = allocate_bf16(scores, numel, groups, low, frac)
    record = {
        "policy": "sensitivity",
        "method": a.method,
        "format": low,
        "granularity": a.granularity,
        "budget_bf16_flops": frac,
        "bf16_flops": _fraction(paths, numel, set(chosen).__contains__),
        "bf16_layers": chosen,
        "positional_bf16_layers": pos_layers,
        # loss increase of the recipe's format over bf16, per layer
        "scores": {p: scores[p][low] - scores[p]["bf16"] for p in paths},
        "calib_tokens": int(calib.shape[0] * calib.shape[1] * (calib.shape[2] - 1)),
        "time_s": time.perf_counter() - t0,
    }
    return bf16_rules(cfg.recipe, chosen), record

"""Per-layer sensitivity: how much does storing layer ``l`` in format ``f`` cost the loss?

Four estimators, all "only layer ``l`` is quantized, the rest stays full precision":

**taylor** (default). The second-order Taylor expansion of the mean loss in the layer
output, ``dL ~= sum(g * dY) + 1/2 dY^T H dY`` with ``g = dL/dY_l``, keeping BOTH terms:
the first-order term ``sum(g * dY_lf)`` (signed) and the empirical-Fisher quadratic
form ``(N/2) sum_tokens (sum_features g * dY_lf)^2`` (``N`` tokens in the batch's mean:
each token's own gradient is ``N g``). The result is an estimate of the loss change in
nats, averaged over batches. It costs the same single forward+backward pass per batch
as the gradient score. Why the first-order term: ModelOpt drops it because at a
minimum of the *training* loss ``E[g] = 0``; on held-out data, and for any model not
trained to convergence, ``E[g] != 0`` and the first-order term is of the same size as
the quadratic one for 4- and 8-bit weight noise (it decides the sign: uniform FP8
lowers the loss). Measured on the tiny preset (400 steps, docs/ptq/): this
estimate matches the measured per-group loss change on the calibration data with
Spearman 0.99 (the Fisher score: 0.07), FP8 layers often *lower* the loss, and the
searched allocation at 5.0 bits beats the heuristic on the held-out validation set
only with this score (the Fisher score's allocation is worse than the heuristic). The
first-order term is a mean of signed per-token terms, so it needs enough calibration
tokens (64k: stable across calibration seeds; 16k: at chance).

**gradient** (NVIDIA ModelOpt's AutoQuantize score). Quantizing ``W_l`` moves
the layer output by ``dY = X_l (W_lf - W_l)`` (``Q_f(X_l) W_lf - X_l W_l`` when inputs are
quantized too). A second-order Taylor expansion of the loss with the Fisher matrix of
the output, kept diagonal, gives

    s_lf = sum_tokens,features (dL/dY_l * dY_lf)^2 .

``dL/dY_l`` and ``X_l`` do not depend on ``f`` or on other layers' formats, so ONE forward
and backward pass per calibration batch captures them for every layer (``jax.vjp`` with
respect to zero perturbations of the outputs, see :mod:`~microscale.ptq.tap`);
each (layer, format) then costs one GEMM ``X_l dW_lf``. Quantizing *all* layers in
``f`` in one pass would measure something else (the interactions), not per-layer scores.

**kl**: ``KL(p_fp || p_q)`` of the next-token distributions with only layer ``l`` in
``f``; **loss**: the measured loss increase. Both are exact for that single change but
cost one forward pass per layer, format and batch.

**The token embedding / LM head** (:func:`table_scores`, one item of the search when the
budget counts the whole model) is not a linear layer: its score for a format is *measured*
with the table (a tied model's lookup and LM head together; an untied model's embedding and
LM head each) replaced by the values a GGUF stores in that format, one forward pass per
calibration batch and format: the loss change (``taylor``: averaged over batches, as the
Taylor scores are; ``loss``: summed) or ``KL(p_fp || p_q)`` (``kl``). The ``gradient``
score's Fisher units have no measured counterpart, so it does not score the table.

Monotone correction (on by default for the unsigned gradient and kl scores only). A
format that stores more bits should not look worse than a cheaper one for the same layer (estimator noise, or a per-tensor format losing to a
finer block format of similar size would otherwise make the search's trade-offs
erratic). With ``monotone=True`` each score becomes the minimum over all formats that
cost at most as much: ``s'_lf = min { s_lg : bits(g) <= bits(f) }`` (reading
``FormatSpec.bits_per_element``). Dominated formats then tie with a cheaper one and the
search prefers the cheaper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from microscale.formats import get_weight_format
from microscale.ptq.engine import ActQuant, Engine
from microscale.ptq.weights import QuantizedWeight

__all__ = [
    "METHODS",
    "ONE_PASS",
    "SIGNED_METHODS",
    "gradient_scores",
    "kl_loss_scores",
    "monotone",
    "score",
    "table_scores",
    "taylor_scores",
]

METHODS = ("taylor", "gradient", "kl", "loss")
# Methods whose scores are signed loss changes (a format may *lower* the loss).
SIGNED_METHODS = ("taylor", "loss")
# Methods of one compiled forward and backward pass per batch (Engine.grad_terms).
ONE_PASS = ("taylor", "gradient")

QWeights = Mapping[str, Mapping[str, QuantizedWeight]]  # {format: {path: weight}}


def _grad_terms(
    engine: Engine,
    batches,
    qweights: QWeights,
    activations: bool,
    act_amax: Mapping[str, float] | None,
    progress=None,
    input_amax: dict[str, float] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """The Taylor terms of every quantized candidate, streamed layer by layer from the
    candidates' QArrays (no dequantized copy of every layer in every format is held).
    An unquantized format (bf16: ``bf16(W) - bf16(W) = 0``) has every term exactly 0.
    ``input_amax``: filled with every layer's input amax (``Engine.grad_terms``)."""
    quantized = [f for f in qweights if get_weight_format(f).quantized]
    cands = {f: {p: qweights[f][p].qarray for p in engine.paths} for f in quantized}
    terms = engine.grad_terms(
        batches,
        cands,
        act_formats={f: activations for f in quantized},
        act_amax=act_amax,
        input_amax=input_amax,
        progress=progress,
    )
    for rows in terms.values():
        for p, row in rows.items():
            rows[p] = {f: row.get(f, 0.0) for f in qweights}
    return terms


def gradient_scores(
    engine: Engine,
    batches,
    qweights: QWeights,
    *,
    activations: bool = False,
    act_amax: Mapping[str, float] | None = None,
    progress=None,
    input_amax: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Fisher scores ``{path: {format: s}}`` (see the module doc)."""
    return _grad_terms(engine, batches, qweights, activations, act_amax, progress, input_amax)[
        "fisher"
    ]


def taylor_scores(
    engine: Engine,
    batches,
    qweights: QWeights,
    *,
    activations: bool = False,
    act_amax: Mapping[str, float] | None = None,
    progress=None,
    input_amax: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Second-order Taylor estimates of the mean loss change ``{path: {format: dL}}``
    (signed; first-order term included; see the module doc), averaged over batches."""
    batches = list(batches)
    n = max(len(batches), 1)
    taylor = _grad_terms(engine, batches, qweights, activations, act_amax, progress, input_amax)[
        "taylor"
    ]
    return {p: {f: v / n for f, v in row.items()} for p, row in taylor.items()}


def kl_loss_scores(
    engine: Engine,
    batches,
    qweights: QWeights,
    *,
    activations: bool = False,
    act_amax: Mapping[str, float] | None = None,
    progress=None,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """``(kl, loss increase)`` scores ``{path: {format: s}}``, summed over batches, with one
    forward pass per (layer, format, batch); ``progress`` is called after each batch."""
    kl = {p: {f: 0.0 for f in qweights} for p in engine.paths}
    dloss = {p: {f: 0.0 for f in qweights} for p in engine.paths}
    for b in batches:
        ref = engine.ref_logp(b)
        _, base = engine.kl_and_loss(engine.params, b, ref)
        for f, qw in qweights.items():
            quant_in = activations and get_weight_format(f).quantized
            for p in engine.paths:
                params = engine.with_kernels({p: qw[p].values})
                act = None
                if quant_in:  # only this layer's input; same palette -> one compile
                    act = ActQuant(
                        formats=((p, f),),
                        palette=(f,),
                        amax=None if act_amax is None else dict(act_amax),
                    )
                k, nll = engine.kl_and_loss(params, b, ref, act)
                kl[p][f] += k
                dloss[p][f] += nll - base
        if progress is not None:
            progress()
    return kl, dloss


def table_scores(
    engine: Engine,
    batches,
    formats: Sequence[str],
    method: str = "taylor",
    *,
    progress: Callable[[], None] | None = None,
) -> dict[str, float]:
    """``{format: score}`` of the token embedding / LM head (:attr:`Engine.tables`) stored in
    each of ``formats`` (see the module doc; an unquantized format scores 0, as a bf16
    layer does); ``progress`` is called after each forward pass of one batch."""
    if method not in ("taylor", "loss", "kl"):
        raise ValueError(
            f"table_scores: method {method!r} does not measure a loss change; expected "
            "'taylor', 'loss' or 'kl'"
        )
    if not engine.tables:
        raise ValueError("table_scores: the model has no token embedding table to score")
    batches = list(batches)
    out = {f: 0.0 for f in formats}
    quantized = {f: engine.with_tables(f) for f in formats if get_weight_format(f).quantized}
    if method == "kl":
        for b in batches:
            ref = engine.ref_logp(b)
            for f, params in quantized.items():
                out[f] += engine.kl_and_loss(params, b, ref)[0]
                if progress is not None:
                    progress()
        return out
    if quantized:
        base = engine.batch_losses(engine.params, batches, progress=progress)
    for f, params in quantized.items():
        d = engine.batch_losses(params, batches, progress=progress) - base
        out[f] = float(np.mean(d) if method == "taylor" else np.sum(d))
    return out


def monotone(
    scores: Mapping[str, Mapping[str, float]], formats: Sequence[str]
) -> dict[str, dict[str, float]]:
    """``s'_lf = min {s_lg : bits(g) <= bits(f)}`` per layer (see the module doc)."""
    bits = {f: get_weight_format(f).bits_per_element for f in formats}
    out = {}
    for p, row in scores.items():
        out[p] = {f: min(row[g] for g in formats if bits[g] <= bits[f]) for f in formats}
    return out


def score(
    engine: Engine,
    batches,
    qweights: QWeights,
    method: str = "gradient",
    *,
    activations: bool = False,
    act_amax: Mapping[str, float] | None = None,
    progress: Callable[[], None] | None = None,
    input_amax: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Raw (uncorrected) scores of ``method`` ("taylor", "gradient", "kl" or "loss");
    ``progress`` is called after each calibration batch. ``input_amax``: a dict filled
    with every layer's input amax over ``batches`` by the same pass (the methods of one
    forward and backward pass per batch, :data:`ONE_PASS`)."""
    if method not in METHODS:
        raise ValueError(f"unknown sensitivity method {method!r}; expected one of {METHODS}")
    if input_amax is not None and method not in ONE_PASS:
        raise ValueError(
            f"score(method={method!r}, input_amax=...): only {list(ONE_PASS)} "
            "capture the layers' inputs in their pass"
        )
    kw: dict[str, Any] = dict(activations=activations, act_amax=act_amax, progress=progress)
    if method == "gradient":
        return gradient_scores(engine, batches, qweights, input_amax=input_amax, **kw)
    if method == "taylor":
        return taylor_scores(engine, batches, qweights, input_amax=input_amax, **kw)
    kl, dloss = kl_loss_scores(engine, batches, qweights, **kw)
    return kl if method == "kl" else dloss

"""Adaptive PTQ end to end: ``quantize_model(model, calib_batches, eval_batches, config)``
calibrates, quantizes every kernel in every candidate format, scores each (layer, format),
searches the allocation of least total score within the bit budget (the problem:
:mod:`~microscale.ptq.problem`) and evaluates it against the baselines, on any NNX model
whose linear layers have 2-D ``[in, out]`` kernels. The phases, weight-only versus W4A4 and
what the result carries: docs/quantize.md#the-phases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from microscale.formats import get_weight_format, weight_only
from microscale.ptq.awq import awq_fold
from microscale.ptq.config import QuantizeConfig
from microscale.ptq.engine import Engine, LossFn
from microscale.ptq.evaluate import Evaluator, evaluate, ptq_effects
from microscale.ptq.imatrix import Imatrix, collect_imatrix
from microscale.ptq.phases import Phases
from microscale.ptq.problem import fit_rows, search_problem, setup
from microscale.ptq.result import QuantizeResult, allocation_rules
from microscale.ptq.search import EMBED_ITEM, Allocation, linear_formats, search
from microscale.ptq.sensitivity import ONE_PASS, monotone, score, table_scores
from microscale.ptq.weights import WeightCache, weight_stats

__all__ = ["quantize_model"]


def quantize_model(
    model: Any,
    calib_batches,
    eval_batches,
    config: QuantizeConfig | None = None,
    *,
    loss_fn: LossFn | None = None,
    calibration: Mapping[str, Any] | None = None,
    trained: Mapping[str, str] | None = None,
    candidates: Mapping[str, Sequence[str]] | None = None,
    log: Callable[[str], None] | None = None,
) -> QuantizeResult:
    """Calibrate, score, search and evaluate (see the module doc).

    Args:
      model: an NNX model with linear layers (left untouched: a private copy is used).
      calib_batches: int token batches ``[n, rows, seq + 1]`` (held out; calibration).
      eval_batches: token batches for validation perplexity (disjoint from calibration).
      config: the run's :class:`QuantizeConfig`.
      loss_fn: ``loss_fn(model, batch) -> scalar``; default next-token cross-entropy.
      calibration: a description of where the calibration batches came from (reported).
      trained: ``{path: format}`` the model was trained with (QAT): evaluated as the points
        ``"trained"`` (round-to-nearest weights) and ``"trained_ptq"`` (``config.ptq``,
        when it differs), pinned layers keeping their pin, with paired differences.
      candidates: ``{path: formats}`` the search may give those layers instead of
        ``config.formats`` (the output layout's restrictions: its ``candidates`` record).
      log: progress messages (e.g. ``print``); None is silent.

    Long: the run's five phases in order, one call each, with the arguments each phase
    hands the next; split, the parts would pass the same dozen names back and forth.
    """
    cfg = QuantizeConfig() if config is None else config
    say = log or (lambda _msg: None)
    calib = [np.asarray(b) for b in calib_batches]
    evals = [np.asarray(b) for b in eval_batches]
    phases = Phases(log)
    options = {p: tuple(f) for p, f in (candidates or {}).items()}
    engine, groups, pinned, trained, awq, cfg, options = _prepare(
        model, calib, evals, cfg, loss_fn, trained, phases, say, options
    )
    paths = engine.paths
    # 1. calibration, 2. sensitivity (the layers', then the token embedding's)
    imatrix = _importance(engine, calib, cfg, phases)
    act_amax, static, weights = _calibrate(engine, calib, cfg, groups, phases, imatrix)
    raw, scores, stats = _score_layers(engine, weights, calib, cfg, static, phases, say, act_amax)
    embed = _score_embedding(engine, calib, cfg, phases)
    # 3. search
    with phases.phase("search", total=1, unit="solve"):
        problem = search_problem(engine, cfg, scores, groups, pinned, embed, options)
        alloc = search(problem, cfg.budget, solver=cfg.solver)
    if embed is not None:
        embed["format"] = alloc.formats[EMBED_ITEM]
    say(
        f"quantize: searched allocation at {alloc.effective_bits:.3f} bits "
        f"(budget {cfg.budget}) {alloc.counts()} in {alloc.solve_time_s * 1e3:.1f} ms"
    )
    # 4. evaluation, 5. the effect of each PTQ choice
    evaluator = Evaluator(engine, weights, evals, cfg, static, problem, trained)
    with phases.phase("evaluate", total=None) as tick:
        evaluator.progress = tick
        points, comparisons = evaluate(evaluator, problem, alloc, groups, pinned, trained, say)
    effects: dict[str, Any] = {}
    if cfg.ptq_effects:
        with phases.phase("ptq_effects", total=None) as tick:
            evaluator.progress = tick
            effects = ptq_effects(evaluator, cfg, paths, pinned, alloc, act_amax)
    evaluator.progress = None
    return _result(
        cfg,
        engine,
        weights,
        alloc,
        calib,
        calibration,
        phases,
        groups=groups,
        pinned=pinned,
        act_amax=act_amax,
        weight_stats=stats,
        scores_raw=raw,
        scores=scores,
        points=points,
        comparisons=comparisons,
        ptq_effects=effects,
        embedding=embed,
        awq=awq,
        imatrix=imatrix,
    )


def _prepare(
    model: Any,
    calib,
    evals,
    cfg: QuantizeConfig,
    loss_fn: LossFn | None,
    trained: Mapping[str, str] | None,
    phases: Phases,
    say: Callable[[str], None],
    options: Mapping[str, tuple[str, ...]],
) -> tuple[
    Engine,
    dict[str, str],
    dict[str, str],
    dict[str, str] | None,
    dict[str, Any] | None,
    QuantizeConfig,
    dict[str, tuple[str, ...]],
]:
    """The engine (of the AWQ-folded model with ``config.awq``), the layers' groups, pins
    and trained formats, what AWQ chose, and the config and options with llama.cpp's
    fallbacks for rows a ggml type cannot hold (:func:`~microscale.ptq.problem.fit_rows`);
    the budget is checked first, before AWQ's phase: the folded model has the same layers
    and sizes."""
    with phases.phase("setup", total=1, unit="model"):
        engine = Engine(model, loss_fn=loss_fn)
    cfg, options = fit_rows(engine, cfg, options, say)
    groups, pinned, trained = setup(engine, cfg, calib, evals, trained, say, options)
    awq = None
    if cfg.awq:
        model, awq = _awq(model, calib, cfg, loss_fn, phases, say)
        engine = Engine(model, loss_fn=loss_fn)
    return engine, groups, pinned, trained, awq, cfg, options


def _awq(
    model: Any,
    calib,
    cfg: QuantizeConfig,
    loss_fn: LossFn | None,
    phases: Phases,
    say: Callable[[str], None],
) -> tuple[Any, dict[str, Any]]:
    """Phase 0 (``config.awq``): a copy of ``model`` with AWQ scales folded in, and what
    was chosen (:func:`~microscale.ptq.awq.awq_fold`)."""
    with phases.phase("awq", total=None, unit="step") as tick:
        folded, info = awq_fold(
            model,
            calib,
            fmt=cfg.awq_format,
            ptq=cfg.ptq,
            alphas=cfg.awq_alphas,
            loss_fn=loss_fn,
            progress=tick,
        )
    alphas = [g["alpha"] for g in info["groups"].values()]
    say(
        f"quantize: awq scales for {len(alphas)} groups in {phases.timings['awq_s']:.1f}s "
        f"({sum(a > 0 for a in alphas)} scaled; alpha median {float(np.median(alphas)):.2f})"
    )
    return folded, info


def _result(
    cfg: QuantizeConfig,
    engine: Engine,
    weights: WeightCache,
    alloc: Allocation,
    calib,
    calibration: Mapping[str, Any] | None,
    phases: Phases,
    **fields: Any,
) -> QuantizeResult:
    """The result: the searched allocation of the linear layers (the embedding item's
    format is in ``fields["embedding"]``), its rules and weights, and ``fields``."""
    linear = dataclasses.replace(alloc, formats=linear_formats(alloc.formats))
    ggml = any(weight_only(get_weight_format(f)) for f in linear.formats.values())
    return QuantizeResult(
        config=cfg,
        paths=engine.paths,
        numel=dict(engine.numel),
        allocation=linear,
        rules=None if ggml else allocation_rules(linear.formats, cfg.activations),
        weights=weights.for_assignment(linear.formats, cfg.ptq),
        calibration=dict(
            calibration or {},
            batches=len(calib),
            tokens=int(sum(b.shape[0] * (b.shape[1] - 1) for b in calib)),
        ),
        timings=phases.timings,
        peak_rss_gb=phases.peak_rss_gb,
        engine=engine,
        **fields,
    )


def _amax_in_score(cfg: QuantizeConfig) -> bool:
    """Whether the score pass measures the layers' input amax (no calibrate phase): a
    weight-only round-to-nearest run scored in one pass per batch, where nothing needs
    the amax (or GPTQ's Hessians) before scoring."""
    return not cfg.activations and cfg.ptq.method != "gptq" and cfg.method in ONE_PASS


def _calibrate(
    engine: Engine,
    calib,
    cfg: QuantizeConfig,
    groups: Mapping[str, str],
    phases: Phases,
    imatrix: Imatrix | None,
) -> tuple[dict[str, float], dict[str, float] | None, WeightCache]:
    """Phase 1: every layer's input amax (and GPTQ's input Hessians); returns the amax, the
    static input amax of W4A4 (None: weight-only or dynamic) and the weights' source.
    Skipped when the score pass measures the amax (:func:`_amax_in_score`): the amax is
    then returned empty, and the score phase fills it. ``imatrix``: what ggml's block
    types are encoded with (:func:`_importance`; None without them)."""
    importance = None if imatrix is None else imatrix.mean_sq()
    if _amax_in_score(cfg):
        return {}, None, WeightCache(engine, groups, None, importance)
    gptq = cfg.ptq.method == "gptq"
    with phases.phase("calibrate", total=len(calib) * (2 if gptq else 1)) as tick:
        act_amax = engine.input_amax(calib, progress=tick)
        static = act_amax if (cfg.activations and cfg.static_act_scales) else None
        hessians: Any = None
        if gptq and cfg.activations:  # W4A4: each format's Hessians from its inputs

            def hessians(fmt: str) -> dict[str, np.ndarray]:
                return engine.input_hessians(calib, act_format=fmt, act_amax=static)

            tick(len(calib))
        elif gptq:
            hessians = engine.input_hessians(calib, progress=tick)
    return act_amax, static, WeightCache(engine, groups, hessians, importance)


def _importance(engine: Engine, calib, cfg: QuantizeConfig, phases: Phases) -> Imatrix | None:
    """llama.cpp's importance matrix of the engine's model (AWQ's folded one with
    ``cfg.awq``) on the calibration batches, when the run has ggml's block types (None
    otherwise): each of their layers is encoded with its input columns' mean squares."""
    if not cfg.weight_only_formats():
        return None
    with phases.phase("imatrix", total=1, unit="pass") as tick:
        imatrix = collect_imatrix(engine.model(), calib)
        tick()
    return imatrix


def _score_layers(
    engine: Engine,
    weights: WeightCache,
    calib,
    cfg: QuantizeConfig,
    static: Mapping[str, float] | None,
    phases: Phases,
    say: Callable[[str], None],
    act_amax: dict[str, float],
) -> tuple[dict, dict, dict]:
    """Phase 2: every candidate of every layer quantized (packed QArrays, compactly), then
    scored, one capture pass per batch; returns (raw scores, corrected scores, weight
    statistics). ``act_amax``: filled by the score pass when the calibrate phase was
    skipped (:func:`_amax_in_score`)."""
    with phases.phase("quantize_weights", total=len(cfg.formats), unit="format") as tick:
        cand = {}
        for f in cfg.formats:
            cand[f] = weights.get(f, cfg.ptq)
            tick()
    stats = weight_stats(engine, cand)
    with phases.phase("score", total=len(calib)) as tick:
        raw = score(
            engine,
            calib,
            cand,
            cfg.method,
            activations=cfg.activations,
            act_amax=static,
            progress=tick,
            input_amax=act_amax if _amax_in_score(cfg) else None,
        )
        scores = monotone(raw, cfg.formats) if cfg.use_monotone else raw
    say(
        f"quantize: {cfg.method} scores for {len(engine.paths)} layers x {len(cfg.formats)} "
        f"formats in {phases.timings['score_s']:.1f}s"
    )
    return raw, scores, stats


def _score_embedding(
    engine: Engine, calib, cfg: QuantizeConfig, phases: Phases
) -> dict[str, Any] | None:
    """The token embedding / LM head item (:attr:`QuantizeResult.embedding`, its format
    chosen by the search) when ``cfg`` searches it and the model has the table; None
    otherwise (an explicit ``embed_formats`` on a model without one is refused)."""
    fmts = cfg.searched_embed_formats
    if not fmts:
        return None
    if not engine.tables:
        if cfg.embed_formats is None:
            return None  # count_other_params on a model without a token embedding
        raise ValueError(
            f"QuantizeConfig.embed_formats={list(fmts)}: the model has no token embedding "
            "table (embed.embedding) to search a format for"
        )
    n_q = sum(get_weight_format(f).quantized for f in fmts)
    per_batch = n_q + (n_q > 0 and cfg.method != "kl")  # kl: its reference in the pass
    with phases.phase("score_embedding", total=len(calib) * per_batch) as tick:
        raw = table_scores(engine, calib, fmts, cfg.method, progress=tick)
    return {
        "format": None,
        "numel": engine.table_numel,
        "candidates": list(fmts),
        "scores": monotone({EMBED_ITEM: raw}, fmts)[EMBED_ITEM] if cfg.use_monotone else raw,
        "scores_raw": raw,
    }

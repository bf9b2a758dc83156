"""The search's problem over a model, from its layers and the config: the layers' fusion
groups and pins, a trained allocation's formats, the budget checked against the cheapest
allocation before any work, and the :class:`~microscale.ptq.search.Problem` the search
solves (the linear layers, the token embedding as one more item when searched). No data
and no phases: :mod:`~microscale.ptq.pipeline` runs those.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from microscale.formats import get_weight_format
from microscale.formats.ggml import layer_format
from microscale.ptq.config import QuantizeConfig
from microscale.ptq.engine import Engine
from microscale.ptq.search import EMBED_ITEM, Problem, check_budget, group_layers

__all__ = ["check_quantize_budget", "fit_rows", "search_problem", "setup"]


def setup(
    engine: Engine,
    cfg: QuantizeConfig,
    calib: Sequence[np.ndarray],
    evals: Sequence[np.ndarray],
    trained: Mapping[str, str] | None,
    say: Callable[[str], None],
    options: Mapping[str, tuple[str, ...]],
) -> tuple[dict[str, str], dict[str, str], dict[str, str] | None]:
    """The layers' groups, pins and trained formats (:func:`_trained`), the budget checked
    against them; refuses a run without calibration or evaluation batches."""
    if not calib or not evals:
        raise ValueError(
            f"quantize_model needs calibration and evaluation batches (got "
            f"{len(calib)} and {len(evals)})"
        )
    groups = group_layers(engine.paths, cfg.groups)
    pinned = _pins(engine.paths, cfg.pin)
    _check_budget(engine, cfg, groups, pinned, options)
    say(
        f"quantize: {len(engine.paths)} linear layers in {len(set(groups.values()))} groups, "
        f"{len(pinned)} pinned; {len(calib)} calibration and {len(evals)} eval batches"
    )
    return groups, pinned, _trained(trained, engine.paths, pinned)


def fit_rows(
    engine: Engine,
    cfg: QuantizeConfig,
    options: Mapping[str, tuple[str, ...]],
    say: Callable[[str], None],
) -> tuple[QuantizeConfig, dict[str, tuple[str, ...]]]:
    """llama.cpp's rule for a row its type cannot hold (:func:`~microscale.formats.ggml.
    layer_format`): a layer whose rows of ``K`` inputs are not whole blocks of a candidate
    ggml type may take the type llama-quantize writes instead. Returns the config with those
    fallbacks among the candidates (scored like the rest) and every layer's options: its
    candidates (``options``, else ``cfg.formats``) with each fallback in place of the type it
    stands for; unchanged when every row fits. A pin that its layer's rows cannot hold is
    refused before any work, naming both."""
    k = engine.rows
    for p, f in _pins(engine.paths, cfg.pin).items():
        if layer_format(f, k[p]) != f:
            raise ValueError(
                f"pin: {f} cannot hold {p}: its rows of {k[p]} inputs are not whole {f} "
                f"blocks; llama.cpp writes such a tensor as {layer_format(f, k[p])} (pin that)"
            )
    base = {p: tuple(options.get(p, cfg.formats)) for p in engine.paths}
    fitted = {p: tuple(dict.fromkeys(layer_format(f, k[p]) for f in fs)) for p, fs in base.items()}
    if fitted == base:
        return cfg, dict(options)
    moved: dict[tuple[str, str], list[str]] = {}
    for p, fs in base.items():
        for f in fs:
            if layer_format(f, k[p]) != f:
                moved.setdefault((f, layer_format(f, k[p])), []).append(p)
    for (f, stored), layers in moved.items():
        widths = sorted({k[p] for p in layers})
        say(
            f"quantize: {f} cannot hold the rows of {len(layers)} layer(s) "
            f"({', '.join(map(str, widths))} inputs): they take {stored} instead, as "
            "llama.cpp writes them"
        )
    added = tuple(dict.fromkeys(s for fs in fitted.values() for s in fs if s not in cfg.formats))
    return dataclasses.replace(cfg, formats=cfg.formats + added), fitted


def _check_budget(
    engine: Engine,
    cfg: QuantizeConfig,
    groups: Mapping[str, str],
    pinned: Mapping[str, str],
    options: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Refuse a budget below the cheapest allocation before any work: the cheapest
    allocation depends on the layers' sizes, candidates, groups and pins, not on scores
    (:func:`~microscale.ptq.search.check_budget` of the search's problem, scores zero)."""
    fmts = cfg.searched_embed_formats
    embed = None
    if fmts and engine.tables:  # the token embedding item, as pipeline._score_embedding makes it
        embed = {
            "numel": engine.table_numel,
            "candidates": list(fmts),
            "scores": dict.fromkeys(fmts, 0.0),
        }
    zero = {p: dict.fromkeys(cfg.formats, 0.0) for p in engine.paths}
    check_budget(search_problem(engine, cfg, zero, groups, pinned, embed, options), cfg.budget)


def check_quantize_budget(
    model: Any, config: QuantizeConfig, candidates: Mapping[str, Sequence[str]] | None = None
) -> None:
    """Raise the ``ValueError`` :func:`quantize_model` raises for ``config.budget`` below
    the cheapest allocation of ``model``'s layers (with ``candidates`` as there), without
    calibration data (callers check it before loading any)."""
    engine = Engine(model)
    options = {p: tuple(f) for p, f in (candidates or {}).items()}
    config, options = fit_rows(engine, config, options, lambda _msg: None)
    _check_budget(
        engine,
        config,
        group_layers(engine.paths, config.groups),
        _pins(engine.paths, config.pin),
        options,
    )


def _pins(paths: Sequence[str], pin: Sequence[tuple[str, str]]) -> dict[str, str]:
    """{path: format} of the layers the first matching ``pin`` regex forces."""
    pinned = {}
    for p in paths:
        for pattern, fmt in pin:
            if re.fullmatch(pattern, p):
                pinned[p] = fmt
                break
    return pinned


def _trained(
    trained: Mapping[str, str] | None, paths: Sequence[str], pinned: Mapping[str, str]
) -> dict[str, str] | None:
    """The trained allocation with registry names, pinned layers keeping their pin."""
    if trained is None:
        return None
    missing = sorted(set(paths) - set(trained))
    if missing:
        raise ValueError(
            f"quantize_model: trained allocation has no format for "
            f"{len(missing)} layer(s), e.g. {missing[0]!r}; expected one "
            f"for every linear layer"
        )
    return {p: pinned.get(p, get_weight_format(trained[p]).name) for p in paths}


def search_problem(
    engine: Engine,
    cfg: QuantizeConfig,
    scores: Mapping[str, Mapping[str, float]],
    groups: Mapping[str, str],
    pinned: Mapping[str, str],
    embed: Mapping[str, Any] | None,
    options: Mapping[str, tuple[str, ...]] | None = None,
) -> Problem:
    """The search over the linear layers, the other parameters counted at 16 bits with
    ``count_other_params``, or the token embedding / LM head among them as one more item
    (:data:`EMBED_ITEM`, with its own candidates)."""
    extra = engine.other_numel if cfg.count_other_params else 0
    options = {p: f for p, f in (options or {}).items() if p in engine.numel}
    if embed is None:
        return Problem(
            formats=cfg.formats,
            scores=scores,
            numel=engine.numel,
            groups=groups,
            pinned=pinned,
            options=options,
            extra_numel=extra,
        )
    if EMBED_ITEM in engine.numel:  # pragma: no cover - no module path has "<"
        raise ValueError(f"a linear layer is named {EMBED_ITEM!r}, the embedding item's name")
    return Problem(
        formats=cfg.formats,
        scores={**scores, EMBED_ITEM: embed["scores"]},
        numel={**engine.numel, EMBED_ITEM: embed["numel"]},
        groups={**groups, EMBED_ITEM: EMBED_ITEM},
        pinned=pinned,
        options={**options, EMBED_ITEM: tuple(embed["candidates"])},
        extra_numel=extra - embed["numel"],
    )

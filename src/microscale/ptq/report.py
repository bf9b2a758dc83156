"""Files of a quantize run: rules, checkpoint, report.json / report.md, plots.

``write_outputs(result, out_dir)`` writes::

    precision_rules.json   the searched allocation as a PrecisionRules (training's object)
    checkpoint/            the quantized model: through microscale.export (compressed-tensors
                           or ModelOpt, vLLM-loadable) for a microscale Transformer; else
                           microscale's own layout (model.safetensors + manifest.json)
    model.gguf             instead of checkpoint/ with layout="gguf": one llama.cpp file
    report.json            budget, effective_bits, val_ppl{bf16, uniform_*, heuristic,
                           searched}, layers{path: format}, scores, calibration, PTQ effects
    report.md              the same as tables
    pareto.png             val perplexity vs effective bits: uniform formats, the heuristic,
                           the searched allocations across budgets
    sensitivity.png        layer x format heatmap of log10 scores, the chosen format marked
    imatrix.gguf           with layout="gguf": the importance matrix measured on the
                           calibration text, as llama.cpp's llama-quantize --imatrix reads it
                           (:mod:`microscale.export.gguf.imatrix`)
    checksums.json         the CRC-32 of every file above but the weight files (which store
                           their own per tensor): ``microscale verify`` names a file edited
                           since (:func:`microscale.integrity.write_file_checksums`)

microscale's own checkpoint layout (``checkpoint/manifest.json`` describes every tensor)
is :mod:`microscale.export.manifest`; each layout is a row of
:mod:`microscale.export.registry`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from microscale.colors import style
from microscale.export import LayerQuant, flat_params
from microscale.export.manifest import read_manifest, write_manifest
from microscale.export.registry import DEFAULT_LAYOUT, Layout, get_layout
from microscale.files import (
    DiskWriteError,
    atomic_folder,
    atomic_write_text,
    check_free_space,
    check_replace_dir,
    lock_folder,
    save_figure,
)
from microscale.fingerprint import fingerprint_line, numerics_fingerprint
from microscale.formats import get_weight_format, weight_only
from microscale.integrity import write_file_checksums
from microscale.outputs import QuantizeOutput
from microscale.ptq.imatrix import Imatrix
from microscale.ptq.result import QuantizeResult

__all__ = [
    "check_quantize_out",
    "plot_pareto",
    "plot_sensitivity",
    "read_own_checkpoint",
    "write_markdown",
    "write_outputs",
    "write_own_checkpoint",
]


def write_own_checkpoint(result: QuantizeResult, out_dir: str | os.PathLike) -> dict[str, Any]:
    """``result``'s weights in microscale's own layout
    (:func:`microscale.export.manifest.write_manifest`); returns a description."""
    assert result.engine is not None  # a result of quantize_model holds its engine
    # rules are None only for ggml types, which this layout refuses (Layout.check_formats)
    assert result.rules is not None, "microscale's own layout holds no ggml block types"
    return write_manifest(
        out_dir,
        params=flat_params(result.engine.params),
        weights={p: result.weights[p] for p in result.paths},
        activations=result.config.activations,
        input_amax=result.act_amax,
        rules=result.rules.to_dict(),
    )


read_own_checkpoint = read_manifest  # the layout's reader, under the name PTQ gave it


def _export(result: QuantizeResult, out: Path, model_config, tokenizer, layout: Layout):
    """``result``'s quantized weights written by ``layout``'s row (byte for byte where the
    layout stores their formats natively); returns the report's ``checkpoint`` entry."""
    assert result.engine is not None  # a result of quantize_model holds its engine
    flat = flat_params(result.engine.params)
    for p in result.paths:
        w = result.weights[p]
        if get_weight_format(w.format).quantized:
            flat[f"{p}.kernel"] = w.qarray
    acts = result.config.activations
    layers = {
        p: LayerQuant(weights=f, inputs=f if acts and get_weight_format(f).quantized else None)
        for p, f in result.allocation.formats.items()
    }
    # the searched token embedding / LM head format, for a layout that stores the table
    # quantized (the others keep it bf16; report.json's embed_format serves a later export)
    embed = result.embed_format
    options = {"embed_format": embed} if embed is not None and layout.embed_formats else {}
    res = layout.write(
        flat,
        out,
        config=model_config,
        layer_formats=layers,
        activations=acts,
        input_amax=result.act_amax if acts else None,
        tokenizer=tokenizer,
        overwrite=True,
        **options,
    )
    return res.describe()


def write_outputs(
    result: QuantizeResult,
    out_dir: str | os.PathLike,
    *,
    model_config=None,
    tokenizer=None,
    layout: str = DEFAULT_LAYOUT,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
    imatrix: Imatrix | None = None,
    datasets: Sequence[str] = (),
) -> dict[str, Any]:
    """Write every output file under ``out_dir`` (see the module doc); returns the report.
    ``imatrix`` (:func:`microscale.ptq.imatrix.collect_imatrix` on the calibration
    batches, named by ``datasets``): written as ``imatrix.gguf`` beside the model.

    The files are written into a temporary sibling folder that replaces ``out_dir`` only
    when complete (:func:`microscale.files.atomic_folder`); ``out_dir`` must be new, empty
    or, with ``overwrite``, an earlier quantize output (:func:`check_quantize_out`).
    A result whose allocation holds ggml's block types has no ``precision_rules.json`` (no
    training recipe runs them: ``result.rules`` is None) and needs a layout that stores them
    (``gguf``): another layout is refused before anything is written.
    """
    row = get_layout(layout)
    ggml = sorted(
        {f for f in result.allocation.formats.values() if weight_only(get_weight_format(f))}
    )
    if ggml and row.check_formats is not None:
        row.check_formats(ggml)
    with lock_folder(out_dir):
        check_quantize_out(out_dir, overwrite=overwrite)
        with atomic_folder(out_dir, overwrite=True, what="quantize output folder") as tmp:
            return _write_outputs(
                result,
                tmp,
                model_config=model_config,
                tokenizer=tokenizer,
                layout=layout,
                log=log,
                shown=Path(out_dir),
                imatrix=imatrix,
                datasets=datasets,
            )


def check_quantize_space(out_dir: str | os.PathLike, model, formats) -> None:
    """Refuse before any work when the file system of ``out_dir`` cannot hold the least
    the output's model can take: every parameter at the cheapest bits per element of
    ``formats`` (the search's candidates and pins), reports and plots not counted. Skipped
    when a name is not a registry format (a layout's own block types: no bound known)."""
    try:
        bits = min(get_weight_format(f).bits_per_element for f in formats)
    except ValueError:
        return
    numel = sum(int(np.prod(np.shape(a))) for a in flat_params(model).values())
    check_free_space(
        out_dir, math.ceil(numel * bits / 8), what="quantize output folder", floor=True
    )


def check_quantize_out(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Fail fast unless ``out_dir`` can take quantize outputs: a writable new or empty
    folder, or (with ``overwrite``) an earlier quantize output
    (:class:`~microscale.outputs.QuantizeOutput`), which is replaced: the rule ``export``
    follows too (:func:`~microscale.files.check_replace_dir`)."""
    return check_replace_dir(
        out_dir,
        overwrite=overwrite,
        what="quantize output folder",
        earlier=QuantizeOutput.detect,
        earlier_what="an earlier quantize output (no report.json + precision_rules.json)",
    )


def _write_outputs(
    result: QuantizeResult,
    out: Path,
    *,
    model_config,
    tokenizer,
    layout: str,
    log,
    shown: Path,
    imatrix: Imatrix | None,
    datasets: Sequence[str],
) -> dict[str, Any]:
    say = log or (lambda _m: None)
    row = get_layout(layout)
    if result.rules is not None:  # ggml's block types: no training recipe runs them
        result.rules.save(out / QuantizeOutput.RULES)
    ck_dir = QuantizeOutput.model(out, single_file=row.single_file)
    checkpoint: dict[str, Any]
    if model_config is not None and row.writes_model:
        try:
            checkpoint = _export(result, ck_dir, model_config, tokenizer, row)
        except DiskWriteError:  # a full disk fills the fallback too: name it at once
            raise
        except Exception as e:  # noqa: BLE001 - recorded in the report, never hidden
            if result.rules is None:  # ggml's bytes: no other layout of ours holds them
                raise
            reason = f"{type(e).__name__}: {e}"
            say(f"quantize: export to {layout} failed ({reason}); writing microscale's layout")
            checkpoint = write_own_checkpoint(result, out / QuantizeOutput.CHECKPOINT)
            checkpoint["fallback_reason"] = reason
    else:
        checkpoint = write_own_checkpoint(result, out / QuantizeOutput.CHECKPOINT)
    # where it will be once the temporary folder is renamed into place
    checkpoint["path"] = str(shown / Path(checkpoint["path"]).name)
    record = dataclasses.replace(
        result.report(), checkpoint=checkpoint, numerics=numerics_fingerprint("quantize")
    )
    QuantizeOutput.write_report(out, record)
    report = record.to_dict()
    write_markdown(report, out / QuantizeOutput.REPORT_MD)
    plot_pareto(report, out / QuantizeOutput.PARETO)
    plot_sensitivity(report, out / QuantizeOutput.SENSITIVITY)
    q = QuantizeOutput
    if imatrix is not None and row.imatrix is not None:
        row.imatrix(out / q.IMATRIX, imatrix, datasets=datasets)
    write_file_checksums(out)  # last: every file above (microscale verify checks them)
    extra = f", {q.IMATRIX}" if (out / q.IMATRIX).exists() else ""
    rules = f"{q.RULES}, " if result.rules is not None else ""
    say(
        f"quantize: wrote {shown}/{{{rules}{q.CHECKPOINT}/, {q.REPORT}, {q.REPORT_MD}, "
        f"{q.PARETO}, {q.SENSITIVITY}{extra}, {q.CHECKSUMS}}}"
    )
    return report


# ---------------------------------------------------------------------- markdown


def _fmt(x: float, nd: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _ptq_name(ptq: Mapping[str, Any]) -> str:
    """The ptq_effects column of a WeightPTQ dict ("rtn", "mse_scale", ..., "gptq")."""
    if ptq.get("method") == "gptq":
        return "gptq"
    mse, f6 = bool(ptq.get("mse_scale")), bool(ptq.get("four_over_six"))
    return {
        (False, False): "rtn",
        (True, False): "mse_scale",
        (False, True): "four_over_six",
        (True, True): "both",
    }[(mse, f6)]


def _bits(d: Mapping[str, Any], key: str) -> str:
    """``d[key]`` as bits per weight ("-" for reports written before it was recorded)."""
    return f"{d[key]:.3f}" if key in d else "-"


def _awq_lines(report: Mapping[str, Any]) -> list[str]:
    """``report.md``'s AWQ section: the alpha of each folded group (none without AWQ)."""
    awq = report.get("awq")
    if not awq:
        return []
    groups = awq["groups"]
    alphas = [g["alpha"] for g in groups.values()]
    lines = [
        "",
        "## AWQ scales",
        "",
        f"Per-input-channel scales folded into the model before everything above (every "
        f"point, bf16 included, is the folded model), chosen for {awq['format']} on "
        f"{awq['tokens']} calibration tokens: {sum(a > 0 for a in alphas)} of "
        f"{len(alphas)} groups scaled.",
        "",
        "| group | alpha | output error vs alpha 0 | s min | s max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, g in groups.items():
        ratio = g["error"] / g["error_alpha0"] if g["error_alpha0"] else 1.0
        lines.append(
            f"| {name} | {g['alpha']:g} | {ratio:.3f} | {g['s_min']:.3g} | {g['s_max']:.3g} |"
        )
    return lines


def _ptq_effect_lines(report: Mapping[str, Any]) -> list[str]:
    """``report.md``'s sections on the PTQ choices and the quantized inputs (none when the
    report measured neither)."""
    lines: list[str] = []
    eff = report.get("ptq_effects") or {}
    if eff.get("weights"):
        lines += [
            "",
            "## PTQ choices (val ppl)",
            "",
            "Every allocation above uses the run's choice "
            f"({_ptq_name(report.get('ptq') or {})}); this table measures each "
            "choice on its own.",
            "",
            "| allocation | rtn | mse_scale | four_over_six | both | gptq | best |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for label, row in eff["weights"].items():
            cells = [
                _fmt(row.get(k)) if k in row else "n/a"
                for k in ("rtn", "mse_scale", "four_over_six", "both", "gptq")
            ]
            best = min(row, key=row.get) if row else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {best} |")
        used = _ptq_name(report.get("ptq") or {})
        worse = [
            lab
            for lab, row in eff["weights"].items()
            if used in row and row[used] > row.get("rtn", row[used])
        ]
        if worse:
            lines += [
                "",
                f"**Note**: the run's PTQ choice ({used}) measured WORSE than "
                f"round-to-nearest on {', '.join(worse)}.",
            ]
    if eff.get("activations"):
        lines += [
            "",
            "## Quantized inputs (W4A4 / W8A8, val ppl)",
            "",
            "| allocation | weight-only | dynamic input amax | static calibrated amax |",
            "|---|---:|---:|---:|",
        ]
        for label, row in eff["activations"].items():
            lines.append(
                f"| {label} | {_fmt(row['weight_only'])} | {_fmt(row['dynamic'])} | "
                f"{_fmt(row['static'])} |"
            )
    return lines


def _comparison_lines(report: Mapping[str, Any]) -> list[str]:
    """The paired val-loss differences between allocations, with their standard errors."""
    lines: list[str] = []
    comp = report.get("comparisons") or {}
    if comp:
        lines += [
            "",
            "## Paired differences (val loss, same batches)",
            "",
            "| difference | mean dloss (nats) | std. error | t |",
            "|---|---:|---:|---:|",
        ]
        for label, c in comp.items():
            lines.append(
                f"| {label} | {c['dloss']:+.5f} | {_fmt(c['se'], 5)} | {_fmt(c['t'], 1)} |"
            )
        lines += [
            "",
            "|t| < 2: the difference is within the evaluation noise of "
            f"{next(iter(comp.values()))['batches']} batches.",
        ]
    return lines


def _layer_lines(report: Mapping[str, Any]) -> list[str]:
    """The per-layer table: group, size, chosen format, score per format, input amax."""
    fmts = report["formats"]
    lines = [
        "",
        "## Layers",
        "",
        "| layer | group | elements | chosen | "
        + " | ".join(f"score {f}" for f in fmts)
        + " | input amax |",
        "|---|---|---:|---|" + "---:|" * len(fmts) + "---:|",
    ]
    for p, f in report["layers"].items():
        sc = report["scores"].get(p, {})
        scores = " | ".join(f"{sc[g]:.3g}" if g in sc else "-" for g in fmts)
        lines.append(
            f"| {p} | {report['groups'][p]} | {report['numel'][p]} | **{f}** | "
            f"{scores} | {report['act_amax'].get(p, float('nan')):.3g} |"
        )
    return lines


def _others(report: Mapping[str, Any]) -> str:
    """How the whole model's bits count the parameters outside the linear layers."""
    emb = report.get("embedding")
    if not emb:
        return "embeddings, norms and LM head counted at 16 bits"
    scores = ", ".join(f"{f} {v:+.4g}" for f, v in emb["scores"].items())
    return (
        f"the token embedding / LM head searched: **{emb['format']}** of {emb['candidates']}, "
        f"scores {scores}; norms at 16 bits"
    )


def write_markdown(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """``report.md``: summary, points, PTQ effects and the per-layer table."""
    pts = report["points"]
    bf16 = pts["bf16"]["val_ppl"]
    lines = [
        "# microscale quantize report",
        "",
        f"Budget **{report['budget']}** bits/weight; searched allocation uses "
        f"**{report['effective_bits']:.4f}** bits ({report['method']} scores, "
        f"{'W+A' if report['activations'] else 'weight-only'}, solver {report['solver']} in "
        f"{report['solve_time_s'] * 1e3:.1f} ms). Formats: {report['counts']}.",
        "",
        f"Bits per weight: **{_bits(report, 'linear_bits')}** in the linear layers, "
        f"**{_bits(report, 'model_bits')}** in the whole model ({_others(report)}).",
        "",
        "## Validation perplexity",
        "",
        "| allocation | effective bits | linear bits | model bits | val ppl | vs bf16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, p in pts.items():
        lines.append(
            f"| {label} | {p['effective_bits']:.3f} | {_bits(p, 'linear_bits')} | "
            f"{_bits(p, 'model_bits')} | {p['val_ppl']:.4f} | "
            f"{100 * (p['val_ppl'] / bf16 - 1):+.2f}% |"
        )
    if "trained" in pts:
        lines += [
            "",
            "`trained`: the allocation this run trained with, rounded to nearest as "
            "its training forward pass and `microscale export` round it (the deployed "
            "model)"
            + (
                "; `trained_ptq`: the same allocation with this report's PTQ "
                "choices (docs/qat measures both on a QAT test bed)."
                if "trained_ptq" in pts
                else "."
            ),
        ]
    lines += _comparison_lines(report)
    lines += _ptq_effect_lines(report)
    lines += _awq_lines(report)
    lines += _layer_lines(report)
    cal = report["calibration"]
    lines += [
        "",
        f"Calibration: {cal.get('tokens')} tokens in {cal.get('batches')} batches "
        f"from the {cal.get('split', '?')} split (seed {report['seed']}). Timings: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in report["timings"].items())
        + ".",
    ]
    if report.get("peak_rss_gb"):
        lines[-1] += (
            " Peak resident memory: "
            + ", ".join(f"{k} {v:.2f} GiB" for k, v in report["peak_rss_gb"].items())
            + "."
        )
    ck = report.get("checkpoint")
    if ck:
        lines.append(f"Checkpoint: `{ck['path']}` ({ck['layout']}).")
    lines += ["", fingerprint_line(report.get("numerics"))]
    atomic_write_text(path, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------- plots


# The allocations that are no format: hues no format of the Pareto plot takes
# (microscale.colors gives the formats theirs).
_SEARCHED, _HEURISTIC = "#882255", "#999933"


def plot_pareto(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Val perplexity vs effective bits (uniform, heuristic, searched across budgets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve = sorted(
        (p["effective_bits"], p["val_ppl"]) for k, p in pts.items() if p["kind"] == "searched"
    )
    if curve:
        xs, ys = zip(*curve, strict=True)
        ax.plot(xs, ys, "-o", color=_SEARCHED, label="searched (budgets)", zorder=2)
    s = pts["searched"]
    ax.plot(
        [s["effective_bits"]],
        [s["val_ppl"]],
        "*",
        ms=16,
        color=_SEARCHED,
        label=f"searched @ {report['budget']}",
        zorder=3,
    )
    uniform = [(k, p) for k, p in pts.items() if p["kind"] == "uniform"]
    for i, (label, p) in enumerate(sorted(uniform, key=lambda kp: kp[1]["effective_bits"])):
        fmt = label.replace("uniform_", "")
        color = style(fmt).color  # the format's colour in every figure (microscale.colors)
        ax.plot([p["effective_bits"]], [p["val_ppl"]], "s", ms=8, color=color, zorder=3)
        ax.annotate(
            fmt,
            (p["effective_bits"], p["val_ppl"]),
            textcoords="offset points",
            xytext=(6, 4 if i % 2 == 0 else -11),
            fontsize=8,
        )
    h = pts["heuristic"]
    ax.plot(
        [h["effective_bits"]],
        [h["val_ppl"]],
        "D",
        ms=8,
        color=_HEURISTIC,
        label="heuristic (first/last + down in FP8)",
        zorder=3,
    )
    ax.axhline(pts["bf16"]["val_ppl"], color="gray", ls="--", lw=1, label="bf16")
    ax.set_xlabel("effective bits per weight")
    ax.set_ylabel("validation perplexity")
    ax.set_title("PTQ: perplexity vs effective bits")
    ax.grid(alpha=0.3)
    save_figure(fig, path, legend_ax=ax)


def plot_sensitivity(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Heatmap of log10 scores (rows: layers, columns: formats); chosen formats boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [f for f in report["formats"] if get_weight_format(f).quantized]
    layers = list(report["layers"])
    sc = report["scores_raw"]
    vals = np.array([[sc[p][f] if p in sc else np.nan for f in fmts] for p in layers], np.float64)
    fig, ax = plt.subplots(figsize=(2.2 + 1.1 * len(fmts), 1.2 + 0.22 * len(layers)))
    signed = bool(np.nanmin(vals) < 0) if np.isfinite(vals).any() else False
    if signed:  # loss changes of either sign: symmetric log scale around 0
        from matplotlib.colors import SymLogNorm

        top = float(np.nanmax(np.abs(vals))) or 1.0
        im = ax.imshow(
            vals,
            aspect="auto",
            cmap="coolwarm",
            norm=SymLogNorm(linthresh=top * 1e-3, vmin=-top, vmax=top),
        )
        label = f"{report['method']} score (loss change, symlog)"
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            logv = np.log10(np.where(vals > 0, vals, np.nan))
        im = ax.imshow(logv, aspect="auto", cmap="viridis")
        label = f"log10 {report['method']} score"
    ax.set_xticks(range(len(fmts)), fmts)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    for i, p in enumerate(layers):
        f = report["layers"][p]
        if f in fmts:
            j = fmts.index(f)
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
    fig.colorbar(im, ax=ax, label=label)
    ax.set_title("sensitivity (red: chosen; bf16 = 0 not shown)", fontsize=9)
    save_figure(fig, path, dpi=110)

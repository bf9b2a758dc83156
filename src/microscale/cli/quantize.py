"""``microscale quantize``: per-layer sensitivity and a budgeted mixed-precision search.

    microscale quantize --model runs/tiny --out out/q budget=4.8
    microscale quantize -m runs/tiny -o out/q5 budget=5.0 formats=nvfp4,fp8,bf16 \\
        method=kl calib_tokens=8192 seed=1
    microscale quantize -m runs/tiny -o out/w4a4 activations=true   # inputs quantized too
    microscale quantize -m runs/tiny -o out/g ptq.method=gptq        # GPTQ
    microscale quantize -m runs/tiny -o out/q layout=gguf budget=5.0
        # llama.cpp: searches nvfp4, mxfp4, q8_0, bf16 only; writes out/q/model.gguf
    microscale quantize -m runs/tiny -o out/q layout=gguf budget=5.5 count_other_params=true
        # the budget counts the whole model; the search picks the token embedding's format
    microscale quantize -m /models/SmolLM2-135M -o out/s corpus=texts/
        # an HF model folder, calibrated on texts/ with the model's own tokenizer
    microscale quantize -m runs/tiny -o out/q budget=4.5 overwrite=true
        # replaces the earlier quantize output out/q (without it: refused, as export does)
    microscale quantize --list-keys                  # every key with its value and meaning

The keys are those of :class:`~microscale.ptq.QuantizeConfig` (dotted for the nested
``ptq.``) and of :class:`~microscale.workflows.quantize.QuantizeRunConfig` (``layout``,
``corpus``, ``step``, ``eval_batches``, ``overwrite``); a layout's ``quantize_preset`` comes first
(``layout=gguf``: ``QuantizeConfig.for_gguf()``'s ggml block types, heuristic and
whole-file budget), then the keys. The flags before ``key=value`` (``--budget 5``,
``--w4a4``, ``--target gguf``, ...) are gone: each is refused with one line naming its key
(:data:`REMOVED_FLAGS`, docs/release-notes.md), and so are ``--checkpoint`` / ``-c``, now
``--model`` / ``-m`` as in every command that reads a model. Everything else is
:func:`microscale.workflows.quantize_run`. Exit codes: 0 done, 2 bad arguments (unknown
key or format, infeasible budget, not a model folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from microscale.cli.args import (
    add_compile_cache_option,
    add_model_option,
    add_quiet,
    add_removed_flags,
    hf_families,
    name_list,
    positive_float_list,
    refuse_unused,
    require,
    required_group,
    spelled,
    split_keys,
    use_compile_cache,
)

# Short names accepted on the command line for registry formats.
_ALIASES = {"fp8": "fp8_e4m3"}


def _formats(text: str) -> tuple[str, ...]:
    """A format list: comma-separated format names (each once), aliases resolved."""
    return tuple(_ALIASES.get(f, f) for f in name_list(text))


# The flags before key=value (removed; docs/release-notes.md) -> what replaces each.
REMOVED_FLAGS = {
    "--budget": "budget=BITS",
    "--formats": "formats=A,B",
    "--target": "layout=gguf",
    "--method": "method=NAME",
    "--calib-tokens": "calib_tokens=N",
    "--seed": "seed=N",
    "--corpus": "corpus=PATH",
    "--step": "step=N",
    "--eval-batches": "eval_batches=N",
    "--w4a4": "activations=true",
    "--dynamic-act-scales": "static_act_scales=false",
    "--no-mse-scale": "ptq.mse_scale=false",
    "--no-four-over-six": "ptq.four_over_six=false",
    "--weight-method": "ptq.method=gptq",
    "--monotone": "monotone=true|false|none",
    "--no-ptq-effects": "ptq_effects=false",
    "--count-other-params": "count_other_params=true",
    "--pareto-budgets": "pareto_budgets=A,B",
    "--solver": "solver=NAME",
    "--layout": "layout=NAME",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = required_group(parser, unless="--list-keys")
    add_model_option(
        required,
        required=False,
        renamed=("--checkpoint", "-c"),
        help="a training run folder (the out= of microscale train), an HF model folder "
        f"(one of: {hf_families()}; config.json, *.safetensors, tokenizer.json) or a "
        "quantize output",
    )
    required.add_argument("--out", "-o", metavar="DIR", help="output folder")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="QuantizeConfig / QuantizeRunConfig keys, dotted for nested "
        "fields: budget=5.0 formats=nvfp4,fp8,bf16 activations=true "
        "ptq.method=gptq layout=gguf corpus=texts/ (--list-keys)",
    )
    add_quiet(parser)
    add_compile_cache_option(parser)
    add_removed_flags(parser, REMOVED_FLAGS)


def configs(args: argparse.Namespace):
    """``(QuantizeConfig, QuantizeRunConfig)`` of the command line's ``key=value``
    overrides. ``ValueError`` (a ``ConfigError`` for a key) naming what is wrong."""
    from microscale.config import apply_overrides
    from microscale.export.registry import get_layout
    from microscale.ptq import QuantizeConfig
    from microscale.workflows.quantize import QuantizeRunConfig

    qkeys, rkeys = split_keys(args.overrides, QuantizeConfig, QuantizeRunConfig)
    for key, parse in (("formats", _formats), ("pareto_budgets", positive_float_list)):
        if isinstance(qkeys.get(key), str):  # a list: empty or repeated items refused
            try:
                qkeys[key] = parse(qkeys[key])
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{key}={qkeys[key]}: {e}") from None
    runc = apply_overrides(QuantizeRunConfig(), rkeys)
    row = get_layout(runc.layout)  # its preset first, then the user's keys
    asked = {"activations": qkeys["activations"]} if "activations" in qkeys else {}
    if apply_overrides(QuantizeConfig(), asked).activations:  # before the preset's formats
        row.refuse_activations()
    cfg = apply_overrides(QuantizeConfig(), {**row.quantize_preset, **qkeys})
    refuse_unused(
        (
            not cfg.static_act_scales and not cfg.activations,
            spelled("static_act_scales", False),
            "without activations=true (only quantized layer inputs have scales)",
        )
    )
    if cfg.activations:
        row.refuse_activations()
    if row.check_formats is not None and "formats" in qkeys:
        row.check_formats(cfg.formats)
    return cfg, runc


def run(args: argparse.Namespace) -> int:
    from microscale.export.registry import get_layout
    from microscale.outputs import QuantizeOutput
    from microscale.workflows import quantize_run

    try:
        cfg, runc = configs(args)
    except (TypeError, ValueError) as e:
        print(f"microscale quantize: error: {e}", file=sys.stderr)
        return 2
    if not require(args, "quantize", "model", "out"):
        return 2
    log = None if args.quiet else (lambda m: print(m, flush=True))
    use_compile_cache(args)
    try:
        result = quantize_run(args.model, args.out, cfg, log=log, **dataclasses.asdict(runc))
    except (FileNotFoundError, ValueError) as e:
        print(f"microscale quantize: error: {e}", file=sys.stderr)
        return 2
    row = get_layout(runc.layout)
    if row.single_file and not QuantizeOutput.model(args.out, single_file=True).is_file():
        print(
            f"microscale quantize: error: the {row.name} export failed (see "
            f"{args.out}/report.json, checkpoint.fallback_reason); the allocation was "
            f"written in microscale's layout to {args.out}/checkpoint",
            file=sys.stderr,
        )
        return 2
    ppl = result.val_ppl
    s = result.points["searched"]
    embed = "" if result.embed_format is None else f", token embedding {result.embed_format}"
    print(
        f"searched {result.allocation.effective_bits:.3f} bits ({s['linear_bits']:.3f} in the "
        f"linear layers, {s['model_bits']:.3f} in the whole model{embed}): val ppl "
        f"{ppl['searched']:.4f} (bf16 {ppl['bf16']:.4f}, heuristic {ppl['heuristic']:.4f} "
        f"@ {result.points['heuristic']['effective_bits']:.2f} bits) -> {args.out}"
    )
    return 0

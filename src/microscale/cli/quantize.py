"""``microscale quantize``: per-layer sensitivity and a budgeted mixed-precision search.

    microscale quantize --checkpoint runs/tiny --budget 4.8 --out out/q
    microscale quantize --checkpoint runs/tiny --budget 5.0 --formats nvfp4,fp8,bf16 \\
        --method kl --calib-tokens 8192 --seed 1 --out out/q5
    microscale quantize --checkpoint runs/tiny --w4a4 --out out/w4a4   # inputs quantized too
    microscale quantize --checkpoint runs/tiny --weight-method gptq --out out/g   # GPTQ
    microscale quantize --checkpoint runs/tiny --target gguf --budget 5.0 --out out/q
        # llama.cpp: searches nvfp4, mxfp4, q8_0, bf16 only; writes out/q/model.gguf
    microscale quantize --checkpoint /models/SmolLM2-135M --corpus texts/ --out out/s
        # an HF Llama folder, calibrated on texts/ with the model's own tokenizer

Everything else is :func:`microscale.ptq.quantize_run`. Exit codes: 0 done, 2 bad
arguments (unknown format, infeasible budget, not a model folder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from microscale.cli.args import (
    name_list,
    nonnegative_int,
    positive_float,
    positive_float_list,
    positive_int,
    refuse_unused,
)

# Short names accepted on the command line for registry formats.
_ALIASES = {"fp8": "fp8_e4m3"}


def _formats(text: str) -> tuple[str, ...]:
    """``--formats``: comma-separated format names (each once), aliases resolved."""
    return tuple(_ALIASES.get(f, f) for f in name_list(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from microscale.export.registry import layout_names

    parser.add_argument("--checkpoint", "-c", required=True, metavar="PATH",
                        help="a training run folder (the out= of microscale train), an HF "
                             "Llama folder (config.json, *.safetensors, tokenizer.json) or a "
                             "quantize output")
    parser.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--budget", type=positive_float, default=4.8,
                        help="effective bits per weight element (default 4.8)")
    parser.add_argument("--formats", type=_formats, default=None,
                        help="candidate formats, comma-separated (fp8 = fp8_e4m3; default "
                             "nvfp4,mxfp4,mxfp8,fp8_e4m3,bf16; --target gguf: "
                             "nvfp4,mxfp4,q8_0,bf16)")
    parser.add_argument("--target", default=None, choices=("gguf",),
                        help="gguf: search only formats llama.cpp runs natively (4.5, 4.25, "
                             "8.5, 16 bits per weight) and write OUT/model.gguf")
    parser.add_argument("--method", default="taylor",
                        choices=("taylor", "gradient", "kl", "loss"),
                        help="sensitivity score (default taylor: first+second order loss "
                             "change, one fwd+bwd per batch; gradient: ModelOpt's Fisher "
                             "score, same pass; kl/loss: one forward per layer and format)")
    parser.add_argument("--calib-tokens", type=positive_int, default=65536,
                        help="held-out calibration tokens (default 65536)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="calibration window seed")
    parser.add_argument("--corpus", default=None,
                        help="calibrate/evaluate on this corpus (a text file or folder, a "
                             ".jsonl, stdlib, ...) tokenized with the model's own tokenizer; "
                             "default: a run's own corpus, stdlib for an HF folder")
    parser.add_argument("--step", type=nonnegative_int, default=None,
                        help="checkpoint step of a run folder (default latest)")
    parser.add_argument("--eval-batches", type=positive_int, default=None,
                        help="validation batches for perplexity (default: the run's; 8 "
                             "batches of 2 x 512 tokens for an HF folder)")
    parser.add_argument("--w4a4", action="store_true",
                        help="quantize layer inputs too (W4A4/W8A8) with static calibrated amax")
    parser.add_argument("--dynamic-act-scales", action="store_true",
                        help="with --w4a4: per-batch input amax instead of the calibrated one")
    parser.add_argument("--no-mse-scale", action="store_true",
                        help="no MSE search of the tensor scale (plain round-to-nearest)")
    parser.add_argument("--no-four-over-six", action="store_true",
                        help="no per-block 4-over-6 scale choice")
    parser.add_argument("--weight-method", default="rtn", choices=("rtn", "gptq"),
                        help="element rounding given the scales: rtn (round to nearest) or "
                             "gptq (error compensation with each layer's calibration-input "
                             "Hessian; default rtn)")
    parser.add_argument("--monotone", default="auto", choices=("auto", "on", "off"),
                        help="monotone score correction (auto: on for gradient/kl, off for "
                             "the signed taylor/loss scores)")
    parser.add_argument("--no-ptq-effects", action="store_true",
                        help="skip the on/off evaluation of each PTQ choice")
    parser.add_argument("--count-other-params", action="store_true",
                        help="count embeddings/norms/LM head (16 bits) in the effective bits")
    parser.add_argument("--pareto-budgets", type=positive_float_list,
                        default=(4.5, 5, 5.5, 6, 6.5, 7, 7.5, 8, 8.5),
                        help="budgets of the searched Pareto points, comma-separated")
    parser.add_argument("--solver", default="auto", choices=("auto", "dp", "milp"))
    parser.add_argument("--layout", default=None,
                        choices=layout_names(single_file=False, quantized=True),
                        help="checkpoint layout (default compressed-tensors; microscale = own "
                             "safetensors + manifest; not with --target gguf)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache")


def run(args: argparse.Namespace) -> int:
    from microscale.ptq import QuantizeConfig, WeightPTQ, quantize_run

    try:
        budgets = args.pareto_budgets
        refuse_unused(
            (args.target == "gguf" and args.layout is not None, f"--layout {args.layout}",
             "with --target gguf (it writes one GGUF file, OUT/model.gguf)"),
            (args.dynamic_act_scales and not args.w4a4, "--dynamic-act-scales",
             "without --w4a4 (only quantized layer inputs have scales)"))
        make, layout = QuantizeConfig, args.layout or "compressed-tensors"
        if args.target == "gguf":
            from microscale.export.gguf import gguf_format

            if args.w4a4:
                raise ValueError("--w4a4 with --target gguf: a GGUF stores weights only "
                                 "(llama.cpp quantizes activations itself)")
            make, layout = QuantizeConfig.for_gguf, "gguf"
            for f in args.formats or ():
                if gguf_format(f) != f:
                    raise ValueError(f"--formats {f}: llama.cpp has no native {f} (it would "
                                     f"run as {gguf_format(f)}); --target gguf searches "
                                     "nvfp4, mxfp4, q8_0, bf16")
        formats = {} if args.formats is None else {"formats": args.formats}
        cfg = make(
            budget=args.budget, **formats, method=args.method,
            calib_tokens=args.calib_tokens, seed=args.seed,
            ptq=WeightPTQ(mse_scale=not args.no_mse_scale,
                          four_over_six=not args.no_four_over_six,
                          method=args.weight_method),
            activations=args.w4a4, static_act_scales=not args.dynamic_act_scales,
            monotone={"auto": None, "on": True, "off": False}[args.monotone],
            ptq_effects=not args.no_ptq_effects,
            count_other_params=args.count_other_params, solver=args.solver,
            pareto_budgets=budgets)
    except (TypeError, ValueError) as e:
        print(f"microscale quantize: error: {e}", file=sys.stderr)
        return 2
    log = None if args.quiet else (lambda m: print(m, flush=True))
    if not args.no_compile_cache:
        from microscale.train import enable_compilation_cache

        enable_compilation_cache()
    try:
        result = quantize_run(args.checkpoint, args.out, cfg, corpus=args.corpus,
                              step=args.step, eval_batches=args.eval_batches,
                              layout=layout, log=log)
    except (FileNotFoundError, ValueError) as e:
        print(f"microscale quantize: error: {e}", file=sys.stderr)
        return 2
    if layout == "gguf" and not (Path(args.out) / "model.gguf").is_file():
        print(f"microscale quantize: error: the GGUF export failed (see "
              f"{args.out}/report.json, checkpoint.fallback_reason); the allocation was "
              f"written in microscale's layout to {args.out}/checkpoint", file=sys.stderr)
        return 2
    ppl = result.val_ppl
    s = result.points["searched"]
    print(f"searched {result.allocation.effective_bits:.3f} bits ({s['linear_bits']:.3f} in the "
          f"linear layers, {s['model_bits']:.3f} in the whole model): val ppl "
          f"{ppl['searched']:.4f} (bf16 {ppl['bf16']:.4f}, heuristic {ppl['heuristic']:.4f} "
          f"@ {result.points['heuristic']['effective_bits']:.2f} bits) -> {args.out}")
    return 0

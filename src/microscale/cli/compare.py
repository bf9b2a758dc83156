"""``microscale compare``: train several recipes on the same data and report paired gaps.

    microscale compare                          # bf16, fp8, nvfp4 x 6 seeds: verdicts with CIs
    microscale compare --preset smoke           # a one-minute first look (no verdict)
    microscale compare --preset decisive        # 20 seeds: +-0.12-point intervals (measured)
    microscale compare --ablations all --seeds 0,1,2
    microscale compare --sizes 0.16M,0.6M,1.7M --runs bf16,nvfp4 --tokens-per-param 1
    microscale compare --config small --parallel 4 steps=2000

A preset (``--preset``, default ``default``) sets the runs, the seeds and the training
regime (overrides of the ``tiny`` config); ``--runs``/``--seeds`` replace its runs/seeds,
``--config`` replaces its regime, and ``key=value`` overrides apply last. Without ``out=``,
a previous ``runs/compare-*`` folder made with the same settings is reused (finished runs
are not recomputed); otherwise a new ``runs/compare-<timestamp>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from microscale.cli.args import (
    add_quiet,
    int_list,
    name_list,
    positive_float,
    positive_int,
    refuse_unused,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from microscale.experiments.compare_config import PRESETS
    from microscale.experiments.scaling import SIZES

    parser.add_argument(
        "--preset",
        "-p",
        default="default",
        choices=list(PRESETS),
        help="; ".join(f"{k}: {v[0]}" for k, v in PRESETS.items()),
    )
    parser.add_argument(
        "--config",
        "-c",
        default=None,
        help="training preset or YAML for the shared config, replacing the "
        "compare preset's regime (default: tiny + the preset's regime)",
    )
    parser.add_argument(
        "--runs", type=name_list, default=None, help="comma-separated runs (default: the preset's)"
    )
    parser.add_argument(
        "--ablations",
        type=name_list,
        default=(),
        help="comma-separated NVFP4 ablations to add, or 'all' "
        "(nvfp4_no_rht, nvfp4_no_sr, nvfp4_1d, nvfp4_all_fp4, "
        "nvfp4_fwd_only, nvfp4_late_bf16, nvfp4_adaptive)",
    )
    parser.add_argument(
        "--seeds", type=int_list, default=None, help="comma-separated seeds (default: the preset's)"
    )
    parser.add_argument(
        "--sizes",
        type=name_list,
        default=None,
        help=f"comma-separated model sizes for a trend sweep, from {list(SIZES)}",
    )
    parser.add_argument(
        "--tokens-per-param",
        type=positive_float,
        default=None,
        help="with --sizes: training tokens per parameter (default 1)",
    )
    parser.add_argument(
        "--min-steps",
        type=positive_int,
        default=None,
        help="with --sizes: fewest optimizer steps per size (default 100)",
    )
    parser.add_argument(
        "--parallel",
        type=positive_int,
        default=1,
        help="concurrent training processes (default 1: in this process)",
    )
    parser.add_argument(
        "--seed-batch",
        type=int,
        default=0,
        help="seeds of one run trained as one program (default 0: as many as fit in "
        "memory; 1: one run at a time)",
    )
    add_quiet(parser)
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides of the shared training config; out=DIR sets the compare output folder",
    )


def configs(args: argparse.Namespace):
    """The shared training config the ``key=value`` settings build (``--list-keys``);
    ``out=`` is the compare output folder, not a key of it."""
    from microscale.config import apply_overrides
    from microscale.experiments.compare_config import PRESETS
    from microscale.train import TrainConfig
    from microscale.train.init import resolve_config

    if args.config is None:
        regime = apply_overrides(TrainConfig.tiny(), list(PRESETS[args.preset][1]))
    else:
        regime = args.config
    return (resolve_config(regime, [o for o in args.overrides if not o.startswith("out=")]),)


def run(args: argparse.Namespace) -> int:
    from microscale.config import ConfigError
    from microscale.experiments.compare import find_previous, run_compare
    from microscale.experiments.compare_config import CompareConfig
    from microscale.experiments.runs import ABLATIONS
    from microscale.experiments.scaling import ScalingConfig, run_scaling

    outs = [o.split("=", 1)[1] for o in args.overrides if o.startswith("out=")]
    out = outs[-1] if outs else None
    try:
        (base,) = configs(args)
        cfg = CompareConfig.preset(
            args.preset, base=base, parallel=args.parallel, seed_batch=args.seed_batch
        )
        refuse_unused(
            (
                args.sizes is None and args.tokens_per_param is not None,
                "--tokens-per-param",
                "without --sizes",
            ),
            (args.sizes is None and args.min_steps is not None, "--min-steps", "without --sizes"),
        )
        runs = list(args.runs or cfg.runs)
        abl = list(ABLATIONS) if args.ablations == ("all",) else list(args.ablations)
        runs += [a for a in abl if a not in runs]
        seeds = args.seeds if args.seeds is not None else cfg.seeds
        cfg = dataclasses.replace(cfg, runs=tuple(runs), seeds=seeds)
        scaling = None
        if args.sizes is not None:
            given = {
                k: v
                for k, v in (
                    ("tokens_per_param", args.tokens_per_param),
                    ("min_steps", args.min_steps),
                )
                if v is not None
            }
            scaling = ScalingConfig(compare=cfg, sizes=args.sizes, **given)
    except (ConfigError, ValueError) as e:
        print(f"microscale compare: error: {e}", file=sys.stderr)
        return 2
    from microscale.train import enable_compilation_cache

    enable_compilation_cache()
    if scaling is not None:
        out = out or time.strftime("runs/compare-sizes-%Y%m%d-%H%M%S")
        scaling = dataclasses.replace(scaling, compare=dataclasses.replace(cfg, out=out))
        summary = run_scaling(scaling, progress=not args.quiet)
        if not args.quiet:
            print(Path(out, "report.md").read_text())
            print(f"[compare] report: {out}/report.md, plot: scaling.png, summary.json")
        return 0 if summary["sizes"] else 1
    if out is None:
        prev = find_previous("runs", cfg.settings_hash())
        out = str(prev) if prev else time.strftime("runs/compare-%Y%m%d-%H%M%S")
        if prev and not args.quiet:
            print(f"[compare] reusing {prev} (same settings; finished runs are kept)")
    cfg = dataclasses.replace(cfg, out=out)
    summary = run_compare(cfg, progress=not args.quiet)
    if not args.quiet:
        print(Path(out, "report.md").read_text())
        print(f"[compare] report: {out}/report.md, plots: convergence.png gap.png, summary.json")
    return 0 if summary["runs"] else 1

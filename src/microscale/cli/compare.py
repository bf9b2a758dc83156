"""``microscale compare``: train several recipes on the same data and report the gaps.

    microscale compare                                   # tiny model, 5 recipes, ~10 min CPU
    microscale compare --ablations all                   # + the NVFP4 ablations
    microscale compare --runs bf16,nvfp4 --seeds 0,1,2 steps=500 out=runs/cmp
    microscale compare --config small --parallel 4       # 4 processes, one device group each

``key=value`` overrides apply to the shared training config (as for ``microscale train``).
Without ``out=``, a previous ``runs/compare-*`` folder made with the same settings is
reused (finished runs are not recomputed); otherwise a new ``runs/compare-<timestamp>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default="tiny",
                        help="training preset or YAML for the shared config (default: tiny)")
    parser.add_argument("--runs", default=None,
                        help="comma-separated runs (default: bf16,fp8,mxfp8,nvfp4,mxfp4)")
    parser.add_argument("--ablations", default="",
                        help="comma-separated NVFP4 ablations to add, or 'all' "
                             "(nvfp4_no_rht, nvfp4_no_sr, nvfp4_1d, nvfp4_all_fp4, "
                             "nvfp4_fwd_only, nvfp4_late_bf16)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="concurrent training processes (default 1: in this process)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="overrides of the shared training config; out=DIR sets the "
                             "compare output folder")


def run(args: argparse.Namespace) -> int:
    from microscale.config import ConfigError
    from microscale.experiments.compare import (
        ABLATIONS,
        BASELINES,
        CompareConfig,
        find_previous,
        run_compare,
    )
    from microscale.train.config import resolve_config

    out = None
    overrides = []
    for o in args.overrides:
        if o.startswith("out="):
            out = o.split("=", 1)[1]
        else:
            overrides.append(o)
    try:
        base = resolve_config(args.config, overrides)
        runs = _names(args.runs) if args.runs else list(BASELINES)
        abl = list(ABLATIONS) if args.ablations.strip() == "all" else _names(args.ablations)
        runs += [a for a in abl if a not in runs]
        seeds = tuple(int(s) for s in _names(args.seeds))
        cfg = CompareConfig(base=base, runs=tuple(runs), seeds=seeds, out=out or "runs/compare",
                            parallel=args.parallel)
    except (ConfigError, ValueError) as e:
        print(f"microscale compare: error: {e}", file=sys.stderr)
        return 2
    if out is None:
        prev = find_previous("runs", cfg.settings_hash())
        out = str(prev) if prev else time.strftime("runs/compare-%Y%m%d-%H%M%S")
        if prev and not args.quiet:
            print(f"[compare] reusing {prev} (same settings; finished runs are kept)")
    from microscale.train import enable_compilation_cache

    enable_compilation_cache()
    cfg = dataclasses.replace(cfg, out=out)
    summary = run_compare(cfg, progress=not args.quiet)
    if not args.quiet:
        print(Path(out, "report.md").read_text())
        print(f"[compare] report: {out}/report.md, plots: convergence.png gap.png, "
              f"summary.json")
    return 0 if summary["runs"] else 1

"""``microscale train``: train a model with a recipe.

    microscale train --config tiny recipe=nvfp4 steps=300 out=runs/x
    microscale train --config my.yaml optim.lr=1e-3 model.d_model=256
    microscale train --config tiny out=runs/x resume=true      # continue exactly
    microscale train --config tiny --print-config              # resolved YAML, no training
    microscale train --list-keys                               # every key with its comment

``--config`` is a preset (``--help`` lists them: ``microscale.train.list_presets()``) or a
YAML file;
then dotted ``key=value`` overrides. Everything else is :func:`microscale.train.train`.
Exit codes: 0 done, 1 aborted (non-finite losses), 2 bad config or arguments (an ``out=``
some process cannot write included), 3 a multi-process job failed: a process was lost or
the job did not assemble (one line says which and where to resume;
:mod:`microscale.cli.supervise`).
"""

from __future__ import annotations

import argparse
import sys

from microscale.cli.args import add_compile_cache_option, add_quiet, use_compile_cache
from microscale.train.config import list_presets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default="tiny",
        help=f"preset name ({', '.join(list_presets())}) or a YAML path (default: tiny)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, dotted for nested fields: recipe=nvfp4 "
        "steps=300 optim.lr=1e-3 model.d_model=256 out=runs/x",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    add_quiet(parser)
    add_compile_cache_option(parser)


def configs(args: argparse.Namespace):
    """The configs the ``key=value`` settings build (``--list-keys`` lists their keys)."""
    from microscale.train.init import resolve_config

    return (resolve_config(args.config, args.overrides),)


def run(args: argparse.Namespace) -> int:
    from microscale.config import ConfigError, to_yaml

    try:
        (cfg,) = configs(args)
    except ConfigError as e:
        print(f"microscale train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    from microscale.cli.supervise import needs_supervisor, supervise

    if needs_supervisor(cfg.mesh):  # JAX's runtime ends a failed job natively: watch it
        flags = ["--quiet"] * args.quiet + ["--no-compile-cache"] * args.no_compile_cache
        return supervise(["train", "--config", args.config, *args.overrides, *flags], cfg)

    from microscale.train import TrainingAborted, train

    use_compile_cache(args)
    try:
        train(cfg, progress=not args.quiet)
    except TrainingAborted as e:
        print(f"microscale train: {e}", file=sys.stderr)
        return 1
    except (ConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"microscale train: error: {e}", file=sys.stderr)
        return 2
    return 0

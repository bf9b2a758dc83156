"""``microscale plan``: compile a training step at target scale on simulated devices,
check that it fits, and put the recipe's speed-up on a roofline.

    microscale plan --config tiny mesh.data=2 mesh.fsdp=2 mesh.tensor=2
    microscale plan --config llama-8b mesh.fsdp=8 --accelerator b200
    microscale plan --config llama-70b mesh.fsdp=64 mesh.tensor=8 --no-compile
    microscale plan --config llama-8b --devices 8 grad_accum=4 --lower-only

``--config`` and ``key=value`` overrides are ``microscale train``'s. Everything else is
:func:`microscale.plan.plan`. Exit codes: 0 planned (even when it does not fit or does
not compile: the report says so), 2 bad config or arguments.
"""

from __future__ import annotations

import argparse
import sys

from microscale.cli.args import add_quiet, positive_int
from microscale.train.config import list_presets

# Simulated devices when --devices is not given and a mesh axis is -1 ("the remaining
# devices", as the presets' mesh.data or mesh.fsdp is): one 8-GPU node.
DEFAULT_DEVICES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default="tiny",
        help=f"preset ({', '.join(list_presets())}) or a YAML path (default: tiny)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides: mesh.fsdp=64 mesh.tensor=8 grad_accum=4 ...",
    )
    parser.add_argument(
        "--accelerator",
        "-a",
        default="b200",
        help="b200, gb200, gb300, h100 or h200 (default: b200)",
    )
    parser.add_argument(
        "--recipe",
        default="nvfp4",
        help="recipe compiled and compared with bf16 and fp8 (default: nvfp4)",
    )
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="simulated devices (default: the mesh's size; when a mesh axis is -1, "
        f"{DEFAULT_DEVICES}, one node)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="memory and roofline from the shapes only (no XLA)",
    )
    parser.add_argument(
        "--lower-only", action="store_true", help="trace and lower the step but do not compile it"
    )
    parser.add_argument("--out", default=None, help="folder for plan.md and plan.json")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_quiet(parser)


def configs(args: argparse.Namespace):
    """The training config the ``key=value`` settings build (``--list-keys``)."""
    from microscale.train.init import resolve_config

    return (resolve_config(args.config, list(args.overrides) + [f"recipe={args.recipe}"]),)


def devices(cfg, given: int | None) -> int | None:
    """``--devices``, or :data:`DEFAULT_DEVICES` when it is not given and a mesh axis is
    -1 (``None`` otherwise: the mesh's own size)."""
    from microscale.train.mesh import AXES

    if given is None and -1 in (getattr(cfg.mesh, a) for a in AXES):
        return DEFAULT_DEVICES
    return given


def run(args: argparse.Namespace) -> int:
    import json

    from microscale.config import ConfigError

    try:
        (cfg,) = configs(args)
        from microscale.plan import get_accelerator, plan

        acc = get_accelerator(args.accelerator)
        res = plan(
            cfg,
            accelerator=acc,
            devices=devices(cfg, args.devices),
            compile=not args.no_compile,
            lower_only=args.lower_only,
            out=args.out,
            verbose=not args.quiet,
        )
    except (ConfigError, ValueError) as e:
        print(f"microscale plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "markdown"}, indent=2))
    else:
        print(res["markdown"], end="")
    return 0

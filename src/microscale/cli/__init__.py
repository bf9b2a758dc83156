"""The `microscale` command line: a thin dispatcher over the library.

Each subcommand lives in its own module `microscale.cli.<name>` exposing
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported lazily so
``microscale --help`` stays fast and a subcommand only pays for what it uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("microscale.cli.compare", "train several recipes on the same data and report the gaps"),
    "train": ("microscale.cli.train", "train a model with a recipe (bf16, fp8, mxfp8, nvfp4, mxfp4)"),
    "quantize": ("microscale.cli.quantize", "sensitivity analysis + budgeted per-layer precision search"),
    "export": ("microscale.cli.export", "write a packed checkpoint (compressed-tensors / ModelOpt)"),
    "generate": ("microscale.cli.generate", "generate text from a (packed) checkpoint"),
    "eval": ("microscale.cli.eval", "perplexity of a (packed) checkpoint"),
    "plan": ("microscale.cli.plan", "compile a train step at scale on simulated devices: "
                                    "memory fit, collectives, roofline"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = COMMANDS
    parser = argparse.ArgumentParser(
        prog="microscale",
        description="NVFP4 training, verification and adaptive quantization in JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Only the requested subcommand's module is imported.
    wanted = argv[0] if argv and argv[0] in commands else None
    for name, (mod, helptext) in commands.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        if name == wanted:
            importlib.import_module(mod).add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(commands[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The `microscale` command line: a thin dispatcher over the library.

Each subcommand lives in its own module `microscale.cli.<name>` exposing
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported lazily so
``microscale --help`` stays fast and a subcommand only pays for what it uses.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": (
        "microscale.cli.compare",
        "train several recipes on the same data and report the gaps",
    ),
    "train": (
        "microscale.cli.train",
        "train a model with a recipe (bf16, fp8, mxfp8, nvfp4, mxfp4)",
    ),
    "quantize": (
        "microscale.cli.quantize",
        "sensitivity analysis + budgeted per-layer precision search",
    ),
    "import": (
        "microscale.cli.import_hf",
        "an HF model folder (a supported family: `microscale import --help` lists them) as "
        "a run folder (config.json's model, its tokenizer, its weights; no training)",
    ),
    "export": (
        "microscale.cli.export",
        "write a packed checkpoint for vLLM, TensorRT-LLM or llama.cpp (layout=: "
        "`microscale export --list-keys` lists the layouts)",
    ),
    "generate": ("microscale.cli.generate", "generate text from a (packed) checkpoint"),
    "eval": ("microscale.cli.eval", "perplexity of a (packed) checkpoint"),
    "plan": (
        "microscale.cli.plan",
        "compile a train step at scale on simulated devices: memory fit, collectives, roofline",
    ),
    "verify": (
        "microscale.cli.verify",
        "check a GGUF file, export, quantize output or run against its stored checksums",
    ),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (no usage block) naming the help flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def command_parser(name: str):
    """``(module, parser)`` of command ``name``: its module's ``add_arguments``, plus the
    options every command of a kind shares (``--list-keys`` where the module builds
    configs from ``key=value`` settings: ``configs(args)``)."""
    from microscale.cli.args import add_list_keys

    mod, helptext = COMMANDS[name]
    parser = ArgumentParser(prog=f"microscale {name}", description=helptext)
    module = importlib.import_module(mod)
    module.add_arguments(parser)
    if hasattr(module, "configs"):
        add_list_keys(parser)
    return module, parser


def parse(argv: list[str]):
    """``(module, args)`` of ``microscale COMMAND ...`` parsed by the command's real parser,
    without running it (the README's command lines are checked with it). ``--help``, a
    usage error, ``--version`` and no or an unknown command exit (``SystemExit``)."""
    if argv and argv[0] in COMMANDS:
        name = argv[0]
        module, parser = command_parser(name)
        # Options may come after `key=value` overrides (`train steps=3 --quiet out=x`).
        args = parser.parse_intermixed_args(argv[1:])
        args.command = name
        return module, args
    from microscale import __version__

    parser = ArgumentParser(
        prog="microscale",
        description="NVFP4 training, verification and adaptive quantization in JAX.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"microscale {__version__}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (_, helptext) in COMMANDS.items():
        sub.add_parser(name, help=helptext, description=helptext)
    parser.parse_args(argv)  # --help, --version, or no or an unknown command: exits
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """Run ``microscale COMMAND ...``; returns the exit status.

    No input ends in a traceback: argument errors and every error a command raises are
    printed as one line on stderr, ``microscale COMMAND: error: ...`` (exit 2; 130 when
    interrupted). ``MICROSCALE_TRACEBACK=1`` adds the traceback, for bug reports. Run as
    the program (no ``argv``), the error line stays the last thing on stderr: nothing a
    library prints while the process winds down follows it (:func:`_last_line_on_stderr`).
    ``--list-keys`` is answered here for every command with ``key=value`` settings: the
    keys of the configs its module's ``configs(args)`` builds.
    """
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    module, args = parse(argv)  # a usage error, --help or --version exits here
    name = args.command
    try:
        if getattr(args, "list_keys", False):
            from microscale.cli.args import describe_keys

            print(describe_keys(*module.configs(args)))
            return 0
        rc = int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"microscale {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`... --list-keys | head`): no error
        if from_command_line:
            _quiet_stdout()
        return 141  # 128 + SIGPIPE, as a shell tool that the pipe's reader left exits
    except Exception as e:  # noqa: BLE001 - one line, never a traceback (see above)
        known = isinstance(e, (ValueError, OSError, LookupError, TypeError))
        print(
            f"microscale {name}: error: {_one_line(e)}"
            + ("" if known else f" ({type(e).__name__}; MICROSCALE_TRACEBACK=1 shows where)"),
            file=sys.stderr,
        )
        if os.environ.get("MICROSCALE_TRACEBACK"):
            import traceback

            traceback.print_exc()
        rc = 2
    if rc == 2 and from_command_line and not os.environ.get("MICROSCALE_TRACEBACK"):
        _last_line_on_stderr()
    return rc


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of output that the pipe's
    reader no longer takes fails nowhere."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _last_line_on_stderr() -> None:
    """Keep the error line just printed the last thing on stderr: the process exits next,
    and a library's threads may still print their teardown (a failed orbax save's writes
    finishing after its event loop closed, tensorstore's, absl's) to file descriptor 2.
    Only for the program itself (``main()`` reading ``sys.argv``), never for a caller."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""argparse value types shared by the subcommands: each rejects a bad value with a message
naming it and what was expected (argparse adds the option name); and the options several
commands share, spelled one way (``--model``, ``--quiet``, ``--list-keys``)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
from typing import Any


def _number(
    text: str, kind: type, lo: float | None, lo_open: bool, hi: float | None, what: str
) -> Any:
    try:
        v = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, 1, False, None, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, 0, False, None, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, float, 0, True, None, "a number > 0")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, float, 0, False, None, "a number >= 0")


def probability(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, float, 0, True, 1, "a number in (0, 1]")


def _list(text: str, one, what: str) -> tuple:
    """Comma-separated items: at least one, each valid, none twice (a repeated seed,
    run or budget is a typo, never a request to do the same work again)."""
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"{text!r} is empty; expected {what}")
    try:
        values = tuple(one(t) for t in items if t)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{text!r} lists {', '.join(repeated)} more than once; expected {what}, each once"
        )
    return values


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 0 (``0,1,2``)."""
    return _list(text, nonnegative_int, "comma-separated integers >= 0 (e.g. 0,1,2)")


def positive_float_list(text: str) -> tuple[float, ...]:
    """Comma-separated numbers > 0 (``4.5,5,6``)."""
    return _list(text, positive_float, "comma-separated numbers > 0 (e.g. 4.5,5,6)")


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names (``bf16,nvfp4``); which names exist is the command's check."""
    return _list(text, str, "comma-separated names")


def refuse_unused(*cases: tuple[bool, str, str]) -> None:
    """Each case is ``(given, option, why)``: an option the user gave in a combination
    that ignores it. Raise a ``ValueError`` naming the first one and why; a command never
    drops an option silently."""
    for given, option, why in cases:
        if given:
            raise ValueError(f"{option} has no effect {why}; drop it")


# ------------------------------------------------------------------- options every command shares


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` / ``-q``, the same in every long-running command: only errors (and the
    result a command exists to print) reach the terminal."""
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="no progress output (errors still print)"
    )


def add_compile_cache_option(parser: argparse.ArgumentParser) -> None:
    """``--no-compile-cache``, for the commands that compile for minutes (train, quantize);
    :func:`use_compile_cache` acts on it."""
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (not even one that "
        "JAX_COMPILATION_CACHE_DIR names)",
    )


def use_compile_cache(args: argparse.Namespace) -> None:
    """JAX's persistent compilation cache on (microscale's folder, unless one is configured
    already) or, with ``--no-compile-cache``, off: JAX would otherwise still use the folder
    that ``JAX_COMPILATION_CACHE_DIR`` names. Call before the first compilation: JAX
    decides once per process."""
    if args.no_compile_cache:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
    else:
        from microscale.train import enable_compilation_cache

        enable_compilation_cache()


def add_list_keys(parser: argparse.ArgumentParser) -> None:
    """``--list-keys``: added by :func:`microscale.cli.main` to every command whose module
    has ``configs(args)`` (the config dataclasses its ``key=value`` settings build)."""
    parser.add_argument(
        "--list-keys",
        action="store_true",
        help="list every KEY=VALUE key with its value and meaning, and exit",
    )


def required_group(parser: argparse.ArgumentParser, *, unless: str | None = None):
    """The argument group the command's required options go in, so ``--help`` shows them
    under "required arguments" (argparse lists every ``--option`` under "options:").
    ``unless``: the option that waives them (``--list-keys``); :func:`require` checks."""
    title = "required arguments" + (f" (except with {unless})" if unless else "")
    return parser.add_argument_group(title)


class _Refused(argparse.Action):
    """An option, or a positional argument, that is gone: refused with one line,
    ``say(old, value)`` (``value``: what followed it, or None), naming what replaces it.
    ``new_dest``: the replacing option's dest, for an old positional beside it."""

    def __init__(self, option_strings, dest, *, say, new_dest: str | None = None, **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.say, self.new_dest = say, new_dest

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is None:  # the old positional
            if values is None:  # not given
                return
            if self.new_dest and getattr(namespace, self.new_dest, None) is not None:
                parser.error(f"unrecognized arguments: {values}")  # the new option given too
        parser.error(self.say(option_string or f"{self.metavar} (a positional argument)", values))


def add_renamed(parser, old: tuple[str, ...], new: str, short: str | None = None) -> None:
    """The old spellings ``old`` of option ``new`` (``short``: its short form), as hidden
    arguments that refuse themselves with one line naming ``new``: ``microscale quantize
    --checkpoint runs/x`` exits 2 with "--checkpoint is now --model (-m): write --model
    runs/x" (argparse alone would say "unrecognized arguments"). An ``old`` without a
    leading ``-`` is an old positional argument, by its metavar (``HF_FOLDER``): refused
    when one is given. ``parser``: the command's parser or an argument group of it."""
    shown = new + (f" ({short})" if short else "")

    def say(was: str, value: str | None) -> str:
        return f"{was} is now {shown}" + ("" if value is None else f": write {new} {value}")

    new_dest = new.lstrip("-").replace("-", "_")
    dest = "_renamed_" + new_dest
    kw = dict(default=None, action=_Refused, say=say, new_dest=new_dest)
    if flags := tuple(o for o in old if o.startswith("-")):
        parser.add_argument(*flags, dest=dest, **kw)
    for name in (o for o in old if not o.startswith("-")):
        parser.add_argument(f"{dest}_{name.lower()}", metavar=name, **kw)


def add_model_option(group, *, help: str, required: bool = True, renamed: tuple[str, ...] = ()):
    """``--model`` / ``-m PATH``: the model a command reads, one spelling in every command
    that reads one (``quantize``, ``export``, ``import``, ``eval``, ``generate``).

    ``group``: the command's :func:`required_group`, so ``--help`` lists it as required.
    ``required=False`` where argparse must not check it and the command's ``run`` calls
    :func:`require`: where an option waives it (``--list-keys``), and where ``renamed``
    holds an old positional (:func:`microscale.cli.parse` reads the options first, and
    argparse would refuse a missing required one before the old positional's own error). ``renamed``: the
    command's old spellings (``--checkpoint``, ``-c``; ``HF_FOLDER``), each refused with
    one line naming ``--model`` (:func:`add_renamed`)."""
    group.add_argument("--model", "-m", metavar="PATH", required=required, help=help)
    if renamed:
        add_renamed(group, renamed, "--model", "-m")


def hf_families() -> str:
    """The model families an HF folder may hold, from the family registry
    (:data:`microscale.model.FAMILIES`), for help texts and errors."""
    from microscale.model.family import FAMILIES

    return ", ".join(FAMILIES)


# ----------------------------------------------------------------------------- key=value


def add_removed_flags(parser: argparse.ArgumentParser, removed: dict[str, str]) -> None:
    """Register the options ``removed`` (``{old flag: the key=value that replaces it}``,
    the release notes' table) as hidden ones that refuse themselves with one line naming
    their replacement (an unregistered option would be refused without it)."""
    for flag, new in removed.items():
        parser.add_argument(
            flag,
            dest=f"_removed_{flag}",
            default=None,
            action=_Refused,
            say=lambda was, _, new=new: f"{was} was removed (docs/release-notes.md); write {new}",
        )


def _shown(v: Any) -> str:
    """A value as a ``key=value`` command line writes it."""
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "none"
    if isinstance(v, tuple):
        return ",".join(_shown(x) for x in v)
    return str(v)


def spelled(key: str, value: Any) -> str:
    """``key=value`` as the user writes it (``shard_size=2``)."""
    return f"{key}={_shown(value)}"


def split_keys(overrides: list[str], *classes: type) -> list[dict[str, Any]]:
    """The ``key=value`` overrides split by the config class whose field the key's first
    part names; an unknown key raises a ``ConfigError`` naming it and every valid key."""
    from microscale.config import ConfigError, config_keys, parse_overrides

    items = dict(parse_overrides(overrides))
    owner = {f.name: i for i, c in enumerate(classes) for f in dataclasses.fields(c)}
    parts: list[dict[str, Any]] = [{} for _ in classes]
    for k, v in items.items():
        i = owner.get(k.split(".")[0])
        if i is None:
            keys = [key for c in classes for key in config_keys(c)]
            guess = difflib.get_close_matches(k, keys, n=1, cutoff=0.6)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            raise ConfigError(f"unknown key {k!r}{hint} (--list-keys lists every key)")
        parts[i][k] = v
    return parts


def describe_keys(*configs: Any) -> str:
    """``--list-keys``: every key of ``configs`` with its value and comment."""
    from microscale.config import describe

    return "\n".join(describe(c) for c in configs)


def require(args: argparse.Namespace, command: str, *names: str) -> bool:
    """Whether the options ``names`` were given (they are optional only for
    ``--list-keys``); prints the usage error naming the missing ones otherwise."""
    missing = [f"--{n}" for n in names if getattr(args, n) is None]
    if missing:
        print(
            f"microscale {command}: error: the following arguments are required: "
            f"{', '.join(missing)}",
            file=sys.stderr,
        )
    return not missing

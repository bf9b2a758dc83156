"""Every command's ``--help`` and every README command line: help exits 0, every option
says what it does, required options are shown as required, the options every command of
a kind shares (``--list-keys``, ``--quiet``, ``--version``) are there, and each
``microscale ...`` line of the README parses with the real parser (its ``key=value``
settings too) without running."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from microscale import __version__
from microscale.cli import COMMANDS, command_parser, main, parse
from microscale.model.family import FAMILIES

ROOT = Path(__file__).resolve().parents[1]

# Commands that run for minutes and print progress: each takes --quiet.
LONG_RUNNING = ("compare", "train", "quantize", "import", "export", "verify", "plan")


def _options(parser: argparse.ArgumentParser):
    """``(action, group title)`` of each argument but --help and hidden (removed) ones."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            yield action, group.title or ""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_exits_0_and_describes_every_option(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert f"usage: microscale {name}" in capsys.readouterr().out
    _, parser = command_parser(name)
    for action, title in _options(parser):
        shown = action.option_strings or [action.metavar or action.dest]
        assert action.help and action.help.strip(), f"{name} {shown[0]} has no help text"
        if action.required and action.option_strings:
            assert title.startswith("required arguments"), (
                f"{name} {shown[0]} is required but listed under {title!r}"
            )


@pytest.mark.parametrize("name", ["quantize", "export"])
def test_options_required_but_for_list_keys_are_shown_required(name):
    """--model and --out are optional to argparse (--list-keys needs neither), and still
    listed as required."""
    _, parser = command_parser(name)
    titles = {a.dest: t for a, t in _options(parser)}
    for dest in ("model", "out"):
        assert titles[dest] == "required arguments (except with --list-keys)"


def test_shared_options():
    """--list-keys in every command with key=value settings (and it runs: exit 0), --quiet
    in every long-running one."""
    with_keys = [n for n in COMMANDS if hasattr(command_parser(n)[0], "configs")]
    assert {"train", "compare", "plan", "quantize", "export"} <= set(with_keys)
    for name in COMMANDS:
        module, parser = command_parser(name)
        flags = {f for a, _ in _options(parser) for f in a.option_strings}
        assert ("--list-keys" in flags) == (name in with_keys), name
        if name in LONG_RUNNING:
            assert {"--quiet", "-q"} <= flags, name
    for name in with_keys:
        assert main([name, "--list-keys"]) == 0, name


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"microscale {__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "microscale", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == f"microscale {__version__}"


def test_family_lists_come_from_the_registry(capsys):
    """Help that names the HF families names every family of the registry."""
    for name in ("quantize", "export", "import"):
        help_text = " ".join(command_parser(name)[1].format_help().split())
        listed = ", ".join(FAMILIES)
        assert f"one of: {listed}" in help_text, name


def test_import_of_a_hub_id_says_what_it_reads(tmp_path, capsys):
    rc = main(["import", "--model", "meta-llama/Llama-3.2-1B", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert f"an HF model folder (one of: {', '.join(FAMILIES)}" in err[0]
    assert "nothing is downloaded from the Hub" in err[0] and "Llama folder" not in err[0]


def readme_command_lines() -> list[str]:
    """Each ``microscale ...`` command of README.md's fenced code blocks (continuation
    lines joined, one command per ``&&`` part)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("microscale "):
                    lines.append(part)
    return lines


def test_the_readme_has_command_lines():
    assert len(readme_command_lines()) >= 5


@pytest.mark.parametrize("line", readme_command_lines())
def test_each_readme_command_line_parses(line):
    """The options parse with the command's real parser, and the key=value settings build
    the command's configs (an unknown key or a bad value fails here); nothing runs."""
    argv = shlex.split(line, comments=True)[1:]
    module, args = parse(argv)
    if hasattr(module, "configs"):
        assert module.configs(args)


def test_a_reader_that_leaves_the_pipe_is_no_error(monkeypatch, capsys):
    """``microscale train --list-keys | head -1``: the reader leaves, and the command exits
    141 (128 + SIGPIPE) with no error line."""

    class LeftPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", LeftPipe())
    assert main(["train", "--list-keys"]) == 141
    assert capsys.readouterr().err == ""

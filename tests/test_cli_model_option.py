"""One spelling of the model input in every command that reads a model: ``--model`` / ``-m``
parses, is listed as required in ``--help``, and each old spelling (``quantize`` and
``export``'s ``--checkpoint`` / ``-c``, ``import``'s positional ``HF_FOLDER``) exits 2 with
one line naming ``--model`` (:func:`microscale.cli.args.add_model_option`). The README and
the docs spell it the new way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from microscale.cli import COMMANDS, command_parser, main, parse

ROOT = Path(__file__).resolve().parents[1]

# command -> (the other arguments it needs to parse, its old spellings of --model; one
# without a leading "-" is an old positional argument)
MODEL_COMMANDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "quantize": (["--out", "out/q"], ("--checkpoint", "-c")),
    "export": (["--out", "out/x"], ("--checkpoint", "-c")),
    "import": (["--out", "runs/imported"], ("HF_FOLDER",)),
    "eval": ([], ()),
    "generate": (["--prompt", "def "], ()),
}
OLD = [(name, old) for name, (_, olds) in MODEL_COMMANDS.items() for old in olds]


def _refused(argv: list[str], capsys) -> list[str]:
    """The stderr lines of ``microscale ARGV``, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, argv
    return capsys.readouterr().err.strip().splitlines()


def test_every_command_that_reads_a_model_is_in_the_table():
    with_model = {
        name for name in COMMANDS if "--model" in command_parser(name)[1]._option_string_actions
    }
    assert with_model == set(MODEL_COMMANDS)


@pytest.mark.parametrize("flag", ["--model", "-m"])
@pytest.mark.parametrize("name", list(MODEL_COMMANDS))
def test_model_parses(name, flag):
    rest, _ = MODEL_COMMANDS[name]
    _, args = parse([name, flag, "runs/x", *rest])
    assert args.model == "runs/x"
    _, args = parse([name, *rest, f"{flag}=runs/y" if flag == "--model" else "-mruns/y"])
    assert args.model == "runs/y"


@pytest.mark.parametrize(("name", "old"), OLD)
def test_old_spelling_exits_2_with_one_line_naming_model(name, old, capsys):
    rest, _ = MODEL_COMMANDS[name]
    given = [old, "runs/x"] if old.startswith("-") else ["runs/x"]
    err = _refused([name, *given, *rest], capsys)
    assert len(err) == 1, err
    assert err[0].startswith(f"microscale {name}: error: {old}"), err
    assert "is now --model (-m): write --model runs/x" in err[0], err
    if old.startswith("-"):  # the option last, without its value: still named
        err = _refused([name, *rest, old], capsys)
        assert len(err) == 1 and f"{old} is now --model (-m) (see" in err[0], err


@pytest.mark.parametrize("name", list(MODEL_COMMANDS))
def test_help_lists_model_as_required(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    required = out.split("\nrequired arguments")[1]
    assert re.search(r"^  --model PATH, -m PATH\b", required, flags=re.M), out
    _, olds = MODEL_COMMANDS[name]
    assert not any(old in out for old in olds if old != "-c"), out  # hidden
    assert not re.search(r"(^|\s)-c(\s|,|$)", out), out


@pytest.mark.parametrize("name", list(MODEL_COMMANDS))
def test_without_model_the_error_names_it(name, capsys):
    rest, _ = MODEL_COMMANDS[name]
    try:
        rc = main([name, *rest])  # quantize, export, import: checked before any work
    except SystemExit as e:  # eval, generate: argparse's required option
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "required" in err[0] and "--model" in err[0], err


def test_import_with_model_and_a_stray_folder(capsys):
    err = _refused(["import", "--model", "hf/", "other/", "--out", "runs/x"], capsys)
    assert len(err) == 1 and "unrecognized arguments: other/" in err[0], err


def test_docs_spell_the_model_option_the_new_way():
    """README.md and docs/ (but the release notes, which name the old spellings on purpose)
    never write ``--checkpoint``, ``quantize -c`` / ``export -c`` or ``import FOLDER``."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    old = re.compile(r"--checkpoint\b|\b(quantize|export) -c\b|microscale import (?!--)[\w/.]")
    used = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in pages
        if p.name != "release-notes.md"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert used == [], used

"""``microscale verify``: check an output against the checksums microscale stored in it.

    microscale verify out/model.gguf         # a GGUF file (header + every tensor)
    microscale verify out/ct                 # an export folder (compressed-tensors / ModelOpt)
    microscale verify runs/x                 # a training run: every checkpoint step
    microscale verify out/q runs/x --json    # several paths; one JSON object per path

Prints one line per file (or checkpoint step) -- ``ok``, ``DAMAGED`` or ``UNVERIFIED`` (no
checksums stored: written before microscale stored them) -- then one indented line per
problem naming the tensor (at most 50 per file; ``--json`` lists all), and a total. Reads
with numpy and memory maps; no model is built (:mod:`microscale.verify` has the details).
A progress bar (stderr, terminals only) counts the bytes read.
Exit codes: 0 every file matches its checksums, 1 something is damaged, 2 bad arguments or
a path that is not a microscale output, 3 nothing damaged but some file stores no
checksums.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from microscale.cli.args import add_quiet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a .gguf / .safetensors file, or an export, quantize output, "
        "training run or checkpoint folder",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per PATH instead of text"
    )
    add_quiet(parser)


_LABEL = {"ok": "ok", "damaged": "DAMAGED", "unverified": "UNVERIFIED"}
_MAX_LINES = 50  # problem lines per file in text output


def run(args: argparse.Namespace) -> int:
    from microscale.verify import NotAnOutputError, output_kind, silence_orbax_noise, verify_path

    try:  # every path is recognised before any is read
        for p in args.paths:
            output_kind(Path(p))
    except (OSError, NotAnOutputError) as e:
        print(f"microscale verify: error: {e}", file=sys.stderr)
        return 2
    silence_orbax_noise()  # for the rest of this process (late callbacks included)
    show_bar = not args.quiet and sys.stderr.isatty()
    codes, counts = [], {"ok": 0, "damaged": 0, "unverified": 0}
    for p in args.paths:
        res = _verify_one(p, args.json, show_bar, counts, verify_path)
        codes.append(res.exit_code)
        if args.json:
            print(json.dumps(res.to_dict()))
        else:
            for note in res.notes:
                print(f"{'note':<10} {note}")
    if not args.json:
        n = sum(counts.values())
        print(
            f"verify: {n} file{'s' if n != 1 else ''} checked: {counts['ok']} ok, "
            f"{counts['damaged']} damaged, {counts['unverified']} without checksums"
        )
    return 1 if 1 in codes else 3 if 3 in codes else 0


def _verify_one(path: str, as_json: bool, show_bar: bool, counts: dict, verify_path):
    """Check one path, printing a line per file as it is done (through the progress bar
    when one is shown, so that the two do not garble each other)."""
    bar = None

    def say(text: str) -> None:
        (bar.write if bar is not None else print)(text)

    def start(total: int) -> None:
        nonlocal bar
        if show_bar:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"verify {path}",
                leave=False,
                file=sys.stderr,
            )

    def file_done(rep) -> None:
        counts[rep.status] += 1
        if as_json:
            return
        say(f"{_LABEL[rep.status]:<10} {rep.summary()}")
        for prob in rep.problems[:_MAX_LINES]:
            say(f"{'':<10}   {prob.message}")
        if len(rep.problems) > _MAX_LINES:
            say(
                f"{'':<10}   ... and {len(rep.problems) - _MAX_LINES} more problems "
                "(--json lists all)"
            )

    try:
        return verify_path(
            path,
            on_start=start,
            on_bytes=lambda n: bar.update(n) if bar is not None else None,
            on_file=file_done,
        )
    finally:
        if bar is not None:
            bar.close()

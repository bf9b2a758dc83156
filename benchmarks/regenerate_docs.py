"""Regenerate the reports under ``docs/`` whose numbers came from other code.

``docs/reports.toml`` lists every report a command wrote: its numerics fingerprint kind, the
command that regenerates it (writing into ``$OUT``, a fresh temporary folder) and the files
copied back. A report is *stale* when the fingerprint it records is not the current code's
(:func:`microscale.fingerprint.numerics_fingerprint`).

    python benchmarks/regenerate_docs.py                 # list every report and its state
    python benchmarks/regenerate_docs.py --stale         # rerun the stale ones not marked kept
    python benchmarks/regenerate_docs.py --only docs/compare/summary.json   # one, even if kept

Commands run one at a time, from the repository root, with this Python's ``microscale``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from microscale.fingerprint import numerics_fingerprint, recorded_fingerprint

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path = ROOT / "docs" / "reports.toml") -> list[dict]:
    """The ``[[report]]`` rows of ``docs/reports.toml``."""
    with path.open("rb") as f:
        return tomllib.load(f)["report"]


def state(row: dict) -> str:
    """``current``, ``stale``, ``no fingerprint`` or ``missing`` for one row's report."""
    path = ROOT / row["path"]
    if not path.is_file():
        return "missing"
    have = recorded_fingerprint(path)
    if have is None:
        return "no fingerprint"
    return "current" if have == numerics_fingerprint(row["kind"])["sha256"] else "stale"


def regenerate(row: dict) -> float:
    """Run ``row``'s command into a fresh folder and copy its files to ``dest``; seconds."""
    if "command" not in row:
        raise SystemExit(f"{row['path']}: no command in docs/reports.toml ({row.get('kept')})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = row["command"].replace("$OUT", shlex.quote(str(out)))
        if cmd.startswith("microscale "):
            cmd = f"{shlex.quote(sys.executable)} -m {cmd}"
        elif cmd.startswith("python "):
            cmd = f"{shlex.quote(sys.executable)} {cmd[len('python ') :]}"
        print(f"$ {cmd}", flush=True)
        subprocess.run(cmd, shell=True, check=True, cwd=ROOT, env=os.environ.copy())
        dest = ROOT / row["dest"]
        dest.mkdir(parents=True, exist_ok=True)
        for name in row["copy"]:
            shutil.copy2(out / name, dest / name)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stale", action="store_true", help="rerun stale reports not marked kept")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATH",
        help="rerun this report (a path from docs/reports.toml), kept or not",
    )
    a = ap.parse_args()
    rows = load()
    known = {r["path"] for r in rows}
    for p in a.only:
        if p not in known:
            raise SystemExit(
                f"--only {p!r} is not a report in docs/reports.toml; known: {sorted(known)}"
            )
    for row in rows:
        st = state(row)
        run = row["path"] in a.only or (a.stale and st != "current" and "kept" not in row)
        print(
            f"{row['path']}: {st}"
            + (" (kept)" if "kept" in row else "")
            + (" -> regenerating" if run else ""),
            flush=True,
        )
        if run:
            print(f"  done in {regenerate(row):.0f} s, now {state(row)}", flush=True)


if __name__ == "__main__":
    main()

"""Where the test suite's time goes, per module: the table of benchmarks/timings.md.

Record a run with the plugin of ``tests/suite_clock.py``, then add it up::

    SUITE_CLOCK_DIR=/tmp/clock pytest -n 2 -q -p suite_clock
    python benchmarks/suite_times.py /tmp/clock            # one run
    python benchmarks/suite_times.py /tmp/before /tmp/after  # two runs side by side

Per module: tests, CPU seconds (the worker's and its waited-for children's, so a CLI test's
subprocess counts), XLA compile seconds and trace + lowering seconds in the worker (not in
children), and the rest of the CPU. With two runs, the CPU of each and the ratio. ``--top``
rows (default 25), then the total of all modules, then per worker its tests, CPU seconds,
when its last test ended (from the first test's start: a worker that ends long before the
other left a core idle) and its compiles, of which how many the persistent cache served.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

FIELDS = ("tests", "cpu", "compile", "lower_trace")


def per_module(folder: Path) -> dict[str, dict[str, float]]:
    """``{module path: {tests, cpu, compile, lower_trace}}`` over every worker's file."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"{folder}: no suite_clock files (*.json); run pytest -p suite_clock")
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    for f in files:
        for nodeid, t in json.loads(f.read_text()).items():
            row = out[nodeid.split("::")[0]]
            row["tests"] += 1
            row["cpu"] += t["cpu"]
            row["compile"] += t["compile"]
            row["lower_trace"] += t["lower"] + t["trace"]
    return dict(out)


def _total(mods: dict[str, dict[str, float]]) -> dict[str, float]:
    return {k: sum(m[k] for m in mods.values()) for k in FIELDS}


def table(mods: dict[str, dict[str, float]], top: int) -> str:
    """One run: the costliest ``top`` modules by CPU, then the total."""
    lines = [
        "| module | tests | CPU s | compile s | trace + lower s | rest s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ranked = sorted(mods.items(), key=lambda kv: -kv[1]["cpu"])
    for name, m in [*ranked[:top], ("all modules", _total(mods))]:
        rest = m["cpu"] - m["compile"] - m["lower_trace"]
        lines.append(
            f"| `{name}` | {m['tests']:.0f} | {m['cpu']:.0f} | {m['compile']:.0f} "
            f"| {m['lower_trace']:.0f} | {rest:.0f} |"
        )
    return "\n".join(lines)


def compared(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], top: int):
    """Two runs: the ``top`` modules by CPU before, their CPU and compile after, ratios."""
    lines = [
        "| module | tests before | after | CPU s before | after | ratio | compile s before | after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    zero = dict.fromkeys(FIELDS, 0.0)
    ranked = sorted(before, key=lambda k: -before[k]["cpu"])[:top]
    rows = [(k, before[k], after.get(k, zero)) for k in ranked]
    rows.append(("all modules", _total(before), _total(after)))
    for name, b, a in rows:
        ratio = f"{a['cpu'] / b['cpu']:.2f}" if b["cpu"] else "-"
        lines.append(
            f"| `{name}` | {b['tests']:.0f} | {a['tests']:.0f} | {b['cpu']:.0f} | {a['cpu']:.0f} "
            f"| {ratio} | {b['compile']:.0f} | {a['compile']:.0f} |"
        )
    return "\n".join(lines)


def workers(folder: Path) -> str:
    """Per worker file: tests, CPU seconds, and the end of its last test in seconds from
    the run's first start (recorded by a suite_clock with the ``start`` field)."""
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))}
    starts = [t["start"] for r in runs.values() for t in r.values() if t.get("start")]
    if not starts:
        return "(no start times recorded)"
    t0 = min(starts)
    lines = []
    for name, r in runs.items():
        end = max(t["start"] + t["wall"] for t in r.values()) - t0
        cpu = sum(t["cpu"] for t in r.values())
        line = f"{name}: {len(r)} tests, {cpu:.0f} CPU s, last test ended at {end:.0f} s"
        if any("compiles" in t for t in r.values()):  # recorded since the cache counts
            compiles = sum(t.get("compiles", 0) for t in r.values())
            hits = sum(t.get("hits", 0) for t in r.values())
            line += f", {compiles:.0f} compiles ({hits:.0f} persistent-cache hits)"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="one or two SUITE_CLOCK_DIR folders")
    p.add_argument("--top", type=int, default=25, help="rows before the total (default 25)")
    a = p.parse_args()
    if len(a.runs) > 2:
        p.error(f"one or two runs, not {len(a.runs)}")
    mods = [per_module(r) for r in a.runs]
    print(table(mods[0], a.top) if len(mods) == 1 else compared(mods[0], mods[1], a.top))
    for run in a.runs:
        print(f"\n{run}:\n{workers(run)}")


if __name__ == "__main__":
    main()

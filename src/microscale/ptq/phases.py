"""Wall time, peak memory and a progress bar for each phase of a quantize run.

``with phases.phase("score", total=len(calib), unit="batch") as tick: ... tick()`` times
the phase into ``phases.timings["score_s"]`` and records the peak resident memory reached
*during* it in ``phases.peak_rss_gb["score"]`` (GiB). On Linux the kernel's high-water
mark ``VmHWM`` is reset at the phase start (``/proc/self/clear_refs``), so each phase
reports its own peak; where that is not possible the figure is the process's peak so far
(``getrusage``), still an upper bound, and ``peak_rss_scope`` says ``"process"``.

Progress: a tqdm bar on stderr when ``show`` and stderr is a terminal; otherwise, when
``show``, plain lines through ``log`` at about every tenth of the phase (and at its end).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["Phases", "peak_rss_gb"]

_GIB = float(1 << 30)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_gb() -> float:
    """Peak resident memory of this process in GiB: ``VmHWM`` (since the last reset) on
    Linux, else ``getrusage``'s lifetime maximum."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / _GIB
    except OSError:
        pass
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru / _GIB * (1 if sys.platform == "darwin" else 1024)


class Phases:
    """Per-phase ``timings`` (seconds) and ``peak_rss_gb`` (GiB), with progress output."""

    def __init__(
        self,
        log: Callable[[str], None] | None = None,
        *,
        show: bool = True,
        prefix: str = "quantize",
    ):
        # Message sink for plain progress lines (None: silent).
        self.log = log
        # Show progress at all (a bar on a terminal, else lines through log).
        self.show = bool(show) and log is not None
        self.prefix = prefix
        self.timings: dict[str, float] = {}
        self.peak_rss_gb: dict[str, float] = {}
        self.peak_rss_scope = "phase"

    @contextlib.contextmanager
    def phase(
        self, name: str, total: int | None = None, unit: str = "batch"
    ) -> Iterator[Callable[..., None]]:
        """Time ``name``; yields ``tick(n=1)`` that advances its progress by ``n``."""
        if not _reset_peak():
            self.peak_rss_scope = "process"
        t0 = time.perf_counter()
        done = 0
        bar = None
        if self.show and sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(
                total=total,
                desc=f"{self.prefix} {name}",
                unit=unit,
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )
        step = max(1, total // 10) if total else 10  # plain lines: ~10 per phase
        units = unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")

        def tick(n: int = 1) -> None:
            nonlocal done
            done += n
            if bar is not None:
                bar.update(n)
            elif self.log is not None and self.show and (done % step < n or done == total):
                of = f"/{total}" if total else ""
                self.log(
                    f"{self.prefix}: {name} {done}{of} {units} ({time.perf_counter() - t0:.0f}s)"
                )

        try:
            yield tick
        finally:
            if bar is not None:
                bar.close()
            self.timings[f"{name}_s"] = time.perf_counter() - t0
            self.peak_rss_gb[name] = round(peak_rss_gb(), 3)

"""One progress style for every long loop: a tqdm bar on a terminal, plain lines in a log.

A carriage-return bar written into a file is one unreadable line, and a rate measured from
the start counts XLA's compilation (tens of seconds before step 1) as if every step cost
it: "eta 3h22m" at step 1 of a 7-minute run. So :class:`Progress`

* draws a tqdm bar when its stream is a terminal, and otherwise prints a line at the
  first update, then at most one every ``every`` seconds, and a last one on
  :meth:`Progress.close` (unless the count is already shown);
* measures its rate from the first update on: the units before it (the first step, with
  its compilation) are not in the rate, and until a second update there is no ETA. On a
  terminal the bar's clock restarts at the first update for the same reason.

    with Progress(300, "train", unit="step") as bar:
        for step in range(300):
            ...
            bar.update(1, loss=f"{loss:.4f}")
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"1h02m03s"``, ``"2m03s"`` or ``"3s"``."""
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Progress of ``total`` units (``None``: unknown): a bar on a terminal, else lines.

    ``show=False`` prints nothing; ``initial`` units are done already (a resumed run);
    ``every``: seconds between plain lines. Values given to :meth:`update` or
    :meth:`set_postfix` stay shown until replaced."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        unit: str = "step",
        show: bool = True,
        stream: TextIO | None = None,
        initial: int = 0,
        every: float = 5.0,
        leave: bool = True,
    ):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.show = bool(show)
        self.stream = stream if stream is not None else sys.stderr
        self.n = int(initial)
        self.every = every
        self.post: dict[str, str] = {}
        self._t0 = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (time, n) at the first update
        self._last_line = -math.inf  # the first update prints at once
        self._shown_n: int | None = None  # the count of the last plain line
        self._bar = None
        if self.show and _is_tty(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=self.n,
                desc=desc,
                unit=unit,
                dynamic_ncols=True,
                leave=leave,
                file=self.stream,
            )

    # ------------------------------------------------------------------ updates
    def update(self, n: int = 1, *, force: bool = False, **post: Any) -> None:
        """``n`` more units done; ``post``: values to show beside the count; ``force``: a
        plain line now, however soon after the last."""
        self.set_postfix(**post)
        self.n += n
        now = time.perf_counter()
        if self._first is None and n > 0:
            self._first = (now, self.n)
            if self._bar is not None:  # the bar's clock and rate from here on
                self._bar.reset()
                self._bar.initial = self._bar.n = self._bar.last_print_n = self.n
                self._bar.refresh()
                return
        if self._bar is not None:
            self._bar.update(n) if n else self._bar.refresh()
        elif self.show and (force or now - self._last_line >= self.every):
            self._line(now)

    def set_postfix(self, **post: Any) -> None:
        """Values shown beside the count (``loss="2.31"``); ``None`` removes one."""
        for k, v in post.items():
            if v is None:
                self.post.pop(k, None)
            else:
                self.post[k] = str(v)
        if self._bar is not None and post:
            self._bar.set_postfix(self.post, refresh=False)

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc, refresh=False)

    def write(self, text: str) -> None:
        """A line for the user that does not break the bar (printed when quiet too)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the rate since the first update; ``None`` before a second
        update or when the total is unknown."""
        if self._first is None or self.total is None:
            return None
        t1, n1 = self._first
        if self.n <= n1:
            return None
        now = time.perf_counter() if now is None else now
        return (now - t1) / (self.n - n1) * max(self.total - self.n, 0)

    def close(self) -> None:
        """Close the bar, or print the last line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.show and self._first is not None and self._shown_n != self.n:
            self._line(time.perf_counter())
        self.show = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plain lines
    def _line(self, now: float) -> None:
        self._last_line, self._shown_n = now, self.n
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        parts = [f"{self.desc} {self.unit} {count}"]
        parts += [f"{k} {v}" for k, v in self.post.items()]
        eta = self.eta(now)
        left = "eta after the first " + self.unit if eta is None else f"eta {format_duration(eta)}"
        parts.append(f"elapsed {format_duration(now - self._t0)} {left}")
        print(" | ".join(parts), file=self.stream, flush=True)


def _is_tty(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()

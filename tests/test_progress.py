"""microscale.progress: a bar on a terminal, plain lines elsewhere, and an ETA that leaves
out the first unit (compilation). Time is a fake clock: no test here sleeps."""

from __future__ import annotations

import io

import pytest

from microscale import progress as pm
from microscale.progress import Progress, format_duration
from microscale.train.metrics import MetricsLogger


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(pm.time, "perf_counter", c)
    return c


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (0.4, "0s"),
        (59, "59s"),
        (60, "1m00s"),
        (3599, "59m59s"),
        (3600, "1h00m00s"),
        (12133, "3h22m13s"),
        (-5, "0s"),
    ],
)
def test_format_duration(seconds, shown):
    assert format_duration(seconds) == shown


def test_eta_leaves_out_the_first_unit(clock):
    out = io.StringIO()
    bar = Progress(100, "train", stream=out, every=0.0)
    assert bar.eta() is None
    clock.t += 200.0  # step 1: 200 s of compilation
    bar.update(1)
    assert bar.eta() is None  # one point: no rate yet
    assert "eta after the first step" in out.getvalue()
    for _ in range(9):  # then 0.5 s a step
        clock.t += 0.5
        bar.update(1)
    assert bar.eta() == pytest.approx(0.5 * 90)
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("train step 10/100 | ")
    assert "elapsed 3m24s eta 45s" in last  # elapsed counts the compile; the rate does not


def test_plain_lines_are_lines_and_throttled(clock):
    out = io.StringIO()
    bar = Progress(50, "compare", stream=out, every=5.0)
    for _ in range(50):
        clock.t += 1.0
        bar.update(1, loss="2.5000")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    # the first update (t = 1), then one per 5 s (t = 6, 11, ..., 46), then close's
    assert len(lines) == 1 + 9 + 1
    assert lines[-1].startswith("compare step 50/50 | loss 2.5000 | ")
    assert all(line.count(" | ") >= 2 for line in lines)


def test_force_prints_at_once_and_postfix_persists(clock):
    out = io.StringIO()
    bar = Progress(10, "train", stream=out, every=1e9)
    bar.update(1, loss="1.0")
    bar.update(1, val="0.9")
    assert len(out.getvalue().splitlines()) == 1
    bar.update(0, force=True)
    line = out.getvalue().splitlines()[-1]
    assert "step 2/10 | loss 1.0 | val 0.9 |" in line
    bar.set_postfix(val=None)
    bar.update(0, force=True)
    assert "val" not in out.getvalue().splitlines()[-1]


def test_quiet_prints_only_written_lines(clock):
    out = io.StringIO()
    bar = Progress(10, "train", stream=out, show=False, every=0.0)
    for _ in range(10):
        clock.t += 1.0
        bar.update(1)
    bar.write("aborted: a message")
    bar.close()
    assert out.getvalue() == "aborted: a message\n"


def test_close_does_not_repeat_the_last_line(clock):
    out = io.StringIO()
    bar = Progress(3, "train", stream=out, every=0.0)
    for _ in range(3):
        clock.t += 1.0
        bar.update(1)
    bar.close()
    bar.close()
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
        "train step 1/3",
        "train step 2/3",
        "train step 3/3",
    ]


def test_unknown_total_counts_without_eta(clock):
    out = io.StringIO()
    bar = Progress(None, "evaluate", unit="batch", stream=out, every=0.0)
    for _ in range(3):
        clock.t += 1.0
        bar.update(1)
    assert bar.eta() is None
    assert out.getvalue().splitlines()[-1].startswith("evaluate batch 3 | elapsed 3s eta")


def test_terminal_bar_rate_starts_after_the_first_unit(clock):
    term = Terminal()
    bar = Progress(100, "train", stream=term, initial=20)
    assert bar._bar is not None and bar._bar.n == 20
    bar.update(1)  # the resumed run's first step, with its compile
    tq = bar._bar
    assert (tq.n, tq.initial) == (21, 21)  # tqdm's rate counts units after this one
    bar.update(4)
    assert tq.n == 25
    bar.write("a message")
    bar.close()
    assert "a message" in term.getvalue() and "\r" in term.getvalue()


def test_metrics_logger_plain_lines(tmp_path, clock):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=300, tensorboard=False, stream=out)
    clock.t += 120.0  # compile
    log.progress(1, loss=5.0)
    for step in range(2, 12):
        clock.t += 5.0
        log.progress(step, loss=4.0, tokens_per_s=1234.5, lr=1e-3)
    log.message("resumed")
    log.close()
    lines = out.getvalue().splitlines()
    assert "eta after the first step" in lines[0]
    assert "train step 11/300 | loss 4.0000 | tok/s 1,234 | lr 1.00e-03" in out.getvalue()
    at_11 = [line for line in lines if "step 11/300" in line]
    assert at_11 and all("eta 24m05s" in line for line in at_11)  # 289 x 5 s, not x 170/11
    assert "resumed" in lines

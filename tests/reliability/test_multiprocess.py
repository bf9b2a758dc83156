"""Many hosts, on one machine: JAX's multi-process runtime with processes on 127.0.0.1,
CPU devices in each, gloo collectives between them.

Two processes of 4 devices each train one ``mesh.fsdp=8`` run together (the launch the
docs show: the same command on every host, its own ``mesh.process_id``) and must train
what one process on 8 devices trains: the same losses at every step and the same final
validation loss (to the rounding of a sum in another order, bound in the test), a
checkpoint that every process wrote and ``microscale verify`` passes.

A job that loses a process, or never assembles, ends every process within a bounded
wait, each with one line naming the cause (``microscale.cli.supervise``): the fault table
below, and a kill of one process mid-run after which the whole job resumes from the last
complete checkpoint and trains what an uninterrupted job trains, bit for bit.

The harness (:class:`Job`) gives each process its own session, a wall-clock limit (the
suite's hang guard), and kills every process group it started when the test ends,
whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microscale.cli import main
from microscale.outputs import TrainingRun

from .conftest import TRAIN_ARGS, child_env

pytestmark = pytest.mark.slow

# The run: TRAIN_ARGS with a batch the 8 fsdp shards divide, all of it on the fsdp axis.
ARGS = [
    *TRAIN_ARGS,
    "data.batch_size=8",
    "mesh.data=1",
    "mesh.fsdp=8",
    "mesh.tensor=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Processes of one job: started in their own sessions, logs under ``logs``, all
    killed by :meth:`kill_all` (the fixture calls it at the end of every test)."""

    def __init__(self, logs: Path, limit_s: float):
        self.logs = logs
        self.limit_s = limit_s
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, argv: list[str], *, devices: int, name: str) -> subprocess.Popen:
        env = child_env(
            JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
        )
        log = self.logs / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                [sys.executable, "-m", "microscale", *argv],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append((p, log))
        return p

    def wait_all(self) -> list[int]:
        """Every process's exit code; fails the test (with the logs) past the limit."""
        deadline = time.monotonic() + self.limit_s
        for p, log in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"{log.stem} still running after {self.limit_s} s:\n{self.tails()}")
        return [p.returncode for p, _ in self.procs]

    def tails(self, lines: int = 15) -> str:
        return "\n".join(
            f"--- {log.name} (exit {p.returncode})\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for p, log in self.procs
        )

    def kill_all(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # exited just now
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def job(tmp_path, hang_guard_s):
    j = Job(tmp_path, hang_guard_s)
    try:
        yield j
    finally:
        j.kill_all()


def _last_line(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _launch(job, common, out, port, ids, *, n=2, extra=(), name="process"):
    """Start processes ``ids`` of an ``n``-process job (8 CPU devices in all)."""
    for i in ids:
        argv = [*common, f"out={out}", f"mesh.coordinator_address=127.0.0.1:{port}"]
        argv += [f"mesh.num_processes={n}", f"mesh.process_id={i}", *extra]
        job.start(argv, devices=8 // n, name=f"{name}{i}")


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / TrainingRun.METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}


def test_two_processes_train_what_one_process_on_eight_devices_trains(
    job, tmp_path, words_corpus, cache_env
):
    common = ["train", "--config", "tiny", "--quiet", *ARGS, f"data.corpus={words_corpus}"]
    ref, multi = tmp_path / "one-process", tmp_path / "two-processes"
    job.start([*common, f"out={ref}"], devices=8, name="reference")
    assert job.wait_all() == [0], job.tails()

    port = _free_port()
    for i in range(2):
        job.start(
            [
                *common,
                f"out={multi}",
                f"mesh.coordinator_address=127.0.0.1:{port}",
                "mesh.num_processes=2",
                f"mesh.process_id={i}",
            ],
            devices=4,
            name=f"process{i}",
        )
    assert job.wait_all() == [0, 0, 0], job.tails()

    want, got = _losses(ref), _losses(multi)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    # The same program, partitioned the same way over 8 devices; only the transport of
    # its collectives differs: gloo between processes sums the 8 shards' partial losses
    # in another order than XLA does inside one. A float32 sum of 8 terms of one sign is
    # within 7 u (u = 2^-24) relative of the exact sum in any order, so two orders differ
    # by at most 14 u (seen: 1 ulp, about 1.5 u, on 2 of the 4 steps, equal on the
    # others). Later losses and the final validation loss are computed from the updated
    # parameters, so they check the updates too, to this bound.
    rel = 2 * 7 * 2.0**-24
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel, abs=0), (step, job.tails())
    summary = {r: json.loads((r / TrainingRun.SUMMARY).read_text()) for r in (ref, multi)}
    assert summary[multi]["final_val_loss"] == pytest.approx(
        summary[ref]["final_val_loss"], rel=rel, abs=0
    )
    steps = sorted(p.name for p in (multi / TrainingRun.CHECKPOINTS).iterdir() if p.name.isdigit())
    assert steps == ["2", "4"]
    assert main(["verify", str(multi)]) == 0


# Faults end the job, never hang it: short timeouts, so that each row ends in seconds.
FAST = ["mesh.init_timeout_s=5", "mesh.heartbeat_timeout_s=5"]
# Every row ends every process well within this (the timeouts above, plus start-up).
BOUND_S = 60.0


def _ends_within(job, bound_s: float) -> list[int]:
    t0 = time.monotonic()
    codes = job.wait_all()
    assert time.monotonic() - t0 < bound_s, job.tails()
    return codes


# (the row, which processes start and with which ids, each one's exit status and line)
FAULTS = [
    ("a process_id outside the job", [2], [2], [r"mesh.process_id=2: expected 0 \.\. 1"]),
    (
        "two processes with one id",
        [0, 0],
        [3, 3],
        # The newer registration wins the id and is refused; the other waits for the id
        # that never came. Which is which depends on timing.
        [
            r"another process joined 127\.0\.0\.1:\d+ with this process's id "
            r"\(mesh.process_id=0\)|did not assemble within mesh.init_timeout_s=5 s"
        ]
        * 2,
    ),
    (
        "an unreachable coordinator",
        [1],
        [3],
        [r"did not assemble within mesh.init_timeout_s=5 s: process 1 could not register"],
    ),
]


@pytest.mark.parametrize("row,ids,codes,lines", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_job_that_cannot_assemble_ends_with_one_line(
    job, tmp_path, words_corpus, cache_env, row, ids, codes, lines
):
    common = ["train", "--config", "tiny", "--quiet", *ARGS, f"data.corpus={words_corpus}"]
    _launch(job, common, tmp_path / "run", _free_port(), ids, extra=FAST)
    assert _ends_within(job, BOUND_S) == codes, job.tails()
    for (_, log), want in zip(job.procs, lines, strict=True):
        last = _last_line(log)
        assert last.startswith("microscale train: error: "), job.tails()
        assert re.search(want, last), job.tails()
    assert "Check failure" not in job.tails(lines=1000)  # no native crash report
    assert not (tmp_path / "run").exists()  # nothing was started, nothing is left


def test_a_folder_one_process_cannot_write_stops_every_process(
    job, tmp_path, words_corpus, cache_env
):
    common = ["train", "--config", "tiny", "--quiet", *ARGS, f"data.corpus={words_corpus}"]
    port, blocked = _free_port(), tmp_path / "a-file"
    blocked.write_text("a file where process 1's mount of out= would be")
    _launch(job, common, tmp_path / "run", port, [0], extra=FAST)
    _launch(job, common, blocked / "run", port, [1], extra=FAST)
    assert _ends_within(job, BOUND_S) == [2, 2], job.tails()
    (_, log0), (_, log1) = job.procs
    assert re.search(r"process 1 of 2 cannot write the run folder out=.*/run", _last_line(log0))
    assert re.search(r"process 1 of 2 cannot write the run folder: .*a-file", _last_line(log1))
    assert not (tmp_path / "run").exists()  # process 0's probe folder is gone again


def _steps(run: Path) -> list[int]:
    return sorted(
        int(p.name) for p in (run / TrainingRun.CHECKPOINTS).iterdir() if p.name.isdigit()
    )


def test_a_killed_process_ends_the_job_and_the_job_resumes_bit_for_bit(
    job, tmp_path, words_corpus, cache_env
):
    common = ["train", "--config", "tiny", "--quiet", *ARGS, f"data.corpus={words_corpus}"]
    common += ["steps=20", *FAST]
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    _launch(job, common, ref, _free_port(), [0, 1], name="reference")
    assert job.wait_all() == [0, 0], job.tails()

    job.procs.clear()
    port = _free_port()
    _launch(job, common, run, port, [0, 1], name="killed")
    victim = job.procs[1][0]
    deadline = time.monotonic() + job.limit_s
    while not (run / TrainingRun.CHECKPOINTS / "2").is_dir():  # mid-run: after a save
        assert time.monotonic() < deadline and victim.poll() is None, job.tails()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the host is gone: supervisor and trainer
    t0 = time.monotonic()
    assert job.procs[0][0].wait(timeout=BOUND_S) == 3, job.tails()
    assert time.monotonic() - t0 < BOUND_S
    line = _last_line(job.procs[0][1])
    assert re.search(
        r"process 1 of the job stopped answering|a peer process of the job|no report of its own",
        line,
    ), job.tails(40)
    assert "Check failure" not in job.tails(lines=1000)
    resume_from = int(re.search(r"last complete checkpoint is step (\d+)", line)[1])
    assert resume_from == max(_steps(run)) < 20, line

    job.procs.clear()
    _launch(job, [*common, "resume=true"], run, _free_port(), [0, 1], name="resumed")
    assert job.wait_all() == [0, 0], job.tails()
    # The same program on the same 8 devices and gloo's reduction in the same order: the
    # resumed job equals the uninterrupted one exactly, from the step it resumed after.
    want, got = _losses(ref), _losses(run)
    assert {k: got[k] for k in want if k > resume_from} == {
        k: v for k, v in want.items() if k > resume_from
    }
    summary = {r: json.loads((r / TrainingRun.SUMMARY).read_text()) for r in (ref, run)}
    assert summary[run]["final_val_loss"] == summary[ref]["final_val_loss"]
    leftovers = [p.name for p in (run / TrainingRun.CHECKPOINTS).iterdir() if "tmp" in p.name]
    assert leftovers == []  # the save the kill interrupted was discarded
    assert main(["verify", str(run)]) == 0


def test_four_processes_that_lose_their_coordinator_all_end(job, tmp_path, words_corpus, cache_env):
    """Four processes of 2 devices each; process 0, which also hosts JAX's coordination
    service, is killed mid-run: each of the other three ends with the line."""
    common = ["train", "--config", "tiny", "--quiet", *ARGS, f"data.corpus={words_corpus}"]
    run = tmp_path / "run"
    _launch(job, [*common, "steps=20", *FAST], run, _free_port(), range(4), n=4)
    victim = job.procs[0][0]
    deadline = time.monotonic() + job.limit_s
    while not (run / TrainingRun.CHECKPOINTS / "2").is_dir():
        assert time.monotonic() < deadline and victim.poll() is None, job.tails()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    for p, log in job.procs[1:]:
        assert p.wait(timeout=max(BOUND_S - (time.monotonic() - t0), 0.1)) == 3, job.tails()
        line = _last_line(log)
        assert re.search(
            r"coordinator at 127\.0\.0\.1:\d+, stopped answering|process 0 of the job "
            r"stopped answering|a peer process of the job|no report of its own",
            line,
        ), job.tails()
        assert re.search(r"The last complete checkpoint is step \d+ in ", line), line
    assert "Check failure" not in job.tails(lines=1000)

"""One line, not a native crash, when a multi-process job fails.

JAX's distributed runtime ends a process whose job cannot go on with a native fatal error
(glog's ``LOG(FATAL)``: a line starting ``F``, a C++ stack trace, SIGABRT), which Python
cannot catch. ``microscale train`` therefore runs a multi-process launch (a coordinator
given, or a SLURM/MPI/TPU environment) in a child process of its own, relays the child's
output, and when the runtime ends it, prints one line that names the cause and the last
complete checkpoint, and exits 3 (:data:`EXIT_JOB_FAILED`)::

    the runtime's report                              the cause the line names
    ------------------------------------------------  ----------------------------------
    DEADLINE_EXCEEDED while registering               the job did not assemble within
                                                      mesh.init_timeout_s
    ALREADY_EXISTS                                    two processes with one process_id
    tasks unhealthy (stopped sending heartbeats): 1   process 1 lost (no heartbeat for
                                                      mesh.heartbeat_timeout_s)
    a collective's "Connection reset by peer"         a peer dropped its connection
    Failed to send RPC to coordination service        process 0, the coordinator, lost
    anything else                                     the status itself

Checkpoints are saved to a temporary folder and renamed to their step when every process
has written its part, so the newest step folder is complete; a resumed run removes the
temporary leftovers of a save the fault interrupted.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from microscale.outputs import CheckpointStep, TrainingRun

__all__ = ["CHILD", "EXIT_JOB_FAILED", "explain", "needs_supervisor", "supervise"]

# Set in the child's environment: the child trains instead of supervising again.
CHILD = "MICROSCALE_SUPERVISED_CHILD"
# The exit status of a process whose job failed (a peer lost, the job never assembled).
EXIT_JOB_FAILED = 3

# glog lines of the runtime's fatal report: its coordination warnings and errors, then
# the fatal line.
_GLOG = re.compile(r"^([EFW])\d{4} [\d:.]+ +\d+ (\S+)\] ")
# A collective's transport (gloo on CPUs) that lost its peer mid-step.
_PEER_GONE = re.compile(
    r"Connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?|Read error \[[^\]]*\]:\d+"
)
_DEAD = re.compile(r"stopped sending heartbeats\):\s*([\d,\s]+)")


def needs_supervisor(mesh_cfg) -> bool:
    """Whether this ``train`` launch joins a multi-process job (and is not the child)."""
    if os.environ.get(CHILD) or mesh_cfg.distributed == "off":
        return False
    from microscale.train.mesh import multi_host_env

    explicit = mesh_cfg.distributed == "on" or mesh_cfg.coordinator_address is not None
    return explicit or multi_host_env()


def explain(report: str, mesh_cfg, *, how: str = "SIGABRT") -> tuple[str, bool]:
    """The cause the runtime's fatal ``report`` names, in the job's own settings, and
    whether the job had assembled (then where to resume from is worth saying). ``how``:
    the way the training process ended (a signal's name)."""
    me = "this process" if mesh_cfg.process_id is None else f"process {mesh_cfg.process_id}"
    where = mesh_cfg.coordinator_address or "the coordinator JAX discovered"
    n = mesh_cfg.num_processes
    if "ALREADY_EXISTS" in report:
        return (
            f"another process joined {where} with this process's id "
            f"(mesh.process_id={mesh_cfg.process_id}): every process of the job needs its "
            f"own, 0 .. {n - 1 if n else 'num_processes - 1'}"
        ), False
    if "DEADLINE_EXCEEDED" in report and "RegisterTask" in report:
        return (
            f"the job did not assemble within mesh.init_timeout_s={mesh_cfg.init_timeout_s} s:"
            f" {me} could not register with {where}, or not all "
            f"{n or 'of the'} processes joined (is process 0 running, is its address "
            "reachable from here, did every process start with its own mesh.process_id?)"
        ), False
    dead = _DEAD.search(report)
    if dead:
        ids = ", ".join(x for x in re.split(r"[,\s]+", dead.group(1)) if x)
        return (
            f"process {ids} of the job stopped answering (no heartbeat for "
            f"mesh.heartbeat_timeout_s={mesh_cfg.heartbeat_timeout_s} s: killed, crashed or "
            f"cut off), so {me} stopped too"
        ), True
    gone = _PEER_GONE.search(report) if "Gloo" in report else None
    if gone:
        return (
            f"a peer process of the job dropped its connection ({gone[0]}:"
            f" killed, crashed or cut off), so {me} stopped too"
        ), True
    if "Failed to send RPC to coordination service" in report:
        return (
            f"process 0, the job's coordinator at {where}, stopped answering (killed, "
            f"crashed or cut off), so {me} stopped too"
        ), True
    status = next(
        (
            ln.split("absl::Status:", 1)[1].strip()
            for ln in report.splitlines()
            if "absl::Status:" in ln
        ),
        None,
    )
    if status is not None:
        return f"JAX's distributed runtime stopped {me}: {status}", True
    return (
        f"the training process of {me} ended by {how} with no report of its own (in a "
        "multi-process job, the runtime's way of stopping a process whose peer was lost; "
        "the other processes' lines may name it)"
    ), True


def last_checkpoint(out: str | None) -> str:
    """Where the job can resume from, as the end of the error line."""
    if out is None:
        return ""
    folder = Path(out).expanduser() / TrainingRun.CHECKPOINTS
    with contextlib.suppress(OSError):
        steps = CheckpointStep.steps(folder)
        if steps:
            return (
                f". The last complete checkpoint is step {steps[-1].name} in {folder}: run the "
                "same command with resume=true on every process to continue from it"
            )
    return ". No checkpoint was complete: run the same command on every process to start again"


def _die_with_parent() -> None:  # in the child, before exec: a killed parent takes it along
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def supervise(argv: list[str], cfg, *, prog: str = "microscale train") -> int:
    """Run ``microscale ARGV`` as a child and relay it; the child's exit status, or
    :data:`EXIT_JOB_FAILED` with one line on stderr when the runtime ended it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "microscale.cli", *argv],
        env={**os.environ, CHILD: "1"},
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
    )
    forward = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in forward:  # a scheduler's stop reaches the trainer, which saves and ends
        signal.signal(s, lambda sig, _frame: proc.send_signal(sig))
    report: list[str] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            m = _GLOG.match(line)
            held = m and (m.group(1) == "F" or "coordination" in m.group(2))
            if report or held or line.startswith(f"{prog}: error: "):
                report.append(line)  # the fatal report (and the child's error line): kept back
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        rc = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too (one process group)
        proc.wait()
        raise
    finally:
        for s, h in forward.items():
            signal.signal(s, h)
    crashed = rc < 0 or any(_GLOG.match(ln) and ln.startswith("F") for ln in report)
    if not crashed:
        sys.stderr.writelines(report)  # glog lines of a run that ended by itself
        return rc
    if os.environ.get("MICROSCALE_TRACEBACK"):
        sys.stderr.writelines(report)  # the runtime's own report, for whoever debugs it
    how = signal.Signals(-rc).name if rc < 0 else f"exit status {rc}"
    cause, started = explain("".join(report), cfg.mesh, how=how)
    where = last_checkpoint(cfg.out) if started else ""
    print(f"{prog}: error: {cause}{where}", file=sys.stderr)
    return EXIT_JOB_FAILED

"""``microscale train``'s supervisor of multi-process runs (``cli/supervise.py``): the
runtime's fatal reports, as JAX 0.10 prints them (recorded from real two-process runs on
127.0.0.1), each turned into the one line that names its cause. The faults themselves,
with real processes, are in ``tests/reliability/test_multiprocess.py``."""

from __future__ import annotations

import pytest

from microscale.cli.supervise import CHILD, explain, last_checkpoint, needs_supervisor
from microscale.train import MeshConfig
from microscale.train.mesh import _MULTI_HOST_ENV, _WORLD_SIZE_ENV

MESH = MeshConfig(
    coordinator_address="127.0.0.1:24001", num_processes=2, process_id=0, heartbeat_timeout_s=5
)
F = "F1206 12:47:41.949437   29285 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: "  # noqa: E501
E = "E1206 12:53:30.920027   30701 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).\n"  # noqa: E501

# (the report, the cause's words, whether the job had started: then the line says where
# to resume)
REPORTS = [
    (
        F
        + "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n",
        "did not assemble within mesh.init_timeout_s=300 s: process 0 could not register "
        "with 127.0.0.1:24001",
        False,
    ),
    (
        F + "ALREADY_EXISTS: Aborted connect attempt as there is a request from a newer "
        "incarnation.\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n",
        "another process joined 127.0.0.1:24001 with this process's id (mesh.process_id=0)",
        False,
    ),
    (
        E + F + "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):"
        "\n1\nThe tasks have crashed. Check the task logs for an earlier error.\n",
        "process 1 of the job stopped answering (no heartbeat for mesh.heartbeat_timeout_s=5 s",
        True,
    ),
    (
        E + F + "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):"
        "\n1, 3\nThe tasks have crashed.\n",
        "process 1, 3 of the job stopped answering",
        True,
    ),
    (
        "microscale train: error: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/"
        "transport/tcp/pair.cc:538] Read error [127.0.0.1]:18560: Connection reset by peer "
        "(JaxRuntimeError; MICROSCALE_TRACEBACK=1 shows where)\n",
        "a peer process of the job dropped its connection (Read error [127.0.0.1]:18560",
        True,
    ),
    (
        "microscale train: error: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/"
        "transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:15282\n",
        "dropped its connection (Connection closed by peer [127.0.0.1]:15282: killed",
        True,
    ),
    (
        E + F + "UNAVAILABLE: Failed to send RPC to coordination service. Either the leader "
        "task was preempted/died/restarted unexpectedly or this task is experiencing network "
        "issues.\n",
        "process 0, the job's coordinator at 127.0.0.1:24001, stopped answering",
        True,
    ),
    (  # a silent abort: nothing to read but how the process ended
        "",
        "the training process of process 0 ended by SIGABRT with no report of its own",
        True,
    ),
    (
        F + "INTERNAL: something new\n",
        "JAX's distributed runtime stopped process 0: INTERNAL: something new",
        True,
    ),
]


@pytest.mark.parametrize("report,cause,started", REPORTS)
def test_each_fatal_report_is_one_line_naming_its_cause(report, cause, started):
    line, did_start = explain(report, MESH)
    assert cause in line
    assert did_start is started
    assert "\n" not in line and "Check failure" not in line


def test_where_to_resume_is_the_newest_finished_step(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert "No checkpoint was complete" in last_checkpoint(str(tmp_path))
    for name in ("2", "4", "6.orbax-checkpoint-tmp-1733", "damaged"):
        (ckpts / name).mkdir(parents=True)
    (ckpts / "8").write_text("a file, not a step")
    line = last_checkpoint(str(tmp_path))
    assert f"step 4 in {ckpts}" in line and "resume=true on every process" in line
    assert last_checkpoint(None) == ""


def test_only_multi_process_launches_are_supervised(monkeypatch):
    for var in (*_MULTI_HOST_ENV, *_WORLD_SIZE_ENV, CHILD):
        monkeypatch.delenv(var, raising=False)
    assert not needs_supervisor(MeshConfig())
    assert not needs_supervisor(
        MeshConfig(distributed="off", coordinator_address="h:1", num_processes=2, process_id=0)
    )
    assert needs_supervisor(MESH)
    assert needs_supervisor(MeshConfig(distributed="on"))
    monkeypatch.setenv("SLURM_NTASKS", "4")  # srun's launch: JAX discovers the rest
    assert needs_supervisor(MeshConfig())
    monkeypatch.setenv(CHILD, "1")  # the supervised child trains itself
    assert not needs_supervisor(MESH)

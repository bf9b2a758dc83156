"""One writer per output folder: while a live process holds a folder, every writing
command into it fails at once, naming the folder and the holder's PID."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from microscale.cli import main

from .conftest import TRAIN_ARGS, child_env

ENV = child_env()

_HOLDER = textwrap.dedent("""
    import sys, time
    from microscale.files import lock_folder
    with lock_folder(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(600)
""")


@pytest.fixture
def held(tmp_path):
    """A folder locked by another live process: ``(path, pid)``."""
    out = tmp_path / "held"
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "locked"
        yield out, p.pid
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "compare", "quantize", "export"])
def test_second_writer_fails_at_once(command, held, tiny_run, words_corpus, capsys):
    out, pid = held
    argv = {
        "train": [
            "train",
            "--config",
            "tiny",
            *TRAIN_ARGS,
            f"data.corpus={words_corpus}",
            f"out={out}",
        ],
        "compare": [
            "compare",
            "--runs",
            "bf16",
            *TRAIN_ARGS,
            f"data.corpus={words_corpus}",
            f"out={out}",
        ],
        "quantize": ["quantize", "-m", str(tiny_run), "--out", str(out), "-q"],
        "export": ["export", "-m", str(tiny_run), "--out", str(out)],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(out) in err and f"PID {pid}" in err, err
    assert not out.exists() or not any(out.iterdir())  # nothing was written


@pytest.mark.slow
def test_cli_process_against_held_folder(held, words_corpus, hang_guard_s):
    """A real `microscale train` process (not in-process) refuses the held folder."""
    out, pid = held
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "microscale",
            "train",
            "--config",
            "tiny",
            *TRAIN_ARGS,
            f"data.corpus={words_corpus}",
            f"out={out}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=hang_guard_s,
    )
    assert r.returncode == 2
    assert f"PID {pid}" in r.stderr and str(out) in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_two_trainings_one_folder(tmp_path, words_corpus, cache_env, hang_guard_s):
    """Two `microscale train` into one out= with seeds 0 and 1, started together: exactly
    one runs; the folder's config, checkpoint and summary all come from that one."""
    out = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "microscale",
                "train",
                "--config",
                "tiny",
                *TRAIN_ARGS,
                f"data.corpus={words_corpus}",
                f"seed={seed}",
                f"out={out}",
                "--quiet",
            ],
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 1)
    ]
    results = [(p.wait(timeout=hang_guard_s), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    winner = next(seed for seed, (rc, _) in zip((0, 1), results, strict=True) if rc == 0)
    loser_err = next(err for rc, err in results if rc == 2)
    # the lock (or, had the winner already finished, its checkpoints) stops the loser
    assert str(out) in loser_err and "Traceback" not in loser_err
    assert "PID" in loser_err or "already holds checkpoints" in loser_err
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == winner
    assert json.loads((out / "summary.json").read_text())["config"]["seed"] == winner

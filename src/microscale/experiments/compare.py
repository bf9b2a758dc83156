"""``microscale compare``: the same model, data order, initialisation and token budget,
trained once per run (:data:`~microscale.experiments.runs.RUNS`: the baselines and the
NVFP4 ablations) and seed, each a call of :func:`microscale.train.train` into
``OUT/runs/<name>`` (a finished run is found by the trainer's resume logic, not recomputed),
then the report (:mod:`.report`: ``report.md``, ``convergence.png``, ``gap.png``,
``summary.json``) and ``timings.json`` (wall and CPU seconds per run). What makes the
comparison fair and how the paired gaps over seeds are read: docs/verifying.md.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from microscale.config import dump_yaml, to_dict
from microscale.experiments.compare_config import CompareConfig
from microscale.experiments.report import write_report
from microscale.experiments.seeds import seed_batch_size, train_seeds, why_not_batched
from microscale.files import atomic_write_text, check_output_dir, lock_folder
from microscale.outputs import TrainingRun
from microscale.progress import Progress
from microscale.train import TrainConfig, TrainingAborted, train


def find_previous(base_dir: str | os.PathLike, settings_hash: str) -> Path | None:
    """The newest ``compare-*`` folder under ``base_dir`` made with the same settings."""
    base = Path(base_dir)
    if not base.is_dir():
        return None
    for d in sorted(base.glob("compare-*"), reverse=True):
        try:
            if json.loads((d / "compare.json").read_text())["settings_hash"] == settings_hash:
                return d
        except (OSError, ValueError, KeyError):
            continue
    return None


def _run_subprocess(cfg: TrainConfig, env_extra: dict[str, str]) -> subprocess.Popen:
    assert cfg.out is not None  # every run of a comparison has its folder
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    yaml_path = run_dir / "compare_config.yaml"
    dump_yaml(cfg, yaml_path)
    cmd = [sys.executable, "-m", "microscale.cli", "train", "--config", str(yaml_path), "--quiet"]
    log = open(run_dir / "train.log", "ab")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_extra}
    )


def _device_groups(n: int) -> list[dict[str, str]]:
    """Environment per process: GPUs split into n groups; on CPU nothing to split."""
    import jax

    devs = jax.devices()
    if devs[0].platform != "gpu" or len(devs) < n:
        return [{} for _ in range(n)]
    ids = [d.id for d in devs]
    per = len(ids) // n
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids[i * per : (i + 1) * per]))} for i in range(n)
    ]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _completed(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / TrainingRun.SUMMARY).read_text()).get("status") == "completed"
    except (OSError, ValueError):
        return False


def _groups(
    cfg: CompareConfig, jobs: list[tuple[str, int, TrainConfig]]
) -> list[list[tuple[str, int, TrainConfig]]]:
    """The jobs in training order, grouped into seed batches: for each chunk of
    ``seed_batch`` seeds, each run's seeds of that chunk as one batch (seed-major, so each
    chunk's paired runs finish together). A run already started one by one (its folder
    holds checkpoints) or one that cannot batch (:func:`.seeds.why_not_batched`) trains
    alone."""
    solo = [j for j in jobs if cfg.seed_batch == 1 or _started(Path(j[2].out))]  # type: ignore[arg-type]  # jobs set out
    rest = [j for j in jobs if j not in solo]
    by_run: dict[str, list] = {}
    for j in rest:
        by_run.setdefault(j[0], []).append(j)
    chunked: dict[str, list[list]] = {}
    for name, js in by_run.items():
        if why_not_batched([j[2] for j in js]) is not None or len(js) == 1:
            solo += js
            continue
        k = seed_batch_size(js[0][2], len(js), requested=cfg.seed_batch)
        chunked[name] = [js[i : i + k] for i in range(0, len(js), k)]
    groups = [[j] for j in solo]
    for i in range(max((len(v) for v in chunked.values()), default=0)):
        groups += [v[i] for v in chunked.values() if i < len(v)]
    return groups


def _started(run_dir: Path) -> bool:
    ckpts = run_dir / TrainingRun.CHECKPOINTS
    return ckpts.is_dir() and any(ckpts.iterdir())


def _run_serial(
    cfg: CompareConfig, jobs: list[tuple[str, int, TrainConfig]], progress: bool
) -> None:
    """Train the jobs in this process, replicates as seed batches (:func:`_groups`), under
    one progress display (steps of all runs; :class:`~microscale.progress.Progress`), and record each trained run's wall
    and CPU seconds in ``OUT/timings.json`` (a batch's, split evenly over its runs)."""
    assert cfg.out is not None  # set by CompareConfig's resolution
    timings_path = Path(cfg.out) / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    todo = [j for j in jobs if not _completed(Path(j[2].out))]  # type: ignore[arg-type]  # jobs set out
    groups = _groups(cfg, todo)
    bar = Progress(sum(j[2].steps for j in todo), "compare", unit="step", show=progress)
    for i, group in enumerate(groups):
        name, seeds = group[0][0], [j[1] for j in group]
        shown = f"s{seeds[0]}" if len(seeds) == 1 else f"s{seeds[0]}-{seeds[-1]} ({len(seeds)})"
        bar.set_description(f"compare {i + 1}/{len(groups)} {name} {shown}")
        done = [0] * len(group)

        def advance(k, rec, done=done):
            if rec.get("kind") == "train" and rec.get("step", 0) > done[k]:
                bar.update(rec["step"] - done[k])
                done[k] = rec["step"]

        w0, c0 = time.perf_counter(), _cpu_seconds()
        if len(group) == 1:
            try:
                train(group[0][2], progress=False, callbacks=[lambda r: advance(0, r)])
            except TrainingAborted as e:  # e.g. all-FP4 diverging: report it, go on
                bar.write(f"[compare] {name} (seed {seeds[0]}) aborted: {e}")
        else:
            for s in train_seeds([j[2] for j in group], progress=False, callbacks=[advance]):
                if s["status"] == "aborted":
                    bar.write(f"[compare] {name} ({s['out']}) aborted: {s['error']}")
        bar.update(sum(j[2].steps for j in group) - sum(done))
        wall, cpu = time.perf_counter() - w0, _cpu_seconds() - c0
        for _, seed, rcfg in group:
            timings[f"{name}-seed{seed}"] = {
                "wall_s": wall / len(group),
                "cpu_s": cpu / len(group),
                "steps": rcfg.steps,
                "seed_batch": len(group),
            }
        atomic_write_text(timings_path, json.dumps(timings, indent=2))
    bar.close()


def _run_parallel(
    cfg: CompareConfig, jobs: list[tuple[str, int, TrainConfig]], progress: bool
) -> None:
    """Train the jobs in up to ``cfg.parallel`` subprocesses (one device group each), with
    a progress bar over runs, recording each run's wall and CPU seconds (``os.wait4``)."""
    assert cfg.out is not None  # set by CompareConfig's resolution
    timings_path = Path(cfg.out) / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    pending = [j for j in jobs if not _completed(Path(j[2].out))]  # type: ignore[arg-type]  # jobs set out
    free = _device_groups(cfg.parallel)
    bar = Progress(len(pending), "compare", unit="run", show=progress)
    running: list[tuple[str, int, TrainConfig, subprocess.Popen, dict, float]] = []
    failed = []
    while pending or running:
        while pending and free:
            name, seed, rcfg = pending.pop(0)
            env = free.pop(0)
            running.append((name, seed, rcfg, _run_subprocess(rcfg, env), env, time.perf_counter()))
            bar.set_postfix(running=", ".join(f"{r[0]} s{r[1]}" for r in running))
        time.sleep(1.0)
        for item in list(running):
            name, seed, rcfg, proc, env, w0 = item
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            running.remove(item)
            free.append(env)
            bar.update(1)
            if code not in (0, 1):  # 1: aborted (non-finite), summary written
                failed.append(f"{name} (seed {seed})")
            timings[f"{name}-seed{seed}"] = {
                "wall_s": time.perf_counter() - w0,
                "cpu_s": ru.ru_utime + ru.ru_stime,
                "steps": rcfg.steps,
                "parallel": cfg.parallel,
            }
            atomic_write_text(timings_path, json.dumps(timings, indent=2))
    bar.close()
    if failed:
        raise RuntimeError(f"run(s) {failed} failed; see their train.log under {cfg.out}/runs")


def run_compare(cfg: CompareConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train every run (skipping finished ones), then write the report. Returns summary.
    One writer per compare folder: a second compare into ``cfg.out`` while this one runs
    fails at once (:func:`microscale.files.lock_folder`)."""
    out = check_output_dir(cfg.out, what="out=")
    with lock_folder(out):
        out.mkdir(parents=True, exist_ok=True)
        return _run_compare(cfg, out, progress=progress)


def _run_compare(cfg: CompareConfig, out: Path, *, progress: bool) -> dict[str, Any]:
    atomic_write_text(
        out / "compare.json",
        json.dumps({"settings_hash": cfg.settings_hash(), "config": to_dict(cfg)}, indent=2),
    )
    dump_yaml(cfg.base, out / "base_config.yaml")
    # seed-major: each seed's paired runs finish together
    jobs = [(name, seed, cfg.run_config(name, seed)) for seed in cfg.seeds for name in cfg.runs]
    t0 = time.perf_counter()
    if cfg.parallel == 1:
        _run_serial(cfg, jobs, progress)
    else:
        _run_parallel(cfg, jobs, progress)
    if progress:
        print(
            f"[compare] all runs done in {time.perf_counter() - t0:.0f} s; writing report",
            flush=True,
        )
    return write_report(cfg)

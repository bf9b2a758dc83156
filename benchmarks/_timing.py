"""Shared timing helper for the benchmark scripts (not a test; never asserted)."""

from __future__ import annotations

import time

import jax


def time_wall_cpu(fn, *args, repeats: int = 10, warmup: int = 2) -> tuple[float, float]:
    """(median wall seconds, median process-CPU seconds) of ``fn(*args)`` (outputs
    blocked on) after ``warmup`` calls. CPU time is the steadier number on a shared machine."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def time_fn(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time in milliseconds of ``fn(*args)`` (outputs blocked on)."""
    return 1e3 * time_wall_cpu(fn, *args, repeats=repeats, warmup=warmup)[0]


def print_table(rows: list[tuple[str, float]], baseline: str) -> None:
    """Print name / ms / ratio-to-baseline as a markdown table."""
    base = dict(rows)[baseline]
    print(f"| what | ms | x {baseline} |")
    print("|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} |")

"""Shared timing helper for the benchmark scripts (not a test; never asserted)."""

from __future__ import annotations

import time

import jax


def time_fn(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time in milliseconds of ``fn(*args)`` (outputs blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def print_table(rows: list[tuple[str, float]], baseline: str) -> None:
    """Print name / ms / ratio-to-baseline as a markdown table."""
    base = dict(rows)[baseline]
    print(f"| what | ms | x {baseline} |")
    print("|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} |")

"""Run tests under every XLA:CPU variant of ``tests/formats/test_exact_any_cpu.py``.

A tolerance on a floating-point reduction holds on one CPU and can break on another:
XLA:CPU picks its dot kernels by machine and flags (YNNPACK fusions or not, the widest
vector ISA it may emit), and a float32 sum's order is the kernel's. The CI machines come
in two kinds (Intel with AMX; AMD EPYC with AVX-512 BF16 and no AMX), so a bound must
hold on both. This script runs pytest once per variant of `VARIANTS` (``XLA_FLAGS`` set
before jax is imported; the ``fake_devices`` children inherit it) and prints one line
each, then a markdown table::

    python tests/cpu_variants.py                      # the tolerance-based tests
    python tests/cpu_variants.py tests/train -k chunk  # any pytest arguments
    python tests/cpu_variants.py --variants avx512,ynnpack_off_avx2 tests/ops

The default selection is `TOLERANCE_TESTS`: the modules that assert a hard-coded bound on a
result of XLA arithmetic (docs/testing/tolerances.md lists each bound and its source).
Exit status: 0 when every variant passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _variants() -> dict[str, str]:
    """The one table of variants, `test_exact_any_cpu.VARIANTS`."""
    path = HERE / "formats" / "test_exact_any_cpu.py"
    spec = importlib.util.spec_from_file_location("_exact_any_cpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.VARIANTS)


# Modules with a hard-coded tolerance on XLA arithmetic (reductions: GEMMs, sums, softmax,
# a model's forward or backward), from docs/testing/tolerances.md's `xla-reduction` rows.
TOLERANCE_TESTS = (
    "tests/experiments/test_seeds.py",
    "tests/export/test_export_gguf.py",
    "tests/export/test_export_hf.py",
    "tests/export/test_families_hf.py",
    "tests/export/test_gguf_families.py",
    "tests/export/test_export_llamacpp.py",
    "tests/export/test_rope_hf.py",
    "tests/formats/test_hadamard.py",
    "tests/inference/test_inference_engine.py",
    "tests/model/test_attention_chunk.py",
    "tests/model/test_families.py",
    "tests/model/test_rope.py",
    "tests/model/test_model_rules.py",
    "tests/model/test_model_transformer.py",
    "tests/model/test_scan_layers.py",
    "tests/ops/test_native_sharded.py",
    "tests/ops/test_ops_backend.py",
    "tests/ops/test_ops_delayed.py",
    "tests/ops/test_ops_dot.py",
    "tests/ops/test_ops_sharding.py",
    "tests/ops/test_tensor_split.py",
    "tests/plan/test_plan_native_sharding.py",
    "tests/ptq/test_gptq.py",
    "tests/ptq/test_ptq_awq.py",
    "tests/ptq/test_ptq_families.py",
    "tests/ptq/test_ptq_hf.py",
    "tests/ptq/test_ptq_pipeline.py",
    "tests/ptq/test_ptq_sensitivity.py",
    "tests/ptq/test_ptq_weights.py",
    "tests/train/test_hf_import.py",
    "tests/train/test_loss_chunk.py",
    "tests/train/test_optim.py",
    "tests/train/test_train_init.py",
    "tests/train/test_train_loop.py",
    "tests/train/test_train_parts.py",
    "tests/train/test_train_qat.py",
    "tests/train/test_train_sharding.py",
)

_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed).*?)\s*=*$")


def run_variant(name: str, flags: str, pytest_args: list[str]) -> tuple[int, str, float, str]:
    """pytest under one variant: (exit code, summary line, wall seconds, load average)."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    lines = proc.stdout.splitlines()
    summary = next((m.group(1) for x in reversed(lines) if (m := _SUMMARY.match(x))), "")
    failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
    if failed:
        summary += "; " + "; ".join(failed)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return proc.returncode, summary or "(no summary line)", wall, load


def main(argv: list[str] | None = None) -> int:
    variants = _variants()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(variants), help="comma-separated names")
    args, rest = p.parse_known_args(argv)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in variants]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {list(variants)}")
    pytest_args = rest or ["-n", "2", *TOLERANCE_TESTS]
    rows = []
    for name in chosen:
        rc, summary, wall, load = run_variant(name, variants[name], pytest_args)
        print(f"{name:18s} rc={rc} {wall:7.0f} s  load {load}  {summary}", flush=True)
        rows.append((name, variants[name] or "(none)", rc, summary, wall, load))
    print("\n| variant | XLA_FLAGS | result | wall | load average (1, 5, 15 min) at the end |")
    print("|---|---|---|---:|---|")
    for name, flags, _rc, summary, wall, load in rows:
        print(f"| {name} | `{flags}` | {summary} | {wall:.0f} s | {load} |")
    return 0 if all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

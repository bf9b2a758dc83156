"""Ahead-of-time compilation of the real sharded train step on simulated devices.

`compile_step` builds exactly what ``microscale train`` runs -- the abstract model and
AdamW state with the trainer's shardings (``train.state.build_state(abstract=True)``: only
``jax.ShapeDtypeStruct``\\ s, nothing allocated) and the jitted step of
``train.step.make_train_step`` -- lowers it for an abstract global batch and compiles it
with XLA's SPMD partitioner. The compiled program is the per-device program, so its
memory analysis (argument / output / temporary buffers) and its HLO are per device.

JAX fixes its device count when it starts, so the simulated devices
(``--xla_force_host_platform_device_count=N`` on the CPU backend) need a fresh process:
`compile_in_subprocess` runs this module's ``_main`` in a child ``python`` with
that flag and ``JAX_PLATFORMS=cpu`` and reads back a JSON result. A process that already
has enough devices (tests on 8 fake devices) may call `compile_step` directly.

What the CPU compile does and does not tell about a GPU: the shardings, the collectives
the partitioner inserts and the argument bytes are the GPU's. Temporary bytes come from
XLA:CPU's buffer assignment and scheduling, which differ from XLA:GPU's (fusion, remat of
the scheduler, bf16 handling), so they are an estimate of the GPU's activations, not a
measurement of them.

The program is compiled to be inspected, never run, so the CPU backend's LLVM passes run
unoptimized (:data:`COMPILER_OPTIONS`): everything read here (the partitioner's
collectives, the fused HLO, XLA's FLOPs, the buffer assignment) is decided by the HLO
passes before the machine code exists, and the compile is quicker (0.5-0.7x the time for
small steps, 0.8-0.9x for the llama-8b and llama-70b presets: benchmarks/timings.md). A
persistent-cache entry carries its compile options in its key, so such a program is never
served to a train step.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from microscale.outputs import TrainingRun

__all__ = ["COMPILER_OPTIONS", "compile_in_subprocess", "compile_step"]

# XLA options of the inspected program: LLVM's optimization of the CPU machine code off (the
# HLO, the collectives and the buffer assignment do not depend on it; tests/plan holds them
# equal to the default compile's)
COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


def _say(msg: str, t0: float) -> None:
    print(f"[plan {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _heartbeat(done, t0: float, every: float = 30.0) -> None:
    while not done.wait(every):
        _say("still compiling", t0)


def _measure(compiled, devices: int, hlo_path: str | None) -> dict[str, Any]:
    """Memory, XLA's FLOP count, and the dot FLOPs and collectives read from the HLO of a
    compiled step (written to ``hlo_path`` when given)."""
    from microscale.plan.hlo import HloModule

    mem = compiled.memory_analysis()
    m = {
        k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float((cost or {}).get("flops", 0.0))
    text = compiled.as_text()
    if hlo_path:
        Path(hlo_path).write_text(text)
    hlo = HloModule(text, devices)
    return {
        "memory": m,
        "xla_flops": xla_flops,
        "dot_flops": hlo.dot_flops(),
        "collectives": hlo.collectives(),
        "unknown_trip_counts": hlo.unknown_trip_counts,
    }


def compile_step(
    cfg,
    *,
    lower_only: bool = False,
    hlo_path: str | None = None,
    verbose: bool = True,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Lower (and unless ``lower_only``, compile) the train step of ``cfg`` (a
    :class:`~microscale.train.TrainConfig`) on this process's devices; the result is a
    JSON-able dict (see module doc). ``compiler_options``: XLA's options for the compile
    (None: :data:`COMPILER_OPTIONS`; ``{}``: the defaults, as ``microscale train`` compiles).
    Raises what tracing/lowering raises."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from microscale.train.mesh import BATCH_AXES
    from microscale.train.optim import lr_schedule
    from microscale.train.state import build_state
    from microscale.train.step import make_train_step

    t0 = time.perf_counter()
    st = build_state(cfg, abstract=True)
    mesh = st.mesh
    accum = cfg.data.grad_accum
    micro = cfg.data.batch_size // accum
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if micro % dp:
        raise ValueError(
            f"data.batch_size / data.grad_accum = {micro} is not divisible by the "
            f"data-parallel ways mesh.data * mesh.fsdp = {dp}"
        )
    batch_sh = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES, None))
    step = make_train_step(
        st.graphdefs["main"],
        st.tx,
        lr_schedule(cfg.optim, cfg.steps),
        seed=cfg.seed,
        param_shardings=st.param_shardings,
        opt_shardings=st.opt_shardings,
        batch_sharding=batch_sh,
    )
    batch = jax.ShapeDtypeStruct((accum, micro, cfg.data.seq_len + 1), jnp.int32, sharding=batch_sh)
    if verbose:
        _say(f"lowering the train step on mesh {dict(mesh.shape)}", t0)
    lowered = step.lower(
        st.params, st.opt_state, st.rest, batch, jax.ShapeDtypeStruct((), jnp.int32)
    )
    out: dict[str, Any] = {
        "mesh": dict(mesh.shape),
        "devices": int(mesh.size),
        "lower_s": time.perf_counter() - t0,
        "replicated": [str(r) for r in st.replicated],
    }
    if lower_only:
        return out
    if verbose:
        _say("compiling (XLA SPMD partitioner + CPU backend; minutes for large models)", t0)
    t1 = time.perf_counter()
    done = threading.Event()
    if verbose:  # a heartbeat: XLA's compile is one call with no progress of its own
        threading.Thread(target=_heartbeat, args=(done, t0), daemon=True).start()
    try:
        opts = COMPILER_OPTIONS if compiler_options is None else compiler_options
        compiled = lowered.compile(compiler_options=opts)
    finally:
        done.set()
    out["compile_s"] = time.perf_counter() - t1
    out.update(_measure(compiled, mesh.size, hlo_path))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if verbose:
        _say(f"compiled in {out['compile_s']:.1f}s", t0)
    return out


def compile_in_subprocess(
    cfg,
    devices: int,
    *,
    lower_only: bool = False,
    hlo_path: str | None = None,
    timeout: float | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """`compile_step` in a fresh ``python`` with ``devices`` simulated CPU devices.

    Returns its result dict, or ``{"error": message, "phase": ...}`` when the step does
    not trace, lower or compile (the message is the child's exception). Raises
    ``RuntimeError`` when the child dies without a result (killed, out of memory).
    """
    from microscale.config import dump_yaml

    with tempfile.TemporaryDirectory(prefix="microscale-plan-") as tmp:
        # the child reads the config as a run folder stores it
        cfg_path, res_path = Path(tmp) / TrainingRun.CONFIG, Path(tmp) / "result.json"
        dump_yaml(cfg, cfg_path)
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={int(devices)}"]),
        )
        cmd = [
            sys.executable,
            "-c",
            "import sys; from microscale.plan.compile import _main; "
            "raise SystemExit(_main(sys.argv[1:]))",
            str(cfg_path),
            str(res_path),
        ]
        if lower_only:
            cmd.append("--lower-only")
        if hlo_path:
            cmd += ["--hlo", str(hlo_path)]
        if not verbose:
            cmd.append("--quiet")
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=None if verbose else subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
        if not res_path.exists():
            tail = (proc.stderr or "")[-2000:] if not verbose else ""
            raise RuntimeError(
                f"the compile process exited with code {proc.returncode} "
                f"after {time.perf_counter() - t0:.0f}s without a result "
                f"(out of memory or killed?) {tail}"
            )
        return json.loads(res_path.read_text())


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="microscale.plan.compile")
    p.add_argument("config")
    p.add_argument("result")
    p.add_argument("--lower-only", action="store_true")
    p.add_argument("--hlo")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    from microscale.config import load_yaml
    from microscale.files import atomic_write_text
    from microscale.train import TrainConfig

    cfg = load_yaml(TrainConfig, a.config)
    phase = "lower" if a.lower_only else "compile"
    try:
        res = compile_step(cfg, lower_only=a.lower_only, hlo_path=a.hlo, verbose=not a.quiet)
    except Exception as e:  # reported to the parent, which explains it
        res = {"error": f"{type(e).__name__}: {e}", "phase": phase}
    atomic_write_text(a.result, json.dumps(res))
    return 0

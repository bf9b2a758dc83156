"""The plan table of docs/plan/README.md: memory per device, fit, the largest microbatch
that fits, and the roofline's predicted NVFP4 speed-ups for the large presets on several
meshes and accelerators, from the shapes (the compiled plans are docs/plan/*/plan.md).

    python benchmarks/plan_table.py --out docs/plan/table.md
"""

from __future__ import annotations

import argparse

from microscale.config import apply_overrides
from microscale.files import atomic_write_text
from microscale.plan import (
    ACCELERATORS,
    check_config,
    largest_microbatch,
    roofline,
    shape_memory,
)
from microscale.plan.run import abstract_model
from microscale.train import TrainConfig

CASES = [  # (preset, overrides)
    ("llama-8b", ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"]),
    ("llama-8b", ["mesh.data=1", "mesh.fsdp=64", "mesh.tensor=1"]),
    ("llama-70b", ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=8"]),
    ("llama-70b", ["mesh.data=1", "mesh.fsdp=64", "mesh.tensor=8"]),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--accelerators", default=",".join(ACCELERATORS))
    a = p.parse_args(argv)
    accs = [ACCELERATORS[n] for n in a.accelerators.split(",")]
    lines = [
        "| preset | mesh (data x fsdp x tensor) | accelerator | state GB (params + Adam "
        "+ grads) | activations GB (estimate) | peak GB | fits | largest microbatch per "
        "device (sequences x tokens) | NVFP4 / FP8 step | "
        "NVFP4 / BF16 step | NVFP4 / FP8 GEMMs only | quantize share of NVFP4 step |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    models = {}
    for preset, over in CASES:
        cfg = apply_overrides(TrainConfig.preset(preset), over + ["recipe=nvfp4"])
        mesh, n = check_config(cfg, None)
        model = models.get(preset) or models.setdefault(preset, abstract_model(cfg.model))
        mem = shape_memory(cfg, mesh, model)["bytes"]
        for acc in accs:
            roof = roofline(cfg, mesh, acc, ("bf16", "fp8", "nvfp4"), model=model)
            s = roof["speedup"]
            nv = roof["recipes"]["nvfp4"]
            state = mem["params"] + mem["opt_state"] + mem["grads"]
            fits = "yes" if mem["total"] <= acc.hbm_bytes else "**no**"
            big = largest_microbatch(cfg, mesh, acc.hbm_bytes, model)
            most = "none" if big is None else f"{big['sequences_per_device']} x {cfg.data.seq_len}"
            fmt = lambda r, k: "n/a (no FP4)" if r is None else f"{r[k]:.2f}x"
            share = "n/a" if nv["total"] is None else f"{nv['terms']['quantize'] / nv['total']:.0%}"
            lines.append(
                f"| {preset} | {mesh['data']} x {mesh['fsdp']} x {mesh['tensor']} ({n}) | "
                f"{acc.name} | {state / 1e9:.1f} | {mem['activations'] / 1e9:.1f} | "
                f"{mem['total'] / 1e9:.1f} | {fits} ({acc.hbm_bytes / 1e9:.0f}) | {most} | "
                f"{fmt(s['fp8'], 'step')} | {fmt(s['bf16'], 'step')} | "
                f"{fmt(s['fp8'], 'gemm_only')} | {share} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        atomic_write_text(a.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Analytic vs compiled collectives and FLOPs of the sharded train step, per mesh.

    python docs/plan/collectives.py > docs/plan/collectives.md

Compiles the step of a 2-block model (d_model 256, d_ff 1024, 8 heads, untied 512-token
vocabulary, 16 x 128 tokens, scanned layers) on 8 simulated CPU devices for each mesh and recipe, and
prints a markdown table: the analytic volume of ``microscale.plan.comm`` and the compiled
bytes by collective kind (per device per step), their ratio (against the analytic volume,
and against it as XLA:CPU lowers it, ``plan.comm.cpu_volume``), and
the compiled matmul FLOPs against ``plan.comm.matmul_flops``. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

MODEL = [
    "model.vocab_size=512",
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.d_ff=1024",
    "model.max_seq_len=128",
    "data.seq_len=128",
    "data.batch_size=16",
    "model.tie_embeddings=false",
    "model.scan_layers=true",
]
MESHES = [
    ("1 x 8 x 1", ["mesh.data=1", "mesh.fsdp=8"]),
    ("8 x 1 x 1", ["mesh.data=8"]),
    ("2 x 4 x 1", ["mesh.data=2", "mesh.fsdp=4"]),
    ("1 x 1 x 8", ["mesh.data=1", "mesh.tensor=8"]),
    ("1 x 4 x 2", ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]),
    ("2 x 2 x 2", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
]
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def main() -> None:
    from microscale.config import apply_overrides
    from microscale.plan.comm import analytic_collectives, cpu_volume, matmul_flops
    from microscale.plan.compile import compile_step
    from microscale.train import TrainConfig

    mb = lambda b: f"{b / 1e6:.2f}"  # noqa: E731
    print(
        "| mesh (data x fsdp x tensor) | recipe | remat | "
        + " | ".join(f"{k} MB (analytic / compiled)" for k in KINDS)
        + " | total MB | compiled / analytic "
        "| compiled / analytic as XLA:CPU lowers it | matmul FLOPs compiled / formula |"
    )
    print("|---|---|---|" + "---:|" * (len(KINDS) + 4))
    for label, mesh in MESHES:
        for recipe in ("bf16", "nvfp4"):
            for remat in ("false", "true"):
                cfg = apply_overrides(
                    TrainConfig.tiny(), MODEL + mesh + [f"recipe={recipe}", f"model.remat={remat}"]
                )
                r = compile_step(cfg, verbose=False)
                a = analytic_collectives(cfg, r["mesh"])
                comp = {k: v["bytes"] for k, v in r["collectives"].items()}
                total = sum(comp.values())
                cpu = cpu_volume(a, comp)  # the volume as XLA:CPU lowers it
                cells = [f"{mb(a['by_kind'].get(k, 0))} / {mb(comp.get(k, 0))}" for k in KINDS]
                print(
                    f"| {label} | {recipe} | {remat} | "
                    + " | ".join(cells)
                    + f" | {mb(a['total'])} / {mb(total)} | {total / a['total']:.2f}x | "
                    f"{total / cpu:.2f}x | "
                    f"{r['dot_flops'] / matmul_flops(cfg, 8):.4f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""What one ``microscale compare`` is: :class:`CompareConfig` (a base training config, the
runs and seeds to train from it, the output folder) and the presets (``PRESETS``).

Its own module so that :mod:`.compare` (which trains the runs) and :mod:`.report` (which
reads them) both import it, and neither imports the other's config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from microscale.config import apply_overrides, to_dict
from microscale.experiments.runs import BASELINES, RUNS
from microscale.train import TrainConfig

__all__ = ["PRESETS", "REGIME", "CompareConfig"]

# Compare presets: (what it is for, overrides of the `tiny` training preset, runs, seeds).
# The regime comes from the noise study (docs/compare-noise/): at peak lr 3e-3 some seeds'
# bf16 runs sit on a plateau that nvfp4 escapes (or the reverse), so paired gaps swing by
# several points; at 1e-3 with cosine decay to 0 the gap's seed sd is 0.4-0.8 points. The
# cheapest setting measured there is the 0.16M-parameter model (d_model 64): its gap sd
# (0.41, n = 4) is no larger than the 0.62M model's (0.61-0.77) at ~60% of the CPU per run,
# so more seeds fit. The final eval reads 64 x 16 x 128 = 131k validation tokens (and as
# many of the second held-out set): its own SE (~0.01 points) is far below the seed spread.
REGIME = (
    "model.d_model=64",
    "model.d_ff=128",
    "steps=150",
    "optim.warmup_steps=15",
    "lr=1e-3",
    "optim.min_lr_ratio=0",
    "eval_every=0",
    "eval_batches=64",
    "data.eval_batch_size=16",
    "tensorboard=false",
)
# The smoke preset: the same model, data and machinery in about a minute (timings:
# benchmarks/timings.md), a check that everything runs rather than a verdict: 2 seeds give
# a paired interval with 1 degree of freedom (t = 12.7), and 60 steps stop far from the
# default's losses.
SMOKE = (*REGIME, "steps=60", "optim.warmup_steps=6", "eval_batches=16")
PRESETS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], tuple[int, ...]]] = {
    "smoke": (
        "a one-minute first look: bf16 and nvfp4 x 2 seeds, 60 steps (too few to resolve "
        "the default's gaps; the report says so)",
        SMOKE,
        ("bf16", "nvfp4"),
        (0, 1),
    ),
    "default": (
        "bf16, fp8 and nvfp4 paired over 6 seeds (timings: benchmarks/timings.md)",
        REGIME,
        ("bf16", "fp8", "nvfp4"),
        tuple(range(6)),
    ),
    "decisive": (
        "the default's regime with 20 seeds (measured: +-0.12-point intervals vs bf16 and fp8)",
        REGIME,
        ("bf16", "fp8", "nvfp4"),
        tuple(range(20)),
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """One comparison: a base training config and the runs to train from it."""

    # The shared training config (model, data, optimizer, steps, seed, ...).
    base: TrainConfig = TrainConfig()
    # Runs to train, names from RUNS (baselines first).
    runs: tuple[str, ...] = BASELINES
    # Initialisation/SR seeds; several seeds give mean and spread per run.
    seeds: tuple[int, ...] = (0,)
    # Output folder.
    out: str = "runs/compare"
    # Concurrent training processes (one device group each); 1 = in this process.
    parallel: int = 1
    # Seeds of one run trained as one program (experiments/seeds.py): 0 = as many as fit
    # in memory, 1 = one run at a time. In this process only (parallel = 1).
    seed_batch: int = 0

    def __post_init__(self):
        unknown = [r for r in self.runs if r not in RUNS]
        if unknown:
            raise ValueError(f"unknown run(s) {unknown}; expected names from {list(RUNS)}")
        if not self.runs:
            raise ValueError("runs is empty; expected at least one of " + str(list(RUNS)))
        if len(set(self.runs)) != len(self.runs):
            raise ValueError(f"runs {list(self.runs)} lists a run twice")
        if not self.seeds or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds={self.seeds}: expected one or more ints >= 0")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {list(self.seeds)} lists a seed twice")
        if self.parallel < 1:
            raise ValueError(f"parallel={self.parallel}: expected an int >= 1")
        if isinstance(self.seed_batch, bool) or not isinstance(self.seed_batch, int):
            raise ValueError(f"seed_batch={self.seed_batch!r}: expected an int >= 0")
        if self.seed_batch < 0:
            raise ValueError(f"seed_batch={self.seed_batch}: expected an int >= 0 (0: as fit)")

    @classmethod
    def preset(cls, name: str, base: TrainConfig | None = None, **kw) -> CompareConfig:
        """A compare preset (``PRESETS``): its runs and seeds, and its training regime
        applied to the ``tiny`` config (or to ``base`` when given, which then wins)."""
        if name not in PRESETS:
            raise ValueError(f"unknown compare preset {name!r}; expected one of {list(PRESETS)}")
        _, overrides, runs, seeds = PRESETS[name]
        if base is None:
            base = apply_overrides(TrainConfig.tiny(), list(overrides))
        return cls(**{"base": base, "runs": runs, "seeds": seeds, **kw})

    def run_dirs(self) -> dict[tuple[str, int], Path]:
        root = Path(self.out) / "runs"
        multi = len(self.seeds) > 1
        return {
            (r, s): root / (f"{r}-seed{s}" if multi else r) for r in self.runs for s in self.seeds
        }

    def run_config(self, name: str, seed: int) -> TrainConfig:
        # A seed fixes both the initialisation and the data order, so runs of one seed are
        # paired and seeds are independent replicates.
        cfg = apply_overrides(self.base, {**RUNS[name], "seed": seed, "data.seed": seed})
        out = str(self.run_dirs()[(name, seed)])
        return dataclasses.replace(cfg, out=out, resume=True)

    def settings_hash(self) -> str:
        """Identifies the comparison's settings (not its output folder)."""
        d = {
            "base": to_dict(dataclasses.replace(self.base, out=None, resume=False)),
            "runs": list(self.runs),
            "seeds": list(self.seeds),
        }
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

"""The runs ``microscale compare`` knows, one row each: a name and the overrides that make
it differ from the base config (:mod:`.compare` trains them, :mod:`.report` reads them)."""

from __future__ import annotations

from typing import Any

__all__ = ["ABLATIONS", "BASELINES", "CONTROLS", "RUNS"]

# name -> the overrides that make this run differ from the base config.
RUNS: dict[str, dict[str, Any]] = {
    "bf16": {"recipe": "bf16"},
    "fp8": {"recipe": "fp8"},
    "mxfp8": {"recipe": "mxfp8"},
    "nvfp4": {"recipe": "nvfp4"},
    "mxfp4": {"recipe": "mxfp4"},
    "nvfp4_no_rht": {"recipe": "nvfp4_no_rht"},
    "nvfp4_no_sr": {"recipe": "nvfp4_no_sr"},
    "nvfp4_1d": {"recipe": "nvfp4_1d"},  # 1x16 weight blocks
    # no bf16 blocks
    "nvfp4_all_fp4": {"recipe": "nvfp4", "precision.bf16_last": 0, "precision.bf16_first": 0},
    "nvfp4_fwd_only": {"recipe": "nvfp4_fwd_only"},  # FP4 in the forward GEMM only
    # the last 18% of tokens in bf16 (the paper's Appendix D)
    "nvfp4_late_bf16": {
        "recipe": "nvfp4",
        "precision.late.fraction": 0.18,
        "precision.late.bf16": "all",
    },
    # nvfp4 with the bf16 layers chosen by measured sensitivity after a bf16 warm-up, at
    # the positional rule's bf16 FLOP fraction (train/adaptive.py)
    "nvfp4_adaptive": {"recipe": "nvfp4", "precision.kind": "sensitivity"},
    # the control for nvfp4_adaptive's bf16 warm-up: the same warm-up, then the positional rule
    "nvfp4_warmup": {"recipe": "nvfp4", "precision.warmup": 0.1},
}
# Runs also read against a control run of the same set (when both are in it): the control
# shares everything but the one choice under test.
CONTROLS = {"nvfp4_adaptive": "nvfp4_warmup"}
BASELINES = ("bf16", "fp8", "mxfp8", "nvfp4", "mxfp4")
ABLATIONS = tuple(n for n in RUNS if n not in BASELINES)

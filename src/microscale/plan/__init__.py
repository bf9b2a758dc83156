"""Scale without the hardware: compile the real sharded train step on a simulated mesh,
check the fit per device, and model the step time per recipe on a roofline.

* `plan` -- the whole report (``microscale plan``); `check_config`, `shape_memory`,
  `largest_microbatch` (the most sequences per device that fit an accelerator).
* `compile_step` / `compile_in_subprocess` -- AOT lower + compile on fake CPU devices.
* `roofline` / `recipe_step_time` -- step-time terms from published peak rates.
* `ACCELERATORS` / `get_accelerator` -- the one table of peak rates, with sources.
* `HloModule` -- collectives and matmul FLOPs of a compiled program, loops counted.
"""

from microscale.plan.compile import compile_in_subprocess, compile_step
from microscale.plan.hardware import ACCELERATORS, Accelerator, get_accelerator
from microscale.plan.hlo import HloModule
from microscale.plan.roofline import recipe_step_time, roofline
from microscale.plan.run import check_config, largest_microbatch, plan, shape_memory

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "HloModule",
    "check_config",
    "compile_in_subprocess",
    "compile_step",
    "get_accelerator",
    "largest_microbatch",
    "plan",
    "recipe_step_time",
    "roofline",
    "shape_memory",
]

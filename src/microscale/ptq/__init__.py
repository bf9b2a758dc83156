"""Adaptive post-training quantization: calibration, sensitivity, budgeted search, PTQ.

Not every layer tolerates 4 bits. ``microscale quantize`` measures how much each linear
layer's loss contribution suffers in each candidate format and gives each layer the
cheapest format its sensitivity allows under an effective-bits budget::

    from microscale.ptq import QuantizeConfig, quantize_model
    from microscale.workflows import quantize_run

    result = quantize_run("runs/tiny", "out/q", QuantizeConfig(budget=4.8))   # a run folder
    result = quantize_model(model, calib_batches, eval_batches, QuantizeConfig())  # any model
    result.allocation.formats      # {"layers.0.attn.q_proj": "nvfp4", ...}
    result.rules                   # PrecisionRules (the object training and export use)
    result.val_ppl                 # {"bf16", "uniform_nvfp4", "heuristic", "searched", ...}

Modules: :mod:`~microscale.ptq.search` (exact multiple-choice knapsack),
:mod:`~microscale.ptq.sensitivity` (taylor / gradient / KL / loss scores),
:mod:`~microscale.ptq.weights` (MSE tensor scale, four over six),
:mod:`~microscale.ptq.gptq` (GPTQ error compensation for block-scaled formats),
:mod:`~microscale.ptq.awq` (activation-aware per-channel scales folded into the model),
:mod:`~microscale.ptq.engine` and :mod:`~microscale.ptq.tap` (the model as
traced functions: per-layer inputs and output gradients from one backward pass),
:mod:`~microscale.ptq.pipeline` (the run's phases), :mod:`~microscale.ptq.problem` (the
search's problem over the layers, the budget check), :mod:`~microscale.ptq.config` (its
options), :mod:`~microscale.ptq.evaluate` (validation of allocations, the PTQ-effects
table), :mod:`~microscale.ptq.result` (what it decided, ``report.json``),
:mod:`~microscale.ptq.run` (the calibrator quantize and export share, a run's trained
allocation), :mod:`~microscale.ptq.report` (files and plots),
:mod:`~microscale.ptq.sequential`
(calibration and GPTQ one decoder block at a time, from memory-mapped weights).
``quantize_run`` (a model folder in, quantized outputs out) reads training runs, so it
sits above ``ptq`` and ``train``: :mod:`microscale.workflows`.
"""

from microscale.ptq.awq import awq_fold
from microscale.ptq.config import DEFAULT_FORMATS, QuantizeConfig
from microscale.ptq.engine import ActQuant, Engine, next_token_loss
from microscale.ptq.evaluate import heuristic_allocation
from microscale.ptq.gptq import gptq_quantize
from microscale.ptq.pipeline import quantize_model
from microscale.ptq.problem import check_quantize_budget
from microscale.ptq.report import read_own_checkpoint, write_outputs
from microscale.ptq.result import QuantizeResult, allocation_rules, ptq_recipe
from microscale.ptq.run import (
    calibration_batches,
    calibration_windows,
    input_amax,
    trained_allocation,
)
from microscale.ptq.search import (
    DEFAULT_GROUPS,
    EMBED_ITEM,
    Allocation,
    Problem,
    brute_force,
    check_budget,
    effective_bits,
    group_layers,
    model_bits,
    search,
)
from microscale.ptq.sensitivity import (
    gradient_scores,
    kl_loss_scores,
    monotone,
    score,
    table_scores,
    taylor_scores,
)
from microscale.ptq.sequential import folder_source, params_source, sequential_gptq
from microscale.ptq.tap import intercept_linears
from microscale.ptq.weights import (
    QuantizedWeight,
    WeightPTQ,
    four_over_six,
    quantize_group,
    quantize_weight,
)

__all__ = [
    "DEFAULT_FORMATS",
    "DEFAULT_GROUPS",
    "EMBED_ITEM",
    "ActQuant",
    "Allocation",
    "Engine",
    "Problem",
    "QuantizeConfig",
    "QuantizeResult",
    "QuantizedWeight",
    "WeightPTQ",
    "allocation_rules",
    "awq_fold",
    "brute_force",
    "calibration_batches",
    "calibration_windows",
    "check_budget",
    "check_quantize_budget",
    "effective_bits",
    "model_bits",
    "four_over_six",
    "gptq_quantize",
    "gradient_scores",
    "group_layers",
    "heuristic_allocation",
    "input_amax",
    "intercept_linears",
    "kl_loss_scores",
    "monotone",
    "next_token_loss",
    "ptq_recipe",
    "quantize_group",
    "quantize_model",
    "quantize_weight",
    "read_own_checkpoint",
    "score",
    "search",
    "sequential_gptq",
    "folder_source",
    "params_source",
    "table_scores",
    "taylor_scores",
    "trained_allocation",
    "write_outputs",
]

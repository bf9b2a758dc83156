"""Training: config, step, loop, mesh/sharding, checkpoints, metrics.

Library use (what ``microscale train`` and ``microscale compare`` call)::

    from microscale.config import apply_overrides
    from microscale.train import TrainConfig, train

    cfg = apply_overrides(TrainConfig.tiny(), ["recipe=nvfp4", "out=runs/x"])
    summary = train(cfg)                # dict, also in runs/x/summary.json
    summary["final_val_loss"], summary["unigram_entropy"]

Modules: :mod:`~microscale.train.config` (TrainConfig and presets),
:mod:`~microscale.train.step` (the jitted step), :mod:`~microscale.train.loop`
(``train``), :mod:`~microscale.train.phases` (the precision phases and the change
between them), :mod:`~microscale.train.state` (``build_state``, ``load_checkpoint``),
:mod:`~microscale.train.optim`, :mod:`~microscale.train.mesh`,
:mod:`~microscale.train.checkpoint`, :mod:`~microscale.train.metrics`.
"""

from microscale.ops.loss import cross_entropy
from microscale.train.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointMismatchError,
)
from microscale.train.config import (
    LateSwitchConfig,
    MeshConfig,
    OptimConfig,
    PrecisionConfig,
    SensitivityConfig,
    TrainConfig,
    list_presets,
    preset_yaml,
)
from microscale.train.init import resolve_config
from microscale.train.loop import TrainingAborted, enable_compilation_cache, train
from microscale.train.mesh import build_mesh, maybe_initialize_distributed
from microscale.train.metrics import weight_quant_stats
from microscale.train.optim import lr_schedule, make_optimizer
from microscale.train.state import build_state, load_checkpoint
from microscale.train.step import make_eval_step, make_train_step

__all__ = [
    "CheckpointCorruptError",
    "Checkpointer",
    "CheckpointMismatchError",
    "LateSwitchConfig",
    "MeshConfig",
    "OptimConfig",
    "PrecisionConfig",
    "SensitivityConfig",
    "TrainConfig",
    "TrainingAborted",
    "build_mesh",
    "build_state",
    "cross_entropy",
    "enable_compilation_cache",
    "list_presets",
    "preset_yaml",
    "resolve_config",
    "load_checkpoint",
    "lr_schedule",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "maybe_initialize_distributed",
    "train",
    "weight_quant_stats",
]

"""``TrainConfig``: everything one training run needs, as one frozen dataclass.

A run is fully described by a :class:`TrainConfig` (written to ``OUT/config.yaml`` at
start): the model shape (:class:`~microscale.model.ModelConfig`), the data and its
batching (:class:`~microscale.data.DataConfig` -- sequence length, global batch size,
gradient accumulation and eval batches live there, once), the optimizer
(:class:`OptimConfig`), the recipe and its per-layer precision rules, the late precision
switch (:class:`LateSwitchConfig`), the device mesh (:class:`MeshConfig`) and the loop's
cadence (steps, eval / log / checkpoint intervals).

Presets mirror the model presets (``TrainConfig.preset("tiny")``, ``list_presets()``)
and ship as YAML in ``microscale/configs/<preset>.yaml`` -- plain serializations of these
classmethods (``microscale.config.to_yaml(TrainConfig.tiny())``). Overrides are dotted
``key=value`` strings (``microscale.config.apply_overrides``); a few frequent nested keys
have top-level aliases (``batch_size``, ``seq_len``, ``grad_accum``, ``eval_batches``,
``corpus``, ``lr``).

The ``tiny`` preset is sized for a laptop: 300 steps of 16 x 128 tokens on CPU. Measured
times and losses, with their date and machine load, are in ``benchmarks/timings.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from microscale.config import to_yaml
from microscale.data import DataConfig
from microscale.model import (
    BF16_LAYOUTS,
    ModelConfig,
    PrecisionRules,
    list_presets,
    rules_for_training,
)
from microscale.ops import get_recipe
from microscale.ptq.sensitivity import METHODS

__all__ = ["AdaptiveConfig", "LateSwitchConfig", "MeshConfig", "OptimConfig", "TrainConfig", "list_presets",
           "preset_yaml"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (see :mod:`microscale.train.optim`)."""

    # Peak learning rate.
    lr: float = 3e-3
    # Linear warmup steps from ~0 to lr.
    warmup_steps: int = 30
    # "cosine": decay to min_lr_ratio * lr at the last step; "wsd": warmup-stable-decay,
    # linear decay over the final decay_fraction of the steps.
    schedule: Literal["cosine", "wsd"] = "cosine"
    # WSD only: fraction of the steps spent decaying.
    decay_fraction: float = 0.2
    # Final learning rate as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Decoupled weight decay (matrices only; norms are not decayed).
    weight_decay: float = 0.1
    # Adam (beta1, beta2).
    betas: tuple[float, float] = (0.9, 0.95)
    # Adam epsilon.
    eps: float = 1e-8
    # Global gradient-norm clip (<= 0 disables).
    grad_clip: float = 1.0

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}: expected a learning rate > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps}: expected >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio}: expected in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction}: expected in (0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay={self.weight_decay}: expected >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas}: expected two values in [0, 1)")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"optim.schedule={self.schedule!r}: expected 'cosine' or 'wsd'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LateSwitchConfig:
    """Train the last tokens in high precision (NVFP4 paper, Appendix D)."""

    # Fraction of the final training tokens run in bf16 (0 = never switch; paper: ~0.18).
    fraction: float = 0.0
    # "full": forward and backward GEMMs in bf16; "fwd_only": only the forward GEMM in
    # bf16, dgrad/wgrad keep the recipe.
    mode: Literal["full", "fwd_only"] = "full"

    def __post_init__(self):
        if not 0 <= self.fraction < 1:
            raise ValueError(f"late_switch.fraction={self.fraction}: expected in [0, 1)")
        if self.mode not in ("full", "fwd_only"):
            raise ValueError(f"late_switch.mode={self.mode!r}: expected 'full' or 'fwd_only'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh (data, fsdp, tensor) and multi-host start-up (see ``train/mesh.py``)."""

    # Data-parallel ways; -1 = all devices left after fsdp and tensor.
    data: int = -1
    # Fully-sharded data-parallel ways (params + optimizer state sharded on d_model).
    fsdp: int = 1
    # Tensor-parallel ways (heads and MLP hidden split).
    tensor: int = 1
    # jax.distributed.initialize(): "auto" (when a multi-host launch is detected or a
    # coordinator is given), "on", "off".
    distributed: Literal["auto", "on", "off"] = "auto"
    # host:port of process 0 (None: let JAX discover it from SLURM / MPI / TPU env).
    coordinator_address: str | None = None
    # Number of processes (with coordinator_address).
    num_processes: int | None = None
    # This process's id (with coordinator_address).
    process_id: int | None = None
    # Global device ids to build the mesh from (e.g. [4, 5, 6, 7] to run beside another
    # job on one host); empty = all devices.
    device_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor"):
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ValueError(f"mesh.{name}={v}: expected a positive size or -1 (the rest)")
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            raise ValueError("mesh: at most one of data/fsdp/tensor may be -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    """``bf16_policy=sensitivity``: which layers stay bf16 (see ``train/adaptive.py``)."""

    # Fraction of the steps trained fully in bf16 before the sensitivity is measured.
    warmup_fraction: float = 0.1
    # Largest fraction of the linear-layer FLOPs (= weight elements) kept in bf16; None =
    # the fraction the positional rule keeps (bf16_first + bf16_last blocks).
    bf16_flops: float | None = None
    # Sensitivity score (microscale.ptq: "taylor", "gradient", "kl", "loss").
    method: str = "taylor"
    # Training-split tokens the scores are measured on (rounded up to whole batches).
    calib_tokens: int = 16384
    # Score with each layer's input quantized too (as the recipe's forward pass does).
    activations: bool = True
    # "layer": q/k/v and gate/up share a precision, other layers choose alone; "block":
    # whole transformer blocks stay bf16 or not.
    granularity: Literal["layer", "block"] = "layer"

    def __post_init__(self):
        if not 0 < self.warmup_fraction < 1:
            raise ValueError(f"adaptive.warmup_fraction={self.warmup_fraction}: expected in "
                             "(0, 1)")
        if self.bf16_flops is not None and not 0 <= self.bf16_flops < 1:
            raise ValueError(f"adaptive.bf16_flops={self.bf16_flops}: expected None or a "
                             "fraction in [0, 1)")
        if self.method not in METHODS:
            raise ValueError(f"adaptive.method={self.method!r}: expected one of {METHODS}")
        if self.calib_tokens < 1:
            raise ValueError(f"adaptive.calib_tokens={self.calib_tokens}: expected an int >= 1")
        if self.granularity not in ("layer", "block"):
            raise ValueError(f"adaptive.granularity={self.granularity!r}: expected 'layer' or "
                             "'block'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Serializes to/from YAML and ``key=value`` overrides."""

    # Model shape and dtypes (presets: list_presets()).
    model: ModelConfig = ModelConfig.tiny()
    # Corpus, tokenizer and batching: data.seq_len, data.batch_size (global sequences per
    # optimizer step), data.grad_accum, data.eval_batches live here.
    data: DataConfig = DataConfig()
    # AdamW and the learning-rate schedule.
    optim: OptimConfig = OptimConfig()
    # Recipe of the quantized linear layers (microscale.ops.list_recipes(): bf16, fp8,
    # mxfp8, nvfp4, mxfp4, and the nvfp4 ablations).
    recipe: str = "bf16"
    # Leading transformer blocks kept in bf16.
    bf16_first: int = 0
    # Trailing blocks kept in bf16; None = the recipe default (15% of blocks, >= 1, for a
    # quantized recipe; 0 for bf16).
    bf16_last: int | None = None
    # A named (bf16_first, bf16_last) layout instead of the two fields (which must then be
    # left at 0 / None): "paper_12b" = first 2 + last 8 blocks in bf16 (arXiv 2509.25149).
    bf16_layout: str | None = None
    # Path of a PrecisionRules JSON (e.g. a `microscale quantize` output's
    # precision_rules.json, for QAT); replaces recipe/bf16_first/bf16_last when set.
    rules: str | None = None
    # How the layers of `rules` train: "forward": each quantized recipe's forward pass
    # only, gradients in bf16 through the quantizer (straight-through; QAT); "full": each
    # layer in the full low-precision training recipe of its weight format (nvfp4, mxfp4,
    # mxfp8, fp8_e4m3: dgrad and wgrad quantized too); "as_written": the recipes unchanged.
    rules_mode: Literal["forward", "full", "as_written"] = "forward"
    # Which blocks of a quantized recipe stay bf16: "position" (bf16_first/bf16_last),
    # "sensitivity" (after a bf16 warm-up, per-layer sensitivity picks the bf16 layers
    # under a linear-FLOP budget; see the adaptive.* keys) or "position_warmup" (the
    # positional rule after the same bf16 warm-up: the control that separates the warm-up's
    # effect from the choice's).
    bf16_policy: Literal["position", "sensitivity", "position_warmup"] = "position"
    # Settings of bf16_policy=sensitivity (its warm-up also sets position_warmup's).
    adaptive: AdaptiveConfig = AdaptiveConfig()
    # Start from these weights (weights only: optimizer, schedule and data position start
    # fresh): a microscale run folder, a `microscale quantize` output or an HF Llama folder.
    init_from: str | None = None
    # Checkpoint step of an init_from run folder; None = its latest.
    init_step: int | None = None
    # Switch to high precision for the final tokens.
    late_switch: LateSwitchConfig = LateSwitchConfig()
    # Optimizer steps.
    steps: int = 300
    # Evaluate every N steps (and at the end); 0 = only at the end.
    eval_every: int = 100
    # Write a metrics line every N steps.
    log_every: int = 10
    # Save a checkpoint every N steps (and at the end); 0 = only at the end.
    checkpoint_every: int = 0
    # Finished checkpoints kept (oldest deleted first).
    keep_checkpoints: int = 2
    # Continue from the latest checkpoint in out (exactly: same data, keys and state).
    resume: bool = False
    # Seed of the initialization and of the per-step keys (stochastic rounding).
    seed: int = 0
    # Output folder; None = runs/<model>-<recipe>-<timestamp>.
    out: str | None = None
    # Device mesh and multi-host settings.
    mesh: MeshConfig = MeshConfig()
    # Abort after this many consecutive non-finite losses/gradients (updates are skipped).
    max_nonfinite_in_a_row: int = 10
    # Testing aid: steps (1-based, as logged) whose gradient is replaced by NaN, to
    # exercise the skip/abort path.
    inject_nonfinite_steps: tuple[int, ...] = ()
    # Write TensorBoard event files under out/tb.
    tensorboard: bool = True

    # Top-level shorthands accepted by apply_overrides (CLI): alias -> dotted key.
    _aliases = {"batch_size": "data.batch_size", "seq_len": "data.seq_len",
                "grad_accum": "data.grad_accum", "eval_batches": "data.eval_batches",
                "corpus": "data.corpus", "lr": "optim.lr"}

    def __post_init__(self):
        for name in ("steps", "log_every", "keep_checkpoints", "max_nonfinite_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected an int >= 1")
        for name in ("eval_every", "checkpoint_every", "bf16_first", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected an int >= 0")
        if self.bf16_last is not None and self.bf16_last < 0:
            raise ValueError(f"bf16_last={self.bf16_last}: expected None or an int >= 0")
        if self.bf16_layout is not None:
            if self.bf16_layout not in BF16_LAYOUTS:
                raise ValueError(f"bf16_layout={self.bf16_layout!r}: expected None or one of "
                                 f"{sorted(BF16_LAYOUTS)}")
            if self.bf16_first != 0 or self.bf16_last is not None:
                raise ValueError(f"bf16_layout={self.bf16_layout!r} sets bf16_first and "
                                 f"bf16_last; got also bf16_first={self.bf16_first}, "
                                 f"bf16_last={self.bf16_last} (set one or the other)")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}: lower seq_len or raise max_seq_len")
        recipe = get_recipe(self.recipe)  # raises with the known names
        for spec in recipe.operands().values():
            b = spec.spec.block_size
            if b is None:
                continue
            m = self.model
            for name, dim in (("d_model", m.d_model), ("d_ff", m.d_ff),
                              ("n_heads * head_dim", m.n_heads * m.head_dim),
                              ("n_kv_heads * head_dim", m.n_kv_heads * m.head_dim)):
                if dim % b:
                    raise ValueError(
                        f"recipe {self.recipe!r} quantizes in blocks of {b}, but model "
                        f"{name}={dim} is not a multiple of {b}")
        if self.rules is None:
            self.precision_rules()  # validates bf16_first/bf16_last against n_layers
        if self.rules_mode not in ("forward", "full", "as_written"):
            raise ValueError(f"rules_mode={self.rules_mode!r}: expected 'forward', 'full' or "
                             "'as_written'")
        if self.bf16_policy not in ("position", "sensitivity", "position_warmup"):
            raise ValueError(f"bf16_policy={self.bf16_policy!r}: expected 'position', "
                             "'sensitivity' or 'position_warmup'")
        if self.bf16_policy != "position":
            if self.rules is not None:
                raise ValueError(f"bf16_policy={self.bf16_policy} sets the bf16 layers from "
                                 "the recipe; it cannot be combined with rules=")
            if self.bf16_policy == "sensitivity" and self.bf16_layout is not None:
                raise ValueError("bf16_policy=sensitivity chooses the bf16 layers itself; it "
                                 f"cannot be combined with bf16_layout={self.bf16_layout!r}")
            if not recipe.quantized:
                raise ValueError(f"bf16_policy={self.bf16_policy} needs a quantized recipe, "
                                 f"got recipe={self.recipe!r}")
            warm = self.warmup_steps
            if warm >= self.switch_step:
                raise ValueError(f"adaptive.warmup_fraction={self.adaptive.warmup_fraction} "
                                 f"leaves no step between the bf16 warm-up ({warm} steps) and "
                                 f"the late switch at step {self.switch_step}")
        if self.init_step is not None and self.init_from is None:
            raise ValueError(f"init_step={self.init_step} needs init_from=PATH")
        if self.init_step is not None and self.init_step < 0:
            raise ValueError(f"init_step={self.init_step}: expected None or an int >= 0")

    # ------------------------------------------------------------------ derived
    def precision_rules(self) -> PrecisionRules:
        """The per-layer rules of the main phase (from ``rules`` or the recipe)."""
        if self.rules is not None:
            try:
                rules = PrecisionRules.load(self.rules)
            except (OSError, ValueError, TypeError) as e:
                raise ValueError(f"rules={self.rules!r}: {e}") from None
            return rules_for_training(rules, self.rules_mode)
        first, last = (BF16_LAYOUTS[self.bf16_layout] if self.bf16_layout is not None
                       else (self.bf16_first, self.bf16_last))
        return PrecisionRules.for_recipe(self.recipe, self.model.n_layers,
                                         bf16_first=first, bf16_last=last)

    @property
    def tokens_per_step(self) -> int:
        return self.data.batch_size * self.data.seq_len

    @property
    def warmup_steps(self) -> int:
        """Steps trained all-bf16 first (bf16_policy sensitivity or position_warmup; else 0)."""
        if self.bf16_policy == "position":
            return 0
        return max(1, int(round(self.adaptive.warmup_fraction * self.steps)))

    @property
    def own_allocation(self) -> bool:
        """Whether the run trains with an allocation of its own (``rules=``, e.g. QAT, or
        ``bf16_policy=sensitivity``), recorded in ``OUT/precision_rules.json``: what
        ``microscale export`` writes and ``microscale quantize`` scores as ``trained``."""
        return self.rules is not None or self.bf16_policy == "sensitivity"

    @property
    def switch_step(self) -> int:
        """First step of the late high-precision phase (``steps`` when there is none)."""
        if self.late_switch.fraction <= 0:
            return self.steps
        return self.steps - int(round(self.late_switch.fraction * self.steps))

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls) -> TrainConfig:
        """~1.7M params, byte-level stdlib, 614k tokens; sized for a CPU, val loss far below
        the unigram entropy for bf16 and nvfp4 alike (benchmarks/timings.md)."""
        return cls(model=ModelConfig.tiny(),
                   data=DataConfig(seq_len=128, batch_size=16, eval_batches=8),
                   optim=OptimConfig(lr=3e-3, warmup_steps=30),
                   steps=300, eval_every=25, log_every=10)

    @classmethod
    def small(cls) -> TrainConfig:
        """~25M params; sized for one GPU."""
        return cls(model=ModelConfig.small(),
                   data=DataConfig(seq_len=512, batch_size=32, eval_batches=16),
                   optim=OptimConfig(lr=1.5e-3, warmup_steps=100),
                   steps=2000, eval_every=250, log_every=20, checkpoint_every=500)

    @classmethod
    def gpt2_124m(cls) -> TrainConfig:
        """GPT-2 small scale; one GPU or more (data parallel by default)."""
        return cls(model=ModelConfig.gpt2_124m(),
                   data=DataConfig(seq_len=1024, batch_size=256, grad_accum=4,
                                   eval_batches=32),
                   optim=OptimConfig(lr=6e-4, warmup_steps=700, schedule="wsd"),
                   steps=20000, eval_every=1000, log_every=50, checkpoint_every=1000,
                   keep_checkpoints=3)

    @classmethod
    def llama_1b(cls) -> TrainConfig:
        """Llama 3.2 1B shape; FSDP over all devices."""
        return cls(model=ModelConfig.llama_1b(),
                   data=DataConfig(seq_len=2048, batch_size=512, grad_accum=4,
                                   eval_batches=32),
                   optim=OptimConfig(lr=3e-4, warmup_steps=2000, schedule="wsd"),
                   steps=100000, eval_every=2000, log_every=100, checkpoint_every=2000,
                   keep_checkpoints=3, mesh=MeshConfig(data=1, fsdp=-1, tensor=1))

    @classmethod
    def llama_8b(cls) -> TrainConfig:
        """Llama 3.1 8B shape; FSDP over all devices (add mesh.tensor for > 64 chips)."""
        return cls(model=ModelConfig.llama_8b(),
                   data=DataConfig(seq_len=4096, batch_size=512, grad_accum=8,
                                   eval_batches=32),
                   optim=OptimConfig(lr=3e-4, warmup_steps=2000, schedule="wsd"),
                   steps=200000, eval_every=2000, log_every=100, checkpoint_every=1000,
                   keep_checkpoints=3, mesh=MeshConfig(data=1, fsdp=-1, tensor=1))

    @classmethod
    def llama_70b(cls) -> TrainConfig:
        """Llama 3.1 70B shape: 4M-token batches of 8k sequences, FSDP x 8-way tensor
        parallelism (set mesh.fsdp; ``microscale plan`` before a cluster run)."""
        return cls(model=ModelConfig.llama_70b(),
                   data=DataConfig(seq_len=8192, batch_size=512, grad_accum=8,
                                   eval_batches=32),
                   optim=OptimConfig(lr=1.5e-4, warmup_steps=2000, schedule="wsd"),
                   steps=500000, eval_every=2000, log_every=100, checkpoint_every=1000,
                   keep_checkpoints=3, mesh=MeshConfig(data=1, fsdp=-1, tensor=8))

    @classmethod
    def preset(cls, name: str) -> TrainConfig:
        """A preset by name ('-' and '_' interchangeable)."""
        key = name.strip().lower().replace("-", "_")
        if key not in _PRESETS:
            raise ValueError(f"unknown train preset {name!r}; expected one of {list_presets()}")
        return getattr(cls, key)()


# One training preset per model preset (a classmethod of TrainConfig each).
_PRESETS = tuple(p.replace("-", "_") for p in list_presets())


def preset_yaml(name: str) -> str:
    """The YAML text of a preset (what ``microscale/configs/<name>.yaml`` holds)."""
    cfg = TrainConfig.preset(name)
    key = name.strip().lower().replace("-", "_")
    return (f"# microscale TrainConfig preset {key!r}: a serialization of TrainConfig.{key}().\n"
            "# Copy and edit it, then: microscale train --config my.yaml [key=value ...]\n"
            + to_yaml(cfg))

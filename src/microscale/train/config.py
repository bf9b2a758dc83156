"""``TrainConfig``: everything one training run needs, as one frozen dataclass.

A run is fully described by a :class:`TrainConfig` (written to ``OUT/config.yaml`` at
start): the model shape (:class:`~microscale.model.ModelConfig`), the data and its
batching (:class:`~microscale.data.DataConfig` -- sequence length, global batch size,
gradient accumulation and eval batches live there, once), the optimizer
(:class:`OptimConfig`), the recipe and where it applies (:class:`PrecisionConfig`: the
per-layer rules, the warm-up, the late precision switch), the device mesh
(:class:`MeshConfig`) and the loop's cadence (steps, eval / log / checkpoint intervals).

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
from microscale.model import ModelConfig, PrecisionRules, list_presets
from microscale.ops import get_recipe
from microscale.train.precision import (
    REMOVED_KEYS,
    LateSwitchConfig,
    PrecisionConfig,
    SensitivityConfig,
)

__all__ = [
    "LateSwitchConfig",
    "MeshConfig",
    "OptimConfig",
    "PrecisionConfig",
    "SensitivityConfig",
    "TrainConfig",
    "list_presets",
    "preset_yaml",
]


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
    # This process's id (with coordinator_address), 0 .. num_processes - 1.
    process_id: int | None = None
    # Seconds every process waits for all num_processes to join the coordinator before it
    # stops with an error naming the address (JAX's initialization_timeout).
    init_timeout_s: int = 300
    # Seconds without a heartbeat after which a process counts as dead and every other
    # process of the job stops with an error naming it (JAX's heartbeat_timeout_seconds).
    heartbeat_timeout_s: int = 60
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
        for name in ("init_timeout_s", "heartbeat_timeout_s"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"mesh.{name}={v}: expected a whole number of seconds >= 1")
        self._check_processes()

    def _check_processes(self) -> None:
        """The three launch settings go together, and the id is one of the job's."""
        given = {
            k: getattr(self, k) for k in ("coordinator_address", "num_processes", "process_id")
        }
        if self.coordinator_address is None:
            extra = [f"mesh.{k}={v}" for k, v in given.items() if v is not None]
            if extra:
                raise ValueError(
                    f"{' '.join(extra)} without mesh.coordinator_address: pass "
                    "mesh.coordinator_address=HOST:PORT (process 0's) as well, or none of "
                    "the three to let JAX discover them from SLURM/MPI"
                )
            return
        host, sep, port = self.coordinator_address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"mesh.coordinator_address={self.coordinator_address!r}: expected HOST:PORT "
                "(process 0's address and a free port, e.g. 10.0.0.1:1234)"
            )
        n, i = self.num_processes, self.process_id
        if n is None or i is None:
            missing = [k for k in ("num_processes", "process_id") if given[k] is None]
            raise ValueError(
                f"mesh.coordinator_address={self.coordinator_address} needs "
                + " and ".join(f"mesh.{k}" for k in missing)
                + " too (the job's size and this process's id in 0 .. size - 1)"
            )
        if n < 1:
            raise ValueError(f"mesh.num_processes={n}: expected a whole number >= 1")
        if not 0 <= i < n:
            raise ValueError(
                f"mesh.process_id={i}: expected 0 .. {n - 1} (mesh.num_processes={n}); "
                "every process of the job gets its own"
            )


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
    # Which layers train in the recipe: one kind ("position", "layout", "rules",
    # "sensitivity") with its settings, the all-bf16 warm-up and the late switch.
    precision: PrecisionConfig = PrecisionConfig()
    # Start from these weights (weights only: optimizer, schedule and data position start
    # fresh): a microscale run folder, a `microscale quantize` output or an HF folder.
    init_from: str | None = None
    # Checkpoint step of an init_from run folder; None = its latest.
    init_step: int | None = None
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
    _aliases = {
        "batch_size": "data.batch_size",
        "seq_len": "data.seq_len",
        "grad_accum": "data.grad_accum",
        "eval_batches": "data.eval_batches",
        "corpus": "data.corpus",
        "lr": "optim.lr",
    }
    # Keys before the precision sub-config (removed): old key -> what replaces it, named by
    # the unknown-key error.
    _removed_keys = REMOVED_KEYS

    def __post_init__(self):
        for name in ("steps", "log_every", "keep_checkpoints", "max_nonfinite_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected an int >= 1")
        for name in ("eval_every", "checkpoint_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected an int >= 0")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}: lower seq_len or raise max_seq_len"
            )
        recipe = get_recipe(self.recipe)  # raises with the known names
        for spec in recipe.operands().values():
            b = spec.spec.block_size
            if b is None:
                continue
            m = self.model
            for name, dim in (
                ("d_model", m.d_model),
                ("d_ff", m.d_ff),
                ("n_heads * head_dim", m.n_heads * m.head_dim),
                ("n_kv_heads * head_dim", m.n_kv_heads * m.head_dim),
            ):
                if dim % b:
                    raise ValueError(
                        f"recipe {self.recipe!r} quantizes in blocks of {b}, but model "
                        f"{name}={dim} is not a multiple of {b}"
                    )
        self._check_precision(recipe.quantized)
        if self.init_step is not None and self.init_from is None:
            raise ValueError(f"init_step={self.init_step} needs init_from=PATH")
        if self.init_step is not None and self.init_step < 0:
            raise ValueError(f"init_step={self.init_step}: expected None or an int >= 0")

    def _check_precision(self, quantized: bool) -> None:
        """The checks of ``precision`` that need the rest of the run (recipe, model, steps);
        its own are in :class:`PrecisionConfig`."""
        p = self.precision
        if p.spec.needs_quantized and not quantized:
            raise ValueError(
                f"precision.kind={p.kind!r} needs a quantized recipe, got recipe={self.recipe!r}"
            )
        if p.warmup_fraction > 0 and not quantized:
            raise ValueError(
                f"precision.warmup={p.warmup_fraction} (an all-bf16 warm-up) "
                f"needs a quantized recipe, got recipe={self.recipe!r}"
            )
        if not p.spec.reads_file:
            try:
                self.precision_rules()  # bf16_first/bf16_last against n_layers
            except ValueError as e:
                raise ValueError(f"precision: {e}") from None
        warm = self.warmup_steps
        if warm and warm >= self.switch_step:
            raise ValueError(
                f"precision.warmup={p.warmup_fraction} leaves no step between "
                f"the bf16 warm-up ({warm} steps) and the late switch at step "
                f"{self.switch_step}"
            )

    # ------------------------------------------------------------------ derived
    def precision_rules(self) -> PrecisionRules:
        """The per-layer rules of the main phase (``precision``'s kind; for a kind chosen
        during the run, the positional rules it starts from)."""
        return self.precision.main_rules(self.recipe, self.model.n_layers)

    @property
    def tokens_per_step(self) -> int:
        return self.data.batch_size * self.data.seq_len

    @property
    def warmup_steps(self) -> int:
        """Steps trained all-bf16 first (``precision.warmup``, the kind's default; else 0)."""
        frac = self.precision.warmup_fraction
        if frac <= 0:
            return 0
        return max(1, int(round(frac * self.steps)))

    @property
    def own_allocation(self) -> bool:
        """Whether the run trains with an allocation of its own (``precision.kind`` rules,
        e.g. QAT, or sensitivity), recorded in ``OUT/precision_rules.json``: what
        ``microscale export`` writes and ``microscale quantize`` scores as ``trained``."""
        return self.precision.spec.own_allocation

    @property
    def switch_step(self) -> int:
        """First step of the late high-precision phase (``steps`` when there is none)."""
        late = self.precision.late
        if late.fraction <= 0:
            return self.steps
        return self.steps - int(round(late.fraction * self.steps))

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls) -> TrainConfig:
        """~1.7M params, byte-level stdlib, 614k tokens; sized for a CPU, val loss far below
        the unigram entropy for bf16 and nvfp4 alike (benchmarks/timings.md)."""
        return cls(
            model=ModelConfig.tiny(),
            data=DataConfig(seq_len=128, batch_size=16, eval_batches=8),
            optim=OptimConfig(lr=3e-3, warmup_steps=30),
            steps=300,
            eval_every=25,
            log_every=10,
        )

    @classmethod
    def small(cls) -> TrainConfig:
        """~25M params; sized for one GPU."""
        return cls(
            model=ModelConfig.small(),
            data=DataConfig(seq_len=512, batch_size=32, eval_batches=16),
            optim=OptimConfig(lr=1.5e-3, warmup_steps=100),
            steps=2000,
            eval_every=250,
            log_every=20,
            checkpoint_every=500,
        )

    @classmethod
    def gpt2_124m(cls) -> TrainConfig:
        """GPT-2 small scale; one GPU or more (data parallel by default)."""
        return cls(
            model=ModelConfig.gpt2_124m(),
            data=DataConfig(seq_len=1024, batch_size=256, grad_accum=4, eval_batches=32),
            optim=OptimConfig(lr=6e-4, warmup_steps=700, schedule="wsd"),
            steps=20000,
            eval_every=1000,
            log_every=50,
            checkpoint_every=1000,
            keep_checkpoints=3,
        )

    @classmethod
    def llama_1b(cls) -> TrainConfig:
        """Llama 3.2 1B shape; FSDP over all devices."""
        return cls(
            model=ModelConfig.llama_1b(),
            data=DataConfig(seq_len=2048, batch_size=512, grad_accum=4, eval_batches=32),
            optim=OptimConfig(lr=3e-4, warmup_steps=2000, schedule="wsd"),
            steps=100000,
            eval_every=2000,
            log_every=100,
            checkpoint_every=2000,
            keep_checkpoints=3,
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        )

    @classmethod
    def llama_8b(cls) -> TrainConfig:
        """Llama 3.1 8B shape; FSDP over all devices (add mesh.tensor for > 64 chips)."""
        return cls(
            model=ModelConfig.llama_8b(),
            data=DataConfig(seq_len=4096, batch_size=512, grad_accum=8, eval_batches=32),
            optim=OptimConfig(lr=3e-4, warmup_steps=2000, schedule="wsd"),
            steps=200000,
            eval_every=2000,
            log_every=100,
            checkpoint_every=1000,
            keep_checkpoints=3,
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        )

    @classmethod
    def llama_70b(cls) -> TrainConfig:
        """Llama 3.1 70B shape: 4M-token batches of 8k sequences, FSDP x 8-way tensor
        parallelism (set mesh.fsdp; ``microscale plan`` before a cluster run)."""
        return cls(
            model=ModelConfig.llama_70b(),
            data=DataConfig(seq_len=8192, batch_size=512, grad_accum=8, eval_batches=32),
            optim=OptimConfig(lr=1.5e-4, warmup_steps=2000, schedule="wsd"),
            steps=500000,
            eval_every=2000,
            log_every=100,
            checkpoint_every=1000,
            keep_checkpoints=3,
            mesh=MeshConfig(data=1, fsdp=-1, tensor=8),
        )

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
    return (
        f"# microscale TrainConfig preset {key!r}: a serialization of TrainConfig.{key}().\n"
        "# Copy and edit it, then: microscale train --config my.yaml [key=value ...]\n"
        + to_yaml(cfg)
    )

"""``train(cfg)``: the training loop as a library function.

What one call does, in order:

1. multi-host start-up if configured (``mesh.py``), the (data, fsdp, tensor) mesh;
2. the output folder: ``config.yaml`` (the resolved :class:`TrainConfig`),
   ``precision_rules.json`` (the per-layer rules of the main phase, and of the late phase
   when there is one), ``tokenizer.json``;
3. data (:func:`microscale.data.load_data`): the train batcher, the fixed validation
   batches of every held-out set, the unigram entropy of the val split;
4. the model: parameters initialized directly sharded (``jax.jit`` with output
   shardings from the model's logical axes), float32 master weights, AdamW state --
   or all of it restored from the latest checkpoint when ``resume=true``;
5. the loop over steps (``step.py``): the batch for step ``t`` is ``batch_at(t)`` (a pure
   function of the data seed and ``t``), the key is ``fold_in(seed, t)``; at
   ``switch_step`` the late precision switch re-applies the rules (one recompile);
   metrics are read back one step late so the host never stalls the device;
6. evaluations, checkpoints, ``metrics.jsonl`` / TensorBoard / progress (``metrics.py``);
7. ``summary.json`` (written atomically) and the summary dict returned.

Non-finite steps are skipped on device (``step.py``) and counted here; after
``max_nonfinite_in_a_row`` in a row :class:`TrainingAborted` is raised (a
``summary.json`` with ``"status": "aborted"`` is written first) and no checkpoint is
saved, so the last good one is intact and ``resume=true`` continues from it.

Exact resume: params, optimizer state, the step, the non-finite counters and the phase
are checkpointed; batches and keys are functions of the step. 20 steps straight and 10 +
resume + 10 give identical losses (``tests/train/test_train_loop.py``).

The parts, each a top-level name with explicit arguments (``tests/train/test_train_parts.py``
tests them alone): :class:`Clock` (the counters and timers), :func:`evaluate` (an
``"eval"`` record), :func:`checkpoint_meta` and :func:`write_summary` (``summary.json``);
the phases and their compiled programs are in :mod:`~microscale.train.phases`.

One start of a run (:func:`_run_start`) builds what is fixed for it once, a frozen
``_Run`` (config, folder, data, checkpointer, logger, phases, eval batches, the summary's
facts), from :func:`_prepare` (files, data, mesh, state) and :func:`_restore` (the weights
it starts from). :func:`_train_steps` then carries the weights, the optimizer state and
the :class:`~microscale.train.phases.Precision` from step to step (:func:`_train_step`,
:func:`_read_back`, :func:`_evaluate`, :func:`_save`); a phase change
(:func:`_change_phase`) returns a new precision. It returns where it stopped (``_End``)
to :func:`_finish` or :func:`_abort`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale import __version__
from microscale.config import dump_yaml, load_yaml, to_dict
from microscale.data import check_vocab_fits, load_data
from microscale.files import atomic_write_json, check_output_dir, lock_folder, read_json
from microscale.model import (
    assignments,
    iter_linears,
    quantized_blocks,
)
from microscale.ops import get_recipe
from microscale.outputs import TrainingRun
from microscale.progress import format_duration
from microscale.train.checkpoint import Checkpointer
from microscale.train.config import TrainConfig
from microscale.train.init import check_init_shapes, check_model_source, load_init_weights
from microscale.train.mesh import (
    build_mesh,
    check_every_process_writes,
    maybe_initialize_distributed,
    shard_batch,
)
from microscale.train.metrics import MetricsLogger, weight_quant_stats
from microscale.train.phases import (
    BATCH_SPEC,
    EVAL_SPEC,
    Phases,
    Precision,
    choose_allocation,
    enter_phase,
    save_rules,
    start_precision,
)
from microscale.train.state import _leaf_diff, _State, build_state

__all__ = ["TrainingAborted", "default_out", "enable_compilation_cache", "train"]

# Config fields that must not change when resuming (they define the run).
_RUN_DEFINING = (
    "model",
    "data",
    "optim",
    "recipe",
    "precision",
    "init_from",
    "init_step",
    "seed",
    "steps",
)


class TrainingAborted(RuntimeError):
    """Raised after too many consecutive non-finite steps; ``.summary`` holds the partial
    summary (also written to ``OUT/summary.json`` with ``"status": "aborted"``)."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (default ``<microscale cache>/jax``).

    A second run of the same model/recipe/shapes then skips XLA compilation (20-30 s per
    quantized recipe on a laptop CPU). ``MICROSCALE_JAX_CACHE=0`` disables it; a cache dir
    configured elsewhere is left alone. Returns the directory in use (None if disabled).
    """
    env = os.environ.get("MICROSCALE_JAX_CACHE")
    if env is not None and env.strip().lower() in ("0", "off", "false", "no", ""):
        return None
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if current:
        return current
    from microscale.data import cache_root

    d = Path(path or env or cache_root() / "jax").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return str(d)


def default_out(cfg: TrainConfig) -> str:
    """``runs/<d_model>x<n_layers>-<recipe>-<YYYYmmdd-HHMMSS>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    m = cfg.model
    return os.path.join("runs", f"d{m.d_model}x{m.n_layers}-{cfg.recipe}-{stamp}")


# ----------------------------------------------------------------------------- helpers


def _check_resume_compatible(out: Path, cfg: TrainConfig) -> None:
    path = out / TrainingRun.CONFIG
    if not path.exists():
        return
    old = load_yaml(TrainConfig, path)
    diff = [
        (k, a, b)
        for k in _RUN_DEFINING
        for k, a, b in _leaf_diff(k, to_dict(old).get(k), to_dict(cfg).get(k))
    ]
    if diff:
        shown = ", ".join(f"{k}={b!r} (the run has {a!r})" for k, a, b in diff[:8])
        more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
        raise ValueError(
            f"resume=true but {len(diff)} run-defining setting(s) differ from {path}: "
            f"{shown}{more}. A resumed run must keep them (only cadence, mesh and output "
            "options may change); use a new out= for a different run"
        )


def _init_params(cfg: TrainConfig, st: _State, weights: dict, src):
    """``weights`` (of ``init_from``) checked against the model, sharded like ``st.params``."""

    def name(path) -> str:
        return ".".join(str(getattr(k, "key", k)) for k in path)

    leaves = jax.tree_util.tree_flatten_with_path(st.params)[0]
    check_init_shapes(weights, {name(p): x.shape for p, x in leaves}, src, cfg.model)

    def put(path, x, sharding):
        arr = np.asarray(weights[name(path)], dtype=x.dtype)
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    return jax.tree_util.tree_map_with_path(put, st.params, st.param_shardings)


def _quant_stats(model) -> dict[str, dict[str, float]]:
    out = {}
    for path, node in iter_linears(model):
        recipe = getattr(node, "recipe", None)
        if recipe is None or not hasattr(node, "kernel"):
            continue
        stats = weight_quant_stats(node.kernel[...], get_recipe(recipe).fprop_w)
        if stats is not None:
            out[path] = stats
    return out


# ----------------------------------------------------------------------------- train


def train(
    cfg: TrainConfig,
    *,
    progress: bool = True,
    callbacks: Sequence[Callable[[dict], None]] | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` to completion (or resume it); return the summary dict.

    ``progress``: a tqdm bar on a terminal, plain periodic lines otherwise (False: quiet).
    ``callbacks``: called with every metrics record (dicts with ``kind`` "train", "eval" or
    "event", as written to ``metrics.jsonl``) -- e.g. ``microscale compare``'s display.
    ``label``: the progress display's name for this run (default: the recipe).

    With ``resume=true`` a run whose ``summary.json`` says ``"completed"`` at
    ``steps`` is not recomputed: its summary is returned as is. Raises
    :class:`TrainingAborted` after ``max_nonfinite_in_a_row`` non-finite steps,
    ``FileExistsError`` when ``out`` holds checkpoints and ``resume`` is false.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train expects a TrainConfig, got {type(cfg).__name__}")
    t_start = time.perf_counter()
    maybe_initialize_distributed(cfg.mesh)
    several = jax.process_count() > 1
    if cfg.out is None:
        if several:  # the default name carries the start time, which differs between hosts
            raise ValueError(
                "out= is required when several processes train one run: every process "
                "writes the same run folder (e.g. out=/shared/runs/x)"
            )
        cfg = dataclasses.replace(cfg, out=default_out(cfg))
    assert cfg.out is not None
    existed = Path(cfg.out).expanduser().exists()
    if several:  # creates out (removed again when any process fails): all agree it works
        out = check_every_process_writes(cfg.out)
    else:
        out = check_output_dir(cfg.out, what="out=")
    if cfg.init_from is not None and not (cfg.resume and existed):
        check_model_source(cfg.init_from)  # a bad source: refused before any folder exists
    # One writer per run folder (on multi-host runs, process 0 speaks for all).
    lock = lock_folder(out) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock:
        created = not existed if several else not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            return _train_locked(
                cfg, out, t_start=t_start, progress=progress, callbacks=callbacks, label=label
            )
        except BaseException:
            if created and jax.process_index() == 0:
                _remove_unstarted(out)
            raise


# What a run writes before it starts logging: a folder holding only these was never a run.
_STARTUP_FILES = frozenset(
    {TrainingRun.CONFIG, TrainingRun.RULES, TrainingRun.TOKENIZER, TrainingRun.CHECKPOINTS}
)


def _remove_unstarted(out: Path) -> None:
    """Remove ``out`` (created by this call) when the run failed before it logged or saved
    anything (a bad ``init_from``, data or mesh): no half-made run folder is left behind. A
    run that has written metrics or a checkpoint keeps its folder."""
    names = {p.name for p in out.iterdir()}
    ckpts = out / TrainingRun.CHECKPOINTS
    if names <= _STARTUP_FILES and not (ckpts.is_dir() and any(ckpts.iterdir())):
        shutil.rmtree(out, ignore_errors=True)


def _train_locked(
    cfg: TrainConfig, out: Path, *, t_start: float, progress: bool, callbacks, label
) -> dict[str, Any]:
    ckpt = Checkpointer(out / TrainingRun.CHECKPOINTS, keep=cfg.keep_checkpoints)
    try:
        latest = ckpt.latest_step()
        if latest is not None and not cfg.resume:
            raise FileExistsError(
                f"{out} already holds checkpoints (latest step {latest}); pass resume=true "
                "to continue that run, or choose another out="
            )
        if cfg.resume:
            _check_resume_compatible(out, cfg)
        if cfg.resume and latest is not None:
            done = out / TrainingRun.SUMMARY
            if latest >= cfg.steps and done.exists():
                summary = read_json(done, what="run summary")
                if summary.get("status") == "completed":
                    return summary
        return _run_start(
            cfg,
            out,
            ckpt,
            latest if cfg.resume else None,
            t_start=t_start,
            progress=progress,
            callbacks=callbacks,
            label=label or cfg.recipe,
        )
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------- the loop's parts


@dataclasses.dataclass(kw_only=True)
class Clock:
    """The loop's counters and timers, updated once per step read back.

    Time between two read-backs is training time; the first step of each compiled program
    counts as compile time, the others feed the throughput (``tokens_per_s``).
    Evaluations and checkpoints are excluded from both (:meth:`pause`). The non-finite
    counters and ``train_time`` are checkpointed; the rest starts afresh with each start of
    a run.
    """

    # time.perf_counter() when train() was called (the summary's wall time).
    t_start: float
    # Steps done: the last step read back (the step a run starts at before the first).
    step: int
    # Skipped (non-finite) updates so far, over all starts of the run.
    nonfinite_total: int = 0
    # Non-finite steps in a row, up to `step`.
    streak: int = 0
    # Seconds of training so far, over all starts of the run.
    train_time: float = 0.0
    # Seconds of the steps that compiled a program (this start).
    compile_s: float = 0.0
    # Seconds of the other steps (this start).
    timed_s: float = 0.0
    # Tokens of those steps.
    timed_tokens: int = 0
    # time.perf_counter() at the previous read-back (moved on by pauses).
    t_prev: float = 0.0
    # Start of the current log window (moved on by pauses).
    win_t0: float = 0.0
    # Tokens read back in the current log window.
    win_tokens: int = 0
    # Finite losses in the current log window.
    win_loss: list[float] = dataclasses.field(default_factory=list)
    # The last finite losses (at most `keep` of them, see count()).
    recent: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def resumed(cls, meta: dict[str, Any], *, t_start: float, start: int) -> Clock:
        """The clock of a run starting at ``start``; ``meta``: its checkpoint's metadata
        (empty for a fresh run)."""
        return cls(
            t_start=t_start,
            step=start,
            nonfinite_total=int(meta.get("nonfinite_total", 0)),
            streak=int(meta.get("nonfinite_streak", 0)),
            train_time=float(meta.get("train_time_s", 0.0)),
        )

    def tick(self, now: float, tokens: int, *, compiling: bool) -> None:
        """A step was read back at ``now``: the time since the previous one is training
        time, and compile time or throughput time."""
        dt = now - self.t_prev
        self.t_prev = now
        self.train_time += dt
        if compiling:
            self.compile_s += dt
        else:
            self.timed_tokens += tokens
            self.timed_s += dt

    def count(self, step: int, loss: float, *, finite: bool, keep: int) -> None:
        """Step ``step`` (1-based) ended with ``loss``: the streak and the losses kept."""
        self.step = step
        if not finite:
            self.streak += 1
            self.nonfinite_total += 1
        else:
            self.streak = 0
            self.recent.append(loss)
            del self.recent[:-keep]
            self.win_loss.append(loss)

    def end_window(self, now: float) -> tuple[float | None, float | None]:
        """``(mean finite loss, tokens/s)`` of the log window ending at ``now``; a new
        window starts."""
        wdt = now - self.win_t0
        loss_avg = float(np.mean(self.win_loss)) if self.win_loss else None
        rate = self.win_tokens / wdt if wdt > 0 else None
        self.win_loss.clear()
        self.win_t0, self.win_tokens = now, 0
        return loss_avg, rate

    def pause(self, seconds: float) -> None:
        """Exclude ``seconds`` (an evaluation, a checkpoint) from the clocks."""
        self.t_prev += seconds
        self.win_t0 += seconds

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of this start, compile steps excluded (None before a timed step)."""
        return (self.timed_tokens / self.timed_s) if self.timed_s > 0 else None

    @property
    def train_loss(self) -> float | None:
        """Mean of the last finite losses (None before the first)."""
        return float(np.mean(self.recent)) if self.recent else None


def evaluate(
    eval_step: Callable,
    params,
    rest,
    val_batches: Mapping[str, Sequence],
    graphdef,
    *,
    step: int,
    tokens: int,
    phase: str,
) -> dict[str, Any]:
    """The ``"eval"`` record of ``params`` at ``step``: the mean loss of every eval set's
    fixed batches (``eval_step``: :func:`~microscale.train.step.make_eval_step` of
    ``graphdef``), each batch's loss, and the weight-quantization statistics of the model
    (``graphdef`` + ``params`` + ``rest``)."""
    t0 = time.perf_counter()
    per_batch = {
        name: [float(v) for v in jax.device_get([eval_step(params, rest, b) for b in batches])]
        for name, batches in val_batches.items()
    }
    model = nnx.merge(graphdef, nnx.State(params), rest)
    return eval_record(
        per_batch, model, step=step, tokens=tokens, phase=phase, seconds=time.perf_counter() - t0
    )


def eval_record(
    per_batch: Mapping[str, Sequence[float]],
    model,
    *,
    step: int,
    tokens: int,
    phase: str,
    seconds: float,
) -> dict[str, Any]:
    """The ``"eval"`` record from each eval set's per-batch losses (``"val"`` first) and
    the model they were measured on (its weight-quantization statistics)."""
    losses = {name: float(np.mean(vals)) for name, vals in per_batch.items()}
    return {
        "kind": "eval",
        "step": step,
        "tokens": tokens,
        "phase": phase,
        "val_loss": losses["val"],
        "val_ppl": math.exp(min(losses["val"], 50.0)),
        "val_losses": losses,
        "val_batch_losses": {name: list(vals) for name, vals in per_batch.items()},
        "quant": _quant_stats(model),
        "eval_time_s": seconds,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a run's summary reports that does not change while it trains."""

    # The resolved config.
    cfg: TrainConfig
    # The run folder.
    out: Path
    # Parameter count of the model.
    n_params: int
    # Content hash of the corpus.
    corpus_hash: str
    # Unigram entropy (nats) of each eval set ("val" first).
    entropy: dict[str, float]
    # First step of the late high-precision phase (None: no late switch).
    late_switch_step: int | None
    # Axis sizes of the device mesh.
    mesh_shape: dict[str, int]
    # The data's description (data.describe() without its config).
    data: dict[str, Any]


def write_summary(
    path: Path | None,
    status: str,
    *,
    facts: RunFacts,
    clock: Clock,
    last_eval: dict | None,
    precision: dict[str, str | None],
    init_source: dict | None,
    allocation: dict | None,
    **extra,
) -> dict[str, Any]:
    """The run's summary (``status``: "completed" or "aborted"; ``extra``: more keys),
    written atomically to ``path`` unless it is None, and returned.

    ``last_eval``: the latest ``"eval"`` record; ``precision``: each linear layer's recipe
    (:func:`~microscale.model.assignments`); ``init_source`` / ``allocation``: the run's
    ``init_from`` and ``bf16_allocation`` records.
    """
    cfg = facts.cfg
    s = {
        "status": status,
        "recipe": cfg.recipe,
        "final_val_loss": last_eval["val_loss"] if last_eval else None,
        "val_ppl": last_eval["val_ppl"] if last_eval else None,
        "final_val_losses": last_eval["val_losses"] if last_eval else None,
        # per fixed validation batch, so paired comparisons can measure eval noise
        "final_val_batch_losses": last_eval["val_batch_losses"] if last_eval else None,
        "final_train_loss": clock.train_loss,
        "steps": clock.step,
        "tokens": clock.step * cfg.tokens_per_step,
        "tokens_per_s": clock.tokens_per_s,
        "params": facts.n_params,
        "corpus_hash": facts.corpus_hash,
        "unigram_entropy": facts.entropy["val"],
        "unigram_entropies": facts.entropy,
        "nonfinite_steps": clock.nonfinite_total,
        "late_switch_step": facts.late_switch_step,
        "init_from": init_source,
        "bf16_allocation": allocation,
        "wall_time_s": time.perf_counter() - clock.t_start,
        "train_time_s": clock.train_time,
        "compile_time_s": clock.compile_s,
        "precision": precision,
        "mesh": facts.mesh_shape,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "out": str(facts.out),
        "data": facts.data,
        "config": to_dict(cfg),
        "microscale_version": __version__,
    }
    s.update(extra)
    if path is not None:
        atomic_write_json(path, s)
    return s


# ----------------------------------------------------------------------------- one start of a run


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Run:
    """What is fixed for one start of a run, built once by :func:`_run_start` (the weights,
    the precision and the latest evaluation are the loop's, passed and returned)."""

    # The resolved config.
    cfg: TrainConfig
    # The run folder.
    out: Path
    # Process 0: writes the files and prints.
    main: bool
    # microscale.data's loaded data (corpus, tokenizer, eval sets).
    data: Any
    # This process's training batcher.
    batcher: Any
    # The run's checkpoints.
    ckpt: Checkpointer
    # metrics.jsonl / TensorBoard / progress display.
    logger: MetricsLogger
    # Which phase trains each step.
    phases: Phases
    # The step this start begins at (0, or the restored checkpoint's).
    start: int
    # The init_from record (weights of another run or model), or None.
    init_source: dict | None
    # Eval set name -> its fixed validation batches on the devices.
    val: dict[str, list]
    # What the summary reports.
    facts: RunFacts

    @property
    def tps(self) -> int:
        """Tokens per step."""
        return self.cfg.tokens_per_step

    @property
    def rules_out(self) -> Path | None:
        """Where the precision rules are saved (None on processes other than the main one)."""
        return self.out if self.main else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Start:
    """Where one start of a run begins: restored from a checkpoint, from ``init_from``'s
    weights, or fresh."""

    # The float32 master weights.
    params: Any
    # The AdamW state.
    opt_state: Any
    # The first step (0, or the restored checkpoint's).
    step: int
    # The init_from record, or None.
    init_source: dict | None
    # The restored bf16_allocation record, or None.
    allocation: dict | None
    # The restored checkpoint's metadata (empty when none was).
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _End:
    """Where the steps of one start stopped."""

    # The weights after the last step.
    params: Any
    # The precision of the last step.
    precision: Precision
    # The latest "eval" record, or None.
    last_eval: dict | None
    # The step ending too many non-finite steps in a row (None: all steps ran).
    aborted_at: int | None = None


def _run_start(
    cfg: TrainConfig,
    out: Path,
    ckpt: Checkpointer,
    resume_from: int | None,
    *,
    t_start: float,
    progress: bool,
    callbacks,
    label: str,
) -> dict[str, Any]:
    """One start of the run in ``out``: prepare, log the start, train, summarize."""
    main = jax.process_index() == 0
    data, batcher, st, init = _prepare(cfg, out, main=main, fresh=resume_from is None)
    begin = _restore(cfg, st, ckpt, resume_from, init, out)
    phases = Phases.of_run(cfg, st.graphdefs)
    prec = start_precision(st, phases.of(begin.step), begin.allocation)
    clock = Clock.resumed(begin.meta, t_start=t_start, start=begin.step)
    logger = MetricsLogger(
        out,
        total_steps=cfg.steps,
        start_step=begin.step,
        progress=progress,
        tensorboard=cfg.tensorboard,
        main=main,
        callbacks=callbacks,
        description=label,
    )
    try:
        _announce(cfg, logger, prec, begin, warmup_end=phases.warmup_end, out=out)
        val = _eval_batches(data, st.mesh)
        run = _Run(
            cfg=cfg,
            out=out,
            main=main,
            data=data,
            batcher=batcher,
            ckpt=ckpt,
            logger=logger,
            phases=phases,
            start=begin.step,
            init_source=begin.init_source,
            val=val,
            facts=_facts(cfg, out, data, st.mesh, names=list(val), late_start=phases.late_start),
        )
        end = _train_steps(run, clock, prec, begin.params, begin.opt_state)
    except BaseException:
        logger.close()
        raise
    if end.aborted_at is not None:
        _abort(run, clock, end)
    return _finish(run, clock, end, progress=progress)


def _prepare(
    cfg: TrainConfig, out: Path, *, main: bool, fresh: bool
) -> tuple[Any, Any, _State, Any]:
    """The run's files, data, mesh and state (fresh weights): ``(data, batcher, state,
    init)``, ``init`` the weights of ``init_from`` on a ``fresh`` start (else None)."""
    if main:
        dump_yaml(cfg, out / TrainingRun.CONFIG)
    init = None  # read first: a bad init_from fails before data and model are built
    if cfg.init_from is not None and fresh:
        init = load_init_weights(cfg.init_from, step=cfg.init_step)
    data = load_data(cfg.data)
    check_vocab_fits(
        data.vocab_size,
        cfg.model.vocab_size,
        what=f"data.tokenizer={cfg.data.tokenizer!r}"
        if data.tokenizer
        else f"data.corpus={cfg.data.corpus!r}",
    )
    batcher = data.train_batcher(
        process_index=jax.process_index(), process_count=jax.process_count()
    )
    if main and data.tokenizer is not None:
        data.save_tokenizer(out / TrainingRun.TOKENIZER)
    mesh = build_mesh(cfg.mesh)
    _check_divisible(cfg, mesh)
    st = build_state(cfg, mesh)
    if not cfg.precision.spec.chosen_in_run:  # a sensitivity-chosen allocation: once chosen
        save_rules(st, out if main else None)
    return data, batcher, st, init


def _restore(
    cfg: TrainConfig, st: _State, ckpt: Checkpointer, resume_from: int | None, init, out: Path
) -> _Start:
    """The start's weights: restored from the newest intact checkpoint at or before
    ``resume_from``, those of ``init_from`` (``init``), or ``st``'s fresh ones."""
    restored = None
    if resume_from is not None:
        restored = ckpt.restore_newest_intact(
            {"params": st.params, "opt_state": st.opt_state},
            upto=resume_from,
            say=lambda m: print(f"[microscale train] {m}", file=sys.stderr, flush=True),
        )
        if restored is None:
            print(
                f"[microscale train] no intact checkpoint left in {out / TrainingRun.CHECKPOINTS}; "
                "starting from step 0",
                file=sys.stderr,
                flush=True,
            )
    if restored is not None:
        state, meta, _ = restored
        return _Start(
            params=state["params"],
            opt_state=state["opt_state"],
            step=int(meta["step"]),
            init_source=meta.get("init_from"),
            allocation=meta.get("bf16_allocation"),
            meta=meta,
        )
    params, source = st.params, None
    if init is not None:
        params, source = _init_params(cfg, st, *init), init[1].to_dict()
    return _Start(
        params=params, opt_state=st.opt_state, step=0, init_source=source, allocation=None, meta={}
    )


def _check_divisible(cfg: TrainConfig, mesh) -> None:
    """Raise ValueError when a micro-batch or an eval batch does not split evenly over the
    mesh's data-parallel ways."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.data.batch_size // cfg.data.grad_accum
    eval_rows = cfg.data.eval_batch_size or cfg.data.batch_size
    for what, rows in (
        ("data.batch_size / data.grad_accum", micro),
        ("data.eval_batch_size (or batch_size)", eval_rows),
    ):
        if rows % dp:
            raise ValueError(
                f"{what} = {rows} is not divisible by the data-parallel ways "
                f"mesh.data * mesh.fsdp = {dp}"
            )


def _announce(
    cfg: TrainConfig,
    logger: MetricsLogger,
    prec: Precision,
    begin: _Start,
    *,
    warmup_end: int,
    out: Path,
) -> None:
    """The start's first records and messages: init_from, the precision, the resume."""
    start = begin.step
    if begin.init_source is not None and not start:
        logger.log({"kind": "event", "event": "init_from", "step": 0, "source": begin.init_source})
        logger.message(f"init_from: {begin.init_source['note']}")
    # recipes, not names: a rules file may hold custom recipes (QAT on a quantize output)
    start_rules = prec.st.rules["warmup" if start < warmup_end else "main"]
    q_blocks, hp_blocks = quantized_blocks(
        {p: start_rules.resolve(p) for p, _ in iter_linears(prec.model("main", begin.params))}
    )
    logger.log(
        {
            "kind": "event",
            "event": "precision",
            "step": start,
            "quantized_blocks": q_blocks,
            "high_precision_blocks": hp_blocks,
        }
    )
    if cfg.init_from is not None:
        m = cfg.model
        logger.message(
            f"model from {cfg.init_from}: {m.family}, {m.num_params() / 1e6:.1f}M parameters; "
            f"remat={m.remat}, scan_layers={m.scan_layers}, loss_chunk={m.loss_chunk}, "
            f"attention_chunk={m.attention_chunk} (change with model.<key>=)"
        )
    what = cfg.recipe if cfg.precision.rules is None else f"rules {cfg.precision.rules}"
    if start < warmup_end:
        what = f"{cfg.recipe} after a {warmup_end}-step bf16 warm-up; warm-up"
    logger.message(
        f"{what}: {len(q_blocks)} of {len(q_blocks) + len(hp_blocks)} "
        f"blocks quantized" + (f"; blocks {hp_blocks} in high precision" if hp_blocks else "")
    )
    if start:
        logger.log(
            {
                "kind": "event",
                "event": "resume",
                "step": start,
                "tokens": start * cfg.tokens_per_step,
            }
        )
        logger.message(f"resumed from {out / TrainingRun.CHECKPOINTS} at step {start}")


def _eval_batches(data, mesh) -> dict[str, list]:
    """The fixed validation batches of every eval set, on the devices."""
    val_sets = {
        name: data.val_batches(
            name, process_index=jax.process_index(), process_count=jax.process_count()
        )
        for name in data.eval_sets()
    }
    return {name: [shard_batch(mesh, b, EVAL_SPEC) for b in arr] for name, arr in val_sets.items()}


def _facts(cfg: TrainConfig, out: Path, data, mesh, *, names, late_start: int | None) -> RunFacts:
    """What the summary reports of a run on ``data`` (``names``: its eval sets)."""
    return RunFacts(
        cfg=cfg,
        out=out,
        n_params=cfg.model.num_params(),
        corpus_hash=data.corpus.content_hash,
        entropy={name: data.unigram_entropy(name) for name in names},
        late_switch_step=late_start,
        mesh_shape=dict(mesh.shape),
        data={k: v for k, v in data.describe().items() if k != "config"},
    )


def _train_steps(run: _Run, clock: Clock, prec: Precision, params, opt_state) -> _End:
    """The steps from ``run.start`` to ``cfg.steps`` from ``params`` / ``opt_state`` in
    ``prec``, with their evaluations and checkpoints. Each step's metrics are read back one
    step late (the host never stalls the device), and at once before a phase change, an
    evaluation or a checkpoint."""
    cfg = run.cfg
    clock.win_t0 = time.perf_counter()
    if (
        cfg.precision.spec.chosen_in_run
        and prec.allocation is None
        and run.start >= run.phases.warmup_end
    ):  # resumed from the checkpoint taken just before the choice
        prec = _choose_allocation(run, prec, params, run.start)
    last_eval = _evaluate(run, prec, params, 0) if run.start == 0 and cfg.eval_every else None
    # the first step of a compiled program: compile time, not throughput
    compiling = {run.start, cfg.switch_step, run.phases.warmup_end}
    pending: tuple[int, dict] | None = None  # (batch index, metrics) not read back yet
    clock.t_prev = time.perf_counter()
    try:
        with run.batcher.iterate(
            run.start, cfg.steps - run.start, prefetch=cfg.data.prefetch, microbatches=True
        ) as it:
            for idx, batch in it:
                phase = run.phases.of(idx)
                if phase != prec.phase:
                    if pending is not None:
                        _read_back(run, clock, *pending, compiling=compiling)
                        pending = None
                    prec = _change_phase(run, clock, prec, params, phase, idx)
                params, opt_state, m = _train_step(run, prec, params, opt_state, batch, idx)
                if pending is not None:
                    _read_back(run, clock, *pending, compiling=compiling)
                pending = (idx, m)
                step = idx + 1
                do_eval = cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps
                do_ckpt = (
                    cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                ) or step == cfg.steps
                if do_eval or do_ckpt:
                    _read_back(run, clock, *pending, compiling=compiling)
                    pending = None
                    t0 = time.perf_counter()
                    if do_eval:
                        last_eval = _evaluate(run, prec, params, step)
                    if do_ckpt:
                        _save(run, clock, prec, params, opt_state, step)
                    clock.pause(time.perf_counter() - t0)
            if pending is not None:
                _read_back(run, clock, *pending, compiling=compiling)
    except _Abort as a:
        return _End(params=params, precision=prec, last_eval=last_eval, aborted_at=a.step)
    return _End(params=params, precision=prec, last_eval=last_eval)


def _train_step(run: _Run, prec: Precision, params, opt_state, batch, idx: int):
    """Batch ``idx`` trained in ``prec``'s phase: ``(params, opt_state, metrics)``."""
    cfg = run.cfg
    args = [
        params,
        opt_state,
        prec.st.rest,
        shard_batch(prec.st.mesh, batch, BATCH_SPEC),
        jnp.int32(idx),
    ]
    if cfg.inject_nonfinite_steps:
        args.append(jnp.bool_(idx + 1 in cfg.inject_nonfinite_steps))
    return prec.programs.train[prec.phase](*args)


def _save(run: _Run, clock: Clock, prec: Precision, params, opt_state, step: int) -> None:
    """The checkpoint of ``step``: the weights, the optimizer state and their metadata."""
    run.ckpt.save(
        step,
        {"params": params, "opt_state": opt_state},
        checkpoint_meta(
            run.cfg,
            clock,
            step,
            phase=run.phases.of(step),
            init_source=run.init_source,
            allocation=prec.allocation,
        ),
    )


def _choose_allocation(run: _Run, prec: Precision, params, step: int) -> Precision:
    """:func:`~microscale.train.phases.choose_allocation` on the run's training split."""
    return choose_allocation(
        prec,
        params,
        step,
        train_tokens=run.data.corpus.train,
        logger=run.logger,
        rules_out=run.rules_out,
    )


def _change_phase(
    run: _Run, clock: Clock, prec: Precision, params, phase: str, idx: int
) -> Precision:
    """``prec`` leaving its phase for ``phase`` at batch ``idx``: after a warm-up the
    sensitivity choice (excluded from the clocks), then the new phase."""
    if prec.phase == "warmup" and run.cfg.precision.spec.chosen_in_run:
        t0 = time.perf_counter()
        prec = _choose_allocation(run, prec, params, idx)
        clock.pause(time.perf_counter() - t0)
    return enter_phase(prec, phase, idx, logger=run.logger)


def _read_back(run: _Run, clock: Clock, idx: int, metrics: dict, *, compiling: set[int]) -> None:
    """Account for batch ``idx``'s ``metrics`` (fetched from the device now): the clock,
    a non-finite event (:class:`_Abort` after too many in a row), the progress display and,
    every ``log_every`` steps, a ``"train"`` record."""
    cfg, logger = run.cfg, run.logger
    m = jax.device_get(metrics)
    now = time.perf_counter()
    clock.tick(now, run.tps, compiling=idx in compiling)
    step = idx + 1
    loss, gnorm, lr = float(m["loss"]), float(m["grad_norm"]), float(m["lr"])
    finite = bool(m["finite"])
    clock.count(step, loss, finite=finite, keep=max(cfg.log_every, 10))
    if not finite:
        logger.log(
            {
                "kind": "event",
                "event": "nonfinite",
                "step": step,
                "loss": loss,
                "grad_norm": gnorm,
                "streak": clock.streak,
                "total": clock.nonfinite_total,
            }
        )
        logger.message(
            f"step {step}: non-finite loss/gradient (loss={loss}, "
            f"grad_norm={gnorm}); update skipped ({clock.streak} in a row)"
        )
        if clock.streak >= cfg.max_nonfinite_in_a_row:
            raise _Abort(step)
    clock.win_tokens += run.tps
    logger.progress(step)
    if step % cfg.log_every == 0 or step == cfg.steps:
        loss_avg, rate = clock.end_window(now)
        logger.log(
            {
                "kind": "train",
                "step": step,
                "loss": loss,
                "loss_avg": loss_avg,
                "lr": lr,
                "grad_norm": gnorm,
                "tokens": step * run.tps,
                "tokens_per_s": rate,
                "nonfinite": clock.nonfinite_total,
                "phase": run.phases.of(idx),
                "time": now - clock.t_start,
            }
        )
        logger.progress(step, loss=loss, tokens_per_s=rate, lr=lr)


def _evaluate(run: _Run, prec: Precision, params, step: int) -> dict[str, Any]:
    """:func:`evaluate` of ``params`` at ``step`` in ``prec``'s phase, logged and displayed."""
    rec = evaluate(
        prec.programs.eval[prec.phase],
        params,
        prec.st.rest,
        run.val,
        prec.st.graphdefs[prec.phase],
        step=step,
        tokens=step * run.tps,
        phase=prec.phase,
    )
    run.logger.log(rec)
    run.logger.progress(step, val_loss=rec["val_loss"], force=True)
    return rec


def checkpoint_meta(
    cfg: TrainConfig,
    clock: Clock,
    step: int,
    *,
    phase: str,
    init_source: dict | None,
    allocation: dict | None,
) -> dict[str, Any]:
    """The metadata saved with the checkpoint of ``step`` (trained in ``phase``): what an
    exact resume needs besides the weights (the counters, the phase, the allocation) and
    the config."""
    return {
        "step": step,
        "data_step": step,
        "tokens": step * cfg.tokens_per_step,
        "nonfinite_total": clock.nonfinite_total,
        "nonfinite_streak": clock.streak,
        "phase": phase,
        "train_time_s": clock.train_time,
        "recipe": cfg.recipe,
        "microscale_version": __version__,
        "init_from": init_source,
        "bf16_allocation": allocation,
        "config": to_dict(cfg),
    }


def _summary(run: _Run, clock: Clock, end: _End, status: str, **extra) -> dict[str, Any]:
    """:func:`write_summary` of ``run`` ended at ``end`` (written by the main process only)."""
    return write_summary(
        run.out / TrainingRun.SUMMARY if run.main else None,
        status,
        facts=run.facts,
        clock=clock,
        last_eval=end.last_eval,
        precision=assignments(end.precision.model("main", end.params)),
        init_source=run.init_source,
        allocation=end.precision.allocation,
        **extra,
    )


def _abort(run: _Run, clock: Clock, end: _End) -> None:
    """Too many non-finite steps in a row ending at ``end.aborted_at``: log it, write the
    ``"aborted"`` summary and raise :class:`TrainingAborted`."""
    cfg, out, logger, step = run.cfg, run.out, run.logger, end.aborted_at
    run.ckpt.wait()  # an asynchronous save of the last good step finishes first
    good = run.ckpt.latest_step()
    msg = (
        f"training aborted at step {step}: {cfg.max_nonfinite_in_a_row} non-finite "
        f"losses/gradients in a row (max_nonfinite_in_a_row="
        f"{cfg.max_nonfinite_in_a_row}); their updates were skipped. "
        + (
            f"The last good checkpoint is step {good} in {out / TrainingRun.CHECKPOINTS} "
            "(resume=true continues from it). "
            if good is not None
            else "No checkpoint was saved before the failure. "
        )
        + "Try a lower optim.lr, more bf16 blocks (precision.bf16_last=...) or another recipe."
    )
    logger.log({"kind": "event", "event": "abort", "step": step, "message": msg})
    logger.message(msg)
    logger.close()
    summary = _summary(run, clock, end, "aborted", error=msg, last_good_checkpoint=good)
    raise TrainingAborted(msg, summary) from None


def _finish(run: _Run, clock: Clock, end: _End, *, progress: bool) -> dict[str, Any]:
    """The final evaluation (unless the last step had one), the last checkpoint written,
    the ``"completed"`` summary and the closing line."""
    try:
        if end.last_eval is None or end.last_eval["step"] != clock.step:
            last = _evaluate(run, end.precision, end.params, clock.step)
            end = dataclasses.replace(end, last_eval=last)
        run.ckpt.wait()
    finally:
        run.logger.close()
    summary = _summary(run, clock, end, "completed")
    if run.main and progress:
        ent = run.facts.entropy["val"]
        val = summary["final_val_loss"]
        print(
            f"done: {run.cfg.recipe} val_loss {val:.4f} (unigram entropy {ent:.4f}), "
            f"{summary['tokens']:,} tokens, {summary['tokens_per_s'] or 0:,.0f} tok/s, "
            f"{format_duration(summary['wall_time_s'])} -> {run.out}",
            flush=True,
        )
    return summary


class _Abort(Exception):
    """Raised by :func:`_read_back` when too many non-finite steps came in a row."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step

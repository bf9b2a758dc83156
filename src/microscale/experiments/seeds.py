"""Seeds batched in one compiled program: ``microscale compare``'s replicates, trained at once.

A comparison's replicates are runs of one config that differ only in their seeds
(``seed``: the initialisation and the recipes' randomness; ``data.seed``: the batch order).
At the compare presets' size (0.16M parameters) a step's GEMMs are far too small to fill a
CPU, so a run pays dispatch and small-kernel overhead at every step. :func:`train_seeds`
trains S such runs as **one** program instead:

* the S runs' float32 parameters, AdamW states and batches are stacked along a leading seed
  axis, and the trainer's own step (:func:`~microscale.train.step.train_step_fn`, the
  function ``microscale train`` compiles) is ``jax.vmap``-ed over that axis, with each
  run's seed an argument of the step: every run keeps its own initialisation
  (:func:`~microscale.train.build_state` of its config), data order (its ``data.seed``'s
  batcher), stochastic-rounding and Hadamard keys (``fold_in(key(seed), step)``) and
  optimizer state;
* ``vmap`` adds a batch dimension to every operation and never reduces across it: the
  quantizers' amax, the loss mean, the gradient norm and the non-finite test are each per
  seed (one seed's bad step is skipped for that seed alone). What can change is the
  summation order *inside* a seed's reductions, because XLA may pick another kernel for a
  batched GEMM than for the unbatched one; ``tests/experiments/test_seeds.py`` measures it
  per recipe against each seed's own ``microscale train`` run;
* the validation batches are the same for every seed (the held-out split does not depend
  on the seeds) and are evaluated by the vmapped eval step.

Each run writes the folder ``microscale train`` would: ``config.yaml``,
``precision_rules.json``, ``tokenizer.json``, ``metrics.jsonl``, the final checkpoint and
``summary.json`` (plus ``"seed_batch"``: S, and its ``tokens_per_s`` is the run's own
tokens over the batch's time, so S runs' throughput is S times it). The report, ``resume``
and ``init_from=`` read it like any other run. A batch saves checkpoints only at the end:
an interrupted batch starts again from step 0 (a batch is minutes long at this size).

Memory: a batch of S needs about S times one run's bytes (:func:`seed_batch_size`, from
the shapes, :func:`microscale.plan.run.shape_memory`); the compiled program's own memory
analysis is checked again before the first step, and a batch that does not fit is refused
then, naming both sizes. Batches are for runs on one device with one phase; the rest
(:func:`why_not_batched`) train one by one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.config import dump_yaml, to_dict
from microscale.data import check_vocab_fits, load_data
from microscale.data.batching import PrefetchIterator
from microscale.files import check_output_dir, lock_folder
from microscale.model import assignments
from microscale.outputs import TrainingRun
from microscale.plan.run import shape_memory
from microscale.progress import Progress
from microscale.train import TrainConfig, build_mesh
from microscale.train.checkpoint import Checkpointer
from microscale.train.loop import Clock, RunFacts, checkpoint_meta, eval_record, write_summary
from microscale.train.metrics import MetricsLogger
from microscale.train.optim import lr_schedule
from microscale.train.state import build_state
from microscale.train.step import eval_step_fn, train_step_fn

__all__ = ["available_memory", "seed_batch_size", "train_seeds", "why_not_batched"]

# Share of the available memory a seed batch may plan to use (the rest: the host's own
# arrays, XLA's workspace the shape count does not see).
MEMORY_SHARE = 0.8
# The most seeds one batch takes when the size is left to memory (seed_batch=0): on a
# 2-core CPU a 6-seed batch trains at the sequential runs' tokens/s and a 20-seed one at
# 0.60x of it (benchmarks/timings.md, "Seed batches"), so larger batches are asked for.
AUTO_MAX = 6


def _without_seeds(cfg: TrainConfig) -> str:
    """``cfg`` with the fields a replicate changes blanked, as comparable text."""
    c = dataclasses.replace(
        cfg, seed=0, out=None, resume=False, data=dataclasses.replace(cfg.data, seed=0)
    )
    return json.dumps(to_dict(c), sort_keys=True)


def why_not_batched(cfgs: Sequence[TrainConfig]) -> str | None:
    """Why the runs ``cfgs`` cannot train as one seed batch, or None when they can: they
    must differ only in ``seed``, ``data.seed`` and ``out``, run on one device, and have
    one phase (no bf16 warm-up, late switch or in-run sensitivity choice), no
    ``init_from`` and no injected non-finite steps."""
    if not cfgs:
        return "no runs"
    ref = _without_seeds(cfgs[0])
    for c in cfgs[1:]:
        if _without_seeds(c) != ref:
            return f"runs {cfgs[0].out} and {c.out} differ in more than seed and data.seed"
    c = cfgs[0]
    reasons = {
        f"precision.kind={c.precision.kind!r} (chosen in the run)": c.precision.spec.chosen_in_run,
        "precision.warmup > 0 (a bf16 warm-up phase)": c.warmup_steps > 0,
        "precision.late.fraction > 0 (a late switch)": c.precision.late.fraction > 0,
        "init_from is set": c.init_from is not None,
        "inject_nonfinite_steps is set": bool(c.inject_nonfinite_steps),
    }
    for why, applies in reasons.items():
        if applies:
            return why
    n = build_mesh(c.mesh).devices.size
    return None if n == 1 else f"the mesh has {n} devices (seed batches run on one)"


def available_memory() -> int:
    """Bytes a program may use now: the accelerator's limit, or the host's MemAvailable."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _run_bytes(cfg: TrainConfig) -> float:
    """One run's bytes on one device, from the shapes (parameters, AdamW, gradients,
    activations)."""
    return float(shape_memory(cfg, {"data": 1, "fsdp": 1, "tensor": 1})["bytes"]["total"])


def seed_batch_size(cfg: TrainConfig, n: int, *, requested: int = 0, memory: int | None = None):
    """How many of ``n`` replicates of ``cfg`` train as one batch: ``requested`` (0: as many
    as fit in ``MEMORY_SHARE`` of ``memory``, default :func:`available_memory`, at most
    `AUTO_MAX`), at most ``n``. Raises ValueError, naming the sizes, when ``requested`` seeds do not fit."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"seed_batch={requested!r}: expected an int >= 0 (0: as many as fit)")
    budget = MEMORY_SHARE * (available_memory() if memory is None else memory)
    per = _run_bytes(cfg)
    fit = int(budget // per)
    if requested:
        if requested * per > budget:
            raise ValueError(
                f"seed_batch={requested}: {requested} runs of this model need about "
                f"{_gb(requested * per)} (one run: {_gb(per)}), more than {_gb(budget)} "
                f"({MEMORY_SHARE:.0%} of the {_gb(budget / MEMORY_SHARE)} available); use "
                f"seed_batch={max(fit, 1)} or fewer"
            )
        return min(requested, n)
    return max(1, min(n, fit, AUTO_MAX))


def _gb(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


@dataclasses.dataclass(kw_only=True)
class _Replicate:
    """One run of the batch: its files, counters and log."""

    # The run's config.
    cfg: TrainConfig
    # The run folder.
    out: Path
    # Its counters and timers.
    clock: Clock
    # Its metrics.jsonl / TensorBoard writer.
    logger: MetricsLogger
    # What its summary reports that does not change.
    facts: RunFacts
    # The latest "eval" record.
    last_eval: dict | None = None
    # Set when the run was aborted (too many non-finite steps in a row): its summary.
    aborted: dict | None = None


def train_seeds(
    cfgs: Sequence[TrainConfig],
    *,
    progress: bool = True,
    callbacks: Sequence[Callable[[int, dict], None]] | None = None,
    memory: int | None = None,
) -> list[dict[str, Any]]:
    """Train the runs ``cfgs`` (replicates: :func:`why_not_batched` is None) as one seed
    batch; return their summaries in order.

    ``callbacks``: called with ``(index of the run in cfgs, record)`` for every metrics
    record of every run. ``memory``: the bytes to plan for (default
    :func:`available_memory`). Raises ValueError when the runs cannot be batched or the
    compiled batch does not fit, ``FileExistsError`` when a run folder already holds
    checkpoints.
    """
    why = why_not_batched(cfgs)
    if why is not None:
        raise ValueError(f"these runs cannot train as one seed batch: {why}")
    seed_batch_size(cfgs[0], len(cfgs), requested=len(cfgs), memory=memory)
    named = [c.out for c in cfgs if c.out is not None]
    if len(set(named)) != len(cfgs):
        raise ValueError(
            f"each run of a seed batch needs its own out=; got {[c.out for c in cfgs]}"
        )
    outs = [check_output_dir(out, what="out=") for out in named]
    with contextlib.ExitStack() as stack:
        for out in outs:
            out.mkdir(parents=True, exist_ok=True)
            stack.enter_context(lock_folder(out))
            ckpts = out / TrainingRun.CHECKPOINTS
            if ckpts.is_dir() and any(ckpts.iterdir()):
                raise FileExistsError(
                    f"{out} already holds checkpoints: a seed batch starts its runs from "
                    "step 0; resume that run alone (microscale train resume=true) or remove it"
                )
        return _train_batch(list(cfgs), outs, progress, list(callbacks or []), memory)


@dataclasses.dataclass(kw_only=True)
class _Batch:
    """The seed batch's compiled programs and stacked state."""

    # The first run's state (graph, rules, optimizer, mesh); every run shares its graph.
    st: Any
    # The stacked float32 parameters, AdamW states and non-parameter state ([S, ...]).
    params: Any
    opt_state: Any
    rest: Any
    # int32 [S]: each run's seed (its keys).
    seeds: jax.Array
    # The compiled vmapped train step (params, opt_state, rest, batch, step, seeds).
    step: Callable
    # The vmapped eval step (params, rest, batch, seeds) -> [S] losses.
    eval: Callable
    # Each run's training batcher (its data.seed).
    batchers: list


def _build_batch(cfgs: list[TrainConfig], data, memory: int | None) -> _Batch:
    """Each run's state (:func:`~microscale.train.build_state` of its own config), stacked,
    and the vmapped steps, compiled and checked against the memory."""
    cfg = cfgs[0]
    states = [build_state(c, build_mesh(cfg.mesh)) for c in cfgs]
    st = states[0]
    graphdef = st.graphdefs["main"]
    step_fn = train_step_fn(graphdef, st.tx, lr_schedule(cfg.optim, cfg.steps))
    ev = eval_step_fn(graphdef)
    batch = _Batch(
        st=st,
        params=_stack([x.params for x in states]),
        opt_state=_stack([x.opt_state for x in states]),
        rest=_stack([nnx.to_pure_dict(x.rest) for x in states]),
        seeds=jnp.asarray([c.seed for c in cfgs], jnp.int32),
        step=jax.jit(
            jax.vmap(
                lambda p, o, r, b, t, k: step_fn(p, o, nnx.State(r), b, t, k),
                in_axes=(0, 0, 0, 0, None, 0),
            ),
            donate_argnums=(0, 1),
        ),
        eval=jax.jit(
            jax.vmap(lambda p, r, b, k: ev(p, nnx.State(r), b, k), in_axes=(0, 0, None, 0))
        ),
        batchers=[
            dataclasses.replace(
                data, config=dataclasses.replace(data.config, seed=c.data.seed)
            ).train_batcher()
            for c in cfgs
        ],
    )
    example = _batch_at(batch, 0)
    args = (batch.params, batch.opt_state, batch.rest, example, jnp.int32(0), batch.seeds)
    batch.step = batch.step.lower(*args).compile()  # type: ignore[attr-defined]  # a jax.jit function
    _check_compiled_fits(batch.step, len(cfgs), memory)
    return batch


def _batch_at(batch: _Batch, t: int) -> np.ndarray:
    """int32 ``[S, grad_accum, micro, seq_len + 1]``: every run's batch of step ``t``."""
    return np.stack([b.microbatches_at(t) for b in batch.batchers])


def _evaluate(batch: _Batch, reps: list[_Replicate], val: dict, step: int) -> None:
    """Every live run's ``"eval"`` record at ``step``, logged; the clocks paused for it."""
    t0 = time.perf_counter()
    per = {
        name: np.asarray(
            jax.device_get([batch.eval(batch.params, batch.rest, b, batch.seeds) for b in bs])
        )
        for name, bs in val.items()
    }
    for i, r in enumerate(reps):
        if r.aborted is None:
            model = nnx.merge(
                batch.st.graphdefs["main"], nnx.State(_unstack(batch.params, i)), batch.st.rest
            )
            r.last_eval = eval_record(
                {name: [float(v) for v in a[:, i]] for name, a in per.items()},
                model,
                step=step,
                tokens=step * r.cfg.tokens_per_step,
                phase="main",
                seconds=time.perf_counter() - t0,
            )
            r.logger.log(r.last_eval)
    for r in reps:
        r.clock.pause(time.perf_counter() - t0)


def _train_batch(cfgs, outs, progress, callbacks, memory) -> list[dict[str, Any]]:
    """Build, then train every step (metrics read back one step late, as the trainer does),
    evaluating every ``eval_every`` steps and at the end; then each run's files."""
    t_start = time.perf_counter()
    cfg = cfgs[0]
    data = load_data(cfg.data)
    check_vocab_fits(data.vocab_size, cfg.model.vocab_size, what=f"data.corpus={cfg.data.corpus!r}")
    batch = _build_batch(cfgs, data, memory)
    reps = _start_replicates(cfgs, outs, data, batch.st, t_start, callbacks)
    val = {name: [jnp.asarray(b) for b in data.val_batches(name)] for name in data.eval_sets()}
    bar = Progress(cfg.steps, f"{cfg.recipe} x{len(cfgs)}", unit="step", show=progress)
    for r in reps:
        r.clock.win_t0 = r.clock.t_prev = time.perf_counter()
    if cfg.eval_every:
        _evaluate(batch, reps, val, 0)
    pending: tuple[int, Any] | None = None
    it = PrefetchIterator(
        functools.partial(_batch_at, batch), 0, cfg.steps, prefetch=cfg.data.prefetch
    )
    with contextlib.closing(it):
        for idx, tokens in it:
            batch.params, batch.opt_state, m = batch.step(
                batch.params, batch.opt_state, batch.rest, tokens, jnp.int32(idx), batch.seeds
            )
            if pending is not None:
                _read_back(reps, *pending, compiling=pending[0] == 0)
            pending = (idx, m)
            bar.update(1)
            step = idx + 1
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                _read_back(reps, *pending, compiling=pending[0] == 0)
                pending = None
                _evaluate(batch, reps, val, step)
    bar.close()
    return [
        _finish(r, _unstack(batch.params, i), _unstack(batch.opt_state, i), batch.st, len(cfgs))
        for i, r in enumerate(reps)
    ]


def _check_compiled_fits(compiled, s: int, memory: int | None) -> None:
    """Refuse the compiled batch when XLA's own count of its bytes exceeds the budget."""
    mem = compiled.memory_analysis()
    if mem is None:
        return
    peak = sum(
        int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp")
    ) - int(getattr(mem, "alias_size_in_bytes", 0) or 0)
    budget = MEMORY_SHARE * (available_memory() if memory is None else memory)
    if peak > budget:
        raise ValueError(
            f"a batch of {s} seeds compiles to a program of {_gb(peak)}, more than "
            f"{_gb(budget)} ({MEMORY_SHARE:.0%} of the memory available); use a smaller "
            f"seed_batch (about {max(1, int(s * budget // peak))})"
        )


def _start_replicates(cfgs, outs, data, st, t_start, callbacks) -> list[_Replicate]:
    """Each run's startup files, logger and facts (as ``microscale train`` writes them)."""
    reps = []
    for i, (c, out) in enumerate(zip(cfgs, outs, strict=True)):
        dump_yaml(c, out / TrainingRun.CONFIG)
        st.rules["main"].save(out / TrainingRun.RULES)
        if data.tokenizer is not None:
            data.save_tokenizer(out / TrainingRun.TOKENIZER)
        logger = MetricsLogger(
            out,
            total_steps=c.steps,
            progress=False,
            tensorboard=c.tensorboard,
            callbacks=[functools.partial(_call_all, callbacks, i)],
            description=c.recipe,
        )
        facts = RunFacts(
            cfg=c,
            out=out,
            n_params=c.model.num_params(),
            corpus_hash=data.corpus.content_hash,
            entropy={name: data.unigram_entropy(name) for name in data.eval_sets()},
            late_switch_step=None,
            mesh_shape=dict(st.mesh.shape),
            data={k: v for k, v in data.describe().items() if k != "config"},
        )
        reps.append(
            _Replicate(
                cfg=c,
                out=out,
                clock=Clock.resumed({}, t_start=t_start, start=0),
                logger=logger,
                facts=facts,
            )
        )
    return reps


def _call_all(callbacks: Sequence[Callable[[int, dict], None]], i: int, rec: dict) -> None:
    for cb in callbacks:
        cb(i, rec)


def _read_back(reps: list[_Replicate], idx: int, metrics: dict, *, compiling: bool) -> None:
    """Each run's step-``idx`` metrics: its clock, its non-finite count (an aborted summary
    after ``max_nonfinite_in_a_row``), and every ``log_every`` steps a ``"train"`` record."""
    m = jax.device_get(metrics)
    now = time.perf_counter()
    step = idx + 1
    for i, r in enumerate(reps):
        if r.aborted is not None:
            continue
        cfg, clock = r.cfg, r.clock
        tps = cfg.tokens_per_step
        clock.tick(now, tps, compiling=compiling)
        loss, gnorm, lr = float(m["loss"][i]), float(m["grad_norm"][i]), float(m["lr"][i])
        finite = bool(m["finite"][i])
        clock.count(step, loss, finite=finite, keep=max(cfg.log_every, 10))
        if not finite:
            r.logger.log(
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
            if clock.streak >= cfg.max_nonfinite_in_a_row:
                _abort(r, step)
                continue
        clock.win_tokens += tps
        if step % cfg.log_every == 0 or step == cfg.steps:
            loss_avg, rate = clock.end_window(now)
            r.logger.log(
                {
                    "kind": "train",
                    "step": step,
                    "loss": loss,
                    "loss_avg": loss_avg,
                    "lr": lr,
                    "grad_norm": gnorm,
                    "tokens": step * tps,
                    "tokens_per_s": rate,
                    "nonfinite": clock.nonfinite_total,
                    "phase": "main",
                    "time": now - clock.t_start,
                }
            )


def _summary(r: _Replicate, status: str, model, s: int, **extra) -> dict[str, Any]:
    return write_summary(
        r.out / TrainingRun.SUMMARY,
        status,
        facts=r.facts,
        clock=r.clock,
        last_eval=r.last_eval,
        precision=assignments(model),
        init_source=None,
        allocation=None,
        seed_batch=s,
        **extra,
    )


def _abort(r: _Replicate, step: int) -> None:
    msg = (
        f"training aborted at step {step}: {r.cfg.max_nonfinite_in_a_row} non-finite "
        "losses/gradients in a row (max_nonfinite_in_a_row); their updates were skipped. "
        "No checkpoint was saved (a seed batch saves at the end). Try a lower optim.lr, more "
        "bf16 blocks (precision.bf16_last=...) or another recipe."
    )
    r.logger.log({"kind": "event", "event": "abort", "step": step, "message": msg})
    r.logger.close()
    r.aborted = {"error": msg, "last_good_checkpoint": None}


def _finish(r: _Replicate, params, opt_state, st, s: int) -> dict[str, Any]:
    """The run's final checkpoint and its summary (``"aborted"`` when it was)."""
    model = nnx.merge(st.graphdefs["main"], nnx.State(params), st.rest)
    if r.aborted is not None:
        return _summary(r, "aborted", model, s, **r.aborted)
    step = r.clock.step
    ckpt = Checkpointer(r.out / TrainingRun.CHECKPOINTS, keep=r.cfg.keep_checkpoints)
    try:
        ckpt.save(
            step,
            {"params": params, "opt_state": opt_state},
            checkpoint_meta(r.cfg, r.clock, step, phase="main", init_source=None, allocation=None),
        )
        ckpt.wait()
    finally:
        ckpt.close()
        r.logger.close()
    return _summary(r, "completed", model, s)

"""The run's precision phases and the change from one to the next.

A run trains in up to three phases, each its own compiled program: an all-bf16
``"warmup"`` (``precision.warmup``), ``"main"``, and ``"late"`` (the late precision
switch, ``precision.late``). :class:`Phases` says which phase trains each step;
:class:`Precision` is the phase training now and what trains it (every phase's model
graph and rules, their compiled steps of ``step.py``, the ``bf16_allocation``).

A phase change returns a new :class:`Precision` and mutates nothing:
:func:`start_precision` is the precision of a run's first step (a resumed run's restored
allocation recompiled), :func:`choose_allocation` the end of a
``precision.kind=sensitivity`` warm-up (the choice of :mod:`~microscale.train.adaptive`,
recompiled, saved and logged), :func:`enter_phase` the step into the next phase (its
event logged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from microscale.model import PrecisionRules
from microscale.outputs import TrainingRun
from microscale.train.adaptive import bf16_rules, choose_bf16_layers
from microscale.train.config import TrainConfig
from microscale.train.mesh import BATCH_AXES
from microscale.train.metrics import MetricsLogger
from microscale.train.optim import lr_schedule
from microscale.train.state import _State
from microscale.train.step import make_eval_step, make_train_step

__all__ = [
    "BATCH_SPEC",
    "EVAL_SPEC",
    "Phases",
    "Precision",
    "Programs",
    "choose_allocation",
    "compile_programs",
    "enter_phase",
    "save_rules",
    "start_precision",
]

BATCH_SPEC = PartitionSpec(None, BATCH_AXES, None)  # [grad_accum, micro, seq_len + 1]
EVAL_SPEC = PartitionSpec(BATCH_AXES, None)  # [rows, seq_len + 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phases:
    """Which phase (compiled program) trains each step: an all-bf16 ``"warmup"`` first
    (``precision.warmup``), then ``"main"``, then ``"late"`` (the late
    precision switch)."""

    # First step after the all-bf16 warm-up (0: no warm-up).
    warmup_end: int
    # First step of the late high-precision phase (None: no late switch).
    late_start: int | None

    @classmethod
    def of_run(cls, cfg: TrainConfig, graphdefs: dict[str, Any]) -> Phases:
        """The phases of ``cfg`` (``graphdefs``: the phases its state was built with)."""
        return cls(
            warmup_end=cfg.warmup_steps, late_start=cfg.switch_step if "late" in graphdefs else None
        )

    def of(self, step: int) -> str:
        """The phase that trains batch ``step`` (0-based)."""
        if step < self.warmup_end:
            return "warmup"
        return "late" if self.late_start is not None and step >= self.late_start else "main"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Programs:
    """The compiled train and eval steps of every phase (``step.py``)."""

    # phase -> step(params, opt_state, rest, batch, step[, poison]) (make_train_step)
    train: dict[str, Callable]
    # phase -> eval(params, rest, batch) -> mean loss (make_eval_step)
    eval: dict[str, Callable]


def compile_programs(st: _State) -> Programs:
    """The train / eval steps of every phase of ``st`` (jitted; they compile on first use)."""
    cfg, mesh = st.cfg, st.mesh
    schedule = lr_schedule(cfg.optim, cfg.steps)
    inject = bool(cfg.inject_nonfinite_steps)
    train_fns, eval_fns = {}, {}
    for ph, g in st.graphdefs.items():
        train_fns[ph] = make_train_step(
            g,
            st.tx,
            schedule,
            seed=cfg.seed,
            inject=inject,
            param_shardings=st.param_shardings,
            opt_shardings=st.opt_shardings,
            batch_sharding=NamedSharding(mesh, BATCH_SPEC),
        )
        eval_fns[ph] = make_eval_step(
            g,
            seed=cfg.seed,
            param_shardings=st.param_shardings,
            batch_sharding=NamedSharding(mesh, EVAL_SPEC),
        )
    return Programs(train=train_fns, eval=eval_fns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """The phase that trains now and what trains it. A phase change returns a new one."""

    # The phase of the latest step (that of the start step before the first).
    phase: str
    # The trainer state whose model graphs and rules (per phase) these are; a change of
    # the rules returns a copy with new ones (mesh, shardings, optimizer shared).
    st: _State
    # The compiled steps of every phase of `st`.
    programs: Programs
    # The bf16_allocation record (precision.kind=sensitivity), None until chosen.
    allocation: dict | None

    def model(self, phase: str, params):
        """The model of ``phase`` holding ``params``."""
        return nnx.merge(self.st.graphdefs[phase], nnx.State(params), self.st.rest)


def _with_main_rules(st: _State, main: PrecisionRules) -> _State:
    """A copy of ``st`` whose main (and late) phase trains with ``main``; ``st`` is left
    as it is."""
    new = dataclasses.replace(st)
    new.set_main_rules(main)
    return new


def start_precision(st: _State, phase: str, allocation: dict | None) -> Precision:
    """The precision of a start in ``phase``: ``st``'s rules, or those of a restored
    ``allocation``."""
    if allocation:
        st = _with_main_rules(st, bf16_rules(st.cfg.recipe, allocation["bf16_layers"]))
    return Precision(phase=phase, st=st, programs=compile_programs(st), allocation=allocation)


def save_rules(st: _State, out: Path | None) -> None:
    """``precision_rules.json`` (and ``precision_rules_late.json``) from ``st``'s rules,
    in ``out`` (None: not written, a process other than the main one)."""
    if out is not None:
        st.rules["main"].save(out / TrainingRun.RULES)
        if "late" in st.rules:
            st.rules["late"].save(out / "precision_rules_late.json")


def choose_allocation(
    prec: Precision,
    params,
    step: int,
    *,
    train_tokens,
    logger: MetricsLogger,
    rules_out: Path | None,
) -> Precision:
    """``precision.kind=sensitivity`` at the end of the warm-up (batch ``step``): measure the
    warmed-up model (``params``) on ``train_tokens``, choose the bf16 layers; the precision
    recompiled with them, its rules saved in ``rules_out`` (see :func:`save_rules`) and the
    choice logged."""
    cfg = prec.st.cfg
    rules, allocation = choose_bf16_layers(prec.model("warmup", params), cfg, train_tokens)
    allocation["step"] = step
    st = _with_main_rules(prec.st, rules)
    new = dataclasses.replace(prec, st=st, programs=compile_programs(st), allocation=allocation)
    save_rules(st, rules_out)
    logger.log(
        {
            "kind": "event",
            "event": "bf16_allocation",
            "tokens": step * cfg.tokens_per_step,
            **allocation,
        }
    )
    logger.message(
        f"step {step}: {allocation['method']} sensitivity keeps "
        f"{len(allocation['bf16_layers'])} layers in bf16 "
        f"({allocation['bf16_flops']:.1%} of linear FLOPs, budget "
        f"{allocation['budget_bf16_flops']:.1%}): "
        + (", ".join(allocation["bf16_layers"]) or "none")
    )
    return new


def enter_phase(prec: Precision, phase: str, idx: int, *, logger: MetricsLogger) -> Precision:
    """``prec`` in ``phase`` from batch ``idx`` on, the change logged: the end of a warm-up
    before fixed rules, or the late switch. (A warm-up before a sensitivity choice ends with
    :func:`choose_allocation` first.)"""
    cfg = prec.st.cfg
    tokens = idx * cfg.tokens_per_step
    if prec.phase == "warmup" and not cfg.precision.spec.chosen_in_run:
        logger.log({"kind": "event", "event": "warmup_end", "step": idx, "tokens": tokens})
        logger.message(
            f"step {idx}: bf16 warm-up over; {cfg.recipe} with the positional bf16 blocks"
        )
    if phase == "late":
        logger.log(
            {
                "kind": "event",
                "event": "late_switch",
                "step": idx,
                "tokens": tokens,
                "bf16": cfg.precision.late.bf16,
            }
        )
        logger.message(
            f"step {idx}: late switch to high precision "
            f"(bf16: {cfg.precision.late.bf16}) for the last "
            f"{cfg.steps - idx} steps"
        )
    return dataclasses.replace(prec, phase=phase)
